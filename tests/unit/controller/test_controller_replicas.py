"""Rollout replicas behind the router: the same trajectories with 1 or 2 replicas (per-request
seeds), requests spread by tokens, metrics, sleep between steps, a failing replica named, and an
elastic rollout's replicas coming and going with the same samples."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from hybridflow.cluster.worker_group import LocalWorkerGroup, WorkerError
from hybridflow.controller.replicas import ElasticReplicas, RolloutReplicas, replica_role
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.types import GenerationRequest, SamplingParams
from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1)
    return str(write_tiny_model(tmp_path_factory.mktemp("replicas") / "model", spec, seed=3))


def replicas(model_dir: str, count: int, *, free_cache_engine: bool = True, sleep_level: int = 1) -> RolloutReplicas:
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=32, seed=0)
    groups = [LocalWorkerGroup(replica_role(k), lambda r, w: RolloutWorker(r, w, setup)) for k in range(count)]
    return RolloutReplicas(groups, free_cache_engine=free_cache_engine, sleep_level=sleep_level)


def requests() -> list[GenerationRequest]:
    # Prompts of different lengths, sampled (temperature 1) with per-request seeds, as the RL loop sends them.
    return [GenerationRequest(list(range(3, 3 + 4 + 7 * (i % 4))), SamplingParams(n=3, max_tokens=12, seed=100 + i))
            for i in range(8)]


def _tokens(groups) -> list[list[tuple[list[int], list[float]]]]:
    return [[(t.response_ids, t.rollout_logprobs) for t in group] for group in groups]


def test_one_or_two_replicas_generate_the_same_trajectories(model_dir) -> None:
    one, two = replicas(model_dir, 1), replicas(model_dir, 2)
    a, b = one.generate(requests()), two.generate(requests())
    assert [[t.response_ids for t in g] for g in a] == [[t.response_ids for t in g] for g in b]
    for group_a, group_b in zip(a, b, strict=True):
        for ta, tb in zip(group_a, group_b, strict=True):
            assert ta.rollout_logprobs == pytest.approx(tb.rollout_logprobs, abs=1e-5)
    # Both replicas served: every request went to one of them by load.
    loads = two.router.loads
    assert loads[0].requests > 0 and loads[1].requests > 0
    assert loads[0].requests + loads[1].requests == len(requests())


def test_round_metrics_and_token_counts(model_dir) -> None:
    two = replicas(model_dir, 2)
    groups = two.generate(requests())
    metrics = two.take_metrics()
    generated = sum(len(t.response_ids) for g in groups for t in g)
    assert metrics["rollout/generated_tokens"] == generated
    assert metrics["rollout/prefill_tokens"] > 0
    assert 0.0 <= metrics["rollout/prefix_cache_hit_rate"] <= 1.0
    assert metrics["rollout/replica_load_imbalance"] >= 1.0
    assert metrics["perf/rollout/replica_0/tokens_per_s"] > 0 and metrics["perf/rollout/replica_1/tokens_per_s"] > 0
    assert two.take_metrics() == {}  # taken


def test_sleep_frees_the_kv_caches_and_the_next_generation_wakes_them(model_dir) -> None:
    two = replicas(model_dir, 2)
    first = two.generate(requests())
    engines = [group.call_one(0, _engine) for group in two.groups]
    assert all(e.kv_cache_bytes > 0 for e in engines)
    two.sleep()
    assert all(e.kv_cache_bytes == 0 for e in engines)
    again = two.generate(requests())
    assert _tokens(again) == _tokens(first)
    kept = replicas(model_dir, 1, free_cache_engine=False)
    kept.generate(requests())
    kept.sleep()  # rollout.free_cache_engine=false: a no-op
    assert kept.groups[0].call_one(0, _engine).kv_cache_bytes > 0


def test_sleep_level_two_drops_the_weights_until_the_next_sync_brings_them(model_dir) -> None:
    two = replicas(model_dir, 2, sleep_level=2)
    first = two.generate(requests())
    engines = [group.call_one(0, _engine) for group in two.groups]
    held = [e.weight_bytes for e in engines]
    two.sleep()
    assert all(before > 0 for before in held) and all(e.weight_bytes == 0 for e in engines)
    two.update_weights(load_causal_lm(model_dir).state_dict().items())  # what the sync after the update does
    assert [e.weight_bytes for e in engines] == held
    assert _tokens(two.generate(requests())) == _tokens(first)


def test_the_prefix_cache_hit_rate_reaches_the_metrics(model_dir) -> None:
    one = replicas(model_dir, 1)
    first = [GenerationRequest(list(range(3 + i, 43 + i)), SamplingParams(n=1, max_tokens=12, seed=i)) for i in range(4)]
    answers = one.generate(first)
    assert one.take_metrics()["rollout/prefix_cache_hit_rate"] == 0.0  # nothing cached yet
    # Each episode's next turn: its prompt, the sampled response and a tool reply.
    turns = [GenerationRequest(r.prompt_ids + a[0].response_ids + [7] * 5, SamplingParams(n=1, max_tokens=4, seed=1))
             for r, a in zip(first, answers, strict=True)]
    one.generate(turns)
    assert one.take_metrics()["rollout/prefix_cache_hit_rate"] > 0.5


def _engine(worker: RolloutWorker):
    return worker.engine


def _break_engine(replicas: RolloutReplicas, k: int) -> None:
    """Replica ``k``'s engine raises on every request (its process lives on)."""
    async def fail(request):
        raise RuntimeError("engine crashed")

    replicas.groups[k].call_one(0, _engine).generate = fail


