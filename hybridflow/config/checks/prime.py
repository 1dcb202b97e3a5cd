"""The ``prime`` section and ``algorithm.adv_estimator=prime``: ranges, and the combinations PRIME cannot run
with, each refused by its key with the reason. Whether ``prime.model.path`` shares the policy's tokenizer needs
both loaded: set-up checks it (``controller/prime.prepare_prime_model``)."""

from __future__ import annotations

from dataclasses import fields

from hybridflow.config.checks.report import Report
from hybridflow.config.schema import Config
from hybridflow.config.sections.prime import PrimeConfig

PRIME = "prime"


def prime_enabled(cfg: Config) -> bool:
    """Whether the run trains the implicit PRM: its estimator is PRIME's."""
    return cfg.algorithm.adv_estimator == PRIME


def check_prime(cfg: Config, report: Report) -> None:
    p, alg = cfg.prime, cfg.algorithm
    if not prime_enabled(cfg):
        if p != PrimeConfig():
            changed = [f"prime.{field.name}" for field in fields(p) if getattr(p, field.name) != getattr(PrimeConfig(), field.name)]
            report.warn(f"{', '.join(changed)} set but algorithm.adv_estimator={alg.adv_estimator}: the implicit PRM is "
                        "trained only with algorithm.adv_estimator=prime")
        return
    if p.beta <= 0:
        report.error(f"prime.beta={p.beta} must be > 0 (the scale of the implicit rewards and of their loss)")
    if p.micro_batch_size_per_gpu < 1:
        report.error(f"prime.micro_batch_size_per_gpu={p.micro_batch_size_per_gpu} must be >= 1")
    if p.optim.lr <= 0:
        report.error(f"prime.optim.lr={p.optim.lr} must be > 0: the implicit PRM is trained online")
    if alg.reward_dpo_coef < 0 or alg.reward_gt_coef < 0:
        report.error(f"algorithm.reward_dpo_coef={alg.reward_dpo_coef} and algorithm.reward_gt_coef="
                     f"{alg.reward_gt_coef} must be >= 0 (the weights of the implicit and the outcome rewards)")
    elif alg.reward_dpo_coef == 0 and alg.reward_gt_coef == 0:
        report.error("algorithm.reward_dpo_coef and algorithm.reward_gt_coef are both 0: PRIME's advantages would be "
                     "0 everywhere; give one of them a weight (verl's recipe: 5 and 5)")
    elif alg.reward_dpo_coef == 0:
        report.warn("algorithm.reward_dpo_coef=0: the implicit PRM is trained but its rewards do not reach the policy")
    if cfg.rollout.n < 2:
        report.error(f"algorithm.adv_estimator=prime needs rollout.n >= 2: each reward source's baseline is the mean "
                     f"of a prompt's other samples, and rollout.n={cfg.rollout.n} gives none (verl's recipe uses 4)")
    refused = {
        "actor.loss=dpo": (cfg.actor.loss == "dpo", "online DPO trains on pairs, not on advantages"),
        "algorithm.use_kl_in_reward=true": (alg.use_kl_in_reward,
                                            "the implicit rewards are already a log-ratio to a reference; verl's "
                                            "recipe sets the in-reward KL to 0 (use actor.use_kl_loss for a KL term)"),
    }
    for key, (on, reason) in refused.items():
        if on:
            report.error(f"algorithm.adv_estimator=prime cannot run with {key}: {reason}")
