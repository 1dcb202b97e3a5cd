"""The actor role: the policy being trained. Computes logprobs and runs PPO-style updates.

A thin adapter from controller calls to the training engine and the algorithm registries; it
never decides what happens next.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.algorithms import agg_loss, batch_counts, get_policy_loss, kl_penalty
from hybridflow.config.schema import ActorConfig
from hybridflow.models.loading import load_causal_lm, load_tokenizer
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch
from hybridflow.utils.device import parse_dtype


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


class ActorWorker:
    def __init__(self, rank: int, world_size: int, cfg: ActorConfig, setup: ActorSetup) -> None:
        if world_size != 1:
            # Data-parallel gradient reduction arrives with the FSDP2 engine (issue 4).
            raise NotImplementedError("the in-process actor supports one rank; multi-rank needs trainer.backend=ray")
        self.rank, self.world_size = rank, world_size
        self.cfg, self.setup = cfg, setup
        self.tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code)
        model = load_causal_lm(
            setup.model_path,
            dtype=parse_dtype(setup.dtype),
            device=setup.device,
            trust_remote_code=setup.trust_remote_code,
        )
        if setup.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        o = cfg.optim
        self.engine = TrainEngine(
            model,
            OptimSpec(
                lr=o.lr,
                weight_decay=o.weight_decay,
                betas=(o.betas[0], o.betas[1]),
                warmup_steps=o.lr_warmup_steps,
                scheduler=o.lr_scheduler_type,
                min_lr_ratio=o.min_lr_ratio,
                total_steps=setup.total_optimizer_steps,
                grad_clip=cfg.grad_clip,
            ),
            setup.device,
        )
        self.policy_loss = get_policy_loss(cfg.policy_loss.loss_mode)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprobs of the response tokens under the current weights (old_logprobs).  # (B, R)"""
        logprobs, _ = self.engine.compute_logprobs(
            batch, temperature=self.setup.temperature, micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu
        )
        return logprobs

    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches over this rank's shard; metrics averaged."""
        cfg = self.cfg
        mini_size = cfg.ppo_mini_batch_size * self.setup.rollout_n // self.world_size
        # Shuffle order varies per update but is restored by a resume: it is seeded by the LR
        # scheduler's step count, which the checkpoint carries.
        assert self.engine.scheduler is not None
        generator = torch.Generator().manual_seed(int(self.engine.scheduler.last_epoch))
        step_metrics: list[dict[str, float]] = []
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(batch.batch_size, generator=generator) if cfg.shuffle else torch.arange(batch.batch_size)
            for start in range(0, batch.batch_size, mini_size):
                mini = batch.select(order[start : start + mini_size])
                micro_batches = mini.split(cfg.ppo_micro_batch_size_per_gpu)
                # Normalise by the whole mini-batch so accumulation over micro-batches (and, with
                # several ranks, the gradient average) reproduces the full-batch loss exactly.
                num_tokens, num_seqs = batch_counts(mini.response_mask)
                step_metrics.append(
                    self.engine.optimizer_step(
                        micro_batches,
                        self._loss_fn(num_tokens, num_seqs),
                        temperature=self.setup.temperature,
                        with_entropy=True,
                    )
                )
        metrics = {k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}
        metrics["actor/skipped_steps"] = float(self.engine.skipped_steps)
        return metrics

    def _loss_fn(self, num_tokens: int, num_seqs: int):
        cfg = self.cfg
        low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
        high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
        scale = cfg.loss_scale_factor if cfg.loss_scale_factor is not None else float(self.setup.max_response_length)
        pl = cfg.policy_loss
        # Every loss takes the same keywords and ignores the ones that are not its own.
        mode_kwargs = dict(tau_pos=pl.tau_pos, tau_neg=pl.tau_neg, clip_cov_ratio=pl.clip_cov_ratio,
                           clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                           kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef)
        agg = dict(
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            loss_scale_factor=scale,
            dp_size=self.world_size,
        )

        def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
            if mb.advantages is None:
                raise ValueError("update_actor needs advantages on the batch")
            mask = mb.response_mask
            # Fully on-policy (one optimizer step per rollout batch) the old policy *is* the
            # current one, so the controller may skip the extra forward and we detach here.
            old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
            pg_loss, metrics = self.policy_loss(
                old_logprobs=old,
                logprobs=logprobs,
                advantages=mb.advantages,
                response_mask=mask,
                clip_ratio_low=low,
                clip_ratio_high=high,
                clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode,
                **mode_kwargs,
                **agg,
            )
            loss = pg_loss
            with torch.no_grad():
                # Logged values are per-micro-batch, locally normalised, and averaged by the
                # engine; the loss above is the globally normalised one.
                local_pg, _ = self.policy_loss(
                    old_logprobs=old, logprobs=logprobs.detach(), advantages=mb.advantages, response_mask=mask,
                    clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cfg.clip_ratio_c,
                    loss_agg_mode=cfg.loss_agg_mode, loss_scale_factor=scale, **mode_kwargs,
                )
                metrics["actor/pg_loss"] = float(local_pg)
            if entropy is not None:
                metrics["actor/entropy"] = float(agg_loss(entropy.detach(), mask, "token-mean"))
                if cfg.entropy_coeff != 0:
                    loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
            if cfg.use_kl_loss:
                if mb.ref_logprobs is None:
                    raise ValueError("actor.use_kl_loss=true but the batch has no reference logprobs")
                kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_loss_type)
                loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
                metrics["actor/kl_loss"] = float(agg_loss(kl.detach(), mask, "token-mean"))
                metrics["actor/kl_coef"] = cfg.kl_loss_coef
            return loss, metrics

        return loss_fn

    # ------------------------------------------------------------ weights / IO
    def weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.engine.named_weights()

    def save_checkpoint(self, out_dir: str) -> None:
        self.engine.save(Path(out_dir), tokenizer=self.tokenizer)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        self.engine.load(Path(ckpt_dir))

