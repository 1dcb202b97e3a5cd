"""The trainer's attention on CPUs: causal attention over a packed row, forward and backward, in float32, in a
kernel of its own (``cpu_attention.c``).

Why: a packed micro-batch holds many short sequences, and torch's CPU flash-attention spends most of its time on
per-call and per-block overhead at these sizes. On the 18M long-tail update of ``bench/update_bound.py`` (64
sequences of 5-300 tokens in a micro-batch, 8 query and 2 key heads of 64) its float32 forward and backward
reached 12-18 GFLOP per CPU-second against the same core's ~90 for a float32 matmul, and grouping similar
lengths into one call (``packing._length_groups``) adds gathers whose backward writes a full-size zero gradient
per group. Here each sequence is computed in place in the packed row, with no padding, no gather, and the exact
causal half of the work (``bench/update_bound.py`` measures the update's phases before and after).

Numerics: float32 throughout (scores, an exact two-pass softmax with this file's exp, the products), like torch's
float32 kernel in value but not in the last bit. Under bf16 autocast the attention ran in float32 already
(``packing._upcast_for_backward``); here the no-grad forward (the logprobs a PPO ratio divides by) runs the same
kernel as the training forward, so the two agree to the bit. Every output is summed in a fixed order that
depends neither on the thread count nor on the other sequences.

Where: x86-64 CPUs with AVX-512 (torch's dispatch level; ``native_build.MARCH`` says why not AVX2), head
dims that are multiples of 16 up to 256, no dropout, no sliding window shorter than the longest sequence, no
soft-capping or attention sinks. Anything else, no C compiler, or ``HYBRIDFLOW_CPU_KERNELS=0``: the packed
SDPA path (``unavailable_reason`` says why).
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import Any

import torch

from hybridflow.utils import native_build

SOURCE = Path(__file__).with_name("cpu_attention.c")
LANES = 16
MAX_HEAD_DIM = 256


class _Attention(ctypes.Structure):
    """``Attention`` of cpu_attention.c."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v")] + [
        (name, ctypes.c_int64) for name in ("q_token", "q_head", "k_token", "k_head", "v_token", "v_head")
    ] + [("cu", ctypes.c_void_p)] + [(name, ctypes.c_int64) for name in ("tokens", "heads", "kv_heads", "d")] + [
        ("scale", ctypes.c_float), ("out", ctypes.c_void_p), ("dout", ctypes.c_void_p)]


def _configure(library: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.hf_attention_forward.argtypes = [ctypes.POINTER(_Attention), size, size, pointer, pointer]
    library.hf_attention_forward.restype = ctypes.c_int
    library.hf_attention_backward.argtypes = [ctypes.POINTER(_Attention), size, size, pointer, pointer, pointer,
                                              pointer]
    library.hf_attention_backward.restype = ctypes.c_int


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """The compiled kernel and None, or None and why not (once per process)."""
    return native_build.load_vector_kernels(SOURCE, _configure, "the trainer's CPU attention kernel")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None when it can (compiles it on the first call)."""
    return _library()[1]


def available() -> bool:
    return unavailable_reason() is None


def usable(query: torch.Tensor, key: torch.Tensor, dropout: float, sliding_window: int | None, longest: int,
           kwargs: dict[str, Any]) -> bool:
    """Whether a packed row's causal attention (query (1, H, N, D), key (1, Hkv, N, D)) can run here."""
    head_dim, heads, kv_heads = query.shape[3], query.shape[1], key.shape[1]
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and head_dim % LANES == 0 and head_dim <= MAX_HEAD_DIM and heads % kv_heads == 0
            and (dropout == 0.0 or not torch.is_grad_enabled())
            and (sliding_window is None or sliding_window >= longest)
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None and available())


def _shares(cu: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of sequences with about equal work each (a sequence of L tokens costs ~L² + L)."""
    return native_build.balanced_ranges([(e - s) ** 2 + (e - s) for s, e in zip(cu[:-1], cu[1:])], parts)


def _each_share(cu: list[int], call: Any) -> None:
    """``call(first, last)`` for each share of the sequences, on torch's thread count."""
    if not all(native_build.run_ranges(call, _shares(cu, max(1, torch.get_num_threads())))):
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")


def _describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
              out: torch.Tensor | None = None, dout: torch.Tensor | None = None) -> _Attention:
    return _Attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cu.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2], scale,
        None if out is None else out.data_ptr(), None if dout is None else dout.data_ptr())


class _PackedAttention(torch.autograd.Function):
    """softmax(scale q kᵀ + causal mask) v per sequence; q (N, H, D), k and v (N, Hkv, D), float32."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float):
        out = torch.empty(q.shape, dtype=torch.float32)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        attention = _describe(q, k, v, cu, scale)
        library = _library()[0]
        _each_share(cu.tolist(), lambda first, last: library.hf_attention_forward(
            ctypes.byref(attention), first, last, out.data_ptr(), lse.data_ptr()))
        ctx.save_for_backward(q, k, v, cu, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, cu, out, lse = ctx.saved_tensors
        dout = dout.float().contiguous()
        dq = torch.empty(q.shape, dtype=torch.float32)
        dk = torch.empty(k.shape, dtype=torch.float32)
        dv = torch.empty(v.shape, dtype=torch.float32)
        attention = _describe(q, k, v, cu, ctx.scale, out, dout)
        library = _library()[0]
        _each_share(cu.tolist(), lambda first, last: library.hf_attention_backward(
            ctypes.byref(attention), first, last, lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()))
        return dq, dk, dv, None, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(1, heads, N, D) -> a float32 (N, heads, D) view where it can be one (D contiguous)."""
    x = x[0].transpose(0, 1).float()
    return x if x.stride(2) == 1 else x.contiguous()


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: list[int],
                     scale: float | None) -> torch.Tensor:
    """Causal attention of each sequence of a packed row with itself.  # (1, N, H, D) float32

    query (1, H, N, D), key and value (1, Hkv, N, D); sequence s is tokens segments[s] .. segments[s + 1]."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[3])
    cu = torch.tensor(segments, dtype=torch.int64)
    out = _PackedAttention.apply(_rows(query), _rows(key), _rows(value), cu, float(scale))
    return out.unsqueeze(0)
