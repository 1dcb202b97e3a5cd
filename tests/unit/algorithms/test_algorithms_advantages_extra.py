"""gae, remax, grpo_passk, reinforce_plus_plus_baseline, opo, gpg against hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.advantages import ADV_ESTIMATORS
from _algorithm_calls import estimate

torch.set_num_threads(1)
EPS = 1e-6
NAN = float("nan")


def whiten(raw: list[float]) -> torch.Tensor:
    """(x − mean)·rsqrt(unbiased var + 1e-8) of a flat list: the expected batch whitening."""
    x = torch.tensor(raw, dtype=torch.float64)
    return ((x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)).float()


def run(name: str, rewards: torch.Tensor, mask: torch.Tensor, ids: list[int] | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    ids_t = torch.tensor(ids) if ids is not None else torch.arange(rewards.shape[0])
    return estimate(name, token_level_rewards=rewards, response_mask=mask, group_ids=ids_t, **kwargs)


def test_registry_lists_every_estimator() -> None:
    assert sorted(ADV_ESTIMATORS) == [
        "gae",
        "gdpo",
        "gpg",
        "grpo",
        "grpo_passk",
        "opo",
        "optimal_token_baseline",
        "prime",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
        "tir_optimal_token_baseline",
    ]


# --------------------------------------------------------------------------------------------
# gae
# --------------------------------------------------------------------------------------------

# γ = λ = 0.5, so γλ = 0.25.
#   row 0, all policy tokens, r = (0, 0, 1), V = (0.5, 0.25, 0.5):
#     t2: δ = 1 + 0.5·0 − 0.5 = 0.5;            A2 = 0.5
#     t1: δ = 0 + 0.5·0.5 − 0.25 = 0;           A1 = 0 + 0.25·0.5 = 0.125
#     t0: δ = 0 + 0.5·0.25 − 0.5 = −0.375;      A0 = −0.375 + 0.25·0.125 = −0.34375
#     returns = A + V = (0.15625, 0.375, 1.0)
#   row 1, t1 is a tool token (mask 0, its value 9 is never read), r = (0, 0, 2):
#     t2: δ = 2 − 0.5 = 1.5;                    A2 = 1.5, next value 0.5
#     t1: skipped, A and next value carry over
#     t0: δ = 0 + 0.5·0.5 − 1.0 = −0.75;        A0 = −0.75 + 0.25·1.5 = −0.375
#     returns = (0.625, 0, 2.0)
#   row 2, the reward sits on the trailing masked token (value nan there):
#     t2: masked, its reward 1 waits for the policy token before it
#     t1: δ = (0 + 1) + 0.5·0 − 0.5 = 0.5;      A1 = 0.5
#     t0: δ = 0 + 0.5·0.5 − 0.5 = −0.25;        A0 = −0.25 + 0.25·0.5 = −0.125
#     returns = (0.375, 1.0, 0)
GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0], [0.0, 0.0, 1.0]])
GAE_VALUES = torch.tensor([[0.5, 0.25, 0.5], [1.0, 9.0, 0.5], [0.5, 0.5, NAN]])
GAE_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])


def test_gae_hand_worked_with_masked_middle_and_trailing_tokens() -> None:
    advantages, returns = run("gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES, gamma=0.5, lam=0.5)
    expected_returns = torch.tensor([[0.15625, 0.375, 1.0], [0.625, 0.0, 2.0], [0.375, 1.0, 0.0]])
    torch.testing.assert_close(returns, expected_returns)
    # whitened over the 7 policy tokens (row-major order)
    white = whiten([-0.34375, 0.125, 0.5, -0.375, 1.5, -0.125, 0.5])
    expected = torch.zeros(3, 3)
    expected[GAE_MASK != 0] = white
    torch.testing.assert_close(advantages, expected)


def test_gae_matches_verl_recursion_when_masked_tokens_carry_no_reward() -> None:
    """verl's loop, written out: mask-weighted carry of next value and running advantage."""
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 9, generator=generator)
    values = torch.randn(6, 9, generator=generator)
    mask = (torch.rand(6, 9, generator=generator) > 0.3).float()
    rewards = rewards * mask
    gamma, lam = 0.9, 0.8
    next_value = torch.zeros(6)
    running = torch.zeros(6)
    raw = torch.zeros(6, 9)
    for t in reversed(range(9)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running = candidate * mask[:, t] + (1 - mask[:, t]) * running
        raw[:, t] = running
    mean = (raw * mask).sum() / mask.sum()
    var = ((raw - mean) ** 2 * mask).sum() / (mask.sum() - 1)
    verl_advantages = (raw - mean) * torch.rsqrt(var + 1e-8)

    advantages, returns = run("gae", rewards, mask, values=values, gamma=gamma, lam=lam)
    torch.testing.assert_close(advantages, verl_advantages * mask)
    torch.testing.assert_close(returns, (raw + values) * mask)


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5, 2.0]])
    _, returns = run("gae", rewards, torch.ones(1, 4), values=values, gamma=1.0, lam=1.0)
    # λ = 1 telescopes: A_t = Σ_{s≥t} r_s − V_t, so returns = reward-to-go (3, 3, 2, 2)
    torch.testing.assert_close(returns, torch.tensor([[3.0, 3.0, 2.0, 2.0]]))


