"""From one score per sample to the per-token rewards an advantage estimator reads.

Two pure steps, in the order the trainer applies them:

- ``place_outcome_rewards``: an outcome reward (one number per response) sits on the response's
  last token, so that sequential estimators (gae, reinforce_plus_plus) discount it back over
  the response and outcome estimators, which sum a row, see the score itself.
- ``apply_kl_penalty``: in-reward KL (verl's ``algorithm.use_kl_in_reward``), r_t − β·KL_t on
  every response token, where KL_t compares the policy that sampled (old logprobs) with the
  reference model. It returns the batch's mean KL for the adaptive controller that sets β.

Shapes: B samples, R response tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridflow.algorithms.core import check_same_shape, masked_mean
from hybridflow.algorithms.kl import kl_penalty


@torch.no_grad()
def place_outcome_rewards(
    scores: torch.Tensor,  # (B,) one score per sample
    response_attention_mask: torch.Tensor,  # (B, R) 1 on the response's tokens (tool output included), 0 on padding
) -> torch.Tensor:  # (B, R) in scores' dtype
    """Each score on its response's last token, 0 elsewhere.

    The last token is counted by the attention mask, not the loss mask: in a multi-turn response
    the last token can be tool output (loss mask 0), and the estimators carry a reward placed
    there back to the policy token before it. An empty response gets its score on position 0.
    """
    if scores.dim() != 1 or response_attention_mask.dim() != 2 or scores.shape[0] != response_attention_mask.shape[0]:
        raise ValueError(
            f"scores must be (B,) and response_attention_mask (B, R), got {tuple(scores.shape)} and "
            f"{tuple(response_attention_mask.shape)}"
        )
    last = (response_attention_mask.sum(-1) - 1).clamp(min=0)  # (B,)
    token_rewards = scores.new_zeros(response_attention_mask.shape)  # (B, R)
    token_rewards[torch.arange(scores.shape[0], device=scores.device), last] = scores
    return token_rewards


class KLPenalised(NamedTuple):
    """``apply_kl_penalty``'s result."""

    token_level_rewards: torch.Tensor  # (B, R) r − β·KL
    mean_kl: float  # mean KL over the masked-in tokens: the adaptive controller's measurement


@torch.no_grad()
def apply_kl_penalty(
    token_level_rewards: torch.Tensor,  # (B, R)
    old_logprobs: torch.Tensor,  # (B, R) of the policy that sampled
    ref_logprobs: torch.Tensor,  # (B, R) of the reference model
    response_mask: torch.Tensor,  # (B, R) 1 on policy tokens
    kind: str,  # a KL_PENALTY_KINDS name (algorithm.kl_penalty)
    beta: float,  # the KL controller's current coefficient
) -> KLPenalised:
    """r_t − β·KL_t on policy tokens (verl's ``apply_kl_penalty``); masked tokens keep their reward."""
    check_same_shape(token_level_rewards=token_level_rewards, old_logprobs=old_logprobs,
                     ref_logprobs=ref_logprobs, response_mask=response_mask)
    kl = kl_penalty(old_logprobs, ref_logprobs, kind) * response_mask  # (B, R)
    return KLPenalised(token_level_rewards - beta * kl, float(masked_mean(kl, response_mask)))
