"""Policy losses and their registry.

Every policy loss takes one typed record of inputs and its own frozen parameters, so the actor
calls ``loss(inputs, params)`` without branching::

    fn(inputs: LossInputs, params: <its params dataclass>) -> (loss: scalar tensor, metrics: dict[str, float])

``LossInputs`` holds the micro-batch's tensors (old and current logprobs, advantages, mask,
optional rollout IS weights and rollout logprobs) and how its loss is normalised within the
mini-batch (global token and sequence counts, data-parallel size). The parameters are a frozen
dataclass per loss (``PPOClipParams``, ``SAPOParams``, ...), declared at registration and built
once from the config (``build_policy_loss_params``): a setting that does not apply to the chosen
loss is an error there, not silently ignored.
Registered: ``vanilla``, ``gspo``, ``sapo``, ``cispo``, ``gpg``, ``clip_cov``, ``kl_cov``,
``geo_mean``; ``dppo_tv``, ``dppo_kl`` and ``dro`` in ``hybridflow.algorithms.divergence_losses``;
``bypass_mode`` in ``hybridflow.algorithms.bypass``.

Metrics use verl's names: ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``;
they are means over this micro-batch's masked-in tokens. Every mode returns all three (the
actor averages metrics key by key); a metric verl does not compute for a mode is 0.0. Their
meaning per mode follows verl and is given in each docstring. ``actor/ppo_kl`` is the mean of
logπ_old − logπ everywhere except ``kl_cov`` (mean |log-ratio|, as verl).

Every loss clamps the token log-ratio logπ − logπ_old to ±20 before using it (verl does so in
vanilla, sapo and cispo only); that only matters for a token 20 nats off-policy.

Positions with mask 0 are neutralised before any arithmetic (the new losses replace their
logprobs and advantages by 0 there), so padding garbage, even ``-inf``, reaches neither the
loss nor the gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from hybridflow.algorithms.aggregation import Count, agg_loss
from hybridflow.algorithms.core import (
    F,
    build_params,
    check_same_shape,
    masked_mean,
    masked_sum,
    register_into,
    resolve_typed,
)

# exp(20) ≈ 4.9e8 is finite in fp32/bf16; a larger log-ratio means the sample is hopelessly
# off-policy and only needs to be finite (verl clamps the same way).
LOG_RATIO_CLAMP = 20.0

# verl's defaults for the mode-specific parameters (verl/workers/config/actor.py).
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05
CLIP_COV_RATIO = 2e-4
CLIP_COV_LB = 1.0
CLIP_COV_UB = 5.0
KL_COV_RATIO = 2e-4
KL_COV_COEF = 0.1  # verl's config default (core_algos' own fallback is 1.0)


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as a policy loss sees it; B samples, R response tokens.

    The four counts say how this micro-batch's loss is normalised so that micro-batches and
    ranks add up to the mini-batch's loss (``agg_loss``); None means "this micro-batch alone".
    """

    old_logprobs: torch.Tensor  # (B, R) logπ_old of the sampled tokens (behaviour policy, no grad)
    logprobs: torch.Tensor  # (B, R) logπ_θ (with grad)
    advantages: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) 1 on tokens that enter the loss
    rollout_is_weights: torch.Tensor | None = None  # (B, R) importance weights multiplied into the token loss
    rollout_logprobs: torch.Tensor | None = None  # (B, R) the rollout engine's logprobs (bypass_mode)
    global_num_tokens: Count | None = None  # masked-in tokens of the whole mini-batch, all ranks
    global_num_seqs: Count | None = None  # non-empty sequences of the whole mini-batch, all ranks
    loss_scale_factor: float | None = None  # divisor of seq-mean-token-sum-norm; None: R
    dp_size: int = 1  # data-parallel ranks whose gradients are averaged
    generator: torch.Generator | None = None  # random choices (clip_cov); None: the global RNG


