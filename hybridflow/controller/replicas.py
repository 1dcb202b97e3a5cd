"""The rollout replicas as the controller sees them: requests in, trajectories out, via the router.

A replica is one worker group of its own (``rollout replica k``) holding one engine: on Ray, one
process per data-parallel rank, in that rank's placement bundle next to its actor rank. Every
request is placed by the router (``rollout.router``: fewest in-flight tokens, heaviest first); each
replica then gets the requests placed on it in one call and batches them continuously, and all
replicas run at once. Samples are seeded per request, so which replica serves a request does not
change what it generates: a run's trajectories are the same with 1 or 2 replicas: the same tokens, and
the same logprobs to the bit where the engine's numerics do not depend on the batch. The native engine's
do not (every matmul at least ``compact.MIN_MATMUL_ROWS`` rows, keys read in multiples of
``runner.KEY_ALIGN``): measured to the bit in fp32 and bf16 on an AMD EPYC Zen 4
(``bench/batch_invariance.py``); tests allow 1e-5, for other CPUs' matmul libraries.

Weights reach every replica after each step: by copy (``update_weights``) or as receivers of the
broadcast from actor rank 0 (``join_weight_sync`` / ``submit_receive``), replica k as member k + 1.

Between generation and training the replicas sleep (``rollout.free_cache_engine``): their KV
caches are freed while the actor computes logprobs and updates, and the next generation wakes them.

``stream`` is the same round, yielding each request's trajectories as soon as its replica has
them (``RolloutWorker.start`` / ``take``), so the controller scores a prompt group while the rest
of the round is still being generated (``hybridflow.controller.overlap``).

A replica whose process dies mid-round (killed, out of memory, its node lost) is *down*: the
router places nothing on it, and the requests it had in flight are placed again on the others
with the same seeds, so the round's samples are those it would have had. It is restarted (a new
process in its placement bundle, on its node or, if Ray moved the bundle, another with room) at
the next weight sync, which then gives it the current weights by the normal path (the broadcast
group formed again with it; ``rollout.verify_weight_sync`` checks it like the others); with no
other replica alive it is restarted at once and the trainer's ``restore_weights`` brings it the
rollout's weights. ``rollout.max_replica_restarts`` bounds the restarts of each replica: one more
death fails the call with a ``WorkerError`` naming the replica and its node. Replicas built
without a way to restart them (in-process ones die with the controller), and a replica whose own
code raises (it would again), fail the call with the replica's own error. Either way the router
marks the replica dead. ``rollout/replica_restarts`` counts the restarts.

An elastic rollout (``rollout.elastic``: ``ElasticReplicas``) follows the cluster: each replica in a
reservation of its own (``ReplicaPlacer``), and before each weight sync (``prepare_sync``) a
replica down is restarted where its reservation finds room again, or else removed (its slot left
empty, its name not reused until a new replica takes the slot) while more than
``rollout.min_replicas`` are left; then new replicas start while the cluster has room, up to
``rollout.max_replicas``. Both ends of a change form the broadcast group again, so new replicas get
the current weights by the normal sync, checked like the others. The router places each round on
the replicas of the moment; seeds per request keep the samples those of any other replica count.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hybridflow.cluster.worker_group import PendingCall, WorkerError, WorkerGroup, wait_all, wait_each
from hybridflow.controller.replica_pool import ElasticReplicas, ReplicaPool, replica_role
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


class RolloutReplicas:
    """The rollout replicas (one worker group each) behind one router."""

    def __init__(self, groups: Sequence[WorkerGroup[RolloutWorker]], *, free_cache_engine: bool,
                 sleep_level: int = 1, verify_weight_sync: bool = False,
                 rebuild: Callable[[int], WorkerGroup[RolloutWorker]] | None = None, max_restarts: int = 0,
                 elastic: ElasticReplicas | None = None) -> None:
        if not groups:
            raise ValueError("RolloutReplicas needs at least one replica")
        self.router = ReplicaRouter(len(groups))
        # Which replicas there are and which are down: restarts, and rollout.elastic's additions and removals.
        self.pool = ReplicaPool(groups, self.router, rebuild=rebuild, max_restarts=max_restarts, elastic=elastic)
        # Brings the replicas restarted mid-round (none other alive) the rollout's current weights;
        # set by the trainer, which knows them. None: such a restart fails the call.
        self.restore_weights: Callable[[list[int]], None] | None = None
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
    def groups(self) -> list[WorkerGroup[RolloutWorker] | None]:
        return self.pool.groups

    @property
    def num_replicas(self) -> int:
        return self.pool.num_replicas

    @property
    def active(self) -> list[int]:
        return self.pool.active

    def group(self, replica: int) -> WorkerGroup[RolloutWorker]:
        return self.pool.group(replica)

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Trajectory]]:
        """Each request's ``n`` trajectories, in request order. A replica that dies meanwhile is
        down and its requests go to the others (module docstring)."""
        self.wake_up()
        results: list[list[Trajectory]] = [[] for _ in requests]
        outputs: dict[int, ReplicaOutput] = {}  # each replica's round, summed over passes
        todo = list(range(len(requests)))
        while todo:
            todo = self._serve_pass(requests, todo, results, outputs)
        self._metrics.append(self._round_metrics(outputs))
        return results

    def _serve_pass(self, requests: Sequence[GenerationRequest], todo: list[int], results: list[list[Trajectory]],
                    outputs: dict[int, ReplicaOutput]) -> list[int]:
        """Place the requests ``todo`` on the live replicas and serve them; what a replica that died
        had is returned, to place again."""
        self.ensure_live()
        tickets = dict(zip(todo, self.router.place([RouteRequest(len(requests[i].prompt_ids), requests[i].params.n,
                                                                 requests[i].params.max_tokens) for i in todo]),
                           strict=True))
        live = [r for r in self.active if self.router.loads[r].alive]
        placed = {r: [i for i in todo if tickets[i].replica == r] for r in live}
        calls, submitted = [], []  # submitted: when each replica got its call (the in-process backend runs it then)
        for r in live:
            submitted.append(time.perf_counter())
            calls.append(self.group(r).submit_one(0, RolloutWorker.serve, [requests[i] for i in placed[r]]))
        again: list[int] = []
        try:
            for c, outcome in wait_each(*calls):
                r = live[c]
                if isinstance(outcome, WorkerError):
                    for i in placed[r]:  # not in flight any more: placed again below, or the round failed
                        self.router.abandon(tickets.pop(i))
                    self.pool.lost(r, outcome)
                    again += placed[r]
                    continue
                output: ReplicaOutput = outcome[0]
                for i, samples in zip(placed[r], output.trajectories, strict=True):
                    results[i] = samples
                    self.router.finish(tickets.pop(i), sum(len(t.response_ids) for t in samples))
                self.router.loads[r].busy_seconds += output.seconds
                # The replica's engine time, drawn from its submission (its start is not sent back):
                # the rest of the round, up to the slowest replica, it waited.
                self.timeline.add(replica_role(r), "serve", submitted[c], submitted[c] + output.seconds,
                                  requests=len(placed[r]), tokens=int(output.engine_counts.get("generated_tokens", 0)))
                outputs[r] = _summed(outputs.get(r, _NOTHING), output)
        except BaseException:
            for ticket in tickets.values():  # the round failed: none of its requests is in flight
                self.router.abandon(ticket)
            raise
        return sorted(again)

    def stream(self, requests: Sequence[GenerationRequest]) -> Iterator[tuple[int, list[Trajectory]]]:
        """``stream_batches``, one request at a time."""
        with contextlib.closing(self.stream_batches(requests)) as batches:
            for batch in batches:
                yield from batch

    def stream_batches(
        self, requests: Sequence[GenerationRequest], by_reference: bool = False
    ) -> Iterator[list[tuple[int, Any]]]:
        """``generate``, yielding each request's ``n`` trajectories as ``(request index,
        trajectories)`` as soon as its replica finishes it (completion order; those that one poll
        of the replicas found finished come in one list), while the replicas keep generating the
        rest: the same trajectories and round metrics as ``generate``. One ``ReplicaStream``
        given the whole round at once; close the iterator (e.g. ``contextlib.closing``) to abort
        what is unfinished. ``by_reference``: ``(request index, ScoredGroup)``, scored by the
        replica, which keeps the tokens (``ReplicaStream.poll_records``)."""
        with contextlib.closing(self.open_stream()) as stream:
            stream.add(requests, keys=range(len(requests)))
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
            group = self.groups[r]
            if group is None or not self.router.loads[r].alive:
                continue
            try:
                group.call_one(0, RolloutWorker.abort)
            except WorkerError as error:  # it failed too: the next call to it says so
                logger.warning("could not abort the requests of %s: %s", replica_role(r), str(error).splitlines()[0])

    def prepare_sync(self) -> None:
        """Before a weight sync: find the replicas that died while idle (the actor trained), which
        the sync would fail on, and restart every replica down (elastic: ``resize``), so that the
        sync gives them the weights (no-op where replicas are not restarted). A broadcast sync forms
        its group again after (``rejoin_weight_sync``)."""
        pool = self.pool
        if pool.max_restarts > 0 or pool.elastic is not None:
            self._each(RolloutWorker.ping, recover=True)
        if pool.elastic is not None:
            pool.resize()
        else:
            pool.restart_down()

    def ensure_live(self) -> None:
        """With every replica down, restart them now and have the trainer bring them the rollout's
        weights (``restore_weights``): nobody else is left to serve. A no-op while one is alive."""
        if any(self.router.loads[k].alive for k in self.active) or not self.pool.down:
            return
        if self.restore_weights is None:
            raise WorkerError(f"every rollout replica is down ({'; '.join(self.pool.down_reasons)}), and nothing can "
                              f"give a restarted one the rollout's weights mid-round", process_died=True)
        self.restore_weights(self.pool.restart_down())

    def _record_round(self, outputs: dict[int, ReplicaOutput], started: float, requests: dict[int, int]) -> None:
        """A round's busy time, timeline spans (from ``started``) and metrics, per replica."""
        for r, output in outputs.items():
            self.router.loads[r].busy_seconds += output.seconds
            if requests.get(r):  # the replica's engine time, from the round's start to its last finish
                self.timeline.add(replica_role(r), "serve", started, started + output.seconds, requests=requests[r],
                                  tokens=int(output.engine_counts.get("generated_tokens", 0)))
        self._metrics.append(self._round_metrics(outputs))

    def _round_metrics(self, outputs: dict[int, ReplicaOutput]) -> dict[str, float]:
        """The load figures over the replicas of the moment (a removed one's share still counts in
        the token totals), and with ``rollout.elastic`` how many were serving at the round's end."""
        slots = self.active
        served = [outputs.get(r, _NOTHING) for r in slots]
        tokens = [int(o.engine_counts.get("generated_tokens", 0)) for o in served]
        metrics = self.router.metrics([o.seconds for o in served], tokens, slots)
        for name in _SUMMED_COUNTS:
            metrics[f"rollout/{name}"] = sum(o.engine_counts.get(name, 0.0) for o in outputs.values())
        if self.pool.elastic is not None:
            metrics["rollout/replicas"] = float(sum(self.router.loads[r].alive for r in slots))
        return metrics

    def take_metrics(self) -> dict[str, float]:
        """Rollout metrics since the last call: token counts summed over generation rounds, the
        load figures of the last round (a step's main generation), and where replicas can be
        restarted the restarts so far (``rollout/replica_restarts``)."""
        rounds, self._metrics = self._metrics, []
        if not rounds:
            return {}
        merged = dict(rounds[-1])
        if self.pool.max_restarts > 0:
            merged["rollout/replica_restarts"] = float(self.pool.total_restarts)
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
        sync restores them) until the next ``generate`` (no-op unless ``rollout.free_cache_engine``).
        A replica found dead here is down, as in a round."""
        if self.free_cache_engine and not self._asleep:
            self._each(RolloutWorker.sleep, self.sleep_level, recover=True)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self._each(RolloutWorker.wake_up, recover=True)
            self._asleep = False

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Copy new weights into every replica (the object-store path); ``version`` is the policy
        version their tokens record from now on (default: each engine's last + 1)."""
        items = list(weights)
        self.prepare_sync()
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
        uuids = self._each(RolloutWorker.device_uuid)
        return [uuids[k] for k in self.active]

    def node_addresses(self) -> list[str]:
        return [address for k in self.active for address in self.group(k).node_addresses()]

    def submit_join_weight_sync(self, host: str, port: int, world_size: int, on_gpu: bool) -> list[PendingCall[None]]:
        """Every replica joins the weight-sync group, the i-th of them (``active``) as member i + 1
        (actor rank 0 sends)."""
        return [self.group(k).submit_one(0, RolloutWorker.join_weight_sync, host, port, world_size, on_gpu,
                                         member=SENDER_RANK + 1 + i) for i, k in enumerate(self.active)]

    def submit_receive(self, version: int | None = None) -> list[PendingCall[TransferStats]]:
        """Every replica receives the sync that actor rank 0 sends at the same time (``version``
        as in ``update_weights``)."""
        return [self.group(k).submit_one(0, RolloutWorker.receive_weights, version) for k in self.active]

    def close_weight_sync(self) -> None:
        self._each(RolloutWorker.close_weight_sync)

    def close(self) -> None:
        for group in (self.group(k) for k in self.active):
            try:  # a replica's HTTP server (rollout.mode=server) stops before its process goes
                wait_all(group.submit_one(0, RolloutWorker.close))
            except Exception:  # a dead replica has nothing left to stop
                logger.debug("closing %s", group, exc_info=True)
            group.close()

    def _each(self, method: Callable[..., Any], *args: Any, recover: bool = False) -> list[Any]:
        """``method`` on every replica at once, but those down; results by slot (None for a replica
        down and a slot without one). ``recover``: a replica that died meanwhile goes down (``_lost``), else its
        error fails the call."""
        up = [k for k in self.active if not self.pool.is_down(k)]
        results: list[Any] = [None] * len(self.groups)
        calls = [self.group(k).submit_one(0, method, *args) for k in up]
        if not recover:
            for k, done in zip(up, wait_all(*calls), strict=True):
                results[k] = done[0]
            return results
        for c, outcome in wait_each(*calls):
            if isinstance(outcome, WorkerError):
                self.pool.lost(up[c], outcome)
            else:
                results[up[c]] = outcome[0]
        return results


