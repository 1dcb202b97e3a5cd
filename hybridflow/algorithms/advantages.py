"""Advantage estimators and their registry.

Every estimator takes one typed record of inputs and its own frozen parameters, so the
controller calls ``estimator(inputs, params)`` and never branches on the algorithm::

    fn(inputs: AdvantageInputs, params: <its params dataclass>) -> AdvantageOutputs

``AdvantageInputs`` holds every tensor an estimator may read (the always-present token rewards,
response mask and group ids, plus the optional inputs the trainer produces only for an estimator
that declares it ``needs`` them). The parameters are a frozen dataclass per estimator
(``GAEParams``, ``GroupNormParams``, ...), declared at registration and built once from the
config (``build_estimator_params``). Registered: ``gae``, ``grpo``, ``gdpo``, ``grpo_passk``,
``rloo``, ``opo``, ``gpg``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``,
``remax``; in ``hybridflow.algorithms.prime`` ``prime``; and in ``hybridflow.algorithms.token_baseline`` ``optimal_token_baseline`` and
``tir_optimal_token_baseline``.

Masked tokens (``response_mask`` 0: padding, tool output inside a multi-turn response) are
not steps of the policy: time does not advance over them and their advantages are 0 (returns
there are not meaningful; no loss reads them). A reward placed on one still counts: outcome
estimators sum every token's reward, and the sequential ones (gae, remax,
reinforce_plus_plus) pass it back undiscounted to the policy token before it. (The outcome
reward sits on the last response token, ``place_outcome_rewards``, which in a multi-turn
response can be a tool-output token.)

Advantages are constants for the policy loss, so everything here runs under ``torch.no_grad``. Group statistics are vectorised with
``torch.unique(return_inverse=True)`` + ``index_add``: group ids may be any integers, in any
order, and no Python loop runs per sample.

Semantics follow verl 0.9 (``verl/trainer/ppo/core_algos.py``); where this file differs it
says so in the function's docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from hybridflow.algorithms.core import (
    F,
    build_params,
    check_same_shape,
    masked_whiten,
    register_into,
    resolve_typed,
)

# What each optional input is, for the error an estimator raises when it is missing.
_INPUT_DOCS: dict[str, str] = {
    "values": "(B, R) critic values of the response tokens",
    "reward_baselines": "(B,) score of the greedy response to each prompt",
    "reward_components": "(B, K) reward components",
    "old_logprobs": "(B, R) logprobs of the sampled tokens, before the update",
    "sum_pi_squared": "(B, R) sum over the vocabulary of pi(v)^2 at each response position",
    "rollout_is_weights": "(B, R) rollout importance weights pi_old / pi_rollout (None when no correction is configured)",
    "implicit_rewards": "(B, R) the implicit process reward model's token rewards beta * (log phi - log ref)",
}


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an advantage estimator may read; B samples, R response tokens, K components.

    The first three are always present. The optional ones cost the trainer work (a critic
    forward, a greedy rollout, an actor forward), so it produces only those the estimator
    declares in its ``needs`` (``OPTIONAL_ESTIMATOR_INPUTS``); the others are None.
    ``rollout_is_weights`` may be None even when declared: it exists only when the config turns
    the rollout correction's importance weights on (``algorithm.rollout_correction.rollout_is``).
    """

    token_level_rewards: torch.Tensor  # (B, R) float, reward per response token (outcome: at the last)
    response_mask: torch.Tensor  # (B, R) 0/1, 1 on tokens the policy produced
    group_ids: torch.Tensor  # (B,) integer, samples drawn from the same prompt share an id
    values: torch.Tensor | None = None  # (B, R) critic values V(s_t) of the rollout policy (gae)
    reward_baselines: torch.Tensor | None = None  # (B,) reward of the greedy response to each prompt (remax)
    reward_components: torch.Tensor | None = None  # (B, K) the reward's named numbers (gdpo)
    old_logprobs: torch.Tensor | None = None  # (B, R) logπ_old of the sampled tokens (optimal_token_baseline)
    sum_pi_squared: torch.Tensor | None = None  # (B, R) Σ_v π(v)² per response position (optimal_token_baseline)
    rollout_is_weights: torch.Tensor | None = None  # (B, R) truncated π_old/π_rollout, or None (optimal_token_baseline)
    implicit_rewards: torch.Tensor | None = None  # (B, R) the implicit PRM's token rewards (prime)

    def require(self, name: str, estimator: str) -> torch.Tensor:
        """The optional input ``name``, or a ValueError naming the estimator and the field."""
        tensor = getattr(self, name)
        if tensor is None:
            raise ValueError(
                f"advantage estimator {estimator!r} needs AdvantageInputs.{name} ({_INPUT_DOCS.get(name, name)}); "
                f"got None (declare it in the estimator's needs so the trainer produces it)"
            )
        return tensor  # type: ignore[no-any-return]


