"""How the actor cuts a batch into forwards: packed or padded, and the token budget of a micro-batch.

Two decisions that ``actor.use_remove_padding`` and ``actor.use_dynamic_bsz`` (on by default)
leave to the run, made here as pure functions so the workers and ``config explain`` give the same
answer for the same inputs:

- ``packing_decision``: packing needs a model family whose attention can be told where each
  packed sequence starts (position ids restarting at 0, or ``cu_seqlens`` for varlen kernels).
  The families the engine supports (``PACKED_MODEL_TYPES``, tested packed against padded) get
  it; any other model, or modeling code shipped with the checkpoint, runs padded, with a note.
- ``auto_token_budget``: with ``*_max_token_len_per_gpu`` unset, a micro-batch holds as many
  tokens as a fraction of the free memory can keep activations for, from the model's shape
  (``training_bytes_per_token``), rounded down to a power of two and clamped to
  [longest possible sample, ``MAX_AUTO_TOKENS`` of the device type]. Micro-batching never changes the math (losses
  are normalised by the mini-batch's global token and sequence counts), so the budget moves
  speed and memory only.

Nothing here imports torch: the caller passes the free memory it measured
(``available_host_memory_bytes`` for the CPU; the actor asks CUDA for a GPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Families the engine runs packed, each tested packed against padded
# (tests/unit/training/test_training_packing.py). Their attention takes the packed layout
# through transformers' attention interface (sdpa -> the varlen kernel, which bands sliding
# windows; flash-attention from cu_seqlens, eager/flex from restarting position ids). Not Gemma
# 2/3: their eager attention soft-caps scores, which the varlen kernel does not, and no packed
# path is tested for them.
PACKED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral")

# Share of the free memory (when the actor starts) that one training micro-batch's activations
# may take. The rest is for what the estimate leaves out or what comes later: the optimizer's
# moments (allocated at the first step), gradients, the rollout engine's KV cache and a
# reference model on the same device, allocator slack.
MEMORY_FRACTION = 0.25
# The largest budget chosen automatically, per device type. A GPU keeps getting faster with larger
# micro-batches up to a few ten thousand tokens (verl's settings for 7B models on 80 GB GPUs are
# 16k-24k). A CPU runs a micro-batch's matmuls at full speed from a few hundred rows, so past 4096
# tokens a larger micro-batch only holds more activations (on the ~18M model of
# bench/grpo_step_vs_trl.py, 16384 instead of 4096 raised the step's peak RSS by ~2 GB for no speed).
# A user who wants more sets the key.
MAX_AUTO_TOKENS = {"cpu": 4096, "cuda": 16384}
# A forward without backward keeps no activations: verl advises logprob budgets about 2x the
# training one, which is what ``log_prob_max_token_len_per_gpu`` gets when unset.
LOG_PROB_BUDGET_FACTOR = 2

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that size its activations."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    custom_code: bool = False  # config.json names modeling code shipped with the checkpoint (auto_map)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False  # the LM head shares the embedding's weight
    attention_bias: bool = False  # q, k and v projections have biases (Qwen2 always)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    @property
    def num_parameters(self) -> int:
        """Parameters of the causal LM: embedding, decoder layers, final norm, LM head (unless tied)."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        if self.model_type == "qwen3":
            attention += 2 * self.head_size  # q_norm and k_norm
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From a Hugging Face config.json (the text config of a multimodal one)."""
        text = config.get("text_config") or config
        heads = int(text.get("num_attention_heads", 1))
        model_type = str(config.get("model_type", ""))
        return cls(
            model_type=model_type,
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size") or 4 * int(text["hidden_size"])),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            vocab_size=int(text["vocab_size"]),
            custom_code="auto_map" in config,
            head_dim=int(text["head_dim"]) if text.get("head_dim") else None,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            attention_bias=model_type == "qwen2" or bool(text.get("attention_bias", False)),
        )


# hybridflow.models.tiny.TinyModelSpec() (config cannot import models; a test keeps them equal).
BUILTIN_TINY_SHAPE = ModelShape(
    model_type="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=272, tie_word_embeddings=True, attention_bias=True,
)


# The built-in tasks about images: with model.path=builtin:tiny (and no data.train_files) they
# train the built-in vision-language model instead, hybridflow.models.tiny.TinyVLSpec() (its text
# model's shape here, as ModelShape.from_config reads the written config.json; a test keeps them equal).
VISUAL_BUILTIN_TASKS = frozenset({"colour_square"})
BUILTIN_TINY_VL_SHAPE = ModelShape(
    model_type="qwen2_vl", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=272, tie_word_embeddings=True,
)


def read_model_shape(model_path: str, builtin_task: str | None = None) -> ModelShape | None:
    """The shape of ``model.path`` (None where its config.json cannot be read yet). ``builtin_task``:
    the built-in task the run trains on (None with data files of its own), which picks the
    built-in model."""
    if model_path == "builtin:tiny":
        return BUILTIN_TINY_VL_SHAPE if builtin_task in VISUAL_BUILTIN_TASKS else BUILTIN_TINY_SHAPE
    path = Path(model_path).expanduser() / "config.json"
    try:
        return ModelShape.from_config(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def packing_decision(
    requested: bool, model_type: str, custom_code: bool = False, key: str = "actor.use_remove_padding"
) -> tuple[bool, str]:
    """(run packed, why) for ``<key>=requested`` on a model of ``model_type``."""
    if not requested:
        return False, f"{key}=false"
    if custom_code:
        return False, (
            f"the model ships its own modeling code (auto_map), whose attention may not respect packed sequences; "
            f"padded path (families with a packed path: {', '.join(PACKED_MODEL_TYPES)})"
        )
    if model_type not in PACKED_MODEL_TYPES:
        return False, (
            f"model type {model_type!r} has no tested packed attention path; padded path "
            f"(families with one: {', '.join(PACKED_MODEL_TYPES)})"
        )
    return True, f"{key}=true and {model_type} has a packed attention path"


# Under autocast (mixed precision on one rank) the residual stream and the norms stay float32
# while the matmuls save bf16 copies: a layer saves 4 more hidden-sized float32 values per token
# than the count at the compute dtype (the saved tensors of the built-in model under bf16 autocast).
AUTOCAST_FP32_HIDDEN_VALUES = 4


def training_bytes_per_token(
    shape: ModelShape, *, compute_bytes: int, gradient_checkpointing: bool = False, full_logits: bool = False,
    autocast: bool = False,
) -> int:
    """Bytes a training forward keeps per token until its backward (an estimate, on purpose high).

    A decoder layer saves for backward about 10 hidden-sized vectors per token (the two norms'
    inputs and outputs, q and the attention output, the output projection's input, the
    residuals), 4 MLP-sized ones (gate, up, the activation and the product fed to the down
    projection) and k, v: ``(10·h + 4·i + 2·kv)`` values. With gradient checkpointing only the
    layer input stays (``h``), plus one layer's full set while it is recomputed. Logits: the
    chunked head (``hybridflow.training.lm_head``) keeps none; ``full_logits`` (a sharded model,
    a head with soft-capping) keeps float32 logits, their gradient and a softmax temporary.
    ``autocast``: mixed precision on one rank keeps the residual stream and norms in float32.
    """
    per_layer = 10 * shape.hidden_size + 4 * shape.intermediate_size + 2 * shape.kv_size
    # ``autocast`` (compute_bytes < 4 over fp32 weights, one rank): AUTOCAST_FP32_HIDDEN_VALUES more per layer.
    fp32_extra = AUTOCAST_FP32_HIDDEN_VALUES * shape.hidden_size * 4 if autocast and compute_bytes < 4 else 0
    if gradient_checkpointing:
        values = shape.num_hidden_layers * shape.hidden_size + per_layer
        layers_extra = fp32_extra
    else:
        values = shape.num_hidden_layers * per_layer
        layers_extra = shape.num_hidden_layers * fp32_extra
    logits = 3 * 4 * shape.vocab_size if full_logits else 0
    return values * compute_bytes + layers_extra + logits


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True)
class TokenBudget:
    ppo: int  # tokens per training micro-batch
    log_prob: int  # tokens per logprob (forward-only) micro-batch
    reason: str


def auto_token_budget(
    shape: ModelShape,
    available_bytes: int,
    longest_sample: int,
    *,
    compute_bytes: int,
    gradient_checkpointing: bool = False,
    full_logits: bool = False,
    memory_label: str = "free memory",
    device_type: str = "cpu",
) -> TokenBudget:
    """Budgets when ``actor.ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu`` are unset.

    ppo = MEMORY_FRACTION x ``available_bytes`` / ``training_bytes_per_token``, rounded down to
    a power of two (so small changes in free memory rarely change it), clamped to
    [``longest_sample``, ``MAX_AUTO_TOKENS[device_type]``]; log_prob = LOG_PROB_BUDGET_FACTOR x
    ppo, clamped the same way. ``longest_sample`` (max prompt + max response) is the floor: a
    sample is never split.
    """
    cap = MAX_AUTO_TOKENS.get(device_type, MAX_AUTO_TOKENS["cuda"])
    per_token = training_bytes_per_token(
        shape, compute_bytes=compute_bytes, gradient_checkpointing=gradient_checkpointing, full_logits=full_logits
    )
    fits = int(MEMORY_FRACTION * available_bytes) // per_token
    ppo = max(longest_sample, min(cap, _floor_power_of_two(fits)))
    log_prob = max(longest_sample, min(cap * LOG_PROB_BUDGET_FACTOR, ppo * LOG_PROB_BUDGET_FACTOR))
    if fits >= cap and longest_sample > cap:
        # Both bounds apply: say which one won, or the plan prints 8256 beside "capped at 4096".
        bound = (f"capped at {cap} on {device_type}, then raised to the longest possible sample "
                 f"({longest_sample}: a sample is never split)")
    elif fits >= cap:
        bound = f"capped at {cap} on {device_type}"
    elif ppo == longest_sample:
        bound = f"raised to the longest possible sample ({longest_sample}); memory is tight"
    else:
        bound = "rounded down to a power of two"
    reason = (
        f"auto: {MEMORY_FRACTION:g} x {available_bytes / 2**30:.1f} GiB {memory_label} / "
        f"{per_token / 2**10:.0f} KiB of activations per token ({shape.num_hidden_layers} layers x "
        f"(10x{shape.hidden_size} + 4x{shape.intermediate_size} + 2x{shape.kv_size}) x {compute_bytes} B"
        f"{', gradient checkpointing' if gradient_checkpointing else ''}"
        f"{', + float32 logits' if full_logits else ''}) = {fits} tokens, {bound}; "
        f"logprob passes {LOG_PROB_BUDGET_FACTOR}x"
    )
    return TokenBudget(ppo=ppo, log_prob=log_prob, reason=reason)


def available_host_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping), else
    the physical memory; a conservative 4 GiB where neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def cpu_vendor() -> str:
    """The CPU's vendor_id from /proc/cpuinfo ('' where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
