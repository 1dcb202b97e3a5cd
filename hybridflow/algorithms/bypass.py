"""Bypass mode: the rollout engine's logprobs stand in for π_old (verl 0.7's ``bypass_mode`` loss).

verl's ``algorithm.rollout_correction.bypass_mode=true`` skips the trainer's recompute of the old
logprobs: two policies (π_rollout, π_θ) instead of three (π_rollout, π_old, π_θ). The ratio the
loss sees is then π_θ / π_rollout, which already contains the engine mismatch, so correction
happens inside the loss, per micro-batch, against the current policy:

- ``loss_type=ppo_clip``: the PPO clipped surrogate (``vanilla``) with ratio π_θ / π_rollout and
  no extra importance weights (the clip already bounds that ratio; weights would count it twice);
- ``loss_type=reinforce``: L = −w·logπ_θ·A with w = min(π_θ/π_rollout, threshold) (token or
  sequence level, ``rollout_is``; detached), or plain REINFORCE without ``rollout_is``.

With ``rollout_rs`` the tokens (or responses) whose ratio π_θ/π_rollout lies outside the band are
dropped from the loss (not from the token-mean normaliser, which the actor counted before the
loss ran; verl does the same). The ``rollout_corr/*`` metrics describe π_θ against π_rollout.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algorithms.aggregation import Count, agg_loss
from hybridflow.algorithms.core import check_same_shape, masked_mean
from hybridflow.algorithms.policy_loss import compute_ppo_clip_loss, register_policy_loss
from hybridflow.algorithms.rollout_correction import compute_rollout_correction

BYPASS_LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")


def _reinforce(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, weights: torch.Tensor | None, agg: dict[str, Any]
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """−w·logπ·A aggregated over ``mask``; metrics with verl's ``ppo_kl`` against the rollout."""
    keep = mask != 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logp = torch.where(keep, logprobs, zero)  # a select, so padding's -inf cannot reach the gradient
    token_losses = -torch.where(keep, advantages.detach().to(logprobs.dtype), zero) * logp
    if weights is not None:
        token_losses = token_losses * weights.to(logprobs.dtype)
    loss = agg_loss(token_losses, mask.to(logprobs.dtype), **agg)
    with torch.no_grad():
        rollout = torch.where(keep, rollout_logprobs.to(logprobs.dtype), zero)
        kl = float(masked_mean(rollout - logp.detach(), mask.to(logprobs.dtype)))
    return loss, {"actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0, "actor/ppo_kl": kl}


@register_policy_loss("bypass_mode")
def compute_bypass_mode_loss(
    *,
    old_logprobs: torch.Tensor,  # (B, R) unused: the rollout's logprobs are π_old here
    logprobs: torch.Tensor,  # (B, R)
    advantages: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
    rollout_logprobs: torch.Tensor | None = None,  # (B, R)
    bypass_loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_band: tuple[float, float] | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass mode's loss (see the module docstring). ``rollout_rs_band`` bounds π_θ/π_rollout."""
    check_same_shape(old_logprobs=old_logprobs, logprobs=logprobs, advantages=advantages, response_mask=response_mask)
    if bypass_loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"bypass_loss_type must be one of {BYPASS_LOSS_TYPES}, got {bypass_loss_type!r}")
    if rollout_logprobs is None:
        raise ValueError("bypass_mode needs rollout_logprobs= (the rollout engine's logprobs of the sampled tokens)")
    check_same_shape(logprobs=logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    with torch.no_grad():
        current = logprobs.detach()
        correction = compute_rollout_correction(
            old_logprobs=current, rollout_logprobs=rollout_logprobs, response_mask=response_mask,
            level=rollout_is or "token", threshold=rollout_is_threshold,
        )
        mask = response_mask
        if rollout_rs is not None:
            mask = compute_rollout_correction(
                old_logprobs=current, rollout_logprobs=rollout_logprobs, response_mask=response_mask,
                level=rollout_rs, threshold=rollout_is_threshold, rejection_band=rollout_rs_band,
            ).keep_mask
    agg = dict(loss_agg_mode=loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
               loss_scale_factor=loss_scale_factor, dp_size=dp_size)
    if bypass_loss_type == "ppo_clip":
        loss, metrics = compute_ppo_clip_loss(
            old_logprobs=rollout_logprobs, logprobs=logprobs, advantages=advantages, response_mask=mask,
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, **agg,
        )
    else:
        weights = correction.weights if rollout_is is not None else None
        loss, metrics = _reinforce(logprobs, rollout_logprobs, advantages, mask, weights, agg)
    rejected = float(masked_mean((response_mask != 0).float() - (mask != 0).float(), (response_mask != 0).float()))
    return loss, metrics | correction.metrics | {"rollout_corr/rollout_rs_masked_fraction": rejected}