def test_a_failing_replica_is_named_and_marked_dead(model_dir) -> None:
    two = replicas(model_dir, 2)
    _break_engine(two, 1)
    with pytest.raises(WorkerError, match="rollout replica 1 rank 0 failed in RolloutWorker.serve"):
        two.generate(requests())
    assert [load.alive for load in two.router.loads] == [True, False]
    # The router places nothing more on it: the next round runs on replica 0 alone (what replica 0
    # finished of the failed round counts as done).
    served = two.router.loads[0].requests
    again = two.generate(requests())
    assert len(again) == len(requests()) and two.router.loads[0].requests - served == len(requests())
    assert two.router.loads[1].requests == 0
    assert two.router.loads[0].in_flight_tokens == 0


def test_each_replica_serving_a_round_is_a_span_of_the_timeline(model_dir) -> None:
    from hybridflow.tracking.timeline import Timeline, summarize_timeline

    two = replicas(model_dir, 2)
    two.timeline = Timeline()
    groups = two.generate(requests())
    spans = [e for e in two.timeline.events() if e["ph"] == "X"]
    assert sorted(e["tid"] for e in spans) == [0, 1] and {e["name"] for e in spans} == {"serve"}
    assert sum(e["args"]["tokens"] for e in spans) == sum(len(t.response_ids) for g in groups for t in g)
    assert {t.track for t in summarize_timeline(two.timeline.events()).tracks} == {
        "rollout replica 0", "rollout replica 1"}
    # In this process the replicas run one after the other: replica 1 starts when replica 0 ends.
    first, second = sorted(spans, key=lambda e: e["tid"])
    assert second["ts"] >= first["ts"] + first["dur"] - 1.0


# ------------------------------------------------------------------------------ recovery
class MortalGroup(LocalWorkerGroup):
    """An in-process replica whose "process" dies at its first call of ``dies_in`` (the boundary
    a Ray rank's death crosses: the call, and every later one, fails as a dead rank's does)."""

    def __init__(self, role, factory, dies_in=None) -> None:
        super().__init__(role, factory)
        self.dies_in, self.dead = dies_in, False

    def _call(self, rank, method, *args, **kwargs):
        if method is self.dies_in:
            self.dead = True
        if self.dead:
            raise WorkerError(f"{self.role} rank {rank} died in {method.__qualname__} (its process exited)",
                              process_died=True)
        return super()._call(rank, method, *args, **kwargs)


def mortal(model_dir: str, count: int, dies: dict[int, object], max_restarts: int = 1) -> RolloutReplicas:
    """``count`` replicas, replica k dying in ``dies[k]``; restarted ones are sound."""
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=32, seed=0)
    built: list[int] = []

    def build(k: int) -> MortalGroup:
        dies_in = dies.get(k) if k not in built else None
        built.append(k)
        return MortalGroup(replica_role(k), lambda r, w: RolloutWorker(r, w, setup), dies_in)

    return RolloutReplicas([build(k) for k in range(count)], free_cache_engine=True, rebuild=build,
                           max_restarts=max_restarts)


