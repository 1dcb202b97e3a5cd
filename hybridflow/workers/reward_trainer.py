"""One rank of ``hybridflow rm``: a reward model (a one-label sequence classifier) trained on
preference pairs with the Bradley-Terry loss (``algorithms.preference.bradley_terry_loss``).

It scores exactly as the reward-model role scores a run's answers (``hybridflow.workers.reward_model``):
each side is the prompt's chat messages plus the response as the assistant's turn, rendered with the
reward model's own chat template and cut from the start past the length (``render_ids``), and its score
is the head on the last token (``hybridflow.models.scoring``, the engine's ``output="scores"``). So the
exported model serves the function it was trained as.

The engine is the SFT rank's (``SFTWorker``: precision, FSDP2, packing, token budgets, checkpoints)
built around the classifier; pairs are batched and cut as DPO's are (``hybridflow.workers.pair_batches``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.algorithms.preference import REWARD_MODEL_METRICS, bradley_terry_loss
from hybridflow.data.preference import PreferencePair
from hybridflow.types import TrainBatch, Trajectory
from hybridflow.workers.pair_batches import pair_micro_batches, pair_step_batch, pair_values, whole_pairs
from hybridflow.workers.reward_model import render_ids
from hybridflow.workers.sft import SFTWorker

Message = dict[str, str]


def _scored_side(tokenizer: Any, prompt: list[Message], turns: list[Message], max_length: int) -> tuple[Trajectory, bool]:
    """One side as the reward model reads it: the whole rendered chat is the row (there is no response
    to predict, only a last token to score), and whether it was cut."""
    messages = [*prompt, *turns[:-1]]  # earlier assistant turns of a multi-turn response are context
    ids, cut = render_ids(tokenizer, messages, turns[-1]["content"], max_length)
    return Trajectory(prompt_ids=ids, response_ids=[], loss_mask=[], rollout_logprobs=[], finish_reason="stop"), cut


def reward_model_pair(tokenizer: Any, prompt: list[Message], chosen: list[Message], rejected: list[Message],
                      max_length: int | None, template_kwargs: Mapping[str, Any] | None = None,
                      ) -> tuple[PreferencePair | None, bool]:
    """A pair as the reward model scores it (``data.preference.PairMaker``). ``template_kwargs`` is not
    used: the reward-model role renders without them, and training must render as it does."""
    if max_length is None:
        raise ValueError("a reward model's pair needs a max_length (the role's: reward_model.max_length)")
    a, cut_a = _scored_side(tokenizer, prompt, chosen, max_length)
    b, cut_b = _scored_side(tokenizer, prompt, rejected, max_length)
    return PreferencePair(a, b), cut_a or cut_b


class RewardTrainerWorker:
    def __init__(self, sft: SFTWorker, center_coefficient: float, pad_token_id: int) -> None:
        self.sft, self.center_coefficient, self.pad_token_id = sft, center_coefficient, pad_token_id
        self.engine = sft.engine

    def scores(self, pairs: Sequence[PreferencePair]) -> torch.Tensor:
        """(chosen, rejected) scores of every pair under the current weights, over all ranks (a collective).  # (N, 2)"""

        def side_scores(batch: TrainBatch) -> torch.Tensor:
            return self.engine.compute_head_outputs(
                batch, "scores", micro_batch_size=self.sft.cfg.actor.log_prob_micro_batch_size_per_gpu,
                use_remove_padding=self.sft.plan.use_remove_padding, max_token_len=self.sft.plan.log_prob_max_token_len,
            )

        return pair_values(self.sft, pairs, self.pad_token_id, side_scores)

    def train_step(self, pairs: Sequence[PreferencePair], total_pairs: int) -> dict[str, float]:
        """One optimizer step on this rank's ``pairs``; ``total_pairs``: the step's pairs over every rank.
        Metrics: ``rm/<name>_share`` and ``loss_share``, this rank's part of the step's mean of each (sum
        them over ranks), and the engine's ``train/grad_norm``, ``train/lr``."""
        n = len(pairs)
        parts = pair_micro_batches(self.sft, pair_step_batch(pairs, self.pad_token_id), n, "rm.max_length")
        world, num_micro = self.sft.world, len(parts)

        def loss_fn(mb: TrainBatch, scores: torch.Tensor, _entropy: torch.Tensor | None):
            k = whole_pairs(mb, n)
            loss, metrics = bradley_terry_loss(scores[:k], scores[k:], center_coefficient=self.center_coefficient)
            # Summed over the step's pairs on every rank, then x world: FSDP averages gradients over ranks.
            total = loss.sum() / total_pairs * world
            scale = num_micro / total_pairs  # the engine averages micro-batches; ranks are summed
            shares = {f"{name}_share": float(metrics[name].sum()) * scale for name in REWARD_MODEL_METRICS}
            shares["loss_share"] = float(loss.detach().sum()) * scale
            return total, shares

        return self.engine.optimizer_step(parts, loss_fn, temperature=1.0, with_entropy=False,
                                          use_remove_padding=self.sft.plan.use_remove_padding, output="scores")

    def evaluate(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """``loss`` and the ``rm/*`` metrics over ``pairs`` under the current weights (a collective): means over pairs."""
        scores = self.scores(pairs)
        loss, metrics = bradley_terry_loss(scores[:, 0], scores[:, 1], center_coefficient=self.center_coefficient)
        return {"loss": float(loss.mean()), **{name: float(metrics[name].mean()) for name in REWARD_MODEL_METRICS}}


__all__ = ["RewardTrainerWorker", "reward_model_pair"]
