"""Reduce a per-token loss matrix to the scalar that is back-propagated.

A PPO mini-batch is split over data-parallel ranks and, on each rank, into micro-batches whose
gradients are accumulated. The mini-batch loss must not depend on that split. So the caller
passes the counts of the *whole mini-batch* (over all micro-batches and ranks):

- ``global_num_tokens``: masked-in tokens (token-mean),
- ``global_num_seqs``: sequences with at least one masked-in token (seq-mean-*),

and each micro-batch loss is its *sum* divided by the global count, times ``dp_size``
(DDP/FSDP average gradients over ranks, the ``dp_size`` factor undoes that). Then summing the
micro-batch losses of one rank and averaging over ranks gives exactly the whole-batch value,
and so exactly its gradient. Without global counts the micro-batch is normalised on its own
(fine for a single micro-batch on one rank, biased otherwise), which is why ``dp_size > 1``
without them is refused.

Modes (verl ≥ 0.7 semantics; L = loss_mat, M = loss_mask, B sequences, R tokens):

- ``token-mean``: Σ L·M / N_tokens. Every token weighs the same (DAPO).
- ``token-sum``: Σ L·M. No normalisation at all.
- ``seq-mean-token-sum``: mean over sequences of Σ_t L·M.
- ``seq-mean-token-mean``: mean over sequences of (Σ_t L·M / Σ_t M) (GRPO paper).
- ``seq-mean-token-sum-norm``: seq-mean-token-sum / ``loss_scale_factor`` (Dr.GRPO; default
  ``R``, pass a constant such as the max response length so micro-batches padded to different
  lengths agree).

Sequences whose mask is all zero count in no mean; an all-zero mask gives a 0 loss that is
still connected to the graph (never nan).
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.core import (
    UnknownNameError,
    check_same_shape,
    masked_sum,
    unknown_name_message,
)

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

Count = int | float | torch.Tensor


def _divide(total: torch.Tensor, count: Count) -> torch.Tensor:
    """total / count, with a zero count giving 0 (its numerator is 0: nothing was masked in)."""
    count_t = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    if bool((count_t < 0).any()):
        raise ValueError(f"normalising count must be >= 0, got {count}")
    return total / torch.where(count_t > 0, count_t, torch.ones_like(count_t))


def agg_loss(
    loss_mat: torch.Tensor,  # (B, R)
    loss_mask: torch.Tensor,  # (B, R)
    loss_agg_mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """The scalar loss of one micro-batch under ``loss_agg_mode`` (see the module docstring).

    Args:
        loss_mat: per-token losses.
        loss_mask: 1 on tokens that enter the loss.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        global_num_tokens: masked-in tokens of the whole mini-batch (all micro-batches and
            ranks); used by ``token-mean``. None: this micro-batch's own count.
        global_num_seqs: non-empty sequences of the whole mini-batch; used by ``seq-mean-*``.
            None: this micro-batch's own count.
        loss_scale_factor: divisor of ``seq-mean-token-sum-norm``; None: ``R``.
        dp_size: number of data-parallel ranks whose gradients are averaged.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise UnknownNameError(unknown_name_message("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES))
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (B, R), got shape {tuple(loss_mat.shape)}")
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    mask = loss_mask.to(loss_mat.dtype)

    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    if loss_agg_mode == "token-mean":
        if global_num_tokens is None:
            _require_global("global_num_tokens", loss_agg_mode, dp_size)
            global_num_tokens = mask.sum()
        return _divide(masked_sum(loss_mat, mask), global_num_tokens) * dp_size

    # seq-mean-*: one value per sequence, averaged over the non-empty sequences.
    tokens_per_seq = mask.sum(dim=-1)  # (B,)
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # (B,) token sums
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = _divide(seq_losses, tokens_per_seq)
    non_empty = (tokens_per_seq > 0).to(loss_mat.dtype)  # (B,)
    if global_num_seqs is None:
        _require_global("global_num_seqs", loss_agg_mode, dp_size)
        global_num_seqs = non_empty.sum()
    loss = _divide(masked_sum(seq_losses, non_empty), global_num_seqs) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = float(loss_mat.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if not scale > 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        loss = loss / scale
    return loss


def _require_global(name: str, mode: str, dp_size: int) -> None:
    if dp_size > 1:
        raise ValueError(
            f"agg_loss({mode!r}) with dp_size={dp_size} needs {name}: a rank-local count "
            "would make the loss depend on how the mini-batch was split over ranks"
        )


def batch_counts(loss_mask: torch.Tensor) -> tuple[int, int]:
    """(masked-in tokens, non-empty sequences) of a mask (B, R): what a worker sums over its
    micro-batches and all-reduces over ranks to get ``global_num_tokens``/``global_num_seqs``."""
    mask = loss_mask != 0
    return int(mask.sum()), int(mask.any(dim=-1).sum())
