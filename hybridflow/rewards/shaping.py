"""Reward shaping that depends on the response, not on its correctness."""

from __future__ import annotations

import torch


def overlong_buffer_end(buffer_end: int | None, max_response_length: int) -> int:
    """Where the buffer ends (L_max below): ``reward.overlong_buffer.max_response_length`` (verl's
    ``reward_kwargs.max_resp_len``) when set, else the response budget ``data.max_response_length``."""
    return max_response_length if buffer_end is None else int(buffer_end)


def resolve_overlong_buffer(buffer_len: int | None, buffer_end: int) -> int:
    """The buffer length a config asks for (None: a fifth of the buffer's end, DAPO's 4096 of 20480)."""
    length = max(1, buffer_end // 5) if buffer_len is None else int(buffer_len)
    if not 0 < length <= buffer_end:
        raise ValueError(f"reward.overlong_buffer.len={buffer_len} must be in [1, the buffer's end {buffer_end}] "
                         "(reward.overlong_buffer.max_response_length, else data.max_response_length)")
    return length


def compute_overlong_penalty(
    response_lengths: torch.Tensor,  # (B,) integer, generated tokens per response
    *,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:  # (B,) float, <= 0
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

    With L_max = ``max_response_length`` and L_cache = ``buffer_len``, a response of |y| tokens
    gets ``min(0, (L_max − L_cache − |y|) / L_cache) × penalty_factor``: 0 up to
    L_max − L_cache, then linear down to −``penalty_factor`` at L_max. Added to the score, it
    teaches the policy to finish before truncation without punishing every long answer equally.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"buffer_len={buffer_len} must be in [1, max_response_length={max_response_length}]")
    expected = max_response_length - buffer_len
    over = (expected - response_lengths.to(torch.float32)) / buffer_len
    return over.clamp(max=0.0) * penalty_factor
