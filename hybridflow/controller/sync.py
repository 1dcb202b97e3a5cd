"""The synchronous on-policy RL loop.

    sample prompts -> rollout n per prompt -> rewards -> old/ref logprobs where needed
    -> critic values (gae) -> advantages -> critic update -> actor update -> weight sync
    -> validate / checkpoint

``RLTrainer.fit`` is the loop and reads as the algorithm; each phase is a named method. The
trainer does no tensor math beyond gluing records together: algorithms come from registries
chosen by config names, and work happens in worker groups whose fan-out is visible at each
call site. Setup (paths, data, workers) lives in ``hybridflow.controller.setup``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hybridflow.agents import answer_view, compute_agent_metrics
from hybridflow.algorithms import (
    AdvantageInputs,
    apply_kl_penalty,
    masked_mean,
    place_outcome_rewards,
    select_varied_groups,
)
from hybridflow.cluster.worker_group import WorkerGroup, wait_all
from hybridflow.config import ValKwargsConfig, config_to_yaml
from hybridflow.controller.checkpoint import STATE_FILE, CheckpointError, CheckpointManager
from hybridflow.controller.replicas import RolloutReplicas
from hybridflow.controller.setup import BROADCAST, RunSetup
from hybridflow.data import PromptRow
from hybridflow.data.batching import balanced_partitions, flatten_partitions, global_seqlen_metrics
from hybridflow.tracking import (
    compute_batch_metrics, compute_critic_metrics, compute_throughput_metrics, compute_val_core_metrics,
    compute_validation_metrics, reduce_metrics, reward_variables,
)
from hybridflow.tracking.generations import rollout_rows, validation_rows, write_jsonl
from hybridflow.tracking.health import HealthMonitor, HealthThresholds
from hybridflow.types import GenerationRequest, SamplingParams, TrainBatch, Trajectory, collate_trajectories
from hybridflow.training.packing import sequence_lengths
from hybridflow.utils.faults import fault_requested, maybe_fault
from hybridflow.utils.seed import capture_rng_state, derive_seed, restore_rng_state
from hybridflow.utils.timer import PhaseTimer
from hybridflow.utils.watchdog import Watchdog, activity, parse_phase_timeouts
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.reward import RewardWorker

log = logging.getLogger(__name__)

# The few numbers worth a glance on the progress bar; the console logger prints the rest.
PROGRESS_KEYS = {"score": "critic/score/mean", "val": "val/score/mean", "s/step": "timing_s/step"}


class RLTrainer:
    def __init__(self, run: RunSetup) -> None:
        self.run = run
        self.cfg = run.cfg
        self.actor: WorkerGroup[ActorWorker] = run.actor
        # The rollout replicas: requests reach them through a router.
        self.replicas: RolloutReplicas = run.rollout
        self.reference: WorkerGroup[ReferenceWorker] | None = run.reference
        # Built when the estimator needs values (gae); its phases are no-ops otherwise.
        self.critic: WorkerGroup[CriticWorker] | None = run.critic
        self.input_providers = self._input_providers()
        self.reward: WorkerGroup[RewardWorker] = run.reward
        self.checkpoints = CheckpointManager(run.output_dir / "checkpoints", self.cfg.trainer.max_ckpt_to_keep)
        self.step = 0
        h = self.cfg.trainer.health
        self.health = HealthMonitor(
            HealthThresholds(
                zero_variance_group_fraction=h.zero_variance_group_fraction, truncation_ratio=h.truncation_ratio,
                min_entropy=h.min_entropy, logprob_mismatch=h.logprob_mismatch,
                reward_failure_rate=h.reward_failure_rate,
            ),
            repeat_every=h.repeat_every,
        )

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train until the planned number of steps; returns the last step's metrics.

        Ctrl-C finishes the current step, saves a checkpoint and raises ``TrainingInterrupted``
        (a second Ctrl-C stops at once). A phase that stalls past its limit ends the process
        through the watchdog, naming what it waited on.
        """
        run, trainer_cfg = self.run, self.cfg.trainer
        self.resume()
        if self.step >= run.total_steps:
            log.info("run already finished: step %d of %d; nothing to do", self.step, run.total_steps)
            return {}
        metrics: dict[str, float] = {}
        with self.watchdog(), _GracefulInterrupt() as interrupt:
            if trainer_cfg.val_before_train and self.step == 0 and run.val_data is not None:
                run.tracker.log(self.validate(), step=0)
            while self.step < run.total_steps:
                self.step += 1
                metrics = self.train_step()
                metrics |= self.health(metrics, self.step)
                last = self.step == run.total_steps
                if last or (trainer_cfg.test_freq > 0 and self.step % trainer_cfg.test_freq == 0):
                    metrics.update(self.validate())
                save = (trainer_cfg.save_freq > 0 and self.step % trainer_cfg.save_freq == 0) or (last and trainer_cfg.save_final)
                saved = (save or (interrupt.requested and not last)) and self.save_checkpoint()
                run.tracker.log(metrics, step=self.step)
                run.progress.update(self.step, {k: metrics[m] for k, m in PROGRESS_KEYS.items() if m in metrics})
                maybe_fault("after_step", self.step)
                if interrupt.requested and not last:
                    raise TrainingInterrupted(
                        f"interrupted after step {self.step} of {run.total_steps}; a checkpoint was saved: run the "
                        f"same command again to resume" if saved else
                        f"interrupted after step {self.step} of {run.total_steps}; saving its checkpoint failed (see "
                        f"the warning above): the same command resumes from the newest earlier checkpoint"
                    )
        return metrics

    def watchdog(self) -> Watchdog:
        t = self.cfg.trainer
        return Watchdog(t.watchdog_timeout_s, parse_phase_timeouts(t.phase_timeouts))

    def train_step(self) -> dict[str, float]:
        timer = PhaseTimer(self.run.timeline)  # every phase is also a span of <run>/timeline.json
        with timer.phase("step"):
            groups, collect_metrics = self.collect(timer)
            trajectories = [t for group in groups for t in group]
            batch = collate_trajectories(trajectories, self.run.pad_token_id)
            balance_metrics: dict[str, float] = {}
            if self.cfg.trainer.balance_batch:
                order, balance_metrics = self.balance(batch)
                batch, trajectories = batch.select(order), [trajectories[i] for i in order]
            if self.run.needs_old_logprobs:
                with timer.phase("old_log_prob"):
                    batch.old_logprobs = torch.cat(self.actor.split_gather(ActorWorker.compute_logprobs, batch))
            if self.reference is not None:
                with timer.phase("ref"):
                    batch.ref_logprobs = torch.cat(self.reference.split_gather(ReferenceWorker.compute_ref_logprobs, batch))
            extra_inputs, input_metrics = self.estimator_inputs(StepSamples(batch, trajectories, groups), timer)
            collect_metrics |= input_metrics
            rollout_metrics = self.replicas.take_metrics()
            self.replicas.sleep()  # generation is over for this step: free the KV caches for training
            with timer.phase("adv"):
                adv_metrics = self.compute_advantages(batch, extra_inputs)
            if fault_requested("nan_advantages", self.step):  # tests: a NaN that must not reach the weights
                batch.advantages = torch.full_like(batch.advantages, float("nan"))
            if self.run.rollout_data_dir is not None:
                with timer.phase("dump_rollout"):
                    self.dump_rollouts(batch, trajectories)
            critic_metrics = self.update_critic(batch, timer)
            actor_metrics = self.update_actor(batch, timer)
            with timer.phase("update_weights"):
                self.sync_weights()
        return {
            "training/global_step": float(self.step),
            "training/epoch": float(self.run.sampler.epoch),
            **collect_metrics,
            **rollout_metrics,
            **balance_metrics,
            **adv_metrics,
            **critic_metrics,
            **actor_metrics,
            **self.batch_metrics(batch, trajectories),
            **timer.metrics(),
            **compute_throughput_metrics(batch.num_tokens, timer.seconds("step"), self.actor.world_size),
            "perf/cpu_threads": float(torch.get_num_threads()),  # trainer.num_threads, or what others left free
        }

    def collect(self, timer: PhaseTimer) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """Generate and score rounds of prompts until ``data.train_batch_size`` groups are kept.

        Without ``algorithm.filter_groups`` one round keeps every group. With it (DAPO's dynamic
        sampling), groups whose samples all got the same metric carry no learning signal and are
        dropped, and further rounds are drawn until enough remain or ``max_num_gen_batches``
        rounds have run; then the step trains on what was kept (``filter/exhausted`` = 1).
        """
        fg, want = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        kept: list[list[Trajectory]] = []
        reward_metrics: list[dict[str, float]] = []
        episodes: list[Trajectory] = []  # every round's samples, for the agent metrics
        rounds = generated = varied = constant = 0
        while True:
            rounds += 1
            rows = [self.run.train_data[i] for i in self.run.sampler.next_batch()]
            with timer.phase("gen"):
                # The round is part of the seed scope: each round draws fresh samples, and a
                # resumed run draws the same ones.
                trajectories = self.generate(rows, self.train_sampling(), seed_scope=(self.step, rounds))
            model_scores, model_metrics = self.model_scores(trajectories, timer)
            with timer.phase("reward"):
                reward_metrics.append(self.score(trajectories, model_scores) | model_metrics)
            episodes.extend(trajectories)
            groups = _by_group(trajectories)
            generated += len(groups)
            varied_ids = select_varied_groups([_filter_value(t, fg.metric) for t in trajectories],
                                              [t.group_id for t in trajectories])
            constant += len(groups) - len(varied_ids)
            if fg.enable:
                groups = [g for g in groups if g[0].group_id in varied_ids]
            varied += len(groups)
            kept.extend(groups)
            out_of_rounds = 0 < fg.max_num_gen_batches <= rounds
            if len(kept) >= want or not fg.enable or out_of_rounds:
                break
        exhausted = len(kept) < want
        if not kept:
            # Nothing varied in any round: train on the last round (zero advantages for the
            # group estimators, so the update only moves entropy/KL terms) rather than skip.
            kept = _by_group(trajectories)
        if exhausted and fg.enable:
            log.warning(
                "step %d: only %d of %d prompts had varied rewards after %d generation rounds "
                "(algorithm.filter_groups.max_num_gen_batches=%d); training on those",
                self.step, len(kept), want, rounds, fg.max_num_gen_batches,
            )
        kept = kept[:want]
        for group_id, group in enumerate(kept):
            for t in group:
                t.group_id = group_id
        metrics = reduce_metrics(reward_metrics) | self.agent_metrics(episodes)
        metrics["health/zero_variance_group_fraction"] = constant / max(1, generated)
        if fg.enable:
            metrics |= {
                "filter/gen_rounds": float(rounds),
                "filter/varied_group_fraction": varied / max(1, generated),
                "filter/exhausted": float(exhausted),
            }
        return kept, metrics

    def balance(self, batch: TrainBatch) -> tuple[list[int], dict[str, float]]:
        """A sample order under which ``split_gather``'s even split hands each actor rank a similar
        workload. Advantages are computed over the whole batch here, so groups may be split."""
        lengths = sequence_lengths(batch)
        parts = balanced_partitions(lengths, self.actor.world_size)
        return flatten_partitions(parts), global_seqlen_metrics(lengths, parts)

    # ---------------------------------------------------------------- phases
    def train_sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=self.cfg.data.max_response_length)

    def generate(self, rows: list[PromptRow], params: SamplingParams, seed_scope: tuple[int, ...]) -> list[Trajectory]:
        """n trajectories per prompt, grouped by prompt (``group_id`` = row index)."""
        requests = [
            GenerationRequest(
                prompt_ids=row.prompt_ids,
                # Seeds depend only on (run seed, scope, position): a resumed run draws the same samples.
                params=SamplingParams(**{**vars(params), "seed": derive_seed(self.cfg.trainer.seed, *seed_scope, i)}),
                request_id=row.source,
            )
            for i, row in enumerate(rows)
        ]
        metadata = [row.metadata() for row in rows]
        outputs = self._generate_sharded(requests, metadata)
        trajectories = []
        for group_id, (meta, samples) in enumerate(zip(metadata, outputs, strict=True)):
            for t in samples:
                t.group_id = group_id
                # The row's fields, then what an agent loop recorded (turns, tool counts, stop reason).
                t.metadata = {**meta, **t.metadata}
                trajectories.append(t)
        return trajectories

    def _generate_sharded(
        self, requests: list[GenerationRequest], metadata: list[dict[str, Any]]
    ) -> list[list[Trajectory]]:
        """Requests placed on the rollout replicas by the router, each with its row's fields (the
        agent loops read them); results in request order."""
        # Only agent loops read the row fields: a single-turn run sends the requests alone.
        return self.replicas.generate(requests, metadata if self.cfg.rollout.multi_turn.enable else None)

    def score(self, trajectories: list[Trajectory], model_scores: list[float] | None = None) -> dict[str, float]:
        _, metrics = self.score_answers(trajectories, model_scores=model_scores)
        return metrics

    def model_scores(
        self, trajectories: list[Trajectory], timer: PhaseTimer | None = None
    ) -> tuple[list[float] | None, dict[str, float]]:
        """The reward model's score of each final answer (``timing_s/reward_model``), its ranks
        taking contiguous shares; None without a reward model."""
        rm = self.run.reward_model
        if rm is None:
            return None, {}
        views = [answer_view(t) for t in trajectories]
        share = -(-len(views) // rm.group.world_size)  # ceil: the last rank may get fewer
        shards = [(views[r * share : (r + 1) * share],) for r in range(rm.group.world_size)]
        with timer.phase("reward_model") if timer is not None else contextlib.nullcontext():
            results = rm.group.call_each(rm.score, shards)
        return [x for scores, _ in results for x in scores], reduce_metrics([m for _, m in results if m])

    def score_answers(
        self, trajectories: list[Trajectory], shaping: bool = True, model_scores: list[float] | None = None
    ) -> tuple[list[float], dict[str, float]]:
        """Score each trajectory's final answer (``answer_view``: its last assistant turn, not the
        tool replies before it) and set its ``reward`` and ``reward_extra``. A single-turn
        trajectory is scored as it is. Overlong shaping measures the whole response: every turn
        spends the data.max_response_length budget. With a reward model its scores (computed here
        unless given) are combined with the rule scores by the reward role."""
        metrics: dict[str, float] = {}
        if model_scores is None:
            model_scores, metrics = self.model_scores(trajectories)
        views = [answer_view(t) for t in trajectories]
        lengths = [len(t.response_ids) for t in trajectories]
        scores, reward_metrics = self.reward.call_one(0, RewardWorker.score, views, shaping=shaping,
                                                      response_lengths=lengths, model_scores=model_scores)
        metrics |= reward_metrics
        for t, view in zip(trajectories, views, strict=True):
            t.reward, t.reward_extra, t.reward_info = view.reward, view.reward_extra, view.reward_info
        return scores, metrics

    def agent_metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """``num_turns/*``, ``tool_calls/*`` and the masked-token share, for agent runs only (a
        single-turn run's would be constants)."""
        return compute_agent_metrics(trajectories) if self.cfg.rollout.multi_turn.enable else {}

    def compute_advantages(self, batch: TrainBatch, extra_inputs: dict[str, torch.Tensor]) -> dict[str, float]:
        """Token-level rewards (score on the last response token, minus in-reward KL), then the
        configured estimator on one typed record. No estimator-specific branch: the optional
        inputs it declared it needs arrive in ``extra_inputs``, named as AdvantageInputs' fields."""
        alg = self.cfg.algorithm
        token_rewards = place_outcome_rewards(batch.rewards, batch.response_attention_mask)
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            assert batch.old_logprobs is not None and batch.ref_logprobs is not None
            beta = self.run.kl_controller.value
            penalised = apply_kl_penalty(token_rewards, batch.old_logprobs, batch.ref_logprobs, batch.response_mask,
                                         kind=alg.kl_penalty, beta=beta)
            token_rewards = penalised.token_level_rewards
            self.run.kl_controller.update(penalised.mean_kl, n_steps=batch.batch_size)
            metrics |= {"actor/reward_kl_penalty": penalised.mean_kl, "actor/reward_kl_penalty_coeff": beta}
        batch.token_level_rewards = token_rewards
        inputs = AdvantageInputs(token_level_rewards=token_rewards, response_mask=batch.response_mask,
                                 group_ids=batch.group_ids, **extra_inputs)
        batch.advantages, batch.returns = self.run.adv_estimator(inputs, self.run.adv_params)
        return metrics

    # ------------------------------------------------------- estimator inputs
    def _input_providers(self) -> dict[str, InputProvider]:
        """How each optional estimator input is produced (see ``estimator_inputs``): one entry per
        name in OPTIONAL_ESTIMATOR_INPUTS (a unit test keeps them equal), so an estimator that needs
        a new input brings a new provider here, never a branch in the loop."""
        return {
            "values": self.critic_values,
            "reward_baselines": self.greedy_baselines,
            "reward_components": self.named_reward_components,
            "old_logprobs": self.actor_old_logprobs,
            "sum_pi_squared": self.no_sum_pi_squared,
        }

    def estimator_inputs(self, samples: StepSamples, timer: PhaseTimer) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The optional inputs the estimator declared it needs, each from its provider, with the
        metrics the providers report. Nothing is produced that the estimator did not ask for."""
        inputs: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        for need in sorted(self.run.estimator_needs):
            inputs[need], produced_metrics = self.input_providers[need](samples, timer)
            metrics |= produced_metrics
        return inputs, metrics

    def critic_values(self, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's values of the response tokens, kept on the batch for the critic update."""
        assert self.critic is not None, "set-up builds a critic for an estimator that needs values"
        with timer.phase("values"):
            samples.batch.values = torch.cat(self.critic.split_gather(CriticWorker.compute_values, samples.batch))
        return samples.batch.values, {}

    def greedy_baselines(self, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
        """Score of one greedy response per prompt, for each of its samples in batch order (ReMax).  # (B,)"""
        with timer.phase("gen_baseline"):
            params = SamplingParams(n=1, temperature=0.0, max_tokens=self.cfg.data.max_response_length)
            groups = samples.groups
            requests = [GenerationRequest(prompt_ids=g[0].prompt_ids, params=params) for g in groups]
            metadata = [g[0].metadata for g in groups]
            greedy = [outputs[0] for outputs in self._generate_sharded(requests, metadata)]
            for meta, t in zip(metadata, greedy, strict=True):
                t.metadata = {**meta, **t.metadata}
            scores, _ = self.score_answers(greedy)
        # By group id, not group order: balancing may have reordered the batch.
        by_group = {g[0].group_id: score for g, score in zip(groups, scores, strict=True)}
        baselines = torch.tensor([by_group[t.group_id] for t in samples.trajectories], dtype=torch.float32)
        return baselines, {"critic/reward_baseline/mean": sum(scores) / len(scores)}

    def named_reward_components(self, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward's numbers named in ``algorithm.gdpo_reward_keys``, (B, K)."""
        return reward_components(samples.trajectories, self.cfg.algorithm.gdpo_reward_keys), {}

    def actor_old_logprobs(self, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
        """The actor's logprobs before the update; set-up turns that forward on for such an estimator."""
        assert samples.batch.old_logprobs is not None, "set-up computes old logprobs for an estimator that needs them"
        return samples.batch.old_logprobs, {}

    def no_sum_pi_squared(self, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
        raise AssertionError("set-up refuses estimators that need sum_pi_squared (ESTIMATOR_INPUT_SOURCES)")

    def update_critic(self, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        """Regress the critic onto the estimator's returns; with it, how well the values the step
        used predicted them. Nothing without a critic."""
        if self.critic is None:
            return {}
        assert batch.values is not None and batch.returns is not None
        with timer.phase("update_critic"):
            metrics = reduce_metrics(self.critic.split_gather(CriticWorker.update_critic, batch))
        return metrics | compute_critic_metrics(values=batch.values, returns=batch.returns,
                                                response_mask=batch.response_mask)

    def update_actor(self, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        """The policy update; skipped in the first ``trainer.critic_warmup`` steps of a run with a
        critic, which train only the critic so that the actor's first advantages come from a
        fitted value model (without a critic there is nothing to warm up: the key is ignored)."""
        if self.critic is not None and self.step <= self.cfg.trainer.critic_warmup:
            return {}
        with timer.phase("update_actor"):
            return reduce_metrics(self.actor.split_gather(ActorWorker.update_actor, batch))

    def sync_weights(self) -> None:
        """Push the actor's new weights to every rollout rank: streamed from actor rank 0 by
        broadcast (``rollout.weight_sync``), else through this process (in-process: tensor copies)."""
        if self.run.weight_sync == BROADCAST:
            # Both sides at once: every actor rank joins the gather, then rank 0 streams the buckets
            # that the rollout applies as they arrive.
            wait_all(self.actor.submit_all(ActorWorker.send_weights), *self.replicas.submit_receive())
            return
        # Collective: every actor rank joins the gather of its shards; rank 0 holds the result.
        weights = dict(self.actor.call_all(ActorWorker.weights_for_sync)[0])
        self.replicas.update_weights(weights.items())

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
        """Held-out prompts with ``rollout.val_kwargs`` sampling (greedy by default). A run without
        validation data (``data.val_files`` empty, set up says so once) has nothing to measure."""
        if self.run.val_data is None:
            return {}
        with activity("phase", "testing"), self.run.timeline.span("trainer", "testing"):
            return self._validate()

    def _validate(self) -> dict[str, float]:
        start = time.perf_counter()
        params = validation_sampling(self.cfg.rollout.val_kwargs, self.cfg.data.max_response_length)
        rows = list(self.run.val_data)
        trajectories: list[Trajectory] = []
        size = self.cfg.data.val_batch_size
        for start_i in range(0, len(rows), size):
            # A fixed seed scope (-1) keeps sampled validation comparable across steps.
            chunk = self.generate(rows[start_i : start_i + size], params, seed_scope=(-1,))
            for t in chunk:
                t.group_id += start_i
            trajectories.extend(chunk)
        scores, _ = self.score_answers(trajectories, shaping=False)
        sources, group_ids = [t.metadata["data_source"] for t in trajectories], [t.group_id for t in trajectories]
        metrics = compute_validation_metrics(sources, scores, group_ids)
        variables, preds = reward_variables(scores, [t.reward_info for t in trajectories])
        metrics |= compute_val_core_metrics(sources, group_ids, variables, preds)
        if self.run.validation_data_dir is not None:
            self.dump_validation(trajectories, scores)
        metrics |= {f"val/{key}": value for key, value in self.agent_metrics(trajectories).items()}
        metrics["timing_s/testing"] = time.perf_counter() - start
        self.replicas.take_metrics()  # the step's rollout metrics are of training generation only
        self.replicas.sleep()
        log.info("validation at step %d: val/score/mean %.3f", self.step, metrics["val/score/mean"])
        return metrics

    def dump_validation(self, trajectories: list[Trajectory], scores: list[float]) -> None:
        """This validation's samples to ``trainer.validation_data_dir`` (bounded; see tracking.generations)."""
        t, decode = self.cfg.trainer, self._decode
        assert self.run.validation_data_dir is not None
        kept = trajectories[: t.dump_max_samples]  # decode no more than is written
        rows = validation_rows(
            step=self.step, inputs=decode([x.prompt_ids for x in kept]), outputs=decode([x.response_ids for x in kept]),
            ground_truths=[x.metadata.get("ground_truth") for x in kept], scores=scores[: len(kept)],
            reward_infos=[x.reward_info for x in kept], data_sources=[x.metadata["data_source"] for x in kept],
            max_samples=t.dump_max_samples, max_chars=t.dump_max_chars,
        )
        write_jsonl(self.run.validation_data_dir, self.step, rows)

    def dump_rollouts(self, batch: TrainBatch, trajectories: list[Trajectory]) -> None:
        """This step's samples to ``trainer.rollout_data_dir``: each with its sequence advantage, the
        mean over its loss tokens (the advantage itself for outcome estimators)."""
        t, decode = self.cfg.trainer, self._decode
        assert self.run.rollout_data_dir is not None and batch.advantages is not None
        kept = trajectories[: t.dump_max_samples]
        advantages = masked_mean(batch.advantages[: len(kept)], batch.response_mask[: len(kept)], dim=-1)
        rows = rollout_rows(
            step=self.step, prompts=decode([x.prompt_ids for x in kept]),
            responses=decode([x.response_ids for x in kept]),
            ground_truths=[x.metadata.get("ground_truth") for x in kept], scores=[float(x.reward or 0.0) for x in kept],
            advantages=advantages.tolist(), logprobs=[x.rollout_logprobs for x in kept],
            reward_infos=[x.reward_info for x in kept], group_ids=[x.group_id for x in kept],
            max_samples=t.dump_max_samples, max_chars=t.dump_max_chars,
        )
        write_jsonl(self.run.rollout_data_dir, self.step, rows)

    def _decode(self, token_ids: list[list[int]]) -> list[str]:
        # batch_decode([]) is not an empty list in every tokenizer
        return list(self.run.tokenizer.batch_decode(token_ids, skip_special_tokens=True)) if token_ids else []

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> bool:
        """Save one checkpoint; True when it was saved. A save that fails (a full disk: "no space
        left on <path>") has removed its partial folder and left the earlier checkpoints alone;
        then the run stops with that ``CheckpointError`` or, with ``trainer.on_save_error=warn``,
        goes on without this checkpoint (False)."""
        with activity("phase", "save_checkpoint"), self.run.timeline.span("trainer", "save_checkpoint"):
            try:
                self._save_checkpoint()
            except CheckpointError as exc:
                if self.cfg.trainer.on_save_error != "warn":
                    raise
                log.warning("%s; training goes on without this checkpoint (trainer.on_save_error=warn)", exc)
                return False
        return True

    def _save_checkpoint(self) -> None:
        state = {
            "step": self.step,
            "epoch": self.run.sampler.epoch,
            "sampler": self.run.sampler.state_dict(),
            "kl_controller": self.run.kl_controller.state_dict() if self.run.kl_controller else None,
            "rng": capture_rng_state(),
        }
        critic = self.critic
        roles = {"critic": lambda d: critic.call_all(CriticWorker.save_checkpoint, str(d))} if critic else {}
        self.checkpoints.save(
            self.step, state, write_actor=lambda d: self.actor.call_all(ActorWorker.save_checkpoint, str(d)),
            extra_files={"config.yaml": config_to_yaml(self.cfg)}, write_roles=roles,
        )

    def resume(self) -> None:
        """Continue from a checkpoint (``trainer.resume_mode``). ``auto`` takes the newest one that
        verifies and loads, reporting each newer one skipped, and raises ``CheckpointError`` rather
        than start over when checkpoints exist and none does; ``path`` loads that one or raises."""
        t = self.cfg.trainer
        # This run owns its output folder: what killed saves and deletions left there goes now.
        self.checkpoints.clean_leftovers()
        if t.resume_mode == "disable":
            return
        found = self.checkpoints.resume(t.resume_mode, t.resume_from_path, load=self._load_checkpoint)
        if found is None:
            return
        ckpt, state = found
        assert state is not None
        self.step = int(state["step"])
        self.sync_weights()
        log.info("resumed from %s at step %d", ckpt, self.step)

    def _load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """Read ``ckpt`` into the actor, the critic, sampler, KL controller and RNGs; its trainer
        state.

        Any part may refuse; the manager then loads an older checkpoint over all of it, so each
        part is checked before it changes anything (the actor, critic, sampler and KL controller
        check first; the RNGs are put back as they were)."""
        state = self.checkpoints.load_state(ckpt)
        refusals = [r for r in self.actor.call_all(ActorWorker.load_checkpoint, str(ckpt / "actor")) if r]
        if self.critic is not None and not refusals:
            refusals = [r for r in self.critic.call_all(CriticWorker.load_checkpoint, str(ckpt / "critic")) if r]
        if refusals:
            raise CheckpointError(refusals[0])
        rng = capture_rng_state()
        try:
            self.run.sampler.load_state_dict(state["sampler"])
            if self.run.kl_controller is not None and state.get("kl_controller"):
                self.run.kl_controller.load_state_dict(state["kl_controller"])
            if state.get("rng"):
                restore_rng_state(state["rng"])
        except (ValueError, TypeError, KeyError) as exc:
            restore_rng_state(rng)
            raise CheckpointError(f"checkpoint state {ckpt / STATE_FILE} does not fit this run: {exc}") from exc
        return state


class StepSamples(NamedTuple):
    """This step's samples in the three views the estimator-input providers read."""

    batch: TrainBatch
    trajectories: list[Trajectory]  # in batch order
    groups: list[list[Trajectory]]  # by prompt, as collected


# Produces one optional estimator input (and metrics) from the step's samples.
InputProvider = Callable[[StepSamples, PhaseTimer], tuple[torch.Tensor, dict[str, float]]]


def reward_components(trajectories: list[Trajectory], keys: list[str]) -> torch.Tensor:
    """The reward's numbers named ``keys`` per sample, (B, K) (``algorithm.gdpo_reward_keys``). A sample
    without one (its reward failed, and scored 0) counts 0; a key no sample has is a config error."""
    present = {key for t in trajectories for key in t.reward_extra}
    missing = [key for key in keys if key not in present]
    if missing:
        raise ValueError(
            f"algorithm.gdpo_reward_keys {missing} are in no sample's reward (the rewards gave: "
            f"{', '.join(sorted(present))}); return them in the reward function's dict beside 'score'"
        )
    return torch.tensor([[t.reward_extra.get(key, 0.0) for key in keys] for t in trajectories], dtype=torch.float32)


def validation_sampling(v: ValKwargsConfig, max_tokens: int) -> SamplingParams:
    """``rollout.val_kwargs`` as sampling parameters: greedy unless ``do_sample`` (verl's rule), then
    its temperature, top_p and top_k; ``n`` samples per prompt either way."""
    if not v.do_sample:
        return SamplingParams(n=v.n, temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, max_tokens=max_tokens)


def _by_group(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by ``group_id``, groups in first-seen order."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


def _filter_value(t: Trajectory, metric: str) -> float:
    """The number dynamic sampling requires to vary within a group (algorithm.filter_groups.metric)."""
    assert t.reward is not None, "score() sets every reward"
    return t.reward if metric == "score" else t.reward_extra.get("acc", t.reward)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training between steps, after saving a checkpoint."""


class _GracefulInterrupt:
    """The first SIGINT sets ``requested`` (the loop saves and stops after the step); the second
    raises KeyboardInterrupt at once. Only the main thread can install signal handlers: elsewhere
    (a notebook thread, a test runner) Ctrl-C keeps its default behaviour."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _GracefulInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("Ctrl-C: finishing this step, saving a checkpoint, then stopping (Ctrl-C again to stop now)")

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

