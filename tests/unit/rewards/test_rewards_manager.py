"""RewardManager against hostile reward code: every failure costs one sample, never the run.

The hostile reward lives in a temporary file and picks its behaviour from ``solution_str``;
``"echo"`` samples score ``float(ground_truth)``, so a misplaced or lost result shows up as a
wrong number at a known index.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridflow.rewards.manager import RewardManager, ScoreRequest
from hybridflow.rewards.registry import UnknownDataSourceError
from hybridflow.rewards.worker import PRED_MAX_CHARS, STATUS_NONFINITE, STATUS_OK, classify

HOSTILE_REWARD = textwrap.dedent(
    """
    import math
    import os
    import subprocess
    import time

    _LEAK = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kind = solution_str
        if kind == "echo":
            return float(ground_truth)
        if kind == "raise":
            raise ValueError("boom")
        if kind == "sleep":
            time.sleep(3600)
        if kind == "nan":
            return math.nan
        if kind == "inf":
            return float("inf")
        if kind == "none":
            return None
        if kind == "str":
            return "abc"
        if kind == "no_score":
            return {"acc": 1}
        if kind == "exit":
            os._exit(3)
        if kind == "dict":
            return {"score": 0.25, "acc": True, "pred": "x", "steps": float(ground_truth)}
        if kind == "grandchild":
            child = subprocess.Popen(["sleep", "60"])
            with open(extra_info["pid_file"], "w") as handle:
                handle.write(str(child.pid))
            time.sleep(3600)
        if kind == "alloc":
            return len(b"x" * (extra_info["mb"] << 20))
        if kind == "leak":
            _LEAK.append(b"x" * (extra_info["mb"] << 20))
            return 1.0
        raise AssertionError(f"unknown kind {kind!r}")
    """
)

TIMEOUT_S = 0.5
# (kind, which metric counts it); the value is 1/4 in a batch of four.
HOSTILE_KINDS = [
    ("raise", "reward/error_rate"),
    ("exit", "reward/error_rate"),
    ("sleep", "reward/timeout_rate"),
    ("nan", "reward/nonfinite_rate"),
    ("inf", "reward/nonfinite_rate"),
    ("none", "reward/nonfinite_rate"),
    ("str", "reward/nonfinite_rate"),
    ("no_score", "reward/nonfinite_rate"),
]
RATES = ("reward/error_rate", "reward/timeout_rate", "reward/nonfinite_rate")


def echo(value: float) -> ScoreRequest:
    return ScoreRequest("test/echo", "echo", str(value))


def request(kind: str, **extra_info: object) -> ScoreRequest:
    return ScoreRequest("test/hostile", kind, "0", dict(extra_info))


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (a zombie awaiting a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.05)
    return process_gone(pid)


def wait_until_exited(pid: int, within_s: float) -> bool:
    """Until child ``pid`` has wholly exited (waitable, left unreaped). A SIGKILLed process shows
    as a zombie ('Z') while its other threads still exit, which is not yet "between rounds"."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def hostile_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("reward") / "hostile_reward.py"
    path.write_text(HOSTILE_REWARD)
    return str(path)


@pytest.fixture(scope="module")
def hostile(hostile_file: str) -> Iterator[RewardManager]:
    with RewardManager(hostile_file, "compute_score", timeout_s=TIMEOUT_S, memory_limit_mb=512) as manager:
        yield manager


@pytest.fixture(scope="module")
def builtin() -> Iterator[RewardManager]:
    with RewardManager(None, timeout_s=10.0) as manager:
        yield manager


# -- classify: the worker's reading of a return value -------------------------------------------


class _Scalar:
    def __float__(self) -> float:
        return 0.75


