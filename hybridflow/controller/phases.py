"""The phases every training loop is made of, as plain functions of the roles and the step plan.

The loops (``sync.py``, ``one_step_off.py``) differ only in *when* these run and on which
weights; what each phase does is written once, here:

    collect        generate rounds of prompts, score them, keep the groups to train on
    prepare_batch  collate, balance, old/ref logprobs, estimator inputs, advantages
    update         critic then actor
    sync_weights   the actor's weights to every rollout replica
    validate       held-out prompts, verl's validation metrics

No phase branches on an algorithm: algorithms come from registries chosen by config names, and
an estimator's optional inputs come from the providers in ``INPUT_PROVIDERS``. Work happens in
worker groups (``Roles``) whose fan-out is visible at each call site; what a phase decides comes
from the frozen ``StepPlan`` set-up built, never from the config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import torch

from hybridflow.agents import answer_view, compute_agent_metrics
from hybridflow.algorithms import (
    AdvantageInputs,
    KLController,
    apply_kl_penalty,
    compute_distillation_advantages,
    place_outcome_rewards,
    select_varied_groups,
)
from hybridflow.algorithms.preference import pair_rows_by_rank, select_preference_pairs
from hybridflow.cluster.worker_group import wait_all
from hybridflow.controller.dumps import GenerationDumps
from hybridflow.controller.overlap import generate_and_score, model_scores, round_requests
from hybridflow.controller.roles import BESIDE, BROADCAST, Roles, hand_over_weights, reconnect_weight_sync
from hybridflow.controller.step_plan import DistillationMix, Prompts, StepPlan
from hybridflow.data import PromptRow
from hybridflow.data.batching import balanced_partitions, flatten_partitions, global_seqlen_metrics
from hybridflow.data.dataset import ImageInputs
from hybridflow.data.sampler import PromptSampler, SamplerFeedback
from hybridflow.tracking import (
    compute_batch_metrics,
    compute_critic_metrics,
    compute_throughput_metrics,
    compute_val_core_metrics,
    compute_validation_metrics,
    reduce_metrics,
    reward_variables,
)
from hybridflow.tracking.metrics import DISTILL_REVERSE_KL
from hybridflow.types import (
    GenerationRequest,
    RefBatch,
    Sample,
    SampleRecord,
    SamplingParams,
    TrainBatch,
    Trajectory,
    collate_records,
    collate_trajectories,
    row_of,
)
from hybridflow.utils.faults import fault_requested
from hybridflow.utils.timer import PhaseTimer
from hybridflow.utils.watchdog import activity
from hybridflow.workers.actor import ActorWorker, gather_old_logprobs
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward import RewardWorker

log = logging.getLogger(__name__)


class Collected(NamedTuple):
    """One step's samples as collected: groups by prompt, and the collection's metrics (rewards,
    filtering, agents, and the rollout's own counters for the generation that made them)."""

    groups: list[list[Trajectory]] | list[list[SampleRecord]]  # records on the by-reference data plane
    metrics: dict[str, float]
    epoch: int  # the sampler's epoch after drawing them (the training/epoch metric of their step)
    indices: list[int]  # each group's prompt: its dataset index (what the sampler drew), as groups


class StepSamples(NamedTuple):
    """This step's samples in the three views the estimator-input providers read."""

    batch: TrainBatch | RefBatch  # what the update trains on; a RefBatch on the by-reference data plane
    trajectories: list[Trajectory] | list[SampleRecord]  # in ``scored``'s order
    groups: list[list[Trajectory]] | list[list[SampleRecord]]  # by prompt, as collected
    # Every sample of the step, which the step's metrics describe, where the update trains on only some
    # of them (online DPO: on pairs); None: ``batch`` is every sample.
    scored: TrainBatch | None = None

    @property
    def all_samples(self) -> TrainBatch | RefBatch:
        return self.batch if self.scored is None else self.scored


# ---------------------------------------------------------------------- generation
def generate(roles: Roles, plan: StepPlan, rows: list[PromptRow], params: SamplingParams, seed_scope: tuple[int, ...],
             vision: ImageInputs | None = None, first_group: int = 0) -> list[Trajectory]:
    """n trajectories per prompt, grouped by prompt (``group_id`` = ``first_group`` + row index),
    each with its row's fields (its request's)."""
    requests = round_requests(rows, params, plan.seed, seed_scope, vision, first_group)
    return [t for samples in roles.rollout.generate(requests) for t in samples]


# ---------------------------------------------------------------------- rewards
def score_answers(
    roles: Roles, trajectories: list[Trajectory], shaping: bool = True, scores_of_model: list[float] | None = None
) -> tuple[list[float], dict[str, float]]:
    """Score each trajectory's final answer (``answer_view``: its last assistant turn, not the
    tool replies before it) and set its ``reward`` and ``reward_extra``. A single-turn
    trajectory is scored as it is. Overlong shaping measures the whole response: every turn
    spends the data.max_response_length budget. With a reward model its scores (computed here
    unless given) are combined with the rule scores by the reward role."""
    metrics: dict[str, float] = {}
    if scores_of_model is None:
        scores_of_model, metrics = model_scores(roles.reward_model, trajectories)
    views = [answer_view(t) for t in trajectories]
    lengths = [len(t.response_ids) for t in trajectories]
    scores, reward_metrics = roles.reward.call_one(0, RewardWorker.score, views, shaping=shaping,
                                                 response_lengths=lengths, model_scores=scores_of_model)
    metrics |= reward_metrics
    for t, view in zip(trajectories, views, strict=True):
        t.reward, t.reward_extra, t.reward_info = view.reward, view.reward_extra, view.reward_info
    return scores, metrics


def agent_metrics(plan: StepPlan, trajectories: Sequence[Sample]) -> dict[str, float]:
    """``num_turns/*``, ``tool_calls/*`` and the masked-token share, for agent runs only (a
    single-turn run's would be constants)."""
    return compute_agent_metrics(trajectories) if plan.agents else {}


# ---------------------------------------------------------------------- collect
def collect(roles: Roles, plan: StepPlan, prompts: Prompts, step: int, timer: PhaseTimer) -> Collected:
    """Generate and score rounds of prompts until ``data.train_batch_size`` groups are kept.

    Without ``algorithm.filter_groups`` one round keeps every group. With it (DAPO's dynamic
    sampling), groups whose samples all got the same metric carry no learning signal and are
    dropped, and further rounds are drawn until enough remain or ``max_num_gen_batches``
    rounds have run; then the step trains on what was kept (``filter/exhausted`` = 1).
    Prompts come from the run's sampler; seeds from (step, round), so the samples of a step do
    not depend on when, or on which weights' replica, the step's collection ran.
    """
    fg, want = plan.group_filter, plan.groups_per_step
    kept: list[list[Sample]] = []
    kept_indices: list[int] = []  # the dataset index of each kept group's prompt
    reward_metrics: list[dict[str, float]] = []
    episodes: list[Sample] = []  # every round's samples, for the agent metrics
    rounds = generated = constant = 0
    while True:
        rounds += 1
        drawn = prompts.sampler.next_batch()
        rows = [prompts.train[i] for i in drawn]
        # Each prompt group is scored as soon as its samples are done, while the rest of the
        # round is generated. The round is part of the seed scope: each round draws fresh
        # samples, and a resumed run draws the same ones.
        trajectories, round_metrics = generate_and_score(roles, plan, rows, plan.train_sampling, (step, rounds), timer,
                                                         prompts.vision)
        reward_metrics.append(round_metrics)
        episodes.extend(trajectories)
        groups = _by_group(trajectories)
        generated += len(groups)
        varied_ids = select_varied_groups([filter_value(t, fg.metric) for t in trajectories],
                                          [t.group_id for t in trajectories])
        constant += len(groups) - len(varied_ids)
        if fg.enable:
            groups = [g for g in groups if g[0].group_id in varied_ids]
        kept.extend(groups)
        kept_indices.extend(drawn[g[0].group_id] for g in groups)
        out_of_rounds = 0 < fg.max_num_gen_batches <= rounds
        if len(kept) >= want or not fg.enable or out_of_rounds:
            break
    exhausted = len(kept) < want
    if not kept:
        # Nothing varied in any round: train on the last round (zero advantages for the
        # group estimators, so the update only moves entropy/KL terms) rather than skip.
        kept = _by_group(trajectories)
        kept_indices = [drawn[g[0].group_id] for g in kept]
    if exhausted and fg.enable:
        log.warning(
            "step %d: only %d of %d prompts had varied rewards after %d generation rounds "
            "(algorithm.filter_groups.max_num_gen_batches=%d); training on those",
            step, len(kept), want, rounds, fg.max_num_gen_batches,
        )
    kept, kept_indices = kept[:want], kept_indices[:want]
    number_groups(kept)
    metrics = reduce_metrics(reward_metrics) | collection_metrics(plan, episodes, generated, constant)
    if fg.enable:
        metrics |= {"filter/gen_rounds": float(rounds), "filter/exhausted": float(exhausted)}
    # The rollout's counters belong to the generation that made these samples (in the async
    # loops another step's update runs meanwhile).
    return Collected(kept, metrics | roles.rollout.take_metrics(), prompts.sampler.epoch, kept_indices)


def feed_sampler(sampler: PromptSampler, step: int, collected: Collected) -> None:
    """Tell the prompt sampler what the step trained on (after its update): one entry per sample,
    its prompt's dataset index and its reward. The built-in sampler ignores it; a curriculum
    sampler class (data.sampler) reorders what it draws next."""
    rows = [(index, t) for index, group in zip(collected.indices, collected.groups, strict=True) for t in group]
    sampler.after_step(SamplerFeedback(
        step=step, indices=[index for index, _ in rows], scores=[float(t.reward or 0.0) for _, t in rows],
        group_ids=[t.group_id for _, t in rows]))


def number_groups(groups: Sequence[Sequence[Sample]]) -> None:
    """Number a step's groups in batch order (``group_id`` 0 .. k-1, what the batch, the sampler's
    feedback and the metrics group by): the groups of several rounds (dynamic sampling) or of
    several rounds' rows (the fully-async loop) would otherwise share their requests' ids."""
    for group_id, group in enumerate(groups):
        for t in group:
            t.group_id = group_id


def _by_group(trajectories: Sequence[Sample]) -> list[list[Sample]]:
    """Samples grouped by ``group_id``, groups in first-seen order."""
    groups: dict[int, list[Sample]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


def filter_value(t: Sample, metric: str) -> float:
    """The number dynamic sampling requires to vary within a group (algorithm.filter_groups.metric)."""
    assert t.reward is not None, "score_answers() sets every reward"
    return t.reward if metric == "score" else t.reward_extra.get("acc", t.reward)


# ---------------------------------------------------------------------- the batch
def prepare_batch(
    roles: Roles, plan: StepPlan, groups: Sequence[Sequence[Sample]], step: int, timer: PhaseTimer,
    kl_controller: KLController | None, dumps: GenerationDumps,
) -> tuple[StepSamples, dict[str, float]]:
    """The step's training batch from its groups: collated, balanced over the actor's ranks, with
    old/ref logprobs where needed, the estimator's inputs, advantages and returns (the in-reward
    KL penalty's ``kl_controller`` updated), dumped when ``dumps`` has a rollout folder. Online DPO
    (``plan.pairs``) trains on pairs of the samples instead: ``prepare_pair_batch``."""
    if plan.pairs is not None:
        return prepare_pair_batch(roles, plan, groups, step, timer, dumps)
    trajectories = [t for group in groups for t in group]
    batch = collate(trajectories, plan.pad_token_id)
    metrics: dict[str, float] = {}
    if plan.balance_batch:
        order, balance_metrics = balance(roles.actor.world_size, trajectories)
        batch, trajectories = batch.select(order), [trajectories[i] for i in order]
        metrics |= balance_metrics
    if plan.needs_old_logprobs:
        with timer.phase("old_log_prob"):
            old = gather_old_logprobs(roles.actor.split_gather(ActorWorker.compute_old_logprobs, batch))
        # The forward's rollout correction, computed once: the estimator and the actor's loss read it here.
        batch.old_logprobs, batch.sum_pi_squared = old.logprobs, old.sum_pi_squared
        batch.rollout_is_weights, batch.rollout_keep_mask = old.rollout_is_weights, old.rollout_keep_mask
        if actor_updates(roles, plan, step):  # reported with the update it corrects, as its metrics are
            metrics |= old.correction_metrics
    if roles.reference is not None:
        with timer.phase("ref"):
            batch.ref_logprobs = torch.cat(roles.reference.split_gather(roles.reference_logprobs, batch))
    teacher_logprobs = None
    if roles.teachers is not None:
        with timer.phase("teacher"):
            teacher_logprobs, teacher_metrics = roles.teachers.logprobs(
                batch, [row_of(t).data_source for t in trajectories], trajectories)
            metrics |= teacher_metrics
    samples = StepSamples(batch, trajectories, groups)
    extra_inputs, input_metrics = estimator_inputs(roles, plan, samples, timer)
    metrics |= input_metrics
    with timer.phase("adv"):
        metrics |= compute_advantages(plan, batch, extra_inputs, kl_controller)
        if plan.distillation is not None:
            assert teacher_logprobs is not None, "set-up builds the teachers with distillation.enable"
            metrics |= distill(plan.distillation, batch, teacher_logprobs)
    if fault_requested("nan_advantages", step):  # tests: a NaN that must not reach the weights
        batch.advantages = torch.full_like(batch.advantages, float("nan"))
    if dumps.rollout_dir is not None:
        with timer.phase("dump_rollout"):
            dumps.rollouts(step, batch, trajectories)
    return samples, metrics


def prepare_pair_batch(
    roles: Roles, plan: StepPlan, groups: Sequence[Sequence[Sample]], step: int, timer: PhaseTimer,
    dumps: GenerationDumps,
) -> tuple[StepSamples, dict[str, float]]:
    """Online DPO's batch: each group's samples paired by their rewards (``select_preference_pairs``), laid
    out so that every actor rank gets as many whole pairs, chosen rows then rejected rows, a short share
    filled with padding pairs that weigh nothing (``pair_rows_by_rank``), with the reference's logprobs
    of those rows only. Its metrics: the pairs and the groups that gave none; the step's metrics
    (``critic/score/*``) describe every sample."""
    assert plan.pairs is not None
    trajectories = cast(list[Trajectory], [t for group in groups for t in group])
    scored = collate_trajectories(trajectories, plan.pad_token_id)
    with timer.phase("pairs"):
        pairs = select_preference_pairs(scored.rewards, scored.group_ids, selection=plan.pairs.selection,
                                        margin=plan.pairs.margin)
        layout = pair_rows_by_rank(pairs, roles.actor.world_size)
        batch = scored.select(layout.rows)
        # Each rank's rows numbered within its share: the pair loss checks that a micro-batch holds whole pairs.
        batch.group_ids = torch.tensor(layout.positions, dtype=torch.long)
    if roles.reference is not None and batch.batch_size > 0:
        with timer.phase("ref"):
            batch.ref_logprobs = torch.cat(roles.reference.split_gather(roles.reference_logprobs, batch))
    metrics = {
        "pairs/count": float(pairs.count),
        "pairs/groups_without_pair": float(pairs.groups_without_pair),
        "pairs/groups_without_pair_fraction": pairs.groups_without_pair / max(1, pairs.groups),
    }
    if dumps.rollout_dir is not None:
        with timer.phase("dump_rollout"):
            dumps.rollouts(step, scored, trajectories)
    return StepSamples(batch, trajectories, list(groups), scored=scored), metrics


def collate(samples: Sequence[Sample], pad_token_id: int) -> TrainBatch | RefBatch:
    """The step's batch: padded tensors from trajectories, or from records (the by-reference data
    plane) the same columns with each row's tokens left on the replica that made them."""
    if all(isinstance(s, SampleRecord) for s in samples):
        return collate_records(cast(list[SampleRecord], list(samples)), pad_token_id)
    return collate_trajectories(cast(list[Trajectory], list(samples)), pad_token_id)


def balance(ranks: int, samples: Sequence[Sample]) -> tuple[list[int], dict[str, float]]:
    """A sample order under which ``split_gather``'s even split hands each actor rank a similar
    workload. Advantages are computed over the whole batch here, so groups may be split."""
    # What a packed forward pays for each sample: its valid (prompt + response) tokens.
    lengths = [t.prompt_length + t.response_length for t in samples]
    parts = balanced_partitions(lengths, ranks)
    return flatten_partitions(parts), global_seqlen_metrics(lengths, parts)


def compute_advantages(plan: StepPlan, batch: TrainBatch, extra_inputs: dict[str, torch.Tensor | None],
                       kl_controller: KLController | None) -> dict[str, float]:
    """Token-level rewards (score on the last response token, minus in-reward KL), then the
    configured estimator on one typed record. No estimator-specific branch: the optional
    inputs it declared it needs arrive in ``extra_inputs``, named as AdvantageInputs' fields."""
    token_rewards = place_outcome_rewards(batch.rewards, batch.response_attention_mask)
    metrics: dict[str, float] = {}
    if plan.kl_in_reward is not None:
        assert batch.old_logprobs is not None and batch.ref_logprobs is not None and kl_controller is not None
        beta = kl_controller.value
        penalised = apply_kl_penalty(token_rewards, batch.old_logprobs, batch.ref_logprobs, batch.response_mask,
                                     kind=plan.kl_in_reward, beta=beta)
        token_rewards = penalised.token_level_rewards
        kl_controller.update(penalised.mean_kl, n_steps=batch.batch_size)
        metrics |= {"actor/reward_kl_penalty": penalised.mean_kl, "actor/reward_kl_penalty_coeff": beta}
    batch.token_level_rewards = token_rewards
    inputs = AdvantageInputs(token_level_rewards=token_rewards, response_mask=batch.response_mask,
                             group_ids=batch.group_ids, **extra_inputs)
    batch.advantages, batch.returns = plan.estimator.fn(inputs, plan.estimator.params)
    return metrics


def distill(mix: DistillationMix, batch: TrainBatch | RefBatch, teacher_logprobs: torch.Tensor) -> dict[str, float]:
    """On-policy distillation: the task advantages weighted, plus each token's negated reverse KL to its
    teacher (the actor's logprobs before the update against the teacher's, of the sampled token)."""
    assert batch.old_logprobs is not None and batch.advantages is not None, "set-up computes old logprobs"
    assert batch.response_mask is not None
    distilled = compute_distillation_advantages(batch.advantages, batch.old_logprobs, teacher_logprobs,
                                                batch.response_mask, kl_coef=mix.kl_coef,
                                                reward_weight=mix.reward_weight, discount=mix.discount)
    batch.advantages = distilled.advantages
    return {DISTILL_REVERSE_KL: distilled.reverse_kl}


# ---------------------------------------------------------------------- estimator inputs
def estimator_inputs(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[dict[str, torch.Tensor | None], dict[str, float]]:
    """The optional inputs the estimator declared it needs, each from its provider, with the
    metrics the providers report. Nothing is produced that the estimator did not ask for."""
    inputs: dict[str, torch.Tensor | None] = {}
    metrics: dict[str, float] = {}
    for need in sorted(plan.estimator.needs):
        inputs[need], produced_metrics = INPUT_PROVIDERS[need](roles, plan, samples, timer)
        metrics |= produced_metrics
    return inputs, metrics


def critic_values(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's values of the response tokens, kept on the batch for the critic update."""
    assert roles.critic is not None, "set-up builds a critic for an estimator that needs values"
    with timer.phase("values"):
        samples.batch.values = torch.cat(roles.critic.split_gather(CriticWorker.compute_values, samples.batch))
    return samples.batch.values, {}


def greedy_baselines(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
    """Score of one greedy response per prompt, for each of its samples in batch order (ReMax).  # (B,)"""
    with timer.phase("gen_baseline"):
        params = SamplingParams(n=1, temperature=0.0, max_tokens=plan.max_response_length)
        groups = samples.groups
        requests = [GenerationRequest(prompt_ids=g[0].prompt_ids, params=params, multi_modal=g[0].multi_modal,
                                      row=g[0].row, group_id=g[0].group_id) for g in groups]
        greedy = [outputs[0] for outputs in roles.rollout.generate(requests)]
        scores, _ = score_answers(roles, greedy)
        roles.rollout.take_metrics()  # the step's rollout counters are of its sampled generation
    # By group id, not group order: balancing may have reordered the batch.
    by_group = {g[0].group_id: score for g, score in zip(groups, scores, strict=True)}
    baselines = torch.tensor([by_group[t.group_id] for t in samples.trajectories], dtype=torch.float32)
    return baselines, {"critic/reward_baseline/mean": sum(scores) / len(scores)}


def named_reward_components(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward's numbers named in ``algorithm.gdpo_reward_keys``, (B, K)."""
    return reward_components(samples.trajectories, list(plan.gdpo_reward_keys)), {}


def actor_old_logprobs(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's logprobs before the update; set-up turns that forward on for such an estimator."""
    assert samples.batch.old_logprobs is not None, "set-up computes old logprobs for an estimator that needs them"
    return samples.batch.old_logprobs, {}


def actor_sum_pi_squared(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ_v π(v)² per response token, from the old-logprob forward (set-up asks the actor for it)."""
    assert samples.batch.sum_pi_squared is not None, "set-up has the actor compute sum_pi_squared for such an estimator"
    return samples.batch.sum_pi_squared, {}


def rollout_correction_weights(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The rollout correction's importance weights from the old-logprob forward (set-up runs it for
    such an estimator), the ones the actor's loss multiplies in; None when the config has none."""
    assert samples.batch.old_logprobs is not None, "set-up computes old logprobs for an estimator that needs rollout IS weights"
    return samples.batch.rollout_is_weights, {}


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


def implicit_prm_rewards(roles: Roles, plan: StepPlan, samples: StepSamples, timer: PhaseTimer) -> tuple[torch.Tensor, dict[str, float]]:
    """PRIME's implicit PRM trained on the step's samples and their token rewards (``prime.*``; set-up builds it
    for such an estimator), with its ``prime/*`` metrics."""
    assert roles.prime is not None, "set-up builds the implicit PRM for an estimator that needs implicit_rewards"
    with timer.phase("prime"):
        return roles.prime.token_rewards(samples.batch)


# Produces one optional estimator input (and metrics) from the step's samples; None where the
# config makes the input not apply (rollout IS weights without a correction).
InputProvider = Callable[[Roles, StepPlan, StepSamples, PhaseTimer], tuple[torch.Tensor | None, dict[str, float]]]

# How each optional estimator input is produced: one entry per name in OPTIONAL_ESTIMATOR_INPUTS
# (a unit test keeps them equal), so an estimator that needs a new input brings a new provider
# here, never a branch in a loop.
INPUT_PROVIDERS: dict[str, InputProvider] = {
    "values": critic_values,
    "reward_baselines": greedy_baselines,
    "reward_components": named_reward_components,
    "old_logprobs": actor_old_logprobs,
    "sum_pi_squared": actor_sum_pi_squared,
    "rollout_is_weights": rollout_correction_weights,
    "implicit_rewards": implicit_prm_rewards,
}


# ---------------------------------------------------------------------- updates
def update(roles: Roles, plan: StepPlan, batch: TrainBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
    """The critic's update, then the actor's (see ``update_actor`` for the warm-up)."""
    return update_critic(roles, batch, timer) | update_actor(roles, plan, batch, step, timer)


def update_critic(roles: Roles, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
    """Regress the critic onto the estimator's returns; with it, how well the values the step
    used predicted them. Nothing without a critic."""
    if roles.critic is None:
        return {}
    assert batch.values is not None and batch.returns is not None
    with timer.phase("update_critic"):
        metrics = reduce_metrics(roles.critic.split_gather(CriticWorker.update_critic, batch))
    return metrics | compute_critic_metrics(values=batch.values, returns=batch.returns,
                                            response_mask=batch.response_mask)


def update_actor(roles: Roles, plan: StepPlan, batch: TrainBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
    """The policy update; skipped in the first ``trainer.critic_warmup`` steps of a run with a
    critic, which train only the critic so that the actor's first advantages come from a
    fitted value model (without a critic there is nothing to warm up: the key is ignored)."""
    if not actor_updates(roles, plan, step):
        return {}
    if batch.batch_size == 0:  # online DPO's step whose groups gave no pair: nothing to learn from
        return {}
    with timer.phase("update_actor"):
        return reduce_metrics(roles.actor.split_gather(ActorWorker.update_actor, batch))


def actor_updates(roles: Roles, plan: StepPlan, step: int) -> bool:
    """Whether ``step`` updates the actor: not in the critic's warm-up steps (``trainer.critic_warmup``)."""
    return roles.critic is None or step > plan.critic_warmup


def sync_weights(roles: Roles, version: int) -> None:
    """Push the actor's weights (after ``version`` updates: what the rollout's tokens record) to
    every rollout rank: streamed from actor rank 0 by broadcast (``rollout.weight_sync``), handed
    over by each actor rank to the replica in its process (``trainer.hybrid_engine``), else
    through this process (in-process: tensor copies). Replicas whose process died since the last
    sync are restarted first and get these weights with the others (a new broadcast group formed)."""
    if roles.weight_sync == BROADCAST:
        roles.rollout.prepare_sync()  # (update_weights does it on the other path)
        if roles.rollout.pool.rejoin_weight_sync:
            reconnect_weight_sync(roles.actor, roles.rollout)
        # Both sides at once: every actor rank joins the gather, then rank 0 streams the buckets
        # that the rollout applies as they arrive.
        wait_all(roles.actor.submit_all(ActorWorker.send_weights), *roles.rollout.submit_receive(version))
        roles.rollout.verify_sync()
        return
    if roles.weight_sync == BESIDE:
        hand_over_weights(roles.actor, roles.rollout, version, adapter=roles.actor_weights is ActorWorker.adapter_for_sync)
        return
    # Collective: every actor rank joins the gather of its shards; rank 0 holds the result.
    weights = dict(roles.actor.call_all(roles.actor_weights)[0])
    roles.rollout.update_weights(weights.items(), version)


def weights_snapshot(roles: Roles) -> list[tuple[str, torch.Tensor]]:
    """A copy of the actor's full weights (rank 0's gather) that later updates leave alone."""
    return roles.actor.call_all(ActorWorker.weights_snapshot)[0]


# ---------------------------------------------------------------------- metrics
def staleness_metrics(trajectories: Sequence[Sample], actor_version: int, started_versions: list[int],
                      bound: int) -> dict[str, float]:
    """How many versions the weights that made each sample lag the actor's (``async/staleness/*``):
    by its oldest token where the engine records token versions (``Trajectory.token_versions``;
    a partial rollout mixes versions), else by its ``started_versions`` entry, the rollout's when
    the sample began generating. ``hist_<k>`` is the fraction of the samples k versions behind, for
    every k up to the loop's ``bound`` (so a step logs the same keys whatever it trained on) and
    any lag past it."""
    lags = [actor_version - oldest_version(t, started) for t, started in zip(trajectories, started_versions, strict=True)]
    # Samples whose tokens came from more than one version: a weight update reached them mid-way.
    mixed = sum(1 for t in trajectories if len(t.versions) > 1)
    n = max(1, len(lags))
    histogram = {f"async/staleness/hist_{k}": sum(1 for lag in lags if lag == k) / n
                 for k in range(max([bound, *lags]) + 1)}
    return {"async/staleness/mean": sum(lags) / n, "async/staleness/max": float(max(lags, default=0)),
            **histogram, "async/partial_rollout_fraction": mixed / n}


def async_metrics(trajectories: Sequence[Sample], actor_version: int, started_versions: list[int], bound: int,
                  timer: PhaseTimer, rollout_idle_s: float, rollout_busy_s: float) -> dict[str, float]:
    """What a loop that generates beside training reports: the samples' staleness (``bound``: the
    most versions behind the loop lets a sample be), and how long each side waited for the other
    (the trainer in ``timer``'s ``wait_rollout`` phase of its step; the rollout idle
    ``rollout_idle_s`` and busy ``rollout_busy_s`` since the last step)."""
    return {
        **staleness_metrics(trajectories, actor_version, started_versions, bound),
        "async/trainer_idle_ratio": timer.seconds("wait_rollout") / timer.seconds("step"),
        "async/rollout_idle_ratio": rollout_idle_s / max(rollout_idle_s + rollout_busy_s, 1e-9),
        "timing_s/rollout_busy": rollout_busy_s,
    }


def collection_metrics(plan: StepPlan, episodes: Sequence[Sample], generated: int, constant: int) -> dict[str, float]:
    """What a step's collection reports besides rewards: the agent metrics of its ``episodes``, and
    of the ``generated`` prompt groups the share whose rewards did not vary (``constant``), which
    dynamic sampling drops."""
    metrics = agent_metrics(plan, episodes)
    metrics["health/zero_variance_group_fraction"] = constant / max(1, generated)
    if plan.group_filter.enable:
        metrics["filter/varied_group_fraction"] = (generated - constant) / max(1, generated)
    return metrics


def oldest_version(t: Sample, started_version: int) -> int:
    """The oldest weight version among ``t``'s tokens (``started_version`` where none is recorded)."""
    return t.versions[0] if t.versions else started_version


def step_metrics(
    roles: Roles, plan: StepPlan, step: int, collected: Collected, samples: StepSamples, timer: PhaseTimer
) -> dict[str, float]:
    """What every step reports whatever the loop: counters, the batch's numbers, phase timings
    and throughput."""
    batch, trajectories = samples.all_samples, samples.trajectories
    return {
        "training/global_step": float(step),
        "training/epoch": float(collected.epoch),
        **compute_batch_metrics(
            scores=batch.rewards,
            response_lengths=torch.tensor([t.response_length for t in trajectories]),
            prompt_lengths=torch.tensor([t.prompt_length for t in trajectories]),
            max_response_length=plan.max_response_length,
            advantages=batch.advantages,
            response_mask=batch.response_mask,
        ),
        **timer.metrics(),
        **roles.rollout.take_sync_metrics(),  # timing_s/verify_weight_sync of the syncs since the last step
        **compute_throughput_metrics(batch.num_tokens, timer.seconds("step"), roles.actor.world_size),
        "perf/cpu_threads": float(torch.get_num_threads()),  # trainer.num_threads (with =follow, what others left free)
    }


# ---------------------------------------------------------------------- validation
def validate(roles: Roles, plan: StepPlan, prompts: Prompts, dumps: GenerationDumps, step: int) -> dict[str, float]:
    """Held-out prompts with ``rollout.val_kwargs`` sampling (greedy by default). A run without
    validation data (``data.val_files`` empty, set up says so once) has nothing to measure."""
    if prompts.val is None:
        return {}
    with activity("phase", "testing"):
        return _validate(roles, plan, prompts, dumps, step)


def _validate(roles: Roles, plan: StepPlan, prompts: Prompts, dumps: GenerationDumps, step: int) -> dict[str, float]:
    start = time.perf_counter()
    assert prompts.val is not None
    rows = list(prompts.val)
    trajectories: list[Trajectory] = []
    size = plan.val_batch_size
    for start_i in range(0, len(rows), size):
        # A fixed seed scope (-1) keeps sampled validation comparable across steps.
        trajectories.extend(generate(roles, plan, rows[start_i : start_i + size], plan.val_sampling,
                                     seed_scope=(-1,), vision=prompts.vision, first_group=start_i))
    # Scored as training scores, overlong penalty included: verl validates with the same DAPO manager.
    scores, _ = score_answers(roles, trajectories, shaping=True)
    sources, group_ids = [row_of(t).data_source for t in trajectories], [t.group_id for t in trajectories]
    metrics = compute_validation_metrics(sources, scores, group_ids)
    variables, preds = reward_variables(scores, [t.reward_info for t in trajectories])
    metrics |= compute_val_core_metrics(sources, group_ids, variables, preds)
    dumps.validation(step, trajectories, scores)
    metrics |= {f"val/{key}": value for key, value in agent_metrics(plan, trajectories).items()}
    metrics["timing_s/testing"] = time.perf_counter() - start
    roles.rollout.take_metrics()  # the step's rollout metrics are of training generation only
    roles.rollout.sleep()
    log.info("validation at step %d: val/score/mean %.3f", step, metrics["val/score/mean"])
    return metrics
