"""gspo, sapo, cispo, gpg, clip_cov, kl_cov, geo_mean: hand-worked losses, gradients, metrics."""

from __future__ import annotations

from functools import partial

import math

import pytest
import torch

from hybridflow.algorithms.policy_loss import POLICY_LOSSES
from hybridflow.algorithms.rollout_correction import parse_rollout_rs
from _algorithm_calls import policy_loss

torch.set_num_threads(1)

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
METRIC_KEYS = {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
LN = math.log


def loss_and_grad(name: str, logprobs: list[list[float]], old: list[list[float]], advantages: list[list[float]], mask: list[list[float]] | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    """(loss, metrics, d loss / d logprobs) of one registered loss."""
    lp = torch.tensor(logprobs, requires_grad=True)
    loss, metrics = policy_loss(name, 
        old_logprobs=torch.tensor(old),
        logprobs=lp,
        advantages=torch.tensor(advantages),
        response_mask=torch.tensor(mask) if mask is not None else torch.ones_like(lp),
        **{**CLIP, **kwargs},
    )
    loss.backward()
    assert lp.grad is not None
    return loss.item(), metrics, lp.grad


def test_registry_lists_every_policy_loss() -> None:
    assert sorted(POLICY_LOSSES) == [
        "bypass_mode", "cispo", "clip_cov", "dppo_kl", "dppo_tv", "dro", "geo_mean", "gpg", "gspo", "kl_cov", "sapo",
        "vanilla",
    ]


# --------------------------------------------------------------------------------------------
# gspo
# --------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_is_the_geometric_mean() -> None:
    # token ratios 2 and 0.5: vanilla PPO would clip token 0; the sequence ratio is
    # exp((ln 2 + ln 0.5)/2) = 1, inside the range. A = 1: token losses −1, −1 → loss −1;
    # gradient per token −A·s/|y| = −0.5 (seq-mean-token-mean over 2 tokens)
    loss, metrics, grad = loss_and_grad("gspo", [[LN(2.0), LN(0.5)]], [[0.0, 0.0]], [[1.0, 1.0]])
    assert loss == pytest.approx(-1.0)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.5]]))
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)  # −(ln 2 + ln 0.5)/2