class AdvantageOutputs(NamedTuple):
    """An estimator's result; a tuple, so ``advantages, returns = fn(inputs, params)`` reads naturally."""

    advantages: torch.Tensor  # (B, R), 0 on masked tokens
    returns: torch.Tensor  # (B, R), the critic's regression target (gae) or the advantages


# ------------------------------------------------------------------ per-estimator parameters
# Field names are the config's keys (``algorithm.gamma``, ``algorithm.norm_adv_by_std_in_grpo``,
# ...), so ``build_estimator_params`` fills them from the config section without a table.


@dataclass(frozen=True)
class NoParams:
    """For estimators without parameters (rloo, opo, remax, reinforce_plus_plus_baseline)."""


@dataclass(frozen=True)
class GroupNormParams:
    """GRPO-style normalisation: (r − mean_g) / (std_g + ε), or Dr.GRPO's r − mean_g."""

    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6


@dataclass(frozen=True)
class GDPOParams(GroupNormParams):
    """GDPO: group normalisation per reward component, then a weighted sum."""

    gdpo_reward_weights: tuple[float, ...] | None = None  # (K,), None: every component weighs 1


@dataclass(frozen=True)
class DiscountParams:
    gamma: float = 1.0  # discount per policy token, in [0, 1]


@dataclass(frozen=True)
class GAEParams:
    gamma: float = 1.0  # discount per policy token, in [0, 1]
    lam: float = 1.0  # GAE's λ: bias (0, one-step TD) against variance (1, Monte Carlo), in [0, 1]


@dataclass(frozen=True)
class GPGParams:
    f_norm: float = 1.0  # GPG's normalising constant, > 0


@dataclass(frozen=True)
class TokenBaselineParams:
    handle_zero_tail: bool = True  # the longest response's lone tail gets baseline 0


class AdvantageEstimatorFn(Protocol):
    """The signature every registered advantage estimator implements."""

    def __call__(self, inputs: AdvantageInputs, params: Any, /) -> AdvantageOutputs: ...


ADV_ESTIMATORS: dict[str, AdvantageEstimatorFn] = {}

ESTIMATOR_SIGNATURE = "fn(inputs: AdvantageInputs, params) -> (advantages, returns)"

# Inputs the trainer produces only for an estimator that asks for them, because each costs
# work: ``values`` a critic forward, ``reward_baselines`` a greedy rollout and its scoring,
# ``reward_components`` the reward's named extras as a (B, K) tensor, ``old_logprobs`` an actor
# forward, ``sum_pi_squared`` Σ_v π(v)² per token from that forward, ``rollout_is_weights`` the
# rollout correction's importance weights from that forward's logprobs (None, unscaled, when the
# config has no importance weights), ``implicit_rewards`` the implicit PRM's update and forward (PRIME's
# role, ``prime.*``). An estimator declares what it needs in a ``needs`` attribute
# (a tuple of these names, each a field of AdvantageInputs); a ``module:function`` estimator can
# set the same attribute.
OPTIONAL_ESTIMATOR_INPUTS: tuple[str, ...] = (
    "values", "reward_baselines", "reward_components", "old_logprobs", "sum_pi_squared", "rollout_is_weights",
    "implicit_rewards",
)


