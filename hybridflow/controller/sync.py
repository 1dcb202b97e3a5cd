"""The synchronous on-policy loop (``trainer.mode=sync``, the default).

    sample prompts -> rollout n per prompt -> rewards -> old/ref logprobs where needed
    -> critic values (gae) -> advantages -> critic update -> actor update -> weight sync

Every sample of step k comes from the weights after step k - 1: generation waits for the update
and the update waits for the longest response. The phases are plain functions in
``hybridflow.controller.phases`` shared with the asynchronous loops (``one_step_off.py``); the
run around the steps (resume, validation, checkpoints, Ctrl-C) is ``Trainer``'s.
"""

from __future__ import annotations

from hybridflow.controller import phases
from hybridflow.controller.trainer import Trainer
from hybridflow.utils.timer import PhaseTimer


class SyncTrainer(Trainer):
    def train_step(self) -> dict[str, float]:
        run, timer = self.run, PhaseTimer(self.run.timeline)  # each phase also a span of <run>/timeline.json
        with timer.phase("step"):
            collected = phases.collect(run, self.step, timer)
            samples, batch_metrics = phases.prepare_batch(run, collected.groups, self.step, timer)
            run.rollout.sleep()  # generation is over for this step: free the KV caches for training
            update_metrics = self.update(samples.batch, timer)
            phases.feed_sampler(run, self.step, collected)
            with timer.phase("update_weights"):
                self.push_weights()
        return collected.metrics | batch_metrics | update_metrics | phases.step_metrics(run, self.step, collected, samples, timer)


# The name the Python API and earlier releases use for the synchronous trainer.
RLTrainer = SyncTrainer
