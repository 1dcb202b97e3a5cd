"""Health checks: each fires on its threshold, explains itself, and repeats sparingly."""

from __future__ import annotations

import logging

import pytest

from hybridflow.tracking.health import HealthMonitor, HealthThresholds, check_health

HEALTHY = {
    "health/zero_variance_group_fraction": 0.5,
    "response_length/clip_ratio": 0.1,
    "actor/entropy": 0.8,
    "rollout_corr/log_ratio_abs_mean": 0.001,
    "reward/error_rate": 0.0,
    "reward/timeout_rate": 0.0,
    "reward/nonfinite_rate": 0.0,
}


def test_healthy_metrics_raise_nothing() -> None:
    flags, messages = check_health(HEALTHY, HealthThresholds())
    assert messages == [] and set(flags.values()) == {0.0} and len(flags) == 5


@pytest.mark.parametrize(
    ("change", "flag", "phrase"),
    [
        ({"health/zero_variance_group_fraction": 1.0}, "zero_variance_groups", "same reward"),
        ({"response_length/clip_ratio": 0.6}, "truncation", "max_response_length"),
        ({"actor/entropy": 0.001}, "entropy_collapse", "nearly deterministic"),
        ({"rollout_corr/log_ratio_abs_mean": 0.2}, "logprob_mismatch", "rollout_correction"),
        ({"reward/timeout_rate": 0.03, "reward/error_rate": 0.03}, "reward_failures", "6%"),
        ({"reward_model/judge/failure_rate": 0.5}, "reward_failures", "judge gave no score"),
    ],
)
def test_each_check_fires_with_an_explanation(change, flag, phrase) -> None:
    flags, messages = check_health({**HEALTHY, **change}, HealthThresholds())
    assert flags[f"health/{flag}"] == 1.0
    assert sum(flags.values()) == 1.0
    assert len(messages) == 1 and phrase in messages[0]


def test_missing_or_nan_metrics_do_not_fire() -> None:
    flags, messages = check_health({"actor/entropy": float("nan")}, HealthThresholds())
    assert messages == [] and not any(flags.values())


def test_monitor_repeats_every_n_steps_and_rearms(caplog) -> None:
    monitor = HealthMonitor(HealthThresholds(), repeat_every=3)
    bad = {**HEALTHY, "actor/entropy": 0.0}
    with caplog.at_level(logging.WARNING):
        for step in range(1, 8):
            assert monitor(bad, step)["health/entropy_collapse"] == 1.0
        warned = [r.getMessage() for r in caplog.records]
        assert [m.split(":")[0] for m in warned] == ["step 1", "step 4", "step 7"]
        caplog.clear()
        monitor(HEALTHY, 8)
        monitor(bad, 9)  # came back: warned at once
        assert len(caplog.records) == 1