def test_a_replica_that_dies_mid_round_hands_its_requests_to_the_other_with_the_same_samples(model_dir) -> None:
    expected = _tokens(replicas(model_dir, 1).generate(requests()))
    two = mortal(model_dir, 2, {1: RolloutWorker.serve})
    assert _tokens(two.generate(requests())) == expected
    assert two.pool.down == [1] and [load.alive for load in two.router.loads] == [True, False]
    assert two.router.loads[0].requests == len(requests()) and two.router.loads[0].in_flight_requests == 0
    assert two.take_metrics()["rollout/replica_restarts"] == 1.0
    two.sleep()  # the replica down is left alone
    # The next sync restarts it: both serve again, the same samples.
    recorded = []
    two.pool.on_change = lambda: recorded.append([group.nodes() for group in two.groups])  # set-up: placement.json
    assert two.pool.restart_down() == [1] and two.pool.down == [] and two.pool.rejoin_weight_sync and len(recorded) == 1
    assert _tokens(two.generate(requests())) == expected
    assert two.router.loads[1].requests > 0


def test_a_replica_that_dies_mid_stream_hands_its_unfinished_requests_to_the_other(model_dir) -> None:
    expected = _tokens(replicas(model_dir, 1).generate(requests()))
    two = mortal(model_dir, 2, {1: RolloutWorker.take})
    got = {}
    for batch in two.stream_batches(requests()):
        got.update(batch)
    assert _tokens([got[i] for i in range(len(requests()))]) == expected
    assert two.pool.down == [1]
    metrics = two.take_metrics()
    # The dead replica's process had taken nothing: every token counted was generated by replica 0.
    assert metrics["rollout/generated_tokens"] == sum(len(t) for g in expected for t, _ in g)


def test_a_death_past_max_replica_restarts_stops_naming_the_replica_and_its_node(model_dir) -> None:
    two = mortal(model_dir, 2, {1: RolloutWorker.serve}, max_restarts=0)
    with pytest.raises(WorkerError, match=r"rollout replica 1 on node \S+ died and was not restarted: "
                                          r"rollout.max_replica_restarts=0 restarts of it were used up"):
        two.generate(requests())
    assert not two.router.loads[1].alive and two.pool.down == []
    # Replicas built without a way to restart them (in-process ones die with the controller): the
    # replica's own error stops the call.
    one = RolloutReplicas([MortalGroup(replica_role(0), lambda r, w: None, RolloutWorker.serve)],
                          free_cache_engine=False, max_restarts=3)
    with pytest.raises(WorkerError, match=r"^rollout replica 0 rank 0 died in RolloutWorker.serve"):
        one.generate(requests())
    assert one.pool.max_restarts == 0 and not one.router.loads[0].alive


def test_a_restart_that_cannot_start_stops_naming_the_dead_replica_and_its_node(model_dir) -> None:
    """The new process of a restarted replica dies at once (its node was lost, no room elsewhere, as
    Ray cancels it before it runs): the error names the replica that died and the node it was on."""
    two = mortal(model_dir, 2, {1: RolloutWorker.serve})
    two.generate(requests())
    assert two.pool.down == [1]
    node = two.pool.node_of(1)

    def unplaceable(k: int):
        raise WorkerError(f"rollout replica {k} rank 0 died in rendezvous (its process exited): its node has died",
                          process_died=True)

    two.pool._rebuild = unplaceable
    with pytest.raises(WorkerError, match=rf"^rollout replica 1 on {re.escape(node)} died and its restart failed: "
                                          r"rollout replica 1 rank 0 died in rendezvous") as raised:
        two.pool.restart_down()
    assert raised.value.process_died


def test_a_replica_that_raises_is_not_restarted(model_dir) -> None:
    """Its own code failed, not its process: a restart would fail the same way."""
    two = mortal(model_dir, 2, {})
    _break_engine(two, 1)
    with pytest.raises(WorkerError, match="rollout replica 1 rank 0 failed in RolloutWorker.serve"):
        two.generate(requests())
    assert two.pool.down == [] and two.pool.restarts == [0, 0]