@pytest.mark.parametrize(
    ("advantage", "expected_loss", "expected_grad", "clipfrac"),
    [
        # s = 1.5 > 1.2 with A > 0: clipped at −1.2 per token, no gradient
        (1.0, -1.2, 0.0, 1.0),
        # A < 0: max(1.5, 1.2) = 1.5 unclipped; gradient −A·s/|y| = 1.5/2
        (-1.0, 1.5, 0.75, 0.0),
    ],
)
def test_gspo_clips_the_sequence_ratio(advantage: float, expected_loss: float, expected_grad: float, clipfrac: float) -> None:
    loss, metrics, grad = loss_and_grad("gspo", [[LN(1.5), LN(1.5)]], [[0.0, 0.0]], [[advantage, advantage]])
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(grad, torch.full((1, 2), expected_grad))
    assert metrics["actor/pg_clipfrac"] == clipfrac
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("seq-mean-token-mean", -1.5), ("token-mean", -7 / 4), ("token-sum", -7.0), ("seq-mean-token-sum", -3.5)],
)
def test_gspo_aggregates_with_the_configured_mode_as_verl(mode: str, expected: float) -> None:
    # sequence 0: one token, A = 1 → −1; sequence 1: three tokens, A = 2 → −2 each.
    # seq-mean-token-mean (the paper's): (−1 − 2)/2; token-mean: −7/4; token-sum: −7; seq-sum: (−1 − 6)/2
    kwargs = dict(logprobs=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], old=[[0.0] * 3] * 2,
                  advantages=[[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]], mask=[[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _, _ = loss_and_grad("gspo", **kwargs, loss_agg_mode=mode)  # type: ignore[arg-type]
    assert loss == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# sapo
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "advantage", "kwargs", "expected_loss", "expected_grad"),
    [
        # r = 1, A = 1, τ = 1: gate σ(0)·4/1 = 2 → loss −2; slope 4·σ(1−σ)·r = 1 → grad −A = −1
        (1.0, 1.0, {}, -2.0, -1.0),
        # r = 1, A = −1, τ_neg = 1.05: gate 2/1.05 → loss +1.9047619; slope 1 → grad +1
        (1.0, -1.0, {}, 2 / 1.05, 1.0),
        # r = 2, A = 1: gate σ(1)·4 = 0.7310586·4 → loss −2.9242344;
        #   slope 4·σ(1)·(1 − σ(1))·2 = 4·0.1966119·2 = 1.5728954 → grad −1.5728954
        (2.0, 1.0, {}, -2.9242344, -1.5728954),
        # tau_pos = 2 at r = 1: gate σ(0)·4/2 = 1 → loss −1; slope still r = 1
        (1.0, 1.0, {"tau_pos": 2.0}, -1.0, -1.0),
    ],
)
def test_sapo_soft_gate(ratio: float, advantage: float, kwargs: dict, expected_loss: float, expected_grad: float) -> None:
    loss, metrics, grad = loss_and_grad("sapo", [[LN(ratio)]], [[0.0]], [[advantage]], **kwargs)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grad.item() == pytest.approx(expected_grad, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == metrics["actor/pg_clipfrac_lower"] == 0.0


def test_sapo_rejects_nonpositive_temperatures() -> None:
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        loss_and_grad("sapo", [[0.0]], [[0.0]], [[1.0]], tau_neg=0.0)


# --------------------------------------------------------------------------------------------
# cispo, gpg
# --------------------------------------------------------------------------------------------


def test_cispo_clipped_weight_keeps_the_gradient() -> None:
    # token 0: π = 0.3, π_old = 0.2 → r = 1.5, weight clip(1.5) = 1.2, A = 1:
    #   loss −1.2·ln 0.3 = 1.4447674, gradient −1.2 (PPO would give 0 here)
    # token 1: r = 1, A = −1, π = 0.5: loss −1·(−1)·ln 0.5 = −0.6931472, gradient +1
    # token-mean: (1.4447674 − 0.6931472)/2 = 0.3758101; gradients halved
    loss, metrics, grad = loss_and_grad("cispo", [[LN(0.3), LN(0.5)]], [[LN(0.2), LN(0.5)]], [[1.0, -1.0]])
    assert loss == pytest.approx(0.3758101, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.6, 0.5]]))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_gpg_is_reinforce() -> None:
    # losses −A·logπ: −1·ln 0.5 = 0.6931472; −(−2)·ln 0.25 = −2.7725887 → mean −1.0397208
    # gradient −A/2 = (−0.5, 1.0); ppo_kl = mean(old − new) = ((ln 0.4 − ln 0.5) + 0)/2
    loss, metrics, grad = loss_and_grad("gpg", [[LN(0.5), LN(0.25)]], [[LN(0.4), LN(0.25)]], [[1.0, -2.0]])
    assert loss == pytest.approx(-1.0397208, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.0]]))
    assert metrics["actor/ppo_kl"] == pytest.approx((LN(0.4) - LN(0.5)) / 2, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == 0.0


# --------------------------------------------------------------------------------------------
# clip_cov, kl_cov
# --------------------------------------------------------------------------------------------

# A = (1, 1, −1, −1), logπ = (−1, −3, −1, −3): means 0 and −2, so the centred covariance is
# (1·1, 1·(−1), −1·1, −1·(−1)) = (1, −1, −1, 1). With clip_cov_lb 0.5 tokens 0 and 3 qualify.
COV_ADV = [[1.0, 1.0, -1.0, -1.0]]
COV_LOGP = [[-1.0, -3.0, -1.0, -3.0]]


def test_clip_cov_drops_a_random_high_covariance_token() -> None:
    # ratio 1 everywhere: token losses −A = (−1, −1, 1, 1). Budget max(1, ⌊0.25·4⌋) = 1 token.
    #   drop token 0 → (0, −1, 1, 1) → mean 0.25;  drop token 3 → (−1, −1, 1, 0) → −0.25
    outcomes = set()
    for seed in range(16):
        generator = torch.Generator().manual_seed(seed)
        loss, metrics, grad = loss_and_grad(
            "clip_cov", COV_LOGP, COV_LOGP, COV_ADV, clip_cov_ratio=0.25, clip_cov_lb=0.5, generator=generator
        )
        dropped = 0 if loss > 0 else 3
        assert loss == pytest.approx(0.25 if dropped == 0 else -0.25)
        assert grad[0, dropped] == 0.0 and grad[0, 3 - dropped] != 0.0
        assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)  # verl: fraction dropped
        outcomes.add(dropped)
        again, _, _ = loss_and_grad(
            "clip_cov", COV_LOGP, COV_LOGP, COV_ADV, clip_cov_ratio=0.25, clip_cov_lb=0.5,
            generator=torch.Generator().manual_seed(seed),
        )
        assert again == loss  # a seeded generator makes the draw reproducible
    assert outcomes == {0, 3}


