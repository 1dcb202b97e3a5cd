"""The critic's clipped value loss (PPO), verl's ``compute_value_loss``.

The critic regresses V(s_t) onto the returns of the rollout (``gae`` gives returns = A + V).
Like the policy, it must not move too far from the values the advantages were computed with
in one PPO update, so the new prediction is clipped to V_old ± ``cliprange_value`` and the
larger (pessimistic) of the two squared errors is minimised.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import Count, agg_loss
from hybridflow.algorithms.core import check_same_shape, masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,  # (B, R) values predicted now (with grad)
    returns: torch.Tensor,  # (B, R) regression targets
    values: torch.Tensor,  # (B, R) values predicted at rollout time (V_old)
    response_mask: torch.Tensor,  # (B, R)
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """½·agg(max((v − R)², (clip(v, V_old ± cliprange_value) − R)²)) and its metrics.

    Args:
        vpreds: the critic's current predictions.
        returns: targets, e.g. the ``returns`` of the ``gae`` estimator.
        values: the critic's predictions when the advantages were computed.
        response_mask: 1 on tokens that enter the loss.
        cliprange_value: how far a prediction may move from ``values`` before its error stops
            shrinking the loss (verl's ``critic.cliprange_value``, default 0.5). 0 pins the
            clipped prediction to ``values``.
        loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor, dp_size: as in
            ``agg_loss`` (global counts make the loss independent of the micro-batch split).

    Returns:
        (loss, metrics) with ``critic/vf_clipfrac`` = fraction of masked-in tokens where the
        clipped error was the larger one, and ``critic/vpred_mean`` = masked mean of
        ``vpreds`` (verl's names).

    Positions with mask 0 are replaced by 0 before any arithmetic, so padding garbage reaches
    neither the loss nor the gradient.
    """
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    if not cliprange_value >= 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    mask = response_mask != 0
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    vpreds = torch.where(mask, vpreds, zero)
    returns = torch.where(mask, returns.detach().to(vpreds.dtype), zero)
    values = torch.where(mask, values.detach().to(vpreds.dtype), zero)

    vpreds_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped_error = (vpreds - returns).square()
    clipped_error = (vpreds_clipped - returns).square()
    mask_f = mask.to(vpreds.dtype)
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped_error, clipped_error),
        mask_f,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
        dp_size=dp_size,
    )
    with torch.no_grad():
        metrics = {
            "critic/vf_clipfrac": float(masked_mean((clipped_error > unclipped_error).to(mask_f.dtype), mask_f)),
            "critic/vpred_mean": float(masked_mean(vpreds.detach(), mask_f)),
        }
    return loss, metrics
