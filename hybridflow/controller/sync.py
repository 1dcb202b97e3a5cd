"""The synchronous on-policy RL loop.

    sample prompts -> rollout n per prompt -> rewards -> old/ref logprobs where needed
    -> advantages -> actor update -> weight sync -> validate / checkpoint

``RLTrainer.fit`` is the loop and reads as the algorithm; each phase is a named method. The
trainer does no tensor math beyond gluing records together: algorithms come from registries
chosen by config names, and work happens in worker groups whose fan-out is visible at each
call site. Setup (paths, data, workers) lives in ``hybridflow.controller.setup``.
"""

from __future__ import annotations

import logging
import time

import torch

from hybridflow.algorithms import kl_penalty, masked_mean
from hybridflow.cluster.worker_group import WorkerGroup
from hybridflow.controller.checkpoint import CheckpointManager
from hybridflow.controller.setup import RunSetup
from hybridflow.data import PromptRow
from hybridflow.tracking import compute_batch_metrics, compute_throughput_metrics, compute_validation_metrics, reduce_metrics
from hybridflow.types import GenerationRequest, SamplingParams, TrainBatch, Trajectory, collate_trajectories
from hybridflow.utils.seed import derive_seed
from hybridflow.utils.timer import PhaseTimer
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.reward import RewardWorker
from hybridflow.workers.rollout import RolloutWorker

log = logging.getLogger(__name__)

# The few numbers worth a glance on the progress bar; the console logger prints the rest.
PROGRESS_KEYS = {"score": "critic/score/mean", "val": "val/score/mean", "s/step": "timing_s/step"}


