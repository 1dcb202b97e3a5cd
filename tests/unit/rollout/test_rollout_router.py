"""The replica router: placement by in-flight tokens (not request count), heaviest first,
sticky sessions, dead replicas avoided, and the load metrics."""

from __future__ import annotations

import pytest

from hybridflow.rollout.router import NoReplicaError, ReplicaRouter, RouteRequest


def test_tokens_not_request_count_decide_the_replica() -> None:
    router = ReplicaRouter(2)
    # One long request against three short ones: a request-count balance would put two short
    # requests next to the long one; by tokens the long one sits alone.
    requests = [RouteRequest(2000, 2, 16)] + [RouteRequest(20, 2, 16) for _ in range(3)]
    tickets = router.place(requests)
    assert tickets[0].replica == 0 and {t.replica for t in tickets[1:]} == {1}
    assert router.loads[0].in_flight_tokens == 2000 + 2 * 16
    assert router.loads[1].in_flight_tokens == 3 * (20 + 2 * 16)


def test_heaviest_first_gives_an_even_split_and_is_deterministic() -> None:
    sizes = [50, 40, 30, 30, 20, 20, 10]
    requests = [RouteRequest(s, 1, 1) for s in sizes]
    first, second = ReplicaRouter(2).place(requests), ReplicaRouter(2).place(requests)
    assert first == second
    loads = [sum(r.prompt_tokens + 1 for r, t in zip(requests, first) if t.replica == k) for k in (0, 1)]
    assert abs(loads[0] - loads[1]) <= 10  # 101 vs 106 tokens (+1 expected response token each)
    # Round-robin by position would have put 50+30+20+10 = 110 on one and 90 on the other.


def test_finished_requests_free_their_tokens_and_teach_the_expected_length() -> None:
    router = ReplicaRouter(2)
    request = RouteRequest(10, 4, 100)
    assert router.cost(request) == 10 + 4 * 100  # before anything finished: max_tokens
    (ticket,) = router.place([request])
    router.finish(ticket, generated_tokens=4 * 25, seconds=2.0)
    assert router.loads[ticket.replica].in_flight_tokens == 0
    assert router.cost(request) == 10 + 4 * 25  # the running mean of finished samples' lengths
    assert router.loads[ticket.replica].tokens_per_s == pytest.approx(50.0)


def test_an_abandoned_request_frees_its_tokens_without_teaching_anything() -> None:
    router = ReplicaRouter(1)
    request = RouteRequest(10, 2, 50)
    (ticket,) = router.place([request])
    router.abandon(ticket)
    assert router.loads[0].in_flight_tokens == 0 and router.loads[0].requests == 0
    assert router.cost(request) == 10 + 2 * 50


def test_in_flight_load_steers_later_requests() -> None:
    router = ReplicaRouter(2)
    (busy,) = router.place([RouteRequest(1000, 1, 1)])
    later = router.place([RouteRequest(10, 1, 1), RouteRequest(10, 1, 1)])
    assert all(t.replica != busy.replica for t in later)
    router.finish(busy, 1)
    (after,) = router.place([RouteRequest(10, 1, 1)])
    assert after.replica == busy.replica  # freed: now the least loaded


def test_a_session_sticks_to_its_replica_until_that_replica_dies() -> None:
    router = ReplicaRouter(3)
    (turn1,) = router.place([RouteRequest(100, 1, 10, session="episode-7")])
    # Load the session's replica heavily: the next turn still goes there (its KV cache is there).
    router.loads[turn1.replica].in_flight_tokens += 10_000
    (turn2,) = router.place([RouteRequest(150, 1, 10, session="episode-7")])
    assert turn2.replica == turn1.replica
    (fresh,) = router.place([RouteRequest(150, 1, 10)])
    assert fresh.replica != turn1.replica
    router.mark_dead(turn1.replica, "rollout rank died")
    (turn3,) = router.place([RouteRequest(200, 1, 10, session="episode-7")])
    assert turn3.replica != turn1.replica
    (turn4,) = router.place([RouteRequest(250, 1, 10, session="episode-7")])
    assert turn4.replica == turn3.replica  # the session moved with it
    router.end_session("episode-7")
    assert "episode-7" not in router._sessions


def test_sessions_are_forgotten_least_recently_used() -> None:
    router = ReplicaRouter(2, max_sessions=2)
    for name in ("a", "b", "c"):
        router.place([RouteRequest(10, 1, 1, session=name)])
    assert list(router._sessions) == ["b", "c"]


def test_dead_replicas_take_nothing_and_all_dead_is_an_error_naming_them() -> None:
    router = ReplicaRouter(2)
    router.mark_dead(1, "rollout rank 1 died in RolloutWorker.serve")
    assert {t.replica for t in router.place([RouteRequest(10, 1, 1) for _ in range(4)])} == {0}
    router.mark_dead(0, "rollout rank 0 failed")
    with pytest.raises(NoReplicaError, match="replica 1: rollout rank 1 died"):
        router.place([RouteRequest(10, 1, 1)])


def test_load_metrics() -> None:
    metrics = ReplicaRouter(2).metrics([3.0, 1.0], [300, 50])
    assert metrics["rollout/replica_load_imbalance"] == pytest.approx(300 / 175)  # tokens: 300 / mean(300, 50)
    assert metrics["perf/rollout/replica_busy_imbalance"] == pytest.approx(1.5)  # time: 3 / mean(3, 1)
    assert metrics["perf/rollout/replica_0/tokens_per_s"] == pytest.approx(100.0)
    assert metrics["perf/rollout/replica_1/tokens_per_s"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="2 replicas"):
        ReplicaRouter(2).metrics([1.0], [1])


def test_an_added_replica_takes_the_next_requests_and_a_removed_ones_slot_starts_empty() -> None:
    """rollout.elastic: a replica added on a node that joined holds nothing in flight, so the router
    fills it first; a removed replica's slot stays dead until a new replica takes it, its counters cleared."""
    router = ReplicaRouter(1)
    router.finish(router.place([RouteRequest(10, 1, 4)])[0], 4)
    busy = router.place([RouteRequest(10, 1, 4)])[0]
    assert router.add() == 1 and router.num_replicas == 2
    assert router.place([RouteRequest(10, 1, 4)])[0].replica == 1
    router.finish(busy, 4)
    router.mark_dead(0, "removed (rollout.elastic)")
    with pytest.raises(ValueError, match="replica 1 is alive"):
        router.add(1)
    assert router.add(0) == 0 and router.loads[0].alive and router.loads[0].requests == 0
    # Load figures over the replicas of the moment, each named by its slot.
    metrics = router.metrics([2.0], [100], replicas=[1])
    assert metrics["perf/rollout/replica_1/tokens_per_s"] == pytest.approx(50.0)
    assert "perf/rollout/replica_0/tokens_per_s" not in metrics


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaRouter(0)
