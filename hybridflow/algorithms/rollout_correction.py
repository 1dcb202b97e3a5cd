"""Correction for the mismatch between the rollout engine's and the trainer's probabilities.

The rollout engine (vLLM, SGLang, the native sampler; bf16, other kernels) samples tokens from
π_rollout, but the trainer's policy gradient assumes they came from π_old, the same weights
evaluated by the training engine. The two differ, sometimes a lot on a few tokens, which
biases the gradient and can make training collapse (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's ``algorithm.rollout_correction``).

This module computes, from ``old_logprobs`` (trainer) and ``rollout_logprobs`` (engine), the
importance ratio ρ = π_old / π_rollout at one of two levels:

- ``token``: ρ_t per token (biased, low variance; truncated IS, "TIS");
- ``sequence``: ρ = Π_t ρ_t of the whole response, on every token of it (unbiased, high
  variance);

and returns

- ``weights``: min(ρ, ``threshold``) on masked-in tokens, 0 elsewhere, for the policy loss's
  ``rollout_is_weights``;
- ``keep_mask``: ``response_mask`` with the tokens (``token``) or whole responses
  (``sequence``) whose ρ lies outside ``rejection_band`` = (lower, upper) set to 0 (rejection
  sampling / IcePop-style masking), for the policy loss's ``response_mask``; equal to
  ``response_mask`` when ``rejection_band`` is None;
- ``metrics`` of the mismatch, all named ``rollout_corr/...``.

With ``batch_normalize`` the truncated weights are divided by their mean over the batch
(verl's ``rollout_is_batch_normalize``, self-normalised IS): over valid tokens at token level,
over non-empty responses at sequence level, so the mean weight is 1.

Rejection (``compute_rollout_rejection``) follows verl's ``rollout_rs``: a list of criteria, each a
KL estimator between π_rollout and π_old per token (k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ,
with log ρ clamped to ±20) taken per token or summed, averaged or maximised over the response,
and a bound on it. A token (token criteria) or a whole response (sequence criteria) is kept only
if every criterion accepts it. k1 criteria bound the ratio π_rollout/π_old to [lower, upper] (k1
is its log); k2 and k3 are divergences (≥ 0) with an upper bound only.

Weights of rejected tokens are left as they are: the keep mask removes those tokens from the
loss and from its normaliser, so the two are independent, as in verl. Everything here is
computed without gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hybridflow.algorithms.core import UnknownNameError, check_same_shape, masked_mean, unknown_name_message

ROLLOUT_CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence")

# exp(±20) is finite in fp32; a larger log-ratio only has to give a finite (truncated) weight.
LOG_RATIO_CLAMP = 20.0

# verl's rollout_rs criteria: <where>_<estimator>. seq_max_k1 is not one: the largest −log ρ of a
# response bounds only one direction of the ratio.
ROLLOUT_RS_CRITERIA: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
# hybridflow's first names for the two ratio criteria it had before verl's list.
ROLLOUT_RS_SHORT_NAMES: dict[str, str] = {"token": "token_k1", "sequence": "seq_sum_k1"}

# Below this the batch's mean weight is taken as 0 and the weights are left as they are (verl's).
BATCH_NORMALIZE_MIN_MEAN = 1e-8

SumOverRanks = Callable[[Sequence[float]], Sequence[float]]
"""Element-wise sum of a few numbers over the ranks that hold the batch's other shards (the actor
passes ``training.distributed.all_reduce_sum``); None: this batch is the whole batch."""


class RolloutCorrection(NamedTuple):
    """What ``compute_rollout_correction`` returns (unpacks as ``weights, keep_mask, metrics``)."""

    weights: torch.Tensor  # (B, R) truncated IS weights, 0 on masked-out tokens
    keep_mask: torch.Tensor  # (B, R) response_mask with rejected tokens set to 0, its dtype
    metrics: dict[str, float]


class RejectionCriterion(NamedTuple):
    """One ``rollout_rs`` criterion with its bounds (``parse_rollout_rs`` builds them)."""

    name: str  # one of ROLLOUT_RS_CRITERIA
    upper: float  # k1: largest accepted π_rollout/π_old; k2, k3: largest accepted divergence
    lower: float | None = None  # k1: smallest accepted π_rollout/π_old; k2, k3: None


class Rejection(NamedTuple):
    """What ``compute_rollout_rejection`` returns (unpacks as ``keep_mask, metrics``)."""

    keep_mask: torch.Tensor  # (B, R) response_mask with rejected tokens set to 0, its dtype
    metrics: dict[str, float]


def _validate(level: str, threshold: float, rejection_band: tuple[float, float] | None) -> None:
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise UnknownNameError(unknown_name_message("rollout correction level", level, ROLLOUT_CORRECTION_LEVELS))
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold (largest importance weight kept) must be finite and > 0, got {threshold}")
    if rejection_band is not None:
        if len(rejection_band) != 2:
            raise ValueError(f"rejection_band must be (lower, upper), got {rejection_band!r}")
        lower, upper = (float(b) for b in rejection_band)
        if not (math.isfinite(lower) and math.isfinite(upper) and 0 < lower <= upper):
            raise ValueError(f"rejection_band must satisfy 0 < lower <= upper (finite), got {rejection_band!r}")


def _masked_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                      response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ρ = logπ_old − logπ_rollout with 0 on masked-out tokens, the bool mask). # (B, R)

    Raises ValueError on mismatched shapes or a nan log-ratio on a masked-in token."""
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs must be (B, R), got shape {tuple(old_logprobs.shape)}")
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    mask = response_mask != 0
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    log_ratio = torch.where(mask, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), zero)  # (B, R)
    if bool(torch.isnan(log_ratio).any()):
        rows = torch.isnan(log_ratio).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(
            f"old_logprobs - rollout_logprobs is nan on masked-in tokens of rows {rows[:10]}"
            f"{' ...' if len(rows) > 10 else ''} (nan logprobs, or -inf in both)"
        )
    return log_ratio, mask


