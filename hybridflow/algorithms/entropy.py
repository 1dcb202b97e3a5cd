"""Entropy and sampled-token log-probabilities from logits, without full-size temporaries.

Logits of an LLM batch are the largest tensor of a training step ((B, T, V) with V ≈ 150k).
``log_softmax(logits).gather(...)`` or ``Categorical(logits=...).entropy()`` allocate one or
more tensors of the same size, and autograd keeps them until backward. The chunked functions
here walk over rows ``chunk_size`` at a time, upcast each chunk to float32 (bf16 logsumexp
loses the differences that logprobs are made of), and keep only per-row results. Their
backward recomputes the softmax chunk by chunk, so the only full-size tensor they ever
create is the gradient of the logits itself, which autograd needs anyway.

Shapes: ``(..., V)`` logits, ``(...)`` results; results are float32 (or float64 for float64
logits) whatever the logits' dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_CHUNK_SIZE = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """Upcast, and lift −inf (a token masked out of the vocabulary) to the dtype's minimum, so
    its probability is exactly 0 and p·z is 0 instead of 0·(−inf) = nan."""
    dtype = _compute_dtype(logits.dtype)
    return logits.to(dtype).clamp(min=torch.finfo(dtype).min)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) − Σ softmax(z)·z.

    Written with logsumexp rather than −Σ p·log p, so it stays finite for very peaked
    distributions (p = 0 entries would give 0·(−inf)). Differentiable by autograd; use
    ``entropy_from_logits_chunked`` for large batches × vocabularies.
    """
    z = _finite_logits(logits)
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)


# --------------------------------------------------------------------------------------------
# Row blocks
# --------------------------------------------------------------------------------------------