@pytest.mark.parametrize(
    ("value", "status", "score", "extra"),
    [
        (1.0, STATUS_OK, 1.0, {}),
        (True, STATUS_OK, 1.0, {}),
        (3, STATUS_OK, 3.0, {}),
        (_Scalar(), STATUS_OK, 0.75, {}),  # anything with __float__: numpy / 0-d tensor scalars
        (
            {"score": 0.5, "acc": False, "pred": "1/2", "n": 2, "bad": float("nan"), 7: 1.0},
            STATUS_OK,
            0.5,
            {"acc": 0.0, "pred": "1/2", "n": 2.0},  # numeric, finite, string-keyed extras; the answer text
        ),
        (float("nan"), STATUS_NONFINITE, 0.0, {}),
        (float("-inf"), STATUS_NONFINITE, 0.0, {}),
        (None, STATUS_NONFINITE, 0.0, {}),
        ("1.0", STATUS_NONFINITE, 0.0, {}),  # a string is never a score, even a numeric one
        ([1.0], STATUS_NONFINITE, 0.0, {}),
        ({"acc": 1}, STATUS_NONFINITE, 0.0, {}),
        ({"score": None}, STATUS_NONFINITE, 0.0, {}),
        ({"score": float("inf"), "acc": 1}, STATUS_NONFINITE, 0.0, {}),
        # Finite in float64 but inf in the float32 the trainer uses (or inf once squared by the
        # group statistics): garbage, counted like NaN, never a crash of the update.
        (1e308, STATUS_NONFINITE, 0.0, {}),
        (-1e30, STATUS_NONFINITE, 0.0, {}),
        ({"score": 1e20}, STATUS_NONFINITE, 0.0, {}),
        ({"score": 1e18, "big": 1e300, "ok": -2.5}, STATUS_OK, 1e18, {"ok": -2.5}),
        ({"score": 1.0, "pred": "x" * 500, "note": "text"}, STATUS_OK, 1.0, {"pred": "x" * PRED_MAX_CHARS}),
        ({"score": 1.0, "pred": 3}, STATUS_OK, 1.0, {"pred": 3.0}),  # a numeric answer is just a number
    ],
)
def test_classify(value: object, status: int, score: float, extra: dict[str, float]) -> None:
    got_status, got_score, got_extra, message = classify(value)
    assert (got_status, got_score, got_extra) == (status, score, extra)
    assert bool(message) == (status != STATUS_OK)


# -- hostile reward code ------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "metric"), HOSTILE_KINDS)
def test_a_hostile_sample_scores_zero_is_counted_and_the_batch_goes_on(
    hostile: RewardManager, kind: str, metric: str
) -> None:
    output = hostile.score([echo(1), request(kind), echo(2), echo(3)])
    assert output.scores == [1.0, 0.0, 2.0, 3.0]
    assert output.extra == [{}, {}, {}, {}]
    for name in RATES:
        assert output.metrics[name] == (0.25 if name == metric else 0.0), name
    # The manager is still healthy: a later batch scores normally.
    after = hostile.score([echo(4), echo(5)])
    assert after.scores == [4.0, 5.0]
    assert all(after.metrics[name] == 0.0 for name in RATES)


def test_a_hang_costs_one_timeout_and_a_restart(hostile: RewardManager) -> None:
    old_pids = hostile.worker_pids
    start = time.monotonic()
    output = hostile.score([echo(1), request("sleep"), echo(2), request("sleep"), echo(3)])
    elapsed = time.monotonic() - start
    assert output.scores == [1.0, 0.0, 2.0, 0.0, 3.0]
    assert output.metrics["reward/timeout_rate"] == pytest.approx(2 / 5)
    assert output.metrics["reward/worker_restarts"] == 2.0
    assert elapsed >= 2 * TIMEOUT_S
    assert elapsed < 2 * TIMEOUT_S + 20  # restarts take well under 10 s each
    assert all(wait_until_gone(pid, 5.0) for pid in old_pids)


