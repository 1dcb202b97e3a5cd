"""The rollout replicas as the controller sees them: requests in, trajectories out, via the router.

A replica is one worker group of its own (``rollout replica k``) holding one engine: on Ray, one
process per data-parallel rank, in that rank's placement bundle next to its actor rank. Every
request is placed by the router (``rollout.router``: fewest in-flight tokens, heaviest first); each
replica then gets the requests placed on it in one call and batches them continuously, and all
replicas run at once. Samples are seeded per request, so which replica serves a request does not
change what it generates: a run's trajectories are the same with 1 or 2 replicas.

Weights reach every replica after each step: by copy (``update_weights``) or as receivers of the
broadcast from actor rank 0 (``join_weight_sync`` / ``submit_receive``), replica k as member k + 1.

Between generation and training the replicas sleep (``rollout.free_cache_engine``): their KV
caches are freed while the actor computes logprobs and updates, and the next generation wakes them.

``stream`` is the same round, yielding each request's trajectories as soon as its replica has
them (``RolloutWorker.start`` / ``take``), so the controller scores a prompt group while the rest
of the round is still being generated (``hybridflow.controller.overlap``).

A replica whose process dies, or that raises, fails the call with a ``WorkerError`` naming it
(``rollout replica k``, from the worker group's failure handling); the router marks it dead, so
nothing is placed on it again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hybridflow.cluster.worker_group import PendingCall, WorkerError, WorkerGroup, wait_all
from hybridflow.rollout.router import ReplicaRouter, RouteRequest, Ticket
from hybridflow.rollout.stream import Finished
from hybridflow.transfer.verify import SentDigests, compare_digests
from hybridflow.transfer.weight_transfer import SENDER_RANK, TransferStats
from hybridflow.tracking.timeline import Timeline
from hybridflow.types import GenerationRequest, Trajectory
from hybridflow.workers.rollout import RecordBatch, ReplicaOutput, RolloutWorker, ScoredGroup, StreamBatch

logger = logging.getLogger(__name__)

# How long one ``take`` of a streamed round may wait for a first finished request. It bounds how
# late a finished request reaches the controller (the replicas are polled together) and, on Ray,
# how long a replica's other calls (a weight update) queue behind a poll; each poll costs a round
# trip, so ten a second per replica.
STREAM_POLL_S = 0.1

# Engine counters summed over replicas into ``rollout/<name>`` metrics.
_SUMMED_COUNTS = ("prefill_tokens", "generated_tokens", "prefix_cache_query_tokens", "prefix_cache_hit_tokens")


def replica_role(index: int) -> str:
    """The worker-group role of replica ``index``: what errors name."""
    return f"rollout replica {index}"


class RolloutReplicas:
    """The rollout replicas (one worker group each) behind one router."""

    def __init__(self, groups: Sequence[WorkerGroup[RolloutWorker]], *, free_cache_engine: bool,
                 sleep_level: int = 1, verify_weight_sync: bool = False) -> None:
        if not groups:
            raise ValueError("RolloutReplicas needs at least one replica")
        self.groups = list(groups)
        self.router = ReplicaRouter(len(self.groups))
        self.free_cache_engine, self.sleep_level = free_cache_engine, sleep_level
        self._asleep = False
        # rollout.verify_weight_sync: after each sync every replica's digest is checked (verify_sync).
        self.verify_weight_sync = verify_weight_sync
        self._verify_s: float | None = None  # seconds the checks took since take_metrics
        self._metrics: list[dict[str, float]] = []  # one per generation round since take_metrics
        self._streams = 0  # stream() calls so far: each tags its requests with its own number
        # Set-up's timeline (trainer.timeline): each replica's serving seconds of a round as a span.
        self.timeline: Timeline = Timeline.disabled()

    @property
    def num_replicas(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ generation
    def generate(
        self, requests: Sequence[GenerationRequest], metadata: Sequence[dict[str, Any]] | None = None
    ) -> list[list[Trajectory]]:
        """Each request's ``n`` trajectories, in request order. ``metadata`` (the rows' fields)
        goes with each request when agent loops need it."""
        self.wake_up()
        tickets = self.router.place([RouteRequest(len(r.prompt_ids), r.params.n, r.params.max_tokens)
                                     for r in requests])
        placed = [[i for i, t in enumerate(tickets) if t.replica == r] for r in range(self.num_replicas)]
        calls, submitted = [], []  # submitted: when each replica got its call (the in-process backend runs it then)
        for group, idx in zip(self.groups, placed, strict=True):
            submitted.append(time.perf_counter())
            calls.append(group.submit_one(0, RolloutWorker.serve, [requests[i] for i in idx],
                                          None if metadata is None else [metadata[i] for i in idx]))
        try:
            outputs: list[ReplicaOutput] = [results[0] for results in wait_all(*calls)]
        except WorkerError as error:
            for ticket in tickets:  # the whole round failed: none of its requests is in flight
                self.router.abandon(ticket)
            self._mark_failed(str(error))
            raise
        results: list[list[Trajectory]] = [[] for _ in requests]
        for r, (idx, output) in enumerate(zip(placed, outputs, strict=True)):
            for i, samples in zip(idx, output.trajectories, strict=True):
                results[i] = samples
                self.router.finish(tickets[i], sum(len(t.response_ids) for t in samples))
            self.router.loads[r].busy_seconds += output.seconds
            # The replica's engine time, drawn from its submission (its start is not sent back):
            # the rest of the round, up to the slowest replica, it waited.
            self.timeline.add(replica_role(r), "serve", submitted[r], submitted[r] + output.seconds,
                              requests=len(idx), tokens=int(output.engine_counts.get("generated_tokens", 0)))
        self._metrics.append(self._round_metrics(outputs))
        return results

    def stream(
        self, requests: Sequence[GenerationRequest], metadata: Sequence[dict[str, Any]] | None = None
    ) -> Iterator[tuple[int, list[Trajectory]]]:
        """``stream_batches``, one request at a time."""
        with contextlib.closing(self.stream_batches(requests, metadata)) as batches:
            for batch in batches:
                yield from batch

    def stream_batches(
        self, requests: Sequence[GenerationRequest], metadata: Sequence[dict[str, Any]] | None = None,
        by_reference: bool = False,
    ) -> Iterator[list[tuple[int, Any]]]:
        """``generate``, yielding each request's ``n`` trajectories as ``(request index,
        trajectories)`` as soon as its replica finishes it (completion order; those that one poll
        of the replicas found finished come in one list), while the replicas keep generating the
        rest: the same trajectories and round metrics as ``generate``. One ``ReplicaStream``
        given the whole round at once; close the iterator (e.g. ``contextlib.closing``) to abort
        what is unfinished. ``by_reference``: ``(request index, ScoredGroup)``, scored by the
        replica, which keeps the tokens (``ReplicaStream.poll_records``)."""
        with contextlib.closing(self.open_stream()) as stream:
            stream.add(requests, metadata, keys=range(len(requests)))
            while stream.in_flight:
                done = stream.poll_records() if by_reference else stream.poll()
                if done:
                    yield done
            # Only a round that completed gets here (an error or an early close leaves through the with).
            stream.end_round()

    def open_stream(self) -> ReplicaStream:
        """A stream that takes requests at any time and hands back each one's trajectories as it
        finishes (the fully async loop's continuous generation; ``stream_batches`` for one round)."""
        self.wake_up()
        self._streams += 1
        return ReplicaStream(self, self._streams)

    def _abort(self, replicas: Iterable[int]) -> None:
        """Cancel what the living ones of ``replicas`` still run for a stream that ended early."""
        for r in replicas:
            if not self.router.loads[r].alive:
                continue
            try:
                self.groups[r].call_one(0, RolloutWorker.abort)
            except WorkerError as error:  # it failed too: the next call to it says so
                logger.warning("could not abort the requests of %s: %s", replica_role(r), str(error).splitlines()[0])

    def _mark_failed(self, message: str) -> None:
        """The replicas the error names are dead to the router (the error's first line names the
        replica that failed first; later lines may name others)."""
        for r in range(self.num_replicas):
            if f"{replica_role(r)} rank" in message:
                self.router.mark_dead(r, message.splitlines()[0])

    def _record_round(self, outputs: list[ReplicaOutput], started: float, requests: list[int]) -> None:
        """A round's busy time, timeline spans (from ``started``) and metrics, per replica."""
        for r, output in enumerate(outputs):
            self.router.loads[r].busy_seconds += output.seconds
            if requests[r]:  # the replica's engine time, from the round's start to its last finish
                self.timeline.add(replica_role(r), "serve", started, started + output.seconds, requests=requests[r],
                                  tokens=int(output.engine_counts.get("generated_tokens", 0)))
        self._metrics.append(self._round_metrics(outputs))

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
        looked_up = merged.pop("rollout/prefix_cache_query_tokens")
        # Share of prompt tokens whose keys and values came from the prefix cache, not a prefill.
        merged["rollout/prefix_cache_hit_rate"] = merged.pop("rollout/prefix_cache_hit_tokens") / looked_up \
            if looked_up else 0.0
        return merged

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free the replicas' KV caches (and weights, ``rollout.sleep_level=2``; the next weight
        sync restores them) until the next ``generate`` (no-op unless ``rollout.free_cache_engine``)."""
        if self.free_cache_engine and not self._asleep:
            self._each(RolloutWorker.sleep, self.sleep_level)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self._each(RolloutWorker.wake_up)
            self._asleep = False

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Copy new weights into every replica (the object-store path); ``version`` is the policy
        version their tokens record from now on (default: each engine's last + 1)."""
        items = list(weights)
        self._each(RolloutWorker.update_weights, items, version)
        self.verify_sync(dict(items))

    def verify_sync(self, sent: dict[str, torch.Tensor] | None = None) -> None:
        """Check that every replica holds what the last sync sent (``rollout.verify_weight_sync``;
        ``hybridflow.transfer.verify``): against ``sent``, the weights this process handed them,
        or (None: the broadcast, whose bytes never pass here) against the checksums each replica
        took of the bytes it received. Raises ``WeightSyncMismatch`` naming the replica and tensors."""
        if not self.verify_weight_sync:
            return
        start = time.perf_counter()
        sender = SentDigests(sent) if sent is not None else None
        for k, reported in enumerate(self._each(RolloutWorker.weights_digest)):
            if reported is None:  # the replica said why, once
                continue
            held, received = reported
            if sender is not None:
                sender.check(replica_role(k), held)
            elif received is not None:
                compare_digests(replica_role(k), received, held)
        self._verify_s = (self._verify_s or 0.0) + time.perf_counter() - start

    def take_sync_metrics(self) -> dict[str, float]:
        """``timing_s/verify_weight_sync``: the seconds the checks of the syncs since the last call took
        (nothing when none was checked)."""
        verified, self._verify_s = self._verify_s, None
        return {} if verified is None else {"timing_s/verify_weight_sync": verified}

    def kv_cache_budget(self) -> int | None:
        """The smallest KV cache budget in bytes the replicas' engines sized their caches by (None:
        engines that size their own)."""
        budgets = [b for b in self._each(RolloutWorker.kv_cache_budget) if b is not None]
        return min(budgets, default=None)

    def device_uuids(self) -> list[str | None]:
        """Each replica's GPU (None on CPU), for the choice of weight-sync transport."""
        return self._each(RolloutWorker.device_uuid)

    def node_addresses(self) -> list[str]:
        return [address for group in self.groups for address in group.node_addresses()]

    def submit_join_weight_sync(self, host: str, port: int, world_size: int, on_gpu: bool) -> list[PendingCall[None]]:
        """Every replica joins the weight-sync group, replica k as member k + 1 (actor rank 0 sends)."""
        return [group.submit_one(0, RolloutWorker.join_weight_sync, host, port, world_size, on_gpu,
                                 member=SENDER_RANK + 1 + k) for k, group in enumerate(self.groups)]

    def submit_receive(self, version: int | None = None) -> list[PendingCall[TransferStats]]:
        """Every replica receives the sync that actor rank 0 sends at the same time (``version``
        as in ``update_weights``)."""
        return [group.submit_one(0, RolloutWorker.receive_weights, version) for group in self.groups]

    def close_weight_sync(self) -> None:
        self._each(RolloutWorker.close_weight_sync)

    def close(self) -> None:
        for group in self.groups:
            try:  # a replica's HTTP server (rollout.mode=server) stops before its process goes
                wait_all(group.submit_one(0, RolloutWorker.close))
            except Exception:  # a dead replica has nothing left to stop
                logger.debug("closing %s", group, exc_info=True)
            group.close()

    def _each(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """``method`` on every replica at once; results in replica order."""
        return [results[0] for results in wait_all(*(group.submit_one(0, method, *args) for group in self.groups))]


class ReplicaStream:
    """Requests streamed through the replicas: ``add`` places and starts them at any time (they
    join whatever each replica is generating), ``poll`` hands back those finished since, as
    ``(key, trajectories)``. One owner thread at a time.

    Tags carry the stream's number, so a late result of an earlier, failed stream is never taken
    for this one's. A dead or failing replica raises ``WorkerError`` naming it within one poll
    (``STREAM_POLL_S``) and is marked dead in the router. ``close`` abandons in the router, and
    aborts on the replicas still alive, every request not finished (a failure, or an early stop).

    A *round* is the stream's work between two ``end_round`` calls: its replicas' busy seconds
    (start to last finish), engine counters and timeline spans go to the rollout metrics
    (``RolloutReplicas.take_metrics``) as one generation round."""

    def __init__(self, replicas: RolloutReplicas, number: int) -> None:
        self._replicas, self._number = replicas, number
        n = replicas.num_replicas
        self._waiting: list[dict[tuple[int, Any], Ticket]] = [{} for _ in range(n)]  # per replica: tag -> ticket
        self._round_start = time.perf_counter()
        self._seconds = [0.0] * n  # per replica: the round's latest finish, from its requests' start
        self._requests = [0] * n  # requests placed in this round
        self._before: list[dict[str, float]] = [{} for _ in range(n)]  # engine counters at the round's start
        self._after: list[dict[str, float]] = [{} for _ in range(n)]  # ... at the latest call

    @property
    def in_flight(self) -> int:
        return sum(len(waiting) for waiting in self._waiting)

    def add(self, requests: Sequence[GenerationRequest], metadata: Sequence[dict[str, Any]] | None,
            keys: Iterable[Any]) -> None:
        """Place ``requests`` and start them, each under its key (what ``poll`` returns it with)."""
        replicas = self._replicas
        keys = list(keys)
        tickets = replicas.router.place([RouteRequest(len(r.prompt_ids), r.params.n, r.params.max_tokens)
                                         for r in requests])
        placed: dict[int, list[int]] = {}
        for i, ticket in enumerate(tickets):
            placed.setdefault(ticket.replica, []).append(i)
            self._waiting[ticket.replica][(self._number, keys[i])] = ticket  # in flight from here: close abandons it
        try:
            starts = [replicas.groups[r].submit_one(0, RolloutWorker.start, [requests[i] for i in idx],
                                                    None if metadata is None else [metadata[i] for i in idx],
                                                    [(self._number, keys[i]) for i in idx])
                      for r, idx in placed.items()]
            for (r, idx), counts in zip(placed.items(), wait_all(*starts), strict=True):
                self._before[r] = self._before[r] or counts[0]
                self._after[r] = self._after[r] or counts[0]
                self._requests[r] += len(idx)
        except WorkerError as error:
            replicas._mark_failed(str(error))
            raise

    def poll(self) -> list[tuple[Any, list[Trajectory]]]:
        """The requests finished since the last poll (waiting at most ``STREAM_POLL_S`` for one)."""
        return [(finished.tag[1], finished.trajectories) for finished in self._poll(RolloutWorker.take)]

    def poll_records(self) -> list[tuple[Any, ScoredGroup]]:
        """``poll`` on the by-reference data plane: each finished request scored by its replica,
        which keeps its tokens; its records and reward tally (``RolloutWorker.take_records``)."""
        return [(group.tag[1], group) for group in self._poll(RolloutWorker.take_records)]

    def _poll(self, take: Callable[..., Any]) -> list[Any]:
        replicas = self._replicas
        polled = [r for r, waiting in enumerate(self._waiting) if waiting]
        try:
            batches: list[StreamBatch | RecordBatch] = [results[0] for results in wait_all(
                *(replicas.groups[r].submit_one(0, take, STREAM_POLL_S) for r in polled))]
        except WorkerError as error:
            replicas._mark_failed(str(error))
            raise
        done = []
        for r, batch in zip(polled, batches, strict=True):
            self._after[r] = batch.engine_counts
            for finished in batch.finished:
                ticket = self._waiting[r].pop(finished.tag, None)
                if ticket is None:
                    logger.debug("%s: dropped a result of an earlier stream: %r", replica_role(r), finished.tag)
                    continue
                samples = finished.trajectories if isinstance(finished, Finished) else finished.records
                replicas.router.finish(ticket, sum(t.response_length for t in samples))
                self._seconds[r] = max(self._seconds[r], finished.seconds)
                done.append(finished)
        return done

    def end_round(self) -> None:
        """Record the round so far as one generation round (see the class docstring); the next starts now."""
        replicas = self._replicas
        outputs = [ReplicaOutput([], self._seconds[r], {k: v - self._before[r].get(k, 0.0) for k, v in self._after[r].items()})
                   for r in range(replicas.num_replicas)]
        replicas._record_round(outputs, self._round_start, self._requests)
        self._round_start = time.perf_counter()
        self._seconds = [0.0] * replicas.num_replicas
        self._requests = [0] * replicas.num_replicas
        self._before = [dict(after) for after in self._after]

    def close(self) -> None:
        """Abandon and abort what is unfinished (nothing when every request finished)."""
        unfinished = [r for r, waiting in enumerate(self._waiting) if waiting]
        for r in unfinished:
            for ticket in self._waiting[r].values():
                self._replicas.router.abandon(ticket)
            self._waiting[r].clear()
        if unfinished:
            self._replicas._abort(unfinished)
