"""Non-blocking calls, the two sides of a cross-group collective: ``submit_all`` / ``submit_one``
start a call and return, ``wait_all`` waits on several groups at once. On Ray both sides really
run together (they meet in one gloo group, which only forms when every member is in it), and a
rank that raises is a prompt ``WorkerError`` even while the other side is blocked waiting for it:
that side is torn down instead of hanging. In-process groups run a submitted call at once."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hybridflow.cluster.ray_group import LOOPBACK_ONLY_ENV
from hybridflow.cluster.worker_group import (
    LocalWorkerGroup,
    WorkerError,
    WorkerGroup,
    meeting_host,
    wait_all,
)
from hybridflow.transfer.weight_transfer import WeightSyncGroup

# Ray decides at import whether a local head binds 127.0.0.1 only; ask before importing it.
os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")

MEET_TIMEOUT_S = 20.0  # a member that never comes: the others raise after this (the last resort)
PROMPT_S = 15.0  # a failure must surface well before MEET_TIMEOUT_S, through Ray, not the transport


class Peer:
    """A worker that meets the ranks of another group in one gloo group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank

    def meet(self, host: str, port: int, members: int, first_member: int) -> list[str | None]:
        """Join as member ``first_member + rank`` and return every member's name, in member order."""
        group = WeightSyncGroup.connect(rank=first_member + self.rank, world_size=members, host=host, port=port,
                                        timeout_s=MEET_TIMEOUT_S)
        try:
            return group.all_gather_text(f"member {group.rank}")
        finally:
            group.close()

    def meet_unless_rank_1(self, host: str, port: int, members: int, first_member: int) -> list[str | None]:
        if self.rank == 1:
            raise ValueError("no weights here")
        return self.meet(host, port, members, first_member)

    def fail_at_once(self) -> None:
        raise RuntimeError("Connection closed by peer")  # what a collective says when a member vanished

    def exit_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os._exit(1)  # the process dies; Ray's notice of it comes after the peer's own error

    def double(self, value: int) -> int:
        if value < 0:
            raise ValueError(f"negative: {value}")
        return 2 * value + self.rank


# ------------------------------------------------------------------------------- in-process
def test_local_submit_runs_at_once_and_wait_returns_or_raises() -> None:
    group: WorkerGroup[Peer] = LocalWorkerGroup("peer", Peer, world_size=2)
    assert group.submit_all(Peer.double, 5).wait() == [10, 11]
    assert group.submit_one(1, Peer.double, value=3).wait() == [7]
    failed = group.submit_all(Peer.double, -1)  # the error is kept for wait, as on Ray
    with pytest.raises(WorkerError, match=r"peer rank 0 failed in Peer.double: ValueError\('negative: -1'\)"):
        failed.wait()
    assert wait_all(group.submit_all(Peer.double, 1), group.submit_one(0, Peer.double, 2)) == [[2, 3], [4]]
    with pytest.raises(IndexError):
        group.submit_one(2, Peer.double, 1)
    assert group.node_addresses() == ["127.0.0.1", "127.0.0.1"]
    host, port = group.rendezvous(0)
    assert host == "127.0.0.1" and 0 < port < 65536


def test_peers_dial_loopback_only_when_all_share_the_listeners_node() -> None:
    assert meeting_host("10.0.0.1", ["10.0.0.1", "10.0.0.1"]) == "127.0.0.1"
    assert meeting_host("10.0.0.1", ["10.0.0.1", "10.0.0.2"]) == "10.0.0.1"


# ------------------------------------------------------------------------------------- Ray
# Four tests share one module-scoped local Ray cluster (the fixture below): one pytest worker runs the module,
# instead of each worker that draws one of them starting a cluster of its own (this file alone on 2 workers:
# 64.0 worker-seconds before, 48.8 with the group).
pytestmark = pytest.mark.xdist_group("weight_sync_ray_pool")


@pytest.fixture(scope="module")
def pool():
    pytest.importorskip("ray")
    import ray

    from hybridflow.cluster.ray_group import ResourcePool, init_ray

    init_ray(None, dashboard=False, num_cpus=2)
    pool = ResourcePool(2, use_gpu=False)
    yield pool
    pool.close()
    ray.shutdown()


