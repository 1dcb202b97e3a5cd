"""dppo_tv, dppo_kl, dro and bypass_mode against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from _algorithm_calls import policy_loss

from hybridflow.algorithms import parse_rollout_rs

torch.set_num_threads(1)
HALF = math.log(0.5)


def loss_and_grad(name: str, probs: list[float], advantages: list[float], old: list[float] | None = None, **kw):  # type: ignore[no-untyped-def]
    """One response of len(probs) tokens; π_old = 0.5 on every token unless ``old`` is given."""
    logprobs = torch.tensor([probs]).log().requires_grad_(True)
    old_logprobs = torch.tensor([old]).log() if old is not None else torch.full_like(logprobs, HALF)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, **kw}
    loss, metrics = policy_loss(name, old_logprobs=old_logprobs, logprobs=logprobs,
                                          advantages=torch.tensor([advantages]), response_mask=torch.ones_like(logprobs),
                                          **kw)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return float(loss.detach()), grad.flatten().tolist(), metrics


# p = (0.8, 0.6, 0.25, 0.45) against p_old = 0.5; A = (+1, +1, -1, -1).
PROBS, ADV = [0.8, 0.6, 0.25, 0.45], [1.0, 1.0, -1.0, -1.0]


def test_dppo_tv_keeps_tokens_whose_probability_moved_less_than_the_range():
    # p − p_old = (0.3, 0.1, −0.25, −0.05): A > 0 valid while ≤ 0.2, A < 0 while ≥ −0.2 -> (no, yes, no, yes).
    # Valid tokens: −A·r·logp with r = p / 0.5: −1.2·log 0.6 and +0.9·log 0.45; token mean over 4.
    loss, grad, metrics = loss_and_grad("dppo_tv", PROBS, ADV)
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 0.9 * math.log(0.45)) / 4, abs=1e-6)
    assert grad == pytest.approx([0.0, -1.2 / 4, 0.0, 0.9 / 4], abs=1e-6)  # d/dlogp = −A·sg(r)·valid / 4
    assert metrics["actor/pg_clipfrac"] == 0.5
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_dppo_truncates_the_importance_weight_at_clip_ratio_c():
    # With clip_ratio_c = 1.1 token 1's r = 1.2 is cut to 1.1 (token 0's 1.6 too, but it is not valid).
    _, grad, metrics = loss_and_grad("dppo_tv", PROBS, ADV, clip_ratio_c=1.1)
    assert grad == pytest.approx([0.0, -1.1 / 4, 0.0, 0.9 / 4], abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == 0.25  # valid tokens whose ratio was truncated


def test_dppo_kl_bounds_the_binary_kl_of_the_tokens_probability():
    # Binary KL to p_old = 0.5: p = 0.8 -> 0.2231, 0.6 -> 0.0204, 0.25 -> 0.1438, 0.45 -> 0.0050.
    # With both ranges 0.1: valid = (no, yes, no, yes), the same tokens as TV above.
    loss, grad, _ = loss_and_grad("dppo_kl", PROBS, ADV, clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 0.9 * math.log(0.45)) / 4, abs=1e-6)
    assert grad == pytest.approx([0.0, -1.2 / 4, 0.0, 0.9 / 4], abs=1e-6)
    # A token that moved against its advantage stays valid however far: p = 0.1 with A > 0
    # (binary KL 0.51) and p = 0.9 with A < 0.
    _, grad, metrics = loss_and_grad("dppo_kl", [0.1, 0.9], [1.0, -1.0], clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert grad == pytest.approx([-0.2 / 2, 1.8 / 2], abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty():
    # L = −(logp·A − ½β(logp − logp_old)²), β = 0.5, p = 0.6, p_old = 0.5, A = 2.
    loss, grad, metrics = loss_and_grad("dro", [0.6], [2.0], dro_beta=0.5)
    log_ratio = math.log(1.2)
    assert loss == pytest.approx(-(2 * math.log(0.6) - 0.25 * log_ratio**2), abs=1e-6)
    assert grad == pytest.approx([-(2 - 0.5 * log_ratio)], abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(-log_ratio, abs=1e-6)
    with pytest.raises(ValueError, match="dro_beta > 0"):
        loss_and_grad("dro", [0.6], [2.0])


def test_bypass_ppo_clip_is_vanilla_against_the_rollout_logprobs_whatever_old_says():
    rollout = torch.tensor([[0.5, 0.5]]).log()
    bypass = loss_and_grad("bypass_mode", [0.8, 0.3], [1.0, -1.0], old=[0.9, 0.9], rollout_logprobs=rollout,
                           bypass_loss_type="ppo_clip")
    vanilla = loss_and_grad("vanilla", [0.8, 0.3], [1.0, -1.0], old=[0.5, 0.5])
    assert bypass[0] == pytest.approx(vanilla[0]) and bypass[1] == pytest.approx(vanilla[1])
    # ratio 1.6 > 1.2 and 0.6 < 0.8: both clipped, so no gradient reaches either token
    assert bypass[1] == [0.0, 0.0] and bypass[2]["actor/pg_clipfrac"] == 1.0
    assert bypass[2]["rollout_corr/kl"] == pytest.approx(-(math.log(1.6) + math.log(0.6)) / 2, abs=1e-6)


def test_bypass_reinforce_weights_logp_by_the_truncated_ratio_to_the_rollout():
    # w = min(π_θ/π_rollout, 2) = (1.2, 0.4); L = mean(−A·w·logp) over 2 tokens; d/dlogp = −A·w/2.
    rollout = torch.tensor([[0.5, 0.5]]).log()
    loss, grad, _ = loss_and_grad("bypass_mode", [0.6, 0.2], [1.0, -1.0], rollout_logprobs=rollout,
                                  bypass_loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0)
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 0.4 * math.log(0.2)) / 2, abs=1e-6)
    assert grad == pytest.approx([-0.6, 0.2], abs=1e-6)
    plain, plain_grad, _ = loss_and_grad("bypass_mode", [0.6, 0.2], [1.0, -1.0], rollout_logprobs=rollout,
                                         bypass_loss_type="reinforce")
    assert plain_grad == pytest.approx([-0.5, 0.5], abs=1e-6)  # no rollout_is: plain REINFORCE


def test_bypass_rejection_drops_tokens_whose_ratio_to_the_rollout_leaves_the_band():
    rollout = torch.tensor([[0.5, 0.5]]).log()
    criteria = parse_rollout_rs("token_k1", "0.5_1.5")  # bounds π_rollout/π_θ, as verl's k1
    loss, grad, metrics = loss_and_grad("bypass_mode", [0.6, 0.2], [1.0, -1.0], rollout_logprobs=rollout,
                                        bypass_loss_type="reinforce", rollout_rs_criteria=criteria)
    # π_rollout/π_θ = 0.5/0.6 is inside [0.5, 1.5], 0.5/0.2 = 2.5 is not: token 1 is gone
    assert grad == pytest.approx([-1.0, 0.0], abs=1e-6)
    assert loss == pytest.approx(-math.log(0.6), abs=1e-6)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.5


def test_bypass_reinforce_with_batch_normalized_sequence_weights():
    """verl's run_with_rollout_corr.sh (bypass, reinforce, rollout_is=sequence, batch normalised):
    the truncated sequence weights are divided by their mean over the micro-batch's responses."""
    # Two responses of one token: π_θ/π_rollout = 0.6/0.5 = 1.2 and 0.2/0.5 = 0.4; mean 0.8, so
    # the weights become 1.5 and 0.5. L = mean(−A·w·logp) over 2 tokens; d/dlogp = −A·w/2.
    rollout = torch.tensor([[0.5], [0.5]]).log()
    logp = torch.tensor([[0.6], [0.2]]).log().requires_grad_(True)
    loss, metrics = policy_loss("bypass_mode", old_logprobs=rollout, logprobs=logp, advantages=torch.tensor([[1.0], [-1.0]]),
                                response_mask=torch.ones(2, 1), rollout_logprobs=rollout, clip_ratio_low=0.2,
                                clip_ratio_high=0.2, bypass_loss_type="reinforce", rollout_is="sequence",
                                rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.flatten().tolist() == pytest.approx([-0.75, 0.25], abs=1e-6)
    assert loss.item() == pytest.approx((-1.5 * math.log(0.6) + 0.5 * math.log(0.2)) / 2, abs=1e-6)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(0.8, abs=1e-6)


def test_bypass_needs_the_rollout_logprobs_and_a_known_loss_type():
    with pytest.raises(ValueError, match="rollout_logprobs"):
        loss_and_grad("bypass_mode", [0.6], [1.0])
    with pytest.raises(ValueError, match="bypass_loss_type"):
        loss_and_grad("bypass_mode", [0.6], [1.0], rollout_logprobs=torch.zeros(1, 1), bypass_loss_type="pg")