def test_a_worker_killed_between_rounds_is_replaced_without_charging_a_sample(hostile: RewardManager) -> None:
    # The OOM killer or a stray kill between steps: no sample was running, so none may score 0.
    assert hostile.score([echo(1)]).scores == [1.0]
    for pid in hostile.worker_pids:
        os.kill(pid, signal.SIGKILL)
        assert wait_until_exited(pid, 5.0)
    output = hostile.score([echo(1), echo(2), echo(3)])
    assert output.scores == [1.0, 2.0, 3.0]
    assert output.metrics["reward/error_rate"] == 0.0
    assert output.metrics["reward/worker_restarts"] == float(len(hostile.worker_pids))


def test_dict_results_report_their_numeric_extras(hostile: RewardManager) -> None:
    dict_result = ScoreRequest("test/hostile", "dict", "2"), ScoreRequest("test/hostile", "dict", "4")
    output = hostile.score([dict_result[0], echo(1), dict_result[1]])
    assert output.scores == [0.25, 1.0, 0.25]
    assert output.extra == [{"acc": 1.0, "pred": "x", "steps": 2.0}, {}, {"acc": 1.0, "pred": "x", "steps": 4.0}]
    # Means over the samples that carried the key; the non-numeric "pred" is not a metric.
    assert output.metrics["reward/extra/acc/mean"] == 1.0
    assert output.metrics["reward/extra/steps/mean"] == 3.0
    assert "reward/extra/pred/mean" not in output.metrics


