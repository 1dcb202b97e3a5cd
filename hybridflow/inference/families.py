"""What differs between the model families the compact forward (``compact``) runs.

One row per Hugging Face ``model_type``; everything else (RMSNorm, rotary embeddings, grouped-query
attention, a gated MLP) is shared and lives in ``compact``.

==============  ======================  ==================  ===========================================
model_type      q/k/v projection        gate/up projection  sliding-window layers
==============  ======================  ==================  ===========================================
llama           q_proj, k_proj, v_proj  gate_proj, up_proj  none
qwen2, qwen3    q_proj, k_proj, v_proj  gate_proj, up_proj  ``layer_types[i] == "sliding_attention"``
mistral         q_proj, k_proj, v_proj  gate_proj, up_proj  every layer when ``sliding_window`` is set
phi3            qkv_proj (fused)        gate_up_proj        every layer when ``sliding_window`` is set
gemma2          q_proj, k_proj, v_proj  gate_proj, up_proj  ``layer_types[i] == "sliding_attention"``
gemma3_text     q_proj, k_proj, v_proj  gate_proj, up_proj  ``layer_types[i] == "sliding_attention"``
qwen3_moe       q_proj, k_proj, v_proj  experts (MoE)       ``layer_types[i] == "sliding_attention"``
mixtral         q_proj, k_proj, v_proj  experts (MoE)       every layer when ``sliding_window`` is set
==============  ======================  ==================  ===========================================

The Gemma families also change the numerics (``Numerics``): RMSNorm scales by ``1 + weight``, the
embeddings are multiplied by sqrt(hidden_size), the attention and MLP outputs are normalised
before they join the residual ("sandwich" norms: ``post_attention_layernorm`` on the attention
output, ``pre_feedforward_layernorm`` before the MLP, ``post_feedforward_layernorm`` on its
output), scores are scaled by ``query_pre_attn_scalar ** -0.5`` and optionally soft-capped
(``cap tanh(x / cap)``), as are the final logits, and the MLP gate is ``gelu_pytorch_tanh``.
Gemma 3 (text only, ``Gemma3ForCausalLM``) adds per-head q/k norms and its own rotary frequencies
for the sliding layers (``rope_parameters["sliding_attention"]``).

Mixture-of-experts layers (``mlp.experts``, HF's stacked ``gate_up_proj`` (E, 2 I, h) and
``down_proj`` (E, h, I), routed by ``mlp.gate``) follow each family's router exactly: a float32
softmax and the top ``num_experts_per_tok``; Mixtral always renormalises the chosen weights and
keeps them in float32, Qwen3-MoE renormalises only with ``norm_topk_prob`` and casts them to the
model's dtype. The chosen experts run as a dense loop (no grouped kernels: a CPU's way), so these
models decode eagerly (no CUDA graphs) and are not split by tensor parallelism. Qwen3-MoE's dense
layers (``mlp_only_layers``, ``decoder_sparse_step``) are ordinary MLPs.

A sliding window of W lets a query at position p see the keys at positions ``p - W < k <= p``
(Hugging Face's ``sliding_window_overlay``). The slot cache keeps every position, so the window is
a mask only: it saves no memory, and it changes nothing when W is at least the sequence length.

``config_problem`` reads a config as a plain dict (``config.json``, or ``PretrainedConfig.to_dict()``)
so set-up can refuse an unsupported model before any weight loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# RoPE types whose inverse frequencies are recomputed from the sequence length at run time (``su``
# is Phi-3's old name for longrope).
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope", "su")
# The engines that run any Hugging Face architecture they support themselves.
OTHER_ENGINES = "rollout.name=vllm or rollout.name=sglang"


def _no_window(config: Any, index: int) -> int | None:
    return None


def _window_by_layer_type(config: Any, index: int) -> int | None:
    layer_types = getattr(config, "layer_types", None) or []
    if index < len(layer_types) and layer_types[index] == "sliding_attention":
        return int(config.sliding_window)
    return None


def _window_everywhere(config: Any, index: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    return None if window is None else int(window)


@dataclass(frozen=True)
class Numerics:
    """The arithmetic that differs from Llama's (module docstring); the defaults are Llama's."""

    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight)
    embed_scale: float | None = None  # embeddings × this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # scores × this; None: head_dim ** -0.5
    attention_softcap: float | None = None  # scores → cap tanh(scores / cap) before the mask
    final_softcap: float | None = None  # logits → cap tanh(logits / cap)
    activation: str = "silu"  # the MLP gate's: silu | gelu_tanh
    sandwich_norms: bool = False  # attention and MLP outputs normalised before the residual add
    # Mixture of experts: experts per token, whether their router weights are renormalised to sum
    # to 1, and whether they are cast to the model's dtype before weighting the experts' outputs.
    experts_per_token: int = 0
    normalize_top_k: bool = False
    router_weights_in_model_dtype: bool = False


def _llama_numerics(config: Any) -> Numerics:
    return Numerics()


def _gemma_numerics(config: Any) -> Numerics:
    return Numerics(
        norm_offset=1.0,
        embed_scale=float(config.hidden_size) ** 0.5,
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attention_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        activation="gelu_tanh",
        sandwich_norms=True,
    )


def _qwen3_moe_numerics(config: Any) -> Numerics:
    return Numerics(experts_per_token=int(config.num_experts_per_tok), normalize_top_k=bool(config.norm_topk_prob),
                    router_weights_in_model_dtype=True)


def _mixtral_numerics(config: Any) -> Numerics:
    return Numerics(experts_per_token=int(config.num_experts_per_tok), normalize_top_k=True)


def _one_rotary(rotary: Any, config: Any) -> tuple[list[tuple[Any, float]], list[int]]:
    """Every layer uses the rotary module's one table of frequencies."""
    table = (rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))
    return [table], [0] * int(config.num_hidden_layers)


