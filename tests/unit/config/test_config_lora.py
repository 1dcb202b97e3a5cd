"""``actor.lora``: off by default, typed, and every wrong value fails at start-up naming its key."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, explain_config, load_config, validate_config


def test_lora_is_off_by_default_and_a_rank_turns_it_on() -> None:
    assert load_config("grpo").actor.lora.rank == 0
    cfg = load_config("grpo", overrides=["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"])
    assert validate_config(cfg) == []
    assert (cfg.actor.lora.rank, cfg.actor.lora.target_modules) == (8, ["q_proj", "v_proj"])
    # verl writes one name: a list of one
    assert load_config("grpo", overrides=["actor.lora.target_modules=all-linear"]).actor.lora.target_modules == [
        "all-linear"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.lora.rank=-1", "actor.lora.rank=-1 must be >= 0"),
        ("actor.lora.alpha=0", "actor.lora.alpha=0.0 must be > 0"),
        ("actor.lora.dropout=1.0", "actor.lora.dropout=1.0 must be in [0, 1)"),
        ("actor.lora.target_modules=[]", "actor.lora.target_modules=[] must name at least one module"),
        ("actor.lora.target_modules=[all-linear,q_proj]", "all-linear already means every linear layer"),
        ("actor.lora.rank=eight", "actor.lora.rank"),
        ("actor.lora.sync=lazy", "config key 'actor.lora.sync' is 'lazy'; allowed values: merged, adapter"),
        ("rollout.name=vllm actor.lora.sync=adapter", "only the native engine's worker does"),
        ("trainer.mode=fully_async actor.lora.sync=adapter", "trainer.mode=fully_async stages whole weight"),
        ("actor.lora.rank=8 actor.lora.base_dtype=float16",
         "config key 'actor.lora.base_dtype' is 'float16'; allowed values: float32, bfloat16"),
        ("actor.lora.base_dtype=bfloat16", "actor.lora.base_dtype=bfloat16 stores LoRA's frozen base, but "
         "actor.lora.rank=0"),
    ],
)
def test_lora_errors_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config("grpo", overrides=override.split()))
    assert expected in str(info.value)


def test_explain_says_the_actor_serves_the_reference_under_lora() -> None:
    text = explain_config(load_config("grpo", overrides=["actor.lora.rank=8", "actor.use_kl_loss=true"]))
    assert "LoRA: rank 8, alpha 16 on all-linear: only the adapters train (float32); the frozen base is stored in " \
           "float32" in text
    cfg = load_config("grpo", overrides=["actor.lora.rank=8", "actor.lora.base_dtype=bfloat16"])
    assert validate_config(cfg) == []
    assert "the frozen base is stored in bfloat16" in explain_config(cfg)
    assert "reference: yes, the actor's base model with its adapter off" in text
