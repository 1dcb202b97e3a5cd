"""Advantage estimators against hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.advantages import ADV_ESTIMATORS, get_adv_estimator
from hybridflow.algorithms.core import UnknownNameError
from _algorithm_calls import estimate

torch.set_num_threads(1)
EPS = 1e-6


def outcome_batch(scores: list[float], lengths: list[int], width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards on the last valid token of right-padded responses, and the matching mask."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1.0
        rewards[i, length - 1] = score
    return rewards, mask


def run(
    name: str, rewards: torch.Tensor, mask: torch.Tensor, ids: list[int], **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    return estimate(name, 
        token_level_rewards=rewards, response_mask=mask, group_ids=torch.tensor(ids), **kwargs
    )


# Two interleaved groups with arbitrary (non-contiguous) ids:
#   group 10: scores 1, 0, 0.5 → mean 0.5, unbiased var (0.25 + 0.25 + 0)/2 = 0.25, std 0.5
#   group  3: scores 2, 4, 6   → mean 4,   unbiased var (4 + 0 + 4)/2 = 4,       std 2
SCORES = [1.0, 2.0, 0.0, 4.0, 0.5, 6.0]
IDS = [10, 3, 10, 3, 10, 3]
LENGTHS = [1, 2, 3, 4, 2, 3]


def test_grpo_two_groups() -> None:
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, returns = run("grpo", rewards, mask, IDS)
    per_sample = torch.tensor(
        [
            (1.0 - 0.5) / (0.5 + EPS),
            (2.0 - 4.0) / (2.0 + EPS),
            (0.0 - 0.5) / (0.5 + EPS),
            (4.0 - 4.0) / (2.0 + EPS),
            (0.5 - 0.5) / (0.5 + EPS),
            (6.0 - 4.0) / (2.0 + EPS),
        ]
    )
    torch.testing.assert_close(advantages, per_sample[:, None] * mask)
    torch.testing.assert_close(returns, advantages)
    assert advantages[0, 1:].abs().sum() == 0  # padding stays 0


def test_grpo_matches_a_per_group_loop_with_torch_std() -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (40,), generator=generator) * 7 - 11  # negative, sparse ids
    scores = torch.randn(40, generator=generator)
    rewards = torch.zeros(40, 3)
    rewards[:, -1] = scores
    advantages, _ = run("grpo", rewards, torch.ones(40, 3), ids.tolist())
    for gid in ids.unique():
        members = ids == gid
        group = scores[members]
        mean, std = (group.mean(), group.std()) if group.numel() > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        torch.testing.assert_close(advantages[members, 0], (group - mean) / (std + EPS))


def test_dr_grpo_only_subtracts_the_group_mean() -> None:
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = run("grpo", rewards, mask, IDS, norm_adv_by_std_in_grpo=False)
    # r − mean: group 10 → 0.5, −0.5, 0; group 3 → −2, 0, 2
    per_sample = torch.tensor([0.5, -2.0, -0.5, 0.0, 0.0, 2.0])
    torch.testing.assert_close(advantages, per_sample[:, None] * mask)


def test_grpo_singleton_group_uses_mean_zero_std_one() -> None:
    rewards, mask = outcome_batch([3.0, 1.0, 0.0], [2, 2, 2])
    advantages, _ = run("grpo", rewards, mask, [5, 8, 8])
    # singleton: 3/(1 + 1e-6); pair (1, 0): mean 0.5, std sqrt(0.5) ≈ 0.70711
    std = 0.5**0.5
    expected = torch.tensor([3.0 / (1 + EPS), 0.5 / (std + EPS), -0.5 / (std + EPS)])
    torch.testing.assert_close(advantages[:, 0], expected)
    dr, _ = run("grpo", rewards, mask, [5, 8, 8], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(dr[:, 0], torch.tensor([3.0, 0.5, -0.5]))


def test_grpo_zero_variance_group_and_empty_masks_give_finite_zeros() -> None:
    rewards, mask = outcome_batch([1.0, 1.0, 1.0, 0.0], [2, 1, 3, 1])
    mask[3] = 0.0  # an empty (fully masked) response
    advantages, _ = run("grpo", rewards, mask, [0, 0, 0, 1])
    assert torch.isfinite(advantages).all()
    assert advantages.abs().max().item() == 0.0


def test_rloo_leave_one_out_and_singleton() -> None:
    rewards, mask = outcome_batch([1.0, 0.0, 0.5, 7.0], [1, 2, 3, 2])
    advantages, returns = run("rloo", rewards, mask, [4, 4, 4, 9])
    # group 4 (n = 3, mean 0.5): 3/2·(r − 0.5) = 0.75, −0.75, 0
    #   check: 1 − mean(0, 0.5) = 0.75;  0 − mean(1, 0.5) = −0.75
    # group 9 is a singleton: raw score 7
    per_sample = torch.tensor([0.75, -0.75, 0.0, 7.0])
    torch.testing.assert_close(advantages, per_sample[:, None] * mask)
    torch.testing.assert_close(returns, advantages)


def test_reinforce_plus_plus_discount_and_masked_middle_token() -> None:
    gamma = 0.5
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    advantages, returns = run("reinforce_plus_plus", rewards, mask, [0, 1], gamma=gamma)
    # row 0, backwards: t3 = 1; t2 = 0 + 0.5·1 = 0.5; t1 (masked) carries 0.5 undiscounted;
    #        t0 = 0 + 0.5·0.5 = 0.25
    # row 1: t3 = t2 = 0 (padding); t1 = 2; t0 = 0.5·2 = 1
    expected_returns = torch.tensor([[0.25, 0.5, 0.5, 1.0], [1.0, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(returns, expected_returns)
    # whitening over the 5 policy tokens 0.25, 0.5, 1, 1, 2: mean 0.95,
    # squared deviations 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8, unbiased var 0.45
    scale = (0.45 + 1e-8) ** -0.5  # ≈ 1.490712
    expected = torch.tensor([[0.25 - 0.95, 0.0, 0.5 - 0.95, 1.0 - 0.95], [1.0 - 0.95, 2.0 - 0.95, 0.0, 0.0]]) * scale
    torch.testing.assert_close(advantages, expected * mask)
    torch.testing.assert_close(advantages[0, 0], torch.tensor(-1.043498), atol=1e-5, rtol=0)


def test_reinforce_plus_plus_degenerate_batches_stay_finite() -> None:
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    for mask in (torch.zeros(2, 2), torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.ones(2, 2)):
        advantages, returns = run("reinforce_plus_plus", rewards * mask, mask, [0, 1])
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    advantages, _ = run("reinforce_plus_plus", torch.ones(2, 2), torch.ones(2, 2), [0, 1], gamma=0.0)
    assert advantages.abs().max().item() == 0.0  # all returns equal 1 → whitened to 0


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_takes_the_uniform_signature(name: str) -> None:
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 1.0], [1, 2, 3, 4])
    advantages, returns = estimate(name, 
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 1, 1]),
        gamma=1.0,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        epsilon=1e-6,
        values=torch.zeros(4, 4),  # inputs only some estimators need (gae, remax, gdpo, the token baselines, prime)
        reward_baselines=torch.zeros(4),
        reward_components=torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
        old_logprobs=torch.full((4, 4), -0.5),
        sum_pi_squared=torch.full((4, 4), 0.4),
        implicit_rewards=torch.full((4, 4), 0.1),
        f_norm=1.0,
        an_input_no_estimator_knows=object(),
    )
    assert advantages.shape == returns.shape == rewards.shape
    assert not advantages.requires_grad
    assert torch.isfinite(advantages).all()


def test_bad_inputs_are_named() -> None:
    rewards, mask = outcome_batch([1.0, 0.0], [1, 2])
    with pytest.raises(ValueError, match=r"shape mismatch: token_level_rewards \(2, 4\), response_mask \(2, 3\)"):
        run("grpo", rewards, mask[:, :3], [0, 0])
    with pytest.raises(ValueError, match=r"group_ids must be \(2,\)"):
        run("grpo", rewards, mask, [0, 0, 0])
    with pytest.raises(ValueError, match="integer tensor"):
        estimate("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0.0, 1.0]))
    rewards[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite values in rows \[1\]"):
        run("rloo", rewards, mask, [0, 0])


def test_unknown_estimator_lists_names_and_suggests() -> None:
    expected = r"unknown advantage estimator 'gpro'; expected one of: .*grpo.*Did you mean 'grpo'\?"
    with pytest.raises(UnknownNameError, match=expected):
        get_adv_estimator("gpro")
    with pytest.raises(KeyError, match="reinforce_plus_plus"):
        get_adv_estimator("reinforce++")