def test_clip_cov_skips_ppo_clipped_tokens_and_out_of_band_covariance() -> None:
    # token 0 now has ratio 1.5 with A = 1: PPO clips it (loss −1.2), so it is no candidate;
    # budget ⌊0.5·4⌋ = 2 but only token 3 qualifies → losses (−1.2, −1, 1, 0) → mean −0.3
    old = [[-1.0 - LN(1.5), -3.0, -1.0, -3.0]]
    loss, metrics, _ = loss_and_grad("clip_cov", COV_LOGP, old, COV_ADV, clip_cov_ratio=0.5, clip_cov_lb=0.5)
    assert loss == pytest.approx(-0.3, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
    # with verl's default band (1, 5) a covariance of exactly 1 is no candidate: plain PPO
    loss, metrics, _ = loss_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV)
    assert loss == pytest.approx(0.0) and metrics["actor/pg_clipfrac"] == 0.0
    with pytest.raises(ValueError, match="clip_cov_lb must be < clip_cov_ub"):
        loss_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, clip_cov_lb=5.0)


def test_kl_cov_penalises_the_top_covariance_tokens() -> None:
    # logπ = (−1, −3, −1, −3.5): mean −2.125 → centred covariance
    #   (1·1.125, 1·(−0.875), −1·1.125, −1·(−1.375)) = (1.125, −0.875, −1.125, 1.375)
    # top ⌊0.25·4⌋ = 1 token: token 3, whose log-ratio is 0.5 (old −4).
    # losses: −A·r = (−1, −1, 1, e^0.5) and token 3 adds 0.1·|0.5|:
    #   (−1 − 1 + 1 + 1.6487213 + 0.05)/4 = 0.1746803
    # gradient of token 3: (e^0.5 + 0.1)/4 = 0.4371803; ppo_kl (verl: mean |log r|) = 0.5/4
    logp = [[-1.0, -3.0, -1.0, -3.5]]
    old = [[-1.0, -3.0, -1.0, -4.0]]
    loss, metrics, grad = loss_and_grad("kl_cov", logp, old, COV_ADV, kl_cov_ratio=0.25)
    assert loss == pytest.approx(0.1746803, rel=1e-6)
    assert grad[0, 3].item() == pytest.approx(0.4371803, rel=1e-6)
    torch.testing.assert_close(grad[0, :3], torch.tensor([-0.25, -0.25, 0.25]))
    assert metrics["actor/ppo_kl"] == pytest.approx(0.125)
    # kl_cov_ratio 0.5 → top 2 = tokens 3 and 0 (token 0's log-ratio is 0: no penalty value,
    # but its gradient gains 0.1·sign(0) = 0 too); with ppo_kl_coef 0 it is plain −A·r
    plain, _, _ = loss_and_grad("kl_cov", logp, old, COV_ADV, kl_cov_ratio=0.5, ppo_kl_coef=0.0)
    assert plain == pytest.approx((-1 - 1 + 1 + math.exp(0.5)) / 4, rel=1e-6)


# --------------------------------------------------------------------------------------------
# geo_mean
# --------------------------------------------------------------------------------------------


def test_geo_mean_sign_aware_clip_and_geometric_ratio() -> None:
    # clip 0.4 in log space.
    # sequence 0, A = 1: ℓ = (0.6, −0.2) → ℓ' = min(ℓ, 0.4) = (0.4, −0.2), mean 0.1
    #   loss −e^0.1 = −1.1051709; gradient: token 0 clipped → 0, token 1: −e^0.1/2 / 2 seqs
    # sequence 1, A = −1: ℓ = (−0.6, 0.2) → ℓ' = max(ℓ, −0.4) = (−0.4, 0.2), mean −0.1
    #   loss +e^−0.1 = 0.9048374
    # mean over sequences: (−1.1051709 + 0.9048374)/2 = −0.1001668
    loss, metrics, grad = loss_and_grad(
        "geo_mean", [[0.6, -0.2], [-0.6, 0.2]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [-1.0, -1.0]],
        clip_ratio_low=0.4, clip_ratio_high=0.4,
    )
    assert loss == pytest.approx(-0.1001668, rel=1e-5)
    assert grad[0, 0] == 0.0 and grad[1, 0] == 0.0
    assert grad[0, 1].item() == pytest.approx(-math.exp(0.1) / 4, rel=1e-5)
    assert grad[1, 1].item() == pytest.approx(math.exp(-0.1) / 4, rel=1e-5)
    # one token of four clipped with A > 0, one with A < 0
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)