def test_with_no_replica_alive_the_dead_one_restarts_at_once_and_gets_the_weights(model_dir) -> None:
    expected = _tokens(replicas(model_dir, 1).generate(requests()))
    one = mortal(model_dir, 1, {0: RolloutWorker.serve})
    with pytest.raises(WorkerError, match="nothing can give a restarted one the rollout's weights"):
        one.generate(requests())
    one = mortal(model_dir, 1, {0: RolloutWorker.serve})
    restored = []
    one.restore_weights = restored.append
    assert _tokens(one.generate(requests())) == expected
    assert restored == [[0]] and one.pool.restarts == [1]


def test_the_trainer_restores_a_restarted_replica_only_to_weights_it_holds(monkeypatch) -> None:
    """``WeightVersions.restore`` (``RolloutReplicas.restore_weights``): a replica restarted mid-round
    loaded model.path, which is version 0; a later version is synced from the actor only while the
    actor holds it (the sync loop), never from an actor that trains ahead of the rollout."""
    from hybridflow.controller import phases
    from hybridflow.controller.trainer import WeightVersions

    synced = []
    monkeypatch.setattr(phases, "sync_weights", lambda roles, version: synced.append(version))
    versions = WeightVersions(roles=None, plan=None)  # type: ignore[arg-type]
    versions.restore([0], generates_ahead=False)
    assert synced == []  # version 0: what the restarted replica loaded
    versions.actor = versions.rollout = 2
    versions.restore([0], generates_ahead=False)
    assert synced == [2]
    with pytest.raises(WorkerError, match=r"rollout replica 1 restarted while no other replica was alive.*version 2.*"
                                          r"run 2 or more replicas"):
        versions.restore([1], generates_ahead=True)
    versions.actor = 3  # updated, not synced yet
    with pytest.raises(WorkerError, match=r"\(version 3, the loop trains ahead"):
        versions.restore([1], generates_ahead=False)
    assert synced == [2]


# ------------------------------------------------------------------------------ elastic (rollout.elastic)
class Cluster:
    """An elastic rollout's ``ReplicaPlacer`` over in-process replicas: ``room`` reservations are
    free; a replica in ``leaving`` dies at its next call and its node takes its room with it."""

    def __init__(self, model_dir: str, room: int) -> None:
        self.setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                                  max_batch_size=32, seed=0)
        self.room, self.held, self.leaving = room, {}, set()

    def start(self, replica: int, patient: bool):
        if self.room == 0:
            if patient:
                raise RuntimeError("the cluster cannot fit the bundles")
            return None
        self.room -= 1
        self.held[replica] = MortalGroup(replica_role(replica), lambda r, w: RolloutWorker(r, w, self.setup))
        return self.held[replica]

    def has_free_room(self) -> bool:
        return self.room > 0

    def release(self, replica: int) -> None:
        if self.held.pop(replica, None) is not None and replica not in self.leaving:
            self.room += 1
        self.leaving.discard(replica)

    def node_leaves(self, replica: int) -> None:
        self.leaving.add(replica)
        self.held[replica].dead = True


def elastic(cluster: Cluster, min_replicas: int = 1, max_replicas: int = 3, max_restarts: int = 3) -> RolloutReplicas:
    """As set-up builds them (``roles.build_rollout_replicas``): the minimum, then while there is room."""
    bounds = ElasticReplicas(min_replicas, max_replicas, cluster)
    groups = [cluster.start(k, patient=True) for k in range(min_replicas)]
    built = RolloutReplicas(groups, free_cache_engine=True, max_restarts=max_restarts, elastic=bounds)
    built.pool.resize()
    return built


def _same_samples(got, expected) -> None:
    assert [[t for t, _ in g] for g in _tokens(got)] == [[t for t, _ in g] for g in expected]
    for group, expected_group in zip(_tokens(got), expected, strict=True):
        for (_, logprobs), (_, expected_logprobs) in zip(group, expected_group, strict=True):
            assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)


