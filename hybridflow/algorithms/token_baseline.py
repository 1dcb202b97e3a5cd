"""Optimal token baseline (OTB): a per-token baseline weighted by the path's accumulated variance.

verl 0.7.1's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``
(``compute_optimal_token_baseline_advantage`` and
``compute_multi_turn_optimal_token_baseline_advantage`` in ``verl/trainer/ppo/core_algos.py``).
Within a prompt group, at token t::

    w_j = 1 − 2·π_j + Σ_v π(v)²        the squared norm of the score function ∇log π at token j
    W_t = Σ_{j ≤ t} w_j                 its running sum along the response: the path's variance so far
    G_t = Σ_{s ≥ t} r_s                 reward-to-go
    B_t = Σ_i G_{i,t}·W_{i,t} / (Σ_i W_{i,t} + ε)
    A_t = G_t − B_t

π_j is the probability of the sampled token under the policy that sampled it (exp of
``old_logprobs``) and Σπ² the sum of squared probabilities over the vocabulary at that position
(``sum_pi_squared``, verl's ``actor.calculate_sum_pi_squared``). With rollout importance weights ρ
(``rollout_is_weights``: the trainer fills them from the rollout correction, truncated π_old/π_rollout
at ``algorithm.rollout_correction.rollout_is`` level, when that is on), w_j is scaled by ρ_j². A group of one sample has baseline 0 (A = G). With ``handle_zero_tail`` the
one longest response of a group, where it runs past the second longest, gets baseline 0: nothing
else in the group reaches those tokens, so the "baseline" there would be its own return.

The two differ in what "token t" means. ``optimal_token_baseline`` lines responses up by
position in the padded response, masked tokens included (a tool reply in a multi-turn response
shifts everything after it). ``tir_optimal_token_baseline`` (tool-integrated reasoning) counts
only the policy's own tokens, so the k-th generated token of every response shares a baseline;
empty responses are left out of their group (they count neither as members nor for the tail).

Where this differs from verl 0.9.1: a reward placed on a masked token (the controller puts the
outcome on the last response token, which in a multi-turn response can be tool output) still
counts in G for the tokens before it, as in every hybridflow estimator; verl drops it. Returns and
advantages are 0 on masked tokens (verl's returns, in both variants, are G there: at tool output
inside a response).
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.advantages import (
    AdvantageInputs,
    AdvantageOutputs,
    TokenBaselineParams,
    _check_inputs,
    _compute_dtype,
    _group_index,
    register_adv_estimator,
)
from hybridflow.algorithms.core import check_same_shape

# ``rollout_is_weights`` is None unless algorithm.rollout_correction.rollout_is is set (verl scales
# by the rollout correction's weights only then): asking for it costs nothing beyond the
# old-logprob forward that old_logprobs and sum_pi_squared already need.
NEEDS = ("old_logprobs", "sum_pi_squared", "rollout_is_weights")
OTB_EPSILON = 1e-8  # verl's: keeps B finite where every W of the group is 0 (no policy token yet)


def _per_token_weights(old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor,
                       rollout_is_weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """W_t, the running sum of w_j = (1 − 2π_j + Σπ²)·ρ_j² over the policy tokens up to t.  # (B, R)"""
    w = 1.0 - 2.0 * old_logprobs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(w.dtype) ** 2
    return (w * mask).cumsum(dim=-1)


def _group_baselines(returns: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                     handle_zero_tail: bool, member: torch.Tensor) -> torch.Tensor:
    """B per sample and position (B, T) for aligned (B, T) inputs; ``member`` (B,) bool marks the
    samples that count in their group (the others get baseline 0)."""
    inverse, num_groups = _group_index(group_ids, returns.shape[0])
    weighted_mask = weights * mask * member.unsqueeze(-1)  # (B, T)
    numerator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, inverse, returns * weighted_mask)
    denominator = returns.new_zeros(num_groups, returns.shape[1]).index_add_(0, inverse, weighted_mask)
    baselines = (numerator / (denominator + OTB_EPSILON))[inverse]  # (B, T)
    sizes = torch.zeros(num_groups, dtype=torch.long, device=returns.device).index_add_(0, inverse, member.long())
    keep = member & (sizes[inverse] > 1)
    if handle_zero_tail:
        keep_from = _tail_start(mask.sum(dim=-1).long(), inverse, num_groups, member)  # (B,)
        positions = torch.arange(returns.shape[1], device=returns.device)
        baselines = torch.where(positions < keep_from.unsqueeze(-1), baselines, torch.zeros_like(baselines))
    return torch.where(keep.unsqueeze(-1), baselines, torch.zeros_like(baselines))


