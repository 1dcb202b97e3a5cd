"""The engine factory and protocol."""

from __future__ import annotations

import re

import pytest
import torch

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.rollout.base import RolloutEngine, choose_rollout_dtype
from hybridflow.rollout.factory import (
    ROLLOUT_ENGINES,
    EngineArgs,
    EngineSpec,
    build_rollout_engine,
    engine_unavailable,
)
from hybridflow.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)


def _build(name: str) -> RolloutEngine:
    return build_rollout_engine(
        name,
        EngineArgs(
            model=build_tiny_model(TinyModelSpec(num_hidden_layers=1)),
            eos_token_ids=[258],
            pad_token_id=256,
            max_batch_size=8,
            device="cpu",
            dtype="float32",
            seed=3,
        ),
    )


def test_native_engine_is_built_by_name_and_serves_the_builtin_model():
    engine = _build("native")
    assert isinstance(engine, RolloutEngine)
    (trajectories,) = engine.generate_batch([GenerationRequest([1, 2, 3], SamplingParams(n=2, max_tokens=4))])
    assert len(trajectories) == 2
    assert all(1 <= len(t.response_ids) <= 4 for t in trajectories)


def test_unknown_engine_name_lists_the_available_ones():
    assert "native" in ROLLOUT_ENGINES
    with pytest.raises(ValueError, match=r"unknown rollout engine 'nonesuch' \(rollout.name\); available: .*native"):
        _build("nonesuch")


def test_engine_availability_is_checked_without_importing_the_backend(monkeypatch):
    assert engine_unavailable("native", "cpu") is None
    assert "unknown rollout engine 'nonesuch'" in engine_unavailable("nonesuch", "cpu")
    monkeypatch.setitem(ROLLOUT_ENGINES, "absent", EngineSpec(build=_build, package="hybridflow_no_such_pkg",
                                                                extra="absent"))
    assert engine_unavailable("absent", "cpu") == (
        "rollout engine 'absent' needs the 'hybridflow_no_such_pkg' package, which is not installed: "
        "pip install 'hybridflow[absent]'")
    seen: list[torch.device] = []

    def needs_gpu(device: torch.device) -> str | None:
        seen.append(device)
        return None if device.type == "cuda" else "it needs a GPU (trainer.device=cuda)"

    monkeypatch.setitem(ROLLOUT_ENGINES, "gpu_only", EngineSpec(build=_build, available=needs_gpu))
    assert engine_unavailable("gpu_only", "cpu") == "it needs a GPU (trainer.device=cuda)"
    assert engine_unavailable("gpu_only", "cuda") is None
    assert seen == [torch.device("cpu"), torch.device("cuda")]


def test_an_unavailable_engine_is_a_config_error_on_rollout_name_before_anything_loads(monkeypatch):
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import resolve_plugins

    monkeypatch.setitem(ROLLOUT_ENGINES, "absent", EngineSpec(build=_build, package="hybridflow_no_such_pkg",
                                                                extra="absent"))
    with pytest.raises(ConfigError, match=r"rollout.name=absent: rollout engine 'absent' needs") as caught:
        resolve_plugins(make_config(overrides=["rollout.name=absent"]))
    assert caught.value.key == "rollout.name"


def test_auto_rollout_dtype_is_bfloat16_on_a_gpu_and_float32_on_a_cpu():
    assert choose_rollout_dtype("auto", "cuda").dtype == "bfloat16"
    assert choose_rollout_dtype("auto", torch.device("cpu")).dtype == "float32"
    assert choose_rollout_dtype("bfloat16", "cpu").dtype == "bfloat16"  # an explicit choice is kept


def test_the_factory_resolves_auto_and_passes_enforce_eager():
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1))
    engine = build_rollout_engine("native", EngineArgs(model=model, eos_token_ids=[258], pad_token_id=256,
                                                       max_batch_size=4, device="cpu", dtype="auto", enforce_eager=True))
    assert engine.decode_mode == "eager"
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(
    ("model_config", "expected"),
    [
        ({"model_type": "gpt_neox"}, "supports model types llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text, "
                                     "qwen3_moe, mixtral; got 'gpt_neox': use rollout.name=vllm or rollout.name=sglang"),
        ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}},
         "does not support rope_type 'su'"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "needs hidden_act='silu' for llama, got 'gelu'"),
        ({"model_type": "gemma3", "text_config": {}}, "got 'gemma3' (a multimodal Gemma 3 checkpoint"),
    ],
)
def test_a_model_the_native_engine_cannot_run_fails_at_set_up_from_its_config_json(tmp_path, model_config, expected):
    """Only config.json is read: the directory has no weights, and set-up refuses it anyway."""
    import json

    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import resolve_plugins

    (tmp_path / "config.json").write_text(json.dumps(model_config))
    with pytest.raises(ConfigError, match=re.escape(expected)) as caught:
        resolve_plugins(make_config(overrides=[f"model.path={tmp_path}"]))
    assert caught.value.key == "model.path"
    assert f"model.path={str(tmp_path)!r} with rollout.name=native" in str(caught.value)


def test_a_mixture_of_experts_model_with_tensor_parallelism_fails_at_set_up(tmp_path):
    import json

    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import check_rollout_model, resolve_plugins

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_act": "silu"}))
    check_rollout_model(str(tmp_path), "native", 1)
    with pytest.raises(ConfigError, match="does not split mixtral .* rollout.tensor_model_parallel_size=2"):
        check_rollout_model(str(tmp_path), "native", 2)
    # resolve_plugins passes the configured size (a local run refuses TP>1 for its own reason first).
    cfg = make_config(overrides=[f"model.path={tmp_path}"])
    cfg.rollout.tensor_model_parallel_size = 2
    with pytest.raises(ConfigError, match="does not split mixtral"):
        resolve_plugins(cfg)


def test_a_supported_model_type_passes_the_set_up_check(tmp_path):
    import json

    from hybridflow.api import make_config
    from hybridflow.controller.preflight import resolve_plugins

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_act": "silu",
                                                      "sliding_window": 4096}))
    resolve_plugins(make_config(overrides=[f"model.path={tmp_path}"]))


@pytest.mark.parametrize("engine", ["native", "vllm", "sglang"])
def test_a_vision_language_model_needs_the_hf_vision_engine_and_it_needs_one(tmp_path, engine):
    import json

    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import check_rollout_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ConfigError, match=f"qwen2_vl vision-language model, which rollout.name={engine} cannot "
                                          "generate from images; set rollout.name=hf_vision"):
        check_rollout_model(str(tmp_path), engine)
    check_rollout_model(str(tmp_path), "hf_vision")
    with pytest.raises(ConfigError, match="hf_vision: runs vision-language models .* got 'qwen2': use rollout.name=native"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        check_rollout_model(str(tmp_path), "hf_vision")


@pytest.mark.parametrize("override, key", [
    ("rollout.multi_turn.enable=true", "rollout.multi_turn.enable"),
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator"),
])
def test_what_a_vision_language_run_cannot_do_yet_is_refused_by_key(tmp_path, override, key):
    import json

    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import check_vision_language_run

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    check_vision_language_run(make_config(overrides=[f"model.path={tmp_path}", "rollout.name=hf_vision"]))
    cfg = make_config(overrides=[f"model.path={tmp_path}", "rollout.name=hf_vision", override])
    with pytest.raises(ConfigError, match=f"{key}: model.path is a vision-language model and") as caught:
        check_vision_language_run(cfg)
    assert caught.value.key == key
