"""Σ_v π(v)² per response token from the engine's old-logprob pass (the optimal-token-baseline
estimators' input): equal to the softmax of the model's own logits, padded or packed, fused head
or logits path, fixed or token-budget micro-batches, from the same forward as the logprobs."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training.engine import TrainEngine
from hybridflow.training.micro_batches import num_token_budget_micro_batches, token_budget_micro_batches
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories

PAD = 256
TEMPERATURE = 0.8
TOLERANCE = 1e-5  # fp32: the paths differ only in summation order


@pytest.fixture(scope="module", autouse=True)
def threads():
    torch.set_num_threads(1)


def random_batch(seed: int = 11, num: int = 10) -> TrainBatch:
    """Mixed prompt and response lengths, one empty response, tool tokens (loss mask 0) in one."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(num):
        lp = int(torch.randint(1, 10, (1,), generator=g))
        lr = 0 if i == 4 else int(torch.randint(1, 25, (1,), generator=g))
        ids = torch.randint(0, 256, (lp + lr,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:lp], ids[lp:], [1] * lr, [0.0] * lr, "stop", group_id=i // 2))
    trajectories[1].loss_mask[:2] = [0, 0]
    return collate_trajectories(trajectories, pad_token_id=PAD)


def direct(engine: TrainEngine, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and Σπ² from the full (B, R, V) softmax of the model's logits, one row at a time
    (each sample unpadded), independent of the engine's kernels.  # (B, R)"""
    logprobs = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
    spi = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
    p = batch.prompt_length
    with torch.no_grad():
        for i in range(batch.batch_size):
            ids = batch.input_ids[i, batch.attention_mask[i].bool()]
            r = int(batch.attention_mask[i, p:].sum())
            if r == 0:
                continue
            logits = engine.model(input_ids=ids[None]).logits[0, -r - 1 : -1].double() / TEMPERATURE  # (r, V)
            probs = torch.softmax(logits, dim=-1)
            logprobs[i, :r] = probs.log().gather(-1, ids[-r:, None])[:, 0]
            spi[i, :r] = (probs**2).sum(dim=-1)
    return logprobs, spi


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_sum_pi_squared_matches_the_softmax_of_the_model_logits(model, fused, packed):
    engine = TrainEngine(model, None, torch.device("cpu"), fused_lm_head=fused)
    assert engine.fused_lm_head == fused
    batch = random_batch()
    want_lp, want_spi = direct(engine, batch)
    stats = engine.compute_token_stats(batch, temperature=TEMPERATURE, micro_batch_size=3, with_sum_pi_squared=True,
                                       use_remove_padding=packed)
    assert stats.entropy is None and stats.sum_pi_squared.shape == batch.response_mask.shape
    valid = batch.attention_mask[:, batch.prompt_length :].bool()
    assert (stats.sum_pi_squared[valid].double() - want_spi[valid]).abs().max() < TOLERANCE
    assert (stats.logprobs[valid].double() - want_lp[valid]).abs().max() < TOLERANCE
    assert bool(((stats.sum_pi_squared[valid] > 0) & (stats.sum_pi_squared[valid] <= 1)).all())
    if packed:
        assert bool((stats.sum_pi_squared[~valid] == 0).all())
    # The logprobs are those of the plain pass: asking for Σπ² changes nothing else.
    plain, _ = engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=3, use_remove_padding=packed)
    assert torch.equal(plain, stats.logprobs)


@pytest.mark.parametrize("packed", [False, True])
def test_sum_pi_squared_comes_back_in_row_order_from_token_budget_micro_batches(model, packed):
    engine = TrainEngine(model, None, torch.device("cpu"))
    batch = random_batch(seed=12, num=12)
    _, partitions = token_budget_micro_batches(batch, 60, padded=not packed)
    assert len(partitions) > 2 and partitions != sorted(partitions)  # reordered: restoring the order is tested
    reference = engine.compute_token_stats(batch, temperature=TEMPERATURE, micro_batch_size=12,
                                           with_sum_pi_squared=True, with_entropy=True)
    stats = engine.compute_token_stats(
        batch, temperature=TEMPERATURE, with_sum_pi_squared=True, with_entropy=True, use_remove_padding=packed,
        max_token_len=60, num_micro_batches=num_token_budget_micro_batches(batch, 60, padded=not packed) + 1,
    )
    valid = batch.attention_mask[:, batch.prompt_length :].bool()
    for got, want in zip(stats, reference, strict=True):
        assert (got[valid] - want[valid]).abs().max() < TOLERANCE
