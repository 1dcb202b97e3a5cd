"""The actor role: the policy being trained. Computes logprobs (with Σπ² when an estimator
needs it: ``compute_old_logprobs``) and runs PPO-style updates.

A thin adapter from controller calls to the training engine and the algorithm registries; it
never decides what happens next.

With ``world_size > 1`` each rank is one process of a torch.distributed group (the Ray backend
forms it before building the worker): the engine shards the model with FSDP2, the loss is
normalised by counts summed over ranks, so N ranks train exactly like one rank on the same
global batch.

Weight sync to a rollout in another process (``rollout.weight_sync=broadcast``): rank 0 joins a
weight-sync group as its sender (``join_weight_sync``); at each sync every rank walks the same
buckets and gathers them one at a time in lockstep, and rank 0 streams each to the rollout as it
is gathered (``send_weights``, ``stream_weights``): the model is never gathered whole. The other
ranks never join that group; rank 0 tells them over their own group when to gather and how the
sync ended.

LoRA (``actor.lora.rank`` > 0, ``hybridflow.models.lora``): the engine trains the adapters only;
the actor also answers ``compute_ref_logprobs`` (the base model: its adapter switched off), syncs
merged weights under the base model's names (or only the adapter: ``actor.lora.sync=adapter``),
and its checkpoints hold the adapter with its optimizer state and ``model/lora.json``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.algorithms import (
    LossInputs,
    PolicyLossFn,
    RejectionCriterion,
    agg_loss,
    batch_counts,
    build_policy_loss_params,
    compute_rollout_correction,
    compute_rollout_rejection,
    get_policy_loss,
    kl_penalty,
    parse_rollout_rs,
)
from hybridflow.config.budget import (
    BYTES,
    ModelShape,
    auto_token_budget,
    available_host_memory_bytes,
    packing_decision,
)
from hybridflow.config.schema import ActorConfig, LoraConfig, OptimConfig, PolicyLossConfig, RolloutCorrectionConfig
from hybridflow.data.plane import resolve_batch
from hybridflow.models.loading import enable_activation_checkpointing, load_causal_lm, load_tokenizer
from hybridflow.models.vision import freeze_vision_tower
from hybridflow.models.lora import (
    LoraLayout,
    LoraSpec,
    adapter_payload,
    apply_lora,
    keep_adapters_in,
    load_adapter,
    write_lora_manifest,
)
from hybridflow.transfer import weight_transfer
from hybridflow.transfer.weight_transfer import (
    DEFAULT_TRANSFER_BUCKET_BYTES,
    SENDER_RANK,
    TransferStats,
    WeightSyncError,
    WeightSyncGroup,
    gpu_uuid,
    sync_device,
)
from hybridflow.transfer.weights import plan_buckets
from hybridflow.training import distributed
from hybridflow.training.distributed import collective
from hybridflow.training.engine import (
    OptimSpec,
    TrainEngine,
    num_token_budget_micro_batches,
    token_budget_micro_batches,
)
from hybridflow.training.lm_head import TokenStats
from hybridflow.training.sequence_parallel import gather_group_batch
from hybridflow.types import TrainBatch
from hybridflow.utils.device import parse_dtype
from hybridflow.utils.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass
class ActorSetup:
    """The run-level facts an actor needs beyond its own config section."""

    model_path: str
    dtype: str
    device: torch.device
    temperature: float  # rollout temperature: the trainer scores tokens under the same distribution
    rollout_n: int
    total_optimizer_steps: int
    max_response_length: int
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    chat_template: str | None = None  # data.chat_template: saved with the tokenizer in exports
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    max_consecutive_skips: int = 10
    max_prompt_length: int = 0  # with max_response_length: the longest sample, the floor of a token budget
    # The old-logprob forward also returns Σ_v π(v)² per response token (an estimator needs
    # sum_pi_squared: the optimal-token-baseline ones); set-up decides from the estimator's needs.
    sum_pi_squared: bool = False
    checkpoint_format: str = "auto"  # trainer.checkpoint_format
    seed: int = 0  # trainer.seed: LoRA's adapter init, the same on every rank
    override_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # model.override_config


@dataclass
class OldLogprobs:
    """One rank's result of the old-logprob forward (``ActorWorker.compute_old_logprobs``)."""

    logprobs: torch.Tensor  # (B, R)
    sum_pi_squared: torch.Tensor | None = None  # (B, R) when ActorSetup.sum_pi_squared


