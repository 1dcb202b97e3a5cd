"""Correction for the mismatch between the rollout engine's and the trainer's probabilities.

The rollout engine (vLLM, SGLang, the native sampler; bf16, other kernels) samples tokens from
π_rollout, but the trainer's policy gradient assumes they came from π_old, the same weights
evaluated by the training engine. The two differ, sometimes a lot on a few tokens, which
biases the gradient and can make training collapse (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's ``algorithm.rollout_correction``).

This module computes, from ``old_logprobs`` (trainer) and ``rollout_logprobs`` (engine), the
importance ratio ρ = π_old / π_rollout at one of two levels:

- ``token``: ρ_t per token (biased, low variance; truncated IS, "TIS");
- ``sequence``: ρ = Π_t ρ_t of the whole response, on every token of it (unbiased, high
  variance);

and returns

- ``weights``: min(ρ, ``threshold``) on masked-in tokens, 0 elsewhere, for the policy loss's
  ``rollout_is_weights``;
- ``keep_mask``: ``response_mask`` with the tokens (``token``) or whole responses
  (``sequence``) whose ρ lies outside ``rejection_band`` = (lower, upper) set to 0 (rejection
  sampling / IcePop-style masking), for the policy loss's ``response_mask``; equal to
  ``response_mask`` when ``rejection_band`` is None;
- ``metrics`` of the mismatch, all named ``rollout_corr/...``.

Weights of rejected tokens are left as they are: the keep mask removes those tokens from the
loss and from its normaliser, so the two are independent, as in verl. Everything here is
computed without gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hybridflow.algorithms.core import UnknownNameError, check_same_shape, masked_mean, unknown_name_message

ROLLOUT_CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence")

# exp(±20) is finite in fp32; a larger log-ratio only has to give a finite (truncated) weight.
LOG_RATIO_CLAMP = 20.0


class RolloutCorrection(NamedTuple):
    """What ``compute_rollout_correction`` returns (unpacks as ``weights, keep_mask, metrics``)."""

    weights: torch.Tensor  # (B, R) truncated IS weights, 0 on masked-out tokens
    keep_mask: torch.Tensor  # (B, R) response_mask with rejected tokens set to 0, its dtype
    metrics: dict[str, float]


def _validate(level: str, threshold: float, rejection_band: tuple[float, float] | None) -> None:
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise UnknownNameError(unknown_name_message("rollout correction level", level, ROLLOUT_CORRECTION_LEVELS))
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold (largest importance weight kept) must be finite and > 0, got {threshold}")
    if rejection_band is not None:
        if len(rejection_band) != 2:
            raise ValueError(f"rejection_band must be (lower, upper), got {rejection_band!r}")
        lower, upper = (float(b) for b in rejection_band)
        if not (math.isfinite(lower) and math.isfinite(upper) and 0 < lower <= upper):
            raise ValueError(f"rejection_band must satisfy 0 < lower <= upper (finite), got {rejection_band!r}")


@torch.no_grad()
def compute_rollout_correction(
    *,
    old_logprobs: torch.Tensor,  # (B, R) trainer's logprobs of the sampled tokens
    rollout_logprobs: torch.Tensor,  # (B, R) rollout engine's logprobs of the same tokens
    response_mask: torch.Tensor,  # (B, R)
    level: str = "token",
    threshold: float = 2.0,
    rejection_band: tuple[float, float] | None = None,
) -> RolloutCorrection:
    """Truncated importance weights π_old/π_rollout, a rejection mask and mismatch metrics.

    Args:
        old_logprobs: logπ_old of each response token, recomputed by the trainer.
        rollout_logprobs: logπ_rollout of the same tokens, reported by the rollout engine.
        response_mask: 1 on tokens the policy produced.
        level: ``token`` or ``sequence`` (see the module docstring); applies to both the
            weights and the rejection.
        threshold: upper bound of the weights (verl's ``rollout_is_threshold``, default 2.0).
        rejection_band: (lower, upper) bounds on ρ; tokens (or responses) outside are rejected.
            None: nothing is rejected.

    Returns:
        ``RolloutCorrection(weights, keep_mask, metrics)``. Metrics (token means over masked-in
        tokens unless said otherwise):

        - ``rollout_corr/log_ratio_abs_mean``, ``rollout_corr/log_ratio_abs_max``: |logπ_old −
          logπ_rollout| per token, whatever the level: the size of the mismatch (the
          log-ratio is clamped to ±20 in all metrics, so they stay finite);
        - ``rollout_corr/kl``: mean of logπ_rollout − logπ_old (k1 estimate of
          KL(π_rollout‖π_old), verl's name); ``rollout_corr/k3_kl``: mean of ρ − log ρ − 1
          per token (k3, ≥ 0);
        - ``rollout_corr/rollout_is_mean``: mean of ``weights``;
        - ``rollout_corr/truncated_fraction``: tokens whose (level) ρ exceeded ``threshold``;
        - ``rollout_corr/outside_band_fraction``: tokens whose (level) ρ lies outside
          ``rejection_band``, or outside (1/threshold, threshold) when no band is given, so
          the mismatch is visible before rejection is turned on;
        - ``rollout_corr/rollout_rs_masked_fraction``: tokens rejected (0 without a band);
        - ``rollout_corr/rollout_rs_seq_masked_fraction``: responses with a rejected token,
          over all B responses (verl's definition).

        An all-zero mask gives zero weights, an all-zero keep mask and zero metrics.

    Raises:
        ValueError: shapes differ, a masked-in log-ratio is nan, or a bound is invalid.
        UnknownNameError: ``level`` is not one of ``ROLLOUT_CORRECTION_LEVELS``.
    """
    _validate(level, threshold, rejection_band)
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs must be (B, R), got shape {tuple(old_logprobs.shape)}")
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    mask = response_mask != 0
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    log_ratio = torch.where(mask, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), zero)  # (B, R)
    if bool(torch.isnan(log_ratio).any()):
        rows = torch.isnan(log_ratio).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(
            f"old_logprobs - rollout_logprobs is nan on masked-in tokens of rows {rows[:10]}"
            f"{' ...' if len(rows) > 10 else ''} (nan logprobs, or -inf in both)"
        )

    # The log-ratio the weight and the band are judged on: per token, or the response's sum.
    if level == "token":
        level_log_ratio = log_ratio
    else:
        level_log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)  # masked are 0
    # A token one engine deems impossible has an infinite log-ratio; a response with one in each
    # direction has an undefined ratio (inf − inf): it gets weight 0 and lies outside any band.
    undefined = torch.isnan(level_log_ratio)
    raw = torch.exp(level_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = torch.where(mask & ~undefined, raw.clamp(max=threshold), zero)  # (B, R)

    lower, upper = rejection_band if rejection_band is not None else (1.0 / threshold, threshold)
    outside = mask & (undefined | (level_log_ratio < math.log(lower)) | (level_log_ratio > math.log(upper)))
    keep = mask & ~outside if rejection_band is not None else mask
    keep_mask = keep.to(response_mask.dtype)

    mask_f = mask.to(dtype)
    # Metrics read the clamped log-ratio, so one impossible token cannot make them infinite.
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    abs_log_ratio = clamped.abs()
    rejected = mask & ~keep

    def fraction(flags: torch.Tensor) -> float:
        return float(masked_mean(flags.to(dtype), mask_f))

    metrics = {
        "rollout_corr/log_ratio_abs_mean": float(masked_mean(abs_log_ratio, mask_f)),
        "rollout_corr/log_ratio_abs_max": float(abs_log_ratio.max()) if abs_log_ratio.numel() else 0.0,
        "rollout_corr/kl": float(masked_mean(-clamped, mask_f)),
        "rollout_corr/k3_kl": float(masked_mean(torch.exp(clamped) - clamped - 1.0, mask_f)),
        "rollout_corr/rollout_is_mean": float(masked_mean(weights, mask_f)),
        "rollout_corr/truncated_fraction": fraction(level_log_ratio > math.log(threshold)),
        "rollout_corr/outside_band_fraction": fraction(outside),
        "rollout_corr/rollout_rs_masked_fraction": fraction(rejected),
        "rollout_corr/rollout_rs_seq_masked_fraction": (
            float(rejected.any(dim=-1).to(dtype).mean()) if rejected.shape[0] else 0.0
        ),
    }
    return RolloutCorrection(weights, keep_mask, metrics)


@torch.no_grad()
def compute_rollout_is_weights(
    *,
    old_logprobs: torch.Tensor,  # (B, R)
    rollout_logprobs: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    rollout_is: str | None,
    threshold: float,
    bypass_mode: bool = False,
) -> torch.Tensor | None:
    """The truncated importance weights of the configured correction, for an advantage estimator
    (``AdvantageInputs.rollout_is_weights``, the optimal-token-baseline ones), or None.  # (B, R)

    The same weights the actor's policy loss multiplies in (``compute_rollout_correction``'s
    ``weights`` at ``rollout_is`` level, truncated at ``threshold``), computed before advantages
    from the same old logprobs, as verl's trainer does when ``algorithm.rollout_correction`` is on.
    None, so the estimator leaves every token unscaled (verl's behaviour), when importance weights
    are off (``rollout_is`` None) or in bypass mode: there the rollout's logprobs *are* π_old (ρ = 1
    before the update) and the loss weights against the current policy inside its own computation.
    Rejection (``rollout_rs``) does not change these weights: it removes tokens from the loss only.
    """
    if rollout_is is None or bypass_mode:
        return None
    return compute_rollout_correction(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                                      response_mask=response_mask, level=rollout_is, threshold=threshold).weights