def register_adv_estimator(
    name: str, needs: tuple[str, ...] = (), params: type = NoParams
) -> Callable[[F], F]:
    """Decorator: add an estimator under ``name`` (the value of ``algorithm.adv_estimator``).

    ``needs`` names the optional inputs (``OPTIONAL_ESTIMATOR_INPUTS``) it cannot run without;
    ``params`` is its frozen parameters dataclass.
    """
    add = register_into(ADV_ESTIMATORS, name, "advantage estimator")

    def decorator(fn: F) -> F:
        fn.needs = tuple(needs)  # type: ignore[attr-defined]
        fn.params = params  # type: ignore[attr-defined]
        estimator_needs(fn)  # validates the names now rather than mid-run
        return add(fn)

    return decorator


def estimator_needs(fn: Callable[..., Any]) -> frozenset[str]:
    """The optional inputs ``fn`` declared in its ``needs`` attribute (empty if none)."""
    needs = frozenset(getattr(fn, "needs", ()) or ())
    unknown = needs - set(OPTIONAL_ESTIMATOR_INPUTS)
    if unknown:
        raise ValueError(
            f"advantage estimator {getattr(fn, '__qualname__', fn)!r} needs unknown inputs {sorted(unknown)}; "
            f"the trainer can produce: {', '.join(OPTIONAL_ESTIMATOR_INPUTS)}"
        )
    return needs


def estimator_params_type(fn: Callable[..., Any]) -> type:
    """The params dataclass ``fn`` declared in its ``params`` attribute (``NoParams`` if none)."""
    params = getattr(fn, "params", NoParams)
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
        raise ValueError(f"advantage estimator {getattr(fn, '__qualname__', fn)!r}: params must be a dataclass type")
    return params


def build_estimator_params(fn: Callable[..., Any], settings: Mapping[str, Any]) -> Any:
    """``fn``'s params record, each field taken from ``settings`` (the config's algorithm section
    as a plain mapping) when present there, else its default."""
    return build_params(estimator_params_type(fn), shared=settings, specific={},
                        what=f"advantage estimator {getattr(fn, '__qualname__', fn)!r}")


def get_adv_estimator(name: str) -> AdvantageEstimatorFn:
    """The estimator registered as ``name``, or a ``module:function`` path to import, its
    declared needs and params checked (``resolve_typed``)."""

    def check_declarations(fn: AdvantageEstimatorFn) -> None:
        estimator_needs(fn)
        estimator_params_type(fn)

    return resolve_typed(ADV_ESTIMATORS, name, "advantage estimator", ESTIMATOR_SIGNATURE, check_declarations)


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


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The inputs checked (``_check_inputs``), and each response's outcome score (its token
    rewards summed, (B,)) in the compute dtype, which comes along."""
    _check_inputs(token_level_rewards, response_mask)
    dtype = _compute_dtype(token_level_rewards.dtype)
    return token_level_rewards.to(dtype).sum(dim=-1), dtype


def _per_sample_input(inputs: AdvantageInputs, key: str, estimator: str, dims: int, expected: str) -> torch.Tensor:
    """The extra input ``key`` that ``estimator`` needs: ``dims``-dimensional with one row per
    sample (else a ValueError saying it must be ``expected``), and finite."""
    value = inputs.require(key, estimator)
    if value.dim() != dims or value.shape[0] != inputs.token_level_rewards.shape[0]:
        raise ValueError(f"{key} must be {expected}, got {tuple(value.shape)}")
    _check_finite_where(key, value, torch.ones_like(value, dtype=torch.bool))
    return value


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


@register_adv_estimator("grpo", params=GroupNormParams)
@torch.no_grad()
def compute_grpo_advantages(inputs: AdvantageInputs, params: GroupNormParams) -> AdvantageOutputs:
    """GRPO outcome advantages: A_i = (r_i − mean_g) / (std_g + ε), broadcast over tokens.

    ``r_i = token_level_rewards[i].sum()``; ``std_g`` is the unbiased (Bessel) std of group g.
    A group of one sample uses mean 0 and std 1 (so A = r/(1 + ε)), as verl does. With
    ``norm_adv_by_std_in_grpo=False`` (Dr.GRPO) A_i = r_i − mean_g. A group whose rewards are
    all equal gets A = 0: it carries no learning signal. Returns are the advantages.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    norm_adv_by_std_in_grpo, epsilon = params.norm_adv_by_std_in_grpo, params.epsilon
    scores, dtype = _outcome_scores(token_level_rewards, response_mask)  # (B,)
    advantage = _grpo_normalise(scores, group_ids, norm_adv_by_std_in_grpo, epsilon)
    advantages = (advantage.unsqueeze(-1) * response_mask.to(dtype)).to(token_level_rewards.dtype)  # (B, R)
    return AdvantageOutputs(advantages, advantages.clone())


