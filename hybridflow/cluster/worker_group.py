"""Worker groups: N ranks of one role, called as if they were one local object.

The fan-out of every call is explicit at the call site and typed, so an IDE can follow it:

    logprobs = actor.split_gather(ActorWorker.compute_logprobs, batch)   # shard over DP ranks, gather
    metrics = actor.call_all(ActorWorker.update_actor, shards)           # same method on every rank
    scores, _ = reward.call_one(0, RewardWorker.score, trajectories)      # one rank
    sent, received = wait_all(actor.submit_all(ActorWorker.send_weights),  # two groups at once
                              rollout.submit_all(RolloutWorker.receive_weights))

Methods are passed as unbound functions of the worker class (``ActorWorker.compute_logprobs``),
never looked up by a string built at run time. A backend only has to turn "call this function
on rank r with these arguments" into its own mechanism: a direct call in-process
(``LocalWorkerGroup``), a Ray actor per rank (``hybridflow.cluster.ray_group.RayWorkerGroup``);
``hybridflow.cluster.backends`` chooses one by name.

One rule crosses the fan-out: a method declared ``@collective``
(``hybridflow.training.distributed``) gathers or saves state sharded over the ranks, so every
rank must run it. ``call_one`` refuses such a method (one rank alone would wait on its peers
forever); the call site says ``call_all(method)[0]``, so the fan-out stays visible there.

A collective may also span two groups (actor rank 0 streaming weights to the rollout ranks): both
sides must run at the same time, so ``submit_all`` / ``submit_one`` start a call and return a
``PendingCall``, and ``wait_all`` waits on several together. The protocol has them on every
backend, so the controller never asks which backend it drives: in-process they run the call at
once (a cross-group collective never runs in-process: ``trainer.backend=local`` copies weights
directly), on Ray they run concurrently and a failure on either side is reported at once.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from hybridflow.training.distributed import free_port, is_collective
from hybridflow.types import TrainBatch
from hybridflow.utils.watchdog import activity

W = TypeVar("W")
R = TypeVar("R")
P = ParamSpec("P")

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankNode:
    """Where one rank runs: its node (Ray's node id; ``controller`` for an in-process rank), the
    node's address and the rank's process id there (to profile it, or to find it in ``ps``)."""

    node_id: str
    address: str
    pid: int

    def describe(self) -> str:
        """The node in words, for errors: its address and, on Ray, its id (nodes may share an address)."""
        return f"node {self.address}" if self.node_id == "controller" else f"node {self.address} (id {self.node_id})"


class PendingCall(Protocol[R]):
    """A submitted call; ``wait`` gives its results in rank order or raises ``WorkerError``;
    ``wait_together`` waits on several calls of one backend at once (``wait_all``)."""

    def wait(self) -> list[R]: ...

    @staticmethod
    def wait_together(*calls: PendingCall[Any]) -> list[list[Any]]: ...

    @staticmethod
    def wait_each(*calls: PendingCall[Any]) -> Iterator[tuple[int, list[Any] | WorkerError]]: ...


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

    def submit_all(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> PendingCall[R]:
        """``call_all`` without waiting: start ``method`` on every rank, collect with ``wait_all``."""
        ...

    def submit_one(
        self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> PendingCall[R]:
        """``call_one`` without waiting; a ``@collective`` method is refused."""
        ...

    def node_addresses(self) -> list[str]:
        """Each rank's node address, in rank order (where a peer in another group reaches it)."""
        ...

    def rendezvous(self, rank: int) -> tuple[str, int]:
        """(node address, a TCP port free there a moment ago) of ``rank``: where a group that
        rank leads (e.g. weight sync) can listen."""
        ...

    def nodes(self) -> list[RankNode]:
        """Where each rank runs, in rank order (recorded in the run folder's placement.json)."""
        ...

    def close(self) -> None:
        """Release the ranks (processes, reserved resources); the group is unusable after."""
        ...


def meeting_host(listener: str, peers: Iterable[str]) -> str:
    """The address peers dial to reach a rendezvous on node ``listener``: loopback when every
    peer is on that node (a local Ray cluster listens on 127.0.0.1 only), the node's address
    otherwise."""
    return LOOPBACK if all(peer == listener for peer in peers) else listener


def wait_all(*calls: PendingCall[Any]) -> list[list[Any]]:
    """Results of calls submitted together (the two sides of a cross-group collective), in order.

    Ray calls are waited on jointly: the first failure on any side raises ``WorkerError`` at once,
    and a side still waiting on the failed one is torn down rather than left blocked in the
    collective. In-process calls have already run.
    """
    if all(isinstance(call, CompletedCall) for call in calls):
        return [call.wait() for call in calls]
    # A backend's calls wait together by the backend's own means (``RayPendingCall.wait_together``):
    # this module stays free of any backend, so the backends can import it.
    backend_call = next(call for call in calls if not isinstance(call, CompletedCall))
    return type(backend_call).wait_together(*calls)


def wait_each(*calls: PendingCall[Any]) -> Iterator[tuple[int, list[Any] | WorkerError]]:
    """Each call's outcome as it completes: ``(position in calls, its results or its WorkerError)``.

    Unlike ``wait_all`` the calls are independent (the rollout replicas' rounds): one call's
    failure neither ends the wait nor tears down another call's group, so the caller can keep
    what the others return and recover from the failed one. A multi-rank group with a failed
    rank is still torn down (its peers may be blocked in a collective of their own).
    """
    if all(isinstance(call, CompletedCall) for call in calls):
        yield from CompletedCall.wait_each(*calls)
        return
    backend_call = next(call for call in calls if not isinstance(call, CompletedCall))
    yield from type(backend_call).wait_each(*calls)


def refuse_collective(role: str, method: Callable[..., Any]) -> None:
    """``call_one`` of a ``@collective`` method would leave that rank waiting on peers that never
    enter the collective: a hang, so it is an error at the call site instead."""
    if is_collective(method):
        raise TypeError(f"{role}: {method.__qualname__} is @collective and must run on every rank; "
                        f"call it with call_all(...) and take the rank's result")


class WorkerError(RuntimeError):
    """A worker raised; the message names the role, the rank and the method. ``process_died``:
    the rank's process exited (killed, out of memory, its node lost), so a new process could
    take over its work; False when the worker's own code raised (it would raise again)."""

    def __init__(self, message: str, *, process_died: bool = False) -> None:
        super().__init__(message)
        self.process_died = process_died


class CompletedCall(Generic[R]):
    """A submitted call that has already run (in-process groups run it at once): ``wait`` returns
    its results or raises its ``WorkerError``, as a Ray call's ``wait`` would."""

    def __init__(self, run: Callable[[], list[R]]) -> None:
        self._results: list[R] = []
        self._error: WorkerError | None = None
        try:
            self._results = run()
        except WorkerError as error:
            self._error = error

    def wait(self) -> list[R]:
        if self._error is not None:
            raise self._error
        return self._results

    @staticmethod
    def wait_together(*calls: PendingCall[Any]) -> list[list[Any]]:
        return [call.wait() for call in calls]

    @staticmethod
    def wait_each(*calls: PendingCall[Any]) -> Iterator[tuple[int, list[Any] | WorkerError]]:
        for i, call in enumerate(calls):
            try:
                yield i, call.wait()
            except WorkerError as error:
                yield i, error


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

    def submit_all(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> CompletedCall[R]:
        return CompletedCall(lambda: self.call_all(method, *args, **kwargs))

    def submit_one(
        self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> CompletedCall[R]:
        # A bad rank or a @collective method raises here (not a WorkerError), as it does on Ray.
        return CompletedCall(lambda: [self.call_one(rank, method, *args, **kwargs)])

    def node_addresses(self) -> list[str]:
        return [LOOPBACK] * self.world_size

    def rendezvous(self, rank: int) -> tuple[str, int]:
        return LOOPBACK, free_port()

    def nodes(self) -> list[RankNode]:
        return [RankNode("controller", socket.gethostname(), os.getpid())] * self.world_size

    def close(self) -> None:
        """Nothing to release: the workers live and die with the controller's process."""
