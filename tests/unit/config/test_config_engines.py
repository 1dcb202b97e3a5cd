"""Engine capabilities are data (``hybridflow.config.engines``): the registered engines carry the
table's entries, and the checks read a capability, never an engine's name."""

from __future__ import annotations

import dataclasses

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config.engines import ENGINE_CAPABILITIES, capabilities, engines_with
from hybridflow.rollout.factory import ROLLOUT_ENGINES

PARTIAL_ASYNC_VLLM = ["trainer.mode=fully_async", "async_training.partial_rollout=true", "rollout.name=vllm"]


def test_every_registered_engine_carries_its_row_of_the_table() -> None:
    assert set(ROLLOUT_ENGINES) == set(ENGINE_CAPABILITIES)
    for name, spec in ROLLOUT_ENGINES.items():
        assert spec.capabilities is ENGINE_CAPABILITIES[name], name


def test_messages_list_the_engines_that_have_a_capability() -> None:
    assert engines_with("tensor_parallel") == "native, vllm or sglang"
    assert engines_with("partial_rollout") == "native"
    assert engines_with("images") == "hf_vision"
    with pytest.raises(ValueError, match="unknown engine capability 'teleport'"):
        engines_with("teleport")


def test_an_unknown_engine_has_no_capability() -> None:
    assert not any(dataclasses.astuple(capabilities("no_such_engine")))


def _errors(overrides: list[str]) -> str:
    try:
        validate_config(load_config("grpo", overrides=overrides))
    except ConfigError as error:
        return str(error)
    return ""


def test_partial_rollout_is_refused_by_capability_not_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "async_training.partial_rollout=true (new weights pushed" in _errors(PARTIAL_ASYNC_VLLM)
    monkeypatch.setitem(ENGINE_CAPABILITIES, "vllm", dataclasses.replace(ENGINE_CAPABILITIES["vllm"],
                                                                         partial_rollout=True))
    assert "async_training.partial_rollout" not in _errors(PARTIAL_ASYNC_VLLM)


def test_adapter_sync_is_refused_by_capability_not_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ["rollout.name=vllm", "actor.lora.rank=8", "actor.lora.sync=adapter"]
    assert "only the native engine's worker does" in _errors(overrides)
    monkeypatch.setitem(ENGINE_CAPABILITIES, "vllm", dataclasses.replace(ENGINE_CAPABILITIES["vllm"],
                                                                         adapter_merging=True))
    assert "actor.lora.sync=adapter" not in _errors(overrides)
