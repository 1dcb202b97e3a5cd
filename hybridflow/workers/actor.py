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

from hybridflow.algorithms import CorrectedRollout, LossInputs, agg_loss, batch_counts, correct_rollout, kl_penalty
from hybridflow.algorithms.preference import preference_loss, sequence_logps
from hybridflow.config.schema import ActorConfig, RolloutCorrectionConfig
from hybridflow.data.plane import resolve_batch
from hybridflow.models.loading import enable_activation_checkpointing, load_causal_lm, load_tokenizer
from hybridflow.models.lora import (
    LoraLayout,
    adapter_payload,
    apply_lora,
    keep_adapters_in,
    load_adapter,
    write_lora_manifest,
)
from hybridflow.models.vision import freeze_vision_tower
from hybridflow.transfer import weight_transfer
from hybridflow.transfer.weight_transfer import (
    DEFAULT_TRANSFER_BUCKET_BYTES,
    SENDER_RANK,
    TransferStats,
    WeightSyncGroup,
    gpu_uuid,
    sync_device,
)
from hybridflow.training import distributed
from hybridflow.training.distributed import collective
from hybridflow.training.lm_head import TokenStats
from hybridflow.training.micro_batches import plan_micro_batches, train_micro_batches
from hybridflow.training.sequence_parallel import gather_group_batch
from hybridflow.tracking.metrics import reduce_metrics
from hybridflow.types import TrainBatch
from hybridflow.utils.device import parse_dtype
from hybridflow.utils.memory import release_free_heap
from hybridflow.workers.checkpoints import load_engine_checkpoint, sharded_checkpoints
from hybridflow.workers.dpo import DPOLossSpec
from hybridflow.workers.engine_setup import check_rank_group, lora_spec, model_precision, shards_model, trained_engine
from hybridflow.workers.pair_batches import cut_pairs, pair_row_weights, whole_pairs
from hybridflow.workers.policy_loss import build_actor_policy_loss, rollout_correction_settings
from hybridflow.workers.weight_stream import stream_weights

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
    # actor.loss=dpo: online DPO's preference loss (algorithm.online_dpo); the update trains on pairs.
    preference: DPOLossSpec | None = None


@dataclass
class OldLogprobs:
    """One rank's result of the old-logprob forward (``ActorWorker.compute_old_logprobs``): the
    logprobs, and the step's rollout correction computed from them (the one place it is, when old
    logprobs exist): what the estimator and the actor's loss both read from the batch."""

    logprobs: torch.Tensor  # (B, R)
    sum_pi_squared: torch.Tensor | None = None  # (B, R) when ActorSetup.sum_pi_squared
    rollout_is_weights: torch.Tensor | None = None  # (B, R) with algorithm.rollout_correction.rollout_is
    rollout_keep_mask: torch.Tensor | None = None  # (B, R) with rollout_rs: response_mask less the rejected tokens
    correction_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # this rank's rollout_corr/*


