"""PRIME's maths (hybridflow.algorithms.prime) against hand-worked numbers, and its estimator against a literal
transcription of verl's recipe (contiguous groups of n, reward sources RLOO'd apart, returns summed backwards,
whitened)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import AdvantageInputs, get_adv_estimator
from hybridflow.algorithms.core import masked_whiten
from hybridflow.algorithms.prime import (
    PrimeParams,
    compute_implicit_token_rewards,
    implicit_prm_accuracy,
    implicit_prm_loss,
    implicit_prm_metrics,
    implicit_prm_pair_accuracy,
    normalise_implicit_rewards,
    outcome_labels,
)


def test_token_rewards_are_beta_times_the_log_ratio_on_the_mask() -> None:
    lp, ref = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.0, -2.0]])
    got = compute_implicit_token_rewards(lp, ref, torch.tensor([[1.0, 1.0, 0.0]]), beta=0.5)
    assert torch.allclose(got, torch.tensor([[0.25, 0.0, 0.0]]))


def test_the_loss_is_the_cross_entropy_of_sigmoid_of_the_summed_reward_and_its_gradient() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.5, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, sequence = implicit_prm_loss(lp, ref, mask, torch.tensor([1.0, 0.0]), beta=0.5)
    assert torch.allclose(sequence, torch.tensor([0.25, 0.25]))
    # R = 0.25: -log sigmoid(0.25) = log(1 + e^-0.25); the wrong answer's log(1 + e^0.25).
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(-0.25)), math.log(1 + math.exp(0.25))], abs=1e-6)
    loss.sum().backward()
    # dL/dlog phi_t = beta * (sigmoid(R) - label) * m_t
    s = 1 / (1 + math.exp(-0.25))
    expected = torch.tensor([[0.5 * (s - 1), 0.5 * (s - 1), 0.0], [0.5 * s, 0.5 * s, 0.0]])
    assert torch.allclose(lp.grad, expected, atol=1e-6)


def test_labels_and_accuracy() -> None:
    assert outcome_labels(torch.tensor([1.0, 0.1, 0.5, 0.9]), 0.5).tolist() == [1.0, 0.0, 0.0, 1.0]
    # Verdicts R > 0: [1, 0, 0, 1] against labels [1, 0, 1, 0]: two of four.
    assert implicit_prm_accuracy(torch.tensor([0.3, -0.1, 0.0, 2.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])) == 0.5


def test_pair_accuracy_is_verls() -> None:
    rewards = torch.tensor([1.0, -1.0, 0.5, 0.2, 0.4, 3.0, 1.0, 0.0, 0.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3])
    # group 0: both differing pairs ordered right (1); group 1: its one pair wrong (0); group 2: no pair with
    # differing labels (1/2); group 3: a tie with labels (0, 1) agrees under verl's rule (1).
    assert implicit_prm_pair_accuracy(rewards, labels, groups) == pytest.approx((1 + 0 + 0.5 + 1) / 4)


def test_batch_norm_divides_by_the_largest_return_to_go() -> None:
    r = torch.tensor([[1.0, 2.0, 0.0], [-4.0, 1.0, 0.0]])  # returns-to-go [3, 2, 0] and [-3, 1, 0]
    assert torch.allclose(normalise_implicit_rewards(r, "batch_norm"), r / (3 + 1e-6))
    assert normalise_implicit_rewards(r, "none") is r
    assert torch.equal(normalise_implicit_rewards(torch.zeros(2, 3), "batch_norm"), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="batch_norm"):
        normalise_implicit_rewards(r, "layer")


def _inputs(outcome: list[float], implicit: torch.Tensor, mask: torch.Tensor, groups: list[int]) -> AdvantageInputs:
    token = torch.zeros_like(mask)
    last = mask.sum(dim=-1).long() - 1
    token[torch.arange(len(outcome)), last] = torch.tensor(outcome)
    return AdvantageInputs(token_level_rewards=token, response_mask=mask, group_ids=torch.tensor(groups),
                           implicit_rewards=implicit)


def test_prime_advantages_by_hand() -> None:
    implicit = torch.tensor([[0.3, 0.1], [0.0, -0.2], [0.4, 9.0]])  # 9.0 sits on a masked token: ignored
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv, ret = get_adv_estimator("prime")(_inputs([1.0, 0.0, 0.0], implicit, mask, [7, 7, 7]),
                                         PrimeParams(reward_dpo_coef=2.0, reward_gt_coef=1.0))
    # Token means [0.2, -0.1, 0.4] (sum 0.5): loo = 1.5 r - 0.25 -> [[0.2, -0.1], [-0.25, -0.55], [0.35, -]];
    # summed backwards [[0.1, -0.1], [-0.8, -0.55], [0.35]]; outcome loo [1, -0.5, -0.5].
    expected = torch.tensor([[2 * 0.1 + 1, 2 * -0.1 + 1], [2 * -0.8 - 0.5, 2 * -0.55 - 0.5], [2 * 0.35 - 0.5, 0.0]])
    assert torch.allclose(ret, expected, atol=1e-6)
    # Whitened over the five masked-in values [1.2, 0.8, -2.1, -1.6, 0.2]: mean -0.3, unbiased var 2.16.
    std = math.sqrt(2.16 + 1e-8)
    want = torch.tensor([[1.5, 1.1], [-1.8, -1.3], [0.5, 0.0]]) / std
    assert torch.allclose(adv, want, atol=1e-6)


def test_a_coefficient_of_zero_drops_its_source_and_a_lone_sample_keeps_its_rewards() -> None:
    implicit = torch.tensor([[0.5, 0.5], [0.2, 0.0]])
    mask = torch.ones(2, 2)
    estimator = get_adv_estimator("prime")
    _, only_outcome = estimator(_inputs([1.0, 0.0], implicit, mask, [0, 0]), PrimeParams(0.0, 1.0))
    assert torch.allclose(only_outcome, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    # Two groups of one: no other sample to be a baseline, so each keeps its own values (as rloo).
    _, lone = estimator(_inputs([1.0, 0.0], implicit, mask, [0, 1]), PrimeParams(1.0, 1.0))
    assert torch.allclose(lone, torch.tensor([[2.0, 1.5], [0.2, 0.0]]))


def _verl_prime(implicit: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, n: int, dpo: float,
                gt: float) -> torch.Tensor:
    """verl's ``compute_rloo_advantage_return`` transcribed: each source's masked RLOO over contiguous groups of
    n, weighted, summed, returns summed backwards, whitened."""

    def masked_rloo(reward: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        reward = reward.clone()
        reward[~m] = 0
        for start in range(0, reward.shape[0], n):
            means = torch.stack([reward[p][m[p]].mean() for p in range(start, start + n)])
            baseline = means.sum() / (n - 1)
            block, bm = reward[start : start + n], m[start : start + n]
            block[bm] = block[bm] * (n / (n - 1)) - baseline
        return reward

    last = torch.zeros_like(mask, dtype=torch.bool)
    lengths = mask.sum(-1).long()
    last[torch.arange(mask.shape[0]), lengths - 1] = True
    outcome_tokens = torch.zeros_like(mask)
    outcome_tokens[last] = outcome
    final = masked_rloo(implicit, mask.bool()) * dpo + masked_rloo(outcome_tokens, last) * gt
    returns = (final * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return masked_whiten(returns, mask) * mask


def test_prime_advantages_equal_verls_recipe_on_random_batches() -> None:
    generator = torch.Generator().manual_seed(0)
    n, groups, length = 4, 3, 6
    batch = n * groups
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()  # right-padded responses
    implicit = torch.randn(batch, length, generator=generator, dtype=torch.float64).float() * mask
    outcome = torch.randint(0, 2, (batch,), generator=generator).float()
    adv, _ = get_adv_estimator("prime")(_inputs(outcome.tolist(), implicit, mask, [i // n for i in range(batch)]),
                                        PrimeParams(5.0, 5.0))
    assert torch.allclose(adv, _verl_prime(implicit, outcome, mask, n, 5.0, 5.0), atol=1e-5)
    # The group ids, not the order, define the groups: shuffled rows give the shuffled advantages.
    order = torch.randperm(batch, generator=generator)
    shuffled, _ = get_adv_estimator("prime")(
        _inputs(outcome[order].tolist(), implicit[order], mask[order], [int(i) // n for i in order]), PrimeParams())
    assert torch.allclose(shuffled, adv[order], atol=1e-5)


def test_the_estimator_refuses_to_run_without_the_implicit_rewards() -> None:
    mask = torch.ones(2, 2)
    inputs = AdvantageInputs(token_level_rewards=torch.zeros(2, 2), response_mask=mask, group_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="implicit_rewards"):
        get_adv_estimator("prime")(inputs, PrimeParams())


def test_the_metrics_of_a_steps_rewards() -> None:
    rewards = torch.tensor([[0.5, 0.5], [-0.2, 0.0], [0.1, 0.0], [0.3, 0.0]])  # sequence rewards 1, -0.2, 0.1, 0.3
    metrics = implicit_prm_metrics(rewards, torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), 0.5)
    assert metrics == pytest.approx({"prime/pair_acc": 1.0, "prime/implicit_reward/mean": 0.3,
                                     "prime/label/mean": 0.5})
