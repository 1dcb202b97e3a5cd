"""What hybridflow makes of each key of verl's trainer config that is not simply one of its own.

verl's key tree (its ``ppo_trainer.yaml`` and ``ppo_megatron_trainer.yaml`` fully resolved, about
700 leaves; tests/data/verl_config_keys.tsv) reaches hybridflow through ``aliases.translate_key``.
A key there is one of:

- **honoured**: after the prefix rewrite (``actor_rollout_ref.actor.`` -> ``actor.``) it is a
  hybridflow key of the same meaning;
- **alias**: a hybridflow key of the same meaning under another name (``aliases.KEYS``);
- **ignored**: accepted and dropped with a one-line reason, because no value of it changes what
  verl would train (a profiler, a memory or speed knob, an implementation switch);
- **refused**: a ``ConfigError`` in one line saying what hybridflow does instead. Some are refused
  only away from the values that leave the run as verl would run it (``data.train_max_samples=-1``
  is verl's default and means "every row"; any other value would cut the data and is refused).

``RULES`` holds the last two, by exact key or by a glob over a whole subtree when every key in it
gets the same truthful answer (``*.megatron.*``, ``*.profiler.*``). tests/unit/config/
test_config_verl_keys.py walks verl's whole key list and fails on a key that none of these covers;
docs/verl_keys.md is the table ``verl_table.verl_keys_markdown`` makes of it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from hybridflow.config.errors import ConfigError
from hybridflow.config.schema import key_value

ANY = None
"""``Rule.accepts`` for a key ignored at every value."""


@dataclass(frozen=True)
class Rule:
    """How a verl key that hybridflow does not honour is treated.

    ``accepts`` is the set of values that leave the run as verl would run it (accepted and
    dropped, with ``reason`` as the note): ``ANY`` for every value, a tuple of values, or a
    predicate. Any other value is refused with ``reason`` as what hybridflow does instead, or given
    to ``forward``.
    """

    reason: str
    accepts: tuple[Any, ...] | Callable[[Any], bool] | None = ()
    forward: str | None = None
    """A hybridflow key that any other value is given to, instead of a refusal (the value means the
    same there, and verl's default means nothing here)."""

    @property
    def always_ignored(self) -> bool:
        return self.accepts is ANY

    @property
    def always_refused(self) -> bool:
        return isinstance(self.accepts, tuple) and not self.accepts

    def accepted(self, value: Any) -> bool:
        if self.accepts is ANY:
            return True
        if callable(self.accepts):
            return bool(self.accepts(value))
        return any(same_value(value, allowed) for allowed in self.accepts)

    def accepted_text(self) -> str:
        if self.accepts is ANY:
            return "any value"
        if callable(self.accepts):
            return getattr(self.accepts, "__doc__", None) or "verl's default"
        return ", ".join(_show(v) for v in self.accepts)


def ignore(reason: str) -> Rule:
    return Rule(reason, ANY)


def refuse(reason: str, unless: tuple[Any, ...] | Callable[[Any], bool] = ()) -> Rule:
    return Rule(reason, unless)


def forward(reason: str, unless: tuple[Any, ...], to: str) -> Rule:
    """Accepted and dropped at ``unless`` (``reason`` says why); any other value sets ``to``."""
    return Rule(reason, unless, forward=to)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def normalise(value: Any) -> Any:
    """A value as verl would read it: text from a command line is parsed as YAML (``False``,
    ``null``, ``'error'``, ``[a,b]``); anything else is kept."""
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return parsed
    return value


def same_value(value: Any, allowed: Any) -> bool:
    value = normalise(value)
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value is allowed
    if isinstance(allowed, (int, float)) and isinstance(value, (int, float)):
        return math.isclose(float(value), float(allowed), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(allowed, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(value) == len(allowed) and all(same_value(v, a) for v, a in zip(value, allowed, strict=True))
    return bool(value == allowed)


def _empty(value: Any) -> bool:
    """null or an empty mapping"""
    value = normalise(value)
    return value is None or value == {} or value == []


def _verl_class(value: Any) -> bool:
    """a verl class (verl.*)"""
    value = normalise(value)
    return isinstance(value, str) and value.startswith("verl.")


def _mtp_off(value: Any) -> bool:
    """null, or verl's multi-token-prediction config with enable false"""
    value = normalise(value)
    return value is None or (isinstance(value, dict) and not value.get("enable", False))


def _adamw(value: Any) -> bool:
    """AdamW"""
    value = normalise(value)
    return isinstance(value, str) and value.lower() == "adamw"


def _all_contents(value: Any) -> bool:
    """[model, optimizer, extra] in any order"""
    value = normalise(value)
    return isinstance(value, (list, tuple)) and sorted(value) == ["extra", "model", "optimizer"]


# ----------------------------------------------------------------------------------------------
# The one-line answers shared by many keys


def megatron_line(role: str) -> str:
    """What hybridflow does instead of verl's Megatron settings of ``role`` (actor, critic, ...)."""
    if role == "rollout":
        return ("hybridflow trains with FSDP2, not Megatron: weights reach the rollout by their Hugging Face names, "
                "with no layer map")
    if role == "reward_model":
        return ("hybridflow runs the reward model with FSDP2, not Megatron (its own worker group, "
                "reward_model.micro_batch_size_per_gpu per forward)")
    if role == "ref":
        role = "actor"  # the reference shares the actor's layout
    return (f"hybridflow trains with FSDP2, not Megatron: shard with {role}.fsdp_config.fsdp_size, offload with "
            f"{role}.fsdp_config.param_offload/optimizer_offload, split long sequences with "
            f"{role}.ulysses_sequence_parallel_size; tensor, pipeline, expert and context parallel training are not "
            "supported (rollout.tensor_model_parallel_size is generation's)")


def _strategy(role: str) -> Rule:
    return refuse(megatron_line(role), unless=("fsdp", "fsdp2"))


PROFILER = ignore("hybridflow profiles with torch.profiler: trainer.profile.steps (verl's global_profiler.steps) and "
                  "trainer.profile.*; other profiler settings change no result")
SPEED = "a speed or memory setting of verl's implementation; the numbers trained are the same without it"
ROUTER_REPLAY = "hybridflow has no MoE router replay; routing is recomputed by the trainer's forward"
CHECKPOINT_CONTENTS = ("hybridflow's checkpoints always hold the model, the optimizer and the trainer state "
                       "(`hybridflow export` writes a Hugging Face folder)")
OVERRIDE_CONFIG = ("hybridflow loads the model's config.json as saved (edit a copy of the model folder to change it)")
POLICY_OVERRIDE_CONFIG = ("hybridflow's model.override_config takes the model's HF config keys "
                          "(actor_rollout_ref.model.override_config.<key>, or .model_config.<key> as verl's FSDP "
                          "engine unwraps it); Megatron's MoE settings have no counterpart")
MODEL_CONFIG_ENTRIES = ("give its entries one by one: actor_rollout_ref.model.override_config.model_config.<key> is "
                        "model.override_config.<key>")
ROLE_FSDP = {
    "actor_rollout_ref.actor.fsdp_config": "actor",
    "actor_rollout_ref.ref.fsdp_config": "ref",
    "critic.model.fsdp_config": "critic",
}


def _fsdp_rules() -> dict[str, Rule]:
    """verl's FSDP engine settings of each role that are not hybridflow keys of the same name."""
    rules: dict[str, Rule] = {}
    for prefix, role in ROLE_FSDP.items():
        ours = "actor" if role == "ref" else role
        rules.update({
            f"{prefix}.offload_policy": refuse(
                f"hybridflow's {ours}.fsdp_config.param_offload is FSDP2's CPUOffloadPolicy: set that instead",
                unless=(False,)),
            f"{prefix}.reshard_after_forward": ignore("hybridflow's FSDP2 always reshards after forward; " + SPEED),
            f"{prefix}.forward_prefetch": ignore(SPEED),
            f"{prefix}.wrap_policy.min_num_params": ignore("hybridflow's FSDP2 shards each decoder layer; " + SPEED),
            f"{prefix}.use_orig_params": ignore("an FSDP1 setting; FSDP2 always keeps the original parameters"),
            f"{prefix}.seed": ignore("hybridflow seeds every role from trainer.seed"),
            f"{prefix}.full_determinism": refuse("hybridflow does not switch torch to deterministic kernels",
                                                 unless=(False,)),
            f"{prefix}.ulysses_sequence_parallel_size": refuse(
                f"verl's engine copy of the role's setting; set {ours if role != 'ref' else 'ref'}"
                ".ulysses_sequence_parallel_size", unless=(1,)),
            f"{prefix}.entropy_from_logits_with_chunking": ignore(SPEED),
            f"{prefix}.entropy_checkpointing": ignore(SPEED),
            f"{prefix}.use_torch_compile": ignore(
                (f"verl's engine copy; {ours}.use_torch_compile decides, and " if ours == "actor" else "")
                + "compilation changes speed, not results"),
            f"{prefix}.forward_only": ignore("verl sets it per role; hybridflow knows which roles train"),
            f"{prefix}.strategy": _strategy(role),
            f"{prefix}.mixed_precision.buffer_dtype": refuse(
                "FSDP2's mixed precision has no buffer dtype: buffers (rotary frequencies) stay as the model loads "
                "them", unless=("fp32", "float32")),
        })
    # The actor's and critic's own model_dtype, and the actor's param_dtype and both reduce_dtypes, are
    # hybridflow keys (aliases.KEYS); the others are the reference's, or a critic compute dtype of its own.
    rules.update(_role_precision_rules())
    rules["actor_rollout_ref.ref.fsdp_config.dtype"] = ignore("the reference computes in model.dtype, as the actor")
    rules["critic.model.fsdp_config.dtype"] = ignore("the critic computes in model.dtype, as the actor")
    for key in ("optimizer_offload", "fsdp_size"):  # param_offload: aliases.IGNORED
        rules[f"actor_rollout_ref.ref.fsdp_config.{key}"] = ignore(
            "the reference is sharded and offloaded as the actor (actor.fsdp_config.*)")
    return rules


def _role_precision_rules() -> dict[str, Rule]:
    """verl's per-role precision keys that are not the actor's or the critic's own."""
    same_compute = ("every role computes in model.dtype, as the actor: set it with model.dtype (or "
                    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype)")
    return {
        "actor_rollout_ref.ref.fsdp_config.model_dtype": refuse(
            "the reference trains nothing, so it has no master weights: it loads in model.dtype on one rank and "
            "in float32 under model.dtype's mixed precision when sharded", unless=("fp32", "float32")),
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype": refuse(same_compute),
        "critic.model.fsdp_config.mixed_precision.param_dtype": refuse(same_compute),
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype": ignore(
            "the reference computes no gradients, so it reduces none"),
    }


def _optim_rules(role: str, prefix: str) -> dict[str, Rule]:
    """verl's optimizer keys of ``role`` that are not hybridflow keys of the same name."""
    megatron = "hybridflow trains with FSDP2 and torch's AdamW, not Megatron's optimizer: the schedule is " \
               f"{role}.optim.lr_scheduler_type, lr_warmup_steps, lr_warmup_steps_ratio and min_lr_ratio"
    rules = {
        f"{prefix}.optimizer": refuse("hybridflow's optimizer is torch's AdamW", unless=_adamw),
        f"{prefix}.optimizer_impl": refuse("hybridflow's optimizer is torch's AdamW", unless=("torch.optim",)),
        f"{prefix}.total_training_steps": ignore("verl fills it in; hybridflow sizes the schedule from the run's "
                                                 "steps"),
        f"{prefix}.num_cycles": refuse("hybridflow's cosine schedule is one half cycle", unless=(0.5,)),
        f"{prefix}.override_optimizer_config": refuse("hybridflow's AdamW takes lr, betas and weight_decay only",
                                                      unless=_empty),
        f"{prefix}.override_optimizer_config.*": refuse(megatron),
    }
    for key in ("lr_warmup_init", "lr_decay_steps", "lr_decay_style", "min_lr", "weight_decay_incr_style",
                "lr_wsd_decay_style", "lr_wsd_decay_steps", "use_checkpoint_opt_param_scheduler"):
        rules[f"{prefix}.{key}"] = refuse(megatron)
    return rules


def _model_rules(prefix: str, role: str) -> dict[str, Rule]:
    """Model-loading keys verl has for the policy (``actor_rollout_ref.model``) and the critic."""
    lora_owner = "actor.lora.*" if role == "actor" else "the actor's (actor.lora.*); the critic trains every weight"
    rules = {
        f"{prefix}.external_lib": refuse("hybridflow imports no extra module; model.trust_remote_code loads code "
                                         "shipped with the model", unless=(None,)),
        f"{prefix}.override_config.model_config": refuse(
            MODEL_CONFIG_ENTRIES if role == "actor" else OVERRIDE_CONFIG, unless=_empty),
        f"{prefix}.override_config.moe_config.freeze_moe_router": refuse(
            "hybridflow trains the MoE router with the other weights", unless=(False,)),
        f"{prefix}.enable_activation_offload": ignore(SPEED),
        f"{prefix}.use_shm": ignore("loading through shared memory; " + SPEED),
        f"{prefix}.tiled_mlp.*": ignore(SPEED),
    }
    if role == "actor":
        # The policy's overrides are model.override_config (aliases.PREFIXES): every role's model is built
        # from the overridden config; .model_config.<key> is the same key (verl's HFModelConfig unwraps it).
        rules[f"{prefix}.override_config.moe_config.*"] = refuse(POLICY_OVERRIDE_CONFIG)
    else:
        rules.update({
            f"{prefix}.override_config": refuse(OVERRIDE_CONFIG, unless=_empty),
            f"{prefix}.override_config.*": refuse(OVERRIDE_CONFIG),
        })
    if role == "critic":
        rules.update({
            f"{prefix}.enable_gradient_checkpointing": ignore(
                "the critic recomputes activations when model.enable_gradient_checkpointing is on; " + SPEED),
            f"{prefix}.tokenizer_path": ignore("the critic reads the policy's token ids; it needs no tokenizer"),
            f"{prefix}.trust_remote_code": forward("model.trust_remote_code covers the critic", unless=(False,),
                                                   to="model.trust_remote_code"),
            f"{prefix}.lora_rank": refuse(f"LoRA is {lora_owner}", unless=(0,)),
            f"{prefix}.lora_alpha": ignore("only read with critic.model.lora_rank > 0, which hybridflow refuses"),
            f"{prefix}.target_modules": ignore("only read with critic.model.lora_rank > 0, which hybridflow refuses"),
        })
    return rules


# ----------------------------------------------------------------------------------------------
# The table


def _rules() -> dict[str, Rule]:
    ar = "actor_rollout_ref"
    rules: dict[str, Rule] = {
        # Hydra and profiler machinery, whole subtrees.
        "*._target_": refuse("names a Python class verl builds the section with; hybridflow's sections are its typed "
                             "schema (hybridflow/config/schema.py), with no class to swap", unless=_verl_class),
        "*.profiler.*": PROFILER,
        "global_profiler.*": PROFILER,
        "*.router_replay.mode": refuse(ROUTER_REPLAY, unless=("disabled",)),
        "*.router_replay.*": refuse(ROUTER_REPLAY, unless=(None,)),
        "*.checkpoint.save_contents": ignore(CHECKPOINT_CONTENTS + "; what a checkpoint holds changes no result"),
        "*.checkpoint.load_contents": refuse(CHECKPOINT_CONTENTS, unless=_all_contents),
        "*.checkpoint.async_save": ignore("hybridflow saves synchronously; " + SPEED),
        "*.nccl_timeout": ignore("hybridflow's collectives use torch's default timeout; trainer.watchdog_timeout_s "
                                 "bounds a phase"),
        "*.data_loader_seed": ignore("hybridflow seeds the mini-batch shuffle from trainer.seed"),
        "*.rollout_n": ignore("verl's copy of rollout.n; hybridflow reads rollout.n"),
        "*.load_weight": refuse("hybridflow always loads the model's weights", unless=(True,)),
        # Megatron: every key under a role's megatron section, and the Megatron-only knobs beside it.
        f"{ar}.actor.megatron.*": refuse(megatron_line("actor")),
        f"{ar}.ref.megatron.*": refuse(megatron_line("ref")),
        "critic.megatron.*": refuse(megatron_line("critic")),
        "critic.model.lora.*": refuse("hybridflow trains with FSDP2, not Megatron, and the critic trains every weight "
                                      "(LoRA is the actor's: actor.lora.*)"),
        "reward_model.megatron.*": refuse(megatron_line("reward_model")),
        f"{ar}.model.lora.*": refuse("hybridflow trains with FSDP2, not Megatron: its LoRA is actor.lora.* (PEFT: "
                                     "rank, alpha, target_modules, dropout)"),
        f"{ar}.rollout.layer_name_map.*": refuse(megatron_line("rollout")),
        f"{ar}.actor.strategy": _strategy("actor"),
        f"{ar}.ref.strategy": _strategy("ref"),
        "critic.strategy": _strategy("critic"),
        "reward_model.strategy": _strategy("reward_model"),
        # actor
        f"{ar}.actor.calculate_entropy": ignore("the entropy is a metric here (actor/entropy), computed with "
                                                "actor.entropy_coeff or not"),
        f"{ar}.actor.calculate_sum_pi_squared": ignore(
            "computed whenever algorithm.adv_estimator needs it (optimal_token_baseline, tir_optimal_token_baseline)"),
        f"{ar}.actor.sum_pi_squared_checkpointing": ignore(SPEED),
        f"{ar}.actor.entropy_from_logits_with_chunking": ignore(SPEED),
        f"{ar}.actor.entropy_checkpointing": ignore(SPEED),
        f"{ar}.actor.use_fused_kernels": ignore(SPEED),
        f"{ar}.actor.use_prefix_grouper": ignore("shares a group's prompt forward; " + SPEED),
        # reference
        f"{ar}.ref.log_prob_use_dynamic_bsz": ignore(
            "the reference forms micro-batches as actor.use_dynamic_bsz says; micro-batching changes no result"),
        f"{ar}.ref.use_torch_compile": ignore("the reference follows actor.use_torch_compile; " + SPEED),
        f"{ar}.ref.entropy_from_logits_with_chunking": ignore(SPEED),
        f"{ar}.ref.entropy_checkpointing": ignore(SPEED),
        # policy model
        f"{ar}.model.hf_config_path": refuse("hybridflow reads the model's config from model.path", unless=(None,)),
        f"{ar}.model.tokenizer_path": refuse("hybridflow reads the tokenizer from model.path", unless=(None,)),
        f"{ar}.model.use_liger": ignore("Liger's fused kernels; " + SPEED),
        f"{ar}.model.use_fused_kernels": ignore(SPEED),
        f"{ar}.model.fused_kernel_options.impl_backend": ignore(SPEED),
        f"{ar}.model.mtp.enable": refuse("hybridflow has no multi-token prediction", unless=(False,)),
        f"{ar}.model.mtp.enable_train": refuse("hybridflow has no multi-token prediction", unless=(False,)),
        f"{ar}.model.mtp.enable_rollout": refuse("hybridflow has no multi-token prediction", unless=(False,)),
        f"{ar}.model.mtp.*": ignore("only read with model.mtp.enable, which hybridflow refuses"),
        f"{ar}.model.torch_dtype": refuse("not a key of verl's model config; hybridflow's training compute dtype is "
                                          "model.dtype (float32 | bfloat16)"),
        # rollout
        f"{ar}.rollout.cudagraph_capture_sizes": ignore(
            "the native engine captures CUDA graphs per batch bucket itself (rollout.enforce_eager=true: none); "
            + SPEED),
        f"{ar}.rollout.data_parallel_size": refuse(
            "hybridflow's rollout replicas are data parallel by themselves: trainer ranks / "
            "rollout.tensor_model_parallel_size", unless=(1,)),
        f"{ar}.rollout.expert_parallel_size": refuse("expert-parallel generation is not supported; "
                                                     "rollout.tensor_model_parallel_size splits a replica",
                                                     unless=(1,)),
        f"{ar}.rollout.pipeline_model_parallel_size": refuse(
            "pipeline-parallel generation is not supported; rollout.tensor_model_parallel_size splits a replica",
            unless=(1,)),
        f"{ar}.rollout.max_model_len": ignore("the engine's context is data.max_prompt_length + "
                                              "data.max_response_length"),
        f"{ar}.rollout.logprobs_mode": refuse(
            "hybridflow's rollout logprobs are log_softmax(logits / temperature), as the trainer computes them",
            unless=("processed_logprobs",)),
        f"{ar}.rollout.scheduling_policy": ignore("the order requests are served in; " + SPEED),
        f"{ar}.rollout.load_format": ignore("the rollout gets the actor's weights before its first generation "
                                            "whatever format it starts from"),
        f"{ar}.rollout.disable_log_stats": ignore("the engine's own statistics log; hybridflow logs rollout/* metrics"),
        f"{ar}.rollout.do_sample": refuse("training samples are drawn with rollout.temperature (0: greedy)",
                                          unless=(True,)),
        # verl declares it ("abort the rest once (1 - rate) of the requests completed") but no verl code reads
        # it: every request completes there, as here.
        f"{ar}.rollout.over_sample_rate": ignore(
            "declared by verl but read by none of its code (every request completes, as here); to train on the "
            "groups that finish first, trainer.mode=fully_async with async_training.consume_order=completion"),
        # Keys of verl's SGLang server-mode YAML (examples/sglang_multiturn/config/*_server.yaml) that no verl code
        # reads any more.
        f"{ar}.rollout.sglang_rollout_mode": ignore(
            "read by no verl code (its SGLang rollout picks its own mode); hybridflow's HTTP generation is "
            "rollout.mode=server"),
        f"{ar}.rollout.server.*": ignore("verl's SGLang server client settings (timeouts, retries, connections), "
                                         "read by none of its rollout code; " + SPEED),
        f"{ar}.rollout.multi_stage_wake_up": ignore(SPEED),
        f"{ar}.rollout.engine_kwargs.vllm": refuse("hybridflow passes vLLM no extra engine arguments", unless=_empty),
        f"{ar}.rollout.engine_kwargs.sglang": refuse("hybridflow passes SGLang no extra engine arguments",
                                                     unless=_empty),
        # Read only by a TensorRT-LLM rollout, which rollout.name (native | hf_vision | vllm | sglang) refuses.
        f"{ar}.rollout.engine_kwargs.trtllm": ignore("only read with rollout.name=trtllm, which hybridflow does not "
                                                     "have"),
        f"{ar}.rollout.engine_kwargs.trtllm.*": ignore("only read with rollout.name=trtllm, which hybridflow does not "
                                                       "have"),
        # Engine arguments verl's examples set, each a speed setting of the engine.
        f"{ar}.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache": ignore(SPEED),
        f"{ar}.rollout.engine_kwargs.vllm.compilation_config.*": ignore(SPEED),
        f"{ar}.rollout.engine_kwargs.sglang.attention_backend": ignore(SPEED),
        f"{ar}.rollout.engine_kwargs.*": refuse("hybridflow passes the engine no extra arguments"),
        f"{ar}.rollout.calculate_log_probs": ignore("hybridflow's rollout always returns its logprobs"),
        f"{ar}.rollout.agent.num_workers": ignore("agent-loop worker processes; " + SPEED),
        f"{ar}.rollout.agent.default_agent_loop": refuse(
            "set rollout.multi_turn.enable=true and rollout.multi_turn.default_agent_loop (tool_agent | single_turn | "
            "openai)", unless=("single_turn_agent",)),
        f"{ar}.rollout.agent.agent_loop_config_path": refuse(
            "agent loops are named in rollout.multi_turn.default_agent_loop (package.module:Class)", unless=(None,)),
        f"{ar}.rollout.agent.custom_async_server.*": refuse(
            "hybridflow's rollout servers are its own (rollout.mode=server)", unless=(None,)),
        f"{ar}.rollout.checkpoint_engine.*": ignore("how weights travel to the rollout; rollout.weight_sync picks "
                                                    "hybridflow's"),
        f"{ar}.rollout.trace.*": ignore("rollout tracing (weave, mlflow); trainer.rollout_data_dir dumps the samples"),
        f"{ar}.rollout.skip_rollout": refuse("hybridflow always generates; trainer.rollout_data_dir dumps the "
                                             "samples", unless=(False,)),
        f"{ar}.rollout.skip_dump_dir": ignore("only read with rollout.skip_rollout, which hybridflow refuses"),
        f"{ar}.rollout.skip_tokenizer_init": ignore("the engine's tokenizer start-up; " + SPEED),
        f"{ar}.rollout.enable_rollout_routing_replay": refuse(ROUTER_REPLAY, unless=(False,)),
        f"{ar}.rollout.prometheus.*": ignore("engine metrics export; hybridflow logs rollout/* metrics"),
        f"{ar}.rollout.quantization": refuse("the rollout generates with the trained weights in rollout.dtype; no "
                                             "quantised rollout", unless=(None,)),
        f"{ar}.rollout.quantization_config_file": refuse(
            "the rollout generates with the trained weights in rollout.dtype; no quantised rollout", unless=(None,)),
        f"{ar}.rollout.mtp": refuse("hybridflow has no multi-token prediction", unless=_mtp_off),
        f"{ar}.rollout.layered_summon": ignore(SPEED),
        f"{ar}.rollout.ignore_eos": refuse("a response ends at its end-of-sequence token", unless=(False,)),
        f"{ar}.rollout.multi_turn.num_repeat_rollouts": refuse("each sample is one episode; rollout.n sets how many",
                                                               unless=(None,)),
        f"{ar}.rollout.multi_turn.tokenization_sanity_check_mode": ignore(
            "a check of verl's incremental tokenization; hybridflow's episodes are token ids throughout"),
        f"{ar}.rollout.multi_turn.tool_response_truncate_side": refuse(
            "hybridflow keeps the start of a long tool reply (verl's left), cut at "
            "rollout.multi_turn.max_tool_response_length", unless=("left",)),
        f"{ar}.rollout.multi_turn.use_inference_chat_template": refuse(
            "hybridflow trains on the tokens the model generated, with the training chat template", unless=(False,)),
        # data
        "data.tokenizer": refuse("the tokenizer is model.path's", unless=(None,)),
        "data.use_shm": ignore("loading through shared memory; " + SPEED),
        "data.train_max_samples": refuse("hybridflow reads every row of data.train_files (write a smaller file)",
                                         unless=(-1,)),
        "data.val_max_samples": refuse("hybridflow reads every row of data.val_files (write a smaller file)",
                                       unless=(-1,)),
        "data.reward_fn_key": refuse("the scorer is picked by each row's data_source column", unless=("data_source",)),
        "data.return_raw_input_ids": ignore("hybridflow's reward model re-renders the chat with its own tokenizer"),
        "data.return_full_prompt": ignore("an extra field of verl's batch for custom reward managers; hybridflow's "
                                          "reward functions get (data_source, solution_str, ground_truth, extra_info)"),
        "data.dataloader_num_workers": ignore("data-loading processes; " + SPEED),
        "data.image_patch_size": refuse("images are processed by the model's own processor", unless=(14,)),
        "data.validation_shuffle": ignore("validation metrics do not depend on the order of its prompts"),
        "data.filter_overlong_prompts_workers": ignore("filtering processes; " + SPEED),
        "data.video_key": refuse("hybridflow reads no video column", unless=("videos",)),
        "data.trust_remote_code": forward("model.trust_remote_code covers the tokenizer and processor",
                                          unless=(False,), to="model.trust_remote_code"),
        "data.custom_cls.*": refuse(
            "hybridflow has no dataset class to plug in: write the rows your class would make (prompt, data_source, "
            "reward_model.ground_truth, extra_info) to a parquet or JSONL file and give it as data.train_files",
            unless=(None,)),
        "data.datagen.*": refuse("hybridflow trains on data.train_files; no dynamic data generation", unless=(None,)),
        "data.return_multi_modal_inputs": ignore("images reach the model through its processor either way"),
        # critic
        "critic.enable": refuse("hybridflow builds a critic exactly when algorithm.adv_estimator=gae",
                                unless=(None,)),
        # algorithm
        "algorithm.use_pf_ppo": refuse("hybridflow has no PF-PPO sample reweighting", unless=(False,)),
        "algorithm.pf_ppo.*": ignore("only read with algorithm.use_pf_ppo, which hybridflow refuses"),
        # reward
        "reward_model.enable_resource_pool": ignore("the reward model runs in its own worker group; placement "
                                                    "changes no result"),
        "reward_model.n_gpus_per_node": ignore("where verl places the reward model's workers; placement "
                                               "changes no result"),
        "reward_model.nnodes": ignore("where verl places the reward model's workers; placement changes no result"),
        "reward_model.model.input_tokenizer": ignore("hybridflow re-renders the chat for the reward model with its "
                                                     "own tokenizer whenever they differ"),
        "reward_model.model.external_lib": refuse("hybridflow imports no extra module; reward_model.model."
                                                  "trust_remote_code loads code shipped with the model",
                                                  unless=(None,)),
        "reward_model.model.override_config": refuse(OVERRIDE_CONFIG, unless=_empty),
        "reward_model.model.use_shm": ignore(SPEED),
        "reward_model.model.use_remove_padding": ignore(SPEED),
        "reward_model.model.use_fused_kernels": ignore(SPEED),
        "reward_model.model.fsdp_config.*": ignore("the reward model is sharded by hybridflow's FSDP2; " + SPEED),
        "reward_model.use_dynamic_bsz": ignore("micro-batching of the reward model's forward; " + SPEED),
        "reward_model.forward_max_token_len_per_gpu": ignore("micro-batching of the reward model's forward; " + SPEED),
        "reward_model.ulysses_sequence_parallel_size": ignore(SPEED),
        "reward_model.use_reward_loop": ignore("verl's choice of reward implementation; hybridflow has one"),
        "reward_model.launch_reward_fn_async": ignore("hybridflow scores in reward.num_workers processes; " + SPEED),
        "reward_model.reward_loop_source": refuse(
            "a custom reward is reward.custom_reward_function.path/name or reward.reward_manager",
            unless=("register",)),
        "reward_model.reward_loop_module_path": refuse(
            "a custom reward is reward.custom_reward_function.path/name or reward.reward_manager", unless=(None,)),
        "reward_model.reward_loop_class_name": refuse(
            "a custom reward is reward.custom_reward_function.path/name or reward.reward_manager", unless=(None,)),
        # verl's reward loop serves the reward model (a sequence classifier, reward_model.model.path) with an
        # inference engine; hybridflow runs the same model's forward in a worker group: the same scores.
        "reward_model.rollout.*": ignore("verl serves reward_model.model.path with an inference engine; hybridflow "
                                         "runs that model's forward in its own worker group, with the same scores"),
        "reward_model.reward_kwargs.overlong_buffer_cfg.log": ignore(
            "hybridflow always logs the overlong penalty's metrics"),
        "reward_manager.source": refuse("a custom reward manager is reward.custom_reward_function or "
                                        "reward.reward_manager", unless=("register",)),
        "reward_manager.module.*": ignore("only read with reward_manager.source=importlib, which hybridflow refuses"),
        # trainer and the rest
        "trainer.esi_redundant_time": ignore("an Ascend ESI instance's save margin; hybridflow saves by "
                                             "trainer.save_freq"),
        "trainer.val_only": refuse("hybridflow has no validation-only run; trainer.val_before_train=true validates "
                                   "before the first step", unless=(False,)),
        "trainer.default_hdfs_dir": refuse("trainer.checkpoint_dir takes an s3:// or gs:// URL", unless=(None,)),
        "trainer.del_local_ckpt_after_load": ignore("disk space only; trainer.max_ckpt_to_keep keeps the newest"),
        "trainer.max_critic_ckpt_to_keep": ignore("the critic is saved in the actor's checkpoints "
                                                  "(trainer.max_ckpt_to_keep)"),
        "trainer.ray_wait_register_center_timeout": ignore("a Ray start-up wait of verl's; " + SPEED),
        "trainer.use_legacy_worker_impl": ignore("verl's choice between its worker implementations; hybridflow "
                                                 "has one"),
        "ray_kwargs.ray_init.num_cpus": ignore("hybridflow's Ray cluster gets every CPU (trainer.ray_address joins "
                                               "a running one)"),
        "ray_kwargs.timeline_json_file": ignore("hybridflow writes <run>/timeline.json (trainer.timeline)"),
        "transfer_queue.enable": ignore("verl's data plane; trainer.data_plane=refs is hybridflow's, same results"),
    }
    rules.update(_fsdp_rules())
    rules.update(_optim_rules("actor", f"{ar}.actor.optim"))
    rules.update(_optim_rules("critic", "critic.optim"))
    rules.update(_model_rules(f"{ar}.model", "actor"))
    rules.update(_model_rules("critic.model", "critic"))
    return rules


_MICRO_NULL = ("verl's null leaves the micro-batch to be derived; hybridflow keeps its own (micro-batching changes no "
               "result)")

NULL_IS_UNSET: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": _MICRO_NULL,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": _MICRO_NULL,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": _MICRO_NULL,
    "critic.ppo_micro_batch_size_per_gpu": _MICRO_NULL,
    "critic.forward_micro_batch_size_per_gpu": _MICRO_NULL,
    "reward_model.micro_batch_size_per_gpu": _MICRO_NULL,
    "data.val_batch_size": "verl's null validates in one batch; hybridflow generates data.val_batch_size prompts per "
                           "call, with the same results",
    "actor_rollout_ref.actor.optim.warmup_style": "verl's null defers to optim.lr_scheduler_type",
    "critic.optim.warmup_style": "verl's null defers to optim.lr_scheduler_type",
    "data.tool_config_path": "verl's null defers to rollout.multi_turn.tool_config_path",
    "algorithm.rollout_correction.rollout_rs_threshold": "verl's null leaves it unset (only read with rollout_rs)",
    "global_profiler.steps": "verl's null profiles no step, as trainer.profile.steps=[]",
}
"""verl keys honoured here whose verl value ``null`` means "not set": null keeps hybridflow's value
(with a note) instead of failing the type check of a key that takes no null."""



@dataclass(frozen=True)
class GlobalMicroBatch:
    """verl's deprecated global micro-batch of a role: samples per forward summed over its
    data-parallel ranks. verl's workers divide it by (world size // the role's Ulysses size) and use
    the quotient as the per-rank ``*_per_gpu`` value (fsdp_workers.py, "normalize config"); it is
    never divided by rollout.n."""

    per_gpu: str
    """The hybridflow key that counts the same samples per data-parallel rank."""
    sequence_parallel: tuple[str, ...] = ()
    """hybridflow keys of the role's Ulysses size, the first one set wins (the reference's None is
    the actor's); empty: the role has no sequence parallelism (verl's reward model)."""


GLOBAL_MICRO_BATCH: dict[str, GlobalMicroBatch] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": GlobalMicroBatch(
        "actor.ppo_micro_batch_size_per_gpu", ("actor.ulysses_sequence_parallel_size",)),
    # verl's old-logprob forward is the actor's (hybridflow keeps its micro-batch there too).
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": GlobalMicroBatch(
        "actor.log_prob_micro_batch_size_per_gpu", ("actor.ulysses_sequence_parallel_size",)),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": GlobalMicroBatch(
        "ref.log_prob_micro_batch_size_per_gpu",
        ("ref.ulysses_sequence_parallel_size", "actor.ulysses_sequence_parallel_size")),
    "critic.ppo_micro_batch_size": GlobalMicroBatch(
        "critic.ppo_micro_batch_size_per_gpu", ("critic.ulysses_sequence_parallel_size",)),
    "critic.forward_micro_batch_size": GlobalMicroBatch(
        "critic.forward_micro_batch_size_per_gpu", ("critic.ulysses_sequence_parallel_size",)),
    "reward_model.micro_batch_size": GlobalMicroBatch("reward_model.micro_batch_size_per_gpu"),
}
"""verl key -> its per-rank hybridflow key. The division needs the run's rank count, so the loader
collects these values and converts them once every layer is applied (``per_rank_micro_batch``);
verl's null (its default) leaves the per-rank key as it is."""

