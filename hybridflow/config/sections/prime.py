"""PRIME's implicit process reward model (the ``prime`` section; docs/algorithms.md, "PRIME").

Used when ``algorithm.adv_estimator=prime``: a causal LM φ, initialised from ``prime.model.path`` (the policy's
own model by default), trained each step beside the policy with its own optimizer on the step's samples, and
its frozen initial weights as its reference. Its token rewards β·(log φ − log ref) join the outcome reward in
the advantages with the weights ``algorithm.reward_dpo_coef`` / ``algorithm.reward_gt_coef``. It has one rank
per actor rank (FSDP2 over them), and is checkpointed with the run (``<checkpoint>/prime/``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import f, sub
from hybridflow.config.sections.actor import FSDPConfig, OptimConfig

PRIME_UPDATES = ("before", "after")
PRIME_REWARD_NORMS = ("batch_norm", "none")


@dataclass
class PrimeModelConfig:
    path: str | None = f(
        None, "The implicit PRM's starting weights and its frozen reference: a local Hugging Face causal LM with the "
        "policy's tokenizer (an SFT model, say). null: the policy's own model (model.path, the built-in model after "
        "its warm start); then the run's reference model, when it loads one, is the PRM's reference too.",
    )


@dataclass
class PrimeConfig:
    """The implicit PRM: token reward r_t = β·(log φ(y_t) − log ref(y_t)), trained with the cross-entropy of
    σ(Σ_t r_t) against the outcome label (score > label_threshold)."""

    model: PrimeModelConfig = sub(PrimeModelConfig, "The implicit PRM's model.")
    beta: float = f(0.05, "β of the token rewards and of the loss (verl's reward_model.model.beta_train). > 0.")
    label_threshold: float = f(
        0.5, "A sample's outcome label is 1 when its score is above this (the verifier said right), else 0.",
    )
    update: str = f(
        "before", "before: the PRM trains on the step's samples, then scores them (verl's default: the rewards come "
        "from the updated PRM); after: it scores them, then trains.", choices=PRIME_UPDATES,
    )
    reward_norm: str = f(
        "batch_norm", "batch_norm: token rewards divided by the batch's largest |return-to-go| (verl's prime_norm); "
        "none: as they are.", choices=PRIME_REWARD_NORMS,
    )
    micro_batch_size_per_gpu: int = f(
        8, "Samples per PRM micro-batch (forward, and gradient-accumulation step) on one rank when "
        "actor.use_dynamic_bsz is off; with it the PRM and its reference cut micro-batches by the actor's token "
        "budgets.",
    )
    grad_clip: float = f(10.0, "Max global gradient norm of the PRM (verl's 10; <= 0: no clipping).")
    optim: OptimConfig = sub(OptimConfig, "The PRM's own optimizer and schedule (one optimizer step per training "
                                          "step, on all the step's samples).")
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP2 sharding and offload of the PRM (as the actor's).")
