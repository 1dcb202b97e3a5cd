"""Streaming rollout: a worker's start/take on its persistent event loop, ``RolloutReplicas.stream``
on two in-process replicas (every request once, the same trajectories and metrics as
``generate``, a failing replica named, nothing left in flight), and scoring that starts before
the round's last trajectory is finished, with the rewards of scoring the round whole."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from hybridflow.cluster.worker_group import LocalWorkerGroup, WorkerError
from hybridflow.controller.overlap import METRIC_REWARD_OVERLAPPED, generate_and_score
from hybridflow.controller.replicas import RolloutReplicas, replica_role
from hybridflow.data import PromptRow
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.rewards.tally import RewardTally
from hybridflow.rollout.stream import RequestStream
from hybridflow.types import GenerationRequest, SamplingParams
from hybridflow.utils.timer import PhaseTimer
from hybridflow.workers.reward import RewardSetup, RewardWorker
from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1)
    return str(write_tiny_model(tmp_path_factory.mktemp("stream") / "model", spec, seed=3))


def rollout_setup(model_dir: str) -> RolloutSetup:
    return RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                        max_batch_size=32, seed=0)


def requests(count: int = 8, long: int = 40) -> list[GenerationRequest]:
    # Very different lengths (max_tokens 2 .. ``long``, EOS ignored): requests finish far apart.
    return [GenerationRequest(list(range(3, 3 + 4 + 5 * (i % 3))),
                              SamplingParams(n=2, max_tokens=2 + (long - 2) * (i % 4 == 3), seed=100 + i, ignore_eos=True),
                              request_id=f"req-{i}")
            for i in range(count)]


def _tokens(groups) -> list[list[list[int]]]:
    return [[t.response_ids for t in group] for group in groups]


def _drain(worker: RolloutWorker, count: int) -> dict:
    got: dict = {}
    deadline = time.monotonic() + 120
    while len(got) < count:
        assert time.monotonic() < deadline
        for finished in worker.take(0.5).finished:
            got[finished.tag] = finished.trajectories
    return got


# ------------------------------------------------------------------------------ the worker
def test_start_returns_at_once_and_take_hands_back_each_request_with_generates_samples(model_dir) -> None:
    worker = RolloutWorker(0, 1, rollout_setup(model_dir))
    try:
        expected = worker.generate(requests())
        begun = time.perf_counter()
        worker.start(requests()[:4], tags=["a", "b", "c", "d"])
        assert time.perf_counter() - begun < 1.0  # no waiting on generation
        assert worker.take(0.0).in_flight > 0
        # Sleeping now is refused, naming why; a weight update runs between two engine steps.
        with pytest.raises(RuntimeError, match="still in flight"):
            worker.sleep()
        worker.update_weights(worker.model.state_dict().items())  # the same weights: samples unchanged
        worker.start(requests()[4:], tags=["e", "f", "g", "h"])  # joins what is in flight
        got = _drain(worker, 8)
        assert _tokens(got[tag] for tag in "abcdefgh") == _tokens(expected)
        batch = worker.take(0.1)
        assert batch.finished == [] and batch.in_flight == 0 and batch.engine_counts["generated_tokens"] > 0
        worker.sleep()  # nothing in flight: allowed
        worker.wake_up()
    finally:
        worker.close()


def test_a_failing_request_surfaces_from_take_naming_it_and_the_others_still_arrive(model_dir) -> None:
    worker = RolloutWorker(0, 1, rollout_setup(model_dir))
    try:
        bad = GenerationRequest([10**6], SamplingParams(n=1, max_tokens=2), request_id="out-of-vocab")
        worker.start([requests()[0], bad, requests()[1]], tags=[0, 1, 2])
        got, deadline = {}, time.monotonic() + 60
        with pytest.raises(RuntimeError, match=r"request 1 \('out-of-vocab'\) failed: .*outside the vocabulary"):
            while time.monotonic() < deadline:
                got |= {f.tag: f for f in worker.take(0.5).finished}
        while len(got) < 2:
            got |= {f.tag: f for f in worker.take(0.5).finished}
        assert sorted(got) == [0, 2]
        assert worker.abort() == 0  # nothing left
    finally:
        worker.close()


# ------------------------------------------------------------------------------ the replicas
class RecordingStream(RequestStream):
    """A replica's request loop that notes when each request reached the controller, and can fail."""

    def __init__(self, name: str, fails: bool) -> None:
        super().__init__(name)
        self.fails, self.arrivals = fails, []

    def take(self, max_wait_s: float = 0.0):
        if self.fails:
            raise RuntimeError("engine lost")
        finished = super().take(max_wait_s)
        self.arrivals += [time.perf_counter()] * len(finished)
        return finished