def _group(pool, role: str, ranks: int) -> WorkerGroup[Peer]:
    from hybridflow.cluster.ray_group import Placement, RayWorkerGroup

    return RayWorkerGroup(role, Peer, ranks, Placement(pool, share=0.5, num_threads=1, device=torch.device("cpu")))


def _groups(pool) -> tuple[WorkerGroup[Peer], WorkerGroup[Peer]]:
    """A one-rank sender and a two-rank receiver group, colocated over the pool's two bundles."""
    return _group(pool, "sender", 1), _group(pool, "receiver", 2)


def _where(sender: WorkerGroup[Peer], receiver: WorkerGroup[Peer]) -> tuple[str, int]:
    address, port = sender.rendezvous(0)
    return meeting_host(address, receiver.node_addresses()), port


@pytest.mark.slow  # a Ray cluster and rank processes: seconds each
def test_ray_submit_runs_both_sides_together_and_returns_results(pool) -> None:
    sender, receiver = _groups(pool)
    try:
        host, port = _where(sender, receiver)
        # Had submit waited for its result, the sender would block alone in the rendezvous.
        sent, received = wait_all(sender.submit_one(0, Peer.meet, host, port, 3, 0),
                                  receiver.submit_all(Peer.meet, host, port, 3, 1))
        members = ["member 0", "member 1", "member 2"]
        assert sent == [members] and received == [members, members]
        # The groups stay usable, and a single pending call waits like call_all.
        assert receiver.submit_all(Peer.double, 4).wait() == [8, 9] == receiver.call_all(Peer.double, 4)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.slow  # a Ray cluster and rank processes: seconds each
def test_ray_failure_on_one_side_is_prompt_and_tears_down_the_side_left_waiting(pool) -> None:
    sender, receiver = _groups(pool)
    host, port = _where(sender, receiver)
    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"receiver rank 1 failed in Peer.meet_unless_rank_1: "
                                          r"ValueError\('no weights here'\)"):
        wait_all(sender.submit_one(0, Peer.meet, host, port, 3, 0),
                 receiver.submit_all(Peer.meet_unless_rank_1, host, port, 3, 1))
    assert time.perf_counter() - start < PROMPT_S
    # The sender sat in a rendezvous that could never complete: torn down, not left to queue calls.
    with pytest.raises(WorkerError, match=r"sender cannot run Peer.double: it was left waiting on receiver rank 1"):
        sender.call_all(Peer.double, 1)
    with pytest.raises(WorkerError, match="receiver cannot run Peer.double: rank 1 failed earlier"):
        receiver.submit_all(Peer.double, 1)


@pytest.mark.slow  # a Ray cluster and rank processes: seconds each
def test_ray_failure_report_leads_with_a_death_that_ray_reports_after_the_peers_own_error(pool) -> None:
    """A replica killed inside a weight sync: the sender's collective fails at once ("connection
    closed"), Ray's notice of the death may come seconds later on a loaded machine. The report waits
    for it (``DEATH_GRACE_S``) and names the dead rank first, its victim after."""
    from hybridflow.cluster.ray_group import DEATH_GRACE_S, FAILURE_GRACE_S

    sender, dying = _group(pool, "sender", 1), _group(pool, "replica", 1)
    try:
        delay = FAILURE_GRACE_S + 2.0
        assert delay < DEATH_GRACE_S - 3.0
        start = time.perf_counter()
        with pytest.raises(WorkerError, match=r"(?s)replica rank 0.* died in Peer.exit_after \(its process exited\)"
                                              r".*also failed: sender rank 0: RayTaskError\(RuntimeError\)"):
            wait_all(sender.submit_one(0, Peer.fail_at_once), dying.submit_one(0, Peer.exit_after, delay))
        assert time.perf_counter() - start < DEATH_GRACE_S + 5.0
    finally:
        sender.close()
        dying.close()


@pytest.mark.slow  # a Ray cluster and rank processes: seconds each
def test_ray_wait_all_refuses_to_mix_in_process_calls(pool) -> None:
    sender = _group(pool, "sender", 1)
    local = LocalWorkerGroup("local", Peer)
    try:
        with pytest.raises(TypeError, match="CompletedCall together with Ray calls"):
            wait_all(sender.submit_all(Peer.double, 1), local.submit_all(Peer.double, 1))
    finally:
        sender.close()
