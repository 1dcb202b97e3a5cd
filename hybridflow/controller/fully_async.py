"""The fully asynchronous loop (``trainer.mode=fully_async``): the rollout never waits for an update.

    rollout thread:  for step b = 1, 2, ...:
                        wait until the actor is at most s versions short of b's on-policy weights
                        collect step b, put it on the queue (blocks while the queue is full)
    trainer:         for step k: take step k's samples from the queue, update the actor,
                        push the new weights into the generation in flight (partial rollout)

``s`` is ``async_training.staleness_threshold``: a step trains on samples from weights at most
``s`` versions behind the actor's (the actor has made k - 1 updates when step k trains; step b
is admitted to generation once the actor has made b - 1 - s). Nothing older is ever generated, so
nothing is dropped (``async/dropped_samples`` stays 0 at this granularity). ``s = 0`` is the
synchronous algorithm step for step (the rollout is idle while the trainer updates); ``s = 1`` overlaps like ``one_step_off``; larger ``s`` lets
the rollout run further ahead through slow updates and long-tailed generations, with a queue
of up to ``s`` finished steps.

Partial rollout (``async_training.partial_rollout``, the default; the native engine): after each
update the trainer pushes its weights at once, into the generation in flight. The engine swaps
them between two decode steps; samples in flight keep the tokens they have, recompute their keys
and values under the new weights and go on, and every token records the version that sampled it
(``Trajectory.token_versions``), so a sample's staleness is its oldest token's. The rollout never
pauses for an update; the behaviour correction uses the rollout's per-token logprobs.

Without it (other engines), weights change only between batches: after each update the trainer
leaves a copy of the new weights (``_staged``) that the rollout thread applies before its next
batch, so neither waits for the other. (With ``rollout.weight_sync=broadcast`` actor rank 0 must
stream the weights itself: the rollout thread then syncs under ``_actor_lock`` and may wait for
the update in progress; a sync gathers from every actor rank and must not interleave with an
update's collectives.) Same prompts and seeds per step as the sync loop. Validation and checkpoints pause the rollout thread between batches
(``_rollout_lock``) and see the actor's newest weights. A checkpoint records the sampler's
position before the first step not yet trained: a resumed run generates those steps again with
its newest weights, so no prompt is lost and none is trained twice.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from hybridflow.controller import phases
from hybridflow.controller.setup import BROADCAST, RunSetup
from hybridflow.controller.trainer import Trainer
from hybridflow.utils.timer import PhaseTimer


class FullyAsyncTrainer(Trainer):
    def __init__(self, run: RunSetup) -> None:
        super().__init__(run)
        self.staleness = run.cfg.async_training.staleness_threshold
        self.partial_rollout = run.cfg.async_training.partial_rollout
        # Finished steps waiting for the trainer: at most s of them wait while the trainer works
        # on another (backpressure: the rollout thread blocks on a full queue).
        self._queue: queue.Queue[_Made] = queue.Queue(maxsize=max(1, self.staleness))
        self._actor_lock = threading.Lock()  # the actor: the trainer's updates vs the rollout's weight syncs
        self._rollout_lock = threading.Lock()  # the replicas: the rollout thread's batches vs validation
        self._versions = threading.Condition()  # the rollout thread waits here for newer actor weights
        self._sampler_before: dict[int, dict[str, Any]] = {}  # step -> sampler state before it drew
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._staged: _Staged | None = None  # the newest weights for the rollout, as the trainer left them

    def train_step(self) -> dict[str, float]:
        run, timer = self.run, PhaseTimer(self.run.timeline)
        self._start()
        with timer.phase("step"):
            with timer.phase("wait_rollout"):
                made = self._next(self.step)
            with self._actor_lock:
                samples, batch_metrics = phases.prepare_batch(run, made.collected.groups, self.step, timer)
                update_metrics = self.update(samples.batch, timer)
                if self.partial_rollout:
                    with timer.phase("update_weights"):  # into the generation in flight (module docstring)
                        self.push_weights()
                    staged = None
                else:
                    with timer.phase("stage_weights"):
                        staged = None if self.run.weight_sync == BROADCAST else phases.weights_snapshot(run)
            with self._versions:
                self._staged = _Staged(self.actor_version, staged) if staged is not None else None
                self._versions.notify_all()
            self._sampler_before.pop(self.step, None)
        overlap = {
            **phases.staleness_metrics(samples.trajectories, self.step - 1, made.version),
            "async/dropped_samples": 0.0,
            "async/queue_size": float(self._queue.qsize()),
            "async/trainer_idle_ratio": timer.seconds("wait_rollout") / timer.seconds("step"),
            "async/rollout_idle_ratio": made.idle / max(made.idle + made.seconds, 1e-9),
            **made.timer.metrics(),
            "timing_s/rollout_busy": made.seconds,
        }
        return made.collected.metrics | batch_metrics | update_metrics | phases.step_metrics(run, self.step, made.collected, samples, timer) | overlap

    # ------------------------------------------------------------------ the rollout thread
    def _start(self) -> None:
        """Start the rollout thread at the first step of this process (after any resume)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, args=(self.step,), name="fully-async rollout",
                                            daemon=True)
            self._thread.start()

    def _produce(self, first: int) -> None:
        try:
            last_end = time.perf_counter()  # the rollout's idle time: between one batch's end and the next's start
            for step in range(first, self.run.total_steps + 1):
                with self._versions:  # admission: never generate a step more than s versions stale
                    self._versions.wait_for(lambda: self._stop.is_set() or self.actor_version >= step - 1 - self.staleness)
                if self._stop.is_set():
                    return
                with self._rollout_lock:
                    self._refresh_weights()
                    version, timer, start = self.rollout_version, PhaseTimer(self.run.timeline, track="rollout"), time.perf_counter()
                    self._sampler_before[step] = self.run.sampler.state_dict()
                    collected = phases.collect(self.run, step, timer)
                    end = time.perf_counter()
                    made = _Made(step, version, collected, timer, end - start, start - last_end)
                    last_end = end
                while not self._stop.is_set():  # a full queue holds the rollout back
                    try:
                        self._queue.put(made, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # the trainer raises it at its next take
            self._failure = exc
            self._queue.put(_FAILED)  # type: ignore[arg-type]

    def _refresh_weights(self) -> None:
        """The newest weights to the rollout (the rollout thread, between batches); nothing to do
        with partial rollout, where the trainer pushes them as soon as it has them."""
        if self.partial_rollout:
            return
        with self._versions:
            staged = self._staged
        if staged is not None and staged.version > self.rollout_version:
            self.run.rollout.update_weights(staged.weights)
            self.rollout_version = staged.version
        elif staged is None:
            with self._actor_lock:  # broadcast: actor rank 0 sends, between two updates
                self.push_weights()

    def _next(self, step: int) -> _Made:
        made = self._queue.get()
        if made is _FAILED:
            assert self._failure is not None
            raise self._failure
        assert made.step == step, f"samples of step {made.step} taken at step {step}"
        return made

    # ------------------------------------------------------------------ the run around it
    def quiesce(self) -> None:
        """Hold the rollout thread between batches and put the newest weights on the rollout (the
        caller is validation or a checkpoint: both run from the trainer's thread)."""
        with self._rollout_lock, self._actor_lock:
            self.push_weights()

    def validate(self) -> dict[str, float]:
        if self.run.val_data is None:
            return {}
        with self._rollout_lock, self._actor_lock:
            self.push_weights()
            with self.run.timeline.span("trainer", "testing"):
                return phases.validate(self.run, self.step)


    def loop_state(self) -> dict[str, Any]:
        # Steps generated but not trained are generated again after a resume: record the sampler
        # before the first of them drew (or now, when the rollout thread has not started it).
        with self._rollout_lock:
            sampler = self._sampler_before.get(self.step + 1, self.run.sampler.state_dict())
        return {"sampler": sampler, "epoch": sampler["epoch"]}

    def close(self) -> None:
        self._stop.set()
        with self._versions:
            self._versions.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)


class _Made:
    """One step's samples and how they were made (weight version, rollout-side timings)."""

    def __init__(self, step: int, version: int, collected: phases.Collected, timer: PhaseTimer, seconds: float,
                 idle: float) -> None:
        self.step, self.version, self.collected, self.timer, self.seconds, self.idle = (
            step, version, collected, timer, seconds, idle)


class _Staged:
    """A copy of the actor's weights after ``version`` updates, for the rollout thread."""

    def __init__(self, version: int, weights: list[tuple[str, Any]]) -> None:
        self.version, self.weights = version, weights


_FAILED = object()
