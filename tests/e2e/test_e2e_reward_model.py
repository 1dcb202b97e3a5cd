"""A discriminative reward model end to end through the CLI: a tiny sequence classifier built here
scores the built-in task (``combine=replace``: its score is the reward), the run trains and
validates with it, reports its metrics, and a second invocation resumes from the checkpoint (the
reward model is frozen and not in the checkpoint: it is loaded from its path again)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model, write_tiny_reward_model

pytestmark = pytest.mark.slow

RM_METRICS = ("reward_model/score/mean", "reward_model/score/max", "reward_model/score/min",
              "reward_model/truncated_fraction", "timing_s/reward_model")


def train(out: Path, files: list[str], steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", *files, "reward_model.enable=true",
         "reward_model.combine=replace", "reward_model.micro_batch_size_per_gpu=8", "data.train_batch_size=4",
         "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=4", "trainer.test_freq=2",
         "trainer.val_before_train=false", "trainer.save_freq=1", "trainer.save_final=false",
         f"trainer.total_training_steps={steps}", "trainer.num_threads=1", "trainer.progress_bar=false",
         "trainer.logger=[jsonl]", f"trainer.output_dir={out}"],
        capture_output=True, text=True, timeout=300,
    )


def test_a_tiny_reward_model_scores_trains_and_resumes(tmp_path):
    model, rm = write_tiny_model(tmp_path / "policy"), write_tiny_reward_model(tmp_path / "rm", seed=1)
    train_file, val_file = write_arithmetic_task(tmp_path / "data", train_size=16, val_size=4)
    files = [f"model.path={model}", f"reward_model.model.path={rm}", f"data.train_files=[{train_file}]",
             f"data.val_files=[{val_file}]"]
    out = tmp_path / "run"
    first = train(out, files, steps=2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(out, files, steps=3)  # the same folder: resumes after step 2
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resum" in second.stderr.lower(), second.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]  # step 3 trained once, after the resume
    for step in steps:
        assert all(math.isfinite(step[k]) for k in RM_METRICS), step
        # With replace the model's score is the reward: the batch's score is the model's.
        assert step["critic/score/mean"] == pytest.approx(step["reward_model/score/mean"], abs=1e-6)
        assert step["reward_model/score/max"] > step["reward_model/score/min"]  # answers differ, so scores do
        assert "actor/pg_loss" in step
    assert "val/score/mean" in steps[1]  # validation at step 2 was scored by the reward model too
