"""The implicit PRM's worker: its token rewards are 0 while φ is its reference, and trained on a fixed batch its
loss falls and its sequence rewards come to separate the right answers from the wrong ones; micro-batching
does not change the step."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.config.schema import PrimeConfig
from hybridflow.models.tiny import write_tiny_model
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories
from hybridflow.workers.prime import ImplicitPRMWorker, PrimeSetup
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("prime") / "model"))


def _prm(model_dir: str, micro: int = 8, lr: float = 1e-3) -> ImplicitPRMWorker:
    cfg = PrimeConfig(beta=0.5, micro_batch_size_per_gpu=micro)
    cfg.optim.lr = lr
    setup = PrimeSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), total_optimizer_steps=100,
                       max_response_length=6, max_prompt_length=4)
    return ImplicitPRMWorker(0, 1, cfg, setup)


def _batch(model_dir: str) -> TrainBatch:
    """Two prompts, four samples each, half right (score 1) and half wrong, with the reference's logprobs."""
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(8):
        ids = torch.randint(0, 256, (4 + 2 + i % 3,), generator=g).tolist()
        r = len(ids) - 4
        trajectories.append(Trajectory(ids[:4], ids[4:], [1] * r, [-1.0] * r, "stop", reward=float(i % 2),
                                       group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=256)
    ref = ReferenceWorker(0, 1, ReferenceSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"),
                                               temperature=1.0, micro_batch_size=8))
    batch.ref_logprobs = ref.compute_ref_logprobs(batch)
    return batch


def test_rewards_start_at_zero_and_training_separates_right_from_wrong(model_dir):
    prm, batch = _prm(model_dir), _batch(model_dir)
    assert prm.compute_token_rewards(batch).abs().max() < 1e-5  # φ is its reference
    first = prm.update_prm(batch)
    assert first["prime/loss"] == pytest.approx(math.log(2), abs=1e-5)
    for _ in range(10):
        last = prm.update_prm(batch)
    assert last["prime/loss"] < 0.3 and last["prime/acc"] == 1.0
    sequence = prm.compute_token_rewards(batch).sum(dim=-1)
    right, wrong = sequence[batch.rewards > 0.5], sequence[batch.rewards <= 0.5]
    assert right.min() > 0 > wrong.max(), sequence


def test_micro_batches_do_not_change_the_step(model_dir):
    batch = _batch(model_dir)
    whole, cut = _prm(model_dir, micro=8), _prm(model_dir, micro=3)
    a, b = whole.update_prm(batch), cut.update_prm(batch)
    assert a["prime/grad_norm"] == pytest.approx(b["prime/grad_norm"], rel=1e-5)
    assert a["prime/loss"] == pytest.approx(b["prime/loss"], rel=1e-5)
    assert torch.allclose(whole.compute_token_rewards(batch), cut.compute_token_rewards(batch), atol=1e-6)
