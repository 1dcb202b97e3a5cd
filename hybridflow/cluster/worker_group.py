"""Worker groups: N ranks of one role, called as if they were one local object.

The fan-out of every call is explicit at the call site and typed, so an IDE can follow it:

    logprobs = actor.split_gather(ActorWorker.compute_logprobs, batch)   # shard over DP ranks, gather
    metrics = actor.call_all(ActorWorker.update_actor, shards)           # same method on every rank
    scores, _ = reward.call_one(0, RewardWorker.score, trajectories)      # one rank

Methods are passed as unbound functions of the worker class (``ActorWorker.compute_logprobs``),
never looked up by a string built at run time. A backend only has to turn "call this function
on rank r with these arguments" into its own mechanism: a direct call in-process
(``LocalWorkerGroup``), a Ray actor per rank (``hybridflow.cluster.ray_group.RayWorkerGroup``).

One rule crosses the fan-out: a method declared ``@collective``
(``hybridflow.training.distributed``) gathers or saves state sharded over the ranks, so every
rank must run it. ``call_one`` refuses such a method (one rank alone would wait on its peers
forever); the call site says ``call_all(method)[0]``, so the fan-out stays visible there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import torch

from hybridflow.training.distributed import is_collective
from hybridflow.types import TrainBatch
from hybridflow.utils.watchdog import activity

if TYPE_CHECKING:
    from hybridflow.cluster.ray_group import Placement, ResourcePool

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
        """Call ``method`` on one rank; a ``@collective`` method is refused (use ``call_all``)."""
        ...

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple], **kwargs: Any) -> list[R]:
        """Call ``method`` on rank r with ``per_rank_args[r]``; results in rank order."""
        ...

    def split_gather(self, method: Callable[[W, TrainBatch], R], batch: TrainBatch) -> list[R]:
        """Split ``batch`` into ``world_size`` equal shards, rank r gets shard r; results in rank order."""
        ...

    def close(self) -> None:
        """Release the ranks (processes, reserved resources); the group is unusable after."""
        ...


def refuse_collective(role: str, method: Callable[..., Any]) -> None:
    """``call_one`` of a ``@collective`` method would leave that rank waiting on peers that never
    enter the collective: a hang, so it is an error at the call site instead."""
    if is_collective(method):
        raise TypeError(f"{role}: {method.__qualname__} is @collective and must run on every rank; "
                        f"call it with call_all(...) and take the rank's result")


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
        refuse_collective(self.role, method)
        return self._call(rank, method, *args, **kwargs)

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple], **kwargs: Any) -> list[R]:
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.role}: {len(per_rank_args)} argument tuples for {self.world_size} ranks")
        return [self._call(rank, method, *args, **kwargs) for rank, args in enumerate(per_rank_args)]

    def split_gather(self, method: Callable[[W, TrainBatch], R], batch: TrainBatch) -> list[R]:
        shards = batch.chunk(self.world_size)
        return [self._call(rank, method, shard) for rank, shard in enumerate(shards)]

    def close(self) -> None:
        """Nothing to release: the workers live and die with the controller's process."""


BACKENDS = ("local", "ray")


def build_worker_group(
    backend: str, role: str, factory: Callable[[int, int], W], world_size: int, placement: Placement | None = None
) -> WorkerGroup[W]:
    """The one place a backend is chosen by name. ``placement`` (where the ranks run) is
    required by ``ray`` and ignored in-process."""
    if backend == "local":
        return LocalWorkerGroup(role, factory, world_size)
    if backend == "ray":
        if placement is None:
            raise ValueError(f"{role}: trainer.backend=ray needs a placement (resource pool, share, threads, device)")
        from hybridflow.cluster.ray_group import RayWorkerGroup

        return RayWorkerGroup(role, factory, world_size, placement)
    raise ValueError(f"trainer.backend={backend!r} is not available; choose one of {sorted(BACKENDS)}")



def reserve_placements(
    backend: str,
    *,
    data_parallel_size: int,
    device: torch.device,
    colocated_roles: Sequence[str],
    ray_address: str | None = None,
    ray_dashboard: bool = False,
    num_threads: int | None = None,
) -> tuple[ResourcePool | None, dict[str, Placement]]:
    """Where each role's ranks will run, for ``build_worker_group``.

    ``ray``: connect to the cluster at ``ray_address`` (or start a local one) and reserve one
    bundle per data-parallel rank; the ``colocated_roles`` share every bundle equally (rank r
    of each role in bundle r, a single-rank role in bundle 0). Each rank gets ``num_threads``
    torch threads (None: the cores divided over the ranks; colocated roles run one after
    another within a step, so they need not split them). ``local``: nothing to reserve.
    """
    if backend == "local":
        return None, {}
    if backend != "ray":
        raise ValueError(f"trainer.backend={backend!r} is not available; choose one of {sorted(BACKENDS)}")
    from hybridflow.cluster.ray_group import Placement, ResourcePool, init_ray

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Logical CPUs of a local cluster: at least one per rank, so N ranks start even on fewer cores.
    init_ray(ray_address, dashboard=ray_dashboard, num_cpus=max(cores, data_parallel_size))
    pool = ResourcePool(data_parallel_size, use_gpu=device.type == "cuda")
    threads = num_threads or max(1, cores // data_parallel_size)
    share = 1.0 / len(colocated_roles)
    return pool, {role: Placement(pool, share=share, num_threads=threads, device=device) for role in colocated_roles}
