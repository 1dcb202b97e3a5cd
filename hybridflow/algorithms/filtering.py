"""Batch filters that decide which samples are worth training on.

``compute_varied_group_mask`` is DAPO's dynamic sampling criterion (Yu et al. 2025, arXiv
2503.14476, §3.2): a group whose samples all got the same reward has zero group-relative
advantage everywhere, so it adds tokens to the loss normaliser but no gradient. Dropping such
groups keeps the effective batch size constant as accuracy approaches 0 or 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def compute_varied_group_mask(
    values: torch.Tensor,  # (B,) float, the per-sample metric (reward, accuracy)
    group_ids: torch.Tensor,  # (B,) integer, samples of one prompt share an id
) -> torch.Tensor:  # (B,) bool
    """True for samples whose group's ``values`` are not all equal, or whose group has one sample.

    A group of one is kept, as verl does: it has no spread to measure, and dropping it would
    make ``rollout.n=1`` runs discard everything. Any NaN in a group makes it "varied" (kept):
    a broken score is surfaced by the reward metrics rather than silently filtered out.
    """
    if values.dim() != 1 or group_ids.shape != values.shape:
        raise ValueError(
            f"values and group_ids must both be (B,), got {tuple(values.shape)} and {tuple(group_ids.shape)}"
        )
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1
    v = values.to(torch.float64)
    big = torch.finfo(torch.float64).max
    # Per-group max and min via scatter_reduce; a group is constant iff max == min.
    g_max = torch.full((num_groups,), -big, dtype=torch.float64).scatter_reduce(0, index, v, "amax")
    g_min = torch.full((num_groups,), big, dtype=torch.float64).scatter_reduce(0, index, v, "amin")
    size = torch.bincount(index, minlength=num_groups)
    varied = (g_max != g_min) | (size == 1) | torch.isnan(g_max) | torch.isnan(g_min)
    return varied[index]


def select_varied_groups(values: Sequence[float], group_ids: Sequence[int]) -> frozenset[int]:
    """The ids of the groups ``compute_varied_group_mask`` keeps, from plain per-sample lists.

    The trainer's entry point for DAPO's dynamic sampling: it holds scored samples, not tensors.
    """
    keep = compute_varied_group_mask(torch.tensor(list(values)), torch.tensor(list(group_ids)))
    return frozenset(g for g, k in zip(group_ids, keep.tolist(), strict=True) if k)
