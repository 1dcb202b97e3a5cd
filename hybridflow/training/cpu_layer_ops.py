"""A decoder layer's RMSNorms and SwiGLU activation fused for training on CPUs (``cpu_layer_ops.c``), as Liger's
kernels do on GPUs: each is one pass forward and one backward instead of a chain of torch ops.

Why: in the 18M long-tail update (bf16-mixed, one thread, Zen 4) the MLP's ``silu(gate) * up`` and its backward
took ~0.5 s of an 8.5 s update and the RMSNorms (``pow``, ``mean``, ``rsqrt``, two products, and their
backward) ~0.45 s; the matmuls they sit between ran at the hardware's rate. Each op over a (tokens, width)
activation is bound by memory traffic, so fusing them cuts passes over the same bytes.

Numerics: RMSNorm keeps HF's float32 formula and its two roundings (``w * (x * rstd)``), with the sum of squares
in the kernel's order; its output stays float32, as HF's (under autocast the projections cast it, and their
gradients add up in float32). SwiGLU computes ``silu(a) * b`` in float32 and rounds once (HF rounds silu(a) to
bf16 first). The RMSNorm weight's gradient is summed per block of 64 rows and the blocks added in order, so no
result depends on the thread count.

``enable_fused_layer_ops(model)`` sets the forward of the model's RMSNorm and MLP modules of the families below
(instances only; parameters, state dicts and checkpoints are untouched). They take the kernels under CPU autocast
(bf16-mixed, the precision the defaults choose on CPUs with bf16 hardware); a float32 forward (``_mixed`` says
why) and a call the kernels cannot take (a bf16 weight, a DTensor, a width not a multiple of 16) run the
module's own forward.
"""

from __future__ import annotations

import ctypes
import functools
import types
from pathlib import Path
from typing import Any

import torch

from hybridflow.utils import native_build

SOURCE = Path(__file__).with_name("cpu_layer_ops.c")
BLOCK_ROWS = 64  # cpu_layer_ops.c's: rows of one partial sum of the RMSNorm weight's gradient
LANES = 16
# Classes whose forward is HF's Llama RMSNorm (weight * (x * rsqrt(mean(x²) + eps)) in float32) and whose MLP is
# down(act(gate(x)) * up(x)). Gemma's norms scale by (1 + w) and are left alone.
NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2MoeRMSNorm",
                          "Qwen3MoeRMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "Qwen2MoeMLP", "Qwen3MoeMLP"})
SILU = ("silu", "swish")


def _configure(library: ctypes.CDLL) -> None:
    p, n, f, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    library.hf_rms_norm_forward.argtypes = [p, n, n, n, n, p, f, p, p]
    library.hf_rms_norm_backward.argtypes = [p, n, p, p, p, n, n, n, n, p, p]
    library.hf_rms_norm_reduce.argtypes = [p, n, n, p]
    library.hf_swiglu_forward.argtypes = [p, p, p, flag, n, n, n]
    library.hf_swiglu_backward.argtypes = [p, p, p, p, p, flag, n, n, n]
    for name in ("hf_rms_norm_forward", "hf_rms_norm_backward", "hf_rms_norm_reduce", "hf_swiglu_forward",
                 "hf_swiglu_backward"):
        getattr(library, name).restype = None


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    return native_build.load_vector_kernels(SOURCE, _configure, "the trainer's CPU layer kernels")


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can (compiles them on the first call)."""
    return _library()[1]


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor the kernels can address (not a DTensor or another subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"


# ------------------------------------------------------------------------------------------------ RMSNorm


def norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and _plain(x) and _plain(weight)
            and x.shape[-1] == weight.shape[0] and x.shape[-1] % LANES == 0 and unavailable_reason() is None)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape, h = x.shape, x.shape[-1]
        x2 = x.reshape(-1, h)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, h, dtype=torch.float32)
        rstd = torch.empty(rows, dtype=torch.float32)
        w = weight.detach().contiguous()
        library = _library()[0]
        native_build.run_ranges(lambda first, last: library.hf_rms_norm_forward(
            x2.data_ptr(), x2.stride(0), first, last, h, w.data_ptr(), eps, y.data_ptr(), rstd.data_ptr()),
            native_build.even_ranges(rows, _threads()))
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x2, w, rstd = ctx.saved_tensors
        rows, h = x2.shape
        dy = dy.reshape(rows, h).float().contiguous()
        dx = torch.empty(rows, h, dtype=torch.float32)
        blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
        partials = torch.empty(blocks, h, dtype=torch.float32)
        library = _library()[0]
        native_build.run_ranges(lambda first, last: library.hf_rms_norm_backward(
            x2.data_ptr(), x2.stride(0), dy.data_ptr(), w.data_ptr(), rstd.data_ptr(), rows, h, first, last,
            dx.data_ptr(), partials.data_ptr()), native_build.even_ranges(blocks, _threads()))
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.empty(h, dtype=torch.float32)
            library.hf_rms_norm_reduce(partials.data_ptr(), blocks, h, dw.data_ptr())
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of float32 ``x`` (..., h) with a float32 weight, forward and backward in the kernel."""
    return _RMSNorm.apply(x, weight, float(eps))


