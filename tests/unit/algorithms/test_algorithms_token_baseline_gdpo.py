"""gdpo, optimal_token_baseline and tir_optimal_token_baseline against hand-worked numbers."""

from __future__ import annotations

from functools import partial

import math

import pytest
import torch

from _algorithm_calls import estimate

torch.set_num_threads(1)


def approx(values: list[list[float]]):  # type: ignore[no-untyped-def]
    return pytest.approx(torch.tensor(values).flatten().tolist(), abs=1e-5)


# --------------------------------------------------------------------------------------------
# gdpo
# --------------------------------------------------------------------------------------------


def gdpo(components: list[list[float]], mask: torch.Tensor, ids: list[int], **kw):  # type: ignore[no-untyped-def]
    return estimate("gdpo", 
        token_level_rewards=torch.zeros_like(mask), response_mask=mask, group_ids=torch.tensor(ids),
        reward_components=torch.tensor(components), **kw,
    )


def test_gdpo_normalises_each_component_in_its_group_then_sums_and_whitens():
    # Groups {0, 1} and {2, 3}. Component 1: [1, 0 | 1, 1]; component 2: [0, 2 | 4, 0].
    # Group-normalised (n = 2: std = |x - y| / sqrt 2): c1 -> [+s, -s | 0, 0], c2 -> [-s, +s | +s, -s]
    # with s = 1/sqrt 2. Weights (1, 2): [-s, +s, 2s, -2s]; batch whitening (unbiased var 5/3):
    # [-sqrt(3/10), sqrt(3/10), sqrt(6/5), -sqrt(6/5)].
    mask = torch.ones(4, 1)
    adv, returns = gdpo([[1, 0], [0, 2], [1, 4], [1, 0]], mask, [0, 0, 1, 1],
                        reward_component_weights=torch.tensor([1.0, 2.0]))
    a, b = math.sqrt(3 / 10), math.sqrt(6 / 5)
    assert adv.flatten().tolist() == pytest.approx([-a, a, b, -b], abs=1e-5)
    assert torch.equal(adv, returns)


def test_gdpo_ignores_the_score_and_masks_padding():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    estimator = partial(estimate, "gdpo")
    first, _ = estimator(token_level_rewards=torch.zeros(2, 2), response_mask=mask, group_ids=torch.tensor([0, 0]),
                         reward_components=torch.tensor([[1.0], [0.0]]))
    second, _ = estimator(token_level_rewards=torch.ones(2, 2), response_mask=mask, group_ids=torch.tensor([0, 0]),
                          reward_components=torch.tensor([[1.0], [0.0]]))
    assert torch.equal(first, second)
    assert first[1, 1] == 0
    assert first[0, 0] > 0 > first[1, 0]


def test_gdpo_one_component_is_grpo_then_whitened_and_names_a_missing_input():
    mask = torch.ones(3, 1)
    adv, _ = gdpo([[1.0], [0.0], [0.5]], mask, [0, 0, 1], norm_adv_by_std_in_grpo=False)
    # Dr.GRPO per group: [0.5, -0.5 | 0.5 (singleton: mean 0)], then whitened: mean 1/6, var 1/3.
    expected = [(x - 1 / 6) / math.sqrt(1 / 3) for x in (0.5, -0.5, 0.5)]
    assert adv.flatten().tolist() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="gdpo' needs AdvantageInputs.reward_components"):
        estimate("gdpo", token_level_rewards=mask, response_mask=mask, group_ids=torch.tensor([0, 0, 1]))


# --------------------------------------------------------------------------------------------
# optimal token baselines
# --------------------------------------------------------------------------------------------


def otb(name: str, rewards: list[list[float]], mask: list[list[float]], probs: list[list[float]], ids: list[int],
        **kw):  # type: ignore[no-untyped-def]
    """Σπ² = 0.5 everywhere, so w = 1 − 2π + 0.5: 0.5 for π = 0.5, 1.0 for π = 0.25."""
    m = torch.tensor(mask, dtype=torch.float32)
    return estimate(name, 
        token_level_rewards=torch.tensor(rewards, dtype=torch.float32), response_mask=m, group_ids=torch.tensor(ids),
        old_logprobs=torch.tensor(probs, dtype=torch.float32).log(), sum_pi_squared=torch.full_like(m, 0.5), **kw,
    )