def _grpo_normalise(scores: torch.Tensor, group_ids: torch.Tensor, by_std: bool, epsilon: float) -> torch.Tensor:
    """(r − mean_g) / (std_g + ε) per sample (B,), a singleton group using mean 0 and std 1."""
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts, mean, std = _group_stats(scores, inverse, num_groups)
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    advantage = scores - mean
    return advantage / (std + epsilon) if by_std else advantage


@register_adv_estimator("rloo")
@torch.no_grad()
def compute_rloo_advantages(inputs: AdvantageInputs, params: NoParams) -> AdvantageOutputs:
    """RLOO: each sample's baseline is the mean reward of the other n − 1 in its group.

    A_i = r_i − mean_{j≠i} r_j = n/(n − 1)·(r_i − mean_g). A group of one has no other sample,
    so its advantage is the raw score (verl's ``rloo``; ``rloo_vectorized`` gives 0 instead).
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    scores, dtype = _outcome_scores(token_level_rewards, response_mask)  # (B,)
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts, mean, _ = _group_stats(scores, inverse, num_groups)
    leave_one_out = counts / (counts - 1).clamp(min=1) * (scores - mean)
    advantage = torch.where(counts > 1, leave_one_out, scores)
    advantages = (advantage.unsqueeze(-1) * response_mask.to(dtype)).to(token_level_rewards.dtype)  # (B, R)
    return AdvantageOutputs(advantages, advantages.clone())


@register_adv_estimator("reinforce_plus_plus", params=DiscountParams)
@torch.no_grad()
def compute_reinforce_plus_plus_advantages(inputs: AdvantageInputs, params: DiscountParams) -> AdvantageOutputs:
    """REINFORCE++: discounted return-to-go, whitened over every response token of the batch.

    G_t = r_t + γ·G_{t+1} on policy tokens. A token with mask 0 (tool output inside a
    multi-turn response) is not a step of the policy: the running return passes through it
    undiscounted (plus any reward placed on it), so the tokens before a tool call still see
    the final reward. verl 0.9.1 also carries the running return across a masked token, but
    drops a reward placed on one and writes returns 0 there; masked-in advantages agree
    whenever masked tokens carry no reward (always for ordinary right padding).

    advantages = masked_whiten(G, mask) × mask; returns = G (unwhitened).
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    gamma = params.gamma
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
    return AdvantageOutputs(advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype))


# --------------------------------------------------------------------------------------------
# Helpers for the estimators below
# --------------------------------------------------------------------------------------------


def _check_finite_where(name: str, tensor: torch.Tensor, where: torch.Tensor) -> None:
    """Raise naming the rows where ``tensor`` is non-finite at a position ``where`` is True."""
    bad = ~torch.isfinite(tensor) & where
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(f"{name} has non-finite values in rows {rows[:10]}{' ...' if len(rows) > 10 else ''}")


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per-sample scalar (B,) on every masked-in token (B, R), 0 elsewhere, cast to ``dtype``."""
    zero = torch.zeros((), dtype=per_sample.dtype, device=per_sample.device)
    return torch.where(mask != 0, per_sample.unsqueeze(-1), zero).to(dtype)


def _group_mean_or_zero(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean) with a singleton group's mean set to 0, as verl does
    for every estimator whose baseline is a group mean (a lone sample has nothing to compare to)."""
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts, mean, _ = _group_stats(scores, inverse, num_groups)
    return counts, torch.where(counts == 1, torch.zeros_like(mean), mean)


