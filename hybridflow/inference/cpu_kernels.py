"""The native engine's bf16 kernels on CPUs with avx512_bf16 and no AMX (``cpu_kernels.c``): its matmuls
(here), and a decode layer fused around them (``cpu_decode``).

Why: at the end of a long tail a decode step multiplies a few rows by every weight of the model, and
oneDNN's kernels, fast at a hundred rows, spend a few rows' step far below what the core can stream:
one decode step's matmuls of a ~20M Qwen2-shaped model at 8 rows took 3.6-3.9 CPU-ms in oneDNN's
packed layout and 2.0 here, the same at 128 rows (AMD EPYC Zen 4, one thread,
``bench/decode_batch_scaling.py``). The kernel reads weights packed in panels of 48 columns, so each
panel streams from memory in one pass, and keeps a tile of up to 8 rows x 48 columns in registers.

The results are oneDNN's to the bit. Both sum each output in float32 over k in ascending pairs with
the same instruction (vdpbf16ps), restarting every ``k_block`` values of k and adding the blocks in
order, then add the bias and the residual and round once. oneDNN's ``k_block`` is not documented, so
``k_block_for`` finds it: it tries each candidate against ``F.linear`` (oneDNN) on a fixed random
probe of each K and takes the one that gives the same bits, or declines the shape. So the ``dense``
and ``onednn`` layouts, a second torch thread (which takes oneDNN's kernels again) and this kernel all
give the same tokens, and no row's result depends on how many rows it ran beside: the order is the
same for every row count, one row included (so this path needs no ``compact.min_rows``).

The kernel is compiled on first use with the system C compiler (``$CC``, else ``cc``) into a cache
(``$HYBRIDFLOW_KERNEL_CACHE``, else ``~/.cache/hybridflow/kernels``; about a second, once per source
and compiler) and called through ctypes, which lets go of the GIL for the call. No compiler, another
CPU, or ``HYBRIDFLOW_CPU_KERNELS=0``: ``unavailable_reason`` says why, and the engine keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridflow.utils import native_build
from hybridflow.utils.device import CpuFeatures, cpu_features

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=x86-64-v4", "-mavx512bf16", "-shared", "-fPIC", "-std=c11")
LIBS = ("-lm",)
LANES = 16  # float32 lanes a vector holds: N must be a multiple of it
DISABLE_ENV, CACHE_ENV = native_build.DISABLE_ENV, native_build.CACHE_ENV
# oneDNN's k block on an AMD EPYC Zen 4 was 512 for K <= 1024 and 1024 above (any M >= 4, any N); the
# others are there so another oneDNN's choice is still found. K itself means one unbroken sum.
K_BLOCK_CANDIDATES = (512, 1024, 256, 2048, 128)
# The probe's size: enough outputs (65,536) that a wrong k block shows (it flips a bf16 rounding in
# about one output in 4,000: measured ~15-30 of 65,536), small enough to take a few ms once per K.
PROBE_ROWS, PROBE_COLUMNS = 64, 1024


def hardware_reason(cpu: CpuFeatures | None = None) -> str | None:
    """Why this CPU cannot or should not run the kernel, or None. AMX CPUs are left to oneDNN, whose
    tile kernels are faster there and sum in another order."""
    cpu = cpu or cpu_features()
    if not cpu.avx512_bf16:
        return f"the CPU has {cpu.bf16_flags()}, and the kernel needs avx512_bf16"
    if cpu.amx_bf16:
        return "the CPU has AMX, whose oneDNN kernels are left to run the bf16 matmuls"
    return None


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """The compiled kernel and None, or None and why not (once per process)."""
    if native_build.disabled():
        return None, f"{DISABLE_ENV}=0"
    reason = hardware_reason()
    if reason is not None:
        return None, reason
    try:
        path = native_build.compile_shared(SOURCE, FLAGS, LIBS)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("the native engine's bf16 kernel could not be built (%s); oneDNN runs its matmuls", error)
        return None, f"the kernel could not be built: {error}"
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.hf_pack.argtypes = [pointer, size, pointer, size, size]
    library.hf_pack.restype = None
    library.hf_linear.argtypes = [pointer, size, size, size, pointer, size, size, pointer, pointer, size, pointer, size]
    library.hf_linear.restype = None
    library.hf_rms_norm.argtypes = [pointer, size, size, size, pointer, ctypes.c_float, pointer, size]
    library.hf_rms_norm.restype = None
    library.hf_sample.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer, pointer, pointer, pointer]
    library.hf_sample.restype = None
    for name in ("hf_decode_qkv", "hf_decode_attend_mlp"):
        getattr(library, name).restype = None  # arguments: cpu_decode's structures, by reference
    return library, None


def library() -> ctypes.CDLL:
    """The compiled kernels; raises ``RuntimeError`` naming why where they cannot run."""
    loaded, reason = _library()
    if loaded is None:
        raise RuntimeError(f"the bf16 kernels are not available: {reason}")
    return loaded


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None when it can (compiles it on the first call)."""
    return _library()[1]


def available() -> bool:
    return unavailable_reason() is None


