"""Score placement, in-reward KL and DAPO's group selection: the pure steps the trainer calls."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms import apply_kl_penalty, place_outcome_rewards, select_varied_groups


def test_each_score_sits_on_its_responses_last_token():
    attention = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # lengths 3, 1, 0 (empty)
    placed = place_outcome_rewards(torch.tensor([2.0, -1.0, 0.5]), attention)
    assert placed.tolist() == [[0.0, 0.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]


def test_placement_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="scores must be"):
        place_outcome_rewards(torch.zeros(2), torch.ones(3, 4))


def test_in_reward_kl_subtracts_beta_times_the_masked_kl():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # k1 = old − ref: [[0.5, -1.0], [0.0, (masked)]]; β = 0.1.
    out = apply_kl_penalty(rewards, old, ref, mask, kind="kl", beta=0.1)
    torch.testing.assert_close(out.token_level_rewards, torch.tensor([[-0.05, 1.1], [0.0, 0.0]]))
    assert out.mean_kl == pytest.approx((0.5 - 1.0 + 0.0) / 3)


def test_varied_groups_are_selected_from_plain_lists():
    # group 7: equal scores (dropped); group 3: varied; group 5: a singleton (kept, as verl).
    assert select_varied_groups([1.0, 1.0, 0.0, 1.0, 0.0], [7, 7, 3, 3, 5]) == {3, 5}
