"""The engine factory and protocol."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.rollout.base import (
    ROLLOUT_ENGINES,
    RolloutEngine,
    build_rollout_engine,
    resolve_rollout_dtype,
)
from hybridflow.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)


def _build(name: str) -> RolloutEngine:
    return build_rollout_engine(
        name,
        model=build_tiny_model(TinyModelSpec(num_hidden_layers=1)),
        eos_token_ids=[258],
        pad_token_id=256,
        max_batch_size=8,
        device="cpu",
        dtype="float32",
        seed=3,
    )


def test_native_engine_is_built_by_name_and_serves_the_builtin_model():
    engine = _build("native")
    assert isinstance(engine, RolloutEngine)
    (trajectories,) = engine.generate_batch([GenerationRequest([1, 2, 3], SamplingParams(n=2, max_tokens=4))])
    assert len(trajectories) == 2
    assert all(1 <= len(t.response_ids) <= 4 for t in trajectories)


def test_unknown_engine_name_lists_the_available_ones():
    assert "native" in ROLLOUT_ENGINES
    with pytest.raises(ValueError, match=r"unknown rollout engine 'vllm' \(rollout.name\); available: native"):
        _build("vllm")


def test_auto_rollout_dtype_is_bfloat16_on_a_gpu_and_float32_on_a_cpu():
    assert resolve_rollout_dtype("auto", "cuda") == "bfloat16"
    assert resolve_rollout_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_rollout_dtype("bfloat16", "cpu") == "bfloat16"  # an explicit choice is kept


def test_the_factory_resolves_auto_and_passes_enforce_eager():
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1))
    engine = build_rollout_engine("native", model=model, eos_token_ids=[258], pad_token_id=256, max_batch_size=4,
                                  device="cpu", dtype="auto", enforce_eager=True)
    assert engine.decode_mode == "eager"
    assert next(model.parameters()).dtype == torch.float32