def test_a_timeout_kills_what_the_reward_spawned(hostile: RewardManager, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    output = hostile.score([request("grandchild", pid_file=str(pid_file)), echo(1)])
    assert output.scores == [0.0, 1.0]
    assert output.metrics["reward/timeout_rate"] == 0.5
    assert wait_until_gone(int(pid_file.read_text()), 5.0)


def test_a_huge_allocation_fails_inside_the_reward_not_the_host(hostile: RewardManager) -> None:
    output = hostile.score([request("alloc", mb=2048), echo(1), request("alloc", mb=1)])
    assert output.scores == [0.0, 1.0, float(1 << 20)]
    assert output.metrics["reward/error_rate"] == pytest.approx(1 / 3)


def test_a_leaking_reward_gets_a_fresh_worker_without_losing_samples(hostile: RewardManager) -> None:
    # 40 MB per call against a 512 MB cap: past 256 MB the worker retires between samples.
    output = hostile.score([request("leak", mb=40) for _ in range(12)])
    assert output.scores == [1.0] * 12
    assert all(output.metrics[name] == 0.0 for name in RATES)
    assert output.metrics["reward/worker_restarts"] >= 1.0


def test_each_failure_kind_is_logged_once_with_the_data_source_and_error(
    hostile_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    with RewardManager(hostile_file, "compute_score", timeout_s=TIMEOUT_S) as manager:
        with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
            manager.score([request("raise"), request("raise"), request("nan"), echo(1)])
            manager.score([request("raise"), request("none")])
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2
    raised = next(message for message in warnings if "raised" in message)
    assert "'test/hostile'" in raised and "ValueError: boom" in raised and "hostile_reward.py" in raised
    nonfinite = next(message for message in warnings if "no finite score" in message)
    assert "returned nan" in nonfinite and "reward/nonfinite_rate" in nonfinite


def test_results_stay_aligned_across_several_workers_and_failures(hostile_file: str) -> None:
    kinds = {7: "sleep", 13: "exit", 21: "raise", 30: "nan"}
    requests = [request(kinds[i]) if i in kinds else echo(i) for i in range(40)]
    with RewardManager(hostile_file, "compute_score", timeout_s=TIMEOUT_S, num_workers=2) as manager:
        output = manager.score(requests)
    assert output.scores == [0.0 if i in kinds else float(i) for i in range(40)]
    assert output.metrics["reward/error_rate"] == pytest.approx(2 / 40)
    assert output.metrics["reward/timeout_rate"] == pytest.approx(1 / 40)
    assert output.metrics["reward/nonfinite_rate"] == pytest.approx(1 / 40)


# -- built-in scorers in the worker ---------------------------------------------------------------


def test_two_thousand_arithmetic_samples_score_fast(builtin: RewardManager) -> None:
    requests = [
        ScoreRequest("hybridflow/arithmetic", str(i) if i % 3 else "wrong", str(i)) for i in range(2000)
    ]
    start = time.perf_counter()
    output = builtin.score(requests)
    elapsed = time.perf_counter() - start
    assert output.scores == [1.0 if i % 3 else 0.0 for i in range(2000)]
    assert all(output.metrics[name] == 0.0 for name in RATES)
    assert elapsed < 3.0, f"2000 trivial samples took {elapsed:.2f} s"


def test_builtin_scorers_run_in_the_worker_including_math_verify(builtin: RewardManager) -> None:
    output = builtin.score(
        [
            ScoreRequest("HuggingFaceH4/MATH-500", "so \\boxed{0.5}", "\\frac{1}{2}"),
            ScoreRequest("math", "\\boxed{3}", "4"),
            ScoreRequest("openai/gsm8k", "... #### 1,234", "1234"),
        ]
    )
    assert output.scores == [1.0, 0.0, 1.0]
    # math returns its extracted answer too, which validation votes on (maj@k)
    assert output.extra == [{"acc": 1.0, "pred": "0.5"}, {"acc": 0.0, "pred": "3"}, {}]
    assert output.metrics["reward/extra/acc/mean"] == 0.5


def test_an_unknown_data_source_is_rejected_before_scoring(builtin: RewardManager) -> None:
    with pytest.raises(KeyError, match="'my/dataset'.*hybridflow/arithmetic") as info:
        builtin.score([ScoreRequest("hybridflow/arithmetic", "1", "1"), ScoreRequest("my/dataset", "1", "1")])
    assert isinstance(info.value, UnknownDataSourceError)
    assert builtin.score([ScoreRequest("hybridflow/arithmetic", "1", "1")]).scores == [1.0]


def test_an_unpicklable_request_names_its_index_and_leaves_the_manager_usable(builtin: RewardManager) -> None:
    requests = [
        ScoreRequest("hybridflow/arithmetic", "1", "1"),
        ScoreRequest("hybridflow/arithmetic", "1", "1", {"f": lambda: 0}),
    ]
    with pytest.raises(TypeError, match="ScoreRequest 1 "):
        builtin.score(requests)
    with pytest.raises(TypeError, match="request 0 is a dict"):
        builtin.score([{"data_source": "hybridflow/arithmetic"}])  # type: ignore[list-item]
    assert builtin.score([ScoreRequest("hybridflow/arithmetic", "2", "2")]).scores == [1.0]


def test_an_empty_batch(builtin: RewardManager) -> None:
    output = builtin.score([])
    assert output.scores == [] and output.extra == []
    assert all(output.metrics[name] == 0.0 for name in RATES)


# -- construction, loading errors, shutdown --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"num_workers": 0}, "num_workers"),
        ({"memory_limit_mb": 8}, "memory_limit_mb"),
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardManager(None, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        (None, FileNotFoundError, "missing.py"),
        ("def compute_score(:\n", SyntaxError, r"bad_reward.py:1: syntax error"),
        (
            "def other(data_source, solution_str, ground_truth, extra_info):\n    return 1\n",
            AttributeError,
            "defines no 'compute_score'",
        ),
        ("import os\nos._exit(5)\n", RuntimeError, "exited with code 5 while loading"),
    ],
)
def test_loading_errors_surface_in_the_trainer(
    tmp_path: Path, source: str | None, error: type, match: str
) -> None:
    path = tmp_path / ("missing.py" if source is None else "bad_reward.py")
    if source is not None:
        path.write_text(source)
    with pytest.raises(error, match=match):
        RewardManager(str(path), "compute_score", timeout_s=1.0)


def test_a_reward_file_that_hangs_on_import_times_out_at_startup(tmp_path: Path) -> None:
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(3600)\n")
    with pytest.raises(TimeoutError, match="startup_timeout_s=1"):
        RewardManager(str(path), "compute_score", timeout_s=1.0, startup_timeout_s=1.0)


def test_a_worker_killed_by_a_signal_while_loading_is_started_again(tmp_path: Path, caplog) -> None:
    """The out-of-memory killer (or an operator) may kill a worker mid-import: that is not the
    file's fault, so the slot loads again and the run goes on, with a warning naming the signal."""
    marker = tmp_path / "killed_once"
    path = tmp_path / "reward.py"
    path.write_text(
        "import os, signal\n"
        f"if not os.path.exists({str(marker)!r}):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str == ground_truth)\n")
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
        manager = RewardManager(str(path), "compute_score", timeout_s=TIMEOUT_S)
    try:
        assert marker.exists()
        assert "was killed by SIGKILL (signal 9) while loading compute_score" in caplog.text
        out = manager.score([ScoreRequest("any", "4", "4"), ScoreRequest("any", "5", "4")])
        assert list(out.scores) == [1.0, 0.0]
    finally:
        manager.close()


def test_a_worker_killed_at_every_load_stops_the_run_naming_the_signal(tmp_path: Path) -> None:
    path = tmp_path / "reward.py"
    path.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    with pytest.raises(RuntimeError, match=r"killed by SIGKILL \(signal 9\) while loading .*3 times in a row"):
        RewardManager(str(path), "compute_score", timeout_s=1.0)


def test_close_stops_the_workers_and_is_idempotent(hostile_file: str) -> None:
    manager = RewardManager(hostile_file, "compute_score", timeout_s=TIMEOUT_S, num_workers=2)
    pids = manager.worker_pids
    assert len(pids) == 2
    manager.close()
    manager.close()
    assert all(wait_until_gone(pid, 5.0) for pid in pids)
    with pytest.raises(RuntimeError, match="after close"):
        manager.score([echo(1)])


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from hybridflow.rewards.manager import RewardManager, ScoreRequest

    def build():
        return RewardManager(sys.argv[1], "compute_score", timeout_s=600)

    if __name__ == "__main__":
        if sys.argv[2] == "thread":
            made = []
            starter = threading.Thread(target=lambda: made.append(build()))
            starter.start()
            starter.join()
            manager = made[0]
        else:
            manager = build()
        print(manager.worker_pids[0], flush=True)
        threading.Timer(0.5, os._exit, (0,)).start()  # the trainer dies without any cleanup
        manager.score([ScoreRequest("test/hostile", "sleep", "0")])
    """
)


@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_workers_die_with_a_trainer_that_dies_mid_score(
    hostile_file: str, tmp_path: Path, started_from: str
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(_ORPHAN_SCRIPT)
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        trainer = subprocess.Popen(
            [sys.executable, str(script), hostile_file, started_from],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    assert trainer.stdout is not None
    # Read one line only: an orphaned worker would keep the pipe open, and EOF would never come.
    first_line = trainer.stdout.readline()
    assert trainer.wait(timeout=60) == 0, stderr.read_text()
    trainer.stdout.close()
    worker_pid = int(first_line)
    gone = wait_until_gone(worker_pid, 5.0)
    if not gone:
        os.kill(worker_pid, signal.SIGKILL)  # do not leave it behind for the next test run
    assert gone, f"worker {worker_pid} outlived its trainer"


def test_a_sigterm_to_every_process_of_the_job_leaves_the_workers_scoring(hostile_file: str) -> None:
    """Slurm's scancel and container runtimes send SIGTERM to every process: the trainer then
    finishes its step and saves, which needs its workers' scores; they are the trainer's to stop.
    (A manager of its own: the module's shared one has workers the other tests crashed.)"""
    with RewardManager(hostile_file, "compute_score", timeout_s=TIMEOUT_S, memory_limit_mb=512) as manager:
        manager.score([echo(0)])  # the workers are up and serving
        pids = manager.worker_pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        output = manager.score([echo(1), echo(2)])
        assert output.scores == [1.0, 2.0] and output.metrics["reward/worker_restarts"] == 0.0
        assert manager.worker_pids == pids