# --------------------------------------------------------------------------------------------
# Critic-based and sequential estimators
# --------------------------------------------------------------------------------------------


@register_adv_estimator("gae", needs=("values",), params=GAEParams)
@torch.no_grad()
def compute_gae_advantages(inputs: AdvantageInputs, params: GAEParams) -> AdvantageOutputs:
    """Generalised advantage estimation (Schulman et al. 2016), verl's ``gae``.

    Backwards over policy tokens: δ_t = r_t + γ·V_{t'} − V_t with t' the next policy token
    (V = 0 after the last one: the response is terminal), A_t = δ_t + γλ·A_{t'}.
    returns = A + V (before whitening: the critic's regression target);
    advantages = masked_whiten(A) over every response token of the batch.

    A token with mask 0 (tool output inside a multi-turn response) is skipped, as in verl
    (v0.5 #2337): the next value and the running advantage pass over it unchanged. verl also
    drops any reward placed on such a token; here it is added, undiscounted, to the reward of
    the policy token before it (a reward after the last tool call would otherwise be lost).
    The two agree whenever masked tokens carry no reward. Advantages and returns are 0 on
    masked tokens, right padding included. verl leaves the carried-over advantage there, and its
    returns are A + V everywhere (on right padding A = 0, so the critic's output at a padded
    position); no loss reads either, and on masked-in tokens the two agree.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    gamma, lam = params.gamma, params.lam
    _check_inputs(token_level_rewards, response_mask)
    values = inputs.require("values", "gae")
    check_same_shape(token_level_rewards=token_level_rewards, values=values)
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    mask = response_mask != 0
    _check_finite_where("values", values, mask)
    dtype = _compute_dtype(token_level_rewards.dtype)
    rewards = token_level_rewards.to(dtype)
    # Values on masked tokens are never read; zero them so nothing non-finite can leak.
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    v = torch.where(mask, values.to(dtype), zero)

    batch_size, length = rewards.shape
    advantages = torch.zeros_like(rewards)  # (B, R)
    running = rewards.new_zeros(batch_size)  # (B,) A of the next policy token
    next_value = rewards.new_zeros(batch_size)  # (B,) V of the next policy token
    pending = rewards.new_zeros(batch_size)  # (B,) rewards on masked tokens after this one
    for t in reversed(range(length)):
        m = mask[:, t]
        reward = rewards[:, t] + pending
        delta = reward + gamma * next_value - v[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_value = torch.where(m, v[:, t], next_value)
        pending = torch.where(m, zero, reward)
        advantages[:, t] = running
    returns = torch.where(mask, advantages + v, zero)
    whitened = torch.where(mask, masked_whiten(advantages, mask.to(dtype)), zero)
    return AdvantageOutputs(whitened.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype))


@register_adv_estimator("remax", needs=("reward_baselines",))
@torch.no_grad()
def compute_remax_advantages(inputs: AdvantageInputs, params: NoParams) -> AdvantageOutputs:
    """ReMax (Li et al. 2023): the baseline is the reward of the greedy response to the prompt.

    returns_t = Σ_{s ≥ t} r_s (undiscounted reward-to-go); A_t = returns_t − b.
    ``reward_baselines`` (B,) is the score of a greedy (temperature 0) response to each
    sample's prompt, repeated for every sample of that prompt. No whitening. verl sums only
    masked-in rewards; here a reward on a masked token also counts for the tokens before it
    (see the module docstring). Both are 0 on masked tokens.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    _check_inputs(token_level_rewards, response_mask)
    baselines = _per_sample_input(inputs, "reward_baselines", "remax", 1,
                                  f"({token_level_rewards.shape[0]},) to match token_level_rewards")
    dtype = _compute_dtype(token_level_rewards.dtype)
    mask = response_mask != 0
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    reward_to_go = token_level_rewards.to(dtype).flip(-1).cumsum(-1).flip(-1)  # (B, R)
    returns = torch.where(mask, reward_to_go, zero)
    advantages = torch.where(mask, reward_to_go - baselines.to(dtype).unsqueeze(-1), zero)
    return AdvantageOutputs(advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype))


