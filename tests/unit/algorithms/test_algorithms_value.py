"""The critic's clipped value loss against hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.value import compute_value_loss

torch.set_num_threads(1)
NAN = float("nan")

# cliprange 0.5:
#   t0: V_old 0, v 1.0, R 1.0: clip(v) = 0.5 → errors 0 and 0.25 → the clipped one (0.25)
#       wins: no gradient (the clipped prediction is constant in v)
#   t1: V_old 1.0, v 2.0, R 0: clip(v) = 1.5 → errors 4 and 2.25 → 4, gradient 2·(v − R) = 4
#   t2: padding (nan everywhere)
# token-mean: ½·(0.25 + 4)/2 = 1.0625; d/dv1 = ½·4/2 = 1
VPREDS = [[1.0, 2.0, NAN]]
RETURNS = torch.tensor([[1.0, 0.0, NAN]])
VALUES = torch.tensor([[0.0, 1.0, NAN]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_clipped_value_loss_by_hand() -> None:
    vpreds = torch.tensor(VPREDS, requires_grad=True)
    loss, metrics = compute_value_loss(vpreds, RETURNS, VALUES, MASK, cliprange_value=0.5)
    assert loss.item() == pytest.approx(1.0625)
    loss.backward()
    assert vpreds.grad is not None
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 1.0, 0.0]]))
    assert metrics == {"critic/vf_clipfrac": pytest.approx(0.5), "critic/vpred_mean": pytest.approx(1.5)}


def test_aggregation_arguments_are_passed_through() -> None:
    vpreds = torch.tensor(VPREDS)
    # token-sum: ½·(0.25 + 4) = 2.125; with 4 global tokens and dp 2: ½·4.25/4·2 = 1.0625
    loss, _ = compute_value_loss(vpreds, RETURNS, VALUES, MASK, cliprange_value=0.5, loss_agg_mode="token-sum")
    assert loss.item() == pytest.approx(2.125)
    loss, _ = compute_value_loss(
        vpreds, RETURNS, VALUES, MASK, cliprange_value=0.5, global_num_tokens=4, dp_size=2
    )
    assert loss.item() == pytest.approx(1.0625)


def test_a_large_cliprange_is_plain_mse() -> None:
    vpreds = torch.tensor([[1.0, 2.0]])
    loss, metrics = compute_value_loss(
        vpreds, torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), cliprange_value=100.0
    )
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert metrics["critic/vf_clipfrac"] == 0.0


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"shape mismatch: vpreds \(1, 3\), returns \(1, 2\)"):
        compute_value_loss(torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 3), MASK, cliprange_value=0.5)
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        compute_value_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), MASK, cliprange_value=-1.0)
