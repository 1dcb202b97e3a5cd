"""Health checks over a step's metrics: the failure modes that waste a run quietly.

Each check reads metrics the step already logs and, when its threshold is crossed, sets
``health/<name>`` to 1 and explains what it means and what to try. ``HealthMonitor`` repeats a
warning only every ``repeat_every`` steps while the condition persists, so a long run's log
stays readable; the metric is logged every step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthThresholds:
    zero_variance_group_fraction: float = 1.0  # warn when at least this fraction of groups is constant
    truncation_ratio: float = 0.5
    min_entropy: float = 0.01
    logprob_mismatch: float = 0.05  # mean |log pi_trainer - log pi_rollout| per token
    reward_failure_rate: float = 0.05


@dataclass(frozen=True)
class _Check:
    name: str
    triggered: Callable[[Mapping[str, float], HealthThresholds], bool]
    explain: Callable[[Mapping[str, float], HealthThresholds], str]


def _get(metrics: Mapping[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None or value != value else float(value)  # NaN counts as absent


def _over(key: str, attr: str, below: bool = False) -> Callable[[Mapping[str, float], HealthThresholds], bool]:
    def test(metrics: Mapping[str, float], t: HealthThresholds) -> bool:
        value = _get(metrics, key)
        if value is None:
            return False
        limit = getattr(t, attr)
        return value < limit if below else value >= limit

    return test


def _reward_failures(metrics: Mapping[str, float]) -> float:
    keys = ("reward/error_rate", "reward/timeout_rate", "reward/nonfinite_rate", "reward_model/judge/failure_rate")
    return sum(_get(metrics, k) or 0.0 for k in keys)


CHECKS: tuple[_Check, ...] = (
    _Check(
        "zero_variance_groups",
        _over("health/zero_variance_group_fraction", "zero_variance_group_fraction"),
        lambda m, t: (
            f"{m['health/zero_variance_group_fraction']:.0%} of prompt groups got the same reward for every sample: "
            "group-relative advantages are 0 there and the step learns nothing from them. The task may be too "
            "hard or too easy for the model, or the reward may be broken; try more samples (rollout.n), "
            "easier/harder data, or dynamic sampling (algorithm.filter_groups.enable=true)"
        ),
    ),
    _Check(
        "truncation",
        _over("response_length/clip_ratio", "truncation_ratio"),
        lambda m, t: (
            f"{m['response_length/clip_ratio']:.0%} of responses hit data.max_response_length: answers are cut "
            "off before they finish, so their rewards judge truncated text. Raise data.max_response_length, or "
            "penalise length (reward.overlong_buffer.enable=true)"
        ),
    ),
    _Check(
        "entropy_collapse",
        _over("actor/entropy", "min_entropy", below=True),
        lambda m, t: (
            f"policy entropy is {m['actor/entropy']:.4f} nats/token (< {t.min_entropy}): the policy has become "
            "nearly deterministic, so samples of a prompt stop differing and exploration ends. Lower the "
            "learning rate, raise rollout.temperature, use clip-higher (actor.clip_ratio_high=0.28) or an "
            "entropy bonus (actor.entropy_coeff)"
        ),
    ),
    _Check(
        "logprob_mismatch",
        _over("rollout_corr/log_ratio_abs_mean", "logprob_mismatch"),
        lambda m, t: (
            f"the rollout engine's and the trainer's logprobs differ by {m['rollout_corr/log_ratio_abs_mean']:.3f} "
            "nats/token on average: the samples are off-policy for the trainer (dtype, kernels or stale "
            "weights). Check rollout.dtype against model.dtype, or correct for it with "
            "algorithm.rollout_correction.rollout_is=token"
        ),
    ),
    _Check(
        "reward_failures",
        lambda m, t: _reward_failures(m) >= t.reward_failure_rate,
        lambda m, t: (
            f"{_reward_failures(m):.0%} of samples could not be scored (the reward function raised, timed out or "
            "returned a non-number, or the reward model's judge gave no score; see reward/error_rate, "
            "reward/timeout_rate, reward/nonfinite_rate, reward_model/judge/failure_rate); they score 0. Fix the "
            "reward function or raise reward.timeout_s (the judge: its endpoint, prompt template or score parser)"
        ),
    ),
)


def check_health(metrics: Mapping[str, float], thresholds: HealthThresholds) -> tuple[dict[str, float], list[str]]:
    """``health/<check>`` flags (1.0 triggered, 0.0 not) and an explanation per triggered check."""
    flags: dict[str, float] = {}
    messages: list[str] = []
    for check in CHECKS:
        hit = check.triggered(metrics, thresholds)
        flags[f"health/{check.name}"] = float(hit)
        if hit:
            messages.append(f"health/{check.name}: {check.explain(metrics, thresholds)}")
    return flags, messages


class HealthMonitor:
    """``check_health`` per step, logging each warning the first time and every ``repeat_every`` steps."""

    def __init__(self, thresholds: HealthThresholds, repeat_every: int = 10) -> None:
        self.thresholds = thresholds
        self.repeat_every = repeat_every
        self._last_warned: dict[str, int] = {}

    def __call__(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        flags, messages = check_health(metrics, self.thresholds)
        for name, message in zip([k for k, v in flags.items() if v], messages, strict=True):
            last = self._last_warned.get(name)
            if last is None or step - last >= self.repeat_every:
                log.warning("step %d: %s", step, message)
                self._last_warned[name] = step
        for name, value in flags.items():
            if not value:
                self._last_warned.pop(name, None)  # warn again promptly if it comes back
        return flags
