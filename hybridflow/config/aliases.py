"""verl's spellings of hybridflow's config keys, so a verl command line or YAML file works here.

verl nests the policy's settings under ``actor_rollout_ref`` (``actor``, ``rollout``, ``ref``,
``model``); hybridflow keeps them at the top level. ``translate_key`` is the one entry point: a key
is translated by the first rule that matches, each use logged once as a one-line note:

- ``KEYS``: whole keys that live elsewhere here (the old-logprob micro-batch is the actor's, not the
  rollout's; padding removal is the actor's, not the model's; the chat template is the data's).
- ``IGNORED`` and ``verl_keys.RULES``: keys accepted and dropped with why (a sharding strategy
  hybridflow always uses, a profiler), or refused in one line saying what hybridflow does instead
  (every Megatron key), some of them only away from the value that leaves the run as verl's.
- ``PREFIXES``: ``actor_rollout_ref.<role>.`` -> ``<role>.``; the rest of the key is the same.

Anything else unknown is still an error with a suggestion. Every key of verl's trainer config is
classified (tests/unit/config/test_config_verl_keys.py walks them all; docs/verl_keys.md lists them),
and verl's quickstart and GRPO command lines are tested in tests/unit/config/test_config_aliases.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hybridflow.config.errors import ConfigError
from hybridflow.config.verl_keys import GLOBAL_MICRO_BATCH, NULL_IS_UNSET, Rule, normalise, rule_for

log = logging.getLogger(__name__)

PREFIXES: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.", "actor."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.ref.", "ref."),
    # verl's HFModelConfig unwraps override_config.model_config (Megatron's nesting) into the same keys.
    ("actor_rollout_ref.model.override_config.model_config.", "model.override_config."),
    ("actor_rollout_ref.model.", "model."),
    # verl's keyword arguments for the custom reward function: hybridflow's reward.reward_kwargs
    # (passed to every call, checked against the function's signature at start-up).
    ("custom_reward_function.reward_kwargs.", "reward.reward_kwargs."),
    # verl <= 0.7 kept the custom reward function at the top level.
    ("custom_reward_function.", "reward.custom_reward_function."),
    # The reward manager's own arguments (verl passes them to the manager's constructor).
    ("reward_model.reward_kwargs.", "reward.reward_kwargs."),
)

KEYS: dict[str, str] = {
    "custom_reward_function.reward_kwargs": "reward.reward_kwargs",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.max_num_seqs": "rollout.max_batch_size",
    "actor_rollout_ref.model.use_remove_padding": "actor.use_remove_padding",
    "actor_rollout_ref.model.custom_chat_template": "data.chat_template",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "actor_rollout_ref.model.exclude_modules": "actor.lora.exclude_modules",
    "actor_rollout_ref.model.lora_adapter_path": "actor.lora.adapter_path",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.default_local_dir": "trainer.checkpoint_dir",
    "global_profiler.steps": "trainer.profile.steps",
    # verl keeps the PPO clip's SAPO temperatures and gradient clip in other sections.
    "actor_rollout_ref.actor.tau_pos": "actor.policy_loss.tau_pos",
    "actor_rollout_ref.actor.tau_neg": "actor.policy_loss.tau_neg",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.lr_scheduler_type",  # verl's older name
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    # The training compute dtype is one knob here (FSDP2's param_dtype is the compute dtype); the
    # stored dtype and the gradient reduction's are fsdp_config's.
    "actor_rollout_ref.actor.fsdp_config.dtype": "model.dtype",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "model.dtype",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype": "actor.fsdp_config.reduce_dtype",
    "critic.model.fsdp_config.mixed_precision.reduce_dtype": "critic.fsdp_config.reduce_dtype",
    "critic.model.fsdp_config.model_dtype": "critic.fsdp_config.model_dtype",
    # verl files the critic's sharding and padding under its model.
    "critic.model.fsdp_config.param_offload": "critic.fsdp_config.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.fsdp_config.optimizer_offload",
    "critic.model.fsdp_config.fsdp_size": "critic.fsdp_config.fsdp_size",
    "critic.model.use_remove_padding": "critic.use_remove_padding",
    # Rewards: the manager, DAPO's overlong buffer (a reward_kwargs entry in verl), scoring workers.
    "reward_model.reward_manager": "reward.reward_manager",
    "reward_manager.name": "reward.reward_manager",
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": "reward.overlong_buffer.enable",
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": "reward.overlong_buffer.len",
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": "reward.overlong_buffer.penalty_factor",
    "reward_model.reward_kwargs.max_resp_len": "reward.overlong_buffer.max_response_length",
    # verl's SandboxFusion code rewards: rule scoring, which is reward.* here.
    "reward_model.sandbox_fusion.url": "reward.sandbox_fusion.url",
    "reward_model.sandbox_fusion.max_concurrent": "reward.sandbox_fusion.max_concurrent",
    "reward_model.sandbox_fusion.memory_limit_mb": "reward.sandbox_fusion.memory_limit_mb",
    "reward_model.num_workers": "reward.num_workers",
    "data.tool_config_path": "rollout.multi_turn.tool_config_path",
    # verl copies the data lengths into the rollout; one pair of lengths sizes everything here.
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    # verl's SFT trainer (fsdp_sft_trainer) spellings, read by hybridflow sft.
    "data.multiturn.messages_key": "sft.messages_key",
    "data.response_key": "sft.response_key",
    "data.max_length": "sft.max_length",
    "data.micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_gpu",
    # verl's colocated actor, rollout and reference in one process per GPU; true in verl's every config, as here.
    "actor_rollout_ref.hybrid_engine": "trainer.hybrid_engine",
}

IGNORED: dict[str, str] = {
    "actor_rollout_ref.rollout.gpu_memory_utilization":
        "the native engine's KV cache is sized in bytes by rollout.kv_cache_memory_bytes (null: a share of the free "
        "memory at the run's first start, recorded for its resumes), not a memory fraction",
    "actor_rollout_ref.rollout.mode": "rollout.mode here picks in-process (engine) or HTTP server (server) generation; "
                                      "verl's sync/async has no counterpart",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "the reference is offloaded with the actor's fsdp_config",
}


_NO_VALUE: Any = object()


def translate_key(key: str, value: Any = _NO_VALUE) -> str | None:
    """The hybridflow key for ``key`` (itself when it is not one of verl's spellings), or None when
    the key is one hybridflow accepts and ignores (at ``value``: the text of an override or a YAML
    value). Logs the note once per key. Raises ``ConfigError`` (one line, naming the key and what
    hybridflow does instead) for a verl key, or a value of one, that hybridflow refuses; a key
    refused only away from verl's default is refused when no ``value`` is given."""
    if value is not _NO_VALUE and key in NULL_IS_UNSET and normalise(value) is None:
        _note_once(key, f"config: {key}=null keeps hybridflow's value: {NULL_IS_UNSET[key]}")
        return None
    if key in GLOBAL_MICRO_BATCH:
        return _global_micro_batch(key, value)
    if key in KEYS:
        return _noted(key, KEYS[key])
    if key in IGNORED:
        _note_once(key, f"config: {key} is ignored: {IGNORED[key]}")
        return None
    found = rule_for(key)
    if found is not None:
        _, rule = found
        if rule.always_ignored or (value is not _NO_VALUE and rule.accepted(value)):
            _note_once(key, f"config: {key} is ignored: {rule.reason}")
            return None
        if rule.forward is not None:
            return _noted(key, rule.forward)
        raise _refusal(key, value, rule)
    for theirs, ours in PREFIXES:
        if key.startswith(theirs):
            return _noted(key, ours + key[len(theirs):])
    return key


def _global_micro_batch(key: str, value: Any) -> None:
    """verl's null global micro-batch (its default) leaves the per-rank key alone; a number needs
    the run's rank count, which only the whole config has: the loader converts it
    (``verl_keys.per_rank_micro_batch``) and never passes it here."""
    per_gpu = GLOBAL_MICRO_BATCH[key].per_gpu
    if value is not _NO_VALUE and normalise(value) is None:
        _note_once(key, f"config: {key}=null keeps hybridflow's {per_gpu}")
        return None
    raise ConfigError(f"verl's {key} is a global micro-batch, divided over the run's ranks into {per_gpu}; only a "
                      f"whole config (load_config) can convert it: set {per_gpu} (samples per rank)", key=key)


def _refusal(key: str, value: Any, rule: Rule) -> Exception:
    if rule.always_refused:
        return ConfigError(f"verl's {key} is not supported here: {rule.reason}", key=key)
    shown = "" if value is _NO_VALUE else f"={str(value).strip()}"
    return ConfigError(f"verl's {key}{shown} is not supported here (accepted: {rule.accepted_text()}): "
                       f"{rule.reason}", key=key)


def translate_mapping(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """A nested config mapping (a YAML file) with verl's spellings translated: every leaf is
    translated as a dotted key, then nested again (the schema has no mapping-valued leaves, so
    this changes nothing else; a dotted key written flat in YAML nests the same way)."""
    out: dict[Any, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            out[key] = value  # the loader names it
            continue
        for dotted, leaf in _leaves(key, value):
            ours = translate_key(dotted, leaf)
            if ours is not None:
                _merge(out, _nest(ours, leaf))
    return out


def _leaves(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{prefix}.{k}", v)]
    return [(prefix, value)]


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for k, v in other.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = dict(v) if isinstance(v, Mapping) else v


_noted_keys: set[str] = set()


def _noted(theirs: str, ours: str) -> str:
    _note_once(theirs, f"config: {theirs} is hybridflow's {ours}")
    return ours


def _note_once(key: str, message: str) -> None:
    if key not in _noted_keys:
        _noted_keys.add(key)
        log.info("%s", message)
