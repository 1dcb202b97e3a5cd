"""PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456): an implicit
process reward model trained online from outcome labels, whose per-token log-ratio to a frozen reference is a
dense reward beside the outcome reward.

The implicit PRM is a causal LM φ (initialised from the policy) with a frozen copy of its initial weights as the
reference. For a response y its token reward and sequence reward are

    r_t = β · (log φ(y_t | y_<t) − log ref(y_t | y_<t)),        R(y) = Σ_t r_t · m_t        (m: response mask)

and φ is trained each step on the step's samples with the cross-entropy of σ(R) against the outcome label
ℓ = [score > threshold] (``implicit_prm_loss``). The policy's advantages combine two reward sources, each with
its own leave-one-out baseline over the prompt's n samples (verl's PRIME recipe, ``compute_prime_advantages``):

    implicit:  r̃_t = n/(n−1) · r_t − Σ_j mean_t(r_j) / (n−1)                       (on masked-in tokens)
    outcome:   õ_i = n/(n−1) · o_i − Σ_j o_j / (n−1) = o_i − mean_{j≠i} o_j
    G_t = dpo_coef · Σ_{s≥t} r̃_s m_s + gt_coef · õ_i,        A = whiten(G) over the batch's masked-in tokens

Shapes: B samples, R response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.algorithms.advantages import (
    AdvantageInputs,
    AdvantageOutputs,
    _group_index,
    _outcome_scores,
    _per_sample_input,
    register_adv_estimator,
)
from hybridflow.algorithms.core import check_same_shape, masked_whiten

IMPLICIT_REWARD_NORMS = ("batch_norm", "none")  # prime.reward_norm
NORM_EPS = 1e-6  # verl's: keeps an all-zero batch (step one: φ equals its reference) at zero


def compute_implicit_token_rewards(
    logprobs: torch.Tensor,  # (B, R) log φ of the sampled tokens
    ref_logprobs: torch.Tensor,  # (B, R) log ref of the same tokens
    response_mask: torch.Tensor,  # (B, R) 1 on the tokens the policy wrote
    beta: float,
) -> torch.Tensor:  # (B, R) r_t, 0 off the mask
    """r_t = β · (log φ − log ref) on the masked-in tokens."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask)
    return beta * (logprobs - ref_logprobs) * response_mask


