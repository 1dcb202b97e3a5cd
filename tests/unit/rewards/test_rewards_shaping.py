"""DAPO's soft overlong punishment, hand-worked."""

from __future__ import annotations

import pytest
import torch

from hybridflow.rewards.shaping import compute_overlong_penalty, resolve_overlong_buffer


def test_linear_inside_the_buffer_zero_before_it() -> None:
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then -(len - 6) / 4 x factor.
    lengths = torch.tensor([1, 6, 7, 8, 10])
    penalty = compute_overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=2.0)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0])


def test_buffer_resolution_and_errors() -> None:
    assert resolve_overlong_buffer(None, 20480) == 4096  # DAPO's setting: a fifth of the budget
    assert resolve_overlong_buffer(None, 3) == 1
    assert resolve_overlong_buffer(2, 8) == 2
    with pytest.raises(ValueError, match="overlong_buffer.len=9"):
        resolve_overlong_buffer(9, 8)
    with pytest.raises(ValueError, match="buffer_len=0"):
        compute_overlong_penalty(torch.tensor([1]), max_response_length=8, buffer_len=0, penalty_factor=1.0)
