"""The training engine against the rollout engine and against itself."""

import copy

import pytest
import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.inference.native import NativeEngine
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import GenerationRequest, SamplingParams, collate_trajectories

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


@pytest.fixture(scope="module", autouse=True)
def threads():
    torch.set_num_threads(1)


def sampled_trajectories(model, temperature):
    engine = NativeEngine(model=copy.deepcopy(model), eos_token_ids=[258], pad_token_id=256, max_batch_size=64)
    requests = [GenerationRequest([257, 10 + i, 20 + 2 * i, 30][: 2 + i % 3],
                                  SamplingParams(n=3, temperature=temperature, max_tokens=6, seed=i)) for i in range(4)]
    return [t for group in engine.generate_batch(requests) for t in group]


def test_trainer_logprobs_match_the_rollout_engine():
    """With identical weights, the trainer recomputes the rollout's logprobs (same temperature-
    scaled distribution) to fp32 precision: the basis of every ratio in the policy loss."""
    torch.manual_seed(0)
    model = build_tiny_model(SPEC, seed=3)
    trajectories = sampled_trajectories(model, temperature=0.7)
    batch = collate_trajectories(trajectories, pad_token_id=256)
    engine = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"))
    logprobs, _ = engine.compute_logprobs(batch, temperature=0.7, micro_batch_size=5)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max() < 1e-5


def test_gradient_accumulation_equals_one_big_batch():
    """Micro-batches normalised by the whole mini-batch give the same update as no split."""
    model = build_tiny_model(SPEC, seed=4)
    batch = collate_trajectories(sampled_trajectories(model, temperature=1.0), pad_token_id=256)
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        return agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    results = []
    for micro in (batch.batch_size, 5, 1):
        # lr=0 leaves the accumulated gradients in .grad to compare exactly (Adam's first step
        # is ~lr*sign(g), which would amplify float noise in near-zero gradients).
        engine = TrainEngine(copy.deepcopy(model), OptimSpec(lr=0.0, grad_clip=0.0), torch.device("cpu"))
        metrics = engine.optimizer_step(batch.split(micro), loss_fn, temperature=1.0, with_entropy=False)
        results.append((metrics["actor/grad_norm"], [p.grad.clone() for p in engine.model.parameters()]))
    assert results[0][0] > 0
    for norm, grads in results[1:]:
        assert norm == pytest.approx(results[0][0], rel=1e-5)
        for a, b in zip(grads, results[0][1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_non_finite_gradient_skips_the_step():
    model = build_tiny_model(SPEC, seed=5)
    batch = collate_trajectories(sampled_trajectories(model, temperature=1.0), pad_token_id=256)
    engine = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), torch.device("cpu"))
    before = [p.detach().clone() for p in engine.model.parameters()]

    def nan_loss(mb, logprobs, entropy):
        return logprobs.sum() * float("nan"), {}

    metrics = engine.optimizer_step([batch], nan_loss, temperature=1.0, with_entropy=False)
    assert engine.skipped_steps == 1 and metrics["actor/grad_norm"] != metrics["actor/grad_norm"]
    for a, b in zip(before, engine.model.parameters()):
        assert torch.equal(a, b)
