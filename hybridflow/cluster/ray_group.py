"""The Ray backend of the worker-group protocol: every rank is a Ray actor process hosting one
worker object, and the ranks of a group form a torch.distributed process group (gloo on CPU,
NCCL on GPU) before the workers are built, so a worker's ``__init__`` may already shard.

    init_ray(address=None, dashboard=False, num_cpus=2)        # local cluster on 127.0.0.1
    pool = ResourcePool(2, use_gpu=False)                      # one bundle per data-parallel rank
    actor = RayWorkerGroup("actor", factory, 2, Placement(pool, share=0.5, num_threads=1, device=cpu))
    metrics = actor.split_gather(ActorWorker.update_actor, batch)

Calls are the same unbound methods the in-process backend takes; a rank executes
``method(worker, *args)``. Colocated roles (actor and reference ranks, the rollout rank) sit in
the same placement-group bundle and split its CPU/GPU by ``share``.

Failures never hang the controller: every call waits on all ranks at once and the first rank
that raised or died turns into a ``WorkerError`` naming the role, the rank, the method and the
worker's own error (Ray's ``RayTaskError`` / ``RayActorError`` unwrapped). A multi-rank group
with a failed rank is torn down at once (its peers may be blocked in a collective) and refuses
later calls.

Two groups can run the two sides of one collective (actor rank 0 broadcasting weights to the
rollout rank): ``submit_all`` / ``submit_one`` start a call and return a ``RayPendingCall``, and
``wait_all`` waits on several at once with the same failure rules across groups; a group whose
call is still running after a peer group failed is blocked on it, and is torn down too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

import torch

from hybridflow.cluster.worker_group import PendingCall, RankNode, WorkerError, meeting_host, refuse_collective
from hybridflow.models.loading import disable_hf_progress_bars
from hybridflow.training import distributed
from hybridflow.types import TrainBatch
from hybridflow.utils import faults
from hybridflow.utils.memory import configure_host_allocator
from hybridflow.utils.timer import profiler_range
from hybridflow.utils.watchdog import activity

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

W = TypeVar("W")
R = TypeVar("R")
P = ParamSpec("P")

# Ray reads this once, at import: "off" makes a Linux head node advertise and bind 127.0.0.1
# only (Ray's laptop mode). Only set for a cluster this process starts itself.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
PLACEMENT_TIMEOUT_S = 120.0  # a cluster that cannot fit the bundles by then never will on its own
# How long an elastic role's look for room waits for Ray to place a reservation the free resources
# say fits (the cluster's view of them lags a little behind a node that joined or a group released).
ROOM_WAIT_S = 10.0
# After a rank fails, how long to wait for its peers' results: a peer in a collective with a dead
# rank errors a moment later *because* of it, and the report should lead with the cause.
FAILURE_GRACE_S = 2.0
# When every failure in hand is an error a rank raised (none a death) and other ranks are still
# running, a peer's process may have died without Ray having said so yet: a collective notices a
# closed socket at once, Ray's death notice can lag by seconds on a loaded machine. Wait up to this
# long for such a death before reporting, so the report names the dead rank, not its victims.
DEATH_GRACE_S = 10.0
# The label Ray gives every node: its node id (what keeps a pool's node groups on different nodes).
NODE_ID_LABEL = "ray.io/node-id"


# ------------------------------------------------------------------------------------ cluster
def init_ray(address: str | None, *, dashboard: bool, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a local one that listens on 127.0.0.1 only
    (dashboard off unless asked). ``num_cpus``: logical CPUs of a local cluster (so N CPU ranks
    fit even on a machine with fewer cores). A process already connected is left as it is."""
    if address is None:
        os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
    # Nothing about this run is worth reporting to Ray's usage statistics endpoint.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    # Ranks import what the controller can import (a test module, a script's own folder).
    env_vars = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # A fault injected into the run (hybridflow.utils.faults) reaches its ranks on any cluster: a local
    # cluster's ranks inherit this process's environment, an existing cluster's only what the job carries.
    if os.environ.get(faults.ENV):
        env_vars[faults.ENV] = os.environ[faults.ENV]
    runtime_env = {"env_vars": env_vars}
    if address is not None:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        log.warning("ray was imported before hybridflow started it: the local cluster listens on the node's address, "
                    "not only on 127.0.0.1 (import hybridflow's Ray backend first, or set %s=0)", LOOPBACK_ONLY_ENV)
    # The local cluster's processes (GCS, raylet, and the rank processes the raylet starts, which
    # inherit its signal mask) start with SIGTERM blocked, as Ray starts them with SIGINT blocked: a
    # scheduler's SIGTERM to the whole job reaches them too, and they must outlive it so that the
    # controller can finish the step and save (hybridflow.controller.preemption). They still end
    # with the driver (Ray's fate sharing) and by SIGKILL.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ray.init(
            address="local",  # never attach to a cluster found in RAY_ADDRESS or /tmp/ray by accident
            num_cpus=num_cpus,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            runtime_env=runtime_env,
            log_to_driver=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class NoRoomError(RuntimeError):
    """The Ray cluster could not fit a placement group's bundles in time."""