# Sample 0: three tokens, π = (0.5, 0.25, 0.5), reward 1 at the end. Sample 1: two tokens,
# π = (0.25, 0.5), reward 0. W_0 = (0.5, 1.5, 2.0), W_1 = (1.0, 1.5); G_0 = 1, G_1 = 0.
# B_0 = (1·0.5) / (0.5 + 1.0) = 1/3, B_1 = (1·1.5) / (1.5 + 1.5) = 1/2, B_2 = 1 (sample 0 alone).
TWO = dict(rewards=[[0, 0, 1], [0, 0, 0]], mask=[[1, 1, 1], [1, 1, 0]], probs=[[0.5, 0.25, 0.5], [0.25, 0.5, 1]])


def test_optimal_token_baseline_weights_returns_by_accumulated_path_variance():
    adv, returns = otb("optimal_token_baseline", **TWO, ids=[0, 0], handle_zero_tail=False)
    assert adv.flatten().tolist() == approx([[2 / 3, 1 / 2, 0], [-1 / 3, -1 / 2, 0]])
    assert returns.flatten().tolist() == approx([[1, 1, 1], [0, 0, 0]])


def test_the_zero_tail_gives_the_one_longest_response_its_own_return_past_the_others():
    adv, _ = otb("optimal_token_baseline", **TWO, ids=[0, 0])  # handle_zero_tail defaults to True, as verl
    assert adv.flatten().tolist() == approx([[2 / 3, 1 / 2, 1], [-1 / 3, -1 / 2, 0]])


def test_a_lone_sample_has_no_baseline_and_groups_do_not_mix():
    adv, _ = otb("optimal_token_baseline", rewards=[[0, 0, 1], [0, 0, 0], [2, 0, 0]],
                 mask=[[1, 1, 1], [1, 1, 0], [1, 0, 0]], probs=[[0.5, 0.25, 0.5], [0.25, 0.5, 1], [0.5, 1, 1]],
                 ids=[7, 7, 3])
    assert adv.flatten().tolist() == approx([[2 / 3, 1 / 2, 1], [-1 / 3, -1 / 2, 0], [2, 0, 0]])


# Multi-turn: sample 0's middle token is tool output (mask 0). Its policy tokens have
# π = (0.5, 0.25) -> W = (0.5, 1.5); sample 1's (0.25, 0.5) -> W = (1.0, 1.5).
TOOL = dict(rewards=[[0, 0, 1], [0, 0, 0]], mask=[[1, 0, 1], [1, 1, 0]], probs=[[0.5, 1, 0.25], [0.25, 0.5, 1]])


def test_tir_variant_shares_a_baseline_between_the_kth_policy_tokens():
    # k = 0: (1·0.5) / (0.5 + 1.0) = 1/3; k = 1: (1·1.5) / (1.5 + 1.5) = 1/2.
    adv, _ = otb("tir_optimal_token_baseline", **TOOL, ids=[0, 0])
    assert adv.flatten().tolist() == approx([[2 / 3, 0, 1 / 2], [-1 / 3, -1 / 2, 0]])


def test_the_positional_variant_lines_up_padded_positions_instead():
    # Position 1: only sample 1 is a policy token there (G = 0) -> B = 0; position 2: only sample 0 -> B = 1.
    adv, _ = otb("optimal_token_baseline", **TOOL, ids=[0, 0])
    assert adv.flatten().tolist() == approx([[2 / 3, 0, 0], [-1 / 3, 0, 0]])


def test_tir_leaves_empty_responses_out_of_their_group():
    # With the empty response left out, sample 0 is alone: no baseline, A = G.
    adv, _ = otb("tir_optimal_token_baseline", rewards=[[0, 1], [0, 0]], mask=[[1, 1], [0, 0]],
                 probs=[[0.5, 0.5], [1, 1]], ids=[0, 0])
    assert adv.flatten().tolist() == approx([[1, 1], [0, 0]])


def test_rollout_is_weights_scale_each_tokens_variance_by_their_square():
    # Sample 1's first token weighted by 2: w = 4·1.0, so B_0 = 0.5 / (0.5 + 4) = 1/9.
    weights = torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 1.0]])
    adv, _ = otb("optimal_token_baseline", **TWO, ids=[0, 0], handle_zero_tail=False, rollout_is_weights=weights)
    assert adv[0, 0].item() == pytest.approx(1 - 1 / 9, abs=1e-5)


def test_token_baselines_name_their_missing_inputs():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="needs AdvantageInputs.sum_pi_squared"):
        estimate("optimal_token_baseline", token_level_rewards=mask, response_mask=mask,
                                                    group_ids=torch.tensor([0, 0]), old_logprobs=mask)
