"""Rollout-vs-trainer importance weights, rejection and mismatch metrics by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.core import UnknownNameError
from hybridflow.algorithms.rollout_correction import (
    ROLLOUT_RS_CRITERIA,
    RejectionCriterion,
    RolloutCorrectionSettings,
    compute_rollout_correction,
    compute_rollout_rejection,
    correct_rollout,
    parse_rollout_rs,
)

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
    # The band is token_k1 on π_rollout/π_old ∈ [1/3, 1/0.6]: k1 = −log ρ = (−ln 4, 0, ln 2, 0),
    #   mean −0.1732868, max ln 2, min −ln 4; above ln(1/0.6) = 0.51: 1/4, below ln(1/3): 1/4.
    k1 = "rollout_corr/rollout_rs_token_k1"
    expected_k1 = {f"{k1}_mean": -0.1732868, f"{k1}_max": LN(2.0), f"{k1}_min": -LN(4.0), f"{k1}_fraction_high": 0.25,
                   f"{k1}_fraction_low": 0.25, f"{k1}_masked_fraction": 0.5, f"{k1}_seq_masked_fraction": 0.5}
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
    assert metrics == {k: pytest.approx(v, rel=1e-5) for k, v in (expected | expected_k1).items()}
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
    # the sequence ratio is e^(−inf + inf): undefined → weight 0. Rejection judges the per-token
    # log-ratio clamped to ±20 first, as verl: the response's k1 sum is −20 + 20 + 0 = 0, inside
    # the band, so it is kept (verl keeps it too); the metric still counts it outside.
    weights, keep_mask, metrics = compute_rollout_correction(level="sequence", **kwargs)  # type: ignore[arg-type]
    assert weights.abs().sum() == 0
    torch.testing.assert_close(keep_mask, torch.ones(1, 3))
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
    """correct_rollout's weights (the token baselines' ρ) by hand: the loss's truncated weights of
    the configured level, or None (unscaled) without importance weights or in bypass mode."""
    def weights(**kwargs: object):  # type: ignore[no-untyped-def]
        return correct_rollout(RolloutCorrectionSettings(**kwargs), old_logprobs=OLD, rollout_logprobs=ROLLOUT,
                               response_mask=MASK, weights_only=True).weights

    # Token level: min(ρ, 2) = (2, 1, 0.5 | 1, 0, 0); threshold 3 keeps ρ = 4 at 3.
    assert torch.allclose(weights(rollout_is="token", threshold=2.0), torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]))
    assert torch.allclose(weights(rollout_is="token", threshold=3.0), torch.tensor([[3.0, 1.0, 0.5], [1.0, 0.0, 0.0]]))
    # Sequence level: row 0's ρ = 4 * 1 * 0.5 = 2 on each of its tokens (under 2.5), row 1's 1.
    assert torch.allclose(weights(rollout_is="sequence", threshold=2.5), torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0]]))
    assert weights(rollout_is=None, threshold=2.0) is None
    assert weights(rollout_is="token", threshold=2.0, bypass_mode=True) is None
    with pytest.raises(UnknownNameError):
        weights(rollout_is="tokens", threshold=2.0)


# ------------------------------------------------------------------ batch normalisation (verl's rollout_is_batch_normalize)


def test_batch_normalize_token_level_divides_by_the_mean_over_valid_tokens() -> None:
    # truncated weights (2, 1, 0.5 | 1): mean over the 4 valid tokens 4.5/4 = 1.125
    weights, _, metrics = correct(level="token", threshold=2.0, batch_normalize=True)
    expected = torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]) / 1.125
    torch.testing.assert_close(weights, expected)
    assert float(weights.sum() / MASK.sum()) == pytest.approx(1.0)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.125)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.125)  # before normalisation, as verl
    assert "rollout_corr/rollout_is_batch_norm_factor" not in correct(level="token", threshold=2.0).metrics


def test_batch_normalize_sequence_level_averages_each_response_once() -> None:
    # row 0: ρ = 4·1·0.5 = 2 (under 2.5) on 3 tokens, row 1: ρ = 1 on 1 token. The mean is over
    # responses, (2 + 1)/2 = 1.5, not over tokens (7/4): weights 2/1.5 and 1/1.5.
    weights, _, metrics = correct(level="sequence", threshold=2.5, batch_normalize=True)
    torch.testing.assert_close(weights, torch.tensor([[4 / 3, 4 / 3, 4 / 3], [2 / 3, 0.0, 0.0]]))
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.5)
    # truncation comes first: at threshold 1.5 row 0's weight is 1.5, the mean (1.5 + 1)/2 = 1.25
    weights, _, _ = correct(level="sequence", threshold=1.5, batch_normalize=True)
    torch.testing.assert_close(weights, torch.tensor([[1.2, 1.2, 1.2], [0.8, 0.0, 0.0]]))


def test_batch_normalize_sums_over_ranks_and_skips_a_zero_mean() -> None:
    # Another rank holds 2 valid tokens whose weights sum to 3.5: the mean is (4.5 + 3.5)/(4 + 2).
    seen: list[list[float]] = []

    def other_rank(sums):  # type: ignore[no-untyped-def]
        seen.append(list(sums))
        return [sums[0] + 3.5, sums[1] + 2.0]

    weights, _, metrics = correct(level="token", threshold=2.0, batch_normalize=True, sum_over_ranks=other_rank)
    assert seen == [[4.5, 4.0]]
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]) * 0.75)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(8 / 6)
    # No valid token: nothing to divide by; the weights stay (zeros) and the factor is 1, as verl.
    weights, _, metrics = compute_rollout_correction(old_logprobs=OLD, rollout_logprobs=ROLLOUT,
                                                     response_mask=torch.zeros(2, 3), batch_normalize=True)
    assert weights.abs().sum() == 0 and metrics["rollout_corr/rollout_is_batch_norm_factor"] == 1.0


def test_estimator_is_weights_follow_batch_normalize() -> None:
    weights = correct_rollout(RolloutCorrectionSettings(rollout_is="token", threshold=2.0, batch_normalize=True),
                              old_logprobs=OLD, rollout_logprobs=ROLLOUT, response_mask=MASK, weights_only=True).weights
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 0.0]]) / 1.125)


# ------------------------------------------------------------------ rejection criteria (verl's rollout_rs)

# log ρ = logπ_old − logπ_rollout: row 0 (0.5, −1, 0), row 1 (0.2) then padding, row 2 empty.
# k1 = −log ρ:            (−0.5, 1, 0 | −0.2)
# k2 = ½(log ρ)²:         (0.125, 0.5, 0 | 0.02)
# k3 = ρ − 1 − log ρ:     (e^0.5 − 1.5 = 0.148721, e^−1 = 0.367879, 0 | e^0.2 − 1.2 = 0.021403)
# Per response (row 0 | row 1): sum k1 0.5 | −0.2, k2 0.625 | 0.02, k3 0.516600 | 0.021403;
# mean k1 0.166667 | −0.2, k2 0.208333 | 0.02, k3 0.172200 | 0.021403; max k2 0.5 | 0.02, k3 0.367879 | 0.021403.
RS_OLD = torch.tensor([[0.5, -1.0, 0.0], [0.2, NAN, NAN], [NAN, NAN, NAN]])
RS_ROLLOUT = torch.zeros(3, 3)
RS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
TOKEN_1_OF_ROW_0 = [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
ROW_0 = [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
ROW_1 = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def reject(rollout_rs: str, threshold: float | str):  # type: ignore[no-untyped-def]
    return compute_rollout_rejection(old_logprobs=RS_OLD, rollout_logprobs=RS_ROLLOUT, response_mask=RS_MASK,
                                     criteria=parse_rollout_rs(rollout_rs, threshold))


@pytest.mark.parametrize(("criterion", "threshold", "keep"), [
    ("token_k1", "0.6_1.6", TOKEN_1_OF_ROW_0),  # k1 = 1 > ln 1.6 = 0.47; −0.5 ≥ ln 0.6 = −0.51
    ("token_k2", 0.3, TOKEN_1_OF_ROW_0),  # 0.5 > 0.3
    ("token_k3", 0.2, TOKEN_1_OF_ROW_0),  # 0.368 > 0.2
    ("seq_sum_k1", "0.7_1.5", ROW_0),  # 0.5 > ln 1.5 = 0.405; −0.2 ≥ ln 0.7 = −0.357
    ("seq_sum_k2", 0.6, ROW_0),  # 0.625 > 0.6
    ("seq_sum_k3", 0.5, ROW_0),  # 0.5166 > 0.5
    ("seq_mean_k1", "0.9_1.25", ROW_1),  # −0.2 < ln 0.9 = −0.105; 0.167 ≤ ln 1.25 = 0.223
    ("seq_mean_k2", 0.2, ROW_0),  # 0.2083 > 0.2
    ("seq_mean_k3", 0.1, ROW_0),  # 0.1722 > 0.1
    ("seq_max_k2", 0.4, ROW_0),  # 0.5 > 0.4
    ("seq_max_k3", 0.3, ROW_0),  # 0.368 > 0.3
])
def test_each_criterion_keeps_what_its_statistic_allows(criterion: str, threshold: float | str,
                                                        keep: list[list[float]]) -> None:
    keep_mask, metrics = reject(criterion, threshold)
    assert keep_mask.tolist() == keep
    rejected = sum(m - k for mrow, krow in zip(RS_MASK.tolist(), keep, strict=True) for m, k in zip(mrow, krow, strict=True))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / 4)
    assert metrics[f"rollout_corr/rollout_rs_{criterion}_masked_fraction"] == pytest.approx(rejected / 4)


def test_every_verl_criterion_is_covered() -> None:
    assert len(ROLLOUT_RS_CRITERIA) == 11 and "seq_max_k1" not in ROLLOUT_RS_CRITERIA


def test_several_criteria_must_all_pass_and_report_verls_metrics() -> None:
    """verl's run_with_rollout_corr_multi_rs.sh: token_k1 with ratio bounds and seq_max_k2."""
    keep_mask, metrics = reject("token_k1,seq_max_k2", "0.6_1.6,0.4")
    # token_k1 drops row 0's token 1; seq_max_k2 drops all of row 0 (max 0.5 > 0.4)
    assert keep_mask.tolist() == ROW_0
    k1, k2 = "rollout_corr/rollout_rs_token_k1", "rollout_corr/rollout_rs_seq_max_k2"
    expected = {
        # token_k1 over the 4 valid tokens (−0.5, 1, 0, −0.2): mean 0.075; above ln 1.6: 1; below ln 0.6: 0
        f"{k1}_mean": 0.075, f"{k1}_max": 1.0, f"{k1}_min": -0.5, f"{k1}_fraction_high": 0.25,
        f"{k1}_fraction_low": 0.0, f"{k1}_masked_fraction": 0.25, f"{k1}_seq_masked_fraction": 0.5,
        # seq_max_k2 (0.5 | 0.02): its mean counts a response once per token, (3·0.5 + 0.02)/4 = 0.38;
        # max, min and the fractions are over the 2 non-empty responses
        f"{k2}_mean": 0.38, f"{k2}_max": 0.5, f"{k2}_min": 0.02, f"{k2}_fraction_high": 0.5,
        f"{k2}_fraction_low": 0.0, f"{k2}_masked_fraction": 0.75, f"{k2}_seq_masked_fraction": 0.5,
        # together: 3 of 4 valid tokens; 1 response of all 3 (verl divides by B)
        "rollout_corr/rollout_rs_masked_fraction": 0.75,
        "rollout_corr/rollout_rs_seq_masked_fraction": 1 / 3,
    }
    assert metrics == {k: pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in expected.items()}


