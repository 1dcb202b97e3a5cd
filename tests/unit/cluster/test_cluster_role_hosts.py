"""Colocated roles in one process per bundle (``cluster.role_hosts``, ``trainer.hybrid_engine``):
roles added by name share the bundle's process and the pool's process group, calls reach the right
role, one role closing leaves the others running, the last one ends the process, and a dead
process is reported naming every role it held."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from hybridflow.cluster.ray_group import LOOPBACK_ONLY_ENV
from hybridflow.cluster.worker_group import WorkerError

# Ray decides at import whether a local head binds 127.0.0.1 only; ask before importing it.
os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")

pytestmark = pytest.mark.slow  # a Ray cluster and its processes: seconds each
PROMPT_S = 30.0  # a death is reported in the bounded time of RayWorkerGroup's (DEATH_GRACE_S and a margin)


class Trainer:
    """A multi-rank role: its ranks sum over the pool's process group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.weights = torch.full((3,), float(rank + 1))

    def total(self) -> float:
        t = self.weights.clone()
        dist.all_reduce(t)
        return float(t.sum())

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os._exit(1)


class Server:
    """A one-rank role per bundle (a rollout replica): holds what a trainer hands it."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.held: torch.Tensor | None = None

    def pid(self) -> int:
        return os.getpid()

    def name(self, prefix: str) -> str:
        return f"{prefix} {self.held}"


def hand_over(trainer: Trainer, server: Server, scale: float) -> int:
    """The trainer's weights, gathered over the group, handed to the server beside it by reference."""
    full = torch.cat([torch.zeros(0), trainer.weights * scale])
    dist.all_reduce(full)
    server.held = full
    return trainer.rank


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster for this module's tests, shut down after them: a cluster left connected
    would be the one a later module's ``init_ray`` finds (it leaves a connected process as it is), with
    this module's CPU count (test_cluster_config's placement test once waited 30 s for 4 CPUs there)."""
    pytest.importorskip("ray")
    import ray

    from hybridflow.cluster.ray_group import init_ray

    init_ray(None, dashboard=False, num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture
def pool(local_ray):
    from hybridflow.cluster.ray_group import ResourcePool

    pool = ResourcePool(2, use_gpu=False)
    yield pool
    pool.close()


def _hosted(pool, hosts, role: str, cls, ranks: int, first_bundle: int = 0):
    from hybridflow.cluster.ray_group import Placement
    from hybridflow.cluster.role_hosts import HostedWorkerGroup

    return HostedWorkerGroup(role, cls, ranks, Placement(pool, share=0.5, num_threads=1, device=torch.device("cpu"),
                                                         first_bundle=first_bundle, hosts=hosts))


def _hosts(pool):
    from hybridflow.cluster.role_hosts import RoleHosts

    return RoleHosts(pool, num_threads=1, device=torch.device("cpu"))


def test_roles_share_one_process_per_bundle_and_calls_reach_their_role(pool) -> None:
    hosts = _hosts(pool)
    trainer = _hosted(pool, hosts, "actor", Trainer, 2)
    servers = [_hosted(pool, hosts, f"rollout replica {k}", Server, 1, first_bundle=k) for k in range(2)]
    try:
        assert hosts.processes_started == 2
        pids = trainer.call_all(Trainer.pid)
        assert len(set(pids)) == 2 and [s.call_one(0, Server.pid) for s in servers] == pids
        assert [n.pid for n in trainer.nodes()] == pids  # placement.json names the shared processes
        assert trainer.call_all(Trainer.total) == [9.0, 9.0]  # (1+2) x 3 over the pool's group
        # Each rank hands its gathered weights to the server in its own process, in one call.
        assert trainer.call_all_with(hand_over, [(s, 0) for s in servers], 2.0) == [0, 1]
        assert [s.call_one(0, Server.name, "held") for s in servers] == ["held tensor([6., 6., 6.])"] * 2
        with pytest.raises(ValueError, match="do not share a process"):
            trainer.call_all_with(hand_over, [(servers[1], 0), (servers[0], 0)], 1.0)
    finally:
        for group in (*servers, trainer):
            group.close()


def test_a_multi_rank_role_whose_ranks_are_not_the_pools_is_refused() -> None:
    """A host's process group is the pool's: a role of several ranks must be rank b of all bundles in bundle
    b (a tensor-parallel replica over part of the pool needs a group, hence processes, of its own)."""
    from hybridflow.cluster.role_hosts import RoleHost

    # (a device other than the CPU: configure_host_allocator leaves the test process's malloc alone)
    host = RoleHost(bundle=1, num_bundles=3, num_threads=1, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"tp rank 0 of 2 cannot share the process of bundle 1"):
        host.add("tp", 0, 2, Server)
    host.add("rollout replica 1", 0, 1, Server)  # one rank needs no group
    host.add("actor", 1, 3, Server)
    assert host.roles() == ["rollout replica 1 rank 0", "actor rank 1"]
    with pytest.raises(ValueError, match="actor already has a worker"):
        host.add("actor", 1, 3, Server)
    host.remove("actor")
    assert host.roles() == ["rollout replica 1 rank 0"]


def test_one_role_closing_leaves_the_others_and_the_last_ends_the_process(pool) -> None:
    hosts = _hosts(pool)
    trainer = _hosted(pool, hosts, "actor", Trainer, 2)
    reference = _hosted(pool, hosts, "reference", Trainer, 2)
    pids = trainer.call_all(Trainer.pid)
    trainer.close()
    with pytest.raises(WorkerError, match="actor cannot run Trainer.total: the group was closed"):
        trainer.call_all(Trainer.total)
    assert reference.call_all(Trainer.total) == [9.0, 9.0] and reference.call_all(Trainer.pid) == pids
    reference.close()
    # The last role gone, each process ends (this machine's: the local cluster's).
    deadline = time.monotonic() + PROMPT_S
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_dead_process_is_reported_naming_every_role_it_held(pool) -> None:
    hosts = _hosts(pool)
    trainer = _hosted(pool, hosts, "actor", Trainer, 2)
    servers = [_hosted(pool, hosts, f"rollout replica {k}", Server, 1, first_bundle=k) for k in range(2)]
    try:
        start = time.perf_counter()
        with pytest.raises(WorkerError) as failed:
            trainer.call_one(1, Trainer.die)
        assert time.perf_counter() - start < PROMPT_S
        message = str(failed.value)
        assert failed.value.process_died
        assert "actor rank 1 on node" in message and "died in Trainer.die (its process exited)" in message
        assert "(the process of bundle 1, pid" in message and "shared with rollout replica 1 rank 0)" in message
        # The actor's peers may sit in a collective with the dead rank: its processes end, and with them the
        # replicas there; each replica's report names the roles its process held and why it was ended.
        for k in range(2):
            with pytest.raises(WorkerError, match=rf"(?s)rollout replica {k} rank 0 on node .*\(the process of "
                                                  rf"bundle {k}, pid .*, shared with actor rank {k}; ended when actor "
                                                  rf"was torn down \(rank 1 failed earlier in Trainer.die\)\) died in "
                                                  rf"Server.pid \(its process exited\)") as lost:
                servers[k].call_one(0, Server.pid)
            assert lost.value.process_died
    finally:
        for group in (*servers, trainer):
            group.close()
