"""The critic role: a value model V(s_t) trained alongside the policy, for PPO with GAE.

The value model is the causal LM's backbone with a scalar head per token
(``hybridflow.models.loading.load_value_model``), loaded from ``critic.model.path`` (the policy's
weights by default). ``compute_values`` gives the value of each response token, read where the
token's logprob is read (the hidden state at P+t-1); ``update_critic`` regresses them onto the
estimator's returns with PPO's clipped value loss.

It shares the actor's machinery rather than copying it: the same training engine (FSDP2 with
several ranks, packing, token-budget micro-batches agreed over ranks), the same precision rules,
the same global loss normalisation (N ranks train exactly like one rank on the same global
batch), and the same checkpoint formats (``<checkpoint>/critic/``, like ``actor/``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.algorithms import batch_counts
from hybridflow.algorithms.value import compute_value_loss
from hybridflow.config.schema import CriticConfig
from hybridflow.data.plane import resolve_batch
from hybridflow.models.loading import load_tokenizer, load_value_model
from hybridflow.training import distributed
from hybridflow.training.distributed import collective
from hybridflow.training.engine import LossFn
from hybridflow.training.micro_batches import train_micro_batches
from hybridflow.training.sequence_parallel import gather_group_batch
from hybridflow.types import TrainBatch
from hybridflow.workers.checkpoints import load_engine_checkpoint, sharded_checkpoints
from hybridflow.workers.engine_setup import RoleBatching, TrainedRoleSetup, load_trained_role

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CriticSetup(TrainedRoleSetup):
    """The run-level facts a critic needs beyond its own config section (``total_optimizer_steps``: one per
    mini-batch and epoch)."""

    rollout_n: int
    ppo_mini_batch_size: int  # prompts; critic.ppo_mini_batch_size resolved
    ppo_epochs: int  # critic.ppo_epochs resolved


class CriticWorker:
    def __init__(self, rank: int, world_size: int, cfg: CriticConfig, setup: CriticSetup) -> None:
        self.rank, self.world_size = rank, world_size
        self.cfg, self.setup = cfg, setup
        batching = RoleBatching(cfg.use_remove_padding, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu,
                                cfg.forward_max_token_len_per_gpu, remove_padding_key="critic.use_remove_padding")
        self.engine, self.plan = load_trained_role(
            "critic", rank, world_size, cfg, setup, load_value_model, batching,
            sequence_parallel_size=cfg.ulysses_sequence_parallel_size,
        )
        self.tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code)
        self.data_parallel_size = world_size // cfg.ulysses_sequence_parallel_size  # as the actor's
        if rank == 0:
            for note in self.plan.notes:
                log.info("critic: %s", note)

    def token_budgets(self) -> tuple[int | None, int | None]:
        """This rank's (update, forward) token budgets per rank: the run folder records derived ones."""
        return self.plan.per_rank_budgets(self.cfg.ulysses_sequence_parallel_size)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """V(s_t) of every response token under the current weights (the rollout's values).  # (B, R)"""
        batch, own = gather_group_batch(resolve_batch(batch), self.engine.sp_group)  # as the actor's logprob pass
        return self.engine.compute_head_outputs(
            batch, "values", micro_batch_size=self.cfg.forward_micro_batch_size_per_gpu,
            use_remove_padding=self.plan.use_remove_padding, max_token_len=self.plan.log_prob_max_token_len,
        )[own]

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches of the clipped value loss over this rank's
        shard, regressing onto ``batch.returns`` around ``batch.values``; metrics averaged."""
        if batch.values is None or batch.returns is None:
            raise ValueError("update_critic needs the batch's values (compute_values) and returns (the estimator)")
        batch, _ = gather_group_batch(resolve_batch(batch), self.engine.sp_group)  # as the actor's update
        mini_size = self.setup.ppo_mini_batch_size * self.setup.rollout_n // self.data_parallel_size
        # As the actor's: the shuffle order is seeded by the schedule's step count, which
        # checkpoints carry, so a resumed run shuffles alike.
        assert self.engine.scheduler is not None
        generator = torch.Generator().manual_seed(int(self.engine.scheduler.last_epoch))
        step_metrics: list[dict[str, float]] = []
        for _epoch in range(self.setup.ppo_epochs):
            order = (torch.randperm(batch.batch_size, generator=generator) if self.cfg.shuffle
                     else torch.arange(batch.batch_size))
            for start in range(0, batch.batch_size, mini_size):
                mini = batch.select(order[start : start + mini_size])
                micro_batches = train_micro_batches(self.engine, self.plan, mini, self.cfg.ppo_micro_batch_size_per_gpu)
                # Normalised by the whole mini-batch over every rank, as the actor's loss.
                num_tokens, num_seqs = (int(c) for c in distributed.all_reduce_sum(batch_counts(mini.response_mask)))
                step_metrics.append(self.engine.optimizer_step(
                    micro_batches, self._loss_fn(num_tokens, num_seqs, len(micro_batches)),
                    temperature=1.0, with_entropy=False, use_remove_padding=self.plan.use_remove_padding,
                    output="values",
                ))
        return {k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}

    def _loss_fn(self, num_tokens: int, num_seqs: int, num_micro: int) -> LossFn:
        cfg = self.cfg

        def loss_fn(mb: TrainBatch, vpreds: torch.Tensor, _entropy: torch.Tensor | None):
            assert mb.values is not None and mb.returns is not None
            loss, metrics = compute_value_loss(
                vpreds, mb.returns, mb.values, mb.response_mask,
                cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
                global_num_tokens=num_tokens, global_num_seqs=num_seqs,
                loss_scale_factor=float(self.setup.max_response_length), dp_size=self.world_size,
            )
            # Each micro-batch's loss is its share of the mini-batch loss; share x count averages
            # (over micro-batches, then ranks) to the mini-batch's value loss.
            metrics["critic/vf_loss"] = float(loss.detach()) * num_micro
            return loss, metrics

        return loss_fn

    # ------------------------------------------------------------------ IO
    @collective
    def save_checkpoint(self, out_dir: str) -> None:
        """The value model (a Hugging Face token-classification directory, or its shards) and its
        optimizer, in ``trainer.checkpoint_format``."""
        sharded = sharded_checkpoints(self.setup.checkpoint_format, self.world_size)
        self.engine.save(Path(out_dir), tokenizer=self.tokenizer, sharded=sharded)

    @collective
    def load_checkpoint(self, ckpt_dir: str) -> str | None:
        """Load the checkpoint the critic saved in ``ckpt_dir`` (``load_engine_checkpoint``)."""
        return load_engine_checkpoint(self.engine, Path(ckpt_dir), "critic")
