"""What every step of a run does, decided once at set-up from the config and frozen: how prompts
are sampled, how many groups a step trains on, which groups are kept, which forwards the batch
needs, the advantage estimator, and how samples and weights travel. The phases read this plan,
never the config, so a phase's signature shows what it depends on."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.algorithms import AdvantageEstimatorFn
from hybridflow.config import Config, ValKwargsConfig
from hybridflow.config.schema import RolloutCorrectionConfig
from hybridflow.data import RLDataset
from hybridflow.data.dataset import ImageInputs
from hybridflow.data.sampler import PromptSampler
from hybridflow.types import SamplingParams


@dataclass(frozen=True)
class GroupFilter:
    """DAPO's dynamic sampling (``algorithm.filter_groups``): keep only groups whose ``metric``
    varies, drawing up to ``max_num_gen_batches`` rounds (0: no limit)."""

    enable: bool
    metric: str  # acc | score
    max_num_gen_batches: int


@dataclass(frozen=True)
class Estimator:
    """The advantage estimator, its frozen params and the optional inputs it declared it needs."""

    fn: AdvantageEstimatorFn
    params: object  # the estimator's params dataclass, built from the algorithm section
    needs: frozenset[str]


@dataclass(frozen=True)
class DistillationMix:
    """How the teachers' per-token reverse KL joins the task advantages (the ``distillation`` section)."""

    kl_coef: float
    reward_weight: float
    discount: float


@dataclass(frozen=True)
class PairSelection:
    """Online DPO (``actor.loss=dpo``): how each prompt group's scored samples become preference pairs
    (``algorithm.online_dpo.pairs`` and ``margin``, read by ``select_preference_pairs``)."""

    selection: str  # best_worst | all
    margin: float


@dataclass(frozen=True)
class StepPlan:
    seed: int  # trainer.seed: every request's seed derives from it
    total_steps: int
    groups_per_step: int  # data.train_batch_size: prompt groups trained on per step
    train_sampling: SamplingParams
    val_sampling: SamplingParams
    val_batch_size: int
    max_response_length: int
    pad_token_id: int
    group_filter: GroupFilter
    agents: bool  # rollout.multi_turn.enable: agent loops run, and read the row's fields
    by_reference: bool  # trainer.data_plane=refs: replicas score and keep the tokens
    balance_batch: bool
    needs_old_logprobs: bool  # the actor's logprob forward before the update
    estimator: Estimator
    kl_in_reward: str | None  # algorithm.kl_penalty with algorithm.use_kl_in_reward, else None
    gdpo_reward_keys: tuple[str, ...]
    rollout_correction: RolloutCorrectionConfig
    critic_warmup: int  # steps that train only the critic (a run with one)
    weight_sync: str  # rollout.weight_sync resolved: object_store | broadcast
    distillation: DistillationMix | None = None  # distillation.enable: the teachers' advantage term
    pairs: PairSelection | None = None  # actor.loss=dpo: the step trains on pairs of its samples


def validation_sampling(v: ValKwargsConfig, max_tokens: int) -> SamplingParams:
    """``rollout.val_kwargs`` as sampling parameters: greedy unless ``do_sample`` (verl's rule), then
    its temperature, top_p and top_k; ``n`` samples per prompt either way."""
    if not v.do_sample:
        return SamplingParams(n=v.n, temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, max_tokens=max_tokens)


def build_step_plan(cfg: Config, *, total_steps: int, pad_token_id: int, estimator: Estimator,
                    needs_old_logprobs: bool, weight_sync: str) -> StepPlan:
    """The plan of ``cfg``'s steps, with what set-up resolved (steps, tokenizer, estimator, forwards)."""
    r, d, alg, t = cfg.rollout, cfg.data, cfg.algorithm, cfg.trainer
    fg = alg.filter_groups
    return StepPlan(
        seed=t.seed, total_steps=total_steps, groups_per_step=d.train_batch_size,
        train_sampling=SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                      max_tokens=d.max_response_length),
        val_sampling=validation_sampling(r.val_kwargs, d.max_response_length), val_batch_size=d.val_batch_size,
        max_response_length=d.max_response_length, pad_token_id=pad_token_id,
        group_filter=GroupFilter(fg.enable, fg.metric, fg.max_num_gen_batches),
        agents=r.multi_turn.enable, by_reference=t.data_plane == "refs", balance_batch=t.balance_batch,
        needs_old_logprobs=needs_old_logprobs, estimator=estimator,
        kl_in_reward=alg.kl_penalty if alg.use_kl_in_reward else None,
        gdpo_reward_keys=tuple(alg.gdpo_reward_keys), rollout_correction=alg.rollout_correction,
        critic_warmup=t.critic_warmup, weight_sync=weight_sync,
        distillation=distillation_mix(cfg),
        pairs=PairSelection(alg.online_dpo.pairs, alg.online_dpo.margin) if cfg.actor.loss == "dpo" else None,
    )


def distillation_mix(cfg: Config) -> DistillationMix | None:
    dist = cfg.distillation
    return DistillationMix(dist.kl_coef, dist.reward_weight, dist.discount) if dist.enable else None


@dataclass(frozen=True)
class Prompts:
    """Where a run's prompts come from: the training rows and the sampler that draws them, the
    held-out rows (None: no validation), and a vision-language model's processor that turns a
    row's images into its request's pixels (None for a text-only model)."""

    train: RLDataset
    sampler: PromptSampler  # the built-in seeded shuffle, or data.sampler's class
    val: RLDataset | None = None
    vision: ImageInputs | None = None