def supports(weight: torch.Tensor) -> bool:
    """Whether a weight (N, K) can be packed: bf16 on the CPU, N a multiple of 16, K even."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % LANES == 0 and weight.shape[1] % 2 == 0)


@dataclass(frozen=True)
class Panels:
    """A weight (N, K) packed for ``linear``, with the k block that gives oneDNN's bits."""

    data: torch.Tensor  # (N K,) bf16, panel after panel
    out_features: int  # N
    in_features: int  # K
    k_block: int


def pack(weight: torch.Tensor) -> Panels | None:
    """``weight`` (N, K) in panels, or None where the kernel cannot give oneDNN's bits for it (its
    shape, or no k block matched: the caller keeps oneDNN's matmul for this weight)."""
    library, _ = _library()
    if library is None or not supports(weight):
        return None
    k_block = k_block_for(weight.shape[1])
    if k_block is None:
        return None
    weight = weight.detach()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    data = torch.empty(weight.numel(), dtype=torch.bfloat16)
    library.hf_pack(weight.data_ptr(), weight.stride(0), data.data_ptr(), weight.shape[0], weight.shape[1])
    return Panels(data=data, out_features=int(weight.shape[0]), in_features=int(weight.shape[1]), k_block=k_block)


def linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for bf16 ``x`` (M, K) whose rows are contiguous (any row stride) → (M, N)."""
    out = torch.empty(x.shape[0], panels.out_features, dtype=torch.bfloat16, device=x.device)
    _run(x, panels, bias, None, out)
    return out


def add_linear_(residual: torch.Tensor, x: torch.Tensor, panels: Panels) -> None:
    """``residual += x W^T`` in place, rounded once (oneDNN's sum post-op); ``residual`` (M, N) contiguous rows."""
    _run(x, panels, None, residual, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's bf16 RMSNorm of ``x`` (M, h) with contiguous rows, h a multiple of 16: ``weight * round(x / rms)``,
    the float32 sum of squares in the kernel's order."""
    rows, width = x.shape
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or width % LANES or weight.dtype != torch.bfloat16:
        raise ValueError(f"rms_norm needs bf16 (M, h) rows with h a multiple of {LANES}, got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(rows, width, dtype=torch.bfloat16, device=x.device)
    library().hf_rms_norm(x.data_ptr(), x.stride(0), rows, width, weight.data_ptr(), eps, out.data_ptr(), width)
    return out


def sample(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor,
           counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_tokens``' plain case (no filter, penalty or hook) on bf16 ``logits`` (B, V) with contiguous
    rows: (tokens (B,) int64, logprobs (B,) float32). The same draws (``counter_uniforms``' hash); exp and the
    normaliser's sum are the kernel's, so a logprob can differ from torch's in its last bits."""
    rows, vocab = logits.shape
    if logits.dtype != torch.bfloat16 or logits.stride(1) != 1:
        raise ValueError(f"sample needs bf16 (B, V) logits with contiguous rows, got {logits.dtype} {logits.stride()}")
    temperatures = temperatures.to(torch.float32).contiguous()
    greedy, keys = greedy.to(torch.bool).contiguous(), keys.to(torch.int64).contiguous()
    counters = counters.to(torch.int64).contiguous()
    scratch = torch.empty(2 * vocab + LANES, dtype=torch.float32)
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    library().hf_sample(logits.data_ptr(), logits.stride(0), rows, vocab, temperatures.data_ptr(), greedy.data_ptr(),
                        keys.data_ptr(), counters.data_ptr(), scratch.data_ptr(), tokens.data_ptr(), logprobs.data_ptr())
    return tokens, logprobs


def _run(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None, residual: torch.Tensor | None,
         out: torch.Tensor) -> None:
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or k != panels.in_features or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 (M, {panels.in_features}) with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    for name, tensor in (("bias", bias), ("residual", residual)):
        if tensor is not None and (tensor.dtype != torch.bfloat16 or tensor.stride(-1) != 1):
            raise ValueError(f"{name} must be bf16 with contiguous rows")
    library().hf_linear(x.data_ptr(), x.stride(0), rows, k, panels.data.data_ptr(), panels.out_features,
                      panels.k_block, None if bias is None else bias.data_ptr(),
                      None if residual is None else residual.data_ptr(),
                      0 if residual is None else residual.stride(0), out.data_ptr(), out.stride(0))


@functools.cache
def k_block_for(k: int) -> int | None:
    """The k block with which the kernel gives ``F.linear``'s bits for K = ``k`` on this CPU and torch, or
    None when no candidate does. A fixed random probe (module docstring), so the same answer every run."""
    generator = torch.Generator().manual_seed(k)
    weight = (torch.randn(PROBE_COLUMNS, k, generator=generator) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(PROBE_ROWS, k, generator=generator).to(torch.bfloat16)
    expected = F.linear(x, weight)
    library, _ = _library()
    assert library is not None
    data = torch.empty(weight.numel(), dtype=torch.bfloat16)
    library.hf_pack(weight.data_ptr(), k, data.data_ptr(), PROBE_COLUMNS, k)
    for k_block in (*K_BLOCK_CANDIDATES, k):
        if k_block > k and k_block != k:
            continue  # no break inside K: the same sum as k_block = k
        if torch.equal(linear(x, Panels(data, PROBE_COLUMNS, k, k_block)), expected):
            return k_block
    log.warning("the bf16 kernel finds no k block that gives oneDNN's bits for K=%d; oneDNN keeps those matmuls", k)
    return None
