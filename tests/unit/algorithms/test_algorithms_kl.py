"""KL estimators (values, clamps, straight-through gradients) and KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.core import UnknownNameError
from hybridflow.algorithms.kl import (
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)

torch.set_num_threads(1)

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])
# x = logp − ref = [0.5, −1.0]
K1 = [0.5, -1.0]
ABS = [0.5, 1.0]
K2 = [0.125, 0.5]  # ½x²
# k3 with log r = ref − logp = [−0.5, 1.0]: e^{log r} − log r − 1
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # ≈ [0.106531, 0.718282]

EXPECTED = {"kl": K1, "k1": K1, "abs": ABS, "mse": K2, "k2": K2, "low_var_kl": K3, "k3": K3}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_values(kind: str) -> None:
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([EXPECTED[kind]]))


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_straight_through_value_is_the_base_estimator_and_gradient_is_k2(kind: str) -> None:
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, kind + "+")
    torch.testing.assert_close(value.detach(), torch.tensor([EXPECTED[kind]]))
    value.sum().backward()
    # d(½x²)/d logp = x = logp − ref
    torch.testing.assert_close(logp.grad, LOGP - REF)


def test_plain_k3_gradient_differs_from_k2() -> None:
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, "k3").sum().backward()
    # d/d logp of e^{ref−logp} − (ref − logp) − 1 = −e^{ref−logp} + 1
    torch.testing.assert_close(logp.grad, 1 - torch.exp(REF - LOGP))


def test_low_var_kl_is_clamped_both_ways() -> None:
    logp = torch.tensor([[0.0, -30.0]])
    ref = torch.tensor([[-30.0, 0.0]])
    # log r = −30 → clamped to −20: e^−20 + 20 − 1 ≈ 19 → clamped to 10
    # log r = +30 → clamped to  20: e^20 − 21 → clamped to 10
    out = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0]]))


def test_every_kind_is_accepted_and_unknown_is_suggested() -> None:
    for kind in KL_PENALTY_KINDS:
        assert kl_penalty(LOGP, REF, kind).shape == LOGP.shape
    with pytest.raises(UnknownNameError, match=r"unknown KL penalty kind 'low_var_k1'.*Did you mean 'low_var_kl'\?"):
        kl_penalty(LOGP, REF, "low_var_k1")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_penalty(LOGP, REF[:, :1], "kl")


def test_fixed_controller_never_moves() -> None:
    controller = FixedKLController(0.001)
    controller.update(current_kl=5.0, n_steps=256)
    assert controller.value == 0.001
    assert controller.state_dict() == {"value": 0.001}


def test_adaptive_controller_update() -> None:
    controller = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    # KL 9 vs target 6: error 9/6 − 1 = 0.5, clipped to 0.2; β·(1 + 0.2·256/10000) = 0.2·1.00512
    controller.update(current_kl=9.0, n_steps=256)
    assert controller.value == pytest.approx(0.201024)
    # KL 5.4: error 5.4/6 − 1 = −0.1 (inside the clip); β·(1 − 0.1·1000/10000) = β·0.99
    controller.update(current_kl=5.4, n_steps=1000)
    assert controller.value == pytest.approx(0.201024 * 0.99)


def test_adaptive_controller_state_round_trip_and_validation() -> None:
    controller = AdaptiveKLController(0.1, 0.05, 100)
    controller.update(1.0, 10)
    restored = AdaptiveKLController(0.1, 0.05, 100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    with pytest.raises(ValueError, match="expected a dict with key 'value'"):
        restored.load_state_dict({"beta": 1.0})
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        controller.update(float("nan"), 1)


def test_controller_factory() -> None:
    assert isinstance(get_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    adaptive = get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    with pytest.raises(UnknownNameError, match="Did you mean 'adaptive'"):
        get_kl_controller("adaptiv", kl_coef=0.1)