def _batch_normalize(weights: torch.Tensor, mask: torch.Tensor, level: str,
                     sum_over_ranks: SumOverRanks | None) -> tuple[torch.Tensor, float]:
    """The weights divided by their batch mean, and that mean (verl's rollout_is_batch_norm_factor;
    1 when the mean is too small to divide by, and the weights are left as they are).

    Token level: the mean over valid tokens. Sequence level: the mean of the responses' weights
    (each response's weight once, whatever its length) over responses with a valid token."""
    if level == "token":
        total, count = weights.sum(), mask.sum()
    else:
        tokens = mask.sum(dim=-1)  # (B,)
        rows = tokens > 0
        per_response = weights.sum(dim=-1) / tokens.clamp(min=1)  # (B,) each response's (one) weight
        total, count = per_response[rows].sum(), rows.sum()
    sums = [float(total), float(count)]
    if sum_over_ranks is not None:
        sums = list(sum_over_ranks(sums))
    mean = sums[0] / sums[1] if sums[1] > 0 else 0.0
    if mean <= BATCH_NORMALIZE_MIN_MEAN:
        return weights, 1.0
    return weights / mean, mean


@torch.no_grad()
def compute_rollout_correction(
    *,
    old_logprobs: torch.Tensor,  # (B, R) trainer's logprobs of the sampled tokens
    rollout_logprobs: torch.Tensor,  # (B, R) rollout engine's logprobs of the same tokens
    response_mask: torch.Tensor,  # (B, R)
    level: str = "token",
    threshold: float = 2.0,
    rejection_band: tuple[float, float] | None = None,
    batch_normalize: bool = False,
    sum_over_ranks: SumOverRanks | None = None,
) -> RolloutCorrection:
    """Truncated importance weights π_old/π_rollout, a rejection mask and mismatch metrics.

    Args:
        old_logprobs: logπ_old of each response token, recomputed by the trainer.
        rollout_logprobs: logπ_rollout of the same tokens, reported by the rollout engine.
        response_mask: 1 on tokens the policy produced.
        level: ``token`` or ``sequence`` (see the module docstring); applies to both the
            weights and the rejection.
        threshold: upper bound of the weights (verl's ``rollout_is_threshold``, default 2.0).
        rejection_band: (lower, upper) bounds on ρ = π_old/π_rollout; tokens (or responses)
            outside are rejected: ``compute_rollout_rejection`` with the ``token_k1`` (or
            ``seq_sum_k1``) criterion on the inverted band. None: nothing is rejected.
        batch_normalize: divide the truncated weights by their batch mean (the module
            docstring), after truncation, as verl.
        sum_over_ranks: with ``batch_normalize``, sums the batch mean's numerator and count over
            the ranks holding the batch's other shards; None: this is the whole batch.

    Returns:
        ``RolloutCorrection(weights, keep_mask, metrics)``. Metrics (token means over masked-in
        tokens unless said otherwise):

        - ``rollout_corr/log_ratio_abs_mean``, ``rollout_corr/log_ratio_abs_max``: |logπ_old −
          logπ_rollout| per token, whatever the level: the size of the mismatch (the
          log-ratio is clamped to ±20 in all metrics, so they stay finite);
        - ``rollout_corr/kl``: mean of logπ_rollout − logπ_old (k1 estimate of
          KL(π_rollout‖π_old), verl's name); ``rollout_corr/k3_kl``: mean of ρ − log ρ − 1
          per token (k3, ≥ 0);
        - ``rollout_corr/rollout_is_mean``: mean of the truncated weights, before batch
          normalisation (verl reports it before too);
        - ``rollout_corr/rollout_is_batch_norm_factor``: the batch mean the weights were divided
          by (with ``batch_normalize`` only; verl's name);
        - ``rollout_corr/truncated_fraction``: tokens whose (level) ρ exceeded ``threshold``;
        - ``rollout_corr/outside_band_fraction``: tokens whose (level) ρ lies outside
          ``rejection_band``, or outside (1/threshold, threshold) when no band is given, so
          the mismatch is visible before rejection is turned on;
        - ``rollout_corr/rollout_rs_masked_fraction``: tokens rejected (0 without a band);
        - ``rollout_corr/rollout_rs_seq_masked_fraction``: responses with a rejected token,
          over all B responses (verl's definition);
        - with a band, the criterion's own ``rollout_corr/rollout_rs_<criterion>_*`` metrics
          (``compute_rollout_rejection``).

        An all-zero mask gives zero weights, an all-zero keep mask and zero metrics.

    Raises:
        ValueError: shapes differ, a masked-in log-ratio is nan, or a bound is invalid.
        UnknownNameError: ``level`` is not one of ``ROLLOUT_CORRECTION_LEVELS``.
    """
    _validate(level, threshold, rejection_band)
    log_ratio, mask = _masked_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    dtype = log_ratio.dtype
    zero = torch.zeros((), dtype=dtype, device=log_ratio.device)

    # The log-ratio the weight and the band are judged on: per token, or the response's sum.
    if level == "token":
        level_log_ratio = log_ratio
    else:
        level_log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)  # masked are 0
    # A token one engine deems impossible has an infinite log-ratio; a response with one in each
    # direction has an undefined ratio (inf − inf): it gets weight 0 and lies outside any band.
    undefined = torch.isnan(level_log_ratio)
    raw = torch.exp(level_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = torch.where(mask & ~undefined, raw.clamp(max=threshold), zero)  # (B, R)

    lower, upper = rejection_band if rejection_band is not None else (1.0 / threshold, threshold)
    outside = mask & (undefined | (level_log_ratio < math.log(lower)) | (level_log_ratio > math.log(upper)))

    mask_f = mask.to(dtype)
    # Metrics read the clamped log-ratio, so one impossible token cannot make them infinite.
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    abs_log_ratio = clamped.abs()

    def fraction(flags: torch.Tensor) -> float:
        return float(masked_mean(flags.to(dtype), mask_f))

    metrics = {
        "rollout_corr/log_ratio_abs_mean": float(masked_mean(abs_log_ratio, mask_f)),
        "rollout_corr/log_ratio_abs_max": float(abs_log_ratio.max()) if abs_log_ratio.numel() else 0.0,
        "rollout_corr/kl": float(masked_mean(-clamped, mask_f)),
        "rollout_corr/k3_kl": float(masked_mean(torch.exp(clamped) - clamped - 1.0, mask_f)),
        "rollout_corr/rollout_is_mean": float(masked_mean(weights, mask_f)),
        "rollout_corr/truncated_fraction": fraction(level_log_ratio > math.log(threshold)),
        "rollout_corr/outside_band_fraction": fraction(outside),
        "rollout_corr/rollout_rs_masked_fraction": 0.0,
        "rollout_corr/rollout_rs_seq_masked_fraction": 0.0,
    }
    if batch_normalize:
        weights, factor = _batch_normalize(weights, mask, level, sum_over_ranks)
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
    keep_mask = response_mask.clone()
    if rejection_band is not None:
        # The band bounds π_old/π_rollout; the k1 criteria bound its inverse, π_rollout/π_old.
        criterion = RejectionCriterion(ROLLOUT_RS_SHORT_NAMES[level], upper=1.0 / lower, lower=1.0 / upper)
        keep_mask, rejection_metrics = compute_rollout_rejection(
            old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask,
            criteria=(criterion,))
        metrics |= rejection_metrics
    return RolloutCorrection(weights, keep_mask, metrics)


def _parse_bound(text: str, criterion: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"rollout_rs_threshold: {text!r} (for {criterion}) is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"rollout_rs_threshold: the bounds of {criterion} must be finite and > 0, got {text!r}")
    return value


def _criterion(name: str, spec: str, threshold_lower: float | None) -> RejectionCriterion:
    """One criterion from its threshold text: ``upper`` or, for k1, ``lower_upper`` too."""
    if not name.endswith("k1"):
        if "_" in spec:
            raise ValueError(f"rollout_rs_threshold: {name} is a divergence (>= 0) with an upper bound only; got "
                             f"{spec!r} (lower_upper is for the *_k1 ratio criteria)")
        return RejectionCriterion(name, upper=_parse_bound(spec, name))
    if "_" in spec:
        if threshold_lower is not None:
            raise ValueError(f"rollout_rs_threshold {spec!r} gives {name} its lower bound already; leave "
                             f"rollout_rs_threshold_lower unset")
        lower_text, upper_text = spec.split("_", 1)
        lower, upper = _parse_bound(lower_text, name), _parse_bound(upper_text, name)
    else:
        upper = _parse_bound(spec, name)
        lower = threshold_lower if threshold_lower is not None else 1.0 / upper
        if not (math.isfinite(lower) and lower > 0):
            raise ValueError(f"rollout_rs_threshold_lower must be finite and > 0, got {lower}")
    if lower > upper:
        raise ValueError(f"rollout_rs_threshold: {name} needs lower <= upper (ratio bounds), got lower {lower:g} > "
                         f"upper {upper:g}")
    return RejectionCriterion(name, upper=upper, lower=lower)


def parse_rollout_rs(rollout_rs: str, threshold: float | str,
                     threshold_lower: float | None = None) -> tuple[RejectionCriterion, ...]:
    """verl's ``rollout_rs`` and ``rollout_rs_threshold`` as criteria, in the order given.

    ``rollout_rs``: comma-separated names from ``ROLLOUT_RS_CRITERIA`` (or ``token`` /
    ``sequence``, hybridflow's names for ``token_k1`` / ``seq_sum_k1``); a repeat is dropped.
    ``threshold``: a number, or text with one entry per criterion, comma-separated (one entry is
    shared by all). A k1 entry is ``upper`` (lower = ``threshold_lower``, else 1/upper) or
    ``lower_upper``, bounds of π_rollout/π_old; a k2 or k3 entry is the divergence's upper bound.

    Raises:
        UnknownNameError: a name is not a criterion.
        ValueError: the thresholds do not fit the criteria (count, format, a bound <= 0).
    """
    names: list[str] = []
    for raw in rollout_rs.split(","):
        name = ROLLOUT_RS_SHORT_NAMES.get(raw.strip(), raw.strip())
        if not name:
            continue
        if name not in ROLLOUT_RS_CRITERIA:
            raise UnknownNameError(unknown_name_message("rollout_rs criterion", name, ROLLOUT_RS_CRITERIA))
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"rollout_rs {rollout_rs!r} names no criterion; expected one or more of "
                         f"{', '.join(ROLLOUT_RS_CRITERIA)}, comma-separated")
    if isinstance(threshold, bool):
        raise ValueError(f"rollout_rs_threshold must be a number or text, got {threshold!r}")
    specs = [repr(float(threshold))] if isinstance(threshold, (int, float)) else \
        [part.strip() for part in str(threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {threshold!r} has {len(specs)} entries for the {len(names)} criteria "
                         f"{','.join(names)}; give one shared entry or one per criterion")
    if len(specs) == 1:
        specs = specs * len(names)
    if threshold_lower is not None and not any(name.endswith("k1") for name in names):
        raise ValueError(f"rollout_rs_threshold_lower bounds the ratio of a *_k1 criterion, but rollout_rs="
                         f"{','.join(names)} has none")
    return tuple(_criterion(name, spec, threshold_lower) for name, spec in zip(names, specs, strict=True))


def _criterion_statistic(criterion: str, estimators: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The statistic ``criterion`` bounds: per token (B, R), or per response (B,)."""
    where, _, estimator = criterion.rpartition("_")
    values = estimators[estimator]  # (B, R), 0 on masked-out tokens
    if where == "token":
        return values
    if where == "seq_sum":
        return values.sum(dim=-1)
    if where == "seq_mean":
        return masked_mean(values, mask.to(values.dtype), dim=-1)
    # seq_max: the largest over valid tokens; a response without one has 0 (verl's).
    largest = values.masked_fill(~mask, float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(largest), torch.zeros_like(largest), largest)


@torch.no_grad()
def compute_rollout_rejection(
    *,
    old_logprobs: torch.Tensor,  # (B, R) trainer's logprobs of the sampled tokens
    rollout_logprobs: torch.Tensor,  # (B, R) rollout engine's logprobs of the same tokens
    response_mask: torch.Tensor,  # (B, R)
    criteria: Sequence[RejectionCriterion],
) -> Rejection:
    """verl's rejection sampling (``rollout_rs``): the tokens and responses every criterion accepts.

    With log ρ = logπ_old − logπ_rollout clamped to ±20 per token, the estimators of
    KL(π_rollout‖π_old) are k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ. A ``token_*``
    criterion judges each token; ``seq_sum_*``, ``seq_mean_*`` and ``seq_max_*`` judge a response by
    the sum, mean or largest value over its valid tokens and keep or reject all of it. A k1
    statistic is accepted inside [log lower, log upper] (π_rollout/π_old within [lower, upper]),
    a k2 or k3 one up to ``upper``; bounds are inclusive.

    Returns:
        ``Rejection(keep_mask, metrics)``: ``response_mask`` with rejected tokens set to 0 (its
        dtype), and, named as verl names them:

        - per criterion c: ``rollout_corr/rollout_rs_<c>_mean`` (the statistic's mean over valid
          tokens, a response's value counting once per token), ``_max`` and ``_min`` (over valid
          tokens, or over non-empty responses for a sequence criterion), ``_fraction_high`` and
          ``_fraction_low`` (above the upper, below the lower bound, in log space for k1; low is 0
          for k2/k3), ``_masked_fraction`` (valid tokens it rejects) and ``_seq_masked_fraction``
          (non-empty responses in which it rejects a token);
        - ``rollout_corr/rollout_rs_masked_fraction``: valid tokens rejected by any criterion;
        - ``rollout_corr/rollout_rs_seq_masked_fraction``: responses with a rejected token, over
          all B responses.

        An all-zero mask gives an all-zero keep mask and zero metrics.

    Raises:
        ValueError: shapes differ, a masked-in log-ratio is nan, or ``criteria`` is empty.
        UnknownNameError: a criterion's name is not one of ``ROLLOUT_RS_CRITERIA``.
    """
    if not criteria:
        raise ValueError("compute_rollout_rejection needs at least one criterion (parse_rollout_rs)")
    for c in criteria:
        if c.name not in ROLLOUT_RS_CRITERIA:
            raise UnknownNameError(unknown_name_message("rollout_rs criterion", c.name, ROLLOUT_RS_CRITERIA))
    log_ratio, mask = _masked_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    dtype = log_ratio.dtype
    mask_f = mask.to(dtype)
    safe = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    estimators = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}  # 0 where masked out
    valid_rows = mask.any(dim=-1)  # (B,)

    def token_fraction(flags: torch.Tensor) -> float:
        return float(masked_mean(flags.to(dtype), mask_f))

    def row_fraction(flags: torch.Tensor) -> float:  # over non-empty responses
        return float(flags[valid_rows].to(dtype).mean()) if bool(valid_rows.any()) else 0.0

    keep = mask.clone()
    metrics: dict[str, float] = {}
    for c in criteria:
        stat = _criterion_statistic(c.name, estimators, mask)
        if c.name.endswith("k1"):
            assert c.lower is not None, f"{c.name} needs a lower bound (parse_rollout_rs gives it one)"
            low, high = math.log(c.lower), math.log(c.upper)
            accepted = (stat >= low) & (stat <= high)
        else:
            low, high = None, c.upper
            accepted = stat <= high
        per_token = stat if stat.dim() == 2 else stat.unsqueeze(-1).expand_as(log_ratio)
        token_accepted = accepted if accepted.dim() == 2 else accepted.unsqueeze(-1).expand_as(mask)
        keep &= token_accepted
        rejected = mask & ~token_accepted
        judged = stat if stat.dim() == 2 else stat[valid_rows]  # the values the bounds were applied to
        judged_mask = mask if stat.dim() == 2 else torch.ones_like(judged, dtype=torch.bool)
        prefix = f"rollout_corr/rollout_rs_{c.name}"
        any_judged = bool(judged_mask.any())
        metrics |= {
            f"{prefix}_mean": float(masked_mean(per_token, mask_f)),
            f"{prefix}_max": float(judged[judged_mask].max()) if any_judged else 0.0,
            f"{prefix}_min": float(judged[judged_mask].min()) if any_judged else 0.0,
            f"{prefix}_fraction_high": (float(masked_mean((judged > high).to(dtype), judged_mask.to(dtype)))
                                        if any_judged else 0.0),
            f"{prefix}_fraction_low": (float(masked_mean((judged < low).to(dtype), judged_mask.to(dtype)))
                                       if any_judged and low is not None else 0.0),
            f"{prefix}_masked_fraction": token_fraction(rejected),
            f"{prefix}_seq_masked_fraction": row_fraction(rejected.any(dim=-1)),
        }
    rejected = mask & ~keep
    metrics["rollout_corr/rollout_rs_masked_fraction"] = token_fraction(rejected)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (
        float(rejected.any(dim=-1).to(dtype).mean()) if rejected.shape[0] else 0.0)
    return Rejection(keep.to(response_mask.dtype), metrics)


class RolloutCorrectionSettings(NamedTuple):
    """``algorithm.rollout_correction`` as ``correct_rollout`` takes it (the actor's set-up builds it)."""

    rollout_is: str | None  # importance-weight level, or None: the mismatch is measured, not weighted
    threshold: float  # rollout_is_threshold: weights are truncated at it
    batch_normalize: bool = False  # rollout_is_batch_normalize
    bypass_mode: bool = False  # the loss corrects against the current policy itself: nothing here
    criteria: tuple[RejectionCriterion, ...] = ()  # rollout_rs: () without rejection


class CorrectedRollout(NamedTuple):
    """What ``correct_rollout`` returns: each part None where the settings do not ask for it."""

    weights: torch.Tensor | None  # (B, R) the importance weights the policy loss multiplies in
    keep_mask: torch.Tensor | None  # (B, R) response_mask without the rejected tokens
    metrics: dict[str, float]


@torch.no_grad()
def correct_rollout(
    settings: RolloutCorrectionSettings,
    *,
    old_logprobs: torch.Tensor,  # (B, R)
    rollout_logprobs: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    sum_over_ranks: SumOverRanks | None = None,
    weights_only: bool = False,
) -> CorrectedRollout:
    """The configured rollout correction, the one place it is computed: the truncated importance
    weights (``compute_rollout_correction`` at the ``rollout_is`` level, divided by their batch
    mean with ``batch_normalize``, over every rank with ``sum_over_ranks``), the rejection's keep
    mask (``compute_rollout_rejection``) and the mismatch metrics.

    Without importance weights (``rollout_is`` None) the metrics are still measured, at token
    level, so a drifting engine is visible before correction is turned on. Bypass mode returns
    nothing: there the rollout's logprobs *are* π_old (ρ = 1 before the update) and the loss
    weights against the current policy inside its own computation.

    ``weights_only``: only the weights (and their metrics): nothing, not even metrics, without
    importance weights; no rejection. For an advantage estimator (``AdvantageInputs.rollout_is_weights``,
    the optimal-token-baseline ones: None leaves every token unscaled, verl's behaviour), and for
    the on-policy loss, whose weights come from its own forward."""
    if settings.bypass_mode or (weights_only and settings.rollout_is is None):
        return CorrectedRollout(None, None, {})
    common = dict(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    correction = compute_rollout_correction(
        **common, level=settings.rollout_is or "token", threshold=settings.threshold,
        batch_normalize=settings.batch_normalize and settings.rollout_is is not None, sum_over_ranks=sum_over_ranks)
    weights = correction.weights if settings.rollout_is is not None else None
    metrics = dict(correction.metrics)
    if weights_only or not settings.criteria:
        return CorrectedRollout(weights, None, metrics)
    rejection = compute_rollout_rejection(**common, criteria=settings.criteria)
    return CorrectedRollout(weights, rejection.keep_mask, metrics | rejection.metrics)
