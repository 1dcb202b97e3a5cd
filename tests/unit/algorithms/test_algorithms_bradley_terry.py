"""The Bradley-Terry loss of a reward model on pairs, with hand-worked numbers: -log σ(r_c - r_r),
its gradient -σ(r_r - r_c) on the chosen score, TRL's centring term, and the rm/* metrics."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.preference import REWARD_MODEL_METRICS, bradley_terry_loss


def test_loss_gradient_and_metrics_by_hand():
    chosen = torch.tensor([2.0, 0.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    # margins +1 and -1: log(1 + e^-1) and log(1 + e^1)
    assert loss.tolist() == pytest.approx([0.3132616875182228, 1.3132616875182228], abs=1e-12)
    loss.sum().backward()
    assert chosen.grad.tolist() == pytest.approx([-0.2689414213699951, -0.7310585786300049], abs=1e-12)
    assert rejected.grad.tolist() == pytest.approx([0.2689414213699951, 0.7310585786300049], abs=1e-12)
    assert set(metrics) == set(REWARD_MODEL_METRICS)
    assert metrics["rm/accuracy"].tolist() == [1.0, 0.0]
    assert metrics["rm/margin"].tolist() == [1.0, -1.0]
    assert metrics["rm/chosen"].tolist() == [2.0, 0.0] and metrics["rm/rejected"].tolist() == [1.0, 1.0]
    assert not any(m.requires_grad for m in metrics.values())


def test_equal_scores_are_not_counted_right():
    loss, metrics = bradley_terry_loss(torch.zeros(3), torch.zeros(3))
    assert loss.tolist() == pytest.approx([0.6931471805599453] * 3, abs=1e-6)  # log 2
    assert metrics["rm/accuracy"].sum() == 0


def test_centring_adds_c_times_the_squared_sum():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    plain, _ = bradley_terry_loss(chosen, rejected)
    centred, _ = bradley_terry_loss(chosen, rejected, center_coefficient=0.5)
    assert (centred - plain).tolist() == pytest.approx([4.5, 0.5], abs=1e-6)  # 0.5 x 3², 0.5 x 1²
    with pytest.raises(ValueError, match="center_coefficient"):
        bradley_terry_loss(chosen, rejected, center_coefficient=-1.0)
