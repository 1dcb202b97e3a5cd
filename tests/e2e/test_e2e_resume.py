"""Kill the trainer with SIGKILL at chosen moments (after a step, mid checkpoint write, at an
epoch boundary), resume each time, and require the per-step metrics of an uninterrupted run,
bitwise. Plus damaged checkpoints: truncated files and planted pickles."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow

# 64 prompts / 8 per step = 8 steps per epoch: step 8 ends epoch 0.
RUN = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.n=4", "data.max_response_length=4", "trainer.total_epochs=2", "trainer.total_training_steps=10", "trainer.test_freq=5",
    "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2", "trainer.num_threads=1", "trainer.progress_bar=false",
    "trainer.logger=[jsonl]", "actor.optim.lr=1e-3", "actor.ppo_epochs=2", "actor.shuffle=true",
]
# Wall-clock and throughput numbers legitimately differ between runs.
VOLATILE = ("timing_s/", "perf/")


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=16)
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def train(out: Path, files: list[str], fault: str | None = None, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRIDFLOW_FAULT": fault or ""}
    return subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", *files, *RUN, f"trainer.output_dir={out}", *extra],
        capture_output=True, text=True, timeout=600, env=env,
    )


def per_step(out: Path) -> dict[int, dict]:
    """The last record logged for each step (a step re-run after a kill is logged again)."""
    records: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        records[record["step"]] = {k: v for k, v in record.items() if not k.startswith(VOLATILE)}
    return records


def test_kill_anywhere_and_resume_reproduces_the_uninterrupted_run(user_files, tmp_path):
    reference = train(tmp_path / "ref", user_files)
    assert reference.returncode == 0, reference.stderr[-3000:]

    out = tmp_path / "killed"
    # Killed right after step 3; then mid-write of checkpoint 6 (resumes from 5); then right
    # after step 8, the epoch boundary; then runs to the end.
    for fault in ("after_step@3", "checkpoint_write@6", "after_step@8"):
        killed = train(out, user_files, fault)
        assert killed.returncode == -signal.SIGKILL, (fault, killed.stderr[-3000:])
    final = train(out, user_files)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resumed from" in final.stderr

    expected, got = per_step(tmp_path / "ref"), per_step(out)
    assert sorted(got) == sorted(expected) == list(range(0, 11))
    for step in expected:
        assert got[step] == expected[step], f"step {step} differs after kill-and-resume"

    again = train(out, user_files)  # a finished run started again does nothing and says so
    assert again.returncode == 0 and "nothing to do" in again.stderr


def test_damaged_checkpoints_are_named_and_pickles_never_run(user_files, tmp_path):
    out = tmp_path / "run"
    first = train(out, user_files, extra=("trainer.total_training_steps=2",))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = out / "checkpoints" / "global_step_2"

    # A truncated weights file in the newest checkpoint: auto-resume names it and falls back to step 1.
    weights = next((ckpt / "actor").rglob("*.safetensors"))
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])
    resumed = train(out, user_files, extra=("trainer.total_training_steps=3",))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{weights.name} is truncated" in resumed.stderr
    assert "resumed from" in resumed.stderr and "global_step_1" in resumed.stderr

    # resume_mode=path on a checkpoint whose optimizer state was replaced by a malicious pickle:
    # the manifest catches it, and the payload never runs.
    ckpt3 = out / "checkpoints" / "global_step_3"
    marker = tmp_path / "pwned"
    optim = next((ckpt3 / "actor").rglob("optim.pt"))
    optim.write_bytes(pickle.dumps(_Payload(str(marker))))
    refused = train(out, user_files, extra=("trainer.total_training_steps=4", "trainer.resume_mode=path",
                                            f"trainer.resume_from_path={ckpt3}"))
    assert refused.returncode != 0
    assert "optim.pt is" in refused.stderr and "manifest" in refused.stderr
    assert not marker.exists()


class _Payload:
    """Unpickling this would create a file: the test checks it never happens."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))
