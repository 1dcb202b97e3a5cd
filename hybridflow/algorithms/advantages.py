"""Advantage estimators and their registry.

Every estimator has the same keyword-only signature, so the controller calls
``get_adv_estimator(name)(**inputs)`` and never branches on the algorithm::

    fn(*, token_level_rewards,  # (B, R) float, reward per response token (outcome: at the last)
          response_mask,        # (B, R) 0/1, 1 on tokens the policy produced
          group_ids,            # (B,) integer, samples drawn from the same prompt share an id
          gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, epsilon=1e-6,
          **unused)             # inputs other estimators need (values, baselines, ...)
      -> (advantages (B, R), returns (B, R))

Estimators ignore the inputs they do not use. Advantages are constants for the policy loss, so
everything here runs under ``torch.no_grad``. Group statistics are vectorised with
``torch.unique(return_inverse=True)`` + ``index_add``: group ids may be any integers, in any
order, and no Python loop runs per sample.

Semantics follow verl 0.9 (``verl/trainer/ppo/core_algos.py``); where this file differs it
says so in the function's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hybridflow.algorithms.core import F, check_same_shape, masked_whiten, register_into, resolve


class AdvantageEstimatorFn(Protocol):
    """The signature every registered advantage estimator implements."""

    def __call__(
        self,
        *,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: torch.Tensor,
        gamma: float = 1.0,
        lam: float = 1.0,
        norm_adv_by_std_in_grpo: bool = True,
        epsilon: float = 1e-6,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ADV_ESTIMATORS: dict[str, AdvantageEstimatorFn] = {}


def register_adv_estimator(name: str) -> Callable[[F], F]:
    """Decorator: add an estimator under ``name`` (the value of ``algorithm.adv_estimator``)."""
    return register_into(ADV_ESTIMATORS, name, "advantage estimator")  # type: ignore[arg-type]


def get_adv_estimator(name: str) -> AdvantageEstimatorFn:
    """The estimator registered as ``name``, or a ``module:function`` path to import.

    Raises ``UnknownNameError`` (a ValueError and a KeyError) listing the registered names and
    the closest one.
    """
    return resolve(ADV_ESTIMATORS, name, "advantage estimator")


# --------------------------------------------------------------------------------------------
# Input checks and group statistics
# --------------------------------------------------------------------------------------------


def _check_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Shapes agree and rewards are finite: a nan reward would silently poison a whole group."""
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be (B, R), got shape {tuple(token_level_rewards.shape)}")
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    finite = torch.isfinite(token_level_rewards)
    if not bool(finite.all()):
        rows = (~finite).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(
            f"token_level_rewards has non-finite values in rows {rows[:10]}"
            f"{' ...' if len(rows) > 10 else ''}; fix the reward function or drop those samples"
        )


def _group_index(group_ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Dense group index in [0, G) for each sample (B,), and G."""
    if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
        raise ValueError(
            f"group_ids must be ({batch_size},) to match token_level_rewards, got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    return inverse, num_groups


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: bf16 group means lose the small differences GRPO is made of."""
    return torch.promote_types(dtype, torch.float32)


def _group_stats(
    scores: torch.Tensor, inverse: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std), each (B,).

    Two passes (mean, then squared deviations) like ``torch.std``, so the numbers match it.
    The std of a singleton group is left at 0 here; callers apply their own singleton rule.
    """
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, inverse, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, inverse, scores)
    mean = sums / counts  # every group has at least one member, so counts > 0
    deviations = scores - mean[inverse]
    squares = torch.zeros_like(counts).index_add_(0, inverse, deviations * deviations)
    var = squares / (counts - 1).clamp(min=1)
    return counts[inverse], mean[inverse], var.sqrt()[inverse]


# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------


@register_adv_estimator("grpo")
@torch.no_grad()
def compute_grpo_advantages(
    *,
    token_level_rewards: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    group_ids: torch.Tensor,  # (B,)
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages: A_i = (r_i − mean_g) / (std_g + ε), broadcast over tokens.

    ``r_i = token_level_rewards[i].sum()``; ``std_g`` is the unbiased (Bessel) std of group g.
    A group of one sample uses mean 0 and std 1 (so A = r/(1 + ε)), as verl does. With
    ``norm_adv_by_std_in_grpo=False`` (Dr.GRPO) A_i = r_i − mean_g. A group whose rewards are
    all equal gets A = 0: it carries no learning signal. Returns are the advantages.
    """
    _check_inputs(token_level_rewards, response_mask)
    dtype = _compute_dtype(token_level_rewards.dtype)
    scores = token_level_rewards.to(dtype).sum(dim=-1)  # (B,)
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts, mean, std = _group_stats(scores, inverse, num_groups)
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    advantage = scores - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + epsilon)
    advantages = (advantage.unsqueeze(-1) * response_mask.to(dtype)).to(token_level_rewards.dtype)  # (B, R)
    return advantages, advantages.clone()


@register_adv_estimator("rloo")
@torch.no_grad()
def compute_rloo_advantages(
    *,
    token_level_rewards: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    group_ids: torch.Tensor,  # (B,)
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each sample's baseline is the mean reward of the other n − 1 in its group.

    A_i = r_i − mean_{j≠i} r_j = n/(n − 1)·(r_i − mean_g). A group of one has no other sample,
    so its advantage is the raw score (verl's ``rloo``; ``rloo_vectorized`` gives 0 instead).
    """
    _check_inputs(token_level_rewards, response_mask)
    dtype = _compute_dtype(token_level_rewards.dtype)
    scores = token_level_rewards.to(dtype).sum(dim=-1)  # (B,)
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts, mean, _ = _group_stats(scores, inverse, num_groups)
    leave_one_out = counts / (counts - 1).clamp(min=1) * (scores - mean)
    advantage = torch.where(counts > 1, leave_one_out, scores)
    advantages = (advantage.unsqueeze(-1) * response_mask.to(dtype)).to(token_level_rewards.dtype)  # (B, R)
    return advantages, advantages.clone()


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    *,
    token_level_rewards: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    gamma: float = 1.0,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over every response token of the batch.

    G_t = r_t + γ·G_{t+1} on policy tokens. A token with mask 0 (tool output inside a
    multi-turn response) is not a step of the policy: the running return passes through it
    undiscounted (plus any reward placed on it), so the tokens before a tool call still see
    the final reward. verl 0.9 instead zeroes the running return at every masked token, which
    for a masked *middle* token cuts the reward off from earlier turns; for ordinary right
    padding (zero reward after the last token) both give the same numbers.

    advantages = masked_whiten(G, mask) × mask; returns = G (unwhitened).
    """
    _check_inputs(token_level_rewards, response_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    dtype = _compute_dtype(token_level_rewards.dtype)
    rewards = token_level_rewards.to(dtype)
    mask = response_mask.to(dtype)
    # Per-token discount: gamma on policy tokens, 1 (time does not advance) on masked ones.
    discount = torch.where(mask != 0, torch.full_like(mask, gamma), torch.ones_like(mask))
    returns = torch.zeros_like(rewards)  # (B, R)
    running = rewards.new_zeros(rewards.shape[0])  # (B,)
    # The scan over time is inherently sequential; each step is one (B,) vector op.
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + discount[:, t] * running
        returns[:, t] = running
    advantages = masked_whiten(returns, mask) * mask
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)
