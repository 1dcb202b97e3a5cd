"""The same command is the same run: the default command (built-in model, warm start and task),
shortened, run beside a busy process, gives bitwise-equal metrics twice and after a kill-and-resume.

What it guards: every default that changes numbers is a rule, not a timing taken while other
processes run (issue 33: ``rollout.dtype=auto`` once timed bf16 decode at 0.13x fp32 in one run and
7.16x in the next, and the two runs sampled in two precisions). Threads are left to the default too:
unset, the count is a rule of the machine, recorded for the resume (with ``trainer.num_threads=follow``
they would follow the free cores, and the busy process would change them between runs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_records import per_step, records

pytestmark = pytest.mark.slow

# The default command, shortened: two steps, a checkpoint after each (to resume from).
SHORT = ["trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]"]
# The environment as a user's shell has it: without the test runner's per-worker thread cap
# (tests/conftest.py), so the runs take the default thread count.
DEFAULT_ENV = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


@pytest.fixture
def busy_core() -> Iterator[None]:
    """A process that keeps one core busy for the test's length."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def default_train(out: Path, cache: Path, fault: str = "") -> tuple[subprocess.Popen, Path]:
    """The command started in the background; its log goes to a file (a pipe left unread would
    block it while the test waits on another run)."""
    log = out.with_name(f"{out.name}-{fault or 'run'}.log")
    with open(log, "w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.cli", "train", f"warm_start.cache_dir={cache}",
             f"trainer.output_dir={out}", *SHORT],
            stdout=subprocess.DEVNULL, stderr=stderr, env={**DEFAULT_ENV, "HYBRIDFLOW_FAULT": fault},
        )
    return run, log


def finish(started: tuple[subprocess.Popen, Path]) -> tuple[int, str]:
    run, log = started
    run.wait(timeout=900)
    return run.returncode, log.read_text()


def test_the_default_command_beside_a_busy_process_is_the_same_run_twice_and_after_a_kill(
    tmp_path, builtin_cache, busy_core
):
    # Two runs of the command side by side (the machine's load as a test runner's parallel
    # workers make it); the second is killed after its first step and resumed: its steps 0 and 1
    # come from the second run of the command, its step 2 from the resume.
    first = default_train(tmp_path / "first", builtin_cache)
    second = default_train(tmp_path / "second", builtin_cache, fault="after_step@1")
    code, stderr = finish(first)
    assert code == 0, stderr[-3000:]
    code, stderr = finish(second)
    assert code == -signal.SIGKILL, stderr[-3000:]
    code, stderr = finish(default_train(tmp_path / "second", builtin_cache))
    assert code == 0, stderr[-3000:]
    assert "resumed from" in stderr

    expected, got = per_step(tmp_path / "first"), per_step(tmp_path / "second")
    assert sorted(got) == sorted(expected) == [0, 1, 2]
    for step in expected:
        assert got[step] == expected[step], f"step {step} differs between two runs of the default command"
    dtypes = [json.loads((tmp_path / run / "rollout_dtype.json").read_text()) for run in ("first", "second")]
    assert dtypes[0] == dtypes[1] and dtypes[0]["rollout.dtype"] == "auto"
    # Both runs took the rule's count (every core but one), and the resume kept the recorded count.
    threads = [json.loads((tmp_path / run / "token_budgets.json").read_text())["budgets"]["trainer.num_threads"]
               for run in ("first", "second")]
    assert threads == [max(1, len(os.sched_getaffinity(0)) - 1)] * 2
    counts = {record["perf/cpu_threads"] for run in ("first", "second") for record in records(tmp_path / run)
              if "perf/cpu_threads" in record}  # each training step's record (validation's have none)
    assert counts == {threads[0]}