# --------------------------------------------------------------------------------------------
# Outcome estimators with group baselines
# --------------------------------------------------------------------------------------------


@register_adv_estimator("grpo_passk", params=GroupNormParams)
@torch.no_grad()
def compute_grpo_passk_advantages(inputs: AdvantageInputs, params: GroupNormParams) -> AdvantageOutputs:
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595), verl's ``grpo_passk``.

    Only the best response of each group is credited: A = r_max − r_second (the reward the
    group would lose without it), divided by (std_g + ε) when ``norm_adv_by_std_in_grpo``;
    every other response gets 0. When several responses share the maximum, the one with the
    lowest batch index is "best" and its advantage is 0 anyway (r_max = r_second). Every group
    needs at least two samples (verl raises too): the rule is undefined for one.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    norm_adv_by_std_in_grpo, epsilon = params.norm_adv_by_std_in_grpo, params.epsilon
    scores, dtype = _outcome_scores(token_level_rewards, response_mask)  # (B,)
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts, _, std = _group_stats(scores, inverse, num_groups)
    if bool((counts < 2).any()):
        lonely = sorted(set(group_ids[counts < 2].tolist()))
        raise ValueError(
            f"grpo_passk needs at least 2 samples per group; group_ids {lonely[:10]}"
            f"{' ...' if len(lonely) > 10 else ''} have 1 (set rollout.n >= 2)"
        )
    batch = scores.shape[0]
    positions = torch.arange(batch, device=scores.device)
    minus_inf = torch.full((num_groups,), float("-inf"), dtype=dtype, device=scores.device)
    group_max = minus_inf.scatter_reduce(0, inverse, scores, "amax")
    is_max = scores == group_max[inverse]
    first_max = torch.full((num_groups,), batch, device=scores.device).scatter_reduce(
        0, inverse, torch.where(is_max, positions, batch), "amin"
    )
    best = positions == first_max[inverse]
    runner_up = minus_inf.scatter_reduce(0, inverse, torch.where(best, float("-inf"), scores), "amax")
    advantage = torch.where(best, scores - runner_up[inverse], torch.zeros_like(scores))
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + epsilon)
    advantages = _broadcast(advantage, response_mask, token_level_rewards.dtype)
    return AdvantageOutputs(advantages, advantages.clone())


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs, params: NoParams) -> AdvantageOutputs:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv 2501.03262).

    r_i − mean_g (0 for a singleton group) on every response token, then whitened over all
    response tokens of the batch (so a long response weighs more in the statistics, as in
    verl). Returns are the advantages.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    scores, dtype = _outcome_scores(token_level_rewards, response_mask)  # (B,)
    _, mean = _group_mean_or_zero(scores, group_ids)
    mask = response_mask != 0
    centred = _broadcast(scores - mean, response_mask, dtype)  # (B, R)
    zero = torch.zeros((), dtype=dtype, device=centred.device)
    advantages = torch.where(mask, masked_whiten(centred, mask.to(dtype)), zero)
    advantages = advantages.to(token_level_rewards.dtype)
    return AdvantageOutputs(advantages, advantages.clone())


