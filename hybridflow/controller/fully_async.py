"""The fully asynchronous loop (``trainer.mode=fully_async``): the rollout never waits for an update,
and samples move from rollout to trainer one prompt group at a time.

    rollout thread:  admit generation round b (the next data.train_batch_size prompts) once the
                         actor has made b - 1 - s updates; its requests join the ones in flight
                     each prompt group, as soon as its samples finish: score it, put it on the queue
    trainer:         for step k: take data.train_batch_size groups from the queue, drop (and
                         count) any staler than s, update the actor, push the new weights into
                         the generation in flight (partial rollout)

``s`` is ``async_training.staleness_threshold``. Rounds are admitted on one continuous stream
(``ReplicaStream``): round b+1's requests start while round b's long tail is still generating, so
the engine's batch never drains between rounds. At most (s + 1) rounds of groups are admitted
and not yet trained (dropped groups give their place back): the admission rule is the queue's
backpressure, and the queue holds only prompt groups, never whole steps.

Which groups a step takes is ``async_training.consume_order``. ``draw`` (default): the next
groups in the order the sampler drew them, so step k trains on round k's prompts, as the sync
loop does (it waits for its own long tail while later rounds generate); nothing taken can be
staler than s. ``completion``: the first groups to finish, whichever round drew them (a step
never waits on a long tail, and which prompts it trains on depends on timing; a group whose
oldest token is more than s versions behind when taken is dropped, ``async/dropped_samples``).
Either way a step's groups are put in draw order before training. ``s = 0`` with ``draw`` is the
synchronous algorithm step for step: same prompts, seeds and weights.

Partial rollout (``async_training.partial_rollout``, the default; the native engine): after each
update the trainer pushes its weights at once, into the generation in flight. The engine swaps
them between two decode steps; samples in flight keep the tokens they have, recompute their keys
and values under the new weights and go on, and every token records the version that sampled it
(``Trajectory.token_versions``), so a sample's staleness is its oldest token's. Without it (other
engines), weights change on the rollout only when nothing is in flight: the rollout thread stops
admitting, lets the stream drain, and applies the weights the trainer staged (``_staged``), or
with ``rollout.weight_sync=broadcast`` syncs from actor rank 0 under ``_actor_lock``.

Validation and checkpoints pause the rollout thread between two polls (``_rollout_lock``; without
partial rollout, once the stream has drained) and see the actor's newest weights. A checkpoint records, for the earliest round with prompt groups not
yet trained, the sampler's position before it drew, and which groups of that and later rounds
were trained (or dropped): a resumed run draws those rounds again and generates only the rest,
so no prompt is lost and none is trained twice.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

from hybridflow.algorithms import select_varied_groups
from hybridflow.controller import phases
from hybridflow.controller.overlap import merge_model_metrics, round_requests, score_part
from hybridflow.controller.replicas import ReplicaStream
from hybridflow.controller.roles import BROADCAST
from hybridflow.controller.setup import RunSetup
from hybridflow.controller.trainer import WeightVersions
from hybridflow.data import PromptRow
from hybridflow.rewards.tally import RewardTally
from hybridflow.types import Sample, Trajectory
from hybridflow.utils.timer import PhaseTimer

Key = tuple[int, int]  # (generation round, the group's position in the round)


class FullyAsyncLoop:
    def __init__(self, run: RunSetup, versions: WeightVersions) -> None:
        self.roles, self.plan, self.prompts, self.versions = run.roles, run.plan, run.prompts, versions
        self.kl_controller, self.dumps, self.timeline = run.kl_controller, run.dumps, run.timeline
        settings = run.cfg.async_training
        self.staleness, self.partial_rollout = settings.staleness_threshold, settings.partial_rollout
        self.in_draw_order = settings.consume_order == "draw"
        # trainer.data_plane=refs: replicas score groups and keep their tokens; the queue holds records.
        self.by_reference = run.plan.by_reference
        self.batch_groups = run.plan.groups_per_step
        self._step = 0  # the trainer's step in progress (0: none yet)
        self._queue: queue.Queue[_Group] = queue.Queue()  # bounded by admission (module docstring)
        self._taken: dict[Key, _Group] = {}  # off the queue, waiting for their turn (draw order)
        self._actor_lock = threading.Lock()  # the actor: the trainer's updates vs the rollout's weight syncs
        self._rollout_lock = threading.Lock()  # the replicas: the rollout thread's polls vs validation
        self._draining = threading.Event()  # without partial rollout: admit nothing until the stream is empty
        self._in_flight = 0  # the stream's requests in flight after the rollout thread's last poll
        self._state = threading.Condition()  # guards what follows; the rollout thread waits here to admit
        self._rounds: dict[int, _Round] = {}  # admitted rounds with groups not yet taken or dropped
        self._next_round = 1
        self._resumed: dict[int, set[int]] = {}  # round -> groups a resumed run trained already
        self._live = 0  # groups admitted and not dropped, trained ones included
        self._counts = _Counts()  # the rollout side's numbers since the last step
        self._epochs: dict[int, int] = {}  # round -> the sampler's epoch after it drew (training/epoch)
        self._staged: _Staged | None = None  # the newest weights for the rollout, as the trainer left them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def train_step(self, step: int) -> dict[str, float]:
        roles, plan, timer = self.roles, self.plan, PhaseTimer(self.timeline)
        self._step = step
        self._start()
        with timer.phase("step"):
            with timer.phase("wait_rollout"):
                groups, dropped = self._take_batch()
            with self._actor_lock:
                collected = self._collected(groups)
                samples, batch_metrics = phases.prepare_batch(roles, plan, collected.groups, step, timer,
                                                              self.kl_controller, self.dumps)
                update_metrics = self.versions.update(samples.batch, step, timer)
                phases.feed_sampler(self.prompts.sampler, step, collected)
                if self.partial_rollout:
                    with timer.phase("update_weights"):  # into the generation in flight (module docstring)
                        self.versions.push()
                    staged = None
                else:
                    with timer.phase("stage_weights"):
                        staged = None if roles.weight_sync == BROADCAST else phases.weights_snapshot(roles)
            with self._state:
                self._staged = _Staged(self.versions.actor, staged) if staged is not None else None
                counts, self._counts = self._counts, _Counts()
                self._state.notify_all()
        started = {id(t): g.version for g in groups for t in g.trajectories}
        overlap = {
            "async/dropped_samples": float(dropped),
            "async/queue_size": float(self._queue.qsize() + len(self._taken)),
            **phases.async_metrics(samples.trajectories, step - 1, [started[id(t)] for t in samples.trajectories],
                                   self.staleness, timer, counts.idle_s, counts.busy_s),
        }
        return (collected.metrics | batch_metrics | update_metrics
                | phases.step_metrics(roles, plan, step, collected, samples, timer) | overlap)

    # ------------------------------------------------------------------ the trainer's side of the queue
    def _take_batch(self) -> tuple[list[_Group], int]:
        """A step's groups in draw order, and how many samples were dropped as too stale."""
        groups, dropped = [], 0
        while len(groups) < self.batch_groups:
            group = self._take_group()
            with self._state:
                self._rounds[group.key[0]].pending.discard(group.key[1])
                self._forget_finished_rounds()
                if self._step - 1 - min(phases.oldest_version(t, group.version) for t in group.trajectories) > self.staleness:
                    dropped += len(group.trajectories)
                    self._live -= 1  # its place goes to a group not yet admitted
                    self._state.notify_all()
                    continue
            groups.append(group)
        return sorted(groups, key=lambda g: g.key), dropped

    def _take_group(self) -> _Group:
        """The next group by ``consume_order``, waiting for the rollout thread as long as it takes."""
        while True:
            key = self._next_in_draw_order() if self.in_draw_order else next(iter(self._taken), None)
            if key is not None and key in self._taken:
                return self._taken.pop(key)
            group = self._queue.get()
            if group is _FAILED:
                assert self._failure is not None
                raise self._failure
            self._taken[group.key] = group

    def _next_in_draw_order(self) -> Key | None:
        with self._state:
            for b in sorted(self._rounds):
                if self._rounds[b].pending:
                    return b, min(self._rounds[b].pending)
        return None

    def _forget_finished_rounds(self) -> None:
        """Rounds all of whose groups are taken leave the record a checkpoint keeps (``_state`` held)."""
        for b in [b for b, r in self._rounds.items() if not r.pending]:
            del self._rounds[b]

    def _collected(self, groups: list[_Group]) -> phases.Collected:
        """The step's groups as ``phases.collect`` returns a step's samples: numbered in batch order,
        with the reward metrics of exactly these samples and the rollout's numbers since the last step."""
        tally, model_parts = RewardTally(), []
        for group in groups:
            tally.merge(group.tally)
            model_parts.extend(group.model_parts)
        phases.number_groups([g.trajectories for g in groups])
        trajectories = [t for g in groups for t in g.trajectories]
        with self._state:
            generated, constant, filtered = self._counts.generated, self._counts.constant, self._counts.filtered
        metrics = (tally.metrics() | merge_model_metrics(model_parts)
                   | phases.collection_metrics(self.plan, trajectories, generated, constant))
        if self.plan.group_filter.enable:
            metrics["filter/dropped_groups"] = float(filtered)
        epoch = max(self._epochs.get(g.key[0], self.prompts.sampler.epoch) for g in groups)
        return phases.Collected([g.trajectories for g in groups], metrics | self.roles.rollout.take_metrics(), epoch,
                                [g.index for g in groups])

    # ------------------------------------------------------------------ the rollout thread
    def _start(self) -> None:
        """Start the rollout thread at the first step of this process (after any resume)."""
        if self._thread is None:
            self._live = (self._step - 1) * self.batch_groups  # trained before this process
            self._thread = threading.Thread(target=self._produce, name="fully-async rollout", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        try:
            with contextlib.closing(self.roles.rollout.open_stream()) as stream:
                delivered, round_start = 0, time.perf_counter()
                while not self._stop.is_set():
                    started = time.perf_counter()
                    with self._rollout_lock:
                        if not self._draining.is_set():
                            self._admit(stream)
                        finished = self._poll(stream) if stream.in_flight else []
                        ready = [group for key, samples, tally in finished
                                 if (group := self._queue_group(key, samples, tally)) is not None]
                        busy = bool(stream.in_flight or finished)
                        delivered += len(finished)
                        if delivered >= self.batch_groups:
                            # A batch's worth of generation is one round of rollout metrics, ended
                            # before its last groups reach the trainer, which reports them.
                            stream.end_round()
                            PhaseTimer(self.timeline, track="rollout").add(
                                "gen", time.perf_counter() - round_start, start=round_start)
                            delivered, round_start = delivered - self.batch_groups, time.perf_counter()
                    for group in ready:
                        self._queue.put(group)
                    with self._state:
                        self._in_flight = stream.in_flight
                        self._state.notify_all()
                        if busy:
                            self._counts.busy_s += time.perf_counter() - started
                        else:  # nothing in flight and nothing admissible: wait for an update
                            self._state.wait(timeout=0.1)
                            self._counts.idle_s += time.perf_counter() - started
        except BaseException as exc:  # the trainer raises it at its next take
            self._failure = exc
            self._queue.put(_FAILED)

    def _admit(self, stream: ReplicaStream) -> None:
        """Start every round the staleness bound admits (module docstring); with weights that can
        change only between generations, first let the stream drain and take the newest weights."""
        while not self._stop.is_set():
            with self._state:
                if self._live + self.batch_groups > (self.versions.actor + 1 + self.staleness) * self.batch_groups:
                    return
                behind = not self.partial_rollout and self.versions.rollout < self.versions.actor
            if behind:
                if stream.in_flight:
                    return  # no new requests until the old weights' ones are done
                self._refresh_weights()
                with self._state:
                    # The trainer bumps its version in the update and stages the weights a moment
                    # later: a round admitted in between would generate with the old weights, and
                    # with a staleness bound of 0 be dropped (other samples than the sync loop's).
                    if self.versions.rollout < self.versions.actor:
                        return  # wait for the staged weights (the trainer notifies)
            self._admit_round(stream)

    def _admit_round(self, stream: ReplicaStream) -> None:
        plan, sampler, b = self.plan, self.prompts.sampler, self._next_round
        sampler_before = sampler.state_dict()
        drawn = sampler.next_batch()
        rows: list[PromptRow] = [self.prompts.train[i] for i in drawn]
        keep = [i for i in range(len(rows)) if i not in self._resumed.pop(b, set())]
        # Seeds from (round, 1, position): the sync loop's for step b's first generation round.
        requests = round_requests(rows, plan.train_sampling, plan.seed, (b, 1), self.prompts.vision)
        with self._state:
            self._rounds[b] = _Round(sampler_before, rows, drawn, set(keep), self.versions.rollout)
            self._epochs[b] = sampler.epoch
            self._live += len(keep)
            self._next_round += 1
        stream.add([requests[i] for i in keep], keys=[(b, i) for i in keep])

    def _poll(self, stream: ReplicaStream) -> list[tuple[Key, list[Sample], RewardTally | None]]:
        """The prompt groups finished since the last poll: trajectories to score here, or (by
        reference) records their replica scored, with its tally."""
        if self.by_reference:
            return [(key, list(group.records), group.tally) for key, group in stream.poll_records()]
        return [(key, list(trajectories), None) for key, trajectories in stream.poll()]

    def _queue_group(self, key: Key, samples: list[Sample], tally: RewardTally | None) -> _Group | None:
        """A finished prompt group with its row's fields and its scores, for the queue (scored here
        unless its replica did, ``tally``); None when dynamic sampling drops it (rewards that do
        not vary)."""
        b, i = key
        record = self._rounds[b]
        model_parts: list[tuple[int, dict[str, float]]] = []
        if tally is None:
            trajectories = cast(list[Trajectory], samples)
            tally = RewardTally()
            score_part(self.roles, trajectories, tally, model_parts)
        fg = self.plan.group_filter
        varied = bool(select_varied_groups([phases.filter_value(t, fg.metric) for t in samples], [i] * len(samples)))
        with self._state:
            self._counts.generated += 1
            self._counts.constant += not varied
            if fg.enable and not varied:  # no learning signal: never queued, its place goes to another group
                record.pending.discard(i)
                self._counts.filtered += 1
                self._live -= 1
                self._forget_finished_rounds()
                return None
        return _Group(key, record.indices[i], samples, tally, model_parts, record.version)

    def _refresh_weights(self) -> None:
        """The newest weights to the rollout while nothing is in flight (without partial rollout)."""
        with self._state:
            staged = self._staged
        if staged is not None and staged.version > self.versions.rollout:
            self.roles.rollout.update_weights(staged.weights)
            self.versions.rollout = staged.version
        elif staged is None:
            with self._actor_lock:  # broadcast: actor rank 0 sends, between two updates
                self.versions.push()

    # ------------------------------------------------------------------ the run around it
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The rollout thread held between polls and the newest weights on the rollout (the caller
        is validation, from the trainer's thread)."""
        with self._paused_rollout():
            self.versions.push()
            yield

    @contextlib.contextmanager
    def _paused_rollout(self) -> Iterator[None]:
        """The rollout thread held between two polls, the actor between two updates. With partial
        rollout the samples in flight take the new weights where they are; without it weights may
        change only when nothing is in flight, so the stream is first drained (nothing admitted)."""
        if not self.partial_rollout:
            self._draining.set()
            with self._state:
                self._state.wait_for(lambda: self._in_flight == 0 or self._failure is not None
                                     or self._thread is None or not self._thread.is_alive())
        try:
            with self._rollout_lock, self._actor_lock:
                yield
        finally:
            self._draining.clear()

    def loop_state(self) -> dict[str, Any]:
        # Rounds drawn but not all trained are drawn again after a resume, from the sampler's
        # position before the first of them; what they trained already is not generated again.
        with self._rollout_lock, self._state:
            if not self._rounds:
                sampler = self.prompts.sampler.state_dict()
                return {"sampler": sampler, "epoch": sampler["epoch"], "first_round": self._next_round, "done": {}}
            first, done = min(self._rounds), {}
            for b in range(first, self._next_round):  # a round no longer recorded was all trained
                r = self._rounds.get(b)
                done[str(b)] = sorted(set(range(len(r.rows))) - r.pending) if r else list(range(self.batch_groups))
            sampler = self._rounds[first].sampler_before
            return {"sampler": sampler, "epoch": sampler["epoch"], "first_round": first, "done": done}

    def load_loop_state(self, state: dict[str, Any]) -> None:
        self._next_round = int(state.get("first_round", self._step + 1))
        self._resumed = {int(b): set(done) for b, done in state.get("done", {}).items()}

    def close(self) -> None:
        self._stop.set()
        with self._state:
            self._state.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)


class _Round:
    """An admitted generation round: the sampler before it drew, its rows and their dataset
    indices, its groups not yet taken by the trainer nor dropped (``pending``), and the rollout's
    weight version when it was admitted."""

    def __init__(self, sampler_before: dict[str, Any], rows: list[PromptRow], indices: list[int], pending: set[int],
                 version: int) -> None:
        self.sampler_before, self.rows, self.indices, self.pending, self.version = (
            sampler_before, rows, indices, pending, version)


class _Group:
    """One prompt group on the queue: its prompt's dataset index, its samples, their reward tally
    and the reward model's metrics, and the rollout's weight version when its round was admitted."""

    def __init__(self, key: Key, index: int, trajectories: list[Sample], tally: RewardTally,
                 model_parts: list[tuple[int, dict[str, float]]], version: int) -> None:
        self.key, self.index, self.trajectories, self.tally, self.model_parts, self.version = (
            key, index, trajectories, tally, model_parts, version)


class _Counts:
    """The rollout side's numbers between two steps."""

    def __init__(self) -> None:
        self.busy_s = self.idle_s = 0.0
        self.generated = self.constant = self.filtered = 0


class _Staged:
    """A copy of the actor's weights after ``version`` updates, for the rollout thread."""

    def __init__(self, version: int, weights: list[tuple[str, Any]]) -> None:
        self.version, self.weights = version, weights


_FAILED: Any = object()
