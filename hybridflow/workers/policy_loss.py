"""The actor's policy loss and rollout correction as configured: the one place where the flat
``actor.*`` and ``algorithm.rollout_correction.*`` keys become a loss's typed parameters and the
settings of ``hybridflow.algorithms.correct_rollout``."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridflow.algorithms import (
    PolicyLossFn,
    RejectionCriterion,
    RolloutCorrectionSettings,
    build_policy_loss_params,
    get_policy_loss,
    parse_rollout_rs,
)
from hybridflow.config.schema import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig


def build_actor_policy_loss(cfg: ActorConfig, rc: RolloutCorrectionConfig) -> tuple[PolicyLossFn, Any]:
    """The configured policy loss and its typed params: the one place where the flat config keys
    become a loss's parameters.

    Bypass mode replaces the loss (config validation allows it only over vanilla), as in verl.
    The actor's shared keys (clip ratios, aggregation, rollout correction) fill whichever fields
    the loss has. ``actor.policy_loss.*`` keys belong to one loss each: every one of them fills
    its field, and one set away from its default under a loss without that field raises a
    ValueError naming it (``tau_pos`` with loss_mode=vanilla is a mistake, not a no-op).
    """
    mode = "bypass_mode" if rc.bypass_mode else cfg.policy_loss.loss_mode
    fn = get_policy_loss(mode)
    shared = dict(
        clip_ratio_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
        clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
        bypass_loss_type=rc.loss_type, rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs_criteria=rollout_rs_criteria(rc),
    )
    mode_keys = {f.name: getattr(cfg.policy_loss, f.name) for f in dataclasses.fields(cfg.policy_loss)
                 if f.name != "loss_mode"}
    defaults = PolicyLossConfig()
    changed = {k: v for k, v in mode_keys.items() if v != getattr(defaults, k)}
    return fn, build_policy_loss_params(fn, shared={**shared, **mode_keys}, specific=changed, name=mode)


def rollout_rs_criteria(rc: RolloutCorrectionConfig) -> tuple[RejectionCriterion, ...]:
    """The configured rejection criteria (``algorithm.rollout_correction.rollout_rs`` with its
    thresholds, as verl reads them); () without rejection. ValueError on a bad spec (set-up reports
    it as a config error on the key)."""
    if rc.rollout_rs is None:
        return ()
    return parse_rollout_rs(rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower)


def rollout_correction_settings(rc: RolloutCorrectionConfig) -> RolloutCorrectionSettings:
    """``algorithm.rollout_correction`` as ``correct_rollout`` takes it (rejection criteria parsed)."""
    return RolloutCorrectionSettings(
        rollout_is=rc.rollout_is, threshold=rc.rollout_is_threshold, batch_normalize=rc.rollout_is_batch_normalize,
        bypass_mode=rc.bypass_mode, criteria=rollout_rs_criteria(rc),
    )
