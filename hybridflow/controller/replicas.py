"""The rollout replicas as the controller sees them: requests in, trajectories out, via the router.

Each rank of the rollout worker group is one replica with its own engine (on Ray: one process per
data-parallel rank, colocated with that rank's actor). Every request is placed by the router
(``rollout.router``: fewest in-flight tokens, heaviest first); each replica then gets the requests
placed on it in one call and batches them continuously, and all replicas run at once. Samples are
seeded per request, so which replica serves a request does not change what it generates: a run's
trajectories are the same with 1 or 2 replicas.

Between generation and training the replicas sleep (``rollout.free_cache_engine``): their KV
caches are freed while the actor computes logprobs and updates, and the next generation wakes them.

A replica whose process dies, or that raises, fails the call with a ``WorkerError`` naming it (the
worker group's failure handling); the router marks it dead, so nothing is placed on it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow.cluster.worker_group import WorkerError, WorkerGroup
from hybridflow.rollout.router import ReplicaRouter, RouteRequest
from hybridflow.types import GenerationRequest, Trajectory
from hybridflow.workers.rollout import ReplicaOutput, RolloutWorker

# Engine counters summed over replicas into ``rollout/<name>`` metrics.
_SUMMED_COUNTS = ("prefill_tokens", "generated_tokens")


class RolloutReplicas:
    """The rollout worker group's ranks as replicas behind one router."""

    def __init__(self, group: WorkerGroup[RolloutWorker], *, free_cache_engine: bool) -> None:
        self.group = group
        self.router = ReplicaRouter(group.world_size)
        self.free_cache_engine = free_cache_engine
        self._asleep = False
        self._metrics: list[dict[str, float]] = []  # one per generation round since take_metrics

    @property
    def num_replicas(self) -> int:
        return self.group.world_size

    def generate(
        self, requests: Sequence[GenerationRequest], metadata: Sequence[dict[str, Any]] | None = None
    ) -> list[list[Trajectory]]:
        """Each request's ``n`` trajectories, in request order. ``metadata`` (the rows' fields)
        goes with each request when agent loops need it."""
        self.wake_up()
        tickets = self.router.place([RouteRequest(len(r.prompt_ids), r.params.n, r.params.max_tokens)
                                     for r in requests])
        placed = [[i for i, t in enumerate(tickets) if t.replica == r] for r in range(self.num_replicas)]
        shards = [([requests[i] for i in idx], None if metadata is None else [metadata[i] for i in idx])
                  for idx in placed]
        try:
            outputs: list[ReplicaOutput] = self.group.call_each(RolloutWorker.serve, shards)
        except WorkerError as error:
            for r in range(self.num_replicas):  # the group is torn down: nothing more goes to it
                self.router.mark_dead(r, str(error).splitlines()[0])
            raise
        results: list[list[Trajectory]] = [[] for _ in requests]
        for r, (idx, output) in enumerate(zip(placed, outputs, strict=True)):
            for i, samples in zip(idx, output.trajectories, strict=True):
                results[i] = samples
                self.router.finish(tickets[i], sum(len(t.response_ids) for t in samples))
            self.router.loads[r].busy_seconds += output.seconds
        self._metrics.append(self._round_metrics(outputs))
        return results

    def _round_metrics(self, outputs: list[ReplicaOutput]) -> dict[str, float]:
        tokens = [int(o.engine_counts.get("generated_tokens", 0)) for o in outputs]
        metrics = self.router.metrics([o.seconds for o in outputs], tokens)
        for name in _SUMMED_COUNTS:
            metrics[f"rollout/{name}"] = sum(o.engine_counts.get(name, 0.0) for o in outputs)
        return metrics

    def take_metrics(self) -> dict[str, float]:
        """Rollout metrics since the last call: token counts summed over generation rounds, the
        load figures of the last round (a step's main generation)."""
        rounds, self._metrics = self._metrics, []
        if not rounds:
            return {}
        merged = dict(rounds[-1])
        for name in _SUMMED_COUNTS:
            merged[f"rollout/{name}"] = sum(m[f"rollout/{name}"] for m in rounds)
        return merged

    def sleep(self) -> None:
        """Free the replicas' KV caches until the next ``generate`` (no-op unless
        ``rollout.free_cache_engine``)."""
        if self.free_cache_engine and not self._asleep:
            self.group.call_all(RolloutWorker.sleep)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.group.call_all(RolloutWorker.wake_up)
            self._asleep = False
