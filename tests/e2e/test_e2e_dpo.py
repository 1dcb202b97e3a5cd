"""``hybridflow dpo`` end to end on the built-in pairs (the warm-started model's own wrong answers
rejected, the right ones chosen): the validation reward accuracy rises, the held-out greedy accuracy
is measured before and after; a run killed after a step resumes and reproduces the uninterrupted
run's metrics bitwise (fixed threads); two FSDP2 ranks train like one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from run_records import cli_in_process, per_step

pytestmark = pytest.mark.slow

# Ranks against one rank, cuts, resumes and servers are compared within 1e-4-1e-6: float32's sums.
# model.dtype=auto would train bf16-mixed on a CPU with bf16 hardware, whose rounding differs by path.
RUN = [
    "dpo.builtin_prompts=128", "dpo.builtin_val_prompts=32", "dpo.sft_weight=1.0", "data.train_batch_size=16",
    "trainer.total_training_steps=6", "trainer.test_freq=3", "trainer.save_freq=2", "trainer.num_threads=1",
    "trainer.logger=[jsonl]",
    # Token-budget micro-batches, packed, cut by pairs: the speed path, not one padded batch.
    "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=256",
    "model.dtype=float32",
]
VOLATILE = ("train/pairs_per_s",)



def cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """``hybridflow <args>``: a run killed at ``fault``, or one of ranks of their own (``trainer.n_workers``), in a
    process of its own; any other in this one (``cli_in_process``)."""
    if fault is None and not any(arg.startswith("trainer.n_workers=") for arg in args):
        return cli_in_process(list(args), env={"OMP_NUM_THREADS": "1"})
    env = {**os.environ, "HYBRIDFLOW_FAULT": fault or "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], capture_output=True, text=True,
                          timeout=900, env=env)


def test_dpo_learns_the_builtin_pairs_and_resumes_bitwise(tmp_path):
    reference = cli("dpo", *RUN, f"trainer.output_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = per_step(tmp_path / "ref", VOLATILE)
    assert sorted(expected) == list(range(7))
    assert expected[0]["val/rewards/accuracies"] == 0.0  # policy = reference: no margin yet
    assert expected[6]["val/rewards/accuracies"] > 0.6, expected[6]
    assert expected[6]["val/rewards/margins"] > 0
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "train/loss", "train/grad_norm", "train/lr"):
        assert name in expected[1], name
    evaluation = json.loads((tmp_path / "ref" / "dpo_eval.json").read_text())
    assert 0 <= evaluation["greedy_accuracy_before"] <= 1 and 0 <= evaluation["greedy_accuracy_after"] <= 1
    assert "held-out greedy accuracy" in reference.stdout

    out = tmp_path / "killed"
    killed = cli("dpo", *RUN, f"trainer.output_dir={out}", fault="after_step@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = cli("dpo", *RUN, f"trainer.output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "global_step_2" in resumed.stderr
    got = per_step(out, VOLATILE)
    assert got == expected  # bitwise: every metric of every step
    assert (out / "export" / "model.safetensors").is_file()


def test_two_ranks_train_like_one(tmp_path):
    steps = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_final=false", "dpo.export=false",
             "trainer.val_before_train=false"]
    one = cli("dpo", *RUN, *steps, f"trainer.output_dir={tmp_path / 'one'}")
    two = cli("dpo", *RUN, *steps, "trainer.n_workers=2", f"trainer.output_dir={tmp_path / 'two'}")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = per_step(tmp_path / "one", VOLATILE), per_step(tmp_path / "two", VOLATILE)
    for step in (1, 2):
        for key in ("train/loss", "rewards/margins", "logps/chosen", "rewards/accuracies"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)
        assert b[step]["train/grad_norm"] == pytest.approx(a[step]["train/grad_norm"], rel=1e-4)
    assert b[2]["val/loss"] == pytest.approx(a[2]["val/loss"], abs=1e-4)
