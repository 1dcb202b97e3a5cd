"""On-policy distillation: the student samples, a teacher scores each sampled token, and the
per-token reverse KL between them becomes a dense advantage.

For a response y sampled from the student π_S, the single-sample estimate of the reverse KL at
token t is

    k_t = log π_S(y_t | y_<t) − log π_T(y_t | y_<t)        (E_{y_t ~ π_S}[k_t] = KL(π_S || π_T) at t)

Its negation is a per-token reward: the student is pushed towards tokens the teacher finds more
likely than it does itself, and away from the others (Agarwal et al. 2024, "On-Policy
Distillation of Language Models", arXiv 2306.13649; Thinking Machines' "On-Policy Distillation"
(2025), whose recipe this follows: the advantage of token t is −kl_coef · k_t, optionally summed
over the later tokens with a discount, added to the task's own advantages). With

    D_t = Σ_{s ≥ t} γ^{s−t} · (−kl_coef · k_s · m_s)        (m: the loss mask, γ: discount)

the advantage the policy loss reads is

    A_t = reward_weight · A^task_t + D_t

where A^task comes from the run's estimator (GRPO, ...) on the task reward. reward_weight = 0 is
pure distillation; γ = 0 (the default) keeps each token's signal on that token.

Shapes: B samples, R response tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridflow.algorithms.core import check_same_shape, masked_mean


class Distilled(NamedTuple):
    """``compute_distillation_advantages``'s result."""

    advantages: torch.Tensor  # (B, R) reward_weight · A^task + D
    reverse_kl: float  # mean k_t over the masked-in tokens: distill/reverse_kl


@torch.no_grad()
def compute_reverse_kl(
    student_logprobs: torch.Tensor,  # (B, R) log π_S of the sampled tokens
    teacher_logprobs: torch.Tensor,  # (B, R) log π_T of the same tokens
    response_mask: torch.Tensor,  # (B, R) 1 on the tokens the student wrote
) -> torch.Tensor:  # (B, R) k_t, 0 off the mask
    check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, response_mask=response_mask)
    return (student_logprobs - teacher_logprobs) * response_mask


@torch.no_grad()
def discounted_future_sum(values: torch.Tensor, discount: float) -> torch.Tensor:  # (B, R)
    """out_t = Σ_{s ≥ t} discount^{s−t} · values_s along the last dimension (discount 0: ``values``)."""
    if discount == 0.0:
        return values.clone()
    out = torch.empty_like(values)
    running = values.new_zeros(values.shape[:-1])
    for t in range(values.shape[-1] - 1, -1, -1):
        running = values[..., t] + discount * running
        out[..., t] = running
    return out


@torch.no_grad()
def compute_distillation_advantages(
    task_advantages: torch.Tensor,  # (B, R) the estimator's advantages of the task reward
    student_logprobs: torch.Tensor,  # (B, R) log π_S of the sampled tokens (the actor before the update)
    teacher_logprobs: torch.Tensor,  # (B, R) log π_T of the same tokens
    response_mask: torch.Tensor,  # (B, R) 1 on the tokens the student wrote
    *,
    kl_coef: float,
    reward_weight: float,
    discount: float = 0.0,
) -> Distilled:
    """A_t = reward_weight · A^task_t + Σ_{s≥t} discount^{s−t} (−kl_coef · k_s), on the mask (see the module)."""
    check_same_shape(task_advantages=task_advantages, student_logprobs=student_logprobs, response_mask=response_mask)
    if kl_coef < 0 or reward_weight < 0:
        raise ValueError(f"kl_coef={kl_coef} and reward_weight={reward_weight} must be >= 0")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount={discount} must be in [0, 1]")
    mask = response_mask.to(student_logprobs.dtype)
    k = compute_reverse_kl(student_logprobs, teacher_logprobs, mask)
    distill = discounted_future_sum(-kl_coef * k, discount) * mask
    advantages = reward_weight * task_advantages + distill.to(task_advantages.dtype)
    return Distilled(advantages, float(masked_mean(k, mask)))
