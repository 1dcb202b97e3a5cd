"""What each rollout engine (``rollout.name``) can do beyond generating text, as data.

The config checks, the memory planner and the rollout worker read these fields instead of comparing
engine names, so a new engine says what it supports in one place. The table sits here, below the
rollout package, because the config layer checks it before anything is built; each registered
``hybridflow.rollout.factory.EngineSpec`` carries its engine's entry (a test keeps them the same).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineCapabilities:
    # A weight update may land while samples are being generated, and every token records the
    # policy version that made it (async_training.partial_rollout).
    partial_rollout: bool = False
    # One replica spans rollout.tensor_model_parallel_size devices (the native engine over ranks,
    # vLLM and SGLang with workers of their own: EngineSpec.own_tensor_parallel).
    tensor_parallel: bool = False
    # hybridflow's own HTTP server can stand in front of it (rollout.mode=server).
    http_serving: bool = False
    # Its worker merges a LoRA adapter into the weights it serves (actor.lora.sync=adapter).
    adapter_merging: bool = False
    # It generates from images (vision-language models).
    images: bool = False
    # It sizes its KV cache the way the memory planner (``hybridflow plan``) computes it.
    planned_kv_cache: bool = False


# rollout.name -> what the engine can do. The order is the one error messages list engines in.
ENGINE_CAPABILITIES: dict[str, EngineCapabilities] = {
    "native": EngineCapabilities(partial_rollout=True, tensor_parallel=True, http_serving=True, adapter_merging=True,
                                 planned_kv_cache=True),
    "vllm": EngineCapabilities(tensor_parallel=True),
    "sglang": EngineCapabilities(tensor_parallel=True),
    "hf_vision": EngineCapabilities(images=True),
}
CAPABILITY_NAMES = tuple(f.name for f in fields(EngineCapabilities))


def capabilities(name: str) -> EngineCapabilities:
    """The engine's capabilities; an unknown name has none (``engine_unavailable`` names it)."""
    return ENGINE_CAPABILITIES.get(name, EngineCapabilities())


def engines_with(capability: str) -> str:
    """The engines that have ``capability``, for a message: ``native, vllm or sglang``."""
    if capability not in CAPABILITY_NAMES:
        raise ValueError(f"unknown engine capability {capability!r}; known: {', '.join(CAPABILITY_NAMES)}")
    names = [name for name, can in ENGINE_CAPABILITIES.items() if getattr(can, capability)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
