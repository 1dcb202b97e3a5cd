"""The algorithm's keys together: estimators and group sizes, KL in loss and reward, GDPO, policy-loss
modes, DAPO filtering, the overlong buffer and rollout correction."""

from __future__ import annotations

from hybridflow.config.checks.report import Report
from hybridflow.config.schema import Config
from hybridflow.config.sections.algorithm import OnlineDPOConfig


GROUP_ESTIMATORS_NEEDING_N2 = {"rloo": "error", "grpo": "warning", "gdpo": "warning"}
"""Group-baseline estimators and what ``rollout.n=1`` means for them. RLOO's leave-one-out
baseline is undefined for a single sample (an error). GRPO with a single sample takes the group
mean as 0 and std as 1, so the advantage is reward / (1 + 1e-6): it runs, but learns with no
baseline at all (a warning)."""


def check_algorithm(cfg: Config, report: Report) -> None:
    estimator, n = cfg.algorithm.adv_estimator, cfg.rollout.n
    severity = GROUP_ESTIMATORS_NEEDING_N2.get(estimator)
    if severity is not None and n == 1:
        if severity == "error":
            report.error(
                f"rollout.n=1 with algorithm.adv_estimator={estimator}: the leave-one-out baseline needs at "
                f"least 2 samples per prompt; use rollout.n >= 2 (e.g. 4 or 8)"
            )
        else:
            report.warn(
                f"rollout.n=1 with algorithm.adv_estimator={estimator}: each group holds one sample, so the "
                f"group mean is taken as 0 and the std as 1 and the advantage is just reward / (1 + 1e-6), "
                f"with no baseline; use rollout.n >= 2 (GRPO usually uses 4 to 16)"
            )
    if cfg.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        report.warn(
            "both actor.use_kl_loss and algorithm.use_kl_in_reward are true: the KL to the reference "
            "model is penalised twice (in the loss and in the reward); usually only one is wanted"
        )
    if cfg.algorithm.kl_ctrl.type == "adaptive" and not cfg.algorithm.use_kl_in_reward:
        report.warn("algorithm.kl_ctrl.type=adaptive has no effect while algorithm.use_kl_in_reward is false")
    if not cfg.algorithm.norm_adv_by_std_in_grpo and estimator not in ("grpo", "gdpo", "grpo_passk"):
        report.warn(
            f"algorithm.norm_adv_by_std_in_grpo=false has no effect with algorithm.adv_estimator={estimator} "
            f"(it only changes grpo, gdpo and grpo_passk)"
        )
    _check_gdpo(cfg, report)
    _check_policy_loss_modes(cfg, report)
    _check_dapo_and_correction(cfg, report)
    _check_online_dpo(cfg, report)
    if cfg.actor.loss_scale_factor is not None and cfg.actor.loss_agg_mode != "seq-mean-token-sum-norm":
        report.warn(
            f"actor.loss_scale_factor={cfg.actor.loss_scale_factor} has no effect with "
            f"actor.loss_agg_mode={cfg.actor.loss_agg_mode} (only seq-mean-token-sum-norm uses it)"
        )


def _check_gdpo(cfg: Config, report: Report) -> None:
    alg = cfg.algorithm
    if alg.adv_estimator == "gdpo" and not alg.gdpo_reward_keys:
        report.error(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the numbers your reward function "
            "returns beside 'score' to normalise one by one (e.g. [acc,format_reward])"
        )
    weights = alg.gdpo_reward_weights
    if weights is not None and len(weights) != len(alg.gdpo_reward_keys):
        report.error(
            f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(alg.gdpo_reward_keys)} "
            f"algorithm.gdpo_reward_keys; give one weight per key (or null: all 1)"
        )


def _check_policy_loss_modes(cfg: Config, report: Report) -> None:
    pl, rc = cfg.actor.policy_loss, cfg.algorithm.rollout_correction
    if pl.loss_mode == "dro" and (pl.dro_beta is None or pl.dro_beta <= 0):
        report.error(f"actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0, got {pl.dro_beta}")
    if pl.loss_mode == "bypass_mode" and not rc.bypass_mode:
        report.error(
            "actor.policy_loss.loss_mode=bypass_mode is chosen by algorithm.rollout_correction.bypass_mode=true "
            "(which also makes the rollout's logprobs pi_old); set that instead"
        )
    if rc.bypass_mode and pl.loss_mode not in ("vanilla", "bypass_mode"):
        # verl silently replaces the loss; a config that names another one wants something else.
        report.error(
            f"algorithm.rollout_correction.bypass_mode=true replaces the policy loss by bypass_mode "
            f"(algorithm.rollout_correction.loss_type=ppo_clip|reinforce), but actor.policy_loss.loss_mode="
            f"{pl.loss_mode}; leave loss_mode at vanilla or turn bypass mode off"
        )


