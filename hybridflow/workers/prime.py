"""PRIME's implicit process reward model as a role: a causal LM φ trained online beside the policy
(``hybridflow.algorithms.prime``; docs/algorithms.md, "PRIME").

It is built from the critic's pieces: the same training engine (FSDP2 over its ranks, precision rules, packing),
its own optimizer and schedule (``prime.optim``), and the same checkpoint format (``<checkpoint>/prime/``). What
differs is the head and the loss: φ is a plain causal LM, read for the logprobs of the sampled tokens (at
temperature 1: the implicit reward is a log-ratio of the model's own probabilities), and trained with the
cross-entropy of σ(Σ_t r_t) against the outcome label.

Each call gets the batch with ``ref_logprobs`` set to the PRM's reference's logprobs (its frozen starting
weights, from the run's reference role or from the PRM's own reference group) and ``rewards`` the outcome
scores; the worker labels them itself (``prime.label_threshold``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.algorithms.prime import (
    compute_implicit_token_rewards,
    implicit_prm_accuracy,
    implicit_prm_loss,
    outcome_labels,
)
from hybridflow.config.schema import PrimeConfig
from hybridflow.data.plane import resolve_batch
from hybridflow.models.loading import load_causal_lm, load_tokenizer
from hybridflow.training import distributed
from hybridflow.training.distributed import collective
from hybridflow.training.engine import LossFn
from hybridflow.training.micro_batches import train_micro_batches
from hybridflow.types import TrainBatch
from hybridflow.workers.checkpoints import load_engine_checkpoint, sharded_checkpoints
from hybridflow.workers.engine_setup import RoleBatching, TrainedRoleSetup, load_trained_role

log = logging.getLogger(__name__)

PRM_TEMPERATURE = 1.0  # the implicit reward is log φ − log ref of the models' own probabilities


@dataclass(kw_only=True)
class PrimeSetup(TrainedRoleSetup):
    """The run-level facts the implicit PRM needs beyond its ``prime`` section (``total_optimizer_steps``: one per
    training step)."""

    # The actor's micro-batch keys: actor.use_remove_padding (packed forwards where the model has them), and
    # actor.use_dynamic_bsz with the actor's token budgets as the run uses them (recorded with the run, so a resume
    # cuts the PRM's micro-batches alike); without it, prime.micro_batch_size_per_gpu samples per micro-batch.
    batching: RoleBatching = RoleBatching(use_remove_padding=True, use_dynamic_bsz=False, ppo_max_token_len=None,
                                          log_prob_max_token_len=None)


class ImplicitPRMWorker:
    def __init__(self, rank: int, world_size: int, cfg: PrimeConfig, setup: PrimeSetup) -> None:
        self.rank, self.world_size = rank, world_size
        self.cfg, self.setup = cfg, setup
        self.engine, self.plan = load_trained_role("prime", rank, world_size, cfg, setup, load_causal_lm,
                                                   setup.batching)
        self.tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code)

    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:  # (B, R)
        logprobs, _ = self.engine.compute_logprobs(
            batch, temperature=PRM_TEMPERATURE, micro_batch_size=self.cfg.micro_batch_size_per_gpu,
            use_remove_padding=self.plan.use_remove_padding, max_token_len=self.plan.log_prob_max_token_len,
        )
        return logprobs

    def compute_token_rewards(self, batch: TrainBatch) -> torch.Tensor:  # (B, R)
        """r_t = β·(log φ − log ref) of every response token under the current weights (``batch.ref_logprobs``:
        the reference's)."""
        batch = resolve_batch(batch)
        return compute_implicit_token_rewards(self._logprobs(batch), _reference(batch), batch.response_mask,
                                              self.cfg.beta)

    def update_prm(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard: the cross-entropy summed over the step's samples on every
        rank and divided by their count (FSDP2 averages the ranks' gradients, hence x world size). Metrics: the
        engine's ``prime/grad_norm`` and ``prime/lr``, and ``prime/loss`` and ``prime/acc``, the loss and the
        accuracy on the outcome labels of the step's samples before the PRM trained on them (each rank reports its
        part scaled so that the mean over ranks is the step's)."""
        batch = resolve_batch(batch)
        _reference(batch)
        micro_batches = train_micro_batches(self.engine, self.plan, batch, self.cfg.micro_batch_size_per_gpu)
        total = self._step_samples(batch)
        return self.engine.optimizer_step(micro_batches, self._loss_fn(total, len(micro_batches)),
                                          temperature=PRM_TEMPERATURE, with_entropy=False,
                                          use_remove_padding=self.plan.use_remove_padding)

    def _step_samples(self, batch: TrainBatch) -> int:
        """The step's samples over every rank (each rank holds an equal shard)."""
        return int(distributed.all_reduce_sum([float(batch.batch_size)])[0]) if self.world_size > 1 else batch.batch_size

    def _loss_fn(self, total: int, num_micro: int) -> LossFn:
        beta, threshold, world = self.cfg.beta, self.cfg.label_threshold, self.world_size

        def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, _entropy: torch.Tensor | None):
            assert mb.ref_logprobs is not None
            labels = outcome_labels(mb.rewards, threshold).to(logprobs.device)
            loss, sequence = implicit_prm_loss(logprobs, mb.ref_logprobs.to(logprobs.dtype), mb.response_mask,
                                               labels, beta)
            summed = loss.sum()
            # The engine averages metrics over micro-batches and the controller over ranks: x num_micro x world
            # / total makes that mean the step's.
            share = num_micro * world / total
            correct = implicit_prm_accuracy(sequence, labels) * mb.batch_size
            return summed / total * world, {"prime/loss": float(summed.detach()) * share,
                                            "prime/acc": correct * share}

        return loss_fn

    # ------------------------------------------------------------------ IO
    @collective
    def save_checkpoint(self, out_dir: str) -> None:
        """The PRM (a Hugging Face causal-LM directory, or its shards) and its optimizer, in
        ``trainer.checkpoint_format``."""
        sharded = sharded_checkpoints(self.setup.checkpoint_format, self.world_size)
        self.engine.save(Path(out_dir), tokenizer=self.tokenizer, sharded=sharded)

    @collective
    def load_checkpoint(self, ckpt_dir: str) -> str | None:
        """Load the checkpoint the PRM saved in ``ckpt_dir`` (``load_engine_checkpoint``)."""
        return load_engine_checkpoint(self.engine, Path(ckpt_dir), "prime")


def _reference(batch: TrainBatch) -> torch.Tensor:
    if batch.ref_logprobs is None:
        raise ValueError("the implicit PRM needs batch.ref_logprobs: its reference's logprobs of the response tokens")
    return batch.ref_logprobs


__all__ = ["ImplicitPRMWorker", "PrimeSetup", "PRM_TEMPERATURE"]