def gather_old_logprobs(shards: list[OldLogprobs]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ranks' shards (``split_gather``, rank order) glued: (old_logprobs, sum_pi_squared | None).  # (B, R)"""
    logprobs = torch.cat([s.logprobs for s in shards])
    if any(s.sum_pi_squared is None for s in shards):
        return logprobs, None
    return logprobs, torch.cat([s.sum_pi_squared for s in shards])


def stream_weights(
    engine: TrainEngine, rank: int, group: WeightSyncGroup | None,
    max_bucket_bytes: int = DEFAULT_TRANSFER_BUCKET_BYTES, lora: LoraLayout | None = None,
) -> TransferStats | None:
    """One weight sync from a (possibly sharded) training engine, without gathering the model.

    Every rank plans the same buckets from its shards' names and full shapes (no collective),
    each sharded tensor as row slices cut at the shard boundaries and at most a bucket long; then
    rank 0 sends them with ``weight_transfer.send_buckets`` while fetching each slice only when
    the sender asks for it: the rank whose shard holds it sends it to rank 0, in lockstep with
    the others. So rank 0's extra memory is the flat buffer plus one slice (about one bucket),
    not the model, nor its largest tensor; the other ranks send views of their shards. One rank:
    the model's own tensors and views of their rows are sent, nothing gathered or copied.

    Returns rank 0's stats, None on the others. When the sync fails (a receiver refused a bucket,
    naming the parameter) rank 0 raises ``WeightSyncError`` and tells the other ranks, which
    raise it too instead of waiting in a gather that will not come. A collective over the
    engine's ranks; rank 0 passes its weight-sync ``group``.

    ``lora``: the engine's model carries LoRA adapters; what travels is the base model's weights
    under their own names with each adapter merged (``LoraLayout.merge_rows``): the buckets are
    planned from the base weights, and each tensor or row slice is merged on rank 0 as it is
    gathered, from full copies of the adapters (gathered first: r x (in + out) per layer)."""
    named = engine.named_weight_shards()
    adapters: dict[str, torch.Tensor] = {}
    if lora is not None:
        adapters = {n: distributed.gather_weight(t) for n, t in lora.adapters(named).items()}
        named = lora.base_weights(named)
    plan = plan_buckets(named, max_bucket_bytes, distributed.shard_row_cuts)
    if rank != SENDER_RANK:
        error = distributed.follow_bucket_gathers(plan)
        if error is not None:
            raise WeightSyncError(f"actor rank {rank}: the weight sync failed on rank {SENDER_RANK}: {error}")
        return None
    with distributed.lead_bucket_gathers(plan) as buckets:
        if group is None:
            raise RuntimeError("actor rank 0 has not joined a weight-sync group: call join_weight_sync first")
        if lora is not None:
            buckets = ((bucket, _merged(lora, bucket, data, adapters)) for bucket, data in buckets)
        return weight_transfer.send_buckets(group, buckets)


def _merged(lora: LoraLayout, bucket, data, adapters: dict[str, torch.Tensor]):
    """A bucket's gathered bytes with each LoRA adapter merged into its base weight's rows."""
    for entry, rows in zip(bucket, data, strict=True):
        yield lora.merge_rows(entry.name, rows, adapters, entry.rows)


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


@dataclass(frozen=True)
class MicroBatchPlan:
    """How a role cuts its batches into forwards (``config explain`` prints the same decisions)."""

    use_remove_padding: bool
    ppo_max_token_len: int | None  # None: fixed-size micro-batches (use_dynamic_bsz=false)
    log_prob_max_token_len: int | None
    notes: tuple[str, ...]

    def per_rank_budgets(self, sequence_parallel_size: int = 1) -> tuple[int | None, int | None]:
        """(update budget, forward budget) as the ``*_max_token_len_per_gpu`` keys count them: one
        rank's tokens (a Ulysses group's budgets, above, are sp times that)."""
        sp = sequence_parallel_size
        return (None if self.ppo_max_token_len is None else self.ppo_max_token_len // sp,
                None if self.log_prob_max_token_len is None else self.log_prob_max_token_len // sp)


def plan_micro_batches(
    engine: TrainEngine,
    *,
    use_remove_padding: bool,
    use_dynamic_bsz: bool,
    ppo_max_token_len: int | None,
    log_prob_max_token_len: int | None,
    longest_sample: int,
    gradient_checkpointing: bool = False,
    remove_padding_key: str = "actor.use_remove_padding",
    sequence_parallel_size: int = 1,
) -> MicroBatchPlan:
    """Packed or padded (``hybridflow.config.budget.packing_decision`` on the loaded model), and
    the token budgets: the configured ones, or ``auto_token_budget`` from the model's shape and
    the free memory of the engine's device. With several ranks every rank takes the smallest
    rank's budget (a collective), so all cut their batches alike. With Ulysses groups of
    ``sequence_parallel_size`` ranks each rank holds 1/sp of a micro-batch's tokens, so the
    budgets (per rank) are multiplied by sp to count the group's micro-batch, as verl does."""
    plan = _plan_micro_batches(engine, use_remove_padding=use_remove_padding, use_dynamic_bsz=use_dynamic_bsz,
                               ppo_max_token_len=ppo_max_token_len, log_prob_max_token_len=log_prob_max_token_len,
                               longest_sample=longest_sample, gradient_checkpointing=gradient_checkpointing,
                               remove_padding_key=remove_padding_key)
    sp = sequence_parallel_size
    if sp == 1:
        return plan
    if not plan.use_remove_padding:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} splits packed sequences, but this role runs padded "
                         f"micro-batches ({plan.notes[0]})")
    note = f"Ulysses sequence parallel over {sp} ranks: the token budgets count a group's micro-batch (x{sp})"
    return MicroBatchPlan(
        plan.use_remove_padding,
        None if plan.ppo_max_token_len is None else plan.ppo_max_token_len * sp,
        None if plan.log_prob_max_token_len is None else plan.log_prob_max_token_len * sp,
        (*plan.notes, note),
    )


