"""PPO clip (vanilla) loss: each clip case by hand, metrics, gradients, registry."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.core import UnknownNameError
from hybridflow.algorithms.policy_loss import POLICY_LOSSES, get_policy_loss
from _algorithm_calls import policy_loss

torch.set_num_threads(1)

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def ppo(ratio: list[float], advantage: list[float], **kwargs):  # type: ignore[no-untyped-def]
    """vanilla loss with old logprob 0 and logprob log(ratio); returns (loss, metrics, logprobs)."""
    logprobs = torch.tensor([[math.log(r) for r in ratio]], requires_grad=True)
    loss, metrics = policy_loss("vanilla", 
        old_logprobs=torch.zeros_like(logprobs),
        logprobs=logprobs,
        advantages=torch.tensor([advantage]),
        response_mask=torch.ones_like(logprobs),
        **{**CLIP, **kwargs},
    )
    return loss, metrics, logprobs


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "expected_grad"),
    [
        # A > 0, ratio 1.5 above 1.2: max(−1.5, −1.2) = −1.2 (clipped: no gradient)
        (1.5, 1.0, -1.2, 0.0),
        # A > 0, ratio 0.5 below 0.8: max(−0.5, −0.8) = −0.5 (unclipped: d/dlogp −A·r = −0.5)
        (0.5, 1.0, -0.5, -0.5),
        # A < 0, ratio 0.5: max(0.5, 0.8) = 0.8 (clipped); below the dual bound 3
        (0.5, -1.0, 0.8, 0.0),
        # A < 0, ratio 1.5: max(1.5, 1.2) = 1.5 (unclipped: gradient −A·r = 1.5)
        (1.5, -1.0, 1.5, 1.5),
        # A < 0, ratio 4: max(4, 1.2) = 4 > −A·c = 3 → dual clip caps it at 3 (no gradient)
        (4.0, -1.0, 3.0, 0.0),
        # A > 0, ratio 4: max(−4, −1.2) = −1.2; the dual clip only applies to A < 0
        (4.0, 1.0, -1.2, 0.0),
        # on-policy: ratio 1, loss −A, gradient −A
        (1.0, 2.0, -2.0, -2.0),
    ],
)
def test_clip_cases(ratio: float, advantage: float, expected_loss: float, expected_grad: float) -> None:
    loss, _, logprobs = ppo([ratio], [advantage])
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(expected_grad, rel=1e-6, abs=1e-7)


def test_metrics_over_the_token_cases() -> None:
    ratios = [1.5, 0.5, 0.5, 1.5, 4.0, 1.0]
    advantages = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    loss, metrics, _ = ppo(ratios, advantages)
    # token losses −1.2, −0.5, 0.8, 1.5, 3.0, −1.0 → token-mean 2.6/6
    assert loss.item() == pytest.approx(2.6 / 6, rel=1e-6)
    # clipped term won on tokens 0 and 2 → 2/6; dual clip on token 4 → 1/6
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)
    # ppo_kl = mean(old − new) = −mean(log r)
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratios) / 6, rel=1e-6)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
    assert all(isinstance(v, float) for v in metrics.values())


def test_asymmetric_clip_higher() -> None:
    # DAPO clip-higher: ratio 1.25 is inside 1 + 0.28 → unclipped −1.25
    loss, metrics, _ = ppo([1.25], [1.0], clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["actor/pg_clipfrac"] == 0.0
    # ratio 0.75 with A < 0 and low 0.2: max(0.75, 0.8) = 0.8 (clipped)
    loss, _, _ = ppo([0.75], [-1.0], clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(0.8)


def test_masked_tokens_do_not_count_and_huge_ratios_stay_finite() -> None:
    logprobs = torch.tensor([[0.0, 50.0, -1e4]], requires_grad=True)
    loss, metrics = policy_loss("vanilla", 
        old_logprobs=torch.zeros(1, 3),
        logprobs=logprobs,
        advantages=torch.tensor([[1.0, -1.0, 5.0]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0]]),
        **CLIP,
    )
    # token 0: −1; token 1: log-ratio clamped to 20, A < 0 → dual clip 3; token 2 masked
    assert loss.item() == pytest.approx((-1.0 + 3.0) / 2)
    # ppo_kl over masked-in tokens of the clamped log-ratio: (0 − 20)/2
    assert metrics["actor/ppo_kl"] == pytest.approx(-10.0)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()


def test_rollout_is_weights_scale_token_losses() -> None:
    kwargs = dict(
        old_logprobs=torch.zeros(1, 2),
        logprobs=torch.zeros(1, 2),
        advantages=torch.tensor([[1.0, 2.0]]),
        response_mask=torch.ones(1, 2),
        **CLIP,
    )
    plain, _ = policy_loss("vanilla", **kwargs)
    weighted, _ = policy_loss("vanilla", **kwargs, rollout_is_weights=torch.tensor([[3.0, 0.5]]))
    # ratio 1: token losses −1, −2 → mean −1.5; weighted −3, −1 → mean −2
    assert plain.item() == pytest.approx(-1.5)
    assert weighted.item() == pytest.approx(-2.0)


def test_aggregation_arguments_are_passed_through() -> None:
    loss, _ = policy_loss("vanilla", 
        old_logprobs=torch.zeros(2, 2),
        logprobs=torch.zeros(2, 2),
        advantages=torch.tensor([[1.0, 1.0], [3.0, 0.0]]),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        loss_agg_mode="seq-mean-token-mean",
        global_num_seqs=4,
        dp_size=2,
        **CLIP,
    )
    # sequence means −1 and −3, summed −4, / 4 global sequences × dp 2 = −2
    assert loss.item() == pytest.approx(-2.0)


def test_validation_and_registry() -> None:
    assert "vanilla" in POLICY_LOSSES
    with pytest.raises(ValueError, match="clip_ratio_c .* must be > 1"):
        ppo([1.0], [1.0], clip_ratio_c=1.0)
    with pytest.raises(UnknownNameError, match=r"unknown policy loss 'vanila'.*Did you mean 'vanilla'\?"):
        get_policy_loss("vanila")