# ------------------------------------------------------------------------------------------------ SwiGLU


def swiglu_usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float32) and a.shape == b.shape
            and _plain(a) and _plain(b) and unavailable_reason() is None)


def _element_ranges(n: int) -> list[tuple[int, int]]:
    """Ranges of elements starting at multiples of 16 (the kernel's vectors), about equal in size."""
    return native_build.even_ranges(n, _threads(), LANES)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        y = torch.empty_like(a)
        n, bf16 = a.numel(), a.dtype == torch.bfloat16
        library = _library()[0]
        native_build.run_ranges(lambda first, last: library.hf_swiglu_forward(
            a.data_ptr(), b.data_ptr(), y.data_ptr(), bf16, first, last, n), _element_ranges(n))
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        dy = dy.to(a.dtype).contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        n, bf16 = a.numel(), a.dtype == torch.bfloat16
        library = _library()[0]
        native_build.run_ranges(lambda first, last: library.hf_swiglu_backward(
            a.data_ptr(), b.data_ptr(), dy.data_ptr(), da.data_ptr(), db.data_ptr(), bf16, first, last, n),
            _element_ranges(n))
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (bf16 or float32, same shapes), forward and backward in the kernel."""
    return _SwiGLU.apply(a, b)


# ------------------------------------------------------------------------------------------------ the modules


def _mixed() -> bool:
    """Whether this forward runs under CPU autocast (bf16-mixed): the only place the modules take the kernels.

    A float32 model keeps HF's own ops, to the bit: the built-in tool-calling warm start (float32 SFT, lr 2e-3,
    625 steps) is chaotic where it learns the call format, and with the fused ops its preset's seed ended at a
    loss of 0.084 against 0.008 (the next seed: 0.0025 against 0.0016), which its RL test then could not
    recover from; a float32 run's numbers stay those of earlier versions."""
    return torch.is_autocast_enabled("cpu")


def _norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if _mixed() and norm_usable(hidden_states, self.weight):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    product = swiglu(gate, up) if _mixed() and swiglu_usable(gate, up) else self.act_fn(gate) * up
    return self.down_proj(product)


def _silu_mlp(module: torch.nn.Module) -> bool:
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    return (type(module).__name__ in MLP_CLASSES and act in SILU
            and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")))


def enable_fused_layer_ops(model: torch.nn.Module) -> int:
    """Route the model's Llama-style RMSNorms and SiLU MLPs through the fused kernels; returns how many modules
    now do (0 where the kernels are unavailable: ``unavailable_reason``)."""
    if unavailable_reason() is not None:
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
            count += 1
        elif _silu_mlp(module):
            module.forward = types.MethodType(_mlp_forward, module)
            count += 1
    return count
