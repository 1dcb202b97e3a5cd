"""On-policy distillation end to end through the CLI: a tiny student learns from a teacher model of its own
tokenizer, logs the per-token reverse KL, and a run stopped after step 2 and resumed reproduces the
uninterrupted run's step 3 bitwise (the teachers are frozen, loaded from their path again). A teacher with
another tokenizer is refused before any worker starts, naming its key and the difference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from run_records import per_step

pytestmark = pytest.mark.slow

RUN = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=4",
       "distillation.enable=true", "distillation.reward_weight=0.5", "trainer.val_before_train=false",
       "trainer.test_freq=0", "trainer.save_freq=1", "trainer.save_final=false", "trainer.num_threads=1",
       "trainer.progress_bar=false", "trainer.logger=[jsonl]", "actor.optim.lr=1e-2"]


def train(out: Path, files: list[str], steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", *files, *RUN, f"trainer.total_training_steps={steps}",
         f"trainer.output_dir={out}"], capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("distill")
    student, teacher = write_tiny_model(root / "student", seed=0), write_tiny_model(root / "teacher", seed=1)
    train_file, val_file = write_arithmetic_task(root / "data", train_size=16, val_size=4)
    return [f"model.path={student}", f"distillation.teacher.path={teacher}", f"data.train_files=[{train_file}]",
            f"data.val_files=[{val_file}]"]


def test_distillation_runs_logs_the_reverse_kl_and_resumes_bitwise(tmp_path, files) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for out, steps in ((whole, 3), (cut, 2), (cut, 3)):  # the second "cut" run resumes after step 2
        done = train(out, files, steps)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resum" in done.stderr.lower(), done.stderr[-3000:]
    uninterrupted, resumed = per_step(whole), per_step(cut)
    assert sorted(uninterrupted) == sorted(resumed) == [1, 2, 3]
    kl = [uninterrupted[step]["distill/reverse_kl"] for step in (1, 2, 3)]
    assert kl[0] > 0 and kl[2] < kl[0], kl  # two random models disagree, and the student moves to its teacher
    assert all("timing_s/teacher" in json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines())
    assert resumed[3] == uninterrupted[3]  # bitwise: every metric of the resumed step


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, files) -> None:
    teacher = write_tiny_model(tmp_path / "teacher", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(teacher)
    done = train(tmp_path / "run", [*files, f"distillation.teacher.path={teacher}"], steps=1)
    assert done.returncode != 0
    assert "distillation.teacher.path" in done.stderr and "does not share the student's tokenizer" in done.stderr
    assert "'<teacher-only>'" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
