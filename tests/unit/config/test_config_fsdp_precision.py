"""verl's FSDP precision and offload keys as hybridflow reads and checks them: mixed_precision's
param_dtype is the compute dtype (model.dtype), reduce_dtype and model_dtype are fsdp_config keys,
buffer_dtype and the other roles' compute dtypes are refused in one line, and param_offload on one
GPU rank is accepted (the workers shard over a one-rank group) while a CPU run refuses it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.budget import ModelShape
from hybridflow.config.errors import ConfigError
from hybridflow.config.loader import load_config
from hybridflow.config.plan import plan_memory
from hybridflow.config.validate import validate_config
from hybridflow.controller.preflight import machine_problems

ACTOR = "actor_rollout_ref.actor.fsdp_config"


def test_verl_mixed_precision_keys_reach_their_hybridflow_keys_in_either_spelling():
    cfg = load_config(overrides=[f"+{ACTOR}.mixed_precision.param_dtype=bf16",
                                 f"+{ACTOR}.mixed_precision.reduce_dtype=bf16",
                                 f"+{ACTOR}.mixed_precision.buffer_dtype=fp32",
                                 "+critic.model.fsdp_config.mixed_precision.reduce_dtype=bfloat16",
                                 "+actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype=bf16"])
    assert cfg.model.dtype == "bfloat16"
    assert cfg.actor.fsdp_config.reduce_dtype == cfg.critic.fsdp_config.reduce_dtype == "bfloat16"
    assert load_config(overrides=[f"+{ACTOR}.mixed_precision.param_dtype=fp32"]).model.dtype == "float32"


def test_verl_model_dtype_is_the_trained_roles_stored_dtype():
    cfg = load_config(overrides=[f"{ACTOR}.model_dtype=bfloat16", "critic.model.fsdp_config.model_dtype=bf16",
                                 f"{ACTOR}.dtype=bfloat16"])
    assert cfg.actor.fsdp_config.model_dtype == cfg.critic.fsdp_config.model_dtype == "bfloat16"
    assert load_config(overrides=[f"{ACTOR}.model_dtype=fp32"]).actor.fsdp_config.model_dtype == "float32"
    # The reference has no master weights: only verl's default is accepted there.
    load_config(overrides=["actor_rollout_ref.ref.fsdp_config.model_dtype=fp32"])
    with pytest.raises(ConfigError, match="the reference trains nothing"):
        load_config(overrides=["actor_rollout_ref.ref.fsdp_config.model_dtype=bf16"])


@pytest.mark.parametrize(("override", "message"), [
    (f"+{ACTOR}.mixed_precision.buffer_dtype=bf16", "no buffer dtype"),
    ("+critic.model.fsdp_config.mixed_precision.param_dtype=bf16", "every role computes in model.dtype"),
    ("+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16", "every role computes in model.dtype"),
    (f"{ACTOR}.model_dtype=fp16", "allowed values: float32, bfloat16"),
])
def test_what_cannot_be_honoured_is_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def _errors(*overrides: str) -> str:
    try:
        validate_config(load_config(overrides=list(overrides)))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_param_offload_on_one_gpu_rank_is_accepted_and_refused_on_a_cpu():
    assert _errors("trainer.device=cuda", "actor.fsdp_config.param_offload=true",
                   "critic.fsdp_config.param_offload=true") == ""
    for role in ("actor", "critic"):
        assert f"{role}.fsdp_config.param_offload=true moves parameters from the GPU" in _errors(
            "trainer.device=cpu", f"{role}.fsdp_config.param_offload=true")


def test_pure_bf16_needs_bf16_compute_and_no_lora():
    # The actor's pure bf16 makes an unset model.dtype bf16 (verl's run_gptoss_20b.sh sets only model_dtype).
    assert load_config(overrides=[f"+{ACTOR}.model_dtype=bfloat16"]).model.dtype == "bfloat16"
    assert "set model.dtype=bfloat16 too" in _errors("actor.fsdp_config.model_dtype=bfloat16", "model.dtype=float32")
    assert "critic.fsdp_config.model_dtype=bfloat16" in _errors("critic.fsdp_config.model_dtype=bfloat16")
    assert _errors("actor.fsdp_config.model_dtype=bfloat16", "model.dtype=bfloat16") == ""
    assert "actor.lora.base_dtype=bfloat16 instead" in _errors(
        "actor.fsdp_config.model_dtype=bfloat16", "model.dtype=bfloat16", "actor.lora.rank=8")


def test_bf16_reduction_is_a_noted_no_op_on_one_unsharded_rank():
    warnings = validate_config(load_config(overrides=["actor.fsdp_config.reduce_dtype=bfloat16"]))
    assert any("actor.fsdp_config.reduce_dtype=bfloat16 has no effect" in w for w in warnings)
    sharded = load_config(overrides=["actor.fsdp_config.reduce_dtype=bfloat16", "trainer.device=cuda",
                                     "actor.fsdp_config.param_offload=true"])
    assert not any("reduce_dtype" in w for w in validate_config(sharded))


SHAPE = ModelShape(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)


def _resident(*overrides: str):
    plan = plan_memory(load_config(overrides=["trainer.device=cuda", *overrides]), SHAPE)
    update = next(p for p in plan.phases if p.role == "actor" and p.phase == "update")
    return update.params, update.grads


def test_the_memory_plan_counts_one_rank_offload_and_pure_bf16():
    params, _ = _resident()
    # Offloaded on one GPU: only FSDP2's gathered working set (two layers and the root) is on the device.
    offloaded, grads = _resident("actor.fsdp_config.param_offload=true")
    assert 0 < offloaded < params / 2 and grads == 0
    mixed, _ = _resident("model.dtype=bfloat16")
    assert mixed == params  # fp32 master weights under bf16 compute
    assert _resident("model.dtype=bfloat16", "actor.fsdp_config.model_dtype=bfloat16")[0] == params // 2


def test_the_memory_plan_offloads_the_reference_with_the_actor():
    def reference_params(*overrides: str) -> int:
        plan = plan_memory(load_config(overrides=["trainer.device=cuda", "actor.use_kl_loss=true", *overrides]), SHAPE)
        return next(p for p in plan.phases if p.role == "reference").params

    resident = reference_params()
    assert 0 < reference_params("actor.fsdp_config.param_offload=true") < resident / 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_param_offload_with_device_auto_is_a_machine_problem_without_a_gpu():
    """trainer.device=auto is the CPU here, where there is nothing to offload: config explain lists it as
    what this machine lacks (the same line is right on a GPU machine), instead of the actor failing later."""
    problems = [str(p) for p in machine_problems(load_config(overrides=["actor.fsdp_config.param_offload=true"]))]
    assert any("actor.fsdp_config.param_offload=true moves parameters" in p and "no GPU" in p for p in problems)
    assert not any("param_offload" in str(p) for p in machine_problems(load_config()))
