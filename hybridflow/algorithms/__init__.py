"""The algorithm library: pure tensor functions and the registries the config names select.

torch only (no torch.distributed, no config objects), so every function runs on CPU in
milliseconds and is tested with hand-worked numbers. Registries:

- ``ADV_ESTIMATORS`` (``algorithm.adv_estimator``): ``get_adv_estimator(name)``, each
  ``fn(AdvantageInputs, params) -> AdvantageOutputs``
- ``POLICY_LOSSES`` (``actor.policy_loss.loss_mode``): ``get_policy_loss(name)``, each
  ``fn(LossInputs, params) -> (loss, metrics)``
- ``LOSS_AGG_MODES`` (``actor.loss_agg_mode``), ``KL_PENALTY_KINDS`` (``actor.kl_loss_type``,
  ``algorithm.kl_penalty``), ``KL_CONTROLLER_TYPES`` (``algorithm.kl_ctrl.type``),
  ``ROLLOUT_CORRECTION_LEVELS``.

Plain functions: ``place_outcome_rewards`` and ``apply_kl_penalty`` (score to token rewards),
``select_varied_groups`` (DAPO's dynamic sampling), ``compute_value_loss`` (critic), ``compute_rollout_correction`` (importance
weights and rejection between rollout-engine and trainer logprobs), ``compute_rollout_rejection`` (verl's
``rollout_rs`` criteria), ``compute_distillation_advantages`` (on-policy distillation: the
per-token reverse KL to a teacher as an advantage), ``compute_implicit_token_rewards`` and
``implicit_prm_loss`` (PRIME's implicit process reward model; its estimator is ``prime``).
"""

from hybridflow.algorithms.advantages import (
    ADV_ESTIMATORS,
    OPTIONAL_ESTIMATOR_INPUTS,
    AdvantageEstimatorFn,
    AdvantageInputs,
    AdvantageOutputs,
    build_estimator_params,
    compute_gae_advantages,
    compute_gdpo_advantages,
    compute_gpg_advantages,
    compute_grpo_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    estimator_needs,
    get_adv_estimator,
    register_adv_estimator,
)
from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, batch_counts
from hybridflow.algorithms.bypass import BYPASS_LOSS_TYPES, compute_bypass_mode_loss
from hybridflow.algorithms.core import (
    UnknownNameError,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    suggest,
)
from hybridflow.algorithms.distillation import Distilled, compute_distillation_advantages, compute_reverse_kl
from hybridflow.algorithms.divergence_losses import compute_dppo_kl_loss, compute_dppo_tv_loss, compute_dro_loss
from hybridflow.algorithms.entropy import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)
from hybridflow.algorithms.filtering import compute_varied_group_mask, select_varied_groups
from hybridflow.algorithms.kl import (
    KL_CONTROLLER_TYPES,
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    get_kl_controller,
    kl_penalty,
)
from hybridflow.algorithms.policy_loss import (
    POLICY_LOSSES,
    LossInputs,
    PolicyLossFn,
    build_policy_loss_params,
    compute_cispo_loss,
    compute_clip_cov_loss,
    compute_geo_mean_loss,
    compute_gpg_loss,
    compute_gspo_loss,
    compute_kl_cov_loss,
    compute_ppo_clip_loss,
    compute_sapo_loss,
    get_policy_loss,
    register_policy_loss,
)
from hybridflow.algorithms.prime import (
    PrimeParams,
    compute_implicit_token_rewards,
    compute_prime_advantages,
    implicit_prm_loss,
)
from hybridflow.algorithms.rollout_correction import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_RS_CRITERIA,
    CorrectedRollout,
    RejectionCriterion,
    Rejection,
    RolloutCorrection,
    RolloutCorrectionSettings,
    compute_rollout_correction,
    compute_rollout_rejection,
    correct_rollout,
    parse_rollout_rs,
)
from hybridflow.algorithms.token_baseline import (
    compute_optimal_token_baseline_advantages,
    compute_tir_optimal_token_baseline_advantages,
)
from hybridflow.algorithms.token_rewards import KLPenalised, apply_kl_penalty, place_outcome_rewards
from hybridflow.algorithms.value import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "BYPASS_LOSS_TYPES",
    "KL_CONTROLLER_TYPES",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "OPTIONAL_ESTIMATOR_INPUTS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_RS_CRITERIA",
    "AdaptiveKLController",
    "AdvantageEstimatorFn",
    "AdvantageInputs",
    "AdvantageOutputs",
    "FixedKLController",
    "KLController",
    "KLPenalised",
    "LossInputs",
    "PolicyLossFn",
    "RejectionCriterion",
    "Rejection",
    "CorrectedRollout",
    "RolloutCorrection",
    "RolloutCorrectionSettings",
    "UnknownNameError",
    "agg_loss",
    "apply_kl_penalty",
    "batch_counts",
    "build_estimator_params",
    "build_policy_loss_params",
    "compute_bypass_mode_loss",
    "compute_cispo_loss",
    "compute_clip_cov_loss",
    "compute_dppo_kl_loss",
    "Distilled",
    "compute_distillation_advantages",
    "compute_reverse_kl",
    "compute_dppo_tv_loss",
    "compute_dro_loss",
    "compute_gae_advantages",
    "compute_gdpo_advantages",
    "compute_geo_mean_loss",
    "compute_gpg_advantages",
    "compute_gpg_loss",
    "compute_grpo_advantages",
    "compute_grpo_passk_advantages",
    "compute_gspo_loss",
    "compute_kl_cov_loss",
    "compute_opo_advantages",
    "compute_optimal_token_baseline_advantages",
    "compute_ppo_clip_loss",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "PrimeParams",
    "compute_implicit_token_rewards",
    "compute_prime_advantages",
    "implicit_prm_loss",
    "compute_rollout_correction",
    "correct_rollout",
    "compute_rollout_rejection",
    "compute_sapo_loss",
    "compute_tir_optimal_token_baseline_advantages",
    "compute_value_loss",
    "compute_varied_group_mask",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "estimator_needs",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "parse_rollout_rs",
    "place_outcome_rewards",
    "register_adv_estimator",
    "register_policy_loss",
    "select_varied_groups",
    "suggest",
    "sum_pi_squared_from_logits",
]
