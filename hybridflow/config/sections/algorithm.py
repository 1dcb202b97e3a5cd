"""The ``algorithm`` section: advantages, in-reward KL, DAPO filtering, rollout correction."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import f, sub


@dataclass
class KLControlConfig:
    type: str = f("fixed", "fixed | adaptive.", choices=("fixed", "adaptive"))
    kl_coef: float = f(0.001, "Initial in-reward KL coefficient.")
    horizon: int = f(10000, "Adaptive controller horizon.")
    target_kl: float = f(0.1, "Adaptive controller target KL.")


@dataclass
class FilterGroupsConfig:
    enable: bool = f(
        False,
        "DAPO dynamic sampling: drop groups whose samples all got the same metric (no learning signal) "
        "and generate more until data.train_batch_size prompts remain.",
    )
    metric: str = f(
        "acc",
        "What must vary inside a group: acc (the scorer's reward) | score (after reward shaping).",
        choices=("acc", "score"),
    )
    max_num_gen_batches: int = f(
        10,
        "Most generation rounds per step (0: unlimited). When reached, the step trains on the groups kept "
        "so far and reports filter/exhausted=1.",
    )


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = f(
        None,
        "Importance weights pi_old/pi_rollout multiplied into the policy loss: null (off) | token | sequence.",
        choices=("token", "sequence"),
    )
    rollout_is_threshold: float = f(2.0, "Upper truncation of the importance weights (TIS).")
    rollout_is_batch_normalize: bool = f(
        False, "Divide the truncated importance weights by their mean over the batch, so they average 1 "
        "(self-normalised IS): over valid tokens (rollout_is=token) or over responses (sequence); the "
        "rollout_corr/rollout_is_batch_norm_factor metric is that mean. In bypass mode over each micro-batch, "
        "as verl's loss does.",
    )
    rollout_rs: str | None = f(
        None,
        "Rejection (verl's): a comma-separated list of criteria, all of which a token (token_*) or a whole "
        "response (seq_*) must pass. Each bounds a KL estimator between pi_rollout and pi_old per token, "
        "k1 = log(pi_rollout/pi_old), k2 = (k1)^2 / 2, k3 = pi_old/pi_rollout - 1 + k1 (log-ratio clamped to "
        "+-20): token_k1|k2|k3, seq_sum_k1|k2|k3 (sum over the response), seq_mean_k1|k2|k3 (mean), "
        "seq_max_k2|k3 (largest token). null: off. token and sequence are short for token_k1 and seq_sum_k1.",
    )
    rollout_rs_threshold: float | str = f(
        2.0, "Bounds of the rollout_rs criteria: one shared entry or one per criterion, comma-separated "
        "('0.6_1.6,2.5'). A k1 entry bounds the ratio pi_rollout/pi_old: 'lower_upper', or upper alone (lower "
        "is rollout_rs_threshold_lower, else 1/upper); a k2/k3 entry is the divergence's upper bound.",
    )
    rollout_rs_threshold_lower: float | None = f(
        None, "Lower bound of the k1 criteria's ratio where rollout_rs_threshold gives the upper one alone. "
        "None: 1 / upper.")
    bypass_mode: bool = f(
        False, "Use the rollout engine's logprobs as pi_old instead of recomputing them (verl's bypass mode: two "
        "policies, no old-logprob forward). The policy loss becomes bypass_mode: loss_type's loss on pi_theta / "
        "pi_rollout, with rollout_is weights and rollout_rs rejection computed against the current policy.",
    )
    loss_type: str = f(
        "ppo_clip", "Bypass mode's loss: ppo_clip (PPO clip on pi_theta / pi_rollout, no extra weights) | reinforce "
        "(-w * log pi * A with the rollout_is weights, or plain REINFORCE without rollout_is).",
        choices=("ppo_clip", "reinforce"),
    )


@dataclass
class OnlineDPOConfig:
    """Online DPO (``actor.loss=dpo``): each step's samples paired by their rewards, the pairs trained with the
    DPO loss. The loss keys are TRL's, as ``hybridflow dpo``'s (the ``dpo`` section) are."""

    loss_type: str = f(
        "sigmoid", "sigmoid: -log σ(β·Δ), Δ the chosen-minus-rejected log-ratio margin to the reference (DPO; cDPO "
        "with label_smoothing > 0). ipo: (Δ/|y| - 1/(2β))². robust: rDPO under label noise label_smoothing.",
        choices=("sigmoid", "ipo", "robust"),
    )
    beta: float = f(0.1, "β > 0: the strength of the pull towards the reference policy (larger: closer to it).")
    label_smoothing: float = f(0.0, "ε in [0, 0.5): the assumed fraction of wrongly ordered pairs (cDPO, rDPO).")
    reference_free: bool = f(
        False, "No reference model: its log-probabilities are taken as 0 (no reference ranks are started).",
    )
    pairs: str = f(
        "best_worst", "Pairs per prompt group: best_worst (its highest-rewarded sample against its lowest, one pair) "
        "| all (every two samples whose rewards differ by more than margin). A group whose rewards do not spread "
        "by more than margin gives no pair (counted: pairs/groups_without_pair).",
        choices=("best_worst", "all"),
    )
    margin: float = f(0.0, "≥ 0: a pair's chosen reward must exceed its rejected reward by more than this.")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = f(
        "grpo",
        "Advantage estimator: grpo | gdpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | "
        "grpo_passk | opo | gpg | gae (trains a critic: the critic.* keys) | optimal_token_baseline | "
        "tir_optimal_token_baseline (these two always run the old-logprob forward, which then also computes each "
        "response token's sum_pi_squared, sum_v pi(v)^2, as verl's actor.calculate_sum_pi_squared; with "
        "algorithm.rollout_correction.rollout_is set, each token's weight is scaled by its squared importance weight), "
        "prime (PRIME: RLOO on the outcome and on an implicit process reward model trained online beside the "
        "policy, the prime.* keys) or package.module:function.",
    )
    gdpo_reward_keys: list[str] = f(
        [], "gdpo: the reward components, numbers the reward function returns in its dict beside 'score' (acc is "
        "always there: the raw score); each is normalised within its group on its own, as verl.",
    )
    gdpo_reward_weights: list[float] | None = f(
        None, "gdpo: one weight per gdpo_reward_keys entry for the weighted sum of the normalised components. "
        "null: all 1.",
    )
    norm_adv_by_std_in_grpo: bool = f(True, "Divide GRPO advantages by the group std (false: Dr.GRPO).")
    reward_dpo_coef: float = f(
        5.0, "prime: the weight of the implicit process reward model's token rewards in the advantages (verl's "
        "PRIME recipe key; each reward source gets its own leave-one-out baseline, then the returns are summed and "
        "whitened, so only its ratio to reward_gt_coef matters).",
    )
    reward_gt_coef: float = f(5.0, "prime: the weight of the outcome reward (the verifier's score) in the advantages "
                                    "(verl's PRIME recipe key).")
    gamma: float = f(1.0, "Discount factor.")
    lam: float = f(1.0, "GAE lambda.")
    use_kl_in_reward: bool = f(False, "Subtract a KL penalty from token rewards (loads a reference model).")
    kl_penalty: str = f("kl", "KL estimator for the in-reward penalty.")
    kl_ctrl: KLControlConfig = sub(KLControlConfig, "In-reward KL coefficient controller.")
    filter_groups: FilterGroupsConfig = sub(FilterGroupsConfig, "DAPO dynamic sampling.")
    online_dpo: OnlineDPOConfig = sub(OnlineDPOConfig, "Online DPO's pairs and loss (used with actor.loss=dpo).")
    rollout_correction: RolloutCorrectionConfig = sub(
        RolloutCorrectionConfig,
        "Correct for the rollout engine's probabilities differing from the trainer's (metrics are logged "
        "whenever old logprobs are computed).",
    )
