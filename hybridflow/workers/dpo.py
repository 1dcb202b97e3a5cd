"""One rank of ``hybridflow dpo``: the SFT rank's engine (``SFTWorker``: precision, LoRA, FSDP2,
packing, token budgets, checkpoints) trained on preference pairs with ``algorithms.preference``.

A pair's loss needs both of its sides' log-probabilities, so micro-batches are cut by pairs, never
between a pair's two rows (``hybridflow.workers.pair_batches``, shared with ``hybridflow rm``). Each
row's ``group_ids`` entry is its row in the step's batch, so the loss finds a micro-batch's reference
log-probabilities however the rows were grouped.

The reference is frozen: its sequence log-probabilities are computed once, by this engine before it
takes a step (the starting weights are the reference), and kept for the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridflow.algorithms.preference import (
    PREFERENCE_METRICS,
    chosen_nll,
    preference_loss,
    sequence_logps,
)
from hybridflow.data.preference import PreferencePair
from hybridflow.training import distributed
from hybridflow.types import TrainBatch
from hybridflow.workers.pair_batches import pair_micro_batches, pair_step_batch, pair_values, whole_pairs
from hybridflow.workers.sft import SFTWorker


@dataclass(frozen=True)
class DPOLossSpec:
    loss_type: str
    beta: float
    label_smoothing: float
    reference_free: bool
    sft_weight: float = 0.0


class DPOWorker:
    def __init__(self, sft: SFTWorker, spec: DPOLossSpec, pad_token_id: int) -> None:
        self.sft, self.spec, self.pad_token_id = sft, spec, pad_token_id
        self.engine = sft.engine

    # ------------------------------------------------------------------ sequence log-probabilities
    def sequence_logps(self, pairs: Sequence[PreferencePair]) -> torch.Tensor:
        """(chosen, rejected) summed log-probabilities of every pair under the current weights, over all
        ranks (a collective, ``pair_values``).  # (N, 2)"""

        def side_logps(batch: TrainBatch) -> torch.Tensor:
            logprobs, _ = self.engine.compute_logprobs(
                batch, temperature=1.0, micro_batch_size=self.sft.cfg.actor.log_prob_micro_batch_size_per_gpu,
                use_remove_padding=self.sft.plan.use_remove_padding,
                max_token_len=self.sft.plan.log_prob_max_token_len,
            )
            return sequence_logps(logprobs.double(), batch.response_mask)

        return pair_values(self.sft, pairs, self.pad_token_id, side_logps)

    def reference_logps(self, pairs: Sequence[PreferencePair]) -> torch.Tensor:
        """The frozen reference's (chosen, rejected) log-probabilities: the current (starting) weights',
        or zeros when reference-free.  # (N, 2)"""
        if self.spec.reference_free:
            return torch.zeros(len(pairs), 2, dtype=torch.float64)
        return self.sequence_logps(pairs)

    # ------------------------------------------------------------------ training
    def micro_batches(self, batch: TrainBatch, num_pairs: int) -> list[TrainBatch]:
        """This rank's step batch (``num_pairs`` chosen rows, then as many rejected) cut by pairs."""
        return pair_micro_batches(self.sft, batch, num_pairs, "dpo.max_length")

    def train_step(self, pairs: Sequence[PreferencePair], ref: torch.Tensor, total_pairs: int) -> dict[str, float]:
        """One optimizer step on this rank's ``pairs`` (``ref``: their reference log-probabilities, (n, 2));
        ``total_pairs``: the step's pairs over every rank. Metrics: ``dpo/<name>_share``, this rank's part of
        the step's mean of each (sum them over ranks), and the engine's ``train/grad_norm``, ``train/lr``."""
        n = len(pairs)
        batch = pair_step_batch(pairs, self.pad_token_id)
        parts = self.micro_batches(batch, n)
        # The SFT term's token mean is over the step's chosen tokens on every rank.
        chosen_tokens = distributed.all_reduce_sum([float(sum(sum(p.chosen.loss_mask) for p in pairs))])[0]
        loss_fn = self._loss_fn(ref, n, total_pairs, len(parts), chosen_tokens)
        return self.engine.optimizer_step(parts, loss_fn, temperature=1.0, with_entropy=False,
                                          use_remove_padding=self.sft.plan.use_remove_padding)

    def _loss_fn(self, ref: torch.Tensor, num_pairs: int, total_pairs: int, num_micro_batches: int,
                 chosen_tokens: float):
        world, weight = self.sft.world, self.spec.sft_weight

        def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
            loss, metrics = self._pair_losses(mb, logprobs, ref.to(logprobs.device), num_pairs)
            # Summed over the step's pairs on every rank, then x world: FSDP averages gradients over ranks.
            total = loss.sum() / total_pairs * world
            scale = num_micro_batches / total_pairs  # the engine averages micro-batches; ranks are summed
            shares = {f"dpo/{k}_share": float(v.sum()) * scale for k, v in metrics.items()}
            shares["dpo/loss_share"] = float(loss.detach().sum()) * scale
            if weight > 0:
                k = mb.batch_size // 2
                nll = chosen_nll(logprobs[:k], mb.response_mask[:k]).sum() / max(chosen_tokens, 1.0)
                total = total + weight * nll * world
                shares["dpo/loss_share"] += weight * float(nll.detach()) * num_micro_batches
            return total, shares

        return loss_fn

    def _pair_losses(self, mb: TrainBatch, logprobs: torch.Tensor, ref: torch.Tensor, num_pairs: int):
        """Per-pair losses and metrics of a micro-batch holding k chosen rows, then their k rejected rows."""
        k = whole_pairs(mb, num_pairs)
        rows = mb.group_ids
        seq = sequence_logps(logprobs, mb.response_mask)  # (2k,)
        lengths = mb.response_mask.sum(dim=-1)
        pair_ref = ref[rows[:k]].to(seq.dtype)  # (k, 2)
        free = self.spec.reference_free
        return preference_loss(
            seq[:k], seq[k:], None if free else pair_ref[:, 0], None if free else pair_ref[:, 1],
            loss_type=self.spec.loss_type, beta=self.spec.beta, label_smoothing=self.spec.label_smoothing,
            chosen_lengths=lengths[:k], rejected_lengths=lengths[k:],
        )

    # ------------------------------------------------------------------ validation
    def evaluate(self, pairs: Sequence[PreferencePair], ref: torch.Tensor) -> dict[str, float]:
        """The loss and metrics over ``pairs`` under the current weights (a collective): means over pairs."""
        logps = self.sequence_logps(pairs)
        lengths = torch.tensor([[sum(p.chosen.loss_mask), sum(p.rejected.loss_mask)] for p in pairs],
                               dtype=torch.float64)
        free = self.spec.reference_free
        loss, metrics = preference_loss(
            logps[:, 0], logps[:, 1], None if free else ref[:, 0], None if free else ref[:, 1],
            loss_type=self.spec.loss_type, beta=self.spec.beta, label_smoothing=self.spec.label_smoothing,
            chosen_lengths=lengths[:, 0], rejected_lengths=lengths[:, 1],
        )
        out = {name: float(metrics[name].mean()) for name in PREFERENCE_METRICS}
        out["loss"] = float(loss.mean()) + self.spec.sft_weight * float(-logps[:, 0].sum() / lengths[:, 0].sum())
        return out


__all__ = ["DPOLossSpec", "DPOWorker"]