def implicit_prm_loss(
    logprobs: torch.Tensor,  # (B, R) log φ, with gradient
    ref_logprobs: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    labels: torch.Tensor,  # (B,) 1.0 for a correct outcome, else 0.0
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ((B,) per-sample loss, (B,) R(y) detached)
    """The cross-entropy of σ(R(y)) against the outcome label, per sample (callers normalise over the
    batch): −ℓ·log σ(R) − (1−ℓ)·log(1 − σ(R)), computed from the logit R for stability (verl's
    ``compute_ce_dpo_loss_rm`` applies sigmoid then BCE: the same numbers away from saturation)."""
    token_rewards = compute_implicit_token_rewards(logprobs, ref_logprobs, response_mask, beta)
    sequence = token_rewards.sum(dim=-1)  # (B,)
    if labels.shape != sequence.shape:
        raise ValueError(f"labels must be ({sequence.shape[0]},), got {tuple(labels.shape)}")
    loss = F.binary_cross_entropy_with_logits(sequence, labels.to(sequence.dtype), reduction="none")
    return loss, sequence.detach()


def outcome_labels(scores: torch.Tensor, threshold: float) -> torch.Tensor:  # (B,) float 0/1
    """ℓ = [score > threshold]: the verifier's verdict the implicit PRM learns to predict."""
    return (scores > threshold).to(torch.float32)


@torch.no_grad()
def implicit_prm_accuracy(sequence_rewards: torch.Tensor, labels: torch.Tensor) -> float:
    """How often the PRM's verdict σ(R) > 1/2 (R > 0) is the outcome label: ``prime/acc``. A PRM equal to its
    reference (R = 0) predicts "wrong" for every sample."""
    if sequence_rewards.numel() == 0:
        return 0.0
    return float(((sequence_rewards > 0).to(labels.dtype) == labels).float().mean())


@torch.no_grad()
def implicit_prm_pair_accuracy(sequence_rewards: torch.Tensor, labels: torch.Tensor, group_ids: torch.Tensor) -> float:
    """verl's ``compute_dpo_accuracy``: within each prompt's group, over the pairs (i < j) whose labels differ, the
    share the PRM orders as the labels do (verl's rule: [R_i > R_j] == [ℓ_i > ℓ_j], so a tie agrees with
    ℓ_i < ℓ_j); a group with no such pair counts 1/2. The mean over groups: ``prime/pair_acc``."""
    inverse, num_groups = _group_index(group_ids, sequence_rewards.shape[0])
    accuracies = []
    for g in range(num_groups):
        rows = (inverse == g).nonzero().flatten()
        r, y = sequence_rewards[rows], labels[rows].to(sequence_rewards.dtype)
        label_diff = (y[:, None] - y[None, :]).triu(diagonal=1)  # the upper triangle: each pair once
        reward_diff = (r[:, None] - r[None, :]).triu(diagonal=1)
        weight = label_diff.abs()
        if float(weight.sum()) == 0.0:
            accuracies.append(0.5)
            continue
        agree = ((reward_diff > 0) == (label_diff > 0)).to(weight.dtype)
        accuracies.append(float((agree * weight).sum() / weight.sum()))
    return sum(accuracies) / max(1, len(accuracies))


@torch.no_grad()
def implicit_prm_metrics(token_rewards: torch.Tensor, scores: torch.Tensor, group_ids: torch.Tensor,
                         threshold: float) -> dict[str, float]:
    """What the token rewards (B, R) a step's advantages use say about the outcome labels of ``scores`` (B,):
    ``prime/pair_acc``, and the means of the sequence rewards and of the labels."""
    sequence, labels = token_rewards.sum(dim=-1), outcome_labels(scores, threshold)
    return {"prime/pair_acc": implicit_prm_pair_accuracy(sequence, labels, group_ids),
            "prime/implicit_reward/mean": float(sequence.mean()), "prime/label/mean": float(labels.mean())}


@torch.no_grad()
def normalise_implicit_rewards(token_rewards: torch.Tensor, norm: str) -> torch.Tensor:  # (B, R)
    """verl's ``prime_norm``: ``batch_norm`` divides every token reward by the largest |return-to-go| in the batch
    (max over samples and tokens of |Σ_{s≥t} r_s|, + 1e-6), so the implicit returns lie in [−1, 1] whatever β;
    ``none`` leaves them."""
    if norm == "none":
        return token_rewards
    if norm != "batch_norm":
        raise ValueError(f"implicit reward norm {norm!r}: expected one of {', '.join(IMPLICIT_REWARD_NORMS)}")
    to_go = token_rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return token_rewards / (to_go.abs().max() + NORM_EPS) if to_go.numel() else token_rewards


@dataclass(frozen=True)
class PrimeParams:
    """The weights of PRIME's two reward sources (verl's ``algorithm.reward_dpo_coef`` / ``reward_gt_coef``)."""

    reward_dpo_coef: float = 5.0  # the implicit PRM's token rewards
    reward_gt_coef: float = 5.0  # the outcome reward (the verifier's score)


def _leave_one_out(values: torch.Tensor, per_sample: torch.Tensor, inverse: torch.Tensor,
                   num_groups: int) -> torch.Tensor:
    """n/(n−1) · values − Σ_j per_sample_j / (n−1) per sample's group (``values`` (B,) or (B, R), its rows
    broadcast); a group of one has no other sample and keeps its values (as ``rloo``)."""
    counts = torch.zeros(num_groups, dtype=per_sample.dtype).index_add_(0, inverse, torch.ones_like(per_sample))
    sums = torch.zeros(num_groups, dtype=per_sample.dtype).index_add_(0, inverse, per_sample)
    n, total = counts[inverse], sums[inverse]
    if values.dim() == 2:
        n, total = n[:, None], total[:, None]
    return torch.where(n > 1, values * n / (n - 1).clamp(min=1) - total / (n - 1).clamp(min=1), values)


@register_adv_estimator("prime", needs=("implicit_rewards",), params=PrimeParams)
@torch.no_grad()
def compute_prime_advantages(inputs: AdvantageInputs, params: PrimeParams) -> AdvantageOutputs:
    """PRIME's advantages (verl's recipe ``compute_rloo_advantage_return``): RLOO on each reward source apart,
    then their weighted returns summed and whitened over the batch (module docstring).

    The outcome o_i is the sample's summed token-level rewards (the score, less any in-reward KL); its
    leave-one-out value counts on every policy token (verl places it on the last token and sums the returns
    backwards: the same numbers wherever the last response token is a policy token). The implicit rewards'
    per-sample mean is over its masked-in tokens; their leave-one-out values are summed backwards from each
    token. returns = G (unwhitened), advantages = whiten(G) · m."""
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    outcome, dtype = _outcome_scores(token_level_rewards, response_mask)  # (B,)
    implicit = _per_sample_input(inputs, "implicit_rewards", "prime", 2, "(B, R) like token_level_rewards").to(dtype)
    check_same_shape(implicit_rewards=implicit, response_mask=response_mask)
    mask = response_mask.to(dtype)
    inverse, num_groups = _group_index(inputs.group_ids, outcome.shape[0])
    returns = torch.zeros_like(mask)
    if params.reward_dpo_coef != 0.0:
        implicit = implicit * mask
        means = implicit.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,) mean token reward of each sample
        loo = _leave_one_out(implicit, means, inverse, num_groups) * mask
        returns = returns + params.reward_dpo_coef * loo.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1]) * mask
    if params.reward_gt_coef != 0.0:
        loo_outcome = _leave_one_out(outcome, outcome, inverse, num_groups)  # (B,)
        returns = returns + params.reward_gt_coef * loo_outcome[:, None] * mask
    advantages = masked_whiten(returns, mask) * mask
    out = token_level_rewards.dtype
    return AdvantageOutputs(advantages.to(out), returns.to(out))
