"""Preemption loses nothing: SIGTERM (a scheduler's, or a reward function's) finishes the step, saves a
checkpoint and exits 143 naming it; the run resumed from it reproduces the uninterrupted run
bitwise; a second SIGTERM, even in the middle of a save, stops at once and leaves the newest
checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.controller.checkpoint import verify_checkpoint
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from run_records import per_step

pytestmark = pytest.mark.slow

RUN = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=4",
    "trainer.total_training_steps=4", "trainer.test_freq=2", "trainer.save_freq=100", "trainer.num_threads=1",
    "trainer.progress_bar=false", "trainer.logger=[jsonl]", "actor.optim.lr=1e-3", "actor.shuffle=true",
]
# A reward function that sends its trainer SIGTERM once (the first call), then scores normally.
SIGNALLING_REWARD = """
import os, signal
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    sent = Path(__file__).with_suffix(".sent")
    if not sent.exists():
        sent.write_text("")
        os.kill(os.getppid(), signal.SIGTERM)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=8)
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def start(out: Path, files: list[str], fault: str = "", *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli", "train", *files, *RUN, f"trainer.output_dir={out}", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "HYBRIDFLOW_FAULT": fault},
    )


def finish(run: subprocess.Popen) -> tuple[int, list[str]]:
    _, stderr = run.communicate(timeout=600)
    return run.returncode, stderr.strip().splitlines()


@pytest.fixture(scope="module")
def reference(user_files, tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("reference") / "run"
    code, lines = finish(start(out, user_files))
    assert code == 0, lines[-30:]
    return per_step(out)


def resume_and_compare(out: Path, files: list[str], reference: dict[int, dict]) -> None:
    code, lines = finish(start(out, files))
    assert code == 0, lines[-30:]
    assert any("resumed from" in line for line in lines)
    got = per_step(out)
    assert sorted(got) == sorted(reference) == [0, 1, 2, 3, 4]
    for step in reference:
        assert got[step] == reference[step], f"step {step} differs from the uninterrupted run"


def test_sigterm_mid_run_saves_exits_143_naming_the_checkpoint_and_the_resume_reproduces_the_run(
    user_files, reference, tmp_path
):
    out = tmp_path / "run"
    run = start(out, user_files)
    while not ((out / "metrics.jsonl").is_file() and '"step": 1' in (out / "metrics.jsonl").read_text()):
        assert run.poll() is None, finish(run)[1][-30:]
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    code, lines = finish(run)
    assert code == 143, lines[-30:]
    stopped = max(per_step(out))
    ckpt = out / "checkpoints" / f"global_step_{stopped}"
    assert lines[-1] == (f"stopped: SIGTERM after step {stopped} of 4; saved checkpoint {ckpt}: run the same command "
                         "again to resume")
    verify_checkpoint(ckpt)
    resume_and_compare(out, user_files, reference)


def test_two_sigterms_in_the_middle_of_a_save_stop_at_once_and_corrupt_nothing(user_files, reference, tmp_path):
    out = tmp_path / "run"
    # Checkpoints after steps 1 and 2; both signals arrive while checkpoint 2's files are written.
    fault = "checkpoint_write@2:TERM,checkpoint_write@2:TERM"
    code, lines = finish(start(out, user_files, fault, "trainer.save_freq=1"))
    assert code == 143, lines[-30:]
    newest = out / "checkpoints" / "global_step_1"
    assert lines[-1] == ("stopped at once (a second SIGTERM), abandoning the step in hand: the same command resumes "
                         f"from the newest checkpoint, {newest}")
    assert not (out / "checkpoints" / "global_step_2").exists()
    assert list((out / "checkpoints").glob(".tmp-global_step_2-*"))  # the save cut short left its folder
    verify_checkpoint(newest)
    resume_and_compare(out, user_files, reference)
    assert not list((out / "checkpoints").glob(".tmp-*"))  # which the next start removed


def test_sigterm_in_the_middle_of_a_save_completes_it_then_stops(user_files, tmp_path):
    out = tmp_path / "run"
    code, lines = finish(start(out, user_files, "checkpoint_write@2:TERM", "trainer.save_freq=1"))
    assert code == 143, lines[-30:]
    ckpt = out / "checkpoints" / "global_step_2"
    assert lines[-1].startswith(f"stopped: SIGTERM after step 2 of 4; saved checkpoint {ckpt}:")
    verify_checkpoint(ckpt)


def test_a_reward_function_that_signals_its_trainer_gets_the_graceful_stop_not_a_death(user_files, tmp_path):
    reward = tmp_path / "signalling.py"
    reward.write_text(SIGNALLING_REWARD)
    out = tmp_path / "run"
    code, lines = finish(start(out, user_files, "", f"reward.custom_reward_function.path={reward}",
                               "trainer.val_before_train=false"))
    assert code == 143, lines[-30:]
    assert (tmp_path / "signalling.sent").is_file()
    assert lines[-1].startswith("stopped: SIGTERM after step 1 of 4; saved checkpoint ")
    verify_checkpoint(out / "checkpoints" / "global_step_1")


def test_a_job_wide_sigterm_on_ray_reaches_every_process_and_the_run_still_saves(user_files, tmp_path):
    """A scheduler signals the whole job (its process group): the Ray cluster the run started (GCS,
    raylet, the rank processes) gets SIGTERM too. They must outlive it, so that the controller
    finishes the step with its ranks and saves; before, the GCS died with the signal and the run
    ended after a minute with exit 1 and no checkpoint."""
    pytest.importorskip("ray")
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli", "train", *user_files, *RUN, f"trainer.output_dir={out}",
         "trainer.backend=ray", "trainer.n_workers=2", "trainer.total_training_steps=8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)  # a job of its own
    while not ((out / "metrics.jsonl").is_file() and '"step": 1' in (out / "metrics.jsonl").read_text()):
        assert run.poll() is None, finish(run)[1][-30:]
        time.sleep(0.1)
    group = os.getpgid(run.pid)
    assert len(subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()) > 3
    os.killpg(group, signal.SIGTERM)
    code, lines = finish(run)
    assert code == 143, lines[-30:]
    stopped = max(per_step(out))
    ckpt = out / "checkpoints" / f"global_step_{stopped}"
    assert lines[-1].startswith(f"stopped: SIGTERM after step {stopped} of 8; saved checkpoint {ckpt}:"), lines[-30:]
    verify_checkpoint(ckpt)
    deadline = time.monotonic() + 60  # and the cluster still ends with its driver
    while subprocess.run(["pgrep", "-g", str(group)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the run's Ray processes outlived it"
        time.sleep(1)