def _tail_start(lengths: torch.Tensor, inverse: torch.Tensor, num_groups: int, member: torch.Tensor) -> torch.Tensor:
    """Per sample, where its zero tail starts: the second-longest length of its group if it is the
    group's one longest response (strictly), else past its end (no tail)."""
    lengths = torch.where(member, lengths, torch.full_like(lengths, -1))
    floor = torch.full((num_groups,), -1, dtype=lengths.dtype, device=lengths.device)
    longest = floor.scatter_reduce(0, inverse, lengths, "amax")
    at_longest = member & (lengths == longest[inverse])
    ties = torch.zeros(num_groups, dtype=torch.long, device=lengths.device).index_add_(0, inverse, at_longest.long())
    second = floor.scatter_reduce(0, inverse, torch.where(at_longest, -1, lengths), "amax")
    alone = at_longest & (ties[inverse] == 1) & (second[inverse] >= 0)  # a longest response with company
    no_tail = torch.full_like(lengths, torch.iinfo(lengths.dtype).max)
    return torch.where(alone, second[inverse], no_tail)


def _inputs(inputs: AdvantageInputs, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    _check_inputs(token_level_rewards, response_mask)
    old = inputs.require("old_logprobs", name)
    spi = inputs.require("sum_pi_squared", name)
    check_same_shape(token_level_rewards=token_level_rewards, old_logprobs=old, sum_pi_squared=spi)
    dtype = _compute_dtype(token_level_rewards.dtype)
    mask = (response_mask != 0).to(dtype)
    # Masked positions are never read: zero them so padding garbage (even -inf) cannot leak in.
    return (old.to(dtype) * mask, spi.to(dtype) * mask, mask)


@register_adv_estimator("optimal_token_baseline", needs=NEEDS, params=TokenBaselineParams)
@torch.no_grad()
def compute_optimal_token_baseline_advantages(inputs: AdvantageInputs, params: TokenBaselineParams) -> AdvantageOutputs:
    """OTB with baselines per padded response position (see the module docstring)."""
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    old, spi, mask = _inputs(inputs, "optimal_token_baseline")
    returns = token_level_rewards.to(mask.dtype).flip(-1).cumsum(-1).flip(-1) * mask  # (B, R)
    weights = _per_token_weights(old, spi, inputs.rollout_is_weights, mask)
    everyone = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    baselines = _group_baselines(returns, weights, mask, group_ids, params.handle_zero_tail, everyone)
    dtype = token_level_rewards.dtype
    return AdvantageOutputs(((returns - baselines) * mask).to(dtype), returns.to(dtype))


@register_adv_estimator("tir_optimal_token_baseline", needs=NEEDS, params=TokenBaselineParams)
@torch.no_grad()
def compute_tir_optimal_token_baseline_advantages(inputs: AdvantageInputs, params: TokenBaselineParams) -> AdvantageOutputs:
    """OTB with baselines per policy-token index: the k-th generated token of each response in a
    group shares one baseline, whatever tool output came before it (see the module docstring)."""
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    old, spi, mask = _inputs(inputs, "tir_optimal_token_baseline")
    returns = token_level_rewards.to(mask.dtype).flip(-1).cumsum(-1).flip(-1) * mask  # (B, R)
    weights = _per_token_weights(old, spi, inputs.rollout_is_weights, mask)
    # Compact each row's policy tokens to the left: token t of row i moves to column index[i, t].
    lengths = mask.sum(dim=-1).long()  # (B,)
    index = (mask.cumsum(dim=-1) - 1).clamp(min=0).long()  # (B, R)
    width = max(int(lengths.max()), 1) if lengths.numel() else 1

    def compact(x: torch.Tensor) -> torch.Tensor:  # (B, R) -> (B, width), policy tokens only
        return x.new_zeros(x.shape[0], width).scatter_add_(1, index, x * mask)

    compact_mask = (torch.arange(width, device=mask.device) < lengths.unsqueeze(-1)).to(mask.dtype)
    baselines = _group_baselines(compact(returns), compact(weights), compact_mask, group_ids, params.handle_zero_tail,
                                 member=lengths > 0)
    advantages = (returns - baselines.gather(1, index)) * mask
    dtype = token_level_rewards.dtype
    return AdvantageOutputs(advantages.to(dtype), returns.to(dtype))
