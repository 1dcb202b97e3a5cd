"""The algorithm library: pure tensor functions and the registries the config names select.

torch only (no torch.distributed, no config objects), so every function runs on CPU in
milliseconds and is tested with hand-worked numbers. Registries:

- ``ADV_ESTIMATORS`` (``algorithm.adv_estimator``): ``get_adv_estimator(name)``
- ``POLICY_LOSSES`` (``actor.loss_mode``): ``get_policy_loss(name)``
- ``LOSS_AGG_MODES`` (``actor.loss_agg_mode``), ``KL_PENALTY_KINDS`` (``actor.kl_loss_type``,
  ``algorithm.kl_penalty``), ``KL_CONTROLLER_TYPES`` (``algorithm.kl_ctrl.type``).
"""

from hybridflow.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageEstimatorFn,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
    get_adv_estimator,
    register_adv_estimator,
)
from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, batch_counts
from hybridflow.algorithms.core import (
    UnknownNameError,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    suggest,
)
from hybridflow.algorithms.entropy import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_from_logits,
)
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
    PolicyLossFn,
    compute_ppo_clip_loss,
    get_policy_loss,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimatorFn",
    "FixedKLController",
    "KLController",
    "PolicyLossFn",
    "UnknownNameError",
    "agg_loss",
    "batch_counts",
    "compute_grpo_advantages",
    "compute_ppo_clip_loss",
    "compute_reinforce_plus_plus_advantages",
    "compute_rloo_advantages",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
    "suggest",
]
