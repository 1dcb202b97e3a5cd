"""Colocated roles in one process per placement bundle (``trainer.hybrid_engine``, verl's hybrid
engine): one generic Ray actor per bundle, a ``RoleHost``, into which each colocated role's worker
object is added by name; the worker-group protocol is served per role on top of the shared hosts
(``HostedWorkerGroup``), so the controller and the phases call them as they call ``RayWorkerGroup``.

    hosts = RoleHosts(pool, num_threads=1, device=cpu)          # started with the first role
    actor = HostedWorkerGroup("actor", factory, 2, Placement(pool, ..., hosts=hosts))
    replica = HostedWorkerGroup("rollout replica 1", factory, 1, Placement(pool, ..., hosts=hosts, first_bundle=1))
    actor.call_all_with(hand_weights, [(replica0, 0), (replica, 0)])   # rank r beside its partner

Why: every process of its own re-imports torch and transformers (~7 CPU-s each), keeps its own
allocator arenas and, on a GPU, its own CUDA context; and a rollout in another process than the
actor rank needs the weights broadcast to it, where one beside it takes them by reference.

What one process per bundle changes, and how it stays safe:
- One torch.distributed default group per pool, formed when the hosts start (host b is rank b of
  ``num_bundles``): a role of several ranks joins it as it is, so it must span the whole pool from
  bundle 0 (rank r in bundle r: the actor, reference, critic, reward model). A role of one rank
  needs no group. Any other multi-rank role (a tensor-parallel replica over part of the pool) is
  refused: it needs a group of its own, hence processes of its own.
- A host runs one call at a time, in the order the controller submitted them (Ray's order per
  caller), so two roles' collectives never interleave differently on two hosts. Two calls that must
  run at the same time in one process (a broadcast from the actor to the rollout beside it) would
  wait on each other for ever: they are not made here (``call_all_with`` runs both sides in one call).
- Closing one role's group drops its worker from the hosts; a host's process ends with the last
  role in it. Tearing a group down after a failure (its peers may sit in a collective that cannot
  complete) ends its hosts' processes, and with them the other roles there: a later call of theirs
  fails naming the dead process and every role it held, as a rank's death does.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch

from hybridflow.cluster.ray_group import HostProcess, Placement, RayPendingCall, RayWorkerGroup, ResourcePool
from hybridflow.cluster.worker_group import RankNode, WorkerError, meeting_host
from hybridflow.training import distributed
from hybridflow.utils.memory import configure_host_allocator
from hybridflow.utils.timer import profiler_range

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

W = TypeVar("W")
V = TypeVar("V")
R = TypeVar("R")
P = ParamSpec("P")


# ---------------------------------------------------------------------------- the host process
class RoleHost(HostProcess):
    """The process of one placement bundle: the default process group's rank ``bundle`` (when the
    pool has several bundles), and one worker object per role placed in the bundle."""

    def __init__(self, bundle: int, num_bundles: int, num_threads: int, device: torch.device) -> None:
        super().__init__(num_threads)
        configure_host_allocator(device)  # before any role's worker builds its model, as a RankHost does
        self.bundle, self.num_bundles = bundle, num_bundles
        self.workers: dict[str, Any] = {}
        self.labels: dict[str, str] = {}

    def join(self, master_addr: str, master_port: int, device: torch.device) -> None:
        """Join the pool's default process group as rank ``bundle``; every host at once."""
        distributed.init_process_group(rank=self.bundle, world_size=self.num_bundles, master_addr=master_addr,
                                       master_port=master_port, device=device)

    def add(self, role: str, rank: int, world_size: int, factory: Callable[[int, int], Any]) -> None:
        """Build ``role``'s rank ``rank`` of ``world_size`` here; a multi-rank role uses the pool's
        group, so its rank must be this host's (the controller checks it first; so does this)."""
        if role in self.workers:
            raise ValueError(f"{role} already has a worker in the process of bundle {self.bundle}")
        if world_size > 1 and (rank, world_size) != (self.bundle, self.num_bundles):
            raise ValueError(f"{role} rank {rank} of {world_size} cannot share the process of bundle {self.bundle}: "
                             f"its process group is the pool's ({self.num_bundles} ranks, rank {self.bundle} here)")
        self.workers[role] = factory(rank, world_size)
        self.labels[role] = f"{role} rank {rank}"

    def execute(self, role: str, method: Callable[..., R], payload: tuple[tuple, dict[str, Any]]) -> R:
        """``method(worker of role, *args, **kwargs)``, as ``RankHost.execute``."""
        args, kwargs = payload
        with profiler_range(f"{role}/{getattr(method, '__name__', 'call')}"):
            return method(self.workers[role], *args, **kwargs)

    def execute_with(self, role: str, partner: str, method: Callable[..., R],
                     payload: tuple[tuple, dict[str, Any]]) -> R:
        """``method(worker of role, worker of partner, *args, **kwargs)``: two roles of this process
        in one call (the actor rank handing its weights to the rollout replica beside it)."""
        args, kwargs = payload
        with profiler_range(f"{role}/{getattr(method, '__name__', 'call')}"):
            return method(self.workers[role], self.workers[partner], *args, **kwargs)

    def remove(self, role: str) -> None:
        """Drop ``role``'s worker (its group closed); the process stays for the other roles."""
        self.workers.pop(role, None)
        self.labels.pop(role, None)
        gc.collect()

    def roles(self) -> list[str]:
        return list(self.labels.values())


