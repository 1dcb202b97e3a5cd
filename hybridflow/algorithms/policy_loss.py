"""Policy losses and their registry.

Every policy loss has the same keyword-only signature, so the actor calls
``get_policy_loss(loss_mode)(**inputs)`` without branching::

    fn(*, old_logprobs,   # (B, R) logπ_old of the sampled tokens (behaviour policy, no grad)
          logprobs,       # (B, R) logπ_θ (with grad)
          advantages,     # (B, R)
          response_mask,  # (B, R) 1 on tokens that enter the loss
          clip_ratio_low, clip_ratio_high, clip_ratio_c=3.0,
          loss_agg_mode="token-mean",
          global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None, dp_size=1,
          rollout_is_weights=None,  # (B, R) importance weights multiplied into the token loss
          **unused)
      -> (loss: scalar tensor, metrics: dict[str, float])

Metrics use verl's names: ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``;
they are means over this micro-batch's masked-in tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hybridflow.algorithms.aggregation import Count, agg_loss
from hybridflow.algorithms.core import F, check_same_shape, masked_mean, register_into, resolve

# exp(20) ≈ 4.9e8 is finite in fp32/bf16; a larger log-ratio means the sample is hopelessly
# off-policy and only needs to be finite (verl clamps the same way).
LOG_RATIO_CLAMP = 20.0


class PolicyLossFn(Protocol):
    """The signature every registered policy loss implements."""

    def __call__(
        self,
        *,
        old_logprobs: torch.Tensor,
        logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        clip_ratio_low: float,
        clip_ratio_high: float,
        clip_ratio_c: float = 3.0,
        loss_agg_mode: str = "token-mean",
        global_num_tokens: Count | None = None,
        global_num_seqs: Count | None = None,
        loss_scale_factor: float | None = None,
        dp_size: int = 1,
        rollout_is_weights: torch.Tensor | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: add a policy loss under ``name`` (the value of ``actor.loss_mode``)."""
    return register_into(POLICY_LOSSES, name, "policy loss")  # type: ignore[arg-type]


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``, or a ``module:function`` path to import.

    Raises ``UnknownNameError`` (a ValueError and a KeyError) listing the registered names and
    the closest one.
    """
    return resolve(POLICY_LOSSES, name, "policy loss")


@register_policy_loss("vanilla")
def compute_ppo_clip_loss(
    *,
    old_logprobs: torch.Tensor,  # (B, R)
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
    rollout_is_weights: torch.Tensor | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
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

    loss = agg_loss(
        token_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
        dp_size=dp_size,
    )
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
