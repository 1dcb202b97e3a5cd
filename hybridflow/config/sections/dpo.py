"""``hybridflow dpo``'s own settings (the ``dpo`` section): the preference loss and its data.

Everything else DPO reads is a shared key, as ``hybridflow sft`` reads it: model.path, data.train_files /
val_files, data.prompt_key, data.train_batch_size (pairs per step), data.chat_template, actor.optim, actor.lora,
actor.fsdp_config, packing and micro-batching (actor.use_remove_padding, actor.use_dynamic_bsz,
actor.ppo_max_token_len_per_gpu, actor.ppo_micro_batch_size_per_gpu, counted in pairs here), trainer.*.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import f

# TRL's names (DPOConfig.loss_type). sigmoid with label_smoothing > 0 is cDPO (conservative DPO).
DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")


@dataclass
class DPOConfig:
    """``hybridflow dpo``: offline direct preference optimisation on (prompt, chosen, rejected) pairs."""

    loss_type: str = f(
        "sigmoid", "sigmoid: -log σ(β·Δ), Δ the chosen-minus-rejected log-ratio margin (DPO); with label_smoothing "
        "> 0 the conservative cDPO. ipo: (Δ/|y| - 1/(2β))², the margin per completion token (IPO, as TRL "
        "normalises it). robust: the unbiased loss under label noise label_smoothing (rDPO). TRL's DPOConfig.loss_type.",
        choices=DPO_LOSS_TYPES,
    )
    beta: float = f(0.1, "β: the strength of the pull towards the reference (larger: closer to it). TRL's beta.")
    label_smoothing: float = f(
        0.0, "ε in [0, 0.5): the assumed fraction of flipped preference labels (cDPO with loss_type=sigmoid, rDPO "
        "with robust; ignored by ipo). TRL's label_smoothing.",
    )
    reference_free: bool = f(
        False, "No reference model: its log-probabilities are taken as 0, so the loss compares the policy's own "
        "chosen and rejected log-probabilities (TRL's reference_free).",
    )
    sft_weight: float = f(
        0.0, "α ≥ 0: adds α x the token-mean negative log-likelihood of the chosen responses to the loss (RPO; TRL's "
        "loss_type=[sigmoid, sft] with loss_weights=[1, α]), which keeps the chosen answers likely while the "
        "rejected ones are pushed down.",
    )
    chosen_key: str = f("chosen", "Column holding the preferred response: a string, or a list of chat messages "
                                  "(assistant turns, or the whole conversation when the row has no prompt column).")
    rejected_key: str = f("rejected", "Column holding the dispreferred response, in the chosen column's form.")
    max_length: int | None = f(
        None, "Most tokens of a prompt + response (template included); longer ones keep their start (TRL's "
        "keep_start), and a pair left with no response token on either side is skipped and counted. None: "
        "data.max_prompt_length + data.max_response_length.",
    )
    export: bool = f(True, "Write the final model as a Hugging Face directory in <output_dir>/export.")
    builtin_prompts: int = f(
        1024, "Built-in pairs (no data.train_files, model.path=builtin:tiny): training prompts of the arithmetic "
        "task the warm-started model is sampled on; each prompt with a wrong sample gives a pair (the right "
        "answer chosen, the wrong sample rejected).",
    )
    builtin_samples: int = f(8, "Built-in pairs: samples drawn per prompt (temperature 1) to find a wrong one.")
    builtin_val_prompts: int = f(256, "Built-in pairs: held-out prompts for the validation pairs and the greedy "
                                      "accuracy measured before and after training.")
