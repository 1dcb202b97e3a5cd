"""Metric names, in one place, and the pure functions that compute the run-level metrics.

Names follow verl's (``critic/score/mean``, ``response_length/clip_ratio``, ``timing_s/gen``,
``perf/throughput`` ...) so dashboards and habits carry over. Every module that emits a metric
the console, the plots or the summary read should spell it through a constant here, so a
rename is one edit and a typo is a NameError instead of a silently empty chart.

The ``compute_*`` functions take tensors or plain lists and return ``dict[str, float]``; they
do no I/O and keep no state. Non-finite inputs are not rejected: a NaN score gives a NaN
metric, which the JSONL logger writes as ``null``. Counting bad rewards is the reward
manager's job; hiding them here would only make them harder to see.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.utils.timer import RSS_PEAK_PREFIX, TIMING_PREFIX  # spelt where PhaseTimer makes them

# --- timing (seconds per phase of one step) -------------------------------------------------
TIMING_STEP = "timing_s/step"
TIMING_GEN = "timing_s/gen"
TIMING_REWARD = "timing_s/reward"
TIMING_OLD_LOG_PROB = "timing_s/old_log_prob"
TIMING_REF = "timing_s/ref"
TIMING_TEACHER = "timing_s/teacher"  # on-policy distillation: the teachers' logprob forwards
TIMING_VALUES = "timing_s/values"
TIMING_ADV = "timing_s/adv"
TIMING_UPDATE_CRITIC = "timing_s/update_critic"
TIMING_UPDATE_ACTOR = "timing_s/update_actor"
TIMING_UPDATE_WEIGHTS = "timing_s/update_weights"
TIMING_SAVE_CHECKPOINT = "timing_s/save_checkpoint"
TIMING_TESTING = "timing_s/testing"
TIMING_OUTSIDE_STEP = frozenset({TIMING_TESTING, TIMING_SAVE_CHECKPOINT})
"""Phases timed around a step, not inside ``timing_s/step``: never a share of the step's time.
Every other ``timing_s/<phase>`` is a disjoint part of the step (``PhaseTimer`` refuses nesting)."""

# --- throughput -------------------------------------------------------------------------------
PERF_THROUGHPUT = "perf/throughput"  # tokens / s / GPU (or CPU rank)
PERF_TOTAL_NUM_TOKENS = "perf/total_num_tokens"
PERF_TIME_PER_STEP = "perf/time_per_step"
PERF_RSS_PEAK_STEP = f"{RSS_PEAK_PREFIX}step"  # the process's peak resident memory in the step (GB)

# --- actor (emitted by the policy loss and the optimizer step) -------------------------------
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
ACTOR_PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_KL_LOSS = "actor/kl_loss"
ACTOR_KL_COEF = "actor/kl_coef"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"
ACTOR_REWARD_KL_PENALTY = "actor/reward_kl_penalty"
ACTOR_REWARD_KL_PENALTY_COEFF = "actor/reward_kl_penalty_coeff"

# --- on-policy distillation ---------------------------------------------------------------------
DISTILL_REVERSE_KL = "distill/reverse_kl"  # mean over response tokens of log π_student − log π_teacher

# --- critic (value model) and batch statistics --------------------------------------------------
CRITIC_VF_LOSS = "critic/vf_loss"
CRITIC_VF_CLIPFRAC = "critic/vf_clipfrac"
CRITIC_VPRED_MEAN = "critic/vpred_mean"
CRITIC_VF_EXPLAINED_VAR = "critic/vf_explained_var"
CRITIC_GRAD_NORM = "critic/grad_norm"
CRITIC_LR = "critic/lr"
VALUES_MEAN = "critic/values/mean"
VALUES_MAX = "critic/values/max"
VALUES_MIN = "critic/values/min"
RETURNS_MEAN = "critic/returns/mean"
RETURNS_MAX = "critic/returns/max"
RETURNS_MIN = "critic/returns/min"

SCORE_MEAN = "critic/score/mean"
SCORE_MAX = "critic/score/max"
SCORE_MIN = "critic/score/min"
ADVANTAGES_MEAN = "critic/advantages/mean"
ADVANTAGES_MAX = "critic/advantages/max"
ADVANTAGES_MIN = "critic/advantages/min"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_MAX = "response_length/max"
RESPONSE_LENGTH_MIN = "response_length/min"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
PROMPT_LENGTH_MEAN = "prompt_length/mean"
PROMPT_LENGTH_MAX = "prompt_length/max"
PROMPT_LENGTH_MIN = "prompt_length/min"

# --- loop position ----------------------------------------------------------------------------
TRAINING_GLOBAL_STEP = "training/global_step"
TRAINING_EPOCH = "training/epoch"

# --- validation -------------------------------------------------------------------------------
VAL_PREFIX = "val/"
VAL_SCORE_MEAN = "val/score/mean"
VAL_LOSS = "val/loss"  # hybridflow sft: token-mean loss on the held-out chats

# --- supervised fine-tuning (hybridflow sft) --------------------------------------------------------
SFT_TRAIN_LOSS = "train/loss"
SFT_GRAD_NORM = "train/grad_norm"

PASS_THRESHOLD = 0.5
"""A validation sample counts as *correct* for pass@k when its score is above this.

