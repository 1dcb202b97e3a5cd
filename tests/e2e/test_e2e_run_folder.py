"""The run folder across processes: one run at a time holds it (a second refuses, naming the first;
a killed run's lock dies with it), and what a killed run left behind is cleaned at the next start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow

# Long enough that the first run is still training when the second starts (64 prompts, 8 per step).
LONG = ("trainer.total_epochs=100", "trainer.total_training_steps=800")
RUN = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=2", "data.max_response_length=4",
    "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.num_threads=1", "trainer.progress_bar=false",
    "trainer.logger=[jsonl]",
]


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-folder")
    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=8)
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def command(out: Path, files: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "hybridflow.cli", "train", *files, *RUN, f"trainer.output_dir={out}", *extra]


def steps_logged(out: Path) -> list[int]:
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return steps


def wait_for_step(run: subprocess.Popen, out: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while max(steps_logged(out), default=-1) < step:
        assert run.poll() is None, f"the run ended (rc {run.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout_s} s"
        time.sleep(0.2)


def test_a_second_run_on_a_folder_in_use_refuses_and_a_killed_runs_folder_is_taken_over(user_files, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(command(out, user_files, *LONG),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(first, out, 1)
        config_before = (out / "config.yaml").stat().st_mtime_ns
        second = subprocess.run(command(out, user_files, *LONG), capture_output=True,
                                text=True, timeout=300)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2, second.stderr[-3000:]
        assert lines[-1].startswith("config error: trainer.output_dir=") and f"pid {first.pid} " in lines[-1], lines
        assert (out / "config.yaml").stat().st_mtime_ns == config_before  # the second run wrote nothing
        assert first.poll() is None  # and the first runs on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    reached = max(steps_logged(out))
    # The lock died with its holder: the same folder starts again (and resumes from the newest checkpoint).
    third = subprocess.run(command(out, user_files, LONG[0], f"trainer.total_training_steps={reached + 1}"),
                           capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "in use by another run" not in third.stderr and "resumed from" in third.stderr
    assert f"pid {os.getpid()} " not in (out / ".run.lock").read_text()