def gather_old_logprobs(shards: list[OldLogprobs]) -> OldLogprobs:
    """The ranks' shards (``split_gather``, rank order) glued, each column None where a rank has
    none; ``correction_metrics`` the mean over ranks (as the update's metrics are reduced).  # (B, R)"""

    def glued(column: str) -> torch.Tensor | None:
        parts = [getattr(s, column) for s in shards]
        return None if any(p is None for p in parts) else torch.cat(parts)

    logprobs = torch.cat([s.logprobs for s in shards])
    return OldLogprobs(logprobs, glued("sum_pi_squared"), glued("rollout_is_weights"), glued("rollout_keep_mask"),
                       reduce_metrics([s.correction_metrics for s in shards]))


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
        self.engine = trained_engine(
            model, cfg.optim, cfg.fsdp_config, total_steps=setup.total_optimizer_steps, grad_clip=cfg.grad_clip,
            device=setup.device, data_parallel=data_parallel, mixed_precision=compute_dtype,
            sequence_parallel_size=cfg.ulysses_sequence_parallel_size, metrics_prefix="actor",
            checkpoint_trainable_only=self.lora is not None, compile_layers=cfg.use_torch_compile,
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
        self.correction = rollout_correction_settings(setup.rollout_correction)
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
        Σ_v π(v)² of every response token from the same logits, no second forward; and the rollout
        correction from those logprobs (``rollout_correction``).  # (B, R)"""
        # Sequence parallel: the group computes its pooled shards; each rank returns its own rows.
        pooled, own = gather_group_batch(resolve_batch(batch), self.engine.sp_group)
        stats = self._token_stats(pooled, with_sum_pi_squared=self.setup.sum_pi_squared)
        corrected = self.rollout_correction(pooled, stats.logprobs)
        weights, keep_mask = corrected.weights, corrected.keep_mask
        return OldLogprobs(stats.logprobs[own], None if stats.sum_pi_squared is None else stats.sum_pi_squared[own],
                           None if weights is None else weights[own], None if keep_mask is None else keep_mask[own],
                           corrected.metrics)

    def rollout_correction(self, batch: TrainBatch, old_logprobs: torch.Tensor) -> CorrectedRollout:
        """Importance weights and rejection between the rollout engine and the trainer
        (``correct_rollout``), once per step, from the old-logprob forward's ``old_logprobs``; without
        that forward (fully on-policy) the loss computes the weights from its own forward.

        The mismatch metrics are always measured, so a drifting engine is visible before correction
        is turned on. Normalised over the whole batch, as verl's driver does: every rank holds a
        shard, so the mean's sum and count are summed over the ranks (Ulysses groups count each
        shard sp times in both, which leaves the mean as it is)."""
        return correct_rollout(self.correction, old_logprobs=old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                               response_mask=batch.response_mask, sum_over_ranks=distributed.all_reduce_sum)

    def _old_policy_forward(self, batch: TrainBatch, with_sum_pi_squared: bool) -> TokenStats:
        # Sequence parallel: the group computes its pooled shards; each rank returns its own rows.
        batch, own = gather_group_batch(resolve_batch(batch), self.engine.sp_group)
        stats = self._token_stats(batch, with_sum_pi_squared)
        return TokenStats(*(None if x is None else x[own] for x in stats))

    def _token_stats(self, batch: TrainBatch, with_sum_pi_squared: bool) -> TokenStats:
        return self.engine.compute_token_stats(
            batch, temperature=self.setup.temperature, micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
            use_remove_padding=self.plan.use_remove_padding, max_token_len=self.plan.log_prob_max_token_len,
            with_sum_pi_squared=with_sum_pi_squared,
        )

    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches over this rank's shard (its Ulysses group's
        pooled shards); metrics averaged. Token counts are summed over every rank (a group's
        sp times) and the loss scaled by the world size: ``hybridflow.training.sequence_parallel``
        says why that trains like one rank."""
        release_free_heap(self.engine.device)  # what generation's thread freed: the update cannot reuse it
        metrics = (self._update_on_pairs(batch, self.setup.preference) if self.setup.preference is not None
                   else self._update_on_samples(batch))
        release_free_heap(self.engine.device)  # not resident through the generation that follows
        return metrics

    def _update_on_samples(self, batch: TrainBatch) -> dict[str, float]:
        cfg = self.cfg
        batch, _ = gather_group_batch(resolve_batch(batch), self.engine.sp_group)
        if batch.rollout_keep_mask is not None:
            # Rollout rejection (computed with the old logprobs): rejected tokens leave the loss and
            # its normaliser; advantages are unchanged. The IS weights are on the batch already.
            batch = dataclasses.replace(batch, response_mask=batch.rollout_keep_mask)
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
        return metrics

    def _update_on_pairs(self, batch: TrainBatch, spec: DPOLossSpec) -> dict[str, float]:
        """Online DPO (``actor.loss=dpo``): this rank's share of the step's pairs (its k chosen rows, then
        their k rejected rows, each row's ``group_ids`` entry its row in the share: ``prepare_pair_batch``),
        ``actor.ppo_epochs`` optimizer steps over all of them with the preference loss of
        ``hybridflow.algorithms.preference``, a pair's two sides always in one micro-batch. Metrics: TRL's
        (``rewards/*``, ``logps/*``), ``actor/dpo_loss`` and ``actor/entropy``, means over the pairs (and their
        tokens) of every rank; a padding pair (``PairLayout``: a short share filled up) weighs nothing."""
        batch = resolve_batch(batch)
        num_pairs = batch.batch_size // 2
        counted = pair_row_weights(batch, num_pairs)
        own = [float(counted[:num_pairs].sum()), float((batch.response_mask * counted[:, None]).sum())]
        total_pairs, total_tokens = distributed.all_reduce_sum(own)
        step_metrics: list[dict[str, float]] = []
        for _epoch in range(self.cfg.ppo_epochs):
            parts = cut_pairs(batch, num_pairs, self.plan, self.cfg.ppo_micro_batch_size_per_gpu,
                              self.engine.data_parallel, "data.max_response_length")
            skipped_before = self.engine.skipped_steps
            step_metrics.append(self.engine.optimizer_step(
                parts, self._pair_loss_fn(spec, num_pairs, total_pairs, len(parts), total_tokens),
                temperature=self.setup.temperature, with_entropy=True, use_remove_padding=self.plan.use_remove_padding,
            ))
            self._count_skip(skipped=self.engine.skipped_steps > skipped_before)
        metrics = {k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}
        metrics["actor/skipped_steps"] = float(self.engine.skipped_steps)
        return metrics

    def _pair_loss_fn(self, spec: DPOLossSpec, num_pairs: int, total_pairs: float, num_micro: int,
                      total_tokens: float):
        """The loss of a micro-batch of this rank's ``num_pairs``: its share of the mean over the ``total_pairs``
        pairs of every rank (``total_tokens``: their response tokens, for the entropy)."""
        world = self.world_size

        def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
            k = whole_pairs(mb, num_pairs)
            rows = pair_row_weights(mb, k)  # (2k,) 0 on a padding pair's rows
            counted = rows[:k]
            mask = mb.response_mask
            seq = sequence_logps(logprobs, mask)  # (2k,) chosen sides, then rejected sides
            ref_chosen = ref_rejected = None
            if not spec.reference_free:
                if mb.ref_logprobs is None:
                    raise ValueError("actor.loss=dpo needs the reference's logprobs on the batch "
                                     "(or algorithm.online_dpo.reference_free=true)")
                ref = sequence_logps(mb.ref_logprobs, mask)
                ref_chosen, ref_rejected = ref[:k], ref[k:]
            lengths = mask.sum(dim=-1)
            loss, pair_metrics = preference_loss(
                seq[:k], seq[k:], ref_chosen, ref_rejected, loss_type=spec.loss_type, beta=spec.beta,
                label_smoothing=spec.label_smoothing, chosen_lengths=lengths[:k], rejected_lengths=lengths[k:],
            )
            # The step's mean over the pairs of every rank; x world: FSDP averages gradients over ranks.
            total = (loss * counted).sum() / total_pairs * world
            # This micro-batch's share of that mean, x the counts the engine (micro-batches) and the
            # controller (ranks) average over.
            scale = num_micro * world / total_pairs
            metrics = {name: float((v * counted).sum()) * scale for name, v in pair_metrics.items()}
            metrics["actor/dpo_loss"] = float((loss.detach() * counted).sum()) * scale
            if entropy is not None:
                entropy_mean = (entropy.detach() * mask * rows[:, None]).sum() / max(total_tokens, 1.0)
                metrics["actor/entropy"] = float(entropy_mean) * num_micro * world
            return total, metrics

        return loss_fn

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
                correction = correct_rollout(self.correction, old_logprobs=old, rollout_logprobs=mb.rollout_logprobs,
                                             response_mask=mask, weights_only=True)
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
        payload = weights_on_every_rank(self, adapter=True)  # the same gather; rank 0 keeps it
        return payload if self.rank == 0 else []

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


def weights_on_every_rank(actor: ActorWorker, adapter: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``ActorWorker.weights_for_sync`` (``adapter``: ``adapter_for_sync``) with the full tensors on
    every rank, not only rank 0 (each shard all-gathered): each rank hands them to the rollout replica
    in its own process (``trainer.hybrid_engine``). One rank: the model's own tensors, uncopied.
    Collective: every rank calls it (from a call of its own group's, beside the rollout's worker)."""
    shards = actor.engine.named_weight_shards()
    if adapter:
        if actor.lora is None:
            raise RuntimeError("an adapter sync needs actor.lora.rank > 0")
        return adapter_payload(actor.lora, {n: distributed.gather_weight(t).detach()
                                            for n, t in actor.lora.adapters(shards).items()})
    named = [(name, distributed.gather_weight(t).detach()) for name, t in shards]
    return named if actor.lora is None else actor.lora.merged_weights(named)
