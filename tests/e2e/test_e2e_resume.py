"""Kill the trainer with SIGKILL at chosen moments (after a step, mid checkpoint write, at an
epoch boundary), resume each time, and require the per-step metrics of an uninterrupted run,
bitwise. Plus damaged checkpoints: truncated files and planted pickles."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from run_records import cli_in_process, per_step

pytestmark = pytest.mark.slow

# 64 prompts / 8 per step = 8 steps per epoch: step 8 ends epoch 0.
RUN = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.n=4", "data.max_response_length=4", "trainer.total_epochs=2", "trainer.total_training_steps=10", "trainer.test_freq=5",
    "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2", "trainer.num_threads=1", "trainer.progress_bar=false",
    "trainer.logger=[jsonl]", "actor.optim.lr=1e-3", "actor.ppo_epochs=2", "actor.shuffle=true",
]


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=16)
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def train(out: Path, files: list[str], fault: str | None = None, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``hybridflow train``: a run killed at ``fault`` in a process of its own, any other in this one."""
    args = ["train", *files, *RUN, f"trainer.output_dir={out}", *extra]
    if fault is None:
        return cli_in_process(args)
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HYBRIDFLOW_FAULT": fault})


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


def test_kill_and_resume_with_a_critic_reproduces_the_uninterrupted_run(user_files, tmp_path):
    """PPO with a critic: the critic's weights, Adam moments, schedule and shuffle order come back
    from the checkpoint too, so every metric (the critic's included) matches bitwise. Shorter
    than the test above: one kill after a step, one mid checkpoint write, a critic warm-up step.
    The killed run saves sharded checkpoints (the reference the full format): the two formats
    resume alike."""
    ppo = ("algorithm.adv_estimator=gae", "trainer.total_training_steps=4", "critic.shuffle=true",
           "critic.optim.lr=3e-3", "trainer.critic_warmup=1", "trainer.test_freq=2")
    reference = train(tmp_path / "ref", user_files, extra=ppo)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert (tmp_path / "ref" / "checkpoints" / "global_step_4" / "critic" / "optim.pt").is_file()

    out, sharded = tmp_path / "killed", (*ppo, "trainer.checkpoint_format=sharded")
    for fault in ("after_step@1", "checkpoint_write@3"):
        killed = train(out, user_files, fault, extra=sharded)
        assert killed.returncode == -signal.SIGKILL, (fault, killed.stderr[-3000:])
    final = train(out, user_files, extra=sharded)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resumed from" in final.stderr
    assert (out / "checkpoints" / "global_step_4" / "critic" / "dcp" / ".metadata").is_file()

    expected, got = per_step(tmp_path / "ref"), per_step(out)
    assert sorted(got) == sorted(expected) == list(range(0, 5))
    assert "critic/vf_loss" in expected[4] and "actor/pg_loss" not in expected[1]
    for step in expected:
        assert got[step] == expected[step], f"step {step} differs after kill-and-resume"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_damaged_checkpoints_are_named_and_pickles_never_run(user_files, tmp_path):
    from hybridflow.controller.checkpoint import write_manifest

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    first = train(out, user_files, extra=("trainer.total_training_steps=2",))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = ckpts / "global_step_2"

    # A truncated weights file in the newest checkpoint: auto-resume names it and falls back to step 1.
    weights = next((ckpt / "actor").rglob("*.safetensors"))
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])
    damaged_2 = snapshot(ckpt)
    resumed = train(out, user_files, extra=("trainer.total_training_steps=3",))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{weights.name} is truncated" in resumed.stderr
    assert "resumed from" in resumed.stderr and "global_step_1" in resumed.stderr
    # Saving step 2 again moved the damaged one aside, whole: never deleted.
    assert snapshot(ckpts / "damaged-global_step_2") == damaged_2

    # resume_mode=path on a checkpoint whose optimizer state was replaced by a malicious pickle:
    # the manifest catches it, and the payload never runs.
    ckpt3 = ckpts / "global_step_3"
    marker = tmp_path / "pwned"
    optim = next((ckpt3 / "actor").rglob("optim.pt"))
    optim.write_bytes(pickle.dumps(_Payload(str(marker))))
    refused = train(out, user_files, extra=("trainer.total_training_steps=4", "trainer.resume_mode=path",
                                            f"trainer.resume_from_path={ckpt3}"))
    assert refused.returncode != 0
    assert "optim.pt is" in refused.stderr and "manifest" in refused.stderr
    assert not marker.exists()

    # The same pickle with a manifest rewritten to match: verification passes, the loader refuses
    # it (weights_only), and auto-resume falls back to the next checkpoint, saying why.
    write_manifest(ckpt3)
    fallback = train(out, user_files, extra=("trainer.total_training_steps=4",))
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "skipping checkpoint" in fallback.stderr and "optim.pt: refused to load optimizer state" in fallback.stderr
    assert "Traceback" not in fallback.stderr
    assert f"resumed from {ckpts / 'global_step_2'} at step 2" in fallback.stderr
    assert not marker.exists()
    assert (ckpts / "damaged-global_step_3" / "actor" / "optim.pt").read_bytes() == pickle.dumps(_Payload(str(marker)))

    # Every checkpoint damaged: refuse with one line naming them and how to start fresh; exit 1,
    # no step trained, nothing deleted.
    for name in ("global_step_3", "global_step_4"):
        w = next((ckpts / name / "actor").rglob("*.safetensors"))
        w.write_bytes(w.read_bytes()[:100])
    before = snapshot(ckpts)
    logged = per_step(out)
    stuck = train(out, user_files, extra=("trainer.total_training_steps=5",))
    assert stuck.returncode == 1, stuck.stderr[-3000:]
    last = stuck.stderr.strip().splitlines()[-1]
    assert f"none of the 2 checkpoint(s) under {ckpts} verifies and loads" in last
    assert "global_step_4: checkpoint file" in last and "trainer.resume_mode=disable" in last
    assert "Traceback" not in stuck.stderr
    assert snapshot(ckpts) == before
    assert per_step(out) == logged