def _plan_micro_batches(
    engine: TrainEngine,
    *,
    use_remove_padding: bool,
    use_dynamic_bsz: bool,
    ppo_max_token_len: int | None,
    log_prob_max_token_len: int | None,
    longest_sample: int,
    gradient_checkpointing: bool,
    remove_padding_key: str,
) -> MicroBatchPlan:
    """``plan_micro_batches`` for one rank's share of the tokens."""
    model = engine.model
    # config.auto_map names modeling code shipped with the checkpoint (trust_remote_code).
    shape = ModelShape.from_config(model.config.to_dict())
    packed, why = packing_decision(use_remove_padding, shape.model_type, custom_code=shape.custom_code,
                                   key=remove_padding_key)
    notes = [f"{'packed' if packed else 'padded'} micro-batches: {why}"]
    if not use_dynamic_bsz:
        return MicroBatchPlan(packed, None, None, tuple(notes))
    if ppo_max_token_len is None or log_prob_max_token_len is None:
        if engine.device.type == "cuda":
            free, label = torch.cuda.mem_get_info(engine.device)[0], "free GPU memory"
        else:
            free, label = available_host_memory_bytes(), "available host memory"
        dtype = engine.autocast_dtype or next(model.parameters()).dtype
        auto = auto_token_budget(
            shape, free, longest_sample, compute_bytes=BYTES.get(str(dtype).removeprefix("torch."), 4),
            gradient_checkpointing=gradient_checkpointing, full_logits=not engine.fused_lm_head, memory_label=label,
            device_type=engine.device.type,
        )
        ppo = ppo_max_token_len if ppo_max_token_len is not None else auto.ppo
        log_prob = log_prob_max_token_len if log_prob_max_token_len is not None else auto.log_prob
        if engine.data_parallel:
            ppo, log_prob = -distributed.all_reduce_max(-ppo), -distributed.all_reduce_max(-log_prob)
        notes.append(f"token budget: {ppo} tokens per training micro-batch, {log_prob} per logprob micro-batch "
                     f"({auto.reason})")
        return MicroBatchPlan(packed, ppo, log_prob, tuple(notes))
    notes.append(f"token budget: {ppo_max_token_len} tokens per training micro-batch, {log_prob_max_token_len} per "
                 f"logprob micro-batch (configured)")
    return MicroBatchPlan(packed, ppo_max_token_len, log_prob_max_token_len, tuple(notes))


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