# ------------------------------------------------------------------ per-loss parameters
# Field names are the config's keys (``actor.clip_ratio_low``, ``actor.policy_loss.tau_pos``,
# ...), so ``build_policy_loss_params`` fills them without a table.


@dataclass(frozen=True)
class PPOClipParams:
    """vanilla, dppo_tv, dppo_kl: a clip range, the dual-clip bound, the aggregation."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"


@dataclass(frozen=True)
class ClipParams:
    """cispo: a clip range and the aggregation."""

    clip_ratio_low: float
    clip_ratio_high: float
    loss_agg_mode: str = "token-mean"


@dataclass(frozen=True)
class GSPOParams(ClipParams):
    """gspo: as ``ClipParams``; the paper's objective is a mean over sequences."""

    loss_agg_mode: str = "seq-mean-token-mean"


@dataclass(frozen=True)
class GeoMeanParams:
    """geo_mean: a clip range in log space; it always averages over sequences."""

    clip_ratio_low: float
    clip_ratio_high: float


@dataclass(frozen=True)
class AggParams:
    """gpg: only the aggregation."""

    loss_agg_mode: str = "token-mean"


@dataclass(frozen=True)
class SAPOParams:
    """sapo: the gate temperatures for positive and negative advantages."""

    tau_pos: float = SAPO_TAU_POS
    tau_neg: float = SAPO_TAU_NEG


@dataclass(frozen=True)
class ClipCovParams(ClipParams):
    """clip_cov: PPO's clip range plus the covariance rule's fraction and band."""

    clip_cov_ratio: float = CLIP_COV_RATIO
    clip_cov_lb: float = CLIP_COV_LB
    clip_cov_ub: float = CLIP_COV_UB


@dataclass(frozen=True)
class KLCovParams(AggParams):
    """kl_cov: the fraction of tokens penalised and the penalty's coefficient."""

    kl_cov_ratio: float = KL_COV_RATIO
    ppo_kl_coef: float = KL_COV_COEF


class PolicyLossFn(Protocol):
    """The signature every registered policy loss implements."""

    def __call__(self, inputs: LossInputs, params: Any, /) -> tuple[torch.Tensor, dict[str, float]]: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}

POLICY_LOSS_SIGNATURE = "fn(inputs: LossInputs, params) -> (loss, metrics)"


def register_policy_loss(name: str, params: type) -> Callable[[F], F]:
    """Decorator: add a policy loss under ``name`` (the value of ``actor.policy_loss.loss_mode``)
    with ``params``, its frozen parameters dataclass."""
    add = register_into(POLICY_LOSSES, name, "policy loss")

    def decorator(fn: F) -> F:
        fn.params = params  # type: ignore[attr-defined]
        return add(fn)

    return decorator


def policy_loss_params_type(fn: Callable[..., Any]) -> type:
    """The params dataclass ``fn`` declared in its ``params`` attribute (``AggParams`` if none:
    a user's loss then gets the aggregation mode and nothing else)."""
    params = getattr(fn, "params", AggParams)
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
        raise ValueError(f"policy loss {getattr(fn, '__qualname__', fn)!r}: params must be a dataclass type")
    return params


