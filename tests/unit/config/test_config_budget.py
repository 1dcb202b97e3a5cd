"""Packed or padded, and the automatic token budget: pure decisions the actor and ``config explain`` share."""

from __future__ import annotations

import dataclasses

import pytest

from hybridflow.config.budget import (
    BUILTIN_TINY_SHAPE,
    MAX_AUTO_TOKENS,
    PACKED_MODEL_TYPES,
    ModelShape,
    auto_token_budget,
    packing_decision,
    read_model_shape,
    training_bytes_per_token,
)
from hybridflow.models.tiny import TinyModelSpec

GIB = 2**30
QWEN25_7B = ModelShape(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)


def test_builtin_shape_is_the_tiny_model():
    spec = TinyModelSpec()
    assert (BUILTIN_TINY_SHAPE.hidden_size, BUILTIN_TINY_SHAPE.intermediate_size, BUILTIN_TINY_SHAPE.num_hidden_layers,
            BUILTIN_TINY_SHAPE.num_attention_heads, BUILTIN_TINY_SHAPE.num_key_value_heads,
            BUILTIN_TINY_SHAPE.vocab_size) == (spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers,
                                               spec.num_attention_heads, spec.num_key_value_heads, spec.vocab_size)


def test_packing_for_the_engine_families_only():
    for family in PACKED_MODEL_TYPES:
        assert packing_decision(True, family)[0]
    packed, why = packing_decision(True, "gemma2")
    assert not packed and "gemma2" in why and "padded" in why
    packed, why = packing_decision(True, "qwen2", custom_code=True)
    assert not packed and "auto_map" in why
    assert packing_decision(False, "qwen2") == (False, "actor.use_remove_padding=false")


def test_budget_is_a_power_of_two_within_bounds():
    for free in (1 * GIB, 3 * GIB, 20 * GIB, 80 * GIB):
        budget = auto_token_budget(QWEN25_7B, free, 1024, compute_bytes=2, device_type="cuda")
        assert 1024 <= budget.ppo <= MAX_AUTO_TOKENS["cuda"]
        assert budget.ppo == 1024 or budget.ppo & (budget.ppo - 1) == 0
        assert budget.log_prob == min(2 * MAX_AUTO_TOKENS["cuda"], 2 * budget.ppo)
    # Tiny memory: never below the longest sample (a sample is never split), and the reason says so.
    tight = auto_token_budget(QWEN25_7B, GIB // 8, 3000, compute_bytes=2)
    assert tight.ppo == 3000 and "memory is tight" in tight.reason
    # A small model on a big machine is capped, whatever the memory: the same budget everywhere.
    assert auto_token_budget(BUILTIN_TINY_SHAPE, 4 * GIB, 72, compute_bytes=4).ppo == MAX_AUTO_TOKENS["cpu"]
    assert auto_token_budget(BUILTIN_TINY_SHAPE, 64 * GIB, 72, compute_bytes=4).ppo == MAX_AUTO_TOKENS["cpu"]
    assert auto_token_budget(BUILTIN_TINY_SHAPE, 64 * GIB, 72, compute_bytes=4, device_type="cuda").ppo == 16384


def test_budget_follows_the_formula():
    per_token = training_bytes_per_token(QWEN25_7B, compute_bytes=2)
    assert per_token == 28 * (10 * 3584 + 4 * 18944 + 2 * 512) * 2
    # Gradient checkpointing keeps one hidden vector per layer (+ one layer's set); full logits add V floats x 3.
    assert training_bytes_per_token(QWEN25_7B, compute_bytes=2, gradient_checkpointing=True) < per_token / 10
    assert training_bytes_per_token(QWEN25_7B, compute_bytes=2, full_logits=True) == per_token + 12 * 152064
    budget = auto_token_budget(QWEN25_7B, 40 * GIB, 1024, compute_bytes=2, device_type="cuda")
    fits = int(0.25 * 40 * GIB) // per_token
    assert budget.ppo == 1 << (fits.bit_length() - 1)
    assert f"= {fits} tokens" in budget.reason and "x 40.0 GiB" in budget.reason


def test_model_shape_from_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "auto_map": {"AutoModel": "x.Y"}}'
    )
    shape = read_model_shape(str(tmp_path))
    assert dataclasses.astuple(shape) == ("llama", 64, 128, 2, 4, 2, 100, True, None, False, False)
    assert shape.kv_size == 32
    assert read_model_shape(str(tmp_path / "missing")) is None
    assert read_model_shape("builtin:tiny") == BUILTIN_TINY_SHAPE


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], "forward path: packed"),
    (["actor.use_remove_padding=false"], "forward path: padded (actor.use_remove_padding=false)"),
    (["actor.ppo_max_token_len_per_gpu=4096", "actor.log_prob_max_token_len_per_gpu=8192"],
     "token budget: 4096 tokens per training micro-batch, 8192 per logprob micro-batch (actor.ppo_max_token_len"),
    (["actor.use_remove_padding=false", "actor.ppo_max_token_len_per_gpu=4096",
      "actor.log_prob_max_token_len_per_gpu=4096"], "4096 padded token slots (rows x the micro-batch's width)"),
    (["trainer.device=cuda"], "token budget: auto, measured at start-up: 0.25 x free GPU memory"),
])
def test_explain_shows_the_path_and_the_budget(overrides, expected):
    from hybridflow.config import load_config
    from hybridflow.config.explain import explain_config

    assert expected in explain_config(load_config(overrides=overrides))


def test_a_sample_longer_than_the_cap_raises_the_budget_and_the_reason_says_so() -> None:
    """The plan printed "8256 per micro-batch" beside "capped at 4096": both bounds applied and the
    reason named only the one that lost."""
    budget = auto_token_budget(BUILTIN_TINY_SHAPE, 64 * GIB, 8256, compute_bytes=4)
    assert budget.ppo == 8256 > MAX_AUTO_TOKENS["cpu"]
    assert f"capped at {MAX_AUTO_TOKENS['cpu']} on cpu, then raised to the longest possible sample (8256" in budget.reason
    assert "raised" not in auto_token_budget(BUILTIN_TINY_SHAPE, 64 * GIB, 72, compute_bytes=4).reason