def _rotary_by_layer_type(rotary: Any, config: Any) -> tuple[list[tuple[Any, float]], list[int]]:
    """Gemma 3: a table per layer type (``<type>_inv_freq`` on the rotary module)."""
    kinds = sorted(set(config.layer_types))
    tables = [(getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling", 1.0)))
              for kind in kinds]
    return tables, [kinds.index(kind) for kind in config.layer_types]


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` differs from Llama (module docstring's table)."""

    qkv: tuple[str, ...]  # attribute names on ``layer.self_attn`` whose weights, concatenated, are q/k/v rows
    gate_up: tuple[str, ...]  # attribute names on ``layer.mlp``: gate rows, then up rows
    sliding_window: Callable[[Any, int], int | None]  # (HF config, layer index) → window or None
    numerics: Callable[[Any], Numerics] = _llama_numerics
    # (HF rotary module, config) → ([(inv_freq, attention scaling)], each layer's index into that list)
    rotary: Callable[[Any, Any], tuple[list[tuple[Any, float]], list[int]]] = _one_rotary
    activation: tuple[str, str] = ("hidden_act", "silu")  # (config key, the one value supported)
    tensor_parallel: bool = True  # whether rollout.tensor_model_parallel_size > 1 can split it


_SEPARATE = dict(qkv=("q_proj", "k_proj", "v_proj"), gate_up=("gate_proj", "up_proj"))
_GEMMA = dict(**_SEPARATE, sliding_window=_window_by_layer_type, numerics=_gemma_numerics,
              activation=("hidden_activation", "gelu_pytorch_tanh"))

FAMILIES: dict[str, Family] = {
    "llama": Family(**_SEPARATE, sliding_window=_no_window),
    "qwen2": Family(**_SEPARATE, sliding_window=_window_by_layer_type),
    "qwen3": Family(**_SEPARATE, sliding_window=_window_by_layer_type),
    "mistral": Family(**_SEPARATE, sliding_window=_window_everywhere),
    "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",), sliding_window=_window_everywhere),
    "gemma2": Family(**_GEMMA),
    "gemma3_text": Family(**_GEMMA, rotary=_rotary_by_layer_type),
    "qwen3_moe": Family(**_SEPARATE, sliding_window=_window_by_layer_type, numerics=_qwen3_moe_numerics,
                        tensor_parallel=False),
    "mixtral": Family(**_SEPARATE, sliding_window=_window_everywhere, numerics=_mixtral_numerics,
                      tensor_parallel=False),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# Unsupported model types that are close to a supported one: what to use instead.
NEAR_MISSES = {
    "gemma3": "a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration); its text-only form "
              "(model_type gemma3_text, Gemma3ForCausalLM) is supported",
}


def _rope_types(config: Mapping[str, Any]) -> set[str]:
    """Every RoPE type of the config (Gemma 3 keeps one set of parameters per layer type)."""
    found = set()
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if not isinstance(rope, Mapping):
            continue
        for params in [rope, *(v for v in rope.values() if isinstance(v, Mapping))]:
            if params.get("rope_type") or params.get("type"):
                found.add(str(params.get("rope_type") or params.get("type")))
    return found


def _partial_rotary_factor(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters")
    factor = rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None
    return float(factor or config.get("partial_rotary_factor") or 1.0)


def config_problem(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> str | None:
    """Why the native engine cannot run a model of this config (a config.json as a dict) on
    replicas of ``tensor_parallel_size`` ranks, or None.

    The message names the model type, what is supported and what to use instead.
    """
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        hint = f" ({NEAR_MISSES[model_type]})" if model_type in NEAR_MISSES else ""
        return (f"the native rollout engine supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; got "
                f"{model_type!r}{hint}: use {OTHER_ENGINES}, which run other architectures")
    key, expected = family.activation
    activation = config.get(key) or expected
    if activation != expected:
        return f"the native rollout engine needs {key}={expected!r} for {model_type}, got {activation!r}"
    dynamic = sorted(_rope_types(config) & set(DYNAMIC_ROPE_TYPES))
    if dynamic:
        return (f"the native rollout engine does not support rope_type {dynamic[0]!r} (its frequencies depend on "
                f"the sequence length; {model_type}): use {OTHER_ENGINES}")
    partial = _partial_rotary_factor(config)
    if partial != 1.0:
        return (f"the native rollout engine rotates whole heads, but this {model_type} model has "
                f"partial_rotary_factor={partial}: use {OTHER_ENGINES}")
    if tensor_parallel_size > 1 and not family.tensor_parallel:
        return (f"the native rollout engine does not split {model_type} (mixture-of-experts) layers over "
                f"rollout.tensor_model_parallel_size={tensor_parallel_size} ranks: use "
                f"rollout.tensor_model_parallel_size=1 or {OTHER_ENGINES}")
    return None
