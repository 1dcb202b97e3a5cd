"""DAPO's dynamic-sampling criterion: keep groups whose metric varies."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms import compute_varied_group_mask


def test_hand_worked_groups() -> None:
    # group 5: all 1 (dropped); group 2: 0 and 1 (kept); group 9: one sample (kept, as verl);
    # group 4: all 0 (dropped). Members need not be adjacent.
    values = torch.tensor([1.0, 0.0, 1.0, 0.7, 1.0, 0.0, 0.0])
    groups = torch.tensor([5, 2, 5, 9, 2, 4, 4])
    keep = compute_varied_group_mask(values, groups)
    assert keep.tolist() == [False, True, False, True, True, False, False]


def test_tiny_differences_count_as_varied_and_nan_is_kept() -> None:
    keep = compute_varied_group_mask(torch.tensor([0.5, 0.5 + 1e-9, float("nan"), 1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1]))
    assert keep.tolist() == [True, True, True, True]


def test_empty_and_shape_errors() -> None:
    assert compute_varied_group_mask(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="values and group_ids"):
        compute_varied_group_mask(torch.zeros(3), torch.zeros(2, dtype=torch.long))
