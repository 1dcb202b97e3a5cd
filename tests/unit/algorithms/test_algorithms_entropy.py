"""Entropy, sampled-token logprobs and Σπ²: values, gradients, chunking, non-contiguous inputs."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.entropy import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)

torch.set_num_threads(1)


def _logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_entropy_matches_categorical() -> None:
    logits = _logits(3, 4, 11)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk_size=5), expected)


def test_entropy_hand_values_and_masked_vocab() -> None:
    # uniform over 4 → log 4; one-hot-ish (others −inf) → 0, not nan
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, float("-inf"), float("-inf"), float("-inf")]])
    expected = torch.tensor([torch.log(torch.tensor(4.0)).item(), 0.0])
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk_size=1), expected)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_chunked_entropy_equals_unchunked_in_value_and_gradient(chunk_size: int) -> None:
    logits = _logits(2, 7, 13, seed=1).requires_grad_(True)
    upstream = torch.randn(2, 7, generator=torch.Generator().manual_seed(2))
    reference = entropy_from_logits(logits)
    (reference_grad,) = torch.autograd.grad((reference * upstream).sum(), logits)
    chunked = entropy_from_logits_chunked(logits, chunk_size=chunk_size)
    (chunked_grad,) = torch.autograd.grad((chunked * upstream).sum(), logits)
    torch.testing.assert_close(chunked, reference)
    torch.testing.assert_close(chunked_grad, reference_grad)


def test_chunked_functions_pass_gradcheck() -> None:
    logits = _logits(3, 5, seed=3).double().requires_grad_(True)
    labels = torch.tensor([0, 4, 2])
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits_chunked(x, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, chunk_size=2), (logits,))


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_logprobs_match_log_softmax_gather(chunk_size: int) -> None:
    logits = _logits(2, 6, 17, seed=4).requires_grad_(True)
    labels = torch.randint(0, 17, (2, 6), generator=torch.Generator().manual_seed(5))
    upstream = torch.randn(2, 6, generator=torch.Generator().manual_seed(6))
    reference = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]
    (reference_grad,) = torch.autograd.grad((reference * upstream).sum(), logits)
    out = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad((out * upstream).sum(), logits)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(grad, reference_grad)


def test_logprob_hand_value() -> None:
    # log softmax([0, log 3])[1] = log(3/4)
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]])
    out = logprobs_from_logits(logits, torch.tensor([1]))
    torch.testing.assert_close(out, torch.log(torch.tensor([0.75])))


def test_sliced_non_contiguous_logits_and_bf16() -> None:
    full = _logits(3, 8, 11, seed=7)
    sliced = full[:, 2:7]  # how response logits are cut out of (B, T, V): not viewable as rows
    assert not sliced.is_contiguous()
    labels = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(entropy_from_logits_chunked(sliced, chunk_size=4), entropy_from_logits(sliced))
    reference = torch.log_softmax(sliced, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(logprobs_from_logits(sliced, labels, chunk_size=4), reference)

    bf16 = sliced.to(torch.bfloat16).requires_grad_(True)
    out = logprobs_from_logits(bf16, labels)
    assert out.dtype == torch.float32  # computed in float32 whatever the logits' dtype
    torch.testing.assert_close(out, torch.log_softmax(bf16.float(), -1).gather(-1, labels[..., None])[..., 0])
    out.sum().backward()
    assert bf16.grad.dtype == torch.bfloat16 and bf16.grad.shape == bf16.shape


def test_bad_arguments() -> None:
    logits = _logits(2, 5)
    with pytest.raises(ValueError, match=r"labels must have the shape of logits without the vocab dim"):
        logprobs_from_logits(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        logprobs_from_logits(logits, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        entropy_from_logits_chunked(logits, chunk_size=0)
    with pytest.raises(ValueError, match="integer token ids"):
        logprobs_from_logits(logits, torch.tensor([0.0, 1.0]))


# --------------------------------------------------------------------------------------------
# Σπ²
# --------------------------------------------------------------------------------------------


def _direct_sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    return (torch.softmax(logits.double(), dim=-1) ** 2).sum(dim=-1)


def test_sum_pi_squared_hand_values_and_masked_vocab() -> None:
    # uniform over 4 → 4·(1/4)² = 1/4; one token left (others −inf) → 1, not nan;
    # logits (log 1, log 3) → probabilities 1/4, 3/4 → 1/16 + 9/16 = 5/8
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, float("-inf"), float("-inf"), float("-inf")],
                           [0.0, float(torch.log(torch.tensor(3.0))), float("-inf"), float("-inf")]])
    expected = torch.tensor([0.25, 1.0, 0.625])
    for chunk_size in (1, 2, 1024):
        torch.testing.assert_close(sum_pi_squared_from_logits(logits, chunk_size=chunk_size), expected)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 14, 15, 1024])
def test_sum_pi_squared_matches_the_direct_softmax_across_chunk_boundaries(chunk_size: int) -> None:
    logits = _logits(2, 7, 13, seed=4)  # 14 rows: chunk sizes below, at and above it
    got = sum_pi_squared_from_logits(logits, chunk_size=chunk_size)
    assert got.shape == (2, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _direct_sum_pi_squared(logits), atol=1e-6, rtol=1e-5)
    assert bool(((got >= 1 / 13 - 1e-6) & (got <= 1 + 1e-6)).all())


def test_sum_pi_squared_of_a_sliced_batch_and_low_precision_logits() -> None:
    logits = _logits(3, 6, 11, seed=5)
    sliced = logits[:, :-1]  # not viewable as (rows, V): walked one leading index at a time
    torch.testing.assert_close(sum_pi_squared_from_logits(sliced, chunk_size=4).double(),
                               _direct_sum_pi_squared(sliced), atol=1e-6, rtol=1e-5)
    half = logits.bfloat16()
    got = sum_pi_squared_from_logits(half, chunk_size=5)
    assert got.dtype == torch.float32  # upcast before the softmax
    torch.testing.assert_close(got.double(), _direct_sum_pi_squared(half.float()), atol=1e-6, rtol=1e-5)


def test_sum_pi_squared_carries_no_gradient() -> None:
    logits = _logits(4, 9, seed=6).requires_grad_(True)
    assert not sum_pi_squared_from_logits(logits).requires_grad