class Recorder(RolloutWorker):
    def __init__(self, rank, world_size, setup, fails: bool = False) -> None:
        super().__init__(rank, world_size, setup)
        self._stream = RecordingStream(f"rollout rank {rank}", fails)


def replicas(model_dir: str, count: int, failing: int | None = None) -> RolloutReplicas:
    setup = rollout_setup(model_dir)
    groups = [LocalWorkerGroup(replica_role(k), lambda r, w, k=k: Recorder(r, w, setup, fails=k == failing))
              for k in range(count)]
    return RolloutReplicas(groups, free_cache_engine=True)


def test_stream_yields_every_request_once_with_generates_trajectories_and_metrics(model_dir) -> None:
    blocking, streaming = replicas(model_dir, 2), replicas(model_dir, 2)
    expected = blocking.generate(requests())
    order, got = [], {}
    for index, samples in streaming.stream(requests()):
        order.append(index)
        got[index] = samples
    assert sorted(order) == list(range(8))
    assert order != sorted(order)  # short requests came first
    assert _tokens(got[i] for i in range(8)) == _tokens(expected)
    a, b = blocking.take_metrics(), streaming.take_metrics()
    assert set(a) == set(b)
    for key in a:
        if not key.startswith("perf/"):  # wall-clock figures differ
            assert a[key] == b[key], key
    loads = streaming.router.loads
    assert all(load.in_flight_requests == 0 and load.in_flight_tokens == 0 for load in loads)
    assert loads[0].requests + loads[1].requests == 8 and loads[0].busy_seconds > 0
    streaming.sleep()  # nothing in flight after a full stream


def test_a_failing_replica_is_named_and_nothing_stays_in_flight(model_dir) -> None:
    two = replicas(model_dir, 2, failing=1)
    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"rollout replica 1 rank 0 failed in RolloutWorker.take: .*engine lost"):
        list(two.stream(requests()))
    assert time.perf_counter() - start < 30
    assert not two.router.loads[1].alive
    assert all(load.in_flight_requests == 0 for load in two.router.loads)
    # The healthy replica's requests were aborted: it can sleep, and serves the next round alone.
    two.groups[0].call_one(0, RolloutWorker.sleep)
    two.groups[0].call_one(0, RolloutWorker.wake_up)
    assert len(list(two.stream(requests(3)))) == 3


def test_closing_a_stream_early_aborts_what_is_in_flight(model_dir) -> None:
    two = replicas(model_dir, 2)
    stream = two.stream(requests())
    next(stream)
    stream.close()
    assert all(load.in_flight_requests == 0 for load in two.router.loads)
    assert all(group.call_one(0, RolloutWorker.take, 0.0).in_flight == 0 for group in two.groups)


def test_a_continuous_stream_takes_requests_while_others_run_and_keeps_each_under_its_key(model_dir) -> None:
    """The fully async loop's stream: a second round added while the first's long requests still
    generate joins them; every request comes back once under its key, with ``generate``'s samples."""
    # The long requests make 480 tokens: on an idle machine the tiny model decodes 40 within one
    # poll's 0.1 s wait, and the first round would be over before the second joins it.
    blocking, two = replicas(model_dir, 2), replicas(model_dir, 2)
    expected = blocking.generate(requests(long=480))
    stream = two.open_stream()
    stream.add(requests(long=480)[:4], keys=[("a", i) for i in range(4)])
    got = dict(stream.poll())
    while not got:
        got = dict(stream.poll())
    assert stream.in_flight > 0  # the first round's long request (index 3) still runs
    stream.add(requests(long=480)[4:], keys=[("b", i) for i in range(4, 8)])
    while stream.in_flight:
        for key, samples in stream.poll():
            assert key not in got
            got[key] = samples
    assert sorted(got) == [("a", i) for i in range(4)] + [("b", i) for i in range(4, 8)]
    assert _tokens(got[k] for k in sorted(got)) == _tokens(expected)
    stream.end_round()
    assert two.take_metrics()["rollout/generated_tokens"] == blocking.take_metrics()["rollout/generated_tokens"]
    stream.add(requests(2), keys=["late", "later"])
    stream.close()  # unfinished: abandoned and aborted
    assert all(load.in_flight_requests == 0 for load in two.router.loads)
    assert all(group.call_one(0, RolloutWorker.take, 0.0).in_flight == 0 for group in two.groups)