def build_policy_loss_params(
    fn: Callable[..., Any], shared: Mapping[str, Any], specific: Mapping[str, Any], name: str | None = None
) -> Any:
    """``fn``'s params record. ``shared`` settings (clip ratios, aggregation: the actor's keys)
    fill the fields the loss has; ``specific`` ones (``actor.policy_loss.*`` that were set) must
    all be fields of it, else a ValueError names the key that does not apply and the loss
    (``name``, its registry name, or the function's)."""
    return build_params(policy_loss_params_type(fn), shared, specific,
                        what=f"policy loss {name or getattr(fn, '__qualname__', fn)!r}")


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``, or a ``module:function`` path to import, its
    declared params checked (``resolve_typed``)."""
    return resolve_typed(POLICY_LOSSES, name, "policy loss", POLICY_LOSS_SIGNATURE, policy_loss_params_type)


@register_policy_loss("vanilla", params=PPOClipParams)
def compute_ppo_clip_loss(inputs: LossInputs, params: PPOClipParams) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with an asymmetric range and dual clip (verl's ``vanilla``).

    ratio = exp(clamp(logπ − logπ_old, ±20));
    L = max(−A·ratio, −A·clip(ratio, 1 − clip_ratio_low, 1 + clip_ratio_high)), the
    pessimistic bound, which stops the gradient once the ratio has moved far enough in the
    direction the advantage pushes it. For A < 0 the loss is further capped at −A·clip_ratio_c
    (dual clip, Ye et al. 2020): otherwise a token whose ratio exploded gets an unbounded
    push. ``rollout_is_weights`` multiply the token losses before aggregation.

    Metrics: ``actor/pg_clipfrac`` = fraction of tokens where the clipped term won;
    ``actor/pg_clipfrac_lower`` = fraction where the dual clip bound won (A < 0);
    ``actor/ppo_kl`` = mean of logπ_old − logπ (of the clamped log-ratio, as verl).
    """
    old_logprobs, logprobs, advantages = inputs.old_logprobs, inputs.logprobs, inputs.advantages
    response_mask, rollout_is_weights = inputs.response_mask, inputs.rollout_is_weights
    clip_ratio_low, clip_ratio_high, clip_ratio_c = params.clip_ratio_low, params.clip_ratio_high, params.clip_ratio_c
    check_same_shape(
        old_logprobs=old_logprobs, logprobs=logprobs, advantages=advantages, response_mask=response_mask
    )
    if rollout_is_weights is not None:
        check_same_shape(logprobs=logprobs, rollout_is_weights=rollout_is_weights)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")

    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, R)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    token_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)  # (B, R)
    if rollout_is_weights is not None:
        token_losses = token_losses * rollout_is_weights

    loss = agg_loss(token_losses, response_mask, params.loss_agg_mode, **_normaliser(inputs))
    with torch.no_grad():
        mask = response_mask.to(clip_loss.dtype)
        metrics = {
            "actor/pg_clipfrac": float(masked_mean((clipped > unclipped).to(mask.dtype), mask)),
            "actor/pg_clipfrac_lower": float(
                masked_mean(((clip_loss > dual_bound) & negative).to(mask.dtype), mask)
            ),
            "actor/ppo_kl": float(masked_mean(-log_ratio, mask)),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Shared pieces of the losses below
# --------------------------------------------------------------------------------------------

# GSPO bounds the log of its combined ratio from above only: a sequence that became much more
# likely gets a finite (clipped) weight; a much less likely one just underflows towards 0.
GSPO_LOG_RATIO_MAX = 10.0
# geo_mean takes the log of rollout IS weights; a weight of exactly 0 (rejected) must stay finite.
GEO_MEAN_LOG_EPS = 1e-10


class _Prepared(NamedTuple):
    """Inputs with masked-out positions replaced by 0, plus the clamped log-ratio."""

    logprobs: torch.Tensor  # (B, R) with grad
    advantages: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) bool
    mask_f: torch.Tensor  # (B, R) float, logprobs' dtype
    log_ratio: torch.Tensor  # (B, R) clamp(logπ − logπ_old, ±20), with grad
    weights: torch.Tensor | None  # (B, R) rollout IS weights, 0 on masked positions