class _Payload:
    """Unpickling this would create a file: the test checks it never happens."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((ckpt / "actor").rglob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_a_nan_step_is_skipped_and_leaves_the_weights_unchanged(user_files, tmp_path):
    out = tmp_path / "nan"
    done = cli_in_process(["train", *user_files, *RUN, f"trainer.output_dir={out}", "trainer.total_training_steps=3",
                           "trainer.max_ckpt_to_keep=null"], env={"HYBRIDFLOW_FAULT": "nan_advantages@2"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = per_step(out)
    # ppo_epochs=2 x 2 mini-batches = 4 optimizer steps per training step, all skipped at step 2.
    assert [records[s]["actor/skipped_steps"] for s in (1, 2, 3)] == [0.0, 4.0, 4.0]
    w1, w2, w3 = (_weights(out / "checkpoints" / f"global_step_{s}") for s in (1, 2, 3))
    assert all((w1[k] == w2[k]).all() for k in w1), "a skipped step must not move the weights"
    assert any((w2[k] != w3[k]).any() for k in w2), "the next good step trains again"


def test_too_many_consecutive_skips_abort_with_a_clear_message(user_files, tmp_path):
    done = cli_in_process(["train", *user_files, *RUN, f"trainer.output_dir={tmp_path / 'abort'}",
                           "trainer.max_consecutive_skips=3"], env={"HYBRIDFLOW_FAULT": "nan_advantages@2"})
    assert done.returncode != 0
    assert "optimizer steps in a row had a non-finite loss" in done.stderr
    assert "actor rank 0 failed in ActorWorker.update_actor" in done.stderr


def test_ctrl_c_saves_a_checkpoint_and_exits_130(user_files, tmp_path):
    out = tmp_path / "sigint"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli", "train", *user_files, *RUN, f"trainer.output_dir={out}",
         "trainer.save_freq=100", "trainer.total_training_steps=50", "trainer.total_epochs=10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and '"step": 1' in metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopped: SIGINT after step" in stderr and "saved checkpoint" in stderr
    stopped_at = max(per_step(out))
    assert 1 <= stopped_at < 50
    assert (out / "checkpoints" / f"global_step_{stopped_at}" / "manifest.json").is_file()


def test_export_writes_a_hugging_face_model_that_generates_like_the_checkpoint(user_files, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
    from hybridflow.rollout import EngineArgs, build_rollout_engine
    from hybridflow.types import GenerationRequest, SamplingParams

    out = tmp_path / "run"
    done = train(out, user_files, extra=("trainer.total_training_steps=2", "actor.optim.lr=3e-3"))
    assert done.returncode == 0, done.stderr[-3000:]
    export_dir = tmp_path / "exported"
    exported = cli_in_process(["export", str(out), str(export_dir)])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (export_dir / "config.json").is_file() and list(export_dir.glob("*.safetensors"))
    assert not list(export_dir.rglob("optim.pt"))
    again = cli_in_process(["export", str(out), str(export_dir)])
    assert again.returncode == 1 and "not empty" in again.stderr

    ckpt_model = out / "checkpoints" / "global_step_2" / "actor" / "model"
    tokenizer = load_tokenizer(str(ckpt_model))
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)
        for q in ("12+34=", "70-21=", "5+5=")
    ]
    engine = build_rollout_engine("native", EngineArgs(
        model=load_causal_lm(str(ckpt_model)), eos_token_ids=eos_token_ids(str(ckpt_model), tokenizer),
        pad_token_id=tokenizer.pad_token_id, max_batch_size=8, device="cpu", dtype="float32"))
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    ours = [s[0].response_ids for s in engine.generate_batch([GenerationRequest(prompt_ids=p, params=greedy) for p in prompts])]

    hf_tok = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True).eval()
    for prompt, expected in zip(prompts, ours, strict=True):
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                          eos_token_id=eos_token_ids(str(export_dir), hf_tok), pad_token_id=hf_tok.pad_token_id)
        assert generated[0, len(prompt):].tolist()[: len(expected)] == expected
