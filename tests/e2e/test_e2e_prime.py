"""PRIME (``algorithm.adv_estimator=prime``, ``--preset prime``) end to end on the built-in model and task: the
implicit PRM trains beside the policy and logs its accuracy and loss on the outcome labels, its checkpoint is
saved with the run's, and a killed run resumes bitwise; the preset raises the held-out greedy score."""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path

import pytest

from hybridflow import api
from run_records import cli_train, per_step

pytestmark = pytest.mark.slow

# Ranks against one rank, cuts, resumes and servers are compared within 1e-4-1e-6: float32's sums.
# model.dtype=auto would train bf16-mixed on a CPU with bf16 hardware, whose rounding differs by path.
SHORT = ["--preset", "prime", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.max_response_length=8", "trainer.total_training_steps=4", "trainer.test_freq=0", "trainer.save_freq=2",
         "trainer.val_before_train=false", "trainer.num_threads=1", "trainer.progress_bar=false",
         "trainer.logger=[jsonl]", "model.dtype=float32"]


def train(out: Path, cache: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    return cli_train(SHORT, out, cache, fault)


def test_prime_trains_the_implicit_prm_and_a_killed_run_resumes_bitwise(builtin_cache, tmp_path):
    # The uninterrupted run in this process (one process start fewer); the killed one through the CLI.
    api.train(api.make_config("prime", overrides=[*SHORT[2:], f"warm_start.cache_dir={builtin_cache}",
                                                  f"trainer.output_dir={tmp_path / 'ref'}"]))
    steps = per_step(tmp_path / "ref")
    for record in steps.values():
        for key in ("prime/acc", "prime/loss", "prime/pair_acc", "prime/grad_norm"):  # (per_step drops timings)
            assert key in record, key
        assert 0.0 <= record["prime/acc"] <= 1.0
    # Step 1: phi is its reference, every implicit reward is 0 (to float rounding): the loss is log 2.
    first = steps[1]
    assert first["prime/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["prime/grad_norm"] > 0  # the samples' labels differ: phi learns from them
    assert any(abs(steps[s]["prime/loss"] - math.log(2)) > 1e-4 for s in (2, 3, 4))  # phi has left its reference
    assert (tmp_path / "ref" / "checkpoints" / "global_step_2" / "prime" / "optim.pt").is_file()

    out = tmp_path / "killed"
    killed = train(out, builtin_cache, "after_step@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    final = train(out, builtin_cache)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resumed from" in final.stderr
    got = per_step(out)
    assert sorted(got) == sorted(steps) == [1, 2, 3, 4]
    for step in steps:
        assert got[step] == steps[step], f"step {step} differs after kill-and-resume"


def test_the_prime_preset_raises_the_held_out_greedy_score(builtin_cache, tmp_path):
    """``--preset prime`` shortened to 10 steps (about 4 minutes on 2 cores): held-out greedy accuracy must rise
    by at least 0.2 absolute from the warm start (0.227 -> 0.449 measured)."""
    steps = 10
    cfg = api.make_config("prime", overrides=[
        f"warm_start.cache_dir={builtin_cache}", f"trainer.output_dir={tmp_path / 'run'}",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]",
    ])
    result = api.train(cfg)
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    vals = [(r["step"], r["val/score/mean"]) for r in records if "val/score/mean" in r]
    assert [s for s, _ in vals] == [0, steps]
    assert vals[-1][1] - vals[0][1] >= 0.2, vals
