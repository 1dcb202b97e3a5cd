"""``hybridflow rm`` end to end on the built-in pairs (the right answer against the warm-started
model's own wrong one; the reward model starts from the built-in teacher): the Bradley-Terry loss
falls below log 2 and the held-out margin turns positive (a zero head ties every pair); the export (with a
layer added for the head, rm.extra_layers=1) is a reward model that a short GRPO run loads with
``reward_model.enable=true reward_model.model.path=<export>`` and whose every rollout score is the
export's own score of that answer (re-computed here with plain transformers); a run killed after a
step resumes and reproduces the uninterrupted run's metrics bitwise (fixed threads); two FSDP2 ranks
train like one; ``--preset builtin``, the recipe that reaches 0.90 on the held-out pairs, learns them
from its first 100 steps on every CPU."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_records import cli_in_process, per_step


pytestmark = pytest.mark.slow

# Ranks against one rank, cuts, resumes and servers are compared within 1e-4-1e-6: float32's sums.
# model.dtype=auto would train bf16-mixed on a CPU with bf16 hardware, whose rounding differs by path.
RUN = [
    "rm.builtin_prompts=128", "dpo.builtin_val_prompts=32", "data.train_batch_size=16", "actor.optim.lr=1e-3",
    "trainer.total_training_steps=6", "trainer.test_freq=3", "trainer.save_freq=2", "trainer.num_threads=1",
    "trainer.logger=[jsonl]",
    # Token-budget micro-batches, packed, cut by pairs: the speed path, not one padded batch.
    "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=256",
    "model.dtype=float32",
]
VOLATILE = ("train/pairs_per_s",)

RM_METRICS = ("train/loss", "rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected", "train/lr", "train/grad_norm")


def cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """``hybridflow <args>``: a run killed at ``fault``, or one of ranks of their own (``trainer.n_workers``), in a
    process of its own; any other in this one (``cli_in_process``)."""
    if fault is None and not any(arg.startswith("trainer.n_workers=") for arg in args):
        return cli_in_process(list(args), env={"OMP_NUM_THREADS": "1"})
    env = {**os.environ, "HYBRIDFLOW_FAULT": fault or "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], capture_output=True, text=True,
                          timeout=900, env=env)


def own_score(export: Path, question: str, answer: str) -> float:
    """The export's score of one answer, by plain transformers on one unpadded chat (its own pooling)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_rm_learns_the_builtin_pairs_and_its_export_scores_a_grpo_run(tmp_path):
    run = tmp_path / "rm"
    # One layer added for the head (rm.extra_layers): the export is the same family with one more layer.
    trained = cli("rm", *RUN, "rm.extra_layers=1", f"trainer.output_dir={run}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    steps = per_step(run, VOLATILE)
    assert sorted(steps) == list(range(7))
    assert steps[0]["val/rm/accuracy"] == 0.0 and steps[0]["val/loss"] == pytest.approx(math.log(2))  # zero head
    # Six steps learn the pairs' direction on every CPU; how well the held-out pairs are ranked is the
    # preset's guard below (these 32 pairs are mostly slips on one CPU, not on another: 0.31 on a Zen 4).
    assert steps[6]["val/loss"] < math.log(2) and steps[6]["val/rm/margin"] > 0, steps[6]
    for name in RM_METRICS:
        assert all(math.isfinite(steps[s][name]) for s in range(1, 7)), name
    assert json.loads((run / "rm_eval.json").read_text())["val/rm/accuracy"] == steps[6]["val/rm/accuracy"]
    export = run / "export"
    exported = json.loads((export / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2ForSequenceClassification"]
    assert exported["num_hidden_layers"] == 4 + 1  # the built-in teacher's four, and the added one

    grpo = tmp_path / "grpo"
    result = cli("train", "reward_model.enable=true", f"reward_model.model.path={export}",
                 "reward_model.combine=replace", "model.dtype=float32",  # scores compared with a float32 forward
                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
                 "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.save_final=false", "trainer.num_threads=1", "trainer.logger=[jsonl]",
                 f"trainer.output_dir={grpo}", f"trainer.rollout_data_dir={grpo / 'rollouts'}")
    assert result.returncode == 0, result.stderr[-3000:]
    records = per_step(grpo, VOLATILE)
    for step in (1, 2):
        record = records[step]
        for name in ("reward_model/score/mean", "reward_model/score/max", "reward_model/score/min",
                     "reward_model/truncated_fraction", "timing_s/reward_model"):
            assert math.isfinite(record[name]), (step, name)
        assert record["critic/score/mean"] == pytest.approx(record["reward_model/score/mean"], abs=1e-6)
    samples = [json.loads(line) for line in (grpo / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples[:8]:
        question = sample["prompt"].split("user\n", 1)[1].split("\n", 1)[0]  # the built-in prompt's one user turn
        expected = own_score(export, question, sample["response"])
        assert sample["rm_score"] == pytest.approx(expected, abs=1e-4), sample
        assert sample["score"] == sample["rm_score"]  # combine=replace: the reward is the model's score


def test_a_killed_rm_run_resumes_bitwise(tmp_path):
    reference = cli("rm", *RUN, "rm.export=false", f"trainer.output_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = per_step(tmp_path / "ref", VOLATILE)
    out = tmp_path / "killed"
    killed = cli("rm", *RUN, "rm.export=false", f"trainer.output_dir={out}", fault="after_step@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = cli("rm", *RUN, "rm.export=false", f"trainer.output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "global_step_2" in resumed.stderr
    assert per_step(out, VOLATILE) == expected  # bitwise: every metric of every step


def test_two_ranks_train_like_one(tmp_path):
    steps = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_final=false", "rm.export=false",
             "trainer.val_before_train=false"]
    one = cli("rm", *RUN, *steps, f"trainer.output_dir={tmp_path / 'one'}")
    two = cli("rm", *RUN, *steps, "trainer.n_workers=2", f"trainer.output_dir={tmp_path / 'two'}")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = per_step(tmp_path / "one", VOLATILE), per_step(tmp_path / "two", VOLATILE)
    for step in (1, 2):
        for key in ("train/loss", "rm/margin", "rm/chosen", "rm/accuracy"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)
        assert b[step]["train/grad_norm"] == pytest.approx(a[step]["train/grad_norm"], rel=1e-4)
    assert b[2]["val/loss"] == pytest.approx(a[2]["val/loss"], abs=1e-4)


# The built-in pairs are the warm start's own wrong answers, and the warm start depends on the CPU's float
# rounding (docs/figures.md: its held-out score starts at 0.227 on the Xeon with AMX, 0.246 on a Zen 4), so the
# held-out pairs differ by CPU: on an AMD EPYC Zen 4 150 of the 256 are the teacher's one-digit slip, which the
# default command ranks 0.527 at step 30 (the Xeon's pairs: 0.793). The preset (hybridflow rm --preset builtin)
# is the recipe that learns the slips; its 1,000 steps (~6.5 CPU-minutes) reach >= 0.90 (README), too long for
# CI. Its lr is constant, so its first GUARD_STEPS steps are exactly the full run's: guarded here, on every CPU.
GUARD_STEPS = 100
GUARD_MIN = 0.6  # the Zen 4's slip-heavy pairs: 0.645 at step 100 (seed 1; 0.629 / 0.590 for seeds 2 / 3)


def test_the_builtin_preset_ranks_held_out_pairs_above_chance_within_100_steps(tmp_path):
    """A guard on ``hybridflow rm --preset builtin`` (two added layers, every training question, float32): its
    first GUARD_STEPS steps rank at least GUARD_MIN of the 256 held-out pairs right; below it something that
    learning depends on broke (chance is 0.5; a zero head ties every pair, 0)."""
    run = tmp_path / "rm"
    trained = cli("rm", "--preset", "builtin", f"trainer.total_training_steps={GUARD_STEPS}",
                  f"trainer.test_freq={GUARD_STEPS}", "trainer.num_threads=1", "trainer.logger=[jsonl]",
                  "rm.export=false", f"trainer.output_dir={run}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    evaluated = json.loads((run / "rm_eval.json").read_text())
    assert evaluated["val_pairs"] == 256  # the whole held-out set, never a slice of it
    assert evaluated["val/rm/accuracy"] >= GUARD_MIN, evaluated
