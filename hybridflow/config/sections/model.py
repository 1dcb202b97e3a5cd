"""The ``model``, ``warm_start`` and ``sft`` sections: the policy model and its supervised paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.fields import DTYPE_SPELLINGS, f


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
        "auto",
        "Training compute dtype: auto | float32 | bfloat16 (mixed precision: fp32 master weights, optimizer and "
        "gradient reduction; bf16 matmuls; actor.fsdp_config.model_dtype=bfloat16 drops the fp32 copy). auto, a "
        "rule of the hardware (never a timing): bfloat16 on a GPU with bf16 tensor cores and on a CPU with avx512_bf16 or "
        "amx_bf16 (a bf16-mixed update measured 1.35-1.7x fp32 there), float32 on other CPUs (bf16 emulated), "
        "also where ONEDNN_MAX_CPU_ISA caps oneDNN below those flags; "
        "decided at the run's first start, recorded in <output_dir>/token_budgets.json and read back by a "
        "resume, so a resume on another CPU computes as the run started. float32 is the behaviour before auto "
        "became the default, bitwise. The reference model loads in this dtype. verl's actor.fsdp_config.dtype and "
        "fsdp_config.mixed_precision.param_dtype (FSDP2's param_dtype is this compute dtype; bf16/fp32 spellings "
        "accepted).",
        choices=("auto", "float32", "bfloat16"), spellings=DTYPE_SPELLINGS,
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
