"""rollout.dtype on a CPU: auto is a rule (bf16 hardware and the model's size); tune bf16 only when measured
faster and close."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.inference import precision
from hybridflow.rollout import base
from hybridflow.rollout.base import choose_rollout_dtype
from hybridflow.rollout.factory import EngineArgs, build_rollout_engine
from hybridflow.inference.precision import (
    BF16_MIN_PARAMETERS,
    PrecisionProbe,
    probe_decode_precision,
    rule_cpu_rollout_dtype,
    tune_cpu_rollout_dtype,
)
from hybridflow.utils.device import CpuFeatures

torch.set_num_threads(1)

AVX2 = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx2"}), capability="AVX2")
AMX = CpuFeatures(vendor="GenuineIntel", model_name="Xeon 8480+", flags=frozenset({"avx512_bf16", "amx_bf16"}),
                  capability="AVX512")


def figures(speedup: float, mismatch: float) -> PrecisionProbe:
    return PrecisionProbe(batch=32, float32_step_s=speedup * 0.01, bfloat16_step_s=0.01, logprob_mismatch=mismatch,
                          logprob_mismatch_max=4 * mismatch)


def never() -> PrecisionProbe:
    raise AssertionError("no probe without bf16 hardware")


def test_without_bf16_hardware_auto_is_float32_and_nothing_is_measured():
    choice = tune_cpu_rollout_dtype(AVX2, never)
    assert choice.dtype == "float32" and "no avx512_bf16/amx_bf16" in choice.reason and choice.probe is None


@pytest.mark.parametrize(
    ("speedup", "mismatch", "expected", "why"),
    [
        (2.5, 0.01, "bfloat16", "faster and within"),
        (1.1, 0.01, "float32", "not at least 1.20x faster"),
        (2.5, 0.08, "float32", "above the logprob mismatch threshold 0.05"),
        (2.5, math.nan, "float32", "above the logprob mismatch threshold"),
    ],
)
def test_with_bf16_hardware_bf16_needs_both_speed_and_agreement(speedup, mismatch, expected, why):
    choice = tune_cpu_rollout_dtype(AMX, lambda: figures(speedup, mismatch), max_logprob_mismatch=0.05)
    assert choice.dtype == expected and why in choice.reason
    assert choice.probe is not None and f"{speedup:.2f}x" in choice.reason


def test_the_threshold_is_the_health_checks_unless_given():
    assert precision.DEFAULT_MAX_LOGPROB_MISMATCH == 0.05
    assert tune_cpu_rollout_dtype(AMX, lambda: figures(2.0, 0.03)).dtype == "bfloat16"
    assert tune_cpu_rollout_dtype(AMX, lambda: figures(2.0, 0.03), max_logprob_mismatch=0.02).dtype == "float32"


def test_auto_is_a_rule_of_the_hardware_and_the_model_size():
    assert rule_cpu_rollout_dtype(AVX2, 10**9).dtype == "float32"  # no bf16 hardware
    assert rule_cpu_rollout_dtype(AMX, None).dtype == "float32"  # no size to go by
    assert rule_cpu_rollout_dtype(AMX, BF16_MIN_PARAMETERS - 1).dtype == "float32"
    choice = rule_cpu_rollout_dtype(AMX, BF16_MIN_PARAMETERS)
    assert choice.dtype == "bfloat16" and "10.0M parameters" in choice.reason and choice.probe is None
    # The README's figures: the built-in ~0.9M model measured slower in bf16, ~20M and ~100M faster.
    assert rule_cpu_rollout_dtype(AMX, 823_424).dtype == "float32"
    assert rule_cpu_rollout_dtype(AMX, 20_000_000).dtype == rule_cpu_rollout_dtype(AMX, 10**8).dtype == "bfloat16"


def test_resolution_keeps_explicit_dtypes_and_needs_a_model_to_tune():
    assert choose_rollout_dtype("float32", "cpu", cpu=AMX).dtype == "float32"
    assert choose_rollout_dtype("bfloat16", "cpu", cpu=AVX2).dtype == "bfloat16"
    assert choose_rollout_dtype("auto", "cuda", cpu=AVX2).dtype == "bfloat16"
    assert choose_rollout_dtype("tune", "cuda", cpu=AVX2).dtype == "bfloat16"
    assert choose_rollout_dtype("auto", "cpu", cpu=AVX2).dtype == "float32"
    choice = choose_rollout_dtype("tune", "cpu", cpu=AMX)  # bf16 hardware, nothing to measure on
    assert choice.dtype == "float32" and "no model" in choice.reason


def test_the_factory_sizes_the_served_model_for_auto_and_never_times_it(monkeypatch):
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1))
    size = sum(p.numel() for p in model.parameters())

    def never(probed: torch.nn.Module, batch: int) -> PrecisionProbe:
        raise AssertionError("auto must not time anything")

    for threshold, expected in ((size, torch.bfloat16), (size + 1, torch.float32)):
        monkeypatch.setattr(precision, "BF16_MIN_PARAMETERS", threshold)
        with mock.patch.object(base, "cpu_features", return_value=AMX), \
                mock.patch.object(precision, "probe_decode_precision", never):
            engine = build_rollout_engine("native", EngineArgs(
                model=build_tiny_model(TinyModelSpec(num_hidden_layers=1)), eos_token_ids=[258], pad_token_id=256,
                max_batch_size=8, device="cpu", dtype="auto"))
        assert next(engine.model.parameters()).dtype == expected


def test_the_factory_probes_the_served_model_for_tune_on_bf16_hardware():
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1))
    seen = {}

    def fake_probe(probed: torch.nn.Module, batch: int) -> PrecisionProbe:
        seen.update(model=probed, batch=batch)
        return figures(3.0, 0.004)

    with mock.patch.object(base, "cpu_features", return_value=AMX), \
            mock.patch.object(precision, "probe_decode_precision", fake_probe):
        engine = build_rollout_engine("native", EngineArgs(model=model, eos_token_ids=[258], pad_token_id=256,
                                                           max_batch_size=8, device="cpu", dtype="tune",
                                                           max_logprob_mismatch=0.01))
    assert seen == {"model": model, "batch": 8}
    assert next(engine.model.parameters()).dtype == torch.bfloat16


def test_the_probe_measures_both_dtypes_on_copies_of_the_model():
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measured = probe_decode_precision(model, batch=2, prompt_tokens=4, steps=3)
    assert measured.batch == 2 and measured.float32_step_s > 0 and measured.bfloat16_step_s > 0
    # bf16 carries ~3 significant digits: the tokens' logprobs move, but only a little.
    assert 0 < measured.logprob_mismatch <= measured.logprob_mismatch_max < 0.5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert next(model.parameters()).dtype == torch.float32
