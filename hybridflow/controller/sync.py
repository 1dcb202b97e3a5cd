"""The synchronous on-policy loop (``trainer.mode=sync``, the default).

    sample prompts -> rollout n per prompt -> rewards -> old/ref logprobs where needed
    -> critic values (gae) -> advantages -> critic update -> actor update -> weight sync

Every sample of step k comes from the weights after step k - 1: generation waits for the update
and the update waits for the longest response. The phases are plain functions in
``hybridflow.controller.phases`` shared with the asynchronous loops (``one_step_off.py``,
``fully_async.py``); the run around the steps (resume, validation, checkpoints, Ctrl-C) is
``Trainer``'s, which holds this loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from hybridflow.controller import phases
from hybridflow.controller.setup import RunSetup
from hybridflow.controller.trainer import WeightVersions, pushed
from hybridflow.utils.timer import PhaseTimer


class SyncLoop:
    def __init__(self, run: RunSetup, versions: WeightVersions) -> None:
        self.roles, self.plan, self.prompts, self.versions = run.roles, run.plan, run.prompts, versions
        self.kl_controller, self.dumps, self.timeline = run.kl_controller, run.dumps, run.timeline

    def train_step(self, step: int) -> dict[str, float]:
        roles, plan = self.roles, self.plan
        timer = PhaseTimer(self.timeline)  # each phase also a span of <run>/timeline.json
        with timer.phase("step"):
            collected = phases.collect(roles, plan, self.prompts, step, timer)
            samples, batch_metrics = phases.prepare_batch(roles, plan, collected.groups, step, timer,
                                                          self.kl_controller, self.dumps)
            roles.rollout.sleep()  # generation is over for this step: free the KV caches for training
            update_metrics = self.versions.update(samples.batch, step, timer)
            phases.feed_sampler(self.prompts.sampler, step, collected)
            with timer.phase("update_weights"):
                self.versions.push()
        return (collected.metrics | batch_metrics | update_metrics
                | phases.step_metrics(roles, plan, step, collected, samples, timer))

    def paused(self) -> AbstractContextManager[None]:
        return pushed(self.versions)

    def loop_state(self) -> dict[str, Any]:
        return {}

    def load_loop_state(self, state: dict[str, Any]) -> None:
        """Nothing of its own: a step starts and ends within one call."""

    def close(self) -> None:
        """Nothing runs in the background."""