def test_the_short_names_are_the_ratio_criteria() -> None:
    # token / sequence (hybridflow's first names) are token_k1 / seq_sum_k1
    assert reject("token", "0.6_1.6")[0].tolist() == TOKEN_1_OF_ROW_0
    assert reject("sequence", "0.7_1.5")[0].tolist() == ROW_0
    assert parse_rollout_rs("token,token_k1", 2.0) == (RejectionCriterion("token_k1", upper=2.0, lower=0.5),)


def test_rejection_keeps_the_mask_dtype_and_an_empty_mask_gives_zeros() -> None:
    keep_mask, _ = compute_rollout_rejection(old_logprobs=RS_OLD, rollout_logprobs=RS_ROLLOUT,
                                             response_mask=RS_MASK.bool(), criteria=parse_rollout_rs("token_k2", 0.3))
    assert keep_mask.dtype == torch.bool and keep_mask.tolist() == [[bool(v) for v in r] for r in TOKEN_1_OF_ROW_0]
    keep_mask, metrics = compute_rollout_rejection(old_logprobs=RS_OLD, rollout_logprobs=RS_ROLLOUT,
                                                   response_mask=torch.zeros(3, 3),
                                                   criteria=parse_rollout_rs("token_k1,seq_max_k3", "2,0.1"))
    assert keep_mask.abs().sum() == 0 and all(v == 0.0 for v in metrics.values())
    with pytest.raises(ValueError, match="at least one criterion"):
        compute_rollout_rejection(old_logprobs=RS_OLD, rollout_logprobs=RS_ROLLOUT, response_mask=RS_MASK, criteria=())