GLOBAL_MICRO_NOTE = ("verl's deprecated global micro-batch: {per_gpu} = it / (trainer.n_gpus_per_node x "
                     "trainer.nnodes / {sp}), as verl's workers divide it; refused when it does not divide")


def _global_micro_note(spec: GlobalMicroBatch) -> str:
    sp = spec.sequence_parallel[0] if spec.sequence_parallel else "1"
    return GLOBAL_MICRO_NOTE.format(per_gpu=spec.per_gpu, sp=sp)


def per_rank_micro_batch(cfg: Any, key: str, value: Any) -> int:
    """verl's global micro-batch ``key=value`` as the per-rank count of ``cfg`` (the whole config,
    so the rank count is final). ``ConfigError`` naming ``key`` when the value is not a positive
    integer, or does not divide evenly over the data-parallel ranks (verl would floor it, to 0 below
    one sample per rank, which verl itself refuses: a silent change of the global micro-batch)."""
    spec = GLOBAL_MICRO_BATCH[key]
    value = normalise(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"verl's {key} is a global micro-batch (samples summed over the ranks); expected a "
                          f"positive integer, got {_show(value)}", key=key)
    t = cfg.trainer
    ranks = t.n_gpus_per_node * t.nnodes
    sp_key = next((k for k in spec.sequence_parallel if key_value(cfg, k) is not None), None)
    sp = key_value(cfg, sp_key) if sp_key else 1
    groups = f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes}"
    if sp > 1:
        groups += f" / {sp_key}={sp}"
    if sp < 1 or ranks % sp:
        raise ConfigError(f"verl's {key}={value} is divided over the data-parallel ranks ({groups}), which is not a "
                          f"whole number; set {spec.per_gpu} (samples per rank) instead", key=key)
    dp = ranks // sp
    if value % dp:
        raise ConfigError(f"verl's {key}={value} is a global micro-batch, divided over the {dp} data-parallel ranks "
                          f"({groups}); {value} does not divide by {dp} (verl would floor it to {value // dp}): "
                          f"give a multiple of {dp}, or set {spec.per_gpu} (samples per rank) instead", key=key)
    return value // dp

RULES: dict[str, Rule] = _rules()
"""verl key (exact, or a glob over a subtree) -> how hybridflow treats it."""

_EXACT = {k: r for k, r in RULES.items() if "*" not in k}
_GLOBS = sorted(((k, r) for k, r in RULES.items() if "*" in k), key=lambda kr: -len(kr[0]))


def rule_for(key: str) -> tuple[str, Rule] | None:
    """The (pattern, rule) for a verl key: an exact entry first, else the longest matching glob."""
    if key in _EXACT:
        return key, _EXACT[key]
    for pattern, rule in _GLOBS:
        if fnmatch.fnmatchcase(key, pattern):
            return pattern, rule
    return None