def _check_dapo_and_correction(cfg: Config, report: Report) -> None:
    fg, ob, d = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer, cfg.data
    if fg.enable:
        if fg.max_num_gen_batches < 0:
            report.error(f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 0 (0: unlimited)")
        if cfg.rollout.n == 1:
            report.warn("algorithm.filter_groups.enable=true with rollout.n=1: a group of one is always kept, "
                        "so nothing is filtered")
        if d.gen_batch_size is not None and d.gen_batch_size < 1:
            report.error(f"data.gen_batch_size={d.gen_batch_size} must be >= 1 (or null: data.train_batch_size)")
    elif d.gen_batch_size is not None and d.gen_batch_size != d.train_batch_size:
        report.warn(f"data.gen_batch_size={d.gen_batch_size} has no effect while algorithm.filter_groups.enable=false")
    if ob.enable:
        # The buffer ends at verl's max_resp_len when given, else at the response budget.
        end, end_key = ((ob.max_response_length, "reward.overlong_buffer.max_response_length")
                        if ob.max_response_length is not None else (d.max_response_length, "data.max_response_length"))
        if end < 1:
            report.error(f"{end_key}={end} must be >= 1")
        elif ob.len is not None and not 0 < ob.len <= end:
            report.error(f"reward.overlong_buffer.len={ob.len} must be in [1, {end_key}={end}]")
        if ob.penalty_factor < 0:
            report.error(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is_threshold <= 0:
        report.error(f"algorithm.rollout_correction.rollout_is_threshold={rc.rollout_is_threshold} must be > 0")
    # A threshold text ('0.6_1.6,2.5') is checked against the criteria by set-up (parse_rollout_rs).
    upper = rc.rollout_rs_threshold
    if rc.rollout_rs is not None and isinstance(upper, float):
        lower = rc.rollout_rs_threshold_lower if rc.rollout_rs_threshold_lower is not None else 1 / max(upper, 1e-12)
        if not 0 < lower <= upper:
            report.error(
                f"algorithm.rollout_correction: need 0 < rollout_rs_threshold_lower ({lower:g}) <= "
                f"rollout_rs_threshold ({upper:g})"
            )
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        report.warn("algorithm.rollout_correction.rollout_is_batch_normalize=true has no effect without "
                    "algorithm.rollout_correction.rollout_is (no importance weights to normalise)")


def _check_online_dpo(cfg: Config, report: Report) -> None:
    """``actor.loss=dpo``: what its pairs need, and the keys of the policy-gradient path it cannot honour."""
    o, a, alg = cfg.algorithm.online_dpo, cfg.actor, cfg.algorithm
    if a.loss != "dpo":
        if o != OnlineDPOConfig():
            report.warn("algorithm.online_dpo.* is set but has no effect while actor.loss=policy_gradient "
                        "(set actor.loss=dpo for online DPO)")
        return
    if not o.beta > 0:
        report.error(f"algorithm.online_dpo.beta={o.beta} must be > 0 (the loss scales the log-ratio margin by it)")
    if not 0.0 <= o.label_smoothing < 0.5:
        report.error(f"algorithm.online_dpo.label_smoothing={o.label_smoothing} must be in [0, 0.5) (a flip rate of "
                     f"0.5 or more makes the pairs carry no preference)")
    if o.margin < 0:
        report.error(f"algorithm.online_dpo.margin={o.margin} must be >= 0")
    if cfg.rollout.n < 2:
        report.error(f"actor.loss=dpo needs rollout.n >= 2: pairs are made of a prompt's samples, and rollout.n="
                     f"{cfg.rollout.n} gives one per prompt (use 4 to 8)")
    # The policy-gradient path's keys that online DPO has no place for: refused rather than ignored.
    refused = {
        "algorithm.adv_estimator=gae": alg.adv_estimator == "gae",
        "algorithm.use_kl_in_reward=true": alg.use_kl_in_reward,
        "actor.use_kl_loss=true": a.use_kl_loss,
        f"actor.ulysses_sequence_parallel_size={a.ulysses_sequence_parallel_size}": a.ulysses_sequence_parallel_size > 1,
        "trainer.data_plane=refs": cfg.trainer.data_plane == "refs",
        "distillation.enable=true": cfg.distillation.enable,
        "algorithm.rollout_correction (rollout_is, rollout_rs or bypass_mode)": bool(
            alg.rollout_correction.rollout_is or alg.rollout_correction.rollout_rs or alg.rollout_correction.bypass_mode),
    }
    why = {
        "algorithm.adv_estimator=gae": "it trains a critic that DPO never reads",
        "algorithm.use_kl_in_reward=true": "DPO's pull to the reference is algorithm.online_dpo.beta",
        "actor.use_kl_loss=true": "DPO's pull to the reference is algorithm.online_dpo.beta",
        "trainer.data_plane=refs": "pairs are cut from the tokens on the controller",
        "distillation.enable=true": "the teachers' KL joins the advantages, which DPO does not use",
        "algorithm.rollout_correction (rollout_is, rollout_rs or bypass_mode)":
            "DPO's loss has no importance ratio to correct (it learns from samples of any policy)",
    }
    for key, on in refused.items():
        if on:
            reason = why.get(key, "a pair's two sides must stay on one rank, whole")
            report.error(f"actor.loss=dpo cannot run with {key}: {reason}")
    if a.entropy_coeff != 0:
        report.warn(f"actor.entropy_coeff={a.entropy_coeff} has no effect with actor.loss=dpo")
