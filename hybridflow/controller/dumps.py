"""What a run writes of its samples besides metrics: each step's to ``trainer.rollout_data_dir``,
each validation's to ``trainer.validation_data_dir``, and ``trainer.log_val_generations`` of them
to the loggers. Bounded by ``trainer.dump_max_samples`` and ``trainer.dump_max_chars`` (see
``hybridflow.tracking.generations``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hybridflow.algorithms import masked_mean
from hybridflow.data.plane import fetch_trajectories
from hybridflow.tracking import Tracker
from hybridflow.tracking.generations import (
    DUMP_MAX_LOGPROBS,
    clip_text,
    pick_val_generations,
    rollout_rows,
    validation_rows,
    write_jsonl,
)
from hybridflow.tracking.loggers import Generation
from hybridflow.types import RefBatch, Sample, TrainBatch, Trajectory, row_of


class Decoder(Protocol):
    """The part of the policy's tokenizer the dumps use."""

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]: ...


@dataclass(frozen=True)
class GenerationDumps:
    tokenizer: Decoder
    tracker: Tracker
    rollout_dir: Path | None = None  # trainer.rollout_data_dir resolved (None: no dumps)
    validation_dir: Path | None = None  # trainer.validation_data_dir resolved
    max_samples: int = 0  # trainer.dump_max_samples
    max_chars: int = 0  # trainer.dump_max_chars
    val_generations: int = 0  # trainer.log_val_generations

    def validation(self, step: int, trajectories: list[Trajectory], scores: list[float]) -> None:
        """This validation's samples to ``trainer.validation_data_dir`` (when set) and to the loggers."""
        if self.validation_dir is not None:
            self._dump_validation(step, trajectories, scores)
        if self.val_generations > 0:
            self._log_val_generations(step, trajectories, scores)

    def _dump_validation(self, step: int, trajectories: list[Trajectory], scores: list[float]) -> None:
        assert self.validation_dir is not None
        kept = trajectories[: self.max_samples]  # decode no more than is written
        rows = validation_rows(
            step=step, inputs=self._decode([x.prompt_ids for x in kept]),
            outputs=self._decode([x.response_ids for x in kept]),
            ground_truths=[row_of(x).ground_truth for x in kept], scores=scores[: len(kept)],
            reward_infos=[x.reward_info for x in kept], data_sources=[row_of(x).data_source for x in kept],
            max_samples=self.max_samples, max_chars=self.max_chars,
        )
        write_jsonl(self.validation_dir, step, rows)

    def _log_val_generations(self, step: int, trajectories: list[Trajectory], scores: list[float]) -> None:
        """Picked as verl picks them (the same prompts every validation), texts cut to max_chars."""
        inputs = self._decode([x.prompt_ids for x in trajectories])
        chosen = pick_val_generations(inputs, self.val_generations)
        outputs = self._decode([trajectories[i].response_ids for i in chosen])
        samples = [Generation(clip_text(inputs[i], self.max_chars), clip_text(output, self.max_chars), float(scores[i]))
                   for i, output in zip(chosen, outputs, strict=True)]
        self.tracker.log_generations(samples, step)

    def rollouts(self, step: int, batch: TrainBatch | RefBatch, trajectories: Sequence[Sample]) -> None:
        """This step's samples to ``trainer.rollout_data_dir``: each with its sequence advantage, the
        mean over its loss tokens (the advantage itself for outcome estimators). On the by-reference
        data plane the dumped ones' tokens (at most ``max_samples``) are fetched here."""
        assert self.rollout_dir is not None and batch.advantages is not None and batch.response_mask is not None
        kept = fetch_trajectories(trajectories[: self.max_samples])
        advantages = masked_mean(batch.advantages[: len(kept)], batch.response_mask[: len(kept)], dim=-1)
        rows = rollout_rows(
            step=step, prompts=self._decode([x.prompt_ids for x in kept]),
            responses=self._decode([x.response_ids for x in kept]),
            ground_truths=[row_of(x).ground_truth for x in kept], scores=[float(x.reward or 0.0) for x in kept],
            advantages=advantages.tolist(), logprobs=[x.rollout_logprobs for x in kept],
            token_texts=[self._token_texts(x.response_ids[:DUMP_MAX_LOGPROBS]) for x in kept],
            token_versions=[x.token_versions for x in kept],
            reward_infos=[x.reward_info for x in kept], group_ids=[x.group_id for x in kept],
            max_samples=self.max_samples, max_chars=self.max_chars,
        )
        write_jsonl(self.rollout_dir, step, rows)

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own, special tokens kept: one text per logprob (an EOS has a
        logprob too); a token holding part of a multi-byte character reads as U+FFFD."""
        return list(self.tokenizer.batch_decode([[t] for t in token_ids])) if token_ids else []

    def _decode(self, token_ids: list[list[int]]) -> list[str]:
        # batch_decode([]) is not an empty list in every tokenizer
        return list(self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)) if token_ids else []
