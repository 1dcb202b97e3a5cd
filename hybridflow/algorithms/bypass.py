"""Bypass mode: the rollout engine's logprobs stand in for π_old (verl 0.7's ``bypass_mode`` loss).

verl's ``algorithm.rollout_correction.bypass_mode=true`` skips the trainer's recompute of the old
logprobs: two policies (π_rollout, π_θ) instead of three (π_rollout, π_old, π_θ). The ratio the
loss sees is then π_θ / π_rollout, which already contains the engine mismatch, so correction
happens inside the loss, per micro-batch, against the current policy:

- ``loss_type=ppo_clip``: the PPO clipped surrogate (``vanilla``) with ratio π_θ / π_rollout and
  no extra importance weights (the clip already bounds that ratio; weights would count it twice);
- ``loss_type=reinforce``: L = −w·logπ_θ·A with w = min(π_θ/π_rollout, threshold) (token or
  sequence level, ``rollout_is``; detached; divided by their mean over the micro-batch with
  ``rollout_is_batch_normalize``), or plain REINFORCE without ``rollout_is``.

With ``rollout_rs`` criteria (``compute_rollout_rejection``, judged on π_θ against π_rollout) the
rejected tokens (or responses) are dropped from the loss (not from the token-mean normaliser, which the actor counted before the
loss ran; verl does the same). The ``rollout_corr/*`` metrics describe π_θ against π_rollout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.algorithms.core import check_same_shape, masked_mean
from hybridflow.algorithms.policy_loss import (
    LossInputs,
    PPOClipParams,
    _normaliser,
    compute_ppo_clip_loss,
    register_policy_loss,
)
from hybridflow.algorithms.rollout_correction import (
    RejectionCriterion,
    compute_rollout_correction,
    compute_rollout_rejection,
)

BYPASS_LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class BypassParams(PPOClipParams):
    """bypass_mode: PPO's clip settings plus ``algorithm.rollout_correction``'s (keys renamed:
    ``loss_type`` is ``bypass_loss_type``; ``rollout_rs`` with its thresholds is parsed into
    ``rollout_rs_criteria``, empty for no rejection)."""

    bypass_loss_type: str = "ppo_clip"
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs_criteria: tuple[RejectionCriterion, ...] = ()


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


@register_policy_loss("bypass_mode", params=BypassParams)
def compute_bypass_mode_loss(inputs: LossInputs, params: BypassParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass mode's loss (see the module docstring). The rejection criteria judge π_θ against
    π_rollout; ``inputs.old_logprobs`` is unused: the rollout's logprobs are π_old here."""
    old_logprobs, logprobs, advantages = inputs.old_logprobs, inputs.logprobs, inputs.advantages
    response_mask, rollout_logprobs = inputs.response_mask, inputs.rollout_logprobs
    bypass_loss_type, rollout_is = params.bypass_loss_type, params.rollout_is
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
            level=rollout_is or "token", threshold=params.rollout_is_threshold,
            # verl normalises inside its loss too: over this micro-batch (and the ranks' micro-batches
            # at the same position, which hybridflow does not reduce over).
            batch_normalize=params.rollout_is_batch_normalize and rollout_is is not None,
        )
        mask, rejection_metrics = response_mask, {}
        if params.rollout_rs_criteria:
            mask, rejection_metrics = compute_rollout_rejection(
                old_logprobs=current, rollout_logprobs=rollout_logprobs, response_mask=response_mask,
                criteria=params.rollout_rs_criteria,
            )
    agg = dict(loss_agg_mode=params.loss_agg_mode, **_normaliser(inputs))
    if bypass_loss_type == "ppo_clip":
        # No rollout IS weights: the clip already bounds π_θ/π_rollout (weights would count it twice).
        clip_inputs = dataclasses.replace(inputs, old_logprobs=rollout_logprobs, response_mask=mask,
                                          rollout_is_weights=None)
        loss, metrics = compute_ppo_clip_loss(clip_inputs, PPOClipParams(
            params.clip_ratio_low, params.clip_ratio_high, params.clip_ratio_c, params.loss_agg_mode))
    else:
        weights = correction.weights if rollout_is is not None else None
        loss, metrics = _reinforce(logprobs, rollout_logprobs, advantages, mask, weights, agg)
    return loss, metrics | correction.metrics | rejection_metrics