def test_geo_mean_is_weights_and_empty_sequences() -> None:
    # ratio 1, A = 1 → −1 per sequence; IS weights (4, 1) enter as their geometric mean 2;
    # the empty third sequence counts in no mean: (−2 − 1)/2 = −1.5
    lp = torch.zeros(3, 2, requires_grad=True)
    loss, _ = policy_loss("geo_mean", 
        old_logprobs=torch.zeros(3, 2),
        logprobs=lp,
        advantages=torch.ones(3, 2),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]),
        rollout_is_weights=torch.tensor([[4.0, 1.0], [1.0, 1.0], [9.0, 9.0]]),
        **CLIP,
    )
    assert loss.item() == pytest.approx(-1.5, rel=1e-6)


# --------------------------------------------------------------------------------------------
# Properties of every registered loss
# --------------------------------------------------------------------------------------------

ALL_INPUTS = dict(
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    loss_scale_factor=None,
    dp_size=1,
    tau_pos=1.0,
    tau_neg=1.05,
    clip_cov_ratio=2e-4,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    kl_cov_ratio=2e-4,
    ppo_kl_coef=0.1,
    dro_beta=0.1,
    bypass_loss_type="ppo_clip",
    rollout_is="token",
    rollout_rs_criteria=parse_rollout_rs("token", 2.0),
    an_input_no_loss_knows=object(),
)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_takes_the_uniform_signature_and_ignores_padding(name: str) -> None:
    generator = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logprobs = torch.randn(2, 3, generator=generator) - 1.0
    logprobs[mask == 0] = float("-inf")  # garbage on padding must not reach loss or gradient
    logprobs.requires_grad_(True)
    old = (logprobs.detach() + 0.1 * torch.randn(2, 3, generator=generator)).clone()
    old[mask == 0] = float("nan")
    loss, metrics = policy_loss(name, 
        old_logprobs=old,
        logprobs=logprobs,
        advantages=torch.randn(2, 3, generator=generator),
        response_mask=mask,
        rollout_is_weights=torch.where(mask != 0, 1.5, float("nan")),
        rollout_logprobs=old,  # bypass_mode's pi_old
        generator=torch.Generator().manual_seed(0),
        **CLIP,
        **ALL_INPUTS,  # type: ignore[arg-type]
    )
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert METRIC_KEYS <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert logprobs.grad is not None
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[mask == 0] == 0).all()


# kl_cov and clip_cov pick tokens within the micro-batch (as verl), so they are not split-invariant.
SPLIT_INVARIANT = sorted(set(POLICY_LOSSES) - {"clip_cov", "kl_cov"})


@pytest.mark.parametrize("name", SPLIT_INVARIANT)
def test_micro_batches_with_global_counts_add_up_to_the_full_batch(name: str) -> None:
    generator = torch.Generator().manual_seed(2)
    logprobs = torch.randn(4, 5, generator=generator) - 1.0
    old = logprobs + 0.3 * torch.randn(4, 5, generator=generator)
    advantages = torch.randn(4, 1, generator=generator).expand(4, 5).contiguous()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    common = dict(CLIP, loss_agg_mode="token-mean", global_num_tokens=int(mask.sum()), global_num_seqs=4)
    fn = partial(policy_loss, name)
    full, _ = fn(old_logprobs=old, logprobs=logprobs, advantages=advantages, response_mask=mask,
                 rollout_logprobs=old, dro_beta=0.1, **common)  # type: ignore[arg-type]
    parts = [
        fn(old_logprobs=old[s], logprobs=logprobs[s], advantages=advantages[s], response_mask=mask[s],
           rollout_logprobs=old[s], dro_beta=0.1, **common)[0]  # type: ignore[arg-type]
        for s in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(sum(parts), full)


@pytest.mark.parametrize("name", sorted(set(POLICY_LOSSES) - {"vanilla"}))
def test_shape_mismatch_is_named(name: str) -> None:
    with pytest.raises(ValueError, match=r"shape mismatch: old_logprobs \(1, 2\), logprobs \(1, 3\)"):
        policy_loss(name, 
            old_logprobs=torch.zeros(1, 2), logprobs=torch.zeros(1, 3), advantages=torch.zeros(1, 3),
            response_mask=torch.ones(1, 3), **CLIP,
        )