def _prepare(inputs: LossInputs) -> _Prepared:
    """Check shapes and neutralise masked positions.

    ``torch.where`` is a select in the backward pass too, so a masked position gets an exact 0
    gradient even when its input was ``-inf`` or nan; a multiplication by the mask would turn
    such a value into a nan gradient.
    """
    old_logprobs, logprobs, advantages = inputs.old_logprobs, inputs.logprobs, inputs.advantages
    response_mask, rollout_is_weights = inputs.response_mask, inputs.rollout_is_weights
    check_same_shape(
        old_logprobs=old_logprobs, logprobs=logprobs, advantages=advantages, response_mask=response_mask
    )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, R), got shape {tuple(logprobs.shape)}")
    if rollout_is_weights is not None:
        check_same_shape(logprobs=logprobs, rollout_is_weights=rollout_is_weights)
    mask = response_mask != 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(mask, logprobs, zero)
    old = torch.where(mask, old_logprobs.detach().to(logprobs.dtype), zero)
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), zero)
    weights = None
    if rollout_is_weights is not None:
        weights = torch.where(mask, rollout_is_weights.detach().to(logprobs.dtype), zero)
    log_ratio = (logprobs - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _Prepared(logprobs, adv, mask, mask.to(logprobs.dtype), log_ratio, weights)


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def _fraction(flags: torch.Tensor, mask_f: torch.Tensor) -> float:
    """Masked mean of a boolean (B, R) tensor, as a Python float."""
    return float(masked_mean(flags.detach().to(mask_f.dtype), mask_f))


def _metrics(
    x: _Prepared, clipped: torch.Tensor | None = None, clipped_lower: torch.Tensor | None = None
) -> dict[str, float]:
    """The three contract metrics; a missing flag tensor means "this mode has no such clip"."""
    with torch.no_grad():
        return {
            "actor/pg_clipfrac": 0.0 if clipped is None else _fraction(clipped, x.mask_f),
            "actor/pg_clipfrac_lower": 0.0 if clipped_lower is None else _fraction(clipped_lower, x.mask_f),
            "actor/ppo_kl": float(masked_mean(-x.log_ratio.detach(), x.mask_f)),
        }


def _normaliser(inputs: LossInputs) -> dict[str, Any]:
    """``agg_loss``'s keywords that make micro-batches and ranks add up to the mini-batch loss."""
    return dict(global_num_tokens=inputs.global_num_tokens, global_num_seqs=inputs.global_num_seqs,
                loss_scale_factor=inputs.loss_scale_factor, dp_size=inputs.dp_size)


def _aggregate(token_losses: torch.Tensor, x: _Prepared, loss_agg_mode: str, inputs: LossInputs) -> torch.Tensor:
    """Rollout IS weights times the token losses, reduced by ``agg_loss``."""
    if x.weights is not None:
        token_losses = token_losses * x.weights
    return agg_loss(token_losses, x.mask_f, loss_agg_mode, **_normaliser(inputs))


# --------------------------------------------------------------------------------------------
# Sequence-level and smoothed ratios
# --------------------------------------------------------------------------------------------


@register_policy_loss("gspo", params=GSPOParams)
def compute_gspo_loss(inputs: LossInputs, params: GSPOParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), verl's ``gspo``.

    One importance ratio per sequence, the geometric mean of its token ratios,
    s_i = exp(mean_t (logπ − logπ_old)), so a long response is not clipped token by token.
    Per token it enters as s_{i,t} = sg(s_i)·π_t / sg(π_t): the value is s_i, the gradient
    that of logπ_t scaled by s_i (its log is capped at 10). Then the PPO clip:
    L = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1 − clip_ratio_low, 1 + clip_ratio_high)), without
    dual clip. GSPO's clip ranges are much smaller than PPO's (the paper uses 3e-4/4e-4).

    Aggregated with ``loss_agg_mode``, as verl 0.9 does. The paper's objective is a mean over
    sequences (``seq-mean-token-mean``, the default here and the ``gspo`` preset's setting);
    verl's actor default is ``token-mean``, which weights long responses more.
    Metrics: ``pg_clipfrac`` = fraction of tokens where the clipped term won; no lower clip.
    """
    _check_clip(params.clip_ratio_low, params.clip_ratio_high)
    x = _prepare(inputs)
    lengths = x.mask_f.sum(dim=-1).clamp(min=1)  # (B,)
    seq_log_ratio = masked_sum(x.log_ratio, x.mask_f, dim=-1) / lengths  # (B,)
    log_s = x.logprobs - x.logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=GSPO_LOG_RATIO_MAX))  # (B, R)
    unclipped = -x.advantages * s
    clipped = -x.advantages * s.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    token_losses = torch.maximum(unclipped, clipped)
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    return loss, _metrics(x, clipped=clipped > unclipped)


@register_policy_loss("sapo", params=SAPOParams)
def compute_sapo_loss(inputs: LossInputs, params: SAPOParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft Adaptive Policy Optimization (arXiv 2511.20347), verl's ``sapo``.

    A smooth gate replaces the hard clip: L = −f_τ(r)·A with f_τ(r) = σ(τ(r − 1))·4/τ and
    r = π/π_old. Its slope in log r is 4·σ(1 − σ)·r, which is r at r = 1 (the plain policy
    gradient) and decays smoothly as the ratio drifts, instead of dropping to 0 at a clip
    edge. τ = ``tau_pos`` for A > 0 and ``tau_neg`` for A ≤ 0 (a slightly larger τ damps
    negative updates faster; verl defaults 1.0 / 1.05).

    Always aggregated with ``seq-mean-token-mean``, as verl: ``loss_agg_mode`` is ignored.
    There is no clip, so both clip fractions are 0.
    """
    if not (params.tau_pos > 0 and params.tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got tau_pos={params.tau_pos}, tau_neg={params.tau_neg}")
    x = _prepare(inputs)
    ratio = torch.exp(x.log_ratio)
    tau = torch.where(
        x.advantages > 0,
        torch.tensor(params.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.tensor(params.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    token_losses = -gate * x.advantages
    loss = _aggregate(token_losses, x, "seq-mean-token-mean", inputs)
    return loss, _metrics(x)


# --------------------------------------------------------------------------------------------
# Log-likelihood surrogates
# --------------------------------------------------------------------------------------------


@register_policy_loss("cispo", params=ClipParams)
def compute_cispo_loss(inputs: LossInputs, params: ClipParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped IS-weight policy optimization (MiniMax-M1, arXiv 2506.13585), verl's ``cispo``.

    L = −sg(clip(r, 1 − clip_ratio_low, 1 + clip_ratio_high))·A·logπ. The IS weight is
    clipped and detached, but unlike PPO a clipped token still gets a gradient (scaled by
    the clipped weight), so rare high-ratio tokens keep contributing.

    The loss *value* is a log-likelihood surrogate (only its gradient is meaningful).
    Metrics: ``pg_clipfrac`` = fraction of tokens whose ratio was clipped (either side); no
    lower clip.
    """
    _check_clip(params.clip_ratio_low, params.clip_ratio_high)
    x = _prepare(inputs)
    ratio = torch.exp(x.log_ratio.detach())
    weight = ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    token_losses = -weight * x.advantages * x.logprobs
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    return loss, _metrics(x, clipped=ratio != weight)


@register_policy_loss("gpg", params=AggParams)
def compute_gpg_loss(inputs: LossInputs, params: AggParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Policy Gradient (arXiv 2504.02546), verl's ``gpg``: plain REINFORCE, L = −A·logπ.

    No ratio and no clip: meant for one optimizer step per rollout batch (with more, nothing
    keeps the policy near π_old). Pair with the ``gpg`` advantage estimator. ``old_logprobs``
    only feed ``actor/ppo_kl``; both clip fractions are 0 (verl returns no metrics here).
    """
    x = _prepare(inputs)
    token_losses = -x.advantages * x.logprobs
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    return loss, _metrics(x)


# --------------------------------------------------------------------------------------------
# Covariance-based entropy control (Cui et al. 2025, "The Entropy Mechanism of RL for LLMs")
# --------------------------------------------------------------------------------------------


def _centred_covariance(x: _Prepared) -> torch.Tensor:
    """(A − mean A)·(logπ − mean logπ) per token (B, R), means over masked-in tokens, no grad.

    The tokens with the largest covariance are those whose update lowers entropy most (a
    confident token pushed up, or an unlikely one pushed down); both cov losses act on them.
    """
    with torch.no_grad():
        logp = x.logprobs.detach()
        return (x.advantages - masked_mean(x.advantages, x.mask_f)) * (logp - masked_mean(logp, x.mask_f))


@register_policy_loss("clip_cov", params=ClipCovParams)
def compute_clip_cov_loss(inputs: LossInputs, params: ClipCovParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov, verl's ``clip_cov``: PPO clip, plus a random few high-covariance tokens dropped.

    Token losses are PPO's max(−A·r, −A·clip(r, 1 − low, 1 + high)) (no dual clip). Among the
    masked-in tokens PPO did not clip whose centred covariance (see ``_centred_covariance``)
    lies strictly inside (``clip_cov_lb``, ``clip_cov_ub``), max(1, ⌊clip_cov_ratio·N⌋) are
    drawn uniformly at random (N = masked-in tokens of this micro-batch) and contribute
    neither loss nor gradient: that slows the entropy collapse those tokens drive.

    The draw uses ``torch.randperm`` with ``generator`` (the global RNG when None, as verl);
    pass a seeded generator for reproducible steps. Metrics (verl): ``pg_clipfrac`` = fraction
    of tokens dropped by the covariance rule, no lower clip.
    """
    _check_clip(params.clip_ratio_low, params.clip_ratio_high)
    _check_fraction("clip_cov_ratio", params.clip_cov_ratio)
    if not params.clip_cov_lb < params.clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {params.clip_cov_lb} >= {params.clip_cov_ub}")
    x = _prepare(inputs)
    ratio = torch.exp(x.log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    with torch.no_grad():
        cov = _centred_covariance(x)
        candidates = x.mask & ~(clipped > unclipped) & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
        flat = candidates.flatten().nonzero().flatten()  # positions in the flattened (B·R)
        budget = max(int(params.clip_cov_ratio * int(x.mask.sum())), 1)
        if flat.numel() > budget:
            device = inputs.generator.device if inputs.generator is not None else torch.device("cpu")
            order = torch.randperm(flat.numel(), generator=inputs.generator, device=device).to(flat.device)
            flat = flat[order[:budget]]
        dropped = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
        dropped[flat] = True
        dropped = dropped.view_as(candidates)
    token_losses = torch.where(dropped, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    return loss, _metrics(x, clipped=dropped)


@register_policy_loss("kl_cov", params=KLCovParams)
def compute_kl_cov_loss(inputs: LossInputs, params: KLCovParams) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov, verl's ``kl_cov``: −A·r, plus a KL penalty on the highest-covariance tokens.

    L = −A·r on every token (no clip: the penalty is the trust region), and
    L = −A·r + ``ppo_kl_coef``·|log r| on the max(1, ⌊kl_cov_ratio·N⌋) masked-in tokens with
    the largest centred covariance (see ``_centred_covariance``; N = masked-in tokens of this
    micro-batch; ties broken by ``torch.topk``). Deterministic. ``ppo_kl_coef`` defaults to
    verl's config default 0.1 (its code fallback is 1.0).

    Metrics (verl): ``actor/ppo_kl`` is the mean of |log r| here, not of −log r; no clip, so
    both clip fractions are 0.
    """
    _check_fraction("kl_cov_ratio", params.kl_cov_ratio)
    if not params.ppo_kl_coef >= 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {params.ppo_kl_coef}")
    x = _prepare(inputs)
    ratio = torch.exp(x.log_ratio)
    policy_term = -x.advantages * ratio
    with torch.no_grad():
        penalised = torch.zeros(x.mask.numel(), dtype=torch.bool, device=x.mask.device)
        valid = x.mask.flatten().nonzero().flatten()
        if valid.numel() > 0:
            cov = _centred_covariance(x).flatten()[valid]
            k = max(1, int(valid.numel() * params.kl_cov_ratio))
            penalised[valid[torch.topk(cov, k).indices]] = True
        penalised = penalised.view_as(x.mask)
    token_losses = torch.where(penalised, policy_term + params.ppo_kl_coef * x.log_ratio.abs(), policy_term)
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    metrics = _metrics(x)
    with torch.no_grad():
        metrics["actor/ppo_kl"] = float(masked_mean(x.log_ratio.detach().abs(), x.mask_f))
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Geometric mean
# --------------------------------------------------------------------------------------------


@register_policy_loss("geo_mean", params=GeoMeanParams)
def compute_geo_mean_loss(inputs: LossInputs, params: GeoMeanParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Geometric-Mean Policy Optimization (GMPO, arXiv 2507.20673), verl's ``geo_mean``.

    Per token, the log-ratio ℓ = log r is clipped on the side the advantage pushes it, in log
    space: ℓ' = min(ℓ, ``clip_ratio_high``) for A > 0 and max(ℓ, −``clip_ratio_low``) for
    A < 0 (ℓ' = 0 for A = 0). The sequence ratio is the geometric mean exp(mean_t ℓ') (one
    outlier token moves it far less than an arithmetic mean) and the sequence loss is
    −mean_t(A)·exp(mean_t ℓ'). Advantages are meant to be per sequence (outcome estimators).
    GMPO's clip range is wider than PPO's (the paper uses e^{±0.4}).

    Rollout IS weights enter as their per-sequence geometric mean (log of w + 1e-10).
    Sequences are averaged like ``seq-mean-token-mean`` (global sequence count, × dp_size);
    ``loss_agg_mode`` is ignored. verl takes a plain ``torch.mean`` over the micro-batch, which
    is the same for one micro-batch without empty responses; here empty responses count in
    no mean and micro-batches add up to the mini-batch mean.

    Metrics (verl): a token is "clipped" when ℓ is outside [−low, high];
    ``pg_clipfrac`` = clipped with A > 0, ``pg_clipfrac_lower`` = clipped with A < 0.
    """
    _check_clip(params.clip_ratio_low, params.clip_ratio_high)
    x = _prepare(inputs)
    sign = torch.sign(x.advantages)
    bounded = x.log_ratio.clamp(-params.clip_ratio_low, params.clip_ratio_high)
    # sign·min(sign·ℓ, sign·clip(ℓ)): the pessimistic side for this advantage's direction.
    pessimistic = sign * torch.minimum(sign * x.log_ratio, sign * bounded)
    lengths = x.mask_f.sum(dim=-1).clamp(min=1)  # (B,)
    seq_ratio = torch.exp(masked_sum(pessimistic, x.mask_f, dim=-1) / lengths)  # (B,)
    seq_advantage = masked_sum(x.advantages, x.mask_f, dim=-1) / lengths  # (B,)
    seq_losses = -seq_advantage * seq_ratio  # (B,)
    if x.weights is not None:
        log_w = torch.log(x.weights + GEO_MEAN_LOG_EPS)
        seq_losses = seq_losses * torch.exp(masked_sum(log_w, x.mask_f, dim=-1) / lengths)
    # Every token of a sequence carries its sequence's loss; seq-mean-token-mean then yields
    # Σ_i loss_i / (number of non-empty sequences), with the global count when given.
    token_losses = seq_losses.unsqueeze(-1).expand_as(x.mask_f)
    loss = agg_loss(
        token_losses, x.mask_f, "seq-mean-token-mean", global_num_seqs=inputs.global_num_seqs, dp_size=inputs.dp_size
    )
    out_of_range = bounded != x.log_ratio
    return loss, _metrics(x, clipped=out_of_range & (x.advantages > 0), clipped_lower=out_of_range & (x.advantages < 0))
