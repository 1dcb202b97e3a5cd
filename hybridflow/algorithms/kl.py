"""Per-token KL estimators between the policy and the reference model, and KL coefficient
controllers for the in-reward KL penalty.

Estimators (Schulman's k1/k2/k3), with x = logπ − logπ_ref at the sampled token:

- ``kl`` / ``k1``: x. Unbiased, high variance, can be negative.
- ``abs``: |x|.
- ``mse`` / ``k2``: ½x². Its gradient x is the gradient of the true KL to first order.
- ``low_var_kl`` / ``k3``: e^{−x} + x − 1 ≥ 0, unbiased and low variance (the GRPO paper's).
  The exponent is clamped to ±20 and the result to [−10, 10], as verl does, so one token with
  a wild ratio cannot blow up the loss.
- Any of them with a ``+`` suffix (``k3+``): the value of that estimator with the gradient of
  k2 (straight-through), since k1's and k3's own gradients are biased for the KL *loss*.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hybridflow.algorithms.core import UnknownNameError, check_same_shape, unknown_name_message

# verl's clamps for k3: exp(±20) stays finite in fp32; 10 nats per token is already huge.
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_VALUE_CLAMP = 10.0

_BASE_KINDS: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}
KL_PENALTY_KINDS: tuple[str, ...] = tuple(_BASE_KINDS) + tuple(f"{k}+" for k in _BASE_KINDS)


def _forward_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, base: str) -> torch.Tensor:
    if base == "k1":
        return logprobs - ref_logprobs
    if base == "abs":
        return (logprobs - ref_logprobs).abs()
    if base == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    # k3: with log r = logπ_ref − logπ, KL ≈ r − log r − 1.
    log_ratio = (ref_logprobs - logprobs).clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
    value = torch.exp(log_ratio) - log_ratio - 1
    return value.clamp(-LOW_VAR_KL_VALUE_CLAMP, LOW_VAR_KL_VALUE_CLAMP)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, R) of the policy from the reference; see the module docstring.

    Args:
        logprobs: (B, R) log-probabilities of the sampled tokens under the policy.
        ref_logprobs: (B, R) the same under the reference model.
        kind: one of ``KL_PENALTY_KINDS``.
    """
    straight_through = kind.endswith("+")
    base = _BASE_KINDS.get(kind[:-1] if straight_through else kind)
    if base is None:
        raise UnknownNameError(unknown_name_message("KL penalty kind", kind, KL_PENALTY_KINDS))
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    value = _forward_kl(logprobs, ref_logprobs, base)
    if not straight_through or base == "k2":
        return value
    # Forward value of the chosen estimator, backward of k2: surrogate − sg(surrogate) is 0
    # in value and carries k2's gradient.
    surrogate = 0.5 * (logprobs - ref_logprobs).square()
    return surrogate - surrogate.detach() + value.detach()


# --------------------------------------------------------------------------------------------
# KL coefficient controllers (in-reward penalty: reward − β·KL)
# --------------------------------------------------------------------------------------------


def _float(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class FixedKLController:
    """A constant coefficient β. ``update`` is a no-op so both controllers are interchangeable."""

    def __init__(self, kl_coef: float) -> None:
        self.value = _float("kl_coef", kl_coef)
        if self.value < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.value}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _load_value(state, type(self).__name__)


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target_kl``
    (Ziegler et al. 2019, as in verl).

    error = clip(KL/target − 1, −0.2, 0.2);  β ← β·(1 + error·n_steps/horizon).
    The clip bounds how fast β moves; ``horizon`` is how many samples it takes to close the gap.
    """

    # Largest relative error acted on per update (Ziegler et al.).
    MAX_PROPORTIONAL_ERROR = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value = _float("init_kl_coef", init_kl_coef)
        self.target = _float("target_kl", target_kl)
        self.horizon = _float("horizon", horizon)
        if self.value < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {self.value}")
        if self.target <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive controller, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust β after a step that measured ``current_kl`` over ``n_steps`` samples."""
        current_kl = _float("current_kl", current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = current_kl / self.target - 1.0
        error = min(max(error, -self.MAX_PROPORTIONAL_ERROR), self.MAX_PROPORTIONAL_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """β is the only state; target and horizon come from config on resume."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _load_value(state, type(self).__name__)


KLController = FixedKLController | AdaptiveKLController


def _load_value(state: dict[str, Any], owner: str) -> float:
    if not isinstance(state, dict) or "value" not in state:
        raise ValueError(f"{owner}.load_state_dict: expected a dict with key 'value', got {state!r}")
    return _float(f"{owner} state 'value'", state["value"])


KL_CONTROLLER_TYPES: tuple[str, ...] = ("fixed", "adaptive")


def get_kl_controller(
    kind: str, *, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """``fixed`` or ``adaptive`` controller (``algorithm.kl_ctrl.type``) from plain values."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise UnknownNameError(unknown_name_message("KL controller type", kind, KL_CONTROLLER_TYPES))