# ------------------------------------------------------------------------------ scoring overlaps generation
class TimedReward(RewardWorker):
    """The real reward role, noting when each part was scored."""

    def __init__(self, rank, world_size, setup) -> None:
        super().__init__(rank, world_size, setup)
        self.calls: list[tuple[float, int]] = []

    def _rule_scores(self, trajectories):
        self.calls.append((time.perf_counter(), len(trajectories)))
        return super()._rule_scores(trajectories)


def test_groups_are_scored_before_the_last_one_finishes_with_the_rewards_of_scoring_the_round_whole(model_dir):
    reward_setup = RewardSetup(tokenizer_path=model_dir, custom_path=None, custom_name="compute_score", timeout_s=30,
                               num_workers=1, overlong_buffer_len=8, max_response_length=40)
    reward = LocalWorkerGroup("reward", lambda r, w: TimedReward(r, w, reward_setup))
    rows = [PromptRow(prompt_ids=r.prompt_ids, messages=[], data_source="hybridflow/arithmetic", ground_truth=str(i), ability="", extra_info={},
                      source=r.request_id) for i, r in enumerate(requests())]
    two = replicas(model_dir, 2)
    roles = SimpleNamespace(rollout=two, reward=reward, reward_model=None)
    plan = SimpleNamespace(seed=5, by_reference=False, agents=False)
    params = SamplingParams(n=2, max_tokens=40, ignore_eos=True)
    timer = PhaseTimer()
    try:
        # Per-request max_tokens (2 or 40) make the round's requests finish far apart.
        import hybridflow.controller.overlap as overlap

        built = overlap.round_requests

        def uneven(rows, params, seed, scope, vision=None, first_group=0):
            return [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=q.params.max_tokens))
                    for r, q in zip(built(rows, params, seed, scope, vision, first_group), requests(), strict=True)]

        overlap.round_requests = uneven
        try:
            trajectories, metrics = generate_and_score(roles, plan, rows, params, (1, 1), timer)
        finally:
            overlap.round_requests = built
        worker = reward.call_one(0, lambda w: w)
        last_arrival = max(t for group in two.groups for t in group.call_one(0, lambda w: w.stream.arrivals))
        assert len(worker.calls) >= 2 and worker.calls[0][0] < last_arrival  # scoring began mid-round
        assert metrics[METRIC_REWARD_OVERLAPPED] > 0
        assert {"timing_s/gen", "timing_s/reward"} <= set(timer.metrics())
        assert [t.group_id for t in trajectories] == [i for i in range(8) for _ in range(2)]
        # The same rewards and metrics as scoring the round in one call.
        views = [dict(reward=t.reward, extra=t.reward_extra) for t in trajectories]
        scores, whole = reward.call_one(0, RewardWorker.score, trajectories, shaping=True)
        assert [v["reward"] for v in views] == scores == [t.reward for t in trajectories]
        streamed = {k: v for k, v in metrics.items() if k != METRIC_REWARD_OVERLAPPED}
        assert streamed.pop("reward/worker_restarts") == whole.pop("reward/worker_restarts") == 0.0
        assert streamed == whole
        assert whole["reward/overlong_fraction"] > 0  # the shaping took part
    finally:
        reward.call_one(0, RewardWorker.close)


def test_a_tally_merged_from_parts_reports_the_whole_batchs_metrics() -> None:
    whole, first, second = RewardTally(), RewardTally(), RewardTally()
    values = [0.1, 0.7, 0.2, 0.9, 0.3]
    whole.add("m", "mean", values), whole.add("x", "max", values), whole.add("r", "sum", [1.0, 2.0])
    first.add("m", "mean", values[:2]), first.add("x", "max", values[:2]), first.add("r", "sum", [1.0])
    second.add("m", "mean", values[2:]), second.add("x", "max", values[2:]), second.add("r", "sum", [2.0])
    second.add("m", "mean", [5.0], fallback=True)  # a primary "m" exists: the fallback is not reported
    second.add("only_agent", "mean", [4.0, 2.0], fallback=True)
    assert first.merge(second).metrics() == whole.metrics() | {"only_agent": 3.0}