def test_gae_needs_values_of_the_right_shape() -> None:
    with pytest.raises(ValueError, match=r"'gae' needs AdvantageInputs.values"):
        run("gae", GAE_REWARDS, GAE_MASK)
    with pytest.raises(ValueError, match=r"shape mismatch: token_level_rewards \(3, 3\), values \(3, 2\)"):
        run("gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES[:, :2])
    with pytest.raises(ValueError, match=r"values has non-finite values in rows \[1\]"):
        bad = GAE_VALUES.clone()
        bad[1, 0] = NAN  # masked-in: a broken critic must not pass silently
        run("gae", GAE_REWARDS, GAE_MASK, values=bad)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        run("gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES, lam=1.5)


# --------------------------------------------------------------------------------------------
# remax
# --------------------------------------------------------------------------------------------


def test_remax_reward_to_go_minus_greedy_baseline() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    baselines = torch.tensor([0.25, 1.0, 1.0])
    advantages, returns = run("remax", rewards, mask, reward_baselines=baselines)
    # row 0: reward-to-go (1, 1, 1), minus 0.25 → 0.75 everywhere
    # row 1: reward-to-go (1, 1, ·) − 1 → 0; padding 0
    # row 2: the reward 3 sits on a masked token; it still reaches t0: 3 − 1 = 2
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.75, 0.75, 0.75], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]))


def test_remax_needs_one_baseline_per_sample() -> None:
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"'remax' needs AdvantageInputs.reward_baselines"):
        run("remax", rewards, mask)
    with pytest.raises(ValueError, match=r"reward_baselines must be \(2,\)"):
        run("remax", rewards, mask, reward_baselines=torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"reward_baselines has non-finite values in rows \[1\]"):
        run("remax", rewards, mask, reward_baselines=torch.tensor([0.0, NAN]))


# --------------------------------------------------------------------------------------------
# grpo_passk
# --------------------------------------------------------------------------------------------


def test_grpo_passk_credits_only_the_best_response() -> None:
    rewards = torch.zeros(5, 2)
    rewards[:, -1] = torch.tensor([1.0, 5.0, 3.0, 5.0, 2.0])
    mask = torch.ones(5, 2)
    ids = [7, 2, 7, 2, 7]
    advantages, returns = run("grpo_passk", rewards, mask, ids)
    # group 7: scores 1, 3, 2 → best is sample 2 (3), runner-up 2: A = 1 / (std + ε),
    #   std = sqrt(((1−2)² + (3−2)² + 0)/2) = 1
    # group 2: scores 5, 5 tie → the first (sample 1) is "best" with 5 − 5 = 0
    expected = torch.tensor([0.0, 0.0, 1.0 / (1.0 + EPS), 0.0, 0.0])
    torch.testing.assert_close(advantages, expected[:, None] * mask)
    torch.testing.assert_close(returns, advantages)
    unnormalised, _ = run("grpo_passk", rewards, mask, ids, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(unnormalised[:, 0], torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]))


def test_grpo_passk_refuses_singleton_groups() -> None:
    with pytest.raises(ValueError, match=r"at least 2 samples per group; group_ids \[4\] have 1"):
        run("grpo_passk", torch.ones(3, 2), torch.ones(3, 2), [0, 0, 4])


# --------------------------------------------------------------------------------------------
# reinforce_plus_plus_baseline, opo, gpg
# --------------------------------------------------------------------------------------------


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_tokens() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    advantages, returns = run("reinforce_plus_plus_baseline", rewards, mask, [0, 0, 1])
    # group 0: scores 1, 0 → centred 0.5, −0.5; group 1 is a singleton: mean 0 → 2
    # tokens: 0.5, 0.5 | −0.5 | 2 → mean 0.625, unbiased var 3.1875/3 = 1.0625
    white = whiten([0.5, 0.5, -0.5, 2.0])
    torch.testing.assert_close(white[0], torch.tensor(-0.125 / 1.0625**0.5))  # the hand value
    expected = torch.tensor([[white[0], white[1]], [white[2], 0.0], [white[3], 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, advantages)


def test_opo_length_weighted_baseline() -> None:
    rewards = torch.zeros(6, 3)
    rewards[:, 0] = torch.tensor([1.0, 0.0, 0.5, 4.0, 2.0, 3.0])
    mask = torch.zeros(6, 3)
    for i, length in enumerate([1, 3, 2, 2, 0, 0]):
        mask[i, :length] = 1.0
    advantages, _ = run("opo", rewards, mask, [0, 0, 0, 1, 2, 2])
    # group 0: lengths 1, 3, 2 → b = (1·1 + 3·0 + 2·0.5)/6 = 1/3 → A = 2/3, −1/3, 1/6
    # group 1: singleton → b = 0 → A = 4
    # group 2: both responses empty → b = 0, and the mask zeroes everything
    torch.testing.assert_close(advantages[:4, 0], torch.tensor([2 / 3, -1 / 3, 1 / 6, 4.0]))
    torch.testing.assert_close(advantages, advantages * mask)
    assert advantages[4:].abs().sum() == 0


def test_gpg_scales_by_the_fraction_of_nonzero_scores() -> None:
    rewards = torch.zeros(5, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0])
    mask = torch.ones(5, 2)
    advantages, returns = run("gpg", rewards, mask, [0, 0, 1, 1, 9])
    # 3 of 5 scores are non-zero → α = 5/3; group means 0.5, 0.5; id 9 is a singleton (mean 0)
    alpha = 5 / 3
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 3.0]) * alpha
    torch.testing.assert_close(advantages[:, 0], expected)
    torch.testing.assert_close(returns, advantages)
    halved, _ = run("gpg", rewards, mask, [0, 0, 1, 1, 9], f_norm=2.0)
    torch.testing.assert_close(halved, advantages / 2)
    with pytest.raises(ValueError, match="f_norm must be > 0"):
        run("gpg", rewards, mask, [0, 0, 1, 1, 9], f_norm=0.0)
    zeros, _ = run("gpg", torch.zeros(2, 2), torch.ones(2, 2), [0, 0])  # α = 2/max(1, 0): no nan
    assert zeros.abs().sum() == 0