Rule-based scorers return 1.0 for a right answer and 0.0 (or a small format bonus, or -1.0)
otherwise, so 0.5 separates the two without caring which convention a scorer uses."""


def timing_key(phase: str) -> str:
    """``timing_s/<phase>``: the seconds spent in one phase of a step."""
    return f"{TIMING_PREFIX}{phase}"


def val_score_key(data_source: str) -> str:
    """``val/<data_source>/score/mean``: mean validation score over one data source's samples."""
    return f"{VAL_PREFIX}{data_source}/score/mean"


def val_mean_at_k_key(data_source: str, k: int) -> str:
    """``val/<data_source>/score/mean@<k>``: mean score with ``k`` samples drawn per prompt."""
    return f"{VAL_PREFIX}{data_source}/score/mean@{k}"


def val_pass_at_k_key(data_source: str, k: int) -> str:
    """``val/<data_source>/pass@<k>``: chance that at least one of ``k`` samples is correct."""
    return f"{VAL_PREFIX}{data_source}/pass@{k}"


def _stats(values: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max, min) of a non-empty 1-D tensor, as Python floats."""
    values = values.detach().to(torch.float64)
    return values.mean().item(), values.max().item(), values.min().item()


def _check_rows(name: str, tensor: torch.Tensor, rows: int, ndim: int) -> None:
    if tensor.dim() != ndim or tensor.shape[0] != rows:
        expected = "(B,)" if ndim == 1 else "(B, R)"
        raise ValueError(
            f"compute_batch_metrics: {name} must have shape {expected} with B={rows} "
            f"(from scores), got {tuple(tensor.shape)}"
        )


def compute_batch_metrics(
    *,
    scores: torch.Tensor,  # (B,) float, sequence-level scores
    response_lengths: torch.Tensor,  # (B,) long, generated tokens per sample
    prompt_lengths: torch.Tensor,  # (B,) long, prompt tokens per sample
    max_response_length: int,
    advantages: torch.Tensor | None,  # (B, R) float, or None before advantages exist
    response_mask: torch.Tensor,  # (B, R) float/bool, 1 on tokens that enter the loss
) -> dict[str, float]:
    """Statistics of one training batch, under verl's names.

    - ``critic/score/{mean,max,min}`` over the B sequence scores.
    - ``critic/advantages/{mean,max,min}`` over the tokens where ``response_mask`` is 1 only:
      padding and tool-output tokens carry advantages that never reach the loss, so counting
      them would report numbers the optimiser never saw. NaN when no token is masked in
      (every response empty), since there is then no honest value to report.
    - ``response_length/{mean,max,min}`` and ``response_length/clip_ratio``, the fraction of
      responses that reached ``max_response_length`` (were cut off rather than finished);
      a clip ratio near 1 means the length budget, not the policy, decides the answers.
    - ``prompt_length/{mean,max,min}``.
    """
    if scores.dim() != 1 or scores.shape[0] == 0:
        raise ValueError(
            f"compute_batch_metrics: scores must be a non-empty (B,) tensor, got shape "
            f"{tuple(scores.shape)}"
        )
    if max_response_length < 1:
        raise ValueError(
            f"compute_batch_metrics: max_response_length must be >= 1, got {max_response_length}"
        )
    rows = int(scores.shape[0])
    _check_rows("response_lengths", response_lengths, rows, ndim=1)
    _check_rows("prompt_lengths", prompt_lengths, rows, ndim=1)
    _check_rows("response_mask", response_mask, rows, ndim=2)

    metrics: dict[str, float] = {}
    metrics[SCORE_MEAN], metrics[SCORE_MAX], metrics[SCORE_MIN] = _stats(scores)

    if advantages is not None:
        if advantages.shape != response_mask.shape:
            raise ValueError(
                "compute_batch_metrics: advantages and response_mask must have the same (B, R) "
                f"shape, got {tuple(advantages.shape)} and {tuple(response_mask.shape)}"
            )
        valid = advantages.detach()[response_mask.detach().bool()]
        stats = _stats(valid) if valid.numel() else (math.nan, math.nan, math.nan)
        metrics[ADVANTAGES_MEAN], metrics[ADVANTAGES_MAX], metrics[ADVANTAGES_MIN] = stats

    lengths = response_lengths.detach()
    (
        metrics[RESPONSE_LENGTH_MEAN],
        metrics[RESPONSE_LENGTH_MAX],
        metrics[RESPONSE_LENGTH_MIN],
    ) = _stats(lengths)
    # ">=" rather than "==": a length above the budget is a caller bug, but it is certainly
    # a clipped response, not a finished one.
    metrics[RESPONSE_LENGTH_CLIP_RATIO] = (lengths >= max_response_length).double().mean().item()
    metrics[PROMPT_LENGTH_MEAN], metrics[PROMPT_LENGTH_MAX], metrics[PROMPT_LENGTH_MIN] = _stats(
        prompt_lengths
    )
    return metrics


def compute_critic_metrics(
    *,
    values: torch.Tensor,  # (B, R) the critic's values the advantages were computed with
    returns: torch.Tensor,  # (B, R) the estimator's returns (the critic's targets)
    response_mask: torch.Tensor,  # (B, R) 1 on tokens that enter the loss
) -> dict[str, float]:
    """How well the values the step used predicted its returns, under verl's names, over the
    masked-in tokens: ``critic/values/{mean,max,min}``, ``critic/returns/{mean,max,min}`` and
    ``critic/vf_explained_var`` = 1 - Var(returns - values) / (Var(returns) + 1e-5) (1: the
    values explain the returns; 0: no better than their mean; negative: worse). NaN when fewer
    than two tokens are masked in."""
    mask = response_mask.detach().bool()
    v, r = values.detach()[mask].double(), returns.detach()[mask].double()
    if v.numel() < 2:
        return {key: math.nan for key in (VALUES_MEAN, VALUES_MAX, VALUES_MIN, RETURNS_MEAN, RETURNS_MAX,
                                          RETURNS_MIN, CRITIC_VF_EXPLAINED_VAR)}
    metrics: dict[str, float] = {}
    metrics[VALUES_MEAN], metrics[VALUES_MAX], metrics[VALUES_MIN] = _stats(v)
    metrics[RETURNS_MEAN], metrics[RETURNS_MAX], metrics[RETURNS_MIN] = _stats(r)
    metrics[CRITIC_VF_EXPLAINED_VAR] = (1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)).item()
    return metrics


def compute_throughput_metrics(
    num_tokens: int, step_time_s: float, n_gpus: int
) -> dict[str, float]:
    """Tokens per second per device for one step, plus the two numbers it comes from.

    ``num_tokens`` is every token the step processed (prompts and responses of all samples),
    verl's convention, so throughput is comparable across response lengths. ``n_gpus`` is the
    number of devices (or CPU ranks) that shared the step.
    """
    if num_tokens < 0:
        raise ValueError(f"compute_throughput_metrics: num_tokens must be >= 0, got {num_tokens}")
    if not step_time_s > 0:  # also rejects NaN
        raise ValueError(f"compute_throughput_metrics: step_time_s must be > 0, got {step_time_s}")
    if n_gpus < 1:
        raise ValueError(f"compute_throughput_metrics: n_gpus must be >= 1, got {n_gpus}")
    return {
        PERF_TOTAL_NUM_TOKENS: num_tokens,
        PERF_TIME_PER_STEP: step_time_s,
        PERF_THROUGHPUT: num_tokens / step_time_s / n_gpus,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    pass@k is the probability that at least one of ``k`` samples drawn for a prompt is correct.
    Drawing ``k`` of the ``n`` samples without replacement, all ``k`` are wrong with probability
    C(n-c, k) / C(n, k), so

        pass@k = 1 - C(n-c, k) / C(n, k)

    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"). This is unbiased,
    unlike ``1 - (1 - c/n)**k``, which underestimates. The ratio of binomials is evaluated as
    the product prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials themselves.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # fewer than k wrong samples: every k-subset holds a correct one
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def _k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, plus ``n`` itself: the usual pass@k ladder."""
    ks: list[int] = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def compute_validation_metrics(
    data_sources: Sequence[str],
    scores: Sequence[float],
    group_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """Validation metrics overall and per data source.

    Always: ``val/score/mean`` (over all samples) and ``val/<data_source>/score/mean``.

    With ``group_ids`` (samples of one prompt share an id) and some prompt sampled more than
    once, also, per data source with n = the smallest group size in that source:

    - ``val/<data_source>/score/mean@<n>``: the mean over prompts of each prompt's mean score;
    - ``val/<data_source>/pass@<k>`` for k = 1, 2, 4, ... and n: the mean over prompts of the
      unbiased estimator ``pass_at_k(n_i, c_i, k)``, where prompt i has n_i samples of which
      c_i scored above ``PASS_THRESHOLD`` (0.5). A NaN score counts as not correct.

    k stops at the smallest group so that every prompt can contribute an unbiased estimate.
    """
    if len(data_sources) != len(scores):
        raise ValueError(
            f"compute_validation_metrics: {len(data_sources)} data sources but {len(scores)} scores"
        )
    if group_ids is not None and len(group_ids) != len(scores):
        raise ValueError(
            f"compute_validation_metrics: {len(group_ids)} group ids but {len(scores)} scores"
        )
    if not scores:
        raise ValueError("compute_validation_metrics: no validation samples")

    values = [float(s) for s in scores]
    metrics: dict[str, float] = {VAL_SCORE_MEAN: math.fsum(values) / len(values)}

    by_source: dict[str, list[float]] = {}
    for source, score in zip(data_sources, values, strict=True):
        by_source.setdefault(source, []).append(score)
    for source, source_scores in by_source.items():
        metrics[val_score_key(source)] = math.fsum(source_scores) / len(source_scores)

    if group_ids is None:
        return metrics

    groups: dict[int, list[float]] = {}
    group_source: dict[int, str] = {}
    for index, (group, source, score) in enumerate(
        zip(group_ids, data_sources, values, strict=True)
    ):
        group = int(group)
        if group_source.setdefault(group, source) != source:
            raise ValueError(
                f"compute_validation_metrics: group {group} mixes data sources "
                f"{group_source[group]!r} and {source!r} (sample {index}); samples of one "
                "prompt must share its data source"
            )
        groups.setdefault(group, []).append(score)
    if max(len(g) for g in groups.values()) < 2:
        return metrics  # one sample per prompt: @k metrics would repeat score/mean

    for source in by_source:
        source_groups = [g for gid, g in groups.items() if group_source[gid] == source]
        n = min(len(g) for g in source_groups)
        per_prompt_mean = [math.fsum(g) / len(g) for g in source_groups]
        metrics[val_mean_at_k_key(source, n)] = math.fsum(per_prompt_mean) / len(per_prompt_mean)
        correct = [sum(1 for s in g if s > PASS_THRESHOLD) for g in source_groups]
        for k in _k_values(n):
            estimates = [
                pass_at_k(len(g), c, k) for g, c in zip(source_groups, correct, strict=True)
            ]
            metrics[val_pass_at_k_key(source, k)] = math.fsum(estimates) / len(estimates)
    return metrics


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"reduce_metrics: metric {key!r} is a tensor of shape {tuple(value.shape)}, "
                "expected a scalar"
            )
        return float(value.item())
    if isinstance(value, numbers.Real):  # Python and numpy numbers
        return float(value)
    raise TypeError(
        f"reduce_metrics: metric {key!r} has non-numeric value {value!r} ({type(value).__name__})"
    )


def reduce_metrics(metrics_list: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of each metric over micro-batches (or ranks, or mini-batches).

    A key missing from some dicts is averaged over the dicts that have it: a metric emitted
    only when it applies (e.g. a KL loss on some micro-batches) should not be dragged toward
    zero by the ones where it did not. Values may be Python numbers or one-element tensors.
    Keys keep the order in which they first appear.
    """
    sums: dict[str, list[float]] = {}
    for metrics in metrics_list:
        for key, value in metrics.items():
            sums.setdefault(key, []).append(_as_float(key, value))
    return {key: math.fsum(values) / len(values) for key, values in sums.items()}
