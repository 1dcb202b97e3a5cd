"""Worker groups: N ranks of one role, called as if they were one local object.

The fan-out of every call is explicit at the call site and typed, so an IDE can follow it:

    logprobs = actor.split_gather(ActorWorker.compute_logprobs, batch)   # shard over DP ranks, gather
    metrics = actor.call_all(ActorWorker.update_actor, shards)           # same method on every rank
    weights = actor.call_one(0, ActorWorker.weights_for_sync)             # one rank

Methods are passed as unbound functions of the worker class (``ActorWorker.compute_logprobs``),
never looked up by a string built at run time. A backend only has to turn "call this function
on rank r with these arguments" into its own mechanism: a direct call in-process
(``LocalWorkerGroup``), ``actor.method.remote(...)`` for Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from hybridflow.types import TrainBatch
from hybridflow.utils.watchdog import activity

W = TypeVar("W")
R = TypeVar("R")
P = ParamSpec("P")


class WorkerGroup(Protocol[W]):
    """What the controller may do with a group of workers of type ``W``."""

    @property
    def world_size(self) -> int: ...

    def call_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call ``method`` with the same arguments on every rank; results in rank order."""
        ...

    def call_one(self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Call ``method`` on one rank."""
        ...

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple], **kwargs: Any) -> list[R]:
        """Call ``method`` on rank r with ``per_rank_args[r]``; results in rank order."""
        ...

    def split_gather(self, method: Callable[[W, TrainBatch], R], batch: TrainBatch) -> list[R]:
        """Split ``batch`` into ``world_size`` equal shards, rank r gets shard r; results in rank order."""
        ...


class WorkerError(RuntimeError):
    """A worker raised; the message names the role, the rank and the method."""


class LocalWorkerGroup(Generic[W]):
    """In-process backend: ``world_size`` worker objects living in the controller's process.

    The laptop default. Calls are direct, so a worker's exception surfaces immediately with its
    traceback, wrapped to say which role, rank and method raised.
    """

    def __init__(self, role: str, factory: Callable[[int, int], W], world_size: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.role = role
        self._workers = [factory(rank, world_size) for rank in range(world_size)]

    @property
    def world_size(self) -> int:
        return len(self._workers)

    def _call(self, rank: int, method: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        name = getattr(method, "__qualname__", repr(method))
        try:
            # The watchdog names this call if the phase around it stalls.
            with activity("call", f"{self.role} rank {rank} {name}"):
                return method(self._workers[rank], *args, **kwargs)
        except Exception as exc:
            raise WorkerError(f"{self.role} rank {rank} failed in {name}: {exc!r}") from exc

    def call_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return [self._call(rank, method, *args, **kwargs) for rank in range(self.world_size)]

    def call_one(self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.role} has ranks 0..{self.world_size - 1}, not {rank}")
        return self._call(rank, method, *args, **kwargs)

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple], **kwargs: Any) -> list[R]:
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.role}: {len(per_rank_args)} argument tuples for {self.world_size} ranks")
        return [self._call(rank, method, *args, **kwargs) for rank, args in enumerate(per_rank_args)]

    def split_gather(self, method: Callable[[W, TrainBatch], R], batch: TrainBatch) -> list[R]:
        shards = batch.chunk(self.world_size)
        return [self._call(rank, method, shard) for rank, shard in enumerate(shards)]


def build_worker_group(backend: str, role: str, factory: Callable[[int, int], W], world_size: int) -> LocalWorkerGroup[W]:
    """The one place a backend is chosen by name (Ray joins here in a later issue)."""
    backends = {"local": LocalWorkerGroup}
    if backend not in backends:
        raise ValueError(f"trainer.backend={backend!r} is not available; choose one of {sorted(backends)}")
    return backends[backend](role, factory, world_size)