def test_an_elastic_rollout_grows_where_room_appears_and_shrinks_where_a_node_left_with_the_same_samples(
        model_dir) -> None:
    expected = _tokens(replicas(model_dir, 1).generate(requests()))
    cluster = Cluster(model_dir, room=1)
    rollout = elastic(cluster)
    changes = []
    rollout.pool.on_change = lambda: changes.append(rollout.active)  # set-up: placement.json
    assert rollout.active == [0] and not rollout.pool.rejoin_weight_sync
    _same_samples(rollout.generate(requests()), expected)
    assert rollout.take_metrics()["rollout/replicas"] == 1.0

    # A node with room for two joined: the next sync starts two replicas (max_replicas=3), which the
    # broadcast group takes in (rejoin) and the router fills first.
    cluster.room = 2
    rollout.prepare_sync()
    assert rollout.active == [0, 1, 2] and rollout.pool.rejoin_weight_sync and changes == [[0, 1, 2]]
    _same_samples(rollout.generate(requests()), expected)
    metrics = rollout.take_metrics()
    assert metrics["rollout/replicas"] == 3.0
    assert all(rollout.router.loads[k].requests > 0 for k in (1, 2))
    assert metrics["perf/rollout/replica_2/tokens_per_s"] > 0

    # Replica 1's node leaves: the round's samples come from the others; with no room left it is
    # removed at the next sync (no restart counted), its slot empty.
    cluster.node_leaves(1)
    _same_samples(rollout.generate(requests()), expected)
    assert rollout.take_metrics()["rollout/replicas"] == 2.0 and rollout.pool.down == [1]
    rollout.pool.rejoin_weight_sync = False
    rollout.prepare_sync()
    assert rollout.active == [0, 2] and rollout.groups[1] is None and rollout.pool.rejoin_weight_sync
    assert rollout.pool.restarts == [0, 0, 0] and rollout.take_metrics() == {}
    _same_samples(rollout.generate(requests()), expected)
    metrics = rollout.take_metrics()
    assert metrics["rollout/replicas"] == 2.0 and "perf/rollout/replica_1/tokens_per_s" not in metrics

    # Room again: a new replica takes the empty slot, its counters fresh.
    cluster.room = 1
    rollout.prepare_sync()
    assert rollout.active == [0, 1, 2] and rollout.router.loads[1].requests == 0
    _same_samples(rollout.generate(requests()), expected)


def test_an_elastic_replica_that_dies_where_room_is_left_is_restarted_and_the_minimum_waits_for_room(
        model_dir) -> None:
    cluster = Cluster(model_dir, room=2)
    rollout = elastic(cluster, min_replicas=1, max_replicas=2, max_restarts=1)
    cluster.held[1].dead = True  # its process, not its node: its room comes back when it is released
    rollout.prepare_sync()
    assert rollout.active == [0, 1] and rollout.pool.restarts == [0, 1] and rollout.pool.down == []
    # A second death: past rollout.max_replica_restarts=1 with room for it, the run stops naming it.
    cluster.held[1].dead = True
    with pytest.raises(WorkerError, match=r"rollout replica 1 on node \S+ died and was not restarted: "
                                          r"rollout.max_replica_restarts=1 restarts of it were used up"):
        rollout.prepare_sync()
    # The last replica (rollout.min_replicas=1) whose node left is not removed: its restart waits for room.
    cluster = Cluster(model_dir, room=1)
    one = elastic(cluster, min_replicas=1, max_replicas=2)
    cluster.node_leaves(0)
    with pytest.raises(RuntimeError, match="cannot fit"):
        one.prepare_sync()


def test_a_stream_whose_replica_is_replaced_between_polls_starts_its_requests_again(model_dir) -> None:
    """A sync in the middle of a stream (fully async with partial rollout) may remove or restart a
    replica that holds requests of the stream: they are started again on the replicas of now."""
    expected = _tokens(replicas(model_dir, 1).generate(requests()))
    cluster = Cluster(model_dir, room=2)
    rollout = elastic(cluster, max_replicas=2)
    got = {}
    with contextlib.closing(rollout.open_stream()) as stream:
        stream.add(requests(), keys=range(len(requests())))
        assert stream._waiting[1]
        cluster.node_leaves(1)
        rollout.prepare_sync()  # the ping finds it dead; no room: removed
        assert rollout.active == [0]
        while stream.in_flight:
            got.update(stream.poll())
    _same_samples([got[i] for i in range(len(requests()))], expected)