@register_adv_estimator("opo")
@torch.no_grad()
def compute_opo_advantages(inputs: AdvantageInputs, params: NoParams) -> AdvantageOutputs:
    """On-Policy RL with the optimal baseline (OPO, arXiv 2505.23585), verl's ``opo``.

    The baseline is the length-weighted group mean b_g = Σ_i |y_i|·r_i / Σ_i |y_i| (|y_i| =
    masked-in tokens of response i), A_i = r_i − b_g. A singleton group has baseline 0 (A = r).
    A group whose responses are all empty also gets baseline 0 (verl divides 0 by 0 there).
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    scores, dtype = _outcome_scores(token_level_rewards, response_mask)  # (B,)
    lengths = (response_mask != 0).sum(dim=-1).to(dtype)  # (B,)
    inverse, num_groups = _group_index(group_ids, scores.shape[0])
    counts = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    weighted = torch.zeros_like(counts).index_add_(0, inverse, lengths * scores)
    total_length = torch.zeros_like(counts).index_add_(0, inverse, lengths)
    baseline = torch.where(
        (counts > 1) & (total_length > 0), weighted / total_length.clamp(min=1), torch.zeros_like(counts)
    )
    advantages = _broadcast(scores - baseline[inverse], response_mask, token_level_rewards.dtype)
    return AdvantageOutputs(advantages, advantages.clone())


@register_adv_estimator("gpg", params=GPGParams)
@torch.no_grad()
def compute_gpg_advantages(inputs: AdvantageInputs, params: GPGParams) -> AdvantageOutputs:
    """Group Policy Gradient (GPG, arXiv 2504.02546), verl's ``gpg``.

    A_i = α·(r_i − mean_g) / f_norm with α = B / max(1, #samples with a non-zero score): when
    most of the batch scored 0, the few informative samples are scaled up so the batch
    gradient keeps its size. No std normalisation; a singleton group has mean 0. verl's
    ``alpha`` argument is always overwritten by this formula, so it is not an input here.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    f_norm = params.f_norm
    _check_inputs(token_level_rewards, response_mask)
    if not f_norm > 0:
        raise ValueError(f"f_norm must be > 0, got {f_norm}")
    dtype = _compute_dtype(token_level_rewards.dtype)
    scores = token_level_rewards.to(dtype).sum(dim=-1)  # (B,)
    _, mean = _group_mean_or_zero(scores, group_ids)
    nonzero = int(torch.count_nonzero(scores))
    alpha = scores.shape[0] / max(1, nonzero)
    advantages = _broadcast(alpha * (scores - mean) / f_norm, response_mask, token_level_rewards.dtype)
    return AdvantageOutputs(advantages, advantages.clone())


@register_adv_estimator("gdpo", needs=("reward_components",), params=GDPOParams)
@torch.no_grad()
def compute_gdpo_advantages(inputs: AdvantageInputs, params: GDPOParams) -> AdvantageOutputs:
    """GDPO, group reward-decoupled normalisation (arXiv 2601.05242), verl's ``gdpo``.

    Each reward component k (a number the reward function returns, named in
    ``algorithm.gdpo_reward_keys``) is GRPO-normalised within its group on its own,
    A_k = (c_k − mean_g) / (std_g + ε) (singleton: mean 0, std 1; Dr.GRPO without the std), so a
    component with a large scale cannot drown the others; then A = Σ_k w_k·A_k (weights
    ``algorithm.gdpo_reward_weights``, default 1) is whitened over every response token of the
    batch and masked. Returns are the advantages. The score (``token_level_rewards``) is not used:
    the components replace it, as in verl.
    """
    token_level_rewards, response_mask = inputs.token_level_rewards, inputs.response_mask
    group_ids = inputs.group_ids
    norm_adv_by_std_in_grpo, epsilon = params.norm_adv_by_std_in_grpo, params.epsilon
    _check_inputs(token_level_rewards, response_mask)
    components = _per_sample_input(inputs, "reward_components", "gdpo", 2, f"({token_level_rewards.shape[0]}, K)")
    dtype = _compute_dtype(token_level_rewards.dtype)
    weights = (torch.ones(components.shape[1], dtype=dtype) if params.gdpo_reward_weights is None
               else torch.tensor(params.gdpo_reward_weights, dtype=torch.float32).to(dtype))
    if weights.shape != (components.shape[1],):
        raise ValueError(f"gdpo_reward_weights must be ({components.shape[1]},), got {tuple(weights.shape)}")
    normalised = [_grpo_normalise(c, group_ids, norm_adv_by_std_in_grpo, epsilon) for c in components.to(dtype).T]
    combined = (torch.stack(normalised, dim=-1) * weights).sum(dim=-1)  # (B,)
    mask = response_mask.to(dtype)
    advantages = (masked_whiten(combined.unsqueeze(-1) * mask, mask) * mask).to(token_level_rewards.dtype)
    return AdvantageOutputs(advantages, advantages.clone())
