"""A batch sampler whose whole state is two integers, so resuming replays nothing and skips nothing.

Each epoch's order is a permutation derived only from ``(seed, epoch)`` with a local
``torch.Generator``. The sampler therefore never touches (or depends on) the global RNG, and
its state is just *which epoch* and *how many batches of it were taken*: restoring
``{epoch, position}`` reproduces exactly the batches an uninterrupted run would have drawn,
mid-epoch or at an epoch boundary. (Replaying or skipping data after resume is a known failure
of stateful loaders; see reliability.md, "Dataloader replays data after resume".)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

_SEED_MASK = (1 << 63) - 1  # torch.Generator.manual_seed takes a non-negative 64-bit int


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ResumableSampler: {name} must be an int >= {minimum}, got {value!r}")
    return value


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed for one epoch, well mixed so nearby (seed, epoch) pairs are unrelated.

    A hash rather than ``seed + epoch``: with addition, run seed 1 epoch 0 would replay run
    seed 0 epoch 1.
    """
    digest = hashlib.sha256(f"hybridflow.sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


@dataclass(frozen=True)
class SamplerFeedback:
    """What a training step tells the prompt sampler after its update: the samples it trained on.

    One entry per trained sample (B = prompts kept x rollout.n), in the order the step collected
    them; a prompt's dataset index repeats once per sample of its group. Dropped groups (dynamic
    sampling) are not in it: this is the batch the update saw, as verl's curriculum hook gets it.
    """

    step: int
    indices: list[int]  # [B] the dataset index (position in data.train_files' rows) of each sample's prompt
    scores: list[float]  # [B] each sample's reward (the score its advantage was computed from)
    group_ids: list[int]  # [B] the sample's prompt group within the step (0 .. prompts - 1)

    def mean_score_by_index(self) -> dict[int, float]:
        """Each trained prompt's mean reward over its samples, by dataset index."""
        sums: dict[int, list[float]] = {}
        for index, score in zip(self.indices, self.scores, strict=True):
            sums.setdefault(index, []).append(score)
        return {index: sum(values) / len(values) for index, values in sums.items()}


@dataclass
class EpochCursor:
    """Where a prompt sampler stands: ``epoch``, the epoch the next batch comes from, and
    ``position``, the batches of it already taken. Taking an epoch's last batch moves straight to
    ``(epoch + 1, 0)``, so at an epoch boundary ``epoch`` counts the completed epochs."""

    epoch: int = 0
    position: int = 0

    def took_batch(self, steps_per_epoch: int) -> bool:
        """Count one batch taken; True when it was the epoch's last (the cursor then stands at the
        next epoch's start)."""
        self.position += 1
        if self.position == steps_per_epoch:
            self.next_epoch()
            return True
        return False

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0


def cursor_property(name: str) -> Any:
    """A read-only property of a sampler that reads its ``_cursor`` (``EpochCursor``) field ``name``."""
    return property(lambda sampler: getattr(sampler._cursor, name), doc=f"``EpochCursor.{name}``.")


class PromptSampler(Protocol):
    """What a training loop asks of its prompt sampler (``ResumableSampler``, or
    ``sampler_plugin.PluginSampler`` around a user's class). ``state_dict`` is JSON-able and
    holds ``epoch``; ``after_step`` is called once per step, after the update."""

    @property
    def epoch(self) -> int: ...

    @property
    def steps_per_epoch(self) -> int: ...

    def next_batch(self) -> list[int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def after_step(self, feedback: SamplerFeedback) -> None: ...


class ResumableSampler:
    """Endless batches of indices into ``range(num_items)``, epoch after epoch.

    State: ``epoch`` and ``position``, an ``EpochCursor``.
    """

    epoch = cursor_property("epoch")
    position = cursor_property("position")

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.num_items = _check_int("num_items", num_items, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if drop_last and batch_size > num_items:
            raise ValueError(
                f"ResumableSampler: batch_size {batch_size} is larger than the dataset ({num_items} items), "
                "so with drop_last every batch would be dropped; use a smaller batch size or more data"
            )
        self._cursor = EpochCursor()
        self._order: list[int] | None = None  # the current epoch's order, built on first use

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: the short final batch is dropped with ``drop_last``."""
        if self.drop_last:
            return self.num_items // self.batch_size
        return -(-self.num_items // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """All indices in the order epoch ``epoch`` visits them (a pure function of seed and epoch)."""
        _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return list(range(self.num_items))
        generator = torch.Generator(device="cpu")
        generator.manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_items, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        """The next batch of indices, rolling into a freshly shuffled epoch when one ends."""
        if self._order is None:
            self._order = self.epoch_order(self._cursor.epoch)
        start = self._cursor.position * self.batch_size
        batch = self._order[start : start + self.batch_size]
        if self._cursor.took_batch(self.steps_per_epoch):
            self._order = None
        return batch

    def after_step(self, feedback: SamplerFeedback) -> None:
        """Nothing to learn: the order is a function of (seed, epoch) alone."""

    def state_dict(self) -> dict[str, int | bool]:
        """Plain JSON-able state. The settings are included so a mismatch on load is caught."""
        return {
            "epoch": self._cursor.epoch,
            "position": self._cursor.position,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. Raises ``ValueError`` if it was saved under other settings.

        Resuming over a changed dataset or batch size would silently visit a different order,
        which is the "resume differs from the uninterrupted run" bug, so it is refused.
        """
        if not isinstance(state, dict):
            raise ValueError(f"ResumableSampler.load_state_dict: expected a dict, got {type(state).__name__}")
        missing = [key for key in ("epoch", "position") if key not in state]
        if missing:
            raise ValueError(f"ResumableSampler.load_state_dict: state has no {', '.join(map(repr, missing))}")
        for key in ("num_items", "batch_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler.load_state_dict: the state was saved with {key}={state[key]!r} but this "
                    f"sampler has {key}={getattr(self, key)!r}; the data or settings changed since the "
                    "checkpoint, so resuming would not continue the same sequence"
                )
        epoch = _check_int("epoch", state["epoch"], 0)
        position = _check_int("position", state["position"], 0)
        if position >= self.steps_per_epoch:
            raise ValueError(
                f"ResumableSampler.load_state_dict: position {position} is out of range for "
                f"{self.steps_per_epoch} batches per epoch"
            )
        self._cursor = EpochCursor(epoch, position)
        self._order = None
