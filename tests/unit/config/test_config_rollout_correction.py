"""algorithm.rollout_correction as verl's examples write it: rollout_is_batch_normalize, chained
rollout_rs criteria and a rollout_rs_threshold that is a number or verl's spec text."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config.verl_table import classify
from hybridflow.controller.preflight import resolve_plugins

RC = "algorithm.rollout_correction"


def correction(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(overrides=list(overrides)).algorithm.rollout_correction


def test_verls_multi_rs_lines_load_as_written() -> None:
    rc = correction(f"{RC}.rollout_rs='token_k1,seq_max_k2'", f"{RC}.rollout_rs_threshold='0.6_1.6,2.5'",
                    f"{RC}.rollout_is_batch_normalize=True")
    assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_is_batch_normalize) == (
        "token_k1,seq_max_k2", "0.6_1.6,2.5", True)
    assert classify(f"{RC}.rollout_is_batch_normalize").status == "honoured"


@pytest.mark.parametrize(("value", "expected"), [("2.5", 2.5), ("3", 3.0), ("0.5_2.0", "0.5_2.0"), ("null", 2.0)])
def test_the_threshold_is_a_number_or_a_spec_text(value: str, expected: float | str) -> None:
    threshold = correction(f"{RC}.rollout_rs_threshold={value}").rollout_rs_threshold
    assert threshold == expected and type(threshold) is type(expected)


def test_a_threshold_of_another_type_is_named() -> None:
    with pytest.raises(ConfigError, match=r"rollout_rs_threshold' expects float \| str, got bool True"):
        correction(f"{RC}.rollout_rs_threshold=true")


@pytest.mark.parametrize(("overrides", "error"), [
    ([f"{RC}.rollout_rs=token_k4"], r"unknown rollout_rs criterion 'token_k4'"),
    ([f"{RC}.rollout_rs='token_k1,seq_max_k2'", f"{RC}.rollout_rs_threshold='1,2,3'"], "has 3 entries"),
    ([f"{RC}.rollout_rs=seq_max_k3", f"{RC}.rollout_rs_threshold=0.1_0.2"], "upper bound only"),
])
def test_a_bad_rejection_spec_is_a_config_error_on_its_key(overrides: list[str], error: str) -> None:
    cfg = load_config(overrides=overrides)
    validate_config(cfg)
    with pytest.raises(ConfigError, match=error) as info:
        resolve_plugins(cfg, check_machine=False)
    assert info.value.key == f"{RC}.rollout_rs"


def test_batch_normalize_without_weights_warns() -> None:
    warnings = validate_config(load_config(overrides=[f"{RC}.rollout_is_batch_normalize=true"]))
    assert any("rollout_is_batch_normalize=true has no effect" in w for w in warnings)
    assert not any("rollout_is_batch_normalize" in w for w in validate_config(load_config(overrides=[
        f"{RC}.rollout_is_batch_normalize=true", f"{RC}.rollout_is=sequence"])))
