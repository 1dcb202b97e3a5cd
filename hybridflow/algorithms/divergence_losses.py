"""Policy losses that bound or penalise the policy's divergence instead of clipping its ratio.

- ``dppo_tv``, ``dppo_kl``: DPPO (Divergence-bounded PPO, arXiv 2602.04879), verl 0.7.1's modes.
- ``dro``: Direct Reward Optimization's quadratic log-ratio penalty, verl 0.9's mode.

Same typed signature and conventions as ``hybridflow.algorithms.policy_loss`` (whose helpers they use):
masked positions neutralised first, the log-ratio clamped to ±20, rollout IS weights multiplied
into the token losses, the three ``actor/*`` metrics always returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.algorithms.policy_loss import (
    LossInputs,
    PPOClipParams,
    _aggregate,
    _check_clip,
    _metrics,
    _prepare,
    _Prepared,
    register_policy_loss,
)

BINARY_KL_EPS = 1e-8  # verl's: keeps log(1 − p) finite when a token's probability is 1


def _dppo(x: _Prepared, valid: torch.Tensor, inputs: LossInputs, params: PPOClipParams
          ) -> tuple[torch.Tensor, dict[str, float]]:
    """−A·sg(min(r, clip_ratio_c))·logπ on the tokens ``valid`` keeps (the rest get no gradient)."""
    clip_ratio_c = params.clip_ratio_c
    if not clip_ratio_c > 0:
        raise ValueError(f"clip_ratio_c (DPPO's importance-weight truncation) must be > 0, got {clip_ratio_c}")
    ratio = torch.exp(x.log_ratio.detach())
    truncated = ratio.clamp(max=clip_ratio_c)
    valid_f = valid.detach().to(x.logprobs.dtype)
    token_losses = -x.advantages * truncated * x.logprobs * valid_f
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    metrics = _metrics(x, clipped=~valid, clipped_lower=(ratio > clip_ratio_c) & valid)
    return loss, metrics


def _old_logprobs(x: _Prepared, old_logprobs: torch.Tensor) -> torch.Tensor:
    """logπ_old as given (not through the clamped log-ratio), 0 on masked positions."""
    zero = torch.zeros((), dtype=x.logprobs.dtype, device=x.logprobs.device)
    return torch.where(x.mask, old_logprobs.detach().to(x.logprobs.dtype), zero)


@dataclass(frozen=True)
class DROParams:
    """dro: β of the quadratic log-ratio penalty (required, > 0) and the aggregation."""

    dro_beta: float | None = None
    loss_agg_mode: str = "token-mean"


@register_policy_loss("dppo_tv", params=PPOClipParams)
def compute_dppo_tv_loss(inputs: LossInputs, params: PPOClipParams) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV: a token keeps its gradient while its probability has moved less than the
    clip range in the direction its advantage pushes it.

    With p = π(token), p_old = π_old(token): a token with A > 0 is valid while p − p_old ≤
    clip_ratio_high, one with A ≤ 0 while p − p_old ≥ −clip_ratio_low (the clip ranges are
    probability differences here, not ratio bounds). L = −A·sg(min(r, clip_ratio_c))·logπ on valid
    tokens, 0 elsewhere: truncated importance sampling instead of PPO's dual clip.

    Metrics: ``pg_clipfrac`` = tokens not valid; ``pg_clipfrac_lower`` = valid tokens whose ratio
    was truncated (r > clip_ratio_c), as verl.
    """
    _check_clip(params.clip_ratio_low, params.clip_ratio_high)
    x = _prepare(inputs)
    with torch.no_grad():
        moved = x.logprobs.exp() - _old_logprobs(x, inputs.old_logprobs).exp()  # p − p_old
        valid = torch.where(x.advantages > 0, moved <= params.clip_ratio_high, moved >= -params.clip_ratio_low)
    return _dppo(x, valid, inputs, params)


@register_policy_loss("dppo_kl", params=PPOClipParams)
def compute_dppo_kl_loss(inputs: LossInputs, params: PPOClipParams) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL: as ``dppo_tv`` with the binary KL divergence of the token's probability,

        D = p_old·log(p_old/p) + (1 − p_old)·log((1 − p_old + ε)/(1 − p + ε)),  ε = 1e-8,

    as the distance: a token with A > 0 is valid while D ≤ clip_ratio_high or p ≤ p_old (it has
    not moved the way A pushes), one with A ≤ 0 while D ≤ clip_ratio_low or p ≥ p_old.
    """
    _check_clip(params.clip_ratio_low, params.clip_ratio_high)
    x = _prepare(inputs)
    with torch.no_grad():
        old = _old_logprobs(x, inputs.old_logprobs)
        p, p_old = x.logprobs.exp(), old.exp()
        binary_kl = p_old * (old - x.logprobs) + (1 - p_old) * torch.log(
            (1 - p_old + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS)
        )
        valid = torch.where(x.advantages > 0, (binary_kl <= params.clip_ratio_high) | (p <= p_old),
                            (binary_kl <= params.clip_ratio_low) | (p >= p_old))
    return _dppo(x, valid, inputs, params)


@register_policy_loss("dro", params=DROParams)
def compute_dro_loss(inputs: LossInputs, params: DROParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct Reward Optimization: L = −(logπ·A − ½·β·(logπ − logπ_old)²) per token.

    No clip: the quadratic penalty on the log-ratio (β = ``actor.policy_loss.dro_beta``, which
    must be set > 0, as in verl) pulls the policy back towards π_old, harder the further it
    moved. Metrics: ``ppo_kl``; the two clip fractions are 0 (nothing is clipped).
    """
    x = _prepare(inputs)
    dro_beta = params.dro_beta
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"dro needs actor.policy_loss.dro_beta > 0, got {dro_beta}")
    token_losses = -(x.logprobs * x.advantages - 0.5 * dro_beta * x.log_ratio.square())
    loss = _aggregate(token_losses, x, params.loss_agg_mode, inputs)
    return loss, _metrics(x)

