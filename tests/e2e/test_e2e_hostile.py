"""What a hostile new user hit on day one: each case ends in a run that trains, or in one line
naming what is wrong, where, and the fix, with an exit code a script can act on (2: fix the
config or the data; 1: a failure while running). Never a traceback, never a silent restart,
never lost work."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow import api
from hybridflow.cli import describe_error, main
from hybridflow.config import Config
from hybridflow.controller.checkpoint import CheckpointError
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow

SMALL = [
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.n=4",
    "data.max_response_length=4",
    "trainer.total_training_steps=2",
    "trainer.num_threads=1",
    "trainer.progress_bar=false",
    "trainer.logger=[jsonl]",
]
# Log records and progress bars share stderr with the error line; everything else must be it.
NOISE = re.compile(r"^(\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) |Loading weights|Writing model|\s*$)")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=16)
    return {"model": write_tiny_model(root / "model"), "train": train, "val": val, "root": root}


def base(files: dict[str, Path], out: Path, *, val: bool = True) -> list[str]:
    return [f"model.path={files['model']}", f"data.train_files=[{files['train']}]",
            *([f"data.val_files=[{files['val']}]"] if val else []), f"trainer.output_dir={out}", *SMALL]


def cli(args: list[str], capsys) -> tuple[int, str]:
    """``hybridflow <args>`` in this process: its exit code and the one error line it printed."""
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if not NOISE.match(line)]
    assert len(lines) <= 1, lines
    return code, lines[0] if lines else ""


def run_cli(args: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------ lost runs


def test_a_run_without_validation_files_trains_saves_and_says_it_skips_validation(files, tmp_path):
    out = tmp_path / "run"
    done = run_cli(["train", *base(files, out, val=False)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no data.val_files: validation is skipped" in done.stderr
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and not any("val/score/mean" in r for r in records)
    assert (out / "checkpoints" / "global_step_2" / "manifest.json").is_file()  # the final save happened


def test_a_row_without_a_scorer_is_refused_at_load_time_or_counted_in_skip_mode(files, tmp_path, capsys):
    rows = [json.loads(line) for line in _jsonl_rows(files["train"], 17)]
    rows[3]["data_source"] = "nobody/scores-this"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [*base(files, tmp_path / "run"), f"data.train_files=[{train}]"]
    code, line = cli(["train", *args], capsys)
    assert code == 2
    assert line.startswith(f"data error: {train} row 3 (line 4): no reward function scores data_source "
                           f"'nobody/scores-this' (known: ")
    assert not (tmp_path / "run" / "checkpoints").exists()
    # Skip mode trains on the rest, from the first step to the last.
    result = api.train(api.make_config("grpo", overrides=[*args, "data.on_bad_row=skip"]))
    assert result.final_metrics["training/global_step"] == 2


def _jsonl_rows(parquet: Path, n: int) -> list[str]:
    import pyarrow.parquet as pq

    return [json.dumps(row) for row in pq.read_table(parquet).to_pylist()[:n]]


def test_a_huge_finite_reward_is_counted_and_the_run_goes_on(files, tmp_path):
    reward = tmp_path / "huge.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1e308  # finite in float64, inf in float32\n")
    result = api.train(api.make_config("grpo", overrides=[
        *base(files, tmp_path / "run"), f"reward.custom_reward_function.path={reward}"]))
    records = read_metrics(result.metrics_path)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/nonfinite_rate"] == 1.0 and r["critic/score/mean"] == 0.0
        assert r["actor/grad_norm"] == pytest.approx(r["actor/grad_norm"])  # finite, not NaN


# --------------------------------------------------------------- pluggable names at start-up


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithm.adv_estimator=os:system", "config error: algorithm.adv_estimator: advantage estimator 'os:system'"),
        ("actor.policy_loss.loss_mode=os:system", "config error: actor.policy_loss.loss_mode: policy loss 'os:system'"),
        ("actor.policy_loss.loss_mode=vanila", "config error: actor.policy_loss.loss_mode: unknown policy loss"),
        ("algorithm.adv_estimator=no.such.module:fn", "cannot import module 'no.such.module'"),
        ("rollout.name=vlm", "config error: rollout.name=vlm: unknown rollout engine 'vlm'; available: "),
    ],
)
def test_pluggable_names_are_resolved_and_checked_before_anything_loads(files, tmp_path, capsys, override, expected):
    started = time.monotonic()
    code, line = cli(["train", *base(files, tmp_path / "run"), override], capsys)
    assert code == 2 and expected in line, line
    assert time.monotonic() - started < 5.0
    assert not (tmp_path / "run").exists()  # refused before the output folder was made
    code, line = cli(["config", "explain", override], capsys)  # explain resolves them too
    assert code == 2 and expected in line, line


def test_a_custom_loss_with_the_documented_signature_trains(files, tmp_path, monkeypatch):
    """A user's loss is ``fn(inputs: LossInputs, params)``; one that declares a params dataclass gets
    it filled from the config (here vanilla's clip settings), and survives the real call."""
    (tmp_path / "typed_loss.py").write_text(textwrap.dedent("""
        from hybridflow.algorithms import get_policy_loss
        from hybridflow.algorithms.policy_loss import PPOClipParams

        def loss(inputs, params):
            assert isinstance(params, PPOClipParams) and params.clip_ratio_c == 3.0
            return get_policy_loss("vanilla")(inputs, params)
        loss.params = PPOClipParams
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = api.train(api.make_config("grpo", overrides=[
        *base(files, tmp_path / "run"), "actor.policy_loss.loss_mode=typed_loss:loss"]))
    assert result.final_metrics["training/global_step"] == 2


def test_a_policy_loss_key_for_another_loss_is_refused_at_start_up(files, tmp_path, capsys):
    code, line = cli(["train", *base(files, tmp_path / "run"), "actor.policy_loss.tau_pos=1.2"], capsys)
    assert code == 2 and "config error: actor.policy_loss: tau_pos does not apply to policy loss" in line, line


# ------------------------------------------------------------------------- one-line errors


def test_every_user_error_is_one_line_with_its_exit_code(files, tmp_path, capsys):
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(600)\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = tmp_path / "run"
    cases = [
        ([f"data.train_files=[{corrupt}]"], 2, f"data error: {corrupt}: not a readable parquet file"),
        ([f"data.train_files=[{tmp_path / 'missing.parquet'}]"], 2, "config error: data.train_files[0]="),
        ([f"model.path={not_a_model}"], 2, "has no config.json; is it a Hugging Face model directory?"),
        (["actor.policy_loss.loss_mode=nope"], 2, "config error: actor.policy_loss.loss_mode: unknown policy loss"),
        ([f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=nope"], 2,
         f"config error: reward.custom_reward_function.name: custom reward file {reward} defines no 'nope'"),
        ([f"trainer.output_dir={blocker / 'run'}"], 2, "config error: trainer.output_dir="),
        (["trainer.device=cuda"], 2, "config error: trainer.device=cuda but CUDA is not available"),
        ([f"reward.custom_reward_function.path={hangs}", "reward.startup_timeout_s=2"], 2,
         "config error: reward.custom_reward_function.path: reward worker did not finish loading"),
        (["rollout.temperature=0"], 2, "config error: rollout.temperature=0.0 must be >= 0.01 for training"),
        (["rollout.n=100000000"], 2, "rollout.n=100000000 is over the limit of 4096"),
    ]
    for overrides, want_code, expected in cases:
        code, line = cli(["train", *base(files, out), *overrides], capsys)
        assert (code, expected in line) == (want_code, True), (overrides, line)
    assert not (out / "checkpoints").exists()


def test_debug_shows_the_traceback_behind_the_line(files, tmp_path):
    args = ["train", *base(files, tmp_path / "run"), "actor.policy_loss.loss_mode=nope"]
    quiet, loud = run_cli(args, timeout=120), run_cli(args, timeout=120, HYBRIDFLOW_DEBUG="1")
    assert quiet.returncode == loud.returncode == 2
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr


def test_full_disks_and_refused_checkpoints_read_as_one_line() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/data/runs/x/checkpoints/.tmp-global_step_3/actor")
    wrapped = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 123")
    wrapped.__cause__ = full
    assert describe_error(wrapped) == (
        "error: no space left on /data/runs/x/checkpoints/.tmp-global_step_3/actor; free some disk space or point "
        "trainer.output_dir elsewhere", 1)
    refused = CheckpointError("checkpoint file /r/global_step_2/actor/optim.pt cannot be loaded:\nrefused pickle")
    assert describe_error(refused) == (
        "checkpoint error: checkpoint file /r/global_step_2/actor/optim.pt cannot be loaded: refused pickle", 1)


# ------------------------------------------------------------------------------------ fuzzing

_LEAVES = [f.name for f in __import__("dataclasses").fields(Config)]
_BAD_VALUES = st.one_of(
    st.sampled_from(["", "-1", "0", "1e8", "100000000", "-0.0", "1e-45", "1e308", ".inf", ".nan", "null", "[]",
                     "{}", "[1, 2", "os:system", "no.such:fn", "../../../etc/passwd", "true", "é" * 3, "x" * 300,
                     "{a: [b", "!!python/object:os.system", "2**63", "9223372036854775808"]),
    st.text(max_size=12),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def _keys() -> list[str]:
    import dataclasses

    def leaves(node: object, prefix: str = "") -> list[str]:
        out = []
        for fld in dataclasses.fields(node):
            value = getattr(node, fld.name)
            out += leaves(value, f"{prefix}{fld.name}.") if dataclasses.is_dataclass(value) else [prefix + fld.name]
        return out

    return leaves(Config())


KEYS = _keys()
PINNED = {"model.path", "data.train_files", "data.val_files", "trainer.output_dir", "trainer.total_training_steps",
          "trainer.backend", "trainer.ray_address", "trainer.logger", "trainer.resume_from_path"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS + ["actor.optim.lrr", "nope", "rollout..n"]), _BAD_VALUES),
                      min_size=1, max_size=3))
def test_fuzzed_bad_overrides_end_in_exit_0_or_one_line_and_exit_2(files, tmp_path_factory, capsys, pairs):
    """Every outcome of ``hybridflow config explain`` over generated overrides is exit 0 or one
    line with exit 2, never a traceback, within seconds."""
    overrides = [f"{key}={value}" for key, value in pairs]
    started = time.monotonic()
    code, line = cli(["config", "explain", *overrides], capsys)
    assert time.monotonic() - started < 30
    assert code == 0 or (code == 2 and line.startswith("config error: ")), (overrides, code, line)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from([k for k in KEYS if k not in PINNED]), _BAD_VALUES),
                      min_size=1, max_size=2))
def test_fuzzed_bad_overrides_to_train_end_in_a_run_or_one_line(files, tmp_path_factory, capsys, pairs):
    """The same through ``hybridflow train`` on a real (tiny) model and data: a value that happens
    to be valid trains its one step; anything else is one line and exit 2, before loading."""
    out = tmp_path_factory.mktemp("fuzz") / "run"
    overrides = [*base(files, out), *(f"{key}={value}" for key, value in pairs), "trainer.total_training_steps=1"]
    started = time.monotonic()
    code, line = cli(["train", *overrides], capsys)
    assert time.monotonic() - started < 30, overrides
    assert code == 0 or (code == 2 and re.match(r"(config|data) error: ", line)), (pairs, code, line)
