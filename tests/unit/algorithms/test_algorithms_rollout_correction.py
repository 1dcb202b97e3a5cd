"""Rollout-vs-trainer importance weights, rejection and mismatch metrics by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.core import UnknownNameError
from hybridflow.algorithms.rollout_correction import compute_rollout_correction, compute_rollout_is_weights

torch.set_num_threads(1)
LN = math.log
NAN = float("nan")

# Row 0: ρ = π_old/π_rollout = 0.8/0.2 = 4, 0.9/0.9 = 1, 0.2/0.4 = 0.5.
# Row 1: one token with ρ = 1, then padding whose logprobs are nan.
OLD = torch.tensor([[LN(0.8), LN(0.9), LN(0.2)], [LN(0.5), NAN, NAN]])
ROLLOUT = torch.tensor([[LN(0.2), LN(0.9), LN(0.4)], [LN(0.5), NAN, NAN]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def correct(**kwargs: object):  # type: ignore[no-untyped-def]
    return compute_rollout_correction(old_logprobs=OLD, rollout_logprobs=ROLLOUT, response_mask=MASK, **kwargs)


def test_token_level_truncation_rejection_and_metrics() -> None:
    weights, keep_mask, metrics = correct(level="token", threshold=2.0, rejection_band=(0.6, 3.0))
    # weights min(ρ, 2): (2, 1, 0.5 | 1, 0, 0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]))
    # band (0.6, 3): ρ = 4 and ρ = 0.5 are outside → rejected
    torch.testing.assert_close(keep_mask, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    # over the 4 masked-in tokens, log ρ = (ln 4, 0, −ln 2, 0):
    #   |log ρ| mean (1.3862944 + 0.6931472)/4 = 0.5198604, max 1.3862944
    #   kl = mean(−log ρ) = (−1.3862944 + 0.6931472)/4 = −0.1732868
    #   k3 = mean(ρ − log ρ − 1) = ((4 − 1.3862944 − 1) + 0 + (0.5 + 0.6931472 − 1) + 0)/4
    #      = (1.6137056 + 0.1931472)/4 = 0.4517132
    #   weights mean (2 + 1 + 0.5 + 1)/4 = 1.125; truncated 1/4; outside band 2/4;
    #   rejected 2/4 of tokens, 1 of 2 responses
    expected = {
        "rollout_corr/log_ratio_abs_mean": 0.5198604,
        "rollout_corr/log_ratio_abs_max": 1.3862944,
        "rollout_corr/kl": -0.1732868,
        "rollout_corr/k3_kl": 0.4517132,
        "rollout_corr/rollout_is_mean": 1.125,
        "rollout_corr/truncated_fraction": 0.25,
        "rollout_corr/outside_band_fraction": 0.5,
        "rollout_corr/rollout_rs_masked_fraction": 0.5,
        "rollout_corr/rollout_rs_seq_masked_fraction": 0.5,
    }
    assert metrics == {k: pytest.approx(v, rel=1e-5) for k, v in expected.items()}
    assert not weights.requires_grad


def test_without_a_band_nothing_is_rejected_but_the_mismatch_is_reported() -> None:
    _, keep_mask, metrics = correct(threshold=2.0)
    torch.testing.assert_close(keep_mask, MASK)
    # the metric band is (1/2, 2): only ρ = 4 is outside (0.5 is on the edge, not outside)
    assert metrics["rollout_corr/outside_band_fraction"] == pytest.approx(0.25)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0


def test_sequence_level_weights_and_rejection() -> None:
    weights, keep_mask, metrics = correct(level="sequence", threshold=1.5, rejection_band=(0.5, 1.5))
    # row 0: ρ = 4·1·0.5 = 2 → weight min(2, 1.5) = 1.5 on every token, and outside the band
    #   → the whole response is rejected; row 1: ρ = 1 → kept with weight 1
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 1.5], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(keep_mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert metrics["rollout_corr/truncated_fraction"] == pytest.approx(0.75)  # 3 of 4 tokens
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.75)
    # the token-level mismatch metrics do not depend on the level
    assert metrics["rollout_corr/log_ratio_abs_max"] == pytest.approx(LN(4.0), rel=1e-6)


def test_keep_mask_has_the_dtype_of_the_response_mask() -> None:
    _, keep_mask, _ = compute_rollout_correction(
        old_logprobs=OLD, rollout_logprobs=ROLLOUT, response_mask=MASK.bool(), rejection_band=(0.6, 3.0)
    )
    assert keep_mask.dtype == torch.bool
    assert keep_mask.tolist() == [[False, True, False], [True, False, False]]


def test_an_empty_mask_gives_zeros() -> None:
    weights, keep_mask, metrics = compute_rollout_correction(
        old_logprobs=OLD, rollout_logprobs=ROLLOUT, response_mask=torch.zeros(2, 3), rejection_band=(0.5, 2.0)
    )
    assert weights.abs().sum() == 0 and keep_mask.abs().sum() == 0
    assert all(v == 0.0 for v in metrics.values())


def test_tokens_one_engine_deems_impossible() -> None:
    # log ρ = (−inf, +inf, 0): the trainer gives token 0 probability 0, the engine token 1
    old = torch.tensor([[float("-inf"), 0.0, 0.0]])
    rollout = torch.tensor([[0.0, float("-inf"), 0.0]])
    kwargs = dict(old_logprobs=old, rollout_logprobs=rollout, response_mask=torch.ones(1, 3), rejection_band=(0.5, 2.0))
    weights, keep_mask, metrics = compute_rollout_correction(level="token", **kwargs)  # type: ignore[arg-type]
    # weights e^−20 (clamped log-ratio), min(e^20, 2) = 2, 1; the two infinite tokens are rejected
    torch.testing.assert_close(weights, torch.tensor([[math.exp(-20.0), 2.0, 1.0]]))
    torch.testing.assert_close(keep_mask, torch.tensor([[0.0, 0.0, 1.0]]))
    # metrics see the log-ratio clamped to ±20: |log ρ| mean (20 + 20 + 0)/3, max 20
    assert metrics["rollout_corr/log_ratio_abs_mean"] == pytest.approx(40 / 3)
    assert metrics["rollout_corr/log_ratio_abs_max"] == pytest.approx(20.0)
    assert all(math.isfinite(v) for v in metrics.values())
    # the sequence ratio is e^(−inf + inf): undefined → weight 0 and the response is rejected
    weights, keep_mask, metrics = compute_rollout_correction(level="sequence", **kwargs)  # type: ignore[arg-type]
    assert weights.abs().sum() == 0 and keep_mask.abs().sum() == 0
    assert metrics["rollout_corr/outside_band_fraction"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_bad_arguments_are_named() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown rollout correction level 'tokens'.*Did you mean 'token'\?"):
        correct(level="tokens")
    with pytest.raises(ValueError, match="threshold .* must be finite and > 0"):
        correct(threshold=0.0)
    with pytest.raises(ValueError, match=r"rejection_band must satisfy 0 < lower <= upper"):
        correct(rejection_band=(2.0, 1.0))
    with pytest.raises(ValueError, match=r"shape mismatch: old_logprobs \(2, 3\), rollout_logprobs \(2, 2\)"):
        compute_rollout_correction(old_logprobs=OLD, rollout_logprobs=ROLLOUT[:, :2], response_mask=MASK)
    bad = OLD.clone()
    bad[1, 0] = NAN
    with pytest.raises(ValueError, match=r"nan on masked-in tokens of rows \[1\]"):
        compute_rollout_correction(old_logprobs=bad, rollout_logprobs=ROLLOUT, response_mask=MASK)


def test_estimator_is_weights_are_the_losss_truncated_weights_or_none() -> None:
    """compute_rollout_is_weights (the token baselines' ρ) by hand: the loss's truncated weights of
    the configured level, or None (unscaled) without importance weights or in bypass mode."""
    def weights(**kwargs: object):  # type: ignore[no-untyped-def]
        return compute_rollout_is_weights(old_logprobs=OLD, rollout_logprobs=ROLLOUT, response_mask=MASK, **kwargs)

    # Token level: min(ρ, 2) = (2, 1, 0.5 | 1, 0, 0); threshold 3 keeps ρ = 4 at 3.
    assert torch.allclose(weights(rollout_is="token", threshold=2.0), torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]))
    assert torch.allclose(weights(rollout_is="token", threshold=3.0), torch.tensor([[3.0, 1.0, 0.5], [1.0, 0.0, 0.0]]))
    # Sequence level: row 0's ρ = 4 * 1 * 0.5 = 2 on each of its tokens (under 2.5), row 1's 1.
    assert torch.allclose(weights(rollout_is="sequence", threshold=2.5), torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0]]))
    assert weights(rollout_is=None, threshold=2.0) is None
    assert weights(rollout_is="token", threshold=2.0, bypass_mode=True) is None
    with pytest.raises(UnknownNameError):
        weights(rollout_is="tokens", threshold=2.0)
