"""What differs between the model families the compact forward (``compact``) runs.

One row per Hugging Face ``model_type``; everything else (RMSNorm, rotary embeddings, grouped-query
attention, a SiLU-gated MLP) is shared and lives in ``compact``.

==============  ======================  ==================  ===========================================
model_type      q/k/v projection        gate/up projection  sliding-window layers
==============  ======================  ==================  ===========================================
llama           q_proj, k_proj, v_proj  gate_proj, up_proj  none
qwen2, qwen3    q_proj, k_proj, v_proj  gate_proj, up_proj  ``layer_types[i] == "sliding_attention"``
mistral         q_proj, k_proj, v_proj  gate_proj, up_proj  every layer when ``sliding_window`` is set
phi3            qkv_proj (fused)        gate_up_proj        every layer when ``sliding_window`` is set
==============  ======================  ==================  ===========================================

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
class Family:
    """How one ``model_type`` differs from Llama (module docstring's table)."""

    qkv: tuple[str, ...]  # attribute names on ``layer.self_attn`` whose weights, concatenated, are q/k/v rows
    gate_up: tuple[str, ...]  # attribute names on ``layer.mlp``: gate rows, then up rows
    sliding_window: Callable[[Any, int], int | None]  # (HF config, layer index) → window or None

    @property
    def fused(self) -> bool:
        return len(self.qkv) == 1


_SEPARATE = dict(qkv=("q_proj", "k_proj", "v_proj"), gate_up=("gate_proj", "up_proj"))

FAMILIES: dict[str, Family] = {
    "llama": Family(**_SEPARATE, sliding_window=_no_window),
    "qwen2": Family(**_SEPARATE, sliding_window=_window_by_layer_type),
    "qwen3": Family(**_SEPARATE, sliding_window=_window_by_layer_type),
    "mistral": Family(**_SEPARATE, sliding_window=_window_everywhere),
    "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",), sliding_window=_window_everywhere),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def _rope_type(config: Mapping[str, Any]) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if isinstance(rope, Mapping) and (rope.get("rope_type") or rope.get("type")):
            return str(rope.get("rope_type") or rope.get("type"))
    return "default"


def config_problem(config: Mapping[str, Any]) -> str | None:
    """Why the native engine cannot run a model of this config (a config.json as a dict), or None.

    The message names the model type, what is supported and what to use instead.
    """
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        return (f"the native rollout engine supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; got "
                f"{model_type!r}: use {OTHER_ENGINES}, which run other architectures")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        return f"the native rollout engine needs hidden_act='silu', got {activation!r} ({model_type})"
    rope_type = _rope_type(config)
    if rope_type in DYNAMIC_ROPE_TYPES:
        return (f"the native rollout engine does not support rope_type {rope_type!r} (its frequencies depend on "
                f"the sequence length; {model_type}): use {OTHER_ENGINES}")
    rope = config.get("rope_parameters") or {}
    partial = float((rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None)
                    or config.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        return (f"the native rollout engine rotates whole heads, but this {model_type} model has "
                f"partial_rotary_factor={partial}: use {OTHER_ENGINES}")
    return None
