"""How a training role (actor, critic, reference, SFT, reward model) sets up its engine: the
process group it must sit in, the dtypes its weights load and compute in, whether FSDP2 shards
its model, its optimizer and schedule, and a LoRA actor's adapter spec. Shared by every worker
that builds a ``TrainEngine``; the micro-batch plan is ``hybridflow.training.micro_batches``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridflow.config.schema import FSDPConfig, LoraConfig, OptimConfig
from hybridflow.models.loading import enable_activation_checkpointing
from hybridflow.models.lora import LoraSpec
from hybridflow.training import distributed
from hybridflow.training.engine import TrainEngine
from hybridflow.training.micro_batches import MicroBatchPlan, plan_micro_batches
from hybridflow.training.optimizer import OptimSpec
from hybridflow.utils.device import parse_dtype


def check_rank_group(role: str, rank: int, world_size: int) -> None:
    """A rank of a multi-rank role must sit in a process group of exactly that many ranks."""
    if world_size > 1 and distributed.world_size() != world_size:
        raise RuntimeError(
            f"{role} rank {rank} of {world_size}: no torch.distributed process group of {world_size} ranks is "
            f"initialised (found {distributed.world_size()}); several ranks need trainer.backend=ray"
        )


def model_precision(
    dtype: str, *, trainable: bool, data_parallel: bool, master_dtype: str = "float32"
) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype the weights load in, mixed-precision compute dtype or None).

    A trained model in bf16 is mixed precision: fp32 master weights, optimizer and gradient
    reduction, bf16 compute (FSDP2's policy when sharded, autocast on one rank), because Adam
    updates of ~1e-6 relative vanish in bf16's 8-bit mantissa. A frozen model (the reference)
    on one rank simply loads in bf16: half the memory, the same bf16 compute.

    ``master_dtype`` (``fsdp_config.model_dtype``) bf16 is verl's pure bf16 training, chosen
    knowing that rounding: the trained weights load in bf16 and compute in it, with no fp32
    copy and no autocast (the optimizer's state takes the weights' dtype)."""
    weights = parse_dtype(dtype)
    if trainable and parse_dtype(master_dtype) != torch.float32:
        return parse_dtype(master_dtype), None
    if weights != torch.float32 and (trainable or data_parallel):
        return torch.float32, weights
    return weights, None


def shards_model(world_size: int, param_offload: bool, device: torch.device, key: str) -> bool:
    """Whether a role's engine shards its model with FSDP2: with several ranks, and with
    ``param_offload`` (the config ``key`` that sets it) on one GPU rank, because FSDP2 offloads
    sharded parameters only (its CPUOffloadPolicy), so one rank shards over a process group of
    itself, as verl does. Joins that one-rank group when this process has no group yet (a
    one-rank role starts without one)."""
    if world_size > 1:
        return True
    if not param_offload:
        return False
    if device.type != "cuda":
        raise ValueError(f"{key}=true moves parameters from the GPU to the CPU, but this role computes on "
                         f"{device.type}")
    distributed.join_one_rank_group(device)
    return True


def warmup_steps(o: OptimConfig, total_steps: int) -> int:
    """``lr_warmup_steps``, or, when it is -1 or null, ``lr_warmup_steps_ratio`` x ``total_steps`` (verl's rule,
    rounded down as verl does)."""
    if o.lr_warmup_steps is not None and o.lr_warmup_steps >= 0:
        return o.lr_warmup_steps
    return int(o.lr_warmup_steps_ratio * total_steps)


def optim_spec(o: OptimConfig, *, total_steps: int, grad_clip: float) -> OptimSpec:
    """An ``actor.optim`` / ``critic.optim`` section as the engine's optimizer and schedule (``total_steps``: the
    run's optimizer steps, which the schedule counts)."""
    return OptimSpec(
        lr=o.lr, weight_decay=o.weight_decay, betas=(o.betas[0], o.betas[1]),
        warmup_steps=warmup_steps(o, total_steps),
        scheduler=o.lr_scheduler_type, min_lr_ratio=o.min_lr_ratio, total_steps=total_steps, grad_clip=grad_clip,
    )


def lora_spec(cfg: LoraConfig) -> LoraSpec:
    """``actor.lora`` (rank > 0) as the spec ``apply_lora`` takes."""
    return LoraSpec(rank=cfg.rank, alpha=cfg.alpha, target_modules=tuple(cfg.target_modules), dropout=cfg.dropout,
                    exclude_modules=cfg.exclude_modules)


