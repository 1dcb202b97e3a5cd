"""On-policy distillation end to end through the CLI: a tiny student learns from a teacher model of its own
tokenizer, logs the per-token reverse KL, and a run stopped after step 2 and resumed reproduces the
uninterrupted run's step 3 bitwise (the teachers are frozen, loaded from their path again). A teacher with
another tokenizer is refused before any worker starts, naming its key and the difference. The built-in teacher
behind `hybridflow serve` (prompt logprobs over HTTP) gives the same step 1 as the same teacher loaded locally."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hybridflow.cli import main as cli_main
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from run_records import cli_in_process, per_step

pytestmark = pytest.mark.slow

# Ranks against one rank, cuts, resumes and servers are compared within 1e-4-1e-6: float32's sums.
# model.dtype=auto would train bf16-mixed on a CPU with bf16 hardware, whose rounding differs by path.
RUN = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=4",
       "distillation.enable=true", "distillation.reward_weight=0.5", "trainer.val_before_train=false",
       "trainer.test_freq=0", "trainer.save_freq=1", "trainer.save_final=false", "trainer.num_threads=1",
       "trainer.progress_bar=false", "trainer.logger=[jsonl]", "actor.optim.lr=1e-2", "model.dtype=float32"]


def train(out: Path, files: list[str], steps: int) -> subprocess.CompletedProcess:
    """``hybridflow train`` in this process (``cli_in_process``): nothing here kills a run."""
    return cli_in_process(["train", *files, *RUN, f"trainer.total_training_steps={steps}", f"trainer.output_dir={out}"])


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str) -> Iterator[str]:
    """``hybridflow serve *args`` on a free port until the block ends; yields its OpenAI base URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "serve", *args, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # builds (and caches) the built-in teacher first
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "hybridflow serve did not answer /health within 300 s"
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_teacher_behind_hybridflow_serve_gives_the_local_teachers_step_one(tmp_path) -> None:
    """The built-in teacher (a short recipe, cached in the run's cache) as a local worker group and behind
    `hybridflow serve`: step 1 is the same run up to float rounding (the native engine's prefill vs the
    reference worker's forward, both fp32), and the server's counters report no failure."""
    # The teacher's recipe reads these: the server and the runs must name the same (one cached) teacher.
    builtin = [f"warm_start.cache_dir={tmp_path / 'cache'}", "warm_start.steps=4", "distillation.builtin_teacher_steps=4",
               "data.builtin_train_size=64"]
    student = ["model.path=builtin:tiny", "data.builtin_val_size=4", *builtin]

    def step_one(out: Path, teacher: str) -> dict:
        # Through the CLI's main in this process: torch and transformers are imported already, which a process
        # of its own spends most of a one-step run on.
        assert cli_main(["train", *student, *RUN, f"distillation.teacher.path={teacher}",
                         "trainer.total_training_steps=1", "trainer.save_freq=0", f"trainer.output_dir={out}"]) == 0
        return per_step(out)[1]

    with serving("builtin:tiny-teacher", *builtin) as url:
        served = step_one(tmp_path / "served", url)
    local = step_one(tmp_path / "local", "builtin:tiny-teacher")
    assert served["distill/teacher/failures"] == 0 and served["distill/teacher/retries"] == 0
    assert local["distill/reverse_kl"] != 0
    shared = sorted(set(local) & set(served))
    assert "distill/reverse_kl" in shared and "critic/advantages/mean" in shared and "actor/pg_loss" in shared
    different = {key: (local[key], served[key]) for key in shared if isinstance(local[key], (int, float))
                 and not math.isclose(local[key], served[key], rel_tol=1e-4, abs_tol=1e-5)}
    assert not different, different
