"""verl's spellings of hybridflow's config keys, so a verl command line or YAML file works here.

verl nests the policy's settings under ``actor_rollout_ref`` (``actor``, ``rollout``, ``ref``,
``model``); hybridflow keeps them at the top level. A key is translated by the first rule that
matches, each use logged once as a one-line note naming the hybridflow key:

- ``KEYS``: whole keys that live elsewhere here (the old-logprob micro-batch is the actor's, not the
  rollout's; padding removal is the actor's, not the model's; the chat template is the data's).
- ``PREFIXES``: ``actor_rollout_ref.<role>.`` -> ``<role>.``; the rest of the key is the same.
- ``IGNORED``: keys that choose something hybridflow has no choice of (a sharding strategy it
  always uses, a GPU memory fraction its engine does not size by): accepted, with why, and
  dropped. Anything else unknown is still an error with a suggestion.

The table is tested against verl's quickstart and GRPO example command lines
(tests/unit/config/test_config_aliases.py): every target is a real key of the schema.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

PREFIXES: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.", "actor."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.ref.", "ref."),
    ("actor_rollout_ref.model.", "model."),
    # verl <= 0.7 kept the custom reward function at the top level.
    ("custom_reward_function.", "reward.custom_reward_function."),
)

KEYS: dict[str, str] = {
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.max_num_seqs": "rollout.max_batch_size",
    "actor_rollout_ref.model.use_remove_padding": "actor.use_remove_padding",
    "actor_rollout_ref.model.custom_chat_template": "data.chat_template",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.default_local_dir": "trainer.checkpoint_dir",
    "global_profiler.steps": "trainer.profile.steps",
    # verl's SFT trainer (fsdp_sft_trainer) spellings, read by hybridflow sft.
    "data.multiturn.messages_key": "sft.messages_key",
    "data.response_key": "sft.response_key",
    "data.max_length": "sft.max_length",
    "data.micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_gpu",
}

IGNORED: dict[str, str] = {
    "actor_rollout_ref.actor.strategy": "the actor is always sharded with FSDP2 here",
    "critic.strategy": "the critic is always sharded with FSDP2 here",
    "actor_rollout_ref.rollout.gpu_memory_utilization":
        "the native engine's KV cache is sized by rollout.max_batch_size and the response length, not a memory fraction",
    "actor_rollout_ref.rollout.mode": "rollout.mode here picks in-process (engine) or HTTP server (server) generation; "
                                      "verl's sync/async has no counterpart",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "the reference is offloaded with the actor's fsdp_config",
    "actor_rollout_ref.hybrid_engine": "the actor and rollout always share their placement unless rollout.placement=split",
}


def translate_key(key: str) -> str | None:
    """The hybridflow key for ``key`` (itself when it is not one of verl's spellings), or None when
    the key is one hybridflow accepts and ignores. Logs the note once per key."""
    if key in KEYS:
        return _noted(key, KEYS[key])
    if key in IGNORED:
        _note_once(key, f"config: {key} is ignored: {IGNORED[key]}")
        return None
    for theirs, ours in PREFIXES:
        if key.startswith(theirs):
            return _noted(key, ours + key[len(theirs):])
    return key


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
            ours = translate_key(dotted)
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