# ------------------------------------------------------------------------------- the hosts
class RoleHosts:
    """The ``RoleHost`` processes of one resource pool, one per bundle, shared by the roles placed
    on it; started with the first role (``start``), each ended with the last role in it."""

    def __init__(self, pool: ResourcePool, *, num_threads: int, device: torch.device) -> None:
        self.pool, self.num_threads, self.device = pool, num_threads, device
        self._handles: list[ActorHandle] = []
        self._held: list[dict[str, str]] = [{} for _ in range(pool.num_bundles)]  # bundle -> role -> label
        self._ended: list[str | None] = [None] * pool.num_bundles  # why a host's process was ended
        self._held_at_end: list[dict[str, str]] = [{} for _ in range(pool.num_bundles)]
        self._nodes: list[RankNode] = []

    @property
    def processes_started(self) -> int:
        return len(self._handles)

    def start(self) -> list[ActorHandle]:
        """The hosts' handles, starting them (and their process group) the first time."""
        if self._handles:
            return self._handles
        import ray

        host_cls = ray.remote(RoleHost)
        n = self.pool.num_bundles
        self._handles = [host_cls.options(
            max_restarts=0,  # a dead host is reported, never silently replaced
            **self.pool.actor_options(b, 1.0, gpu=self.device.type == "cuda"),
        ).remote(b, n, self.num_threads, self.device) for b in range(n)]
        start = time.perf_counter()
        try:
            if n > 1:
                addr, port = ray.get(self._handles[0].rendezvous.remote())
                master = meeting_host(addr, ray.get([h.node_address.remote() for h in self._handles]))
                ray.get([h.join.remote(master, port, self.device) for h in self._handles])
            self._nodes = ray.get([h.node.remote() for h in self._handles])
        except BaseException:
            self.end(range(n), "its start failed")
            raise
        log.info("hybrid engine: %d role host process(es) up in %.1fs", n, time.perf_counter() - start)
        return self._handles

    def attach(self, role: str, bundles: Sequence[int]) -> None:
        for rank, bundle in enumerate(bundles):
            if self._ended[bundle] is not None:
                raise RuntimeError(f"{role}: the process of bundle {bundle} was ended ({self._ended[bundle]})")
            self._held[bundle][role] = f"{role} rank {rank}"

    def held(self, bundle: int) -> list[str]:
        """The roles' ranks that live in bundle ``bundle``'s process (its death takes them all), or
        for a process this ended, those it held then."""
        return list((self._held_at_end[bundle] if self._ended[bundle] is not None else self._held[bundle]).values())

    def node(self, bundle: int) -> RankNode | None:
        return self._nodes[bundle] if bundle < len(self._nodes) else None

    def ended(self, bundle: int) -> str | None:
        return self._ended[bundle]

    def release(self, role: str, bundles: Sequence[int]) -> None:
        """``role`` leaves ``bundles``: its worker is dropped there, and a host left with no role ends."""
        import ray

        for bundle in bundles:
            self._held[bundle].pop(role, None)
            if self._ended[bundle] is not None or not self._handles or not ray.is_initialized():
                continue
            if self._held[bundle]:
                self._handles[bundle].remove.remote(role)  # after the calls queued before it; no wait
            else:
                self.end([bundle], "its last role closed")

    def end(self, bundles: Sequence[int] | range, reason: str) -> None:
        """End the processes of ``bundles`` now (a blocked collective ends with them)."""
        import ray

        for bundle in bundles:
            if self._ended[bundle] is not None:
                continue
            if bundle < len(self._handles) and ray.is_initialized():
                ray.kill(self._handles[bundle], no_restart=True)
            self._ended[bundle], self._held_at_end[bundle] = reason, dict(self._held[bundle])


