"""verl's model-loading knobs as typed keys: ``actor_rollout_ref.model.override_config.*`` is
``model.override_config`` (a mapping), and ``actor_rollout_ref.model.lora_adapter_path`` is
``actor.lora.adapter_path``, whose folder's adapter_config.json fills ``actor.lora`` (the adapter's
own config wins, as in verl); a missing or broken folder is a one-line error naming the path."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hybridflow.config import ConfigError, load_config, validate_config

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
                  "target_modules": ["v_proj", "q_proj"], "exclude_modules": None, "bias": "none",
                  "use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
                  "modules_to_save": None, "fan_in_fan_out": False, "layers_to_transform": None}


def _adapter(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({**ADAPTER_CONFIG, **changes}))
    (folder / "adapter_model.safetensors").write_bytes(b"")  # its contents are the actor's to read
    return folder


def test_verls_override_config_is_the_models_mapping() -> None:
    cfg = load_config(overrides=["+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
                                 "actor_rollout_ref.model.override_config.model_config.attention_dropout=0.1",
                                 "model.override_config.rope_theta=1000000.0"])
    assert cfg.model.override_config == {"max_position_embeddings": 32768, "attention_dropout": 0.1,
                                         "rope_theta": 1000000.0}
    assert validate_config(cfg) == []
    assert load_config().model.override_config == {}


@pytest.mark.parametrize(("override", "expected"), [
    ("actor_rollout_ref.model.override_config.moe_config.topk=2", "Megatron's MoE settings have no counterpart"),
    ("actor_rollout_ref.model.override_config.moe_config.freeze_moe_router=true", "trains the MoE router"),
    ("critic.model.override_config.max_position_embeddings=4096", "hybridflow loads the model's config.json as saved"),
    ("model.override_config=5", "config key 'model.override_config'"),
])
def test_override_config_refusals_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(overrides=[override])
    assert "\n" not in str(info.value)


def test_the_adapter_folder_fills_actor_lora(tmp_path) -> None:
    folder = _adapter(tmp_path / "adapter")
    cfg = load_config(overrides=[f"actor_rollout_ref.model.lora_adapter_path={folder}"])
    lora = cfg.actor.lora
    assert (lora.adapter_path, lora.rank, lora.alpha, lora.target_modules, lora.dropout, lora.exclude_modules) == (
        str(folder), 4, 8.0, ["q_proj", "v_proj"], 0.05, None)
    assert validate_config(cfg) == []


def test_the_adapters_own_config_wins_with_a_note(tmp_path, caplog) -> None:
    folder = _adapter(tmp_path / "adapter")
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.lora_adapter"):
        cfg = load_config(overrides=[f"actor.lora.adapter_path={folder}", "actor.lora.rank=16",
                                     "actor.lora.alpha=8"])
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha) == (4, 8.0)
    [note] = [r.getMessage() for r in caplog.records]
    assert "the adapter's own config wins, as in verl" in note and "rank 16 -> 4" in note and "alpha" not in note


def test_a_list_of_excluded_names_becomes_the_regex_peft_would_match(tmp_path) -> None:
    import re

    cfg = load_config(overrides=[f"actor.lora.adapter_path={_adapter(tmp_path / 'a', exclude_modules=['visual'])}"])
    pattern = cfg.actor.lora.exclude_modules
    assert re.fullmatch(pattern, "model.visual") and re.fullmatch(pattern, "visual")
    assert not re.fullmatch(pattern, "model.visual.blocks.0") and not re.fullmatch(pattern, "model.nonvisual")


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p / "missing", "is not a directory"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "has no adapter_config.json"),
    (lambda p: _weightless(p), "has no adapter_model.safetensors"),
    (lambda p: _broken(p), "has an unreadable adapter_config.json"),
    (lambda p: _adapter(p / "dora", use_dora=True), "sets use_dora=True"),
    (lambda p: _adapter(p / "rs", use_rslora=True), "sets use_rslora=True"),
    (lambda p: _adapter(p / "regex", target_modules=".*proj"), "target_modules"),
    (lambda p: _adapter(p / "ia3", peft_type="IA3"), "holds a IA3 adapter"),
])
def test_a_missing_or_broken_folder_is_one_line_naming_the_path(tmp_path, make, expected) -> None:
    folder = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"actor.lora.adapter_path={folder}"])
    message = str(info.value)
    assert message.startswith(f"actor.lora.adapter_path='{folder}'") and expected in message, message
    assert "\n" not in message


def _weightless(root: Path) -> Path:
    folder = _adapter(root / "weightless")
    (folder / "adapter_model.safetensors").unlink()
    return folder


def _broken(root: Path) -> Path:
    folder = _adapter(root / "broken")
    (folder / "adapter_config.json").write_text("{not json")
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from hybridflow.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("overrides") / "model"))


def test_config_explain_judges_the_overridden_config(model_dir, tmp_path, capsys) -> None:
    """A name the config class lacks fails at start-up (config explain too), not when the actor loads;
    and the rollout engine's check sees the config as overridden (a length-dependent RoPE the native
    engine cannot run)."""
    from hybridflow.cli import main

    common = ["config", "explain", f"model.path={model_dir}", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main([*common, "+actor_rollout_ref.model.override_config.max_position_embeddings=32768"]) == 0
    capsys.readouterr()
    assert main([*common, "actor_rollout_ref.model.override_config.max_position_embedding=32768"]) == 2
    assert "model.override_config.max_position_embedding: Qwen2Config has no attribute 'max_position_embedding'" \
        in capsys.readouterr().out
    assert main([*common, "model.override_config.rope_scaling={rope_type: dynamic, factor: 2.0}"]) == 2
    assert "the native rollout engine does not support rope_type 'dynamic'" in capsys.readouterr().out