def trained_engine(
    model: torch.nn.Module, optim: OptimConfig, fsdp: FSDPConfig, *, total_steps: int, grad_clip: float,
    device: torch.device, data_parallel: bool, mixed_precision: torch.dtype | None, sequence_parallel_size: int,
    metrics_prefix: str, checkpoint_trainable_only: bool = False, compile_layers: bool = False,
) -> TrainEngine:
    """The engine of a trained RL role (actor, critic) from its ``optim`` and ``fsdp_config``
    sections: the optimizer and schedule, FSDP2's reduce dtype, shard group and offloads."""
    return TrainEngine(
        model,
        optim_spec(optim, total_steps=total_steps, grad_clip=grad_clip),
        device,
        data_parallel=data_parallel,
        mixed_precision=mixed_precision,
        reduce_dtype=parse_dtype(fsdp.reduce_dtype),
        fsdp_size=fsdp.fsdp_size,
        offload_params=fsdp.param_offload,
        offload_optimizer=fsdp.optimizer_offload,
        metrics_prefix=metrics_prefix,
        sequence_parallel_size=sequence_parallel_size,
        checkpoint_trainable_only=checkpoint_trainable_only,
        compile_layers=compile_layers,
    )


class TrainedRoleConfig(Protocol):
    """What ``load_trained_role`` reads of a trained role's section (``critic``, ``prime``)."""

    optim: OptimConfig
    fsdp_config: FSDPConfig
    grad_clip: float


@dataclass
class TrainedRoleSetup:
    """The run-level facts a trained role (critic, implicit PRM) is built from beyond its config section;
    ``CriticSetup`` and ``PrimeSetup`` add what only theirs reads."""

    model_path: str  # <role>.model.path resolved (the policy's model when null)
    dtype: str
    device: torch.device
    total_optimizer_steps: int  # what the role's schedule counts over the run
    max_response_length: int
    max_prompt_length: int = 0
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    checkpoint_format: str = "auto"  # trainer.checkpoint_format


@dataclass(frozen=True)
class RoleBatching:
    """The micro-batch keys of a role as ``plan_micro_batches`` reads them; ``remove_padding_key`` is the
    config key that ``use_remove_padding`` came from (an error names it)."""

    use_remove_padding: bool
    use_dynamic_bsz: bool
    ppo_max_token_len: int | None
    log_prob_max_token_len: int | None
    remove_padding_key: str = "actor.use_remove_padding"


def load_trained_role(
    role: str, rank: int, world_size: int, cfg: TrainedRoleConfig, setup: TrainedRoleSetup,
    load_model: Callable[..., torch.nn.Module], batching: RoleBatching, sequence_parallel_size: int = 1,
) -> tuple[TrainEngine, MicroBatchPlan]:
    """The engine and micro-batch plan of a trained role whose model needs nothing between loading and
    training (critic, implicit PRM), on ``rank`` of ``world_size`` (``check_rank_group``): sharded or
    not (``shards_model``, key ``<role>.fsdp_config.param_offload``), its precision (``model_precision``),
    the model ``load_model(path, dtype=, device=, trust_remote_code=)`` gives, activation checkpointing
    when asked, ``trained_engine`` with the role's name as metrics prefix, and its plan for samples up
    to the longest prompt + response."""
    check_rank_group(role, rank, world_size)
    fsdp = cfg.fsdp_config
    data_parallel = shards_model(world_size, fsdp.param_offload, setup.device, f"{role}.fsdp_config.param_offload")
    weights_dtype, compute_dtype = model_precision(setup.dtype, trainable=True, data_parallel=data_parallel,
                                                   master_dtype=fsdp.model_dtype)
    model = load_model(setup.model_path, dtype=weights_dtype, device=setup.device,
                       trust_remote_code=setup.trust_remote_code)
    if setup.gradient_checkpointing:
        enable_activation_checkpointing(model)
    engine = trained_engine(model, cfg.optim, fsdp, total_steps=setup.total_optimizer_steps, grad_clip=cfg.grad_clip,
                            device=setup.device, data_parallel=data_parallel, mixed_precision=compute_dtype,
                            sequence_parallel_size=sequence_parallel_size, metrics_prefix=role)
    plan = plan_micro_batches(
        engine, use_remove_padding=batching.use_remove_padding, use_dynamic_bsz=batching.use_dynamic_bsz,
        ppo_max_token_len=batching.ppo_max_token_len, log_prob_max_token_len=batching.log_prob_max_token_len,
        longest_sample=setup.max_prompt_length + setup.max_response_length,
        gradient_checkpointing=setup.gradient_checkpointing, remove_padding_key=batching.remove_padding_key,
        sequence_parallel_size=sequence_parallel_size,
    )
    return engine, plan