class ResourcePool:
    """One bundle per data-parallel rank (1 CPU, plus 1 GPU on GPU runs), in placement groups.

    ``nnodes=1``: one placement group of every bundle, by ``strategy`` (PACK: Ray fills a node, then
    the next). ``nnodes=N`` (``trainer.nnodes``): N placement groups of ``num_bundles / N`` bundles,
    each ``STRICT_PACK`` (all on one node) and each on a node no other group of the pool holds, as
    verl's per-node pools: with k bundles a node, ranks ``i*k .. (i+1)*k-1`` share node i
    (``strategy`` is then not used).

    Rank r of every role placed on the pool runs in bundle r, so colocated roles share a
    device; each takes ``share`` of the bundle (fractional CPU/GPU).
    """

    def __init__(self, num_bundles: int, *, use_gpu: bool, nnodes: int = 1, cpus_per_bundle: float = 1.0,
                 timeout_s: float = PLACEMENT_TIMEOUT_S, strategy: str = "PACK") -> None:
        if num_bundles < 1:
            raise ValueError(f"a resource pool needs at least one bundle, got {num_bundles}")
        if nnodes < 1 or num_bundles % nnodes:
            raise ValueError(f"trainer.nnodes={nnodes} must divide the pool's {num_bundles} bundles (ranks): each node "
                             f"holds the same number")
        self.num_bundles, self.use_gpu, self.cpus_per_bundle = num_bundles, use_gpu, cpus_per_bundle
        self.nnodes, self.bundles_per_node = nnodes, num_bundles // nnodes
        self._closed = False
        self.bundle = {"CPU": cpus_per_bundle, **({"GPU": 1.0} if use_gpu else {})}
        self.groups: list[PlacementGroup] = []  # group i holds bundles i*bundles_per_node .. (i+1)*bundles_per_node-1
        self.node_ids: list[str] = []  # group i's node (nnodes > 1; a PACK group may span nodes)
        deadline = time.monotonic() + timeout_s
        try:
            if nnodes == 1:
                self.groups.append(self._reserve(num_bundles, strategy, deadline, timeout_s))
            else:
                for _ in range(nnodes):
                    self.groups.append(self._reserve(self.bundles_per_node, "STRICT_PACK", deadline, timeout_s))
                    self.node_ids.append(_node_of(self.groups[-1]))
        except BaseException:
            self.close()
            raise
        if nnodes > 1:
            log.info("resource pool: %d node(s) of %d bundle(s) each: %s", nnodes, self.bundles_per_node,
                     ", ".join(self.node_ids))

    def _reserve(self, count: int, strategy: str, deadline: float, timeout_s: float) -> PlacementGroup:
        """One placement group of ``count`` bundles, ready by ``deadline`` (else ``NoRoomError``).

        Different node groups land on different nodes by Ray's own node-id label: each group after
        the first carries the label selector ``ray.io/node-id: !in(<nodes taken>)``, so Ray places it
        on another node or waits for one. The alternatives are weaker: Ray has no STRICT_SPREAD
        between placement groups, node affinity for a placement group is only a soft hint, a custom
        resource per node needs every node of an existing cluster started with one, and a check
        after placement would refuse a run Ray could have placed. Greedy is complete here: the
        groups are alike, so whichever fitting node one takes, every other fitting node still fits
        the next."""
        import ray
        from ray.util.placement_group import placement_group

        away = [{NODE_ID_LABEL: f"!in({','.join(self.node_ids)})"} for _ in range(count)] if self.node_ids else None
        group = placement_group([dict(self.bundle) for _ in range(count)], strategy=strategy,
                                bundle_label_selector=away)
        try:
            ray.get(group.ready(), timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError as exc:
            ray.util.remove_placement_group(group)
            raise NoRoomError(self._no_room(strategy, timeout_s)) from exc
        return group

    def _no_room(self, strategy: str, timeout_s: float) -> str:
        import ray

        if self.nnodes == 1:
            layout = f"{self.num_bundles} bundles of {self.bundle} (one placement group, {strategy})"
        else:
            taken = f"; placed on {', '.join(self.node_ids)}, no other node had room" if self.node_ids else ""
            layout = (f"trainer.nnodes={self.nnodes} nodes of {self.bundles_per_node} bundles of {self.bundle} each "
                      f"(each node's bundles together on one node, each node a different one{taken})")
        nodes = "; ".join(f"{n['NodeID'][:12]} {n['Resources']}" for n in ray.nodes() if n["Alive"])
        return (f"the Ray cluster cannot fit {layout} within {timeout_s:.0f}s (available: {ray.available_resources()}; "
                f"nodes: {nodes}); lower trainer.n_workers / trainer.n_gpus_per_node / trainer.nnodes or add nodes")

    def actor_options(self, bundle: int, share: float, *, gpu: bool = True) -> dict[str, Any]:
        """Ray actor options placing one rank in ``bundle`` with ``share`` of its resources."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= bundle < self.num_bundles:
            raise IndexError(f"the pool has bundles 0..{self.num_bundles - 1}, not {bundle}")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        group, index = divmod(bundle, self.bundles_per_node)
        return {
            "num_cpus": self.cpus_per_bundle * share,
            "num_gpus": share if (self.use_gpu and gpu) else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.groups[group], placement_group_bundle_index=index
            ),
        }

    def close(self) -> None:
        """Give the reserved resources back (once; later calls do nothing)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized() and not self._closed:
            for group in self.groups:
                remove_placement_group(group)
        self._closed = True


def _node_of(group: PlacementGroup) -> str:
    """The node a STRICT_PACK placement group's bundles sit on."""
    from ray.util.placement_group import placement_group_table

    nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
    if len(nodes) != 1:  # STRICT_PACK promises one node; say so rather than mislabel ranks
        raise RuntimeError(f"a STRICT_PACK placement group spans nodes {sorted(nodes)}")
    return nodes.pop()


@dataclass(frozen=True)
class Placement:
    """Where and how a group's ranks run: rank r in bundle ``first_bundle + r`` of ``pool`` with
    ``share`` of it, ``num_threads`` torch threads each, computing on ``device`` (which also picks
    the process group backend: NCCL for CUDA, gloo otherwise)."""

    pool: ResourcePool
    share: float
    num_threads: int
    device: torch.device
    first_bundle: int = 0  # a group on part of the pool (one rollout replica of several)
    # trainer.hybrid_engine: the pool's shared processes, one per bundle, that the group's ranks
    # join (a ``role_hosts.RoleHosts``, which imports this module: not named here, no import cycle;
    # ``role_hosts.HostedWorkerGroup``); None: each rank a process of its own.
    hosts: Any = None

    def from_bundle(self, first_bundle: int) -> Placement:
        """The same placement for a group whose rank 0 sits in ``first_bundle``."""
        return dataclasses.replace(self, first_bundle=first_bundle)


@dataclass(frozen=True)
class ElasticPlacement:
    """Where the groups of a role that grows and shrinks with the cluster go (``rollout.elastic``):
    each group in a placement group of its own, ``bundles`` bundles on one node (``STRICT_PACK``: a
    tensor-parallel replica's ranks talk every step), so that one group's reservation is given back
    alone when its node leaves, and a node that joins takes new ones."""

    bundles: int
    use_gpu: bool
    num_threads: int
    device: torch.device

    def reserve(self, wait: bool) -> Placement | None:
        """A placement for one group: ``wait``, for room as long as a fixed pool waits
        (``NoRoomError`` past it); else None unless Ray places it within ``ROOM_WAIT_S``."""
        try:
            pool = ResourcePool(self.bundles, use_gpu=self.use_gpu, strategy="STRICT_PACK",
                                timeout_s=PLACEMENT_TIMEOUT_S if wait else ROOM_WAIT_S)
        except NoRoomError:
            if wait:
                raise
            return None
        return Placement(pool, share=1.0, num_threads=self.num_threads, device=self.device)

    def has_free_room(self) -> bool:
        """Whether the cluster's free resources, all nodes together, hold one group's bundles: a
        cheap first look, so that a full cluster costs no wait (one node must still hold them all)."""
        import ray

        free = ray.available_resources()
        return free.get("CPU", 0.0) >= self.bundles and (not self.use_gpu or free.get("GPU", 0.0) >= self.bundles)


# -------------------------------------------------------------------------------- rank process
class HostProcess:
    """What each Ray process of ours is before it holds a worker: its torch threads set, transformers'
    progress bars off, and the facts the driver asks of it (where it runs, a port to meet at).
    ``RankHost`` holds one rank's worker, ``cluster.role_hosts.RoleHost`` the colocated roles' workers of
    one bundle."""

    def __init__(self, num_threads: int) -> None:
        torch.set_num_threads(max(1, num_threads))
        # Every load and save in this process is ours: no transformers bars in the driver's console.
        disable_hf_progress_bars()

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port): rank 0's is where the process group meets."""
        import ray

        return ray.util.get_node_ip_address(), distributed.free_port()

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node(self) -> RankNode:
        import ray

        return RankNode(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())


