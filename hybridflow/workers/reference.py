"""The reference role: a frozen copy of the initial policy, for KL terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.data.plane import resolve_batch
from hybridflow.models.loading import load_causal_lm
from hybridflow.training.engine import TrainEngine
from hybridflow.training.micro_batches import plan_micro_batches
from hybridflow.training.sequence_parallel import gather_group_batch
from hybridflow.types import TrainBatch
from hybridflow.workers.engine_setup import check_rank_group, model_precision, shards_model


@dataclass
class ReferenceSetup:
    model_path: str
    dtype: str
    device: torch.device
    temperature: float
    micro_batch_size: int
    trust_remote_code: bool = False
    use_remove_padding: bool = False  # where the model has a packed path (as the actor decides)
    use_dynamic_bsz: bool = False  # token-budget micro-batches (actor.use_dynamic_bsz)
    max_token_len: int | None = None  # their budget; None: derived like the actor's logprob budget
    longest_sample: int = 0  # max prompt + max response: the floor of a derived budget
    fsdp_size: int | None = None  # shard group size with several ranks (actor.fsdp_config.fsdp_size)
    # actor.fsdp_config.param_offload: the frozen model's shards live on the CPU between forwards (GPU runs;
    # one rank shards over itself to offload, as the actor).
    offload_params: bool = False
    sequence_parallel_size: int = 1  # Ulysses group size (ref.ulysses_sequence_parallel_size)
    use_torch_compile: bool = False  # actor.use_torch_compile: the reference's forward is the actor's model's
    override_config: dict[str, Any] = field(default_factory=dict)  # model.override_config, as the actor's


class ReferenceWorker:
    """With several ranks, each is one process of a torch.distributed group and the frozen
    model is sharded with FSDP2 like the actor's (same precision rules)."""

    def __init__(self, rank: int, world_size: int, setup: ReferenceSetup) -> None:
        check_rank_group("reference", rank, world_size)
        self.setup = setup
        data_parallel = shards_model(world_size, setup.offload_params, setup.device, "actor.fsdp_config.param_offload")
        weights_dtype, compute_dtype = model_precision(setup.dtype, trainable=False, data_parallel=data_parallel)
        model = load_causal_lm(setup.model_path, dtype=weights_dtype, device=setup.device,
                               trust_remote_code=setup.trust_remote_code, override_config=setup.override_config)
        self.engine = TrainEngine(
            model, optim=None, device=setup.device, data_parallel=data_parallel, mixed_precision=compute_dtype,
            fsdp_size=setup.fsdp_size, offload_params=setup.offload_params,
            sequence_parallel_size=setup.sequence_parallel_size,
            compile_layers=setup.use_torch_compile,
        )
        self.plan = plan_micro_batches(
            self.engine, use_remove_padding=setup.use_remove_padding, use_dynamic_bsz=setup.use_dynamic_bsz,
            ppo_max_token_len=None, log_prob_max_token_len=setup.max_token_len, longest_sample=setup.longest_sample,
            sequence_parallel_size=setup.sequence_parallel_size,
        )

    def token_budgets(self) -> tuple[int | None, int | None]:
        """(None, this rank's logprob token budget per rank): the run folder records a derived one."""
        return self.plan.per_rank_budgets(self.setup.sequence_parallel_size)

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:  # (B, R)
        s = self.setup
        batch, own = gather_group_batch(resolve_batch(batch), self.engine.sp_group)  # as the actor's logprob pass
        logprobs, _ = self.engine.compute_logprobs(
            batch, temperature=s.temperature, micro_batch_size=s.micro_batch_size,
            use_remove_padding=self.plan.use_remove_padding, max_token_len=self.plan.log_prob_max_token_len,
        )
        return logprobs[own]