# ------------------------------------------------------------------------------- the group
class HostedWorkerGroup(RayWorkerGroup[W]):
    """``world_size`` ranks of one role in the shared processes of ``placement.hosts``: rank r in
    bundle ``first_bundle + r``. The calls, their waits and failure reports are ``RayWorkerGroup``'s;
    what differs is where a call goes (the role's worker in a shared process), how the group closes
    (its workers leave; a process ends with its last role) and what a dead process's report names
    (every role it held)."""

    def __init__(self, role: str, factory: Callable[[int, int], W], world_size: int, placement: Placement) -> None:
        hosts = placement.hosts
        if hosts is None:
            raise ValueError(f"{role}: a hosted group needs a placement with hosts")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        bundles = list(range(placement.first_bundle, placement.first_bundle + world_size))
        if bundles[-1] >= placement.pool.num_bundles:
            raise ValueError(f"{role}: {world_size} ranks from bundle {placement.first_bundle} on a pool of "
                             f"{placement.pool.num_bundles} bundles")
        if world_size > 1 and (placement.first_bundle, world_size) != (0, placement.pool.num_bundles):
            raise ValueError(f"{role}: {world_size} ranks from bundle {placement.first_bundle} cannot share the role "
                             f"hosts' processes, whose process group spans all {placement.pool.num_bundles} bundles; "
                             f"a group over part of the pool needs processes of its own")
        self.role, self._hosts, self._bundles = role, hosts, bundles
        self._failed: str | None = None
        self._closed = False
        self._nodes: list[RankNode] = []
        handles = hosts.start()
        self._ranks = [handles[b] for b in bundles]
        hosts.attach(role, bundles)
        try:
            refs = [(r, h.add.remote(role, r, world_size, factory)) for r, h in enumerate(self._ranks)]
            RayPendingCall(self, refs, f"{role}.__init__").wait()
        except BaseException:
            # Peers may sit in a collective of the failed constructor: their processes end too.
            self._tear_down("its start failed")
            raise
        self._nodes = [node for b in bundles if (node := hosts.node(b)) is not None]

    def _execute(self, rank: int, method: Callable[..., Any], payload: Any) -> Any:
        return self._ranks[rank].execute.remote(self.role, method, payload)

    def bundle(self, rank: int) -> int:
        """The placement bundle (and so the process) of ``rank``."""
        return self._bundles[rank]

    def call_all_with(self, method: Callable[Concatenate[W, V, P], R], partners: Sequence[tuple[HostedWorkerGroup[V], int]],
                      *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """On every rank r, ``method(worker, partner worker, *args, **kwargs)`` where ``partners[r]``
        = (group, its rank) lives in rank r's process: both roles' work in one call, so neither
        waits for the other's call to be scheduled. Failures as ``call_all``'s, named after this role."""
        if len(partners) != self.world_size:
            raise ValueError(f"{self.role}: {len(partners)} partners for {self.world_size} ranks")
        for rank, (group, partner_rank) in enumerate(partners):
            if group._hosts is not self._hosts or group.bundle(partner_rank) != self.bundle(rank):
                raise ValueError(f"{self.role} rank {rank} and {group.role} rank {partner_rank} do not share a process")
        name = getattr(method, "__qualname__", repr(method))
        if self._failed is not None:
            raise WorkerError(f"{self.role} cannot run {name}: {self._failed}")
        refs = [(rank, self._ranks[rank].execute_with.remote(self.role, group.role, method, (args, kwargs)))
                for rank, (group, _) in enumerate(partners)]
        return RayPendingCall(self, refs, name).wait()

    def where(self, rank: int) -> str:
        """Rank ``rank``'s node and the process it shares: a dead process took every role it held."""
        if rank >= len(self._nodes):
            return ""
        bundle, node = self._bundles[rank], self._nodes[rank]
        held = [label for label in self._hosts.held(bundle) if label != f"{self.role} rank {rank}"]
        shared = f"the process of bundle {bundle}, pid {node.pid}"
        if held:
            shared += f", shared with {', '.join(held)}"
        ended = self._hosts.ended(bundle)
        if ended is not None:
            shared += f"; ended when {ended}"
        return f" on {node.describe()} ({shared})"

    def close(self) -> None:
        """Leave the shared processes (safe twice, and after a failure); the last role ends each."""
        if not self._closed:
            self._closed = True
            self._hosts.release(self.role, self._bundles)
        self._failed = self._failed or "the group was closed"

    def _tear_down(self, reason: str) -> None:
        """A failed rank's peers may be blocked in a collective: their processes end (and with
        them the other roles there, whose next call reports the process gone)."""
        if not self._closed:
            self._closed = True
            self._hosts.end(self._bundles, f"{self.role} was torn down ({reason})")
            self._hosts.release(self.role, self._bundles)
        self._failed = reason


def hosted(placement: Placement | None) -> bool:
    """Whether ``placement`` puts a group in shared role hosts (``trainer.hybrid_engine``)."""
    return placement is not None and placement.hosts is not None

