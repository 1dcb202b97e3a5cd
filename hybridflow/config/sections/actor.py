"""The ``actor``, ``ref`` and ``critic`` sections: optimisation, policy loss, FSDP, LoRA."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import DTYPE_SPELLINGS, f, sub


@dataclass
class OptimConfig:
    lr: float = f(
        3e-4, "Peak learning rate (AdamW). The default suits the built-in tiny model; 0.5B-7B models use ~1e-6."
    )
    weight_decay: float = f(0.01, "AdamW weight decay.")
    betas: list[float] = f([0.9, 0.999], "AdamW betas.")
    lr_warmup_steps: int | None = f(
        -1, "Linear warm-up steps (optimizer steps). -1 or null: lr_warmup_steps_ratio x the run's optimizer steps "
        "(verl's convention).",
    )
    lr_warmup_steps_ratio: float = f(
        0.0, "Warm-up as a fraction of the run's optimizer steps, in [0, 1), used when lr_warmup_steps is -1 or null "
        "(verl's key: its warm-up is this x trainer steps, and its schedule steps once per trainer step; ours steps "
        "once per optimizer step, so the warm-up covers the same share of the run).",
    )
    lr_scheduler_type: str = f("constant", "constant | cosine.", choices=("constant", "cosine"))
    min_lr_ratio: float = f(0.0, "Cosine schedule floor as a fraction of lr.")


@dataclass
class PolicyLossConfig:
    """The loss and its own settings. Each key below belongs to one loss_mode (named first in its
    description) and fills that loss's typed params; one set away from its default under another
    loss_mode is a config error at start-up (build_actor_policy_loss in hybridflow/workers/policy_loss.py)."""

    loss_mode: str = f(
        "vanilla",
        "Policy loss: vanilla (PPO clip) | gspo | sapo | cispo | gpg | clip_cov | kl_cov | geo_mean | dppo_tv | "
        "dppo_kl | dro, or package.module:function. (bypass_mode is chosen by "
        "algorithm.rollout_correction.bypass_mode.)",
    )
    dro_beta: float | None = f(
        None, "dro: coefficient of the quadratic log-ratio penalty 0.5 * beta * (log pi - log pi_old)^2; required "
        "(> 0) with loss_mode=dro, as in verl.",
    )
    tau_pos: float = f(1.0, "sapo: gate temperature for positive advantages.")
    tau_neg: float = f(1.05, "sapo: gate temperature for negative advantages.")
    clip_cov_ratio: float = f(2e-4, "clip_cov: fraction of tokens whose gradient is dropped.")
    clip_cov_lb: float = f(1.0, "clip_cov: lower covariance bound of the candidates.")
    clip_cov_ub: float = f(5.0, "clip_cov: upper covariance bound of the candidates.")
    kl_cov_ratio: float = f(2e-4, "kl_cov: fraction of tokens (highest covariance) given a KL penalty.")
    ppo_kl_coef: float = f(0.1, "kl_cov: coefficient of that penalty.")


@dataclass
class FSDPConfig:
    fsdp_size: int = f(
        -1,
        "Ranks per FSDP2 shard group; the groups replicate (HSDP): parameter gathers stay within a "
        "group, only gradients cross groups. -1, or at least the rank count (as verl): shard over every "
        "data-parallel rank.",
    )
    param_offload: bool = f(
        False, "Keep sharded parameters, gradients and the optimizer step on the CPU (FSDP2 CPUOffloadPolicy; GPU "
        "runs). On one GPU the model is sharded over a one-rank group so that it can be offloaded, as verl does."
    )
    optimizer_offload: bool = f(False, "Keep the optimizer state on the CPU between optimizer steps.")
    model_dtype: str = f(
        "float32",
        "dtype the trained weights, their gradients and the optimizer state are stored in: float32 (master "
        "weights; model.dtype=bfloat16 computes in bf16 over them) | bfloat16 (pure bf16 training: no float32 "
        "copy, half the memory of weights, gradients and Adam's moments; computes in bf16, so it needs "
        "model.dtype=bfloat16, which the actor's sets when model.dtype is not given). Accuracy cost of bfloat16: an "
        "update smaller than about 1/256 of a weight (bf16's 8-bit mantissa) rounds away, so tiny learning rates "
        "can leave weights unchanged, and Adam's moments are rounded too. verl's key; "
        "bf16/fp32 spellings accepted.",
        choices=("float32", "bfloat16"), spellings=DTYPE_SPELLINGS,
    )
    reduce_dtype: str = f(
        "float32",
        "dtype FSDP2 reduces gradients over ranks in: float32 | bfloat16 (half the gradient traffic; each rank's "
        "gradient is rounded to bf16 before the sum). Sharded roles only (several ranks, or param_offload on "
        "one GPU): an unsharded rank reduces nothing. verl's fsdp_config.mixed_precision.reduce_dtype; bf16/fp32 "
        "spellings accepted.",
        choices=("float32", "bfloat16"), spellings=DTYPE_SPELLINGS,
    )


@dataclass
class LoraConfig:
    """``actor.lora``: train low-rank adapters (PEFT's LoRA) instead of every weight."""

    rank: int = f(
        0, "LoRA rank r. 0: off, every weight trains. > 0: only the adapters train (the optimizer holds only "
        "them), the reference policy is the actor with its adapter disabled (no second copy), checkpoints hold "
        "the adapter and its optimizer state.",
    )
    alpha: float = f(16.0, "LoRA alpha: the update B·A is scaled by alpha / rank.")
    target_modules: list[str] = f(
        ["all-linear"],
        "Modules that get an adapter, by name suffix (e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj]). [all-linear]: every linear layer of the decoder, not the output head (PEFT's all-linear). "
        "One name alone (verl's target_modules=all-linear) is a list of one.",
        single_as_list=True,
    )
    dropout: float = f(0.0, "Dropout on the adapter's input, in [0, 1).")
    adapter_path: str | None = f(
        None, "A saved PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start training from "
        "instead of fresh adapters (verl's actor_rollout_ref.model.lora_adapter_path). As in verl the adapter's own "
        "config wins: rank, alpha, target_modules, dropout and exclude_modules are read from it (a differing value "
        "given here is replaced, with a note), and LoRA is on whatever actor.lora.rank says. null: fresh adapters.",
    )
    exclude_modules: str | None = f(
        None, "A regular expression of module names (matched whole, PEFT's exclude_modules, as verl passes it) that "
        "get no adapter even when target_modules names them, e.g. '.*visual.*' keeps a vision tower without "
        "adapters. null: none excluded.",
    )
    sync: str = f(
        "merged",
        "What a weight sync sends the rollout: merged (W + B·A·alpha/rank under the base model's names, which "
        "every engine takes) | adapter (only A and B: the rollout worker keeps a copy of the base weights and "
        "merges them itself, so a sync moves r·(in+out) instead of in·out numbers per layer; native engine, "
        "trainer.mode sync or one_step_off).",
        choices=("merged", "adapter"),
    )
    base_dtype: str = f(
        "float32",
        "dtype the frozen base weights are stored in: float32 | bfloat16 (half the base's memory: 2 bytes per "
        "parameter instead of 4). The adapters and their optimizer state stay float32. With bfloat16 the base's "
        "matmuls run in bf16 whatever model.dtype (so do the reference logprobs, the base with the adapter off), "
        "and merged weight syncs are rounded to bf16 once; checkpoints (adapter only) are the same.",
        choices=("float32", "bfloat16"),
    )


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = f(32, "Prompts per optimizer step (x rollout.n samples).")
    ppo_micro_batch_size_per_gpu: int = f(64, "Samples per forward/backward on one rank.")
    log_prob_micro_batch_size_per_gpu: int = f(128, "Samples per logprob forward on one rank.")
    use_remove_padding: bool = f(
        True,
        "Pack each micro-batch's sequences into one padding-free row (no compute on padding). Models without "
        "a packed attention path (families other than llama, qwen2, qwen3, mistral, phi3, qwen3_moe, mixtral, "
        "or modeling code shipped with the checkpoint) run padded, with a note. false: always padded (each micro-batch at its own width).",
    )
    use_dynamic_bsz: bool = f(
        True,
        "Form micro-batches by a token budget (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu) "
        "instead of a sample count (the *_micro_batch_size_per_gpu keys are then unused). Padded micro-batches "
        "count their padded slots and group samples of similar length.",
    )
    ppo_max_token_len_per_gpu: int | None = f(
        None,
        "Token budget of a training micro-batch with use_dynamic_bsz. None: derived from the model's shape and "
        "the free memory at start-up, at most 4096 on a CPU and 16384 on a GPU (hybridflow config explain shows the "
        "value and the formula).",
    )
    log_prob_max_token_len_per_gpu: int | None = f(
        None, "Token budget of a logprob micro-batch with use_dynamic_bsz. None: 2x the training budget."
    )
    ppo_epochs: int = f(1, "Passes over each rollout batch.")
    shuffle: bool = f(False, "Shuffle samples between PPO epochs.")
    clip_ratio: float = f(0.2, "PPO clip range (default for clip_ratio_low/high).")
    clip_ratio_low: float | None = f(None, "Lower clip range; None: clip_ratio.")
    clip_ratio_high: float | None = f(None, "Upper clip range; None: clip_ratio (DAPO uses 0.28).")
    clip_ratio_c: float = f(3.0, "Dual-clip bound for negative advantages (> 1).")
    loss_agg_mode: str = f(
        "token-mean",
        "token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.",
    )
    loss_scale_factor: float | None = f(None, "Divisor for seq-mean-token-sum-norm; None: max_response_length.")
    policy_loss: PolicyLossConfig = sub(
        PolicyLossConfig, "Policy loss selection. Each key but loss_mode belongs to the loss named first in its "
        "description; set away from its default under another loss_mode it is a config error.",
    )
    loss: str = f(
        "policy_gradient",
        "What the actor minimises. policy_gradient: the policy loss (actor.policy_loss.loss_mode) on the "
        "estimator's advantages. dpo: online DPO, the preference loss on pairs of each prompt's samples, chosen by "
        "their rewards (algorithm.online_dpo.*; the advantage estimator is not used; one optimizer step per pass "
        "over the step's pairs, actor.ppo_epochs passes).",
        choices=("policy_gradient", "dpo"),
    )
    entropy_coeff: float = f(0.0, "Entropy bonus coefficient.")
    use_kl_loss: bool = f(False, "Add a KL(actor || reference) loss (loads a reference model).")
    kl_loss_coef: float = f(0.001, "Weight of the KL loss.")
    kl_loss_type: str = f("low_var_kl", "KL estimator: kl/k1 | abs | mse/k2 | low_var_kl/k3 (+ for straight-through).")
    grad_clip: float = f(1.0, "Max global gradient norm (<= 0: no clipping).")
    optim: OptimConfig = sub(OptimConfig, "Optimizer.")
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP2 sharding and offload (several ranks; offload also on one).")
    ulysses_sequence_parallel_size: int = f(
        1,
        "Ulysses sequence parallelism: blocks of this many ranks share each micro-batch, each rank computing 1/sp "
        "of every packed sequence's tokens (an all-to-all around attention switches to a split of the heads), so "
        "activations per rank shrink by sp. Must divide the ranks and the model's attention heads; needs "
        "use_remove_padding. The token budgets (ppo_/log_prob_max_token_len_per_gpu) then count the group's "
        "tokens x sp, as verl's. 1: off.",
    )
    lora: LoraConfig = sub(LoraConfig, "LoRA adapters through PEFT (rank 0: off).")
    use_torch_compile: bool = f(
        False,
        "torch.compile each decoder layer of the actor's model and of the reference's (verl's key; verl compiles "
        "its logprob/entropy helper and defaults to true). The first forward and backward compile (on a CPU about "
        "a minute for a small model, Inductor's C++ code), later ones reuse the graphs; same losses within float "
        "rounding. If compiling fails on this model or torch build, the run continues eagerly after one warning. "
        "Default false: on a 2-core CPU a compiled 20M-parameter model trained slower than eager (0.74x per step, "
        "bench/torch_compile.py), after a first step 2x longer.",
    )
    freeze_vision_tower: bool = f(
        False,
        "Train a vision-language model's language part only: the image encoder (Qwen2-VL's visual, a vision_tower "
        "or vision_model) keeps its loaded weights and the optimizer never holds them (verl's key). A text-only "
        "model has none: a note says so. With LoRA use actor.lora.exclude_modules instead.",
    )


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = f(128, "Samples per reference logprob forward on one rank.")
    log_prob_max_token_len_per_gpu: int | None = f(
        None, "Token budget of a reference micro-batch when actor.use_dynamic_bsz is on. None: as the actor's logprob "
        "budget (derived the same way)."
    )
    ulysses_sequence_parallel_size: int | None = f(
        None, "Ulysses sequence parallelism of the reference forward (as actor.ulysses_sequence_parallel_size). "
        "None: the actor's."
    )


@dataclass
class CriticModelConfig:
    path: str | None = f(
        None,
        "The value model's starting point: a local Hugging Face causal LM directory whose backbone gets a "
        "scalar value head (a linear hidden -> 1, initialised to zero). None: model.path (the policy's weights).",
    )


@dataclass
class CriticConfig:
    """verl's ``critic`` section. A critic is built when the estimator needs values (gae)."""

    model: CriticModelConfig = sub(CriticModelConfig, "The value model.")
    ppo_mini_batch_size: int | None = f(
        None, "Prompts per critic optimizer step (x rollout.n samples). None: actor.ppo_mini_batch_size."
    )
    ppo_micro_batch_size_per_gpu: int = f(64, "Samples per critic forward/backward on one rank.")
    forward_micro_batch_size_per_gpu: int = f(128, "Samples per value forward (compute_values) on one rank.")
    use_dynamic_bsz: bool = f(
        True, "Form micro-batches by a token budget, as actor.use_dynamic_bsz (the *_micro_batch_size_per_gpu "
        "keys are then unused).",
    )
    ppo_max_token_len_per_gpu: int | None = f(
        None, "Token budget of a critic training micro-batch with use_dynamic_bsz. None: derived like the actor's."
    )
    forward_max_token_len_per_gpu: int | None = f(
        None, "Token budget of a value-forward micro-batch with use_dynamic_bsz. None: 2x the training budget."
    )
    use_remove_padding: bool = f(True, "Pack micro-batches padding-free where the model allows (as the actor's).")
    ppo_epochs: int | None = f(None, "Passes of the critic over each rollout batch. None: actor.ppo_epochs.")
    shuffle: bool = f(False, "Shuffle samples between critic epochs.")
    cliprange_value: float = f(
        0.5, "Clip a new value prediction to V_old +- this before its squared error (PPO's value clipping)."
    )
    loss_agg_mode: str = f("token-mean", "Aggregation of the value loss over tokens (as actor.loss_agg_mode).")
    grad_clip: float = f(1.0, "Max global gradient norm of the critic (<= 0: no clipping).")
    optim: OptimConfig = sub(
        OptimConfig, "The critic's optimizer (--preset ppo sets lr 1e-3 for the built-in tiny model; verl uses 1e-5 "
        "with 0.5B-7B models).",
    )
    fsdp_config: FSDPConfig = sub(FSDPConfig, "FSDP2 sharding and offload of the critic (as the actor's).")
    ulysses_sequence_parallel_size: int = f(
        1, "Ulysses sequence parallelism of the critic (as actor.ulysses_sequence_parallel_size; needs "
        "critic.use_remove_padding). 1: off."
    )