def test_parse_rollout_rs_reads_thresholds_as_verl() -> None:
    assert parse_rollout_rs("token_k1,seq_max_k2", "0.6_1.6,2.5") == (
        RejectionCriterion("token_k1", upper=1.6, lower=0.6), RejectionCriterion("seq_max_k2", upper=2.5))
    # one entry is shared; a k1 upper alone has lower 1/upper, or rollout_rs_threshold_lower
    assert parse_rollout_rs("token_k1, seq_mean_k3", 2.0) == (
        RejectionCriterion("token_k1", upper=2.0, lower=0.5), RejectionCriterion("seq_mean_k3", upper=2.0))
    assert parse_rollout_rs("sequence", "1.5", threshold_lower=0.9) == (
        RejectionCriterion("seq_sum_k1", upper=1.5, lower=0.9),)


@pytest.mark.parametrize(("rollout_rs", "threshold", "lower", "error"), [
    ("token_k4", 2.0, None, r"unknown rollout_rs criterion 'token_k4'.*Did you mean 'token_k"),
    ("seq_max_k1", 2.0, None, r"unknown rollout_rs criterion 'seq_max_k1'"),
    (" , ", 2.0, None, "names no criterion"),
    ("token_k1,token_k2", "1,2,3", None, "has 3 entries for the 2 criteria"),
    ("token_k2", "0.1_0.2", None, "upper bound only"),
    ("token_k1", "0_2", None, "must be finite and > 0"),
    ("token_k1", "abc", None, "'abc' .* is not a number"),
    ("token_k1", "2_1", None, "lower <= upper"),
    ("token_k3", 2.0, 0.5, "rollout_rs_threshold_lower bounds the ratio of a \\*_k1 criterion"),
    ("token_k1", "0.5_2", 0.5, "leave rollout_rs_threshold_lower unset"),
])
def test_parse_rollout_rs_names_what_is_wrong(rollout_rs: str, threshold: float | str, lower: float | None,
                                              error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_rollout_rs(rollout_rs, threshold, lower)
