"""Online DPO (``actor.loss=dpo``, ``--preset online_dpo``) end to end on the built-in model and task: the
sync loop trains on pairs of its own samples and a killed run resumes bitwise; the one-step-off loop
trains on pairs one version behind; the preset raises the held-out greedy score."""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from hybridflow import api
from run_records import cli_train, per_step

pytestmark = pytest.mark.slow

# Ranks against one rank, cuts, resumes and servers are compared within 1e-4-1e-6: float32's sums.
# model.dtype=auto would train bf16-mixed on a CPU with bf16 hardware, whose rounding differs by path.
SHORT = ["--preset", "online_dpo", "data.train_batch_size=8", "rollout.n=4", "data.max_response_length=8",
         "trainer.total_training_steps=4", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.num_threads=1",
         "trainer.progress_bar=false", "trainer.logger=[jsonl]", "data.builtin_val_size=16", "model.dtype=float32"]


def train(out: Path, cache: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    return cli_train(SHORT, out, cache, fault)


def test_online_dpo_learns_from_pairs_and_a_killed_run_resumes_bitwise(builtin_cache, tmp_path):
    # The uninterrupted run in this process (one process start fewer); the killed one through the CLI.
    api.train(api.make_config("online_dpo", overrides=[*SHORT[2:], f"warm_start.cache_dir={builtin_cache}",
                                                       f"trainer.output_dir={tmp_path / 'ref'}"]))
    steps = per_step(tmp_path / "ref")
    first, later = steps[1], [steps[s] for s in (2, 3, 4)]
    for record in steps.values():
        if record["step"] > 0:
            assert record["pairs/count"] + record["pairs/groups_without_pair"] == 8  # best_worst: one per group
            assert "critic/advantages/mean" not in record and "actor/pg_loss" not in record
    assert first["pairs/count"] > 0
    # Step 1's policy is the reference: every implicit reward is 0 and the sigmoid loss is log 2.
    assert first["actor/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    # After an update the policy has left the reference: the loss and implicit rewards move.
    assert all(abs(r["actor/dpo_loss"] - math.log(2)) > 1e-4 for r in later)
    assert all(abs(r["rewards/chosen"]) > 1e-4 for r in later)

    out = tmp_path / "killed"
    killed = train(out, builtin_cache, "after_step@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    final = train(out, builtin_cache)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resumed from" in final.stderr
    got = per_step(out)
    assert sorted(got) == sorted(steps) == [0, 1, 2, 3, 4]
    for step in steps:
        assert got[step] == steps[step], f"step {step} differs after kill-and-resume"


def test_one_step_off_online_dpo_trains_on_pairs_one_version_behind(builtin_cache, tmp_path):
    """The one-step-off loop: step k's pairs were sampled by the weights of step k - 2, and DPO takes them as
    they are (no behaviour correction: its loss has no importance ratio)."""
    cfg = api.make_config("online_dpo", overrides=[
        *SHORT[2:], "trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.val_before_train=false",
        "trainer.mode=one_step_off", f"warm_start.cache_dir={builtin_cache}", f"trainer.output_dir={tmp_path / 'run'}",
    ])
    result = api.train(cfg)
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["algorithm"]["rollout_correction"]["rollout_is"] is None  # no behaviour correction
    steps = {r["step"]: r for r in map(json.loads, result.metrics_path.read_text().splitlines())}
    assert steps[1]["async/staleness/max"] == 0.0 and steps[1]["actor/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    for step in (2, 3):
        assert steps[step]["async/staleness/max"] == 1.0 and steps[step]["pairs/count"] > 0
        assert abs(steps[step]["actor/dpo_loss"] - math.log(2)) > 1e-4


def test_the_online_dpo_preset_raises_the_held_out_greedy_score(builtin_cache, tmp_path):
    """``--preset online_dpo`` (sync loop), shortened to 30 steps: held-out greedy accuracy must rise by at
    least 0.2 absolute from the warm start."""
    cfg = api.make_config("online_dpo", overrides=[
        f"warm_start.cache_dir={builtin_cache}", f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.total_training_steps=30", "trainer.test_freq=30", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]",
    ])
    result = api.train(cfg)
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    vals = [(r["step"], r["val/score/mean"]) for r in records if "val/score/mean" in r]
    assert [s for s, _ in vals] == [0, 30]
    assert vals[-1][1] - vals[0][1] >= 0.2, vals