_NOTHING = ReplicaOutput([], 0.0, {})  # a replica's round before its first answer


def _summed(a: ReplicaOutput, b: ReplicaOutput) -> ReplicaOutput:
    """Two passes of one replica over a round (before and after a peer's requests came to it)."""
    counts = dict(a.engine_counts)
    for name, value in b.engine_counts.items():
        counts[name] = counts.get(name, 0.0) + value
    return ReplicaOutput(a.trajectories + b.trajectories, a.seconds + b.seconds, counts)


class ReplicaStream:
    """Requests streamed through the replicas: ``add`` places and starts them at any time (they
    join whatever each replica is generating), ``poll`` hands back those finished since, as
    ``(key, trajectories)``. One owner thread at a time.

    Tags carry the stream's number, so a late result of an earlier, failed stream is never taken
    for this one's. A replica that dies is found within one poll (``STREAM_POLL_S``): down, its
    unfinished requests started again on the others with their seeds (``RolloutReplicas``); one
    that cannot be restarted, or that raises, raises ``WorkerError`` naming it and is marked dead
    in the router. A replica replaced between two polls (a weight sync in the middle of the stream
    restarted or removed it, or an elastic run gave its slot a new one) no longer holds what the
    stream started there: those requests are started again too. ``close`` abandons in the router,
    and aborts on the replicas still alive, every request not finished (a failure, or an early stop).

    A *round* is the stream's work between two ``end_round`` calls: its replicas' busy seconds
    (start to last finish), engine counters and timeline spans go to the rollout metrics
    (``RolloutReplicas.take_metrics``) as one generation round. Every per-replica record is by
    slot, so replicas that come and go (``rollout.elastic``) need nothing of the stream."""

    def __init__(self, replicas: RolloutReplicas, number: int) -> None:
        self._replicas, self._number = replicas, number
        self._waiting: dict[int, dict[tuple[int, Any], Ticket]] = {}  # per replica: tag -> ticket
        # The group each replica's requests were started on: a replica replaced since holds none of them.
        self._started_on: dict[int, WorkerGroup[RolloutWorker]] = {}
        # tag -> request (its row's fields on it): what a replica that died had is started again from here.
        self._sent: dict[tuple[int, Any], GenerationRequest] = {}
        self._round_start = time.perf_counter()
        self._seconds: dict[int, float] = {}  # per replica: the round's latest finish, from its requests' start
        self._requests: dict[int, int] = {}  # requests placed in this round
        self._before: dict[int, dict[str, float]] = {}  # engine counters at the round's start
        self._after: dict[int, dict[str, float]] = {}  # ... at the latest call
        # Counters of a replica's process that died in this round, up to its last answer (its new one counts from 0).
        self._carried: dict[int, dict[str, float]] = {}

    @property
    def in_flight(self) -> int:
        return sum(len(waiting) for waiting in self._waiting.values())

    def add(self, requests: Sequence[GenerationRequest], keys: Iterable[Any]) -> None:
        """Place ``requests`` and start them, each under its key (what ``poll`` returns it with)."""
        tags = [(self._number, key) for key in keys]
        self._start(list(zip(tags, requests, strict=True)))

    def _start(self, items: list[tuple[tuple[int, Any], GenerationRequest]]) -> None:
        """Place and start ``(tag, request)``; a replica that dies taking them is down and its share
        is placed again on the others."""
        replicas = self._replicas
        replicas.ensure_live()
        items += self._take_back_replaced()
        tickets = replicas.router.place([RouteRequest(len(r.prompt_ids), r.params.n, r.params.max_tokens)
                                         for _, r in items])
        placed: dict[int, list[int]] = {}
        for i, ((tag, request), ticket) in enumerate(zip(items, tickets, strict=True)):
            placed.setdefault(ticket.replica, []).append(i)
            self._waiting.setdefault(ticket.replica, {})[tag] = ticket  # in flight from here: close abandons it
            self._sent[tag] = request
        order = list(placed)
        for r in order:
            self._started_on[r] = replicas.group(r)
        starts = [replicas.group(r).submit_one(0, RolloutWorker.start, [items[i][1] for i in placed[r]],
                                               [items[i][0] for i in placed[r]])
                  for r in order]
        again = []
        for c, outcome in wait_each(*starts):
            r = order[c]
            if isinstance(outcome, WorkerError):
                again += self._replica_lost(r, outcome)
                continue
            counts = outcome[0]
            self._before[r] = self._before.get(r) or counts
            self._after[r] = self._after.get(r) or counts
            self._requests[r] = self._requests.get(r, 0) + len(placed[r])
        if again:
            self._start(again)

    def _take_back(self, r: int) -> list[tuple[tuple[int, Any], GenerationRequest]]:
        """Replica ``r``'s unfinished requests leave it (returned, to start again on the others);
        its counters so far stay with the round."""
        waiting = self._waiting.pop(r, {})
        lost = [(tag, self._sent[tag]) for tag in waiting]
        for ticket in waiting.values():
            self._replicas.router.abandon(ticket)
        self._carried[r] = _delta(self._after.get(r, {}), self._before.get(r, {}), self._carried.get(r, {}))
        self._before[r], self._after[r] = {}, {}  # the new process's engine counts from 0
        return lost

    def _replica_lost(self, r: int, error: WorkerError) -> list[tuple[tuple[int, Any], GenerationRequest]]:
        """Replica ``r`` failed: ``_take_back``, then ``ReplicaPool.lost`` (which raises when
        it cannot be restarted)."""
        lost = self._take_back(r)
        self._replicas.pool.lost(r, error)
        return lost

    def _take_back_replaced(self) -> list[tuple[tuple[int, Any], GenerationRequest]]:
        """The unfinished requests of every replica replaced since they started there."""
        groups = self._replicas.groups
        replaced = [r for r, waiting in self._waiting.items() if waiting and groups[r] is not self._started_on.get(r)]
        for r in replaced:
            logger.warning("%s was replaced while %d request(s) of a stream ran on it: started again on the "
                           "replicas of now", replica_role(r), len(self._waiting[r]))
        return [item for r in replaced for item in self._take_back(r)]

    def poll(self) -> list[tuple[Any, list[Trajectory]]]:
        """The requests finished since the last poll (waiting at most ``STREAM_POLL_S`` for one)."""
        return [(finished.tag[1], finished.trajectories) for finished in self._poll(RolloutWorker.take)]

    def poll_records(self) -> list[tuple[Any, ScoredGroup]]:
        """``poll`` on the by-reference data plane: each finished request scored by its replica,
        which keeps its tokens; its records and reward tally (``RolloutWorker.take_records``)."""
        return [(group.tag[1], group) for group in self._poll(RolloutWorker.take_records)]

    def _poll(self, take: Callable[..., Any]) -> list[Any]:
        replicas = self._replicas
        again = self._take_back_replaced()
        polled = [r for r, waiting in self._waiting.items() if waiting]
        done = []
        for c, outcome in wait_each(*(replicas.group(r).submit_one(0, take, STREAM_POLL_S) for r in polled)):
            r = polled[c]
            if isinstance(outcome, WorkerError):
                again += self._replica_lost(r, outcome)
                continue
            batch: StreamBatch | RecordBatch = outcome[0]
            self._after[r] = batch.engine_counts
            for finished in batch.finished:
                ticket = self._waiting[r].pop(finished.tag, None)
                if ticket is None:
                    logger.debug("%s: dropped a result of an earlier stream: %r", replica_role(r), finished.tag)
                    continue
                self._sent.pop(finished.tag, None)
                samples = finished.trajectories if isinstance(finished, Finished) else finished.records
                replicas.router.finish(ticket, sum(t.response_length for t in samples))
                self._seconds[r] = max(self._seconds.get(r, 0.0), finished.seconds)
                done.append(finished)
        if again:
            self._start(again)
        return done

    def end_round(self) -> None:
        """Record the round so far as one generation round (see the class docstring); the next starts now."""
        slots = set(self._after) | set(self._carried) | set(self._seconds)
        outputs = {r: ReplicaOutput([], self._seconds.get(r, 0.0),
                                    _delta(self._after.get(r, {}), self._before.get(r, {}), self._carried.get(r, {})))
                   for r in slots}
        self._replicas._record_round(outputs, self._round_start, self._requests)
        self._round_start = time.perf_counter()
        self._seconds, self._requests, self._carried = {}, {}, {}
        self._before = {r: dict(after) for r, after in self._after.items()}

    def close(self) -> None:
        """Abandon and abort what is unfinished (nothing when every request finished)."""
        unfinished = [r for r, waiting in self._waiting.items() if waiting]
        for r in unfinished:
            for ticket in self._waiting[r].values():
                self._replicas.router.abandon(ticket)
        self._waiting.clear()
        self._sent.clear()
        if unfinished:
            self._replicas._abort(unfinished)


def _delta(after: dict[str, float], before: dict[str, float], carried: dict[str, float]) -> dict[str, float]:
    """An engine's counters over a span (``after - before``), plus ``carried`` (a dead process's share)."""
    counts = {k: v - before.get(k, 0.0) for k, v in after.items()}
    for name, value in carried.items():
        counts[name] = counts.get(name, 0.0) + value
    return counts