def _row_blocks(x: torch.Tensor, chunk_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first flat row, block (n, V)) covering the rows of ``x`` (..., V) in order.

    Blocks are views whenever ``x`` can be viewed as (rows, V), so no copy of the logits is
    made. A sliced batch (``logits[:, :-1]``) cannot be viewed that way; it is walked one
    leading index at a time instead, each of which can.
    """
    vocab = x.shape[-1]
    try:
        flat = x.view(-1, vocab)
    except RuntimeError:
        # Only a tensor of 3+ dims sliced along an inner dim gets here; each x[i] is viewable.
        offset = 0
        for sub in x.unbind(0):
            for start, block in _row_blocks(sub, chunk_size):
                yield offset + start, block
            offset += sub.numel() // vocab
        return
    for start in range(0, flat.shape[0], chunk_size):
        yield start, flat[start : start + chunk_size]


def _check_args(logits: torch.Tensor, chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (..., V) with V >= 1, got shape {tuple(logits.shape)}")


def _num_rows(logits: torch.Tensor) -> int:
    return logits.numel() // logits.shape[-1]


# --------------------------------------------------------------------------------------------
# Entropy
# --------------------------------------------------------------------------------------------


class _ChunkedEntropy(torch.autograd.Function):
    """H(z) = lse(z) − E_p[z];  dH/dz = −p ⊙ (z − E_p[z])."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        out_dtype = _compute_dtype(logits.dtype)
        out = torch.empty(_num_rows(logits), dtype=out_dtype, device=logits.device)
        for start, block in _row_blocks(logits, chunk_size):
            z = _finite_logits(block)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            mean_z = (torch.exp(z - lse) * z).sum(dim=-1)
            out[start : start + block.shape[0]] = lse.squeeze(-1) - mean_z
        ctx.save_for_backward(logits)
        ctx.chunk_size = chunk_size
        return out.view(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad.view(-1, logits.shape[-1])
        grad_out = grad_out.reshape(-1)
        for start, block in _row_blocks(logits, ctx.chunk_size):
            stop = start + block.shape[0]
            z = _finite_logits(block)
            probs = torch.softmax(z, dim=-1)
            mean_z = (probs * z).sum(dim=-1, keepdim=True)
            g = grad_out[start:stop].unsqueeze(-1)
            grad_rows[start:stop] = (-g * probs * (z - mean_z)).to(grad.dtype)
        return grad, None


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """``entropy_from_logits`` computed ``chunk_size`` rows at a time (..., V) → (...).

    Same values (float32) and gradient as the unchunked function, with memory O(chunk_size·V)
    beyond the logits and their gradient.
    """
    _check_args(logits, chunk_size)
    return _ChunkedEntropy.apply(logits, chunk_size)


# --------------------------------------------------------------------------------------------
# Log-probabilities of given tokens
# --------------------------------------------------------------------------------------------


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(y) = z_y − lse(z);  d/dz = onehot(y) − softmax(z)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        out_dtype = _compute_dtype(logits.dtype)
        rows = _num_rows(logits)
        flat_labels = labels.reshape(-1)
        out = torch.empty(rows, dtype=out_dtype, device=logits.device)
        lse_all = torch.empty(rows, dtype=out_dtype, device=logits.device)
        for start, block in _row_blocks(logits, chunk_size):
            stop = start + block.shape[0]
            z = block.to(out_dtype)
            lse = torch.logsumexp(z, dim=-1)
            picked = z.gather(-1, flat_labels[start:stop].unsqueeze(-1)).squeeze(-1)
            out[start:stop] = picked - lse
            lse_all[start:stop] = lse
        ctx.save_for_backward(logits, flat_labels, lse_all)
        ctx.chunk_size = chunk_size
        return out.view(labels.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, flat_labels, lse_all = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad.view(-1, logits.shape[-1])
        grad_out = grad_out.reshape(-1).to(lse_all.dtype)
        for start, block in _row_blocks(logits, ctx.chunk_size):
            stop = start + block.shape[0]
            g = grad_out[start:stop].unsqueeze(-1)
            block_grad = -g * torch.exp(block.to(lse_all.dtype) - lse_all[start:stop].unsqueeze(-1))
            block_grad.scatter_add_(-1, flat_labels[start:stop].unsqueeze(-1), g)
            grad_rows[start:stop] = block_grad.to(grad.dtype)
        return grad, None, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """log softmax(logits)[labels]: (..., V) logits and (...) token ids → (...) logprobs.

    Equal to ``log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]`` in value
    and gradient, computed as z_y − logsumexp(z) one chunk of rows at a time.
    """
    _check_args(logits, chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have the shape of logits without the vocab dim: "
            f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    labels = labels.long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[-1]):
        raise ValueError(
            f"labels must lie in [0, {logits.shape[-1]}) (the vocab size), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return _ChunkedLogprobs.apply(logits, labels, chunk_size)


# --------------------------------------------------------------------------------------------
# Sum of squared probabilities
# --------------------------------------------------------------------------------------------


def sum_pi_squared_from_lse(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Σ_v softmax(z)_v² of rows whose log-normaliser ``lse`` is known: Σ exp(2(z − lse)).  # (n, V), (n,) -> (n,)

    The chunk kernels (here and in the training engine's LM head) have ``lse`` already; the
    squares are taken in the exponent, so no probability row is kept beside the logits.
    """
    z = _finite_logits(logits)
    return torch.exp(2.0 * (z - lse.to(z.dtype).unsqueeze(-1))).sum(dim=-1)


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Σ_v π(v)² of softmax(logits) over the last dim, ``chunk_size`` rows at a time: (..., V) → (...).

    verl's ``calculate_sum_pi_squared`` (the optimal-token-baseline estimators' ‖π‖², computed
    with the old policy): no gradient, float32 results, memory O(chunk_size·V) beyond the logits.
    It lies in [1/V, 1]: 1/V for a uniform row, 1 for a one-hot one.
    """
    _check_args(logits, chunk_size)
    out = torch.empty(_num_rows(logits), dtype=_compute_dtype(logits.dtype), device=logits.device)
    for start, block in _row_blocks(logits, chunk_size):
        z = _finite_logits(block)
        out[start : start + block.shape[0]] = sum_pi_squared_from_lse(z, torch.logsumexp(z, dim=-1))
    return out.view(logits.shape[:-1])
