"""The one-step-off-policy loop (``trainer.mode=one_step_off``).

    step k:  take the samples of step k (generated while step k-1 trained)
             weights after step k-1 -> rollout
             start generating step k+1 in the background   ─┐ overlap
             advantages, critic and actor update of step k ─┘
             (step 1, and the first step after a resume, generate in the foreground)

Generation of step k+1 runs while step k trains, so the slower of the two sets the pace instead
of their sum. The price is staleness: step k trains on samples from the weights after step k-2,
one version behind the actor (``async/staleness/mean`` = 1 from step 2 on). The actor's logprobs
before the update are the proximal policy and the rollout's the behaviour policy: with
``async_training.behaviour_correction`` (the default) the loss is weighted by truncated ratios
between them (decoupled PPO).

Same prompts and seeds per step as the sync loop (``phases.collect`` seeds by step); only the
weights that generate them differ. Validation sees the actor's newest weights: ``paused`` lets
the step in the making finish and then syncs. A checkpoint holds the sampler's
position before the step in the making drew its prompts, so a resumed run generates that step
again (with newer weights): no prompt is lost and none is trained twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from hybridflow.controller import phases
from hybridflow.controller.setup import RunSetup
from hybridflow.controller.trainer import WeightVersions
from hybridflow.utils.timer import PhaseTimer

# Versions a trained sample may lag the actor: step k's samples come from the weights after step k-2.
STALENESS_BOUND = 1


class OneStepOffLoop:
    def __init__(self, run: RunSetup, versions: WeightVersions) -> None:
        self.roles, self.plan, self.prompts, self.versions = run.roles, run.plan, run.prompts, versions
        self.kl_controller, self.dumps, self.timeline = run.kl_controller, run.dumps, run.timeline
        # One background thread: the rollout side of the loop (generation and scoring).
        self._rollout_thread = ThreadPoolExecutor(1, thread_name_prefix="one-step-off rollout")
        self._ahead: _Ahead | None = None
        self._rollout_end: float | None = None  # when the rollout side last finished a batch

    def train_step(self, step: int) -> dict[str, float]:
        roles, plan, timer = self.roles, self.plan, PhaseTimer(self.timeline)
        with timer.phase("step"):
            with timer.phase("wait_rollout"):
                collected, made = self._take(step)
            with timer.phase("update_weights"):
                self.versions.push()
            if step < plan.total_steps:
                self._start_next(step + 1)
            samples, batch_metrics = phases.prepare_batch(roles, plan, collected.groups, step, timer,
                                                          self.kl_controller, self.dumps)
            update_metrics = self.versions.update(samples.batch, step, timer)
            phases.feed_sampler(self.prompts.sampler, step, collected)
        # Staleness: versions between the weights that made the samples and the actor's before this update.
        overlap = made.timer.metrics() | phases.async_metrics(  # gen, reward: timed on the rollout side
            samples.trajectories, step - 1, [made.version] * len(samples.trajectories), STALENESS_BOUND, timer,
            made.idle, made.seconds)
        return (collected.metrics | batch_metrics | update_metrics
                | phases.step_metrics(roles, plan, step, collected, samples, timer) | overlap)

    # ------------------------------------------------------------------ the rollout side
    def _start_next(self, step: int) -> None:
        timer = PhaseTimer(self.timeline, track="rollout")
        # The sampler's position before this step draws: what a checkpoint taken meanwhile records.
        sampler_state = self.prompts.sampler.state_dict()
        future = self._rollout_thread.submit(self._collect, step, timer)
        self._ahead = _Ahead(step, self.versions.rollout, sampler_state, timer, future)

    def _collect(self, step: int, timer: PhaseTimer) -> tuple[phases.Collected, float, float]:
        start = time.perf_counter()
        collected = phases.collect(self.roles, self.plan, self.prompts, step, timer)
        end = time.perf_counter()
        # The rollout's idle time: from the end of its previous batch to the start of this one.
        idle, self._rollout_end = start - (self._rollout_end or start), end
        return collected, end - start, idle

    def _take(self, step: int) -> tuple[phases.Collected, _Made]:
        """This step's samples: the ones made in the background, or (none in the making: the first
        step, a resumed run) made now with the rollout's weights."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            timer = PhaseTimer(self.timeline, track="rollout")
            collected, seconds, idle = self._collect(step, timer)
            return collected, _Made(self.versions.rollout, timer, seconds, idle)
        assert ahead.step == step, f"samples of step {ahead.step} taken at step {step}"
        collected, seconds, idle = ahead.future.result()
        return collected, _Made(ahead.version, ahead.timer, seconds, idle)

    @contextmanager
    def paused(self) -> Iterator[None]:
        if self._ahead is not None:
            self._ahead.future.result()  # done; its samples stay for their step
        self.versions.push()
        yield

    def loop_state(self) -> dict[str, Any]:
        if self._ahead is None:
            return {}
        # The step in the making drew prompts the checkpoint must not skip: record the sampler before it.
        return {"sampler": self._ahead.sampler_state, "epoch": self._ahead.sampler_state["epoch"]}

    def load_loop_state(self, state: dict[str, Any]) -> None:
        """Nothing to put back: the step in the making is generated again (module docstring)."""

    def close(self) -> None:
        self._rollout_thread.shutdown(wait=True, cancel_futures=True)


class _Made:
    """How a step's samples were made: the rollout's weight version, the rollout side's timings."""

    def __init__(self, version: int, timer: PhaseTimer, seconds: float, idle: float) -> None:
        self.version, self.timer, self.seconds, self.idle = version, timer, seconds, idle


class _Ahead:
    """A step whose samples are being made in the background."""

    def __init__(self, step: int, version: int, sampler_state: dict[str, Any], timer: PhaseTimer,
                 future: Future[tuple[phases.Collected, float, float]]) -> None:
        self.step, self.version, self.sampler_state, self.timer, self.future = step, version, sampler_state, timer, future
