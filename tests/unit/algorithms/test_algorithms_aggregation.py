"""Loss aggregation modes and their invariance to micro-batch and data-parallel splits."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, batch_counts
from hybridflow.algorithms.core import UnknownNameError

torch.set_num_threads(1)

# Row 2 is fully masked: it counts as no token and no sequence.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum", 3.5),  # sequence sums 3 and 4 → mean over 2 non-empty sequences
        ("seq-mean-token-mean", 2.75),  # sequence means 1.5 and 4 → 2.75
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / R (= 3)
    ],
)
def test_modes_local(mode: str, expected: float) -> None:
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_loss_scale_factor_and_global_counts() -> None:
    # seq-mean-token-sum 3.5 / 7 = 0.5
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(0.5)
    # with a mini-batch of 14 tokens / 4 sequences elsewhere: 7 / 14, (3 + 4) / 4
    assert agg_loss(LOSS, MASK, "token-mean", global_num_tokens=14).item() == pytest.approx(0.5)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=4).item() == pytest.approx(1.75)
    assert agg_loss(LOSS, MASK, "token-mean", global_num_tokens=14, dp_size=2).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "token-sum", dp_size=2).item() == pytest.approx(14.0)


def test_all_masked_gives_a_connected_zero() -> None:
    loss_mat = LOSS.clone().requires_grad_(True)
    for mode in LOSS_AGG_MODES:
        loss = agg_loss(loss_mat, torch.zeros_like(MASK), mode)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.isfinite(loss_mat.grad).all()
        loss_mat.grad = None


def _mini_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (B, R) leaf, inputs (B, R), mask (B, R)) with ragged masks and one empty row."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(8, 5, generator=generator)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    weights = torch.randn(8, 5, generator=generator).requires_grad_(True)
    return weights, inputs, mask


def _loss_mat(weights: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return (weights * inputs).tanh() * 3.0  # non-linear, so gradients differ per token


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_mini_batch(mode: str) -> None:
    weights, inputs, mask = _mini_batch()
    kwargs = {"loss_scale_factor": 5.0}
    whole = agg_loss(_loss_mat(weights, inputs), mask, mode, **kwargs)
    (whole_grad,) = torch.autograd.grad(whole, weights)

    num_tokens, num_seqs = batch_counts(mask)
    assert (num_tokens, num_seqs) == (21, 7)
    total = torch.zeros(())
    for rows in (slice(0, 3), slice(3, 8)):  # unequal micro-batches
        total = total + agg_loss(
            _loss_mat(weights[rows], inputs[rows]),
            mask[rows],
            mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            **kwargs,
        )
    (split_grad,) = torch.autograd.grad(total, weights)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(split_grad, whole_grad)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_data_parallel_ranks_average_to_the_mini_batch(mode: str) -> None:
    weights, inputs, mask = _mini_batch(seed=1)
    whole = agg_loss(_loss_mat(weights, inputs), mask, mode, loss_scale_factor=5.0)
    (whole_grad,) = torch.autograd.grad(whole, weights)

    num_tokens, num_seqs = batch_counts(mask)  # what an all-reduce over ranks would give
    dp_size = 2
    rank_losses, rank_grads = [], []
    for rank_rows in (slice(0, 4), slice(4, 8)):
        rank_loss = torch.zeros(())
        # each rank accumulates two micro-batches
        start, stop = rank_rows.start, rank_rows.stop
        for rows in (slice(start, start + 1), slice(start + 1, stop)):
            rank_loss = rank_loss + agg_loss(
                _loss_mat(weights[rows], inputs[rows]),
                mask[rows],
                mode,
                global_num_tokens=num_tokens,
                global_num_seqs=num_seqs,
                loss_scale_factor=5.0,
                dp_size=dp_size,
            )
        (grad,) = torch.autograd.grad(rank_loss, weights)
        rank_losses.append(rank_loss.detach())
        rank_grads.append(grad)
    # DDP/FSDP all-reduce averages gradients over ranks
    torch.testing.assert_close(sum(rank_grads) / dp_size, whole_grad)
    torch.testing.assert_close(sum(rank_losses) / dp_size, whole.detach())


def test_errors_name_the_problem() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown loss_agg_mode 'token_mean'.*Did you mean 'token-mean'\?"):
        agg_loss(LOSS, MASK, "token_mean")
    with pytest.raises(ValueError, match="needs global_num_tokens"):
        agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="needs global_num_seqs"):
        agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="shape mismatch"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)