class RankHost(HostProcess):
    """The process of one rank: joins the group's process group, then hosts one worker object."""

    def __init__(self, role: str, rank: int, world_size: int, num_threads: int) -> None:
        super().__init__(num_threads)
        self.role, self.rank, self.world_size = role, rank, world_size
        self.worker: Any = None

    def start(
        self, factory: Callable[[int, int], Any], master_addr: str, master_port: int, device: torch.device
    ) -> None:
        configure_host_allocator(device)  # before the worker builds its model
        # A single rank has no peers: it needs no process group (and then runs the plain engine).
        if self.world_size > 1:
            distributed.init_process_group(rank=self.rank, world_size=self.world_size, master_addr=master_addr,
                                           master_port=master_port, device=device)
        self.worker = factory(self.rank, self.world_size)

    def execute(self, method: Callable[..., R], payload: tuple[tuple, dict[str, Any]]) -> R:
        """``method(worker, *args, **kwargs)``; ``payload`` = (args, kwargs), which Ray resolves
        here when the controller passed it as one object-store reference."""
        args, kwargs = payload
        with profiler_range(f"{self.role}/{getattr(method, '__name__', 'call')}"):
            return method(self.worker, *args, **kwargs)


# --------------------------------------------------------------------------------- the group
class RayWorkerGroup(Generic[W]):
    """``world_size`` ranks of one role, each a Ray actor; same calls as ``LocalWorkerGroup``."""

    def __init__(self, role: str, factory: Callable[[int, int], W], world_size: int, placement: Placement) -> None:
        import ray

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if placement.first_bundle + world_size > placement.pool.num_bundles:
            raise ValueError(f"{role}: {world_size} ranks from bundle {placement.first_bundle} on a pool of "
                             f"{placement.pool.num_bundles} bundles")
        self.role = role
        self._failed: str | None = None
        self._nodes: list[RankNode] = []  # where each rank runs, once they all started
        host_cls = ray.remote(RankHost)
        self._ranks: list[ActorHandle] = [
            host_cls.options(
                max_restarts=0,  # a dead rank is reported, never silently replaced
                **placement.pool.actor_options(placement.first_bundle + rank, placement.share,
                                               gpu=placement.device.type == "cuda"),
            ).remote(role, rank, world_size, placement.num_threads)
            for rank in range(world_size)
        ]
        start = time.perf_counter()
        try:
            self._start(factory, placement.device)
        except BaseException:
            self.close()  # nobody else holds these processes: a failed start must not leak them
            raise
        # Where each rank landed (placement.json in the run folder; a multi-node run's first question).
        self._nodes: list[RankNode] = RayPendingCall(
            self, [(rank, handle.node.remote()) for rank, handle in enumerate(self._ranks)], "node").wait()
        log.info("%s: %d Ray rank(s) up in %.1fs on %d node(s)", role, world_size, time.perf_counter() - start,
                 len({node.node_id for node in self._nodes}))

    def _start(self, factory: Callable[[int, int], W], device: torch.device) -> None:
        """Rank 0 picks the rendezvous (loopback when every rank is on its node), then all ranks
        join the process group and build their worker together."""
        addr, port = self.rendezvous(0)
        master = meeting_host(addr, self.node_addresses())
        refs = [(r, h.start.remote(factory, master, port, device)) for r, h in enumerate(self._ranks)]
        RayPendingCall(self, refs, f"{self.role}.__init__").wait()

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    # ---------------------------------------------------------------- protocol
    def call_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return self.submit_all(method, *args, **kwargs).wait()

    def call_one(self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return self.submit_one(rank, method, *args, **kwargs).wait()[0]

    def call_each(self, method: Callable[..., R], per_rank_args: Sequence[tuple], **kwargs: Any) -> list[R]:
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{self.role}: {len(per_rank_args)} argument tuples for {self.world_size} ranks")
        return self._submit([(rank, (tuple(args), kwargs)) for rank, args in enumerate(per_rank_args)], method).wait()

    def split_gather(self, method: Callable[[W, TrainBatch], R], batch: TrainBatch) -> list[R]:
        shards = batch.chunk(self.world_size)
        return self._submit([(rank, ((shard,), {})) for rank, shard in enumerate(shards)], method).wait()

    def submit_all(
        self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> RayPendingCall[R]:
        import ray

        payload = ray.put((args, kwargs))  # one copy in the object store, however many ranks
        return self._submit([(rank, payload) for rank in range(self.world_size)], method)

    def submit_one(
        self, rank: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> RayPendingCall[R]:
        self._check_rank(rank)
        refuse_collective(self.role, method)
        return self._submit([(rank, (args, kwargs))], method)

    def node_addresses(self) -> list[str]:
        refs = [(rank, handle.node_address.remote()) for rank, handle in enumerate(self._ranks)]
        return RayPendingCall(self, refs, "node_address").wait()

    def nodes(self) -> list[RankNode]:
        return list(self._nodes)

    def where(self, rank: int) -> str:
        """Rank ``rank``'s node in words ("" before the ranks started): a dead rank's error names it."""
        return f" on {self._nodes[rank].describe()}" if rank < len(self._nodes) else ""

    def rendezvous(self, rank: int) -> tuple[str, int]:
        self._check_rank(rank)
        return RayPendingCall(self, [(rank, self._ranks[rank].rendezvous.remote())], "rendezvous").wait()[0]

    def close(self) -> None:
        """End every rank's process (safe to call twice, and after a failure)."""
        import ray

        if ray.is_initialized():
            for handle in self._ranks:
                ray.kill(handle, no_restart=True)
        self._failed = self._failed or "the group was closed"

    # ---------------------------------------------------------------- internals
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.role} has ranks 0..{self.world_size - 1}, not {rank}")

    def _submit(self, calls: list[tuple[int, Any]], method: Callable[..., R]) -> RayPendingCall[R]:
        """Start ``method`` on the listed ranks with their (args, kwargs), or an object-store
        reference to them; the pending call's results come in the order of ``calls``."""
        name = getattr(method, "__qualname__", repr(method))
        if self._failed is not None:
            raise WorkerError(f"{self.role} cannot run {name}: {self._failed}")
        refs = [(rank, self._execute(rank, method, payload)) for rank, payload in calls]
        return RayPendingCall(self, refs, name)

    def _execute(self, rank: int, method: Callable[..., Any], payload: Any) -> Any:
        """Start ``method`` on ``rank``'s worker; its ObjectRef (a process of the rank's own here;
        ``role_hosts.HostedWorkerGroup`` reaches its worker in a process shared with other roles)."""
        return self._ranks[rank].execute.remote(method, payload)

    def _tear_down(self, reason: str) -> None:
        """Close the group and make later calls fail with ``reason``."""
        self.close()
        self._failed = reason


class RayPendingCall(Generic[R]):
    """A call running on some ranks of a ``RayWorkerGroup``: ``refs`` holds (rank, ObjectRef)."""

    def __init__(self, group: RayWorkerGroup[Any], refs: list[tuple[int, Any]], name: str) -> None:
        self.group, self.refs, self.name = group, refs, name

    @property
    def label(self) -> str:
        return f"{self.group.role} rank {','.join(str(rank) for rank, _ in self.refs)} {self.name}"

    def wait(self) -> list[R]:
        return wait_ray_calls(self)[0]

    @staticmethod
    def wait_together(*calls: PendingCall[Any]) -> list[list[Any]]:
        return wait_ray_calls(*calls)

    @staticmethod
    def wait_each(*calls: PendingCall[Any]) -> Iterator[tuple[int, list[Any] | WorkerError]]:
        return wait_ray_calls_each(*calls)


@dataclass(frozen=True)
class _Failure:
    order: int  # the call's position in wait_ray_calls: ties between calls go to the first
    call: RayPendingCall[Any]
    rank: int
    error: Exception


def wait_ray_calls(*calls: PendingCall[Any]) -> list[list[Any]]:
    """Results of each call (in rank order), waiting on all their ranks at once.

    The first failure (in completion order, so a dead rank is reported while its peers still
    wait on it) raises ``WorkerError`` at once, after a short grace for the peers' own failures.
    """
    import ray

    ray_calls = [_as_ray_call(call) for call in calls]
    pending = {ref: (c, i) for c, call in enumerate(ray_calls) for i, (_, ref) in enumerate(call.refs)}
    results: list[list[Any]] = [[None] * len(call.refs) for call in ray_calls]
    # The watchdog names these calls if the phase around them stalls.
    with activity("call", "; ".join(call.label for call in ray_calls)):
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            failures = _collect(ready, pending, ray_calls, results)
            if failures:
                failures += _await_peer_failures(list(pending), failures, pending, ray_calls, results)
                stuck = {ray_calls[c].group for c, _ in pending.values()}
                raise _fail(failures, stuck)
    return results


def wait_ray_calls_each(*calls: PendingCall[Any]) -> Iterator[tuple[int, list[Any] | WorkerError]]:
    """Each call's results or ``WorkerError`` as it completes (``worker_group.wait_each``): calls
    fail alone. A failed call's other ranks get the grace of ``wait_ray_calls`` for their own
    errors; a multi-rank group with a failed rank is torn down, as is one still blocked after it."""
    import ray

    ray_calls = [_as_ray_call(call) for call in calls]
    pending = {ref: (c, i) for c, call in enumerate(ray_calls) for i, (_, ref) in enumerate(call.refs)}
    results: list[list[Any]] = [[None] * len(call.refs) for call in ray_calls]
    left = [len(call.refs) for call in ray_calls]
    with activity("call", "; ".join(call.label for call in ray_calls)):
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            done = [pending[ref][0] for ref in ready]
            failures = _collect(ready, pending, ray_calls, results)
            for c in done:
                left[c] -= 1
            for c in sorted({f.order for f in failures}):
                own = [f for f in failures if f.order == c]
                peers = [ref for ref, (cc, _) in pending.items() if cc == c]
                own += _await_peer_failures(peers, own, pending, ray_calls, results)
                stuck = {ref for ref, (cc, _) in pending.items() if cc == c}
                for ref in stuck:  # blocked on the failed rank: the group is torn down below
                    del pending[ref]
                left[c] = -1
                yield c, _fail(own, {ray_calls[c].group} if stuck else set())
            for c in sorted(set(done)):
                if left[c] == 0:
                    yield c, results[c]


def _as_ray_call(call: PendingCall[Any]) -> RayPendingCall[Any]:
    if not isinstance(call, RayPendingCall):
        raise TypeError(f"wait_all cannot wait on a {type(call).__name__} together with Ray calls; use its wait()")
    return call


def _collect(
    ready: list[Any], pending: dict[Any, tuple[int, int]], calls: list[RayPendingCall[Any]], results: list[list[Any]]
) -> list[_Failure]:
    """Move finished refs out of ``pending``: values into ``results``, errors returned with their rank."""
    import ray

    failures: list[_Failure] = []
    for ref in ready:
        c, index = pending.pop(ref)
        try:
            results[c][index] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            failures.append(_Failure(c, calls[c], calls[c].refs[index][0], exc))
    return failures


def _await_peer_failures(
    peers: list[Any], failures: list[_Failure], pending: dict[Any, tuple[int, int]], calls: list[RayPendingCall[Any]],
    results: list[list[Any]],
) -> list[_Failure]:
    """The failures among ``peers`` that follow ``failures`` closely: all of them within
    ``FAILURE_GRACE_S``, then, while no failure in hand is a death, the first death within
    ``DEATH_GRACE_S`` (returning as soon as one is seen, or when no peer is left running)."""
    import ray

    if not peers:
        return []
    late, _ = ray.wait(peers, num_returns=len(peers), timeout=FAILURE_GRACE_S)
    found = _collect(late, pending, calls, results)
    deadline = time.monotonic() + DEATH_GRACE_S - FAILURE_GRACE_S
    left = [ref for ref in peers if ref in pending]

    def died() -> bool:
        return any(isinstance(f.error, ray.exceptions.RayActorError) for f in failures + found)

    while left and not died() and (wait := deadline - time.monotonic()) > 0:
        ready, _ = ray.wait(left, num_returns=1, timeout=wait)
        if not ready:
            break
        found += _collect(ready, pending, calls, results)
        left = [ref for ref in left if ref in pending]
    return found


def _fail(failures: list[_Failure], stuck: set[RayWorkerGroup[Any]]) -> WorkerError:
    """One error naming the root cause first: a rank whose process died, else the first call's
    lowest rank. Tears down every group that cannot take another call: a multi-rank group with a
    failed rank, and a group in ``stuck`` (still running, so blocked on the failed side)."""
    import ray

    failures = sorted(failures, key=lambda f: (not isinstance(f.error, ray.exceptions.RayActorError), f.order, f.rank))
    first = failures[0]
    message = describe_ray_error(first.call.group.role, first.rank, first.call.name, first.error,
                                 first.call.group.where(first.rank))
    others = [f"{f.call.group.role} rank {f.rank}: {type(f.error).__name__}" for f in failures[1:]]
    if others:
        message += f"\n(also failed: {', '.join(others)})"
    for group in {f.call.group for f in failures} | stuck:
        own = next((f for f in failures if f.call.group is group), None)
        if own is not None and group.world_size > 1:
            # Peers of a failed rank may sit in a collective that can no longer complete.
            group._tear_down(f"rank {own.rank} failed earlier in {own.call.name}")
        elif own is None:
            # Still running after the grace: blocked in a collective with the failed side.
            group._tear_down(f"it was left waiting on {first.call.group.role} rank {first.rank}, which failed "
                             f"earlier in {first.call.name}")
    error = WorkerError(message, process_died=isinstance(first.error, ray.exceptions.RayActorError))
    error.__cause__ = first.error
    return error


def describe_ray_error(role: str, rank: int, method: str, exc: Exception, where: str = "") -> str:
    """The controller's message for a rank's failure: who, where, and the worker's own error.
    ``where``: " on node ..." (``RayWorkerGroup.where``), named when the rank's process died: a
    lost node takes every rank on it, and the node is then the thing to look at."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if exc.cause is not None else exc
        remote = str(exc).strip().splitlines()
        return f"{role} rank {rank} failed in {method}: {cause!r}\n" + "\n".join(remote[-20:])
    if isinstance(exc, ray.exceptions.RayActorError):
        detail = " ".join(str(exc).split())
        return f"{role} rank {rank}{where} died in {method} (its process exited): {detail}"
    return f"{role} rank {rank} failed in {method}: {exc!r}"