def train_micro_batches(engine: TrainEngine, plan: MicroBatchPlan, mini: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    """A mini-batch's training micro-batches: ``micro_batch_size`` samples each, or, with a token
    budget (``plan.ppo_max_token_len``), as many as every rank agrees on. Actor and critic alike."""
    budget, padded = plan.ppo_max_token_len, not plan.use_remove_padding
    if budget is None:
        return mini.split(micro_batch_size)
    count = engine.agree_num_micro_batches(num_token_budget_micro_batches(mini, budget, padded=padded))
    return token_budget_micro_batches(mini, budget, num_micro_batches=count, padded=padded)[0]


def sharded_checkpoints(checkpoint_format: str, world_size: int) -> bool:
    """Whether a role saves sharded checkpoints (``trainer.checkpoint_format``): ``auto`` shards
    with more than one rank, where gathering the whole model on rank 0 is what a save would cost."""
    if checkpoint_format not in ("auto", "sharded", "full"):
        raise ValueError(f"trainer.checkpoint_format={checkpoint_format!r}: expected auto, sharded or full")
    return checkpoint_format == "sharded" or (checkpoint_format == "auto" and world_size > 1)


def load_engine_checkpoint(engine: TrainEngine, ckpt_dir: Path, role: str) -> str | None:
    """Load what ``engine.save`` wrote in ``ckpt_dir``: None when it is in place, else why it was
    refused (one line naming the file), with nothing changed.

    The refusal is returned, not raised: a raising rank makes a multi-rank Ray group tear itself
    down, and the controller must be able to try an older checkpoint on the same workers. Every
    rank checks the same files, then the ranks agree before the collective that applies them:
    one rank refusing alone would leave the others waiting in it."""
    try:
        loaded, refusal = engine.read_checkpoint(ckpt_dir), None
    except CheckpointError as exc:
        loaded, refusal = None, str(exc)
    if distributed.all_reduce_max(int(refusal is not None)):
        return refusal or f"{ckpt_dir}: another {role} rank refused this checkpoint"
    assert loaded is not None
    engine.apply_checkpoint(loaded)
    return None


class ActorWorker:
    def __init__(self, rank: int, world_size: int, cfg: ActorConfig, setup: ActorSetup) -> None:
        check_rank_group("actor", rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.cfg, self.setup = cfg, setup
        self.tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code, setup.chat_template)
        data_parallel = shards_model(world_size, cfg.fsdp_config.param_offload, setup.device,
                                     "actor.fsdp_config.param_offload")
        weights_dtype, compute_dtype = model_precision(setup.dtype, trainable=True, data_parallel=data_parallel,
                                                       master_dtype=cfg.fsdp_config.model_dtype)
        if cfg.lora.rank > 0:
            # LoRA's base is frozen: it needs no fp32 master copy, so it may load in bf16 straight
            # away (actor.lora.base_dtype; no fp32 copy is ever made). The adapters stay fp32 below.
            weights_dtype = parse_dtype(cfg.lora.base_dtype)
        model = load_causal_lm(
            setup.model_path,
            dtype=weights_dtype,
            device=setup.device,
            trust_remote_code=setup.trust_remote_code,
            override_config=setup.override_config,
        )
        # LoRA: the engine trains the PEFT-wrapped model's inner HF model (adapters injected in
        # place, everything else frozen); the PeftModel is kept to switch its adapter off.
        self.peft_model, self.lora = None, None
        if cfg.lora.rank > 0:
            # Every rank must draw the same initial A: FSDP2 shards what each rank holds, and
            # replicas (fsdp_size) must start equal. Drawn from the run's seed, RNG left as it was.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(setup.seed)
                # actor.lora.adapter_path: the saved adapter (every rank reads the same file) instead of fresh ones.
                self.peft_model = apply_lora(model, lora_spec(cfg.lora)) if cfg.lora.adapter_path is None \
                    else load_adapter(model, cfg.lora.adapter_path, lora_spec(cfg.lora))
            model = self.peft_model.get_base_model()
            keep_adapters_in(model, torch.float32)
            self.lora = LoraLayout.from_model(model)
        if cfg.freeze_vision_tower:
            # Before the engine: its optimizer holds only what requires grad.
            frozen = freeze_vision_tower(model)
            if self.rank == 0:
                log.info("actor.freeze_vision_tower: %s", f"{frozen} vision-tower parameters frozen" if frozen
                         else "the model has no vision tower")
        if setup.gradient_checkpointing:
            enable_activation_checkpointing(model)
            if self.lora is not None:
                # The frozen embeddings give the checkpointed layers inputs without grad: under
                # reentrant checkpointing (older transformers' default) their adapters would get no
                # gradient. transformers v5 checkpoints non-reentrantly, where this changes nothing.
                model.enable_input_require_grads()
        self.engine = TrainEngine(
            model,
            optim_spec(cfg.optim, total_steps=setup.total_optimizer_steps, grad_clip=cfg.grad_clip),
            setup.device,
            data_parallel=data_parallel,
            mixed_precision=compute_dtype,
            reduce_dtype=parse_dtype(cfg.fsdp_config.reduce_dtype),
            fsdp_size=cfg.fsdp_config.fsdp_size,
            offload_params=cfg.fsdp_config.param_offload,
            offload_optimizer=cfg.fsdp_config.optimizer_offload,
            sequence_parallel_size=cfg.ulysses_sequence_parallel_size,
            checkpoint_trainable_only=self.lora is not None,
            compile_layers=cfg.use_torch_compile,
        )
        # Ulysses groups of sp ranks pool their shards: world / sp data-parallel ranks.
        self.data_parallel_size = world_size // cfg.ulysses_sequence_parallel_size
        self.plan = plan_micro_batches(
            self.engine, use_remove_padding=cfg.use_remove_padding, use_dynamic_bsz=cfg.use_dynamic_bsz,
            ppo_max_token_len=cfg.ppo_max_token_len_per_gpu, log_prob_max_token_len=cfg.log_prob_max_token_len_per_gpu,
            longest_sample=setup.max_prompt_length + setup.max_response_length,
            gradient_checkpointing=setup.gradient_checkpointing,
            sequence_parallel_size=cfg.ulysses_sequence_parallel_size,
        )
        if rank == 0:
            for note in self.plan.notes:
                log.info("actor: %s", note)
        self.policy_loss, self.policy_loss_params = build_actor_policy_loss(cfg, setup.rollout_correction)
        self.consecutive_skips = 0
        self.weight_sync: WeightSyncGroup | None = None  # rank 0, once joined (rollout.weight_sync=broadcast)

    def token_budgets(self) -> tuple[int | None, int | None]:
        """This rank's (update, logprob) token budgets per rank: the run folder records derived ones."""
        return self.plan.per_rank_budgets(self.cfg.ulysses_sequence_parallel_size)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprobs of the response tokens under the current weights (old_logprobs).  # (B, R)"""
        return self._old_policy_forward(batch, with_sum_pi_squared=False).logprobs

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """LoRA: the reference policy's logprobs, the base model's, from this model with its
        adapter switched off (PEFT's ``disable_adapter``): no second copy of the weights. Set-up
        routes reference logprobs here instead of building a reference role.  # (B, R)"""
        if self.peft_model is None:
            raise RuntimeError("compute_ref_logprobs on the actor needs actor.lora.rank > 0 (else a reference role)")
        with self.peft_model.disable_adapter():
            return self._old_policy_forward(batch, with_sum_pi_squared=False).logprobs

    def compute_old_logprobs(self, batch: TrainBatch) -> OldLogprobs:
        """The old-logprob forward: logprobs and, when set-up asked for it (``ActorSetup.sum_pi_squared``),
        Σ_v π(v)² of every response token from the same logits, no second forward.  # (B, R)"""
        stats = self._old_policy_forward(batch, with_sum_pi_squared=self.setup.sum_pi_squared)
        return OldLogprobs(stats.logprobs, stats.sum_pi_squared)

    def _old_policy_forward(self, batch: TrainBatch, with_sum_pi_squared: bool) -> TokenStats:
        # Sequence parallel: the group computes its pooled shards; each rank returns its own rows.
        batch, own = gather_group_batch(resolve_batch(batch), self.engine.sp_group)
        stats = self.engine.compute_token_stats(
            batch, temperature=self.setup.temperature, micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
            use_remove_padding=self.plan.use_remove_padding, max_token_len=self.plan.log_prob_max_token_len,
            with_sum_pi_squared=with_sum_pi_squared,
        )
        return TokenStats(*(None if x is None else x[own] for x in stats))

    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches over this rank's shard (its Ulysses group's
        pooled shards); metrics averaged. Token counts are summed over every rank (a group's
        sp times) and the loss scaled by the world size: ``hybridflow.training.sequence_parallel``
        says why that trains like one rank."""
        cfg = self.cfg
        batch, _ = gather_group_batch(resolve_batch(batch), self.engine.sp_group)
        batch, correction_metrics = self._rollout_correction(batch)
        mini_size = cfg.ppo_mini_batch_size * self.setup.rollout_n // self.data_parallel_size
        # Shuffle order and random loss choices (clip_cov) vary per update but are restored by a
        # resume: the generator is seeded by the LR scheduler's step count, which checkpoints carry.
        assert self.engine.scheduler is not None
        generator = torch.Generator().manual_seed(int(self.engine.scheduler.last_epoch))
        step_metrics: list[dict[str, float]] = []
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(batch.batch_size, generator=generator) if cfg.shuffle else torch.arange(batch.batch_size)
            for start in range(0, batch.batch_size, mini_size):
                mini = batch.select(order[start : start + mini_size])
                micro_batches = train_micro_batches(self.engine, self.plan, mini, cfg.ppo_micro_batch_size_per_gpu)
                # Normalise by the whole mini-batch over every rank, so accumulation over
                # micro-batches and the gradient average over ranks reproduce the full-batch loss.
                num_tokens, num_seqs = (int(c) for c in distributed.all_reduce_sum(batch_counts(mini.response_mask)))
                skipped_before = self.engine.skipped_steps
                step_metrics.append(
                    self.engine.optimizer_step(
                        micro_batches,
                        self._loss_fn(num_tokens, num_seqs, len(micro_batches), generator),
                        temperature=self.setup.temperature,
                        with_entropy=True,
                        use_remove_padding=self.plan.use_remove_padding,
                    )
                )
                self._count_skip(skipped=self.engine.skipped_steps > skipped_before)
        metrics = {k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}
        metrics["actor/skipped_steps"] = float(self.engine.skipped_steps)
        return metrics | correction_metrics

    def _count_skip(self, skipped: bool) -> None:
        """A skipped step leaves the weights alone; many in a row mean the run is broken, so stop."""
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips >= self.setup.max_consecutive_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient norm and were "
                f"skipped (trainer.max_consecutive_skips={self.setup.max_consecutive_skips}); the weights are "
                f"unchanged since the last good step. Look for NaN rewards or advantages, lower actor.optim.lr, or "
                f"use model.dtype=float32"
            )

    def _rollout_correction(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """Importance weights and rejection between the rollout engine and the trainer.

        Needs the trainer's ``old_logprobs``; without them (fully on-policy, no correction
        configured) there is nothing to compare. With them the mismatch metrics are always
        logged, so a drifting engine is visible before correction is turned on.
        """
        rc = self.setup.rollout_correction
        if batch.old_logprobs is None or rc.bypass_mode:  # bypass mode corrects inside its loss
            return batch, {}
        common = dict(old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                      response_mask=batch.response_mask)
        # Normalised over the whole batch, as verl's driver does: every rank holds a shard, so the
        # mean's sum and count are summed over the ranks (Ulysses groups count each shard sp times
        # in both, which leaves the mean as it is).
        weights = compute_rollout_correction(
            **common, level=rc.rollout_is or "token", threshold=rc.rollout_is_threshold,
            batch_normalize=rc.rollout_is_batch_normalize and rc.rollout_is is not None,
            sum_over_ranks=distributed.all_reduce_sum)
        metrics = dict(weights.metrics)
        if rc.rollout_is is not None:
            batch = dataclasses.replace(batch, rollout_is_weights=weights.weights)
        if rc.rollout_rs is not None:
            rejection = compute_rollout_rejection(**common, criteria=rollout_rs_criteria(rc))
            metrics |= rejection.metrics
            # Rejected tokens leave the loss and its normaliser; advantages are unchanged.
            batch = dataclasses.replace(batch, response_mask=rejection.keep_mask)
        return batch, metrics

    def _loss_fn(self, num_tokens: int, num_seqs: int, num_micro: int, generator: torch.Generator):
        cfg, rc = self.cfg, self.setup.rollout_correction
        scale = cfg.loss_scale_factor if cfg.loss_scale_factor is not None else float(self.setup.max_response_length)
        agg = dict(
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            loss_scale_factor=scale,
            dp_size=self.world_size,
        )

        def token_mean_metric(values: torch.Tensor, mask: torch.Tensor) -> float:
            """This micro-batch's share of the mini-batch's token mean, x the micro-batch count:
            the engine's average over micro-batches (and the mean over ranks) then gives the mean
            over every token of the mini-batch, however the samples were cut into micro-batches."""
            share = agg_loss(values.detach(), mask, "token-mean", global_num_tokens=num_tokens, dp_size=self.world_size)
            return float(share) * num_micro

        def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
            if mb.advantages is None:
                raise ValueError("update_actor needs advantages on the batch")
            mask = mb.response_mask
            # Fully on-policy (one optimizer step per rollout batch) the old policy *is* the
            # current one, so the controller may skip the extra forward and we detach here.
            old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
            is_weights, correction_metrics = mb.rollout_is_weights, {}
            if mb.old_logprobs is None and rc.rollout_is is not None and not rc.bypass_mode:
                # On-policy with importance weights: this forward is π_old, so the weights come
                # from it (set-up skipped the old-logprob forward); per sample, so per micro-batch.
                if rc.rollout_is_batch_normalize:
                    raise RuntimeError("algorithm.rollout_correction.rollout_is_batch_normalize needs the whole "
                                       "batch's weights before the update: set-up must run the old-logprob forward")
                correction = compute_rollout_correction(
                    old_logprobs=old, rollout_logprobs=mb.rollout_logprobs, response_mask=mask,
                    level=rc.rollout_is, threshold=rc.rollout_is_threshold)
                is_weights = correction.weights
                # Means over this micro-batch, which the engine averages over micro-batches (the
                # maxima and the mismatch, logged below, would not average).
                correction_metrics = {k: v for k, v in correction.metrics.items()
                                      if not k.endswith("_max") and k != "rollout_corr/log_ratio_abs_mean"}
            inputs = LossInputs(
                old_logprobs=old, logprobs=logprobs, advantages=mb.advantages, response_mask=mask,
                rollout_is_weights=is_weights, rollout_logprobs=mb.rollout_logprobs,
                generator=generator, **agg,
            )
            pg_loss, metrics = self.policy_loss(inputs, self.policy_loss_params)
            metrics |= correction_metrics
            loss = pg_loss
            # The engine averages metrics over micro-batches; each micro-batch's loss is its share
            # of the mini-batch loss (global normalisation), so share x count averages to the
            # mini-batch's policy loss, whatever the aggregation mode.
            metrics["actor/pg_loss"] = float(pg_loss.detach()) * num_micro
            if mb.old_logprobs is None:
                # On-policy, this forward *is* the old policy: the engine mismatch comes for free.
                diff = (logprobs.detach() - mb.rollout_logprobs).abs()
                metrics["rollout_corr/log_ratio_abs_mean"] = token_mean_metric(diff, mask)
            if entropy is not None:
                metrics["actor/entropy"] = token_mean_metric(entropy, mask)
                if cfg.entropy_coeff != 0:
                    loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
            if cfg.use_kl_loss:
                if mb.ref_logprobs is None:
                    raise ValueError("actor.use_kl_loss=true but the batch has no reference logprobs")
                kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_loss_type)
                loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
                metrics["actor/kl_loss"] = token_mean_metric(kl, mask)
                metrics["actor/kl_coef"] = cfg.kl_loss_coef
            return loss, metrics

        return loss_fn

    # ------------------------------------------------------------ weights / IO
    # Collective with several ranks: each rank holds a shard, so every rank takes part in the
    # gather; rank 0 returns (or writes) the full tensors.
    @collective
    def weights_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        """Full weights by HF name on rank 0 (a list, so it can cross a process boundary); []
        on the other ranks. The object-store path returns the model as one object, so sharded
        ranks gather it whole here; one rank returns the model's own tensors, uncopied. LoRA: the
        base model's names with the adapters merged (new tensors for the adapted layers)."""
        return self._base_weights(self.engine.named_weights())

    def _base_weights(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return named if self.lora is None else self.lora.merged_weights(named)

    @collective
    def adapter_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        """``actor.lora.sync=adapter``: only the adapters (``lora.adapter_payload``: A, B and the
        scaling under each adapted weight's base name), gathered whole on rank 0; [] on the others.
        The rollout worker merges them into its own copy of the base weights."""
        if self.lora is None:
            raise RuntimeError("adapter_for_sync needs actor.lora.rank > 0")
        adapters = {n: distributed.gather_weight(t).detach()
                    for n, t in self.lora.adapters(self.engine.named_weight_shards()).items()}
        return adapter_payload(self.lora, adapters) if self.rank == 0 else []

    @collective
    def weights_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """``weights_for_sync``, copied: a version of the weights that later updates leave as it is,
        for a rollout that takes it when it is next between batches (``trainer.mode=fully_async``)."""
        named = self.engine.named_weights()
        if self.lora is None:
            return [(name, tensor.detach().clone()) for name, tensor in named]
        # A merged weight is a new tensor already; only the others are the model's own.
        return [(name, tensor if name in self.lora.layers else tensor.detach().clone())
                for name, tensor in self.lora.merged_weights(named)]

    def device_uuid(self) -> str | None:
        """This rank's GPU (None on CPU), so the controller can tell whether NCCL can link it to
        the rollout ranks."""
        return gpu_uuid(self.setup.device)

    def join_weight_sync(self, host: str, port: int, world_size: int, on_gpu: bool) -> None:
        """Join the weight-sync group at ``host:port`` as its sender, listening there; returns once
        all ``world_size`` members (this rank and the rollout ranks) have joined."""
        if self.rank != SENDER_RANK:
            raise ValueError(f"actor rank {self.rank}: only rank {SENDER_RANK} joins the weight-sync group")
        self.weight_sync = WeightSyncGroup.connect(rank=SENDER_RANK, world_size=world_size, host=host, port=port,
                                                   device=sync_device(self.setup.device, on_gpu))

    @collective
    def send_weights(self, max_bucket_bytes: int = DEFAULT_TRANSFER_BUCKET_BYTES) -> TransferStats | None:
        """One weight sync: rank 0 streams the weights bucket by bucket to the rollout ranks, which
        run ``receive_weights`` at the same time, and every rank joins each bucket's gather
        (FSDP2) as it is sent (``stream_weights``). Returns once they applied every bucket: the
        transfer's stats on rank 0, None on the others."""
        if self.lora is not None and self.cfg.lora.sync == "adapter":
            # Only the adapters (gathered whole on every rank: small), sent by rank 0 as they are.
            payload = self.adapter_for_sync()
            if self.rank != SENDER_RANK:
                return None
            if self.weight_sync is None:
                raise RuntimeError("actor rank 0 has not joined a weight-sync group: call join_weight_sync first")
            return weight_transfer.send_weights(self.weight_sync, payload, max_bucket_bytes)
        return stream_weights(self.engine, self.rank, self.weight_sync, max_bucket_bytes, lora=self.lora)

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group (a no-op when not in one)."""
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None

    @collective
    def save_checkpoint(self, out_dir: str) -> None:
        sharded = sharded_checkpoints(self.setup.checkpoint_format, self.world_size)
        self.engine.save(Path(out_dir), tokenizer=self.tokenizer, sharded=sharded)
        if self.lora is not None and self.rank == 0:
            # What ``hybridflow export`` needs to rebuild the policy: the base model and the adapter's shape.
            write_lora_manifest(Path(out_dir) / "model", self.setup.model_path, lora_spec(self.cfg.lora))

    @collective
    def load_checkpoint(self, ckpt_dir: str) -> str | None:
        """Load the checkpoint the actor saved in ``ckpt_dir`` (``load_engine_checkpoint``)."""
        return load_engine_checkpoint(self.engine, Path(ckpt_dir), "actor")


def lora_spec(cfg: LoraConfig) -> LoraSpec:
    """``actor.lora`` (rank > 0) as the spec ``apply_lora`` takes."""
    return LoraSpec(rank=cfg.rank, alpha=cfg.alpha, target_modules=tuple(cfg.target_modules), dropout=cfg.dropout,
                    exclude_modules=cfg.exclude_modules)


def build_actor_policy_loss(cfg: ActorConfig, rc: RolloutCorrectionConfig) -> tuple[PolicyLossFn, Any]:
    """The configured policy loss and its typed params: the one place where the flat config keys
    become a loss's parameters.

    Bypass mode replaces the loss (config validation allows it only over vanilla), as in verl.
    The actor's shared keys (clip ratios, aggregation, rollout correction) fill whichever fields
    the loss has. ``actor.policy_loss.*`` keys belong to one loss each: every one of them fills
    its field, and one set away from its default under a loss without that field raises a
    ValueError naming it (``tau_pos`` with loss_mode=vanilla is a mistake, not a no-op).
    """
    mode = "bypass_mode" if rc.bypass_mode else cfg.policy_loss.loss_mode
    fn = get_policy_loss(mode)
    shared = dict(
        clip_ratio_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
        clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
        bypass_loss_type=rc.loss_type, rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs_criteria=rollout_rs_criteria(rc),
    )
    mode_keys = {f.name: getattr(cfg.policy_loss, f.name) for f in dataclasses.fields(cfg.policy_loss)
                 if f.name != "loss_mode"}
    defaults = PolicyLossConfig()
    changed = {k: v for k, v in mode_keys.items() if v != getattr(defaults, k)}
    return fn, build_policy_loss_params(fn, shared={**shared, **mode_keys}, specific=changed, name=mode)


def rollout_rs_criteria(rc: RolloutCorrectionConfig) -> tuple[RejectionCriterion, ...]:
    """The configured rejection criteria (``algorithm.rollout_correction.rollout_rs`` with its
    thresholds, as verl reads them); () without rejection. ValueError on a bad spec (set-up reports
    it as a config error on the key)."""
    if rc.rollout_rs is None:
        return ()
    return parse_rollout_rs(rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower)