class RLTrainer:
    def __init__(self, run: RunSetup) -> None:
        self.run = run
        self.cfg = run.cfg
        self.actor: WorkerGroup[ActorWorker] = run.actor
        self.rollout: WorkerGroup[RolloutWorker] = run.rollout
        self.reference: WorkerGroup[ReferenceWorker] | None = run.reference
        self.reward: WorkerGroup[RewardWorker] = run.reward
        self.checkpoints = CheckpointManager(run.output_dir / "checkpoints", self.cfg.trainer.max_ckpt_to_keep)
        self.step = 0

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train until the planned number of steps; returns the last step's metrics."""
        run, trainer_cfg = self.run, self.cfg.trainer
        self.resume()
        if self.step >= run.total_steps:
            log.info("run already finished: step %d of %d; nothing to do", self.step, run.total_steps)
            return {}
        if trainer_cfg.val_before_train and self.step == 0:
            run.tracker.log(self.validate(), step=0)
        metrics: dict[str, float] = {}
        while self.step < run.total_steps:
            self.step += 1
            metrics = self.train_step()
            last = self.step == run.total_steps
            if last or (trainer_cfg.test_freq > 0 and self.step % trainer_cfg.test_freq == 0):
                metrics.update(self.validate())
            if (trainer_cfg.save_freq > 0 and self.step % trainer_cfg.save_freq == 0) or (last and trainer_cfg.save_final):
                self.save_checkpoint()
            run.tracker.log(metrics, step=self.step)
            run.progress.update(self.step, {k: metrics[m] for k, m in PROGRESS_KEYS.items() if m in metrics})
        return metrics

    def train_step(self) -> dict[str, float]:
        timer = PhaseTimer()
        with timer.phase("step"):
            rows = [self.run.train_data[i] for i in self.run.sampler.next_batch()]
            with timer.phase("gen"):
                trajectories = self.generate(rows, self.train_sampling(), seed_scope=self.step)
            with timer.phase("reward"):
                reward_metrics = self.score(trajectories)
            batch = collate_trajectories(trajectories, self.run.pad_token_id)
            if self.run.needs_old_logprobs:
                with timer.phase("old_log_prob"):
                    batch.old_logprobs = torch.cat(self.actor.split_gather(ActorWorker.compute_logprobs, batch))
            if self.reference is not None:
                with timer.phase("ref"):
                    batch.ref_logprobs = torch.cat(self.reference.split_gather(ReferenceWorker.compute_ref_logprobs, batch))
            with timer.phase("adv"):
                adv_metrics = self.compute_advantages(batch)
            with timer.phase("update_actor"):
                actor_metrics = reduce_metrics(self.actor.split_gather(ActorWorker.update_actor, batch))
            with timer.phase("update_weights"):
                self.sync_weights()
        return {
            "training/global_step": float(self.step),
            "training/epoch": float(self.run.sampler.epoch),
            **reward_metrics,
            **adv_metrics,
            **actor_metrics,
            **self.batch_metrics(batch, trajectories),
            **timer.metrics(),
            **compute_throughput_metrics(int(batch.attention_mask.sum()), timer.seconds("step"), self.actor.world_size),
        }

    # ---------------------------------------------------------------- phases
    def train_sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=self.cfg.data.max_response_length)

    def generate(self, rows: list[PromptRow], params: SamplingParams, seed_scope: int) -> list[Trajectory]:
        """n trajectories per prompt, grouped by prompt, split over rollout ranks."""
        requests = [
            GenerationRequest(
                prompt_ids=row.prompt_ids,
                # Seeds depend only on (run seed, step, position): a resumed run draws the same samples.
                params=SamplingParams(**{**vars(params), "seed": derive_seed(self.cfg.trainer.seed, seed_scope, i)}),
                request_id=row.source,
            )
            for i, row in enumerate(rows)
        ]
        world = self.rollout.world_size
        shards = [(requests[r::world],) for r in range(world)]
        per_rank = self.rollout.call_each(RolloutWorker.generate, shards)
        results: list[list[Trajectory]] = [[] for _ in requests]
        for r, outputs in enumerate(per_rank):
            for j, samples in enumerate(outputs):
                results[r + j * world] = samples
        trajectories = []
        for group_id, (row, samples) in enumerate(zip(rows, results, strict=True)):
            for t in samples:
                t.group_id = group_id
                t.metadata = row.metadata()
                trajectories.append(t)
        return trajectories

    def score(self, trajectories: list[Trajectory]) -> dict[str, float]:
        _, metrics = self.reward.call_one(0, RewardWorker.score, trajectories)
        return metrics

    def compute_advantages(self, batch: TrainBatch) -> dict[str, float]:
        """Token-level rewards (score on the last response token, minus in-reward KL), then the
        configured estimator. No estimator-specific branch: they share one signature."""
        alg = self.cfg.algorithm
        lengths = batch.attention_mask[:, batch.prompt_length :].sum(-1)
        last = (lengths - 1).clamp(min=0)
        token_rewards = torch.zeros_like(batch.response_mask)
        token_rewards[torch.arange(batch.batch_size), last] = batch.rewards
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            assert batch.old_logprobs is not None and batch.ref_logprobs is not None
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, alg.kl_penalty) * batch.response_mask
            beta = self.run.kl_controller.value
            token_rewards = token_rewards - beta * kl
            current_kl = float(masked_mean(kl, batch.response_mask))
            self.run.kl_controller.update(current_kl, n_steps=batch.batch_size)
            metrics |= {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
        batch.token_level_rewards = token_rewards
        batch.advantages, batch.returns = self.run.adv_estimator(
            token_level_rewards=token_rewards,
            response_mask=batch.response_mask,
            group_ids=batch.group_ids,
            gamma=alg.gamma,
            lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )
        return metrics

    def sync_weights(self) -> None:
        """Push the actor's new weights to every rollout rank (in-process: tensor copies)."""
        weights = dict(self.actor.call_one(0, ActorWorker.weights_for_sync))
        self.rollout.call_all(RolloutWorker.update_weights, weights.items())

    def batch_metrics(self, batch: TrainBatch, trajectories: list[Trajectory]) -> dict[str, float]:
        return compute_batch_metrics(
            scores=batch.rewards,
            response_lengths=torch.tensor([len(t.response_ids) for t in trajectories]),
            prompt_lengths=torch.tensor([len(t.prompt_ids) for t in trajectories]),
            max_response_length=self.cfg.data.max_response_length,
            advantages=batch.advantages,
            response_mask=batch.response_mask,
        )

    def validate(self) -> dict[str, float]:
        """Held-out prompts with ``rollout.val_kwargs`` sampling (greedy by default)."""
        start = time.perf_counter()
        v = self.cfg.rollout.val_kwargs
        params = SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                max_tokens=self.cfg.data.max_response_length)
        rows = list(self.run.val_data)
        trajectories: list[Trajectory] = []
        size = self.cfg.data.val_batch_size
        for start_i in range(0, len(rows), size):
            # A fixed seed scope (-1) keeps sampled validation comparable across steps.
            chunk = self.generate(rows[start_i : start_i + size], params, seed_scope=-1)
            for t in chunk:
                t.group_id += start_i
            trajectories.extend(chunk)
        scores, _ = self.reward.call_one(0, RewardWorker.score, trajectories)
        metrics = compute_validation_metrics(
            [t.metadata["data_source"] for t in trajectories], scores, [t.group_id for t in trajectories]
        )
        metrics["timing_s/testing"] = time.perf_counter() - start
        log.info("validation at step %d: val/score/mean %.3f", self.step, metrics["val/score/mean"])
        return metrics

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        state = {
            "step": self.step,
            "sampler": self.run.sampler.state_dict(),
            "kl_controller": self.run.kl_controller.state_dict() if self.run.kl_controller else None,
        }
        self.checkpoints.save(
            self.step, state, write_actor=lambda d: self.actor.call_one(0, ActorWorker.save_checkpoint, str(d))
        )

    def resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        ckpt = self.checkpoints.find(t.resume_mode, t.resume_from_path)
        if ckpt is None:
            return
        state = self.checkpoints.load_state(ckpt)
        self.actor.call_all(ActorWorker.load_checkpoint, str(ckpt / "actor"))
        self.run.sampler.load_state_dict(state["sampler"])
        if self.run.kl_controller is not None and state.get("kl_controller"):
            self.run.kl_controller.load_state_dict(state["kl_controller"])
        self.step = int(state["step"])
        self.sync_weights()
        log.info("resumed from %s at step %d", ckpt, self.step)
