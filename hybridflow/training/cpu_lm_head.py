"""The LM head's softmax on CPUs: per-row logprob, log-normaliser, mean logit and entropy of a chunk of logits,
and their gradient, in a kernel of its own (``cpu_lm_head.c``).

Why: ``lm_head._LMHeadLogprobs`` spelled the softmax in torch ops, each a pass over a (rows, V) chunk: the
float32 copy of the bf16 logits, logsumexp (max, subtract, exp, sum), the entropy's exp, product and sum, and in
the backward the exp again, a zero-filled gradient, two products, a scatter, a sum and the bf16 copy. On the 18M
long-tail update (3,328 response rows of V = 4,096, one thread, Zen 4) those passes took about as long as the
head's four matmuls. Here a row is read once for its maximum and once for the sums (forward), and once in the
backward, which writes the gradient straight in the matmul's dtype. Σπ² (``with_sum_pi_squared``) is one more
sum of the same pass, so asking for it changes no other result.

Numerics: float32 sums in the kernel's order and its exp (Cephes' polynomial), so results differ from torch's ops
in the last bits; the gradient's bf16 is rounded to nearest even as torch's ``.to``. Where: the CPUs of
``native_build.march_for``, logits in bf16 or float32.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from hybridflow.utils import native_build

SOURCE = Path(__file__).with_name("cpu_lm_head.c")
DTYPES = (torch.bfloat16, torch.float32)


def _configure(library: ctypes.CDLL) -> None:
    pointer, size, flag, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    library.hf_lm_head_forward.argtypes = [pointer, flag, size, size, size, size, pointer, real, pointer, pointer,
                                           pointer, pointer, pointer]
    library.hf_lm_head_forward.restype = None
    library.hf_lm_head_backward.argtypes = [pointer, flag, size, size, size, size, pointer, real, pointer, pointer,
                                            pointer, pointer, pointer, size]
    library.hf_lm_head_backward.restype = None


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    return native_build.load_vector_kernels(SOURCE, _configure, "the LM head's CPU softmax kernel")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None when it can (compiles it on the first call)."""
    return _library()[1]


def usable(logits_dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and logits_dtype in DTYPES and unavailable_reason() is None


def _ranges(rows: int) -> list[tuple[int, int]]:
    return native_build.even_ranges(rows, max(1, torch.get_num_threads()))


def _check(z: torch.Tensor, labels: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1 or z.dtype not in DTYPES or labels.dtype != torch.int64:
        raise ValueError(f"logits must be bf16/float32 (rows, V) with contiguous rows and labels int64, got "
                         f"{z.dtype} {tuple(z.shape)} strides {z.stride()} and {labels.dtype}")


def row_stats(z: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool,
              with_sum_pi_squared: bool = False) -> tuple[torch.Tensor, ...]:
    """(logprob of the label, lse, E_p[z], entropy or None, Σ_v p(v)² or None) of each row of
    softmax(z / temperature).  # (rows,) each"""
    _check(z, labels)
    labels = labels.contiguous()
    rows = z.shape[0]
    logprobs, lse, mean = (torch.empty(rows, dtype=torch.float32) for _ in range(3))
    entropy = torch.empty(rows, dtype=torch.float32) if with_entropy else None
    spi = torch.empty(rows, dtype=torch.float32) if with_sum_pi_squared else None
    library = _library()[0]
    native_build.run_ranges(lambda first, last: library.hf_lm_head_forward(
        z.data_ptr(), z.dtype == torch.bfloat16, z.stride(0), first, last, z.shape[1], labels.data_ptr(),
        temperature, logprobs.data_ptr(), lse.data_ptr(), mean.data_ptr(),
        None if entropy is None else entropy.data_ptr(), None if spi is None else spi.data_ptr()), _ranges(rows))
    return logprobs, lse, mean, entropy, spi


def logits_grad(z: torch.Tensor, labels: torch.Tensor, temperature: float, lse: torch.Tensor, mean: torch.Tensor,
                grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """d(loss)/dz in z's dtype, from the gradients of the logprobs and of the entropy (either may be None).  # (rows, V)"""
    _check(z, labels)
    labels, lse, mean = labels.contiguous(), lse.contiguous(), mean.contiguous()
    g_lp = None if grad_logprobs is None else grad_logprobs.float().contiguous()
    g_h = None if grad_entropy is None else grad_entropy.float().contiguous()
    dz = torch.empty(z.shape, dtype=z.dtype)
    library = _library()[0]
    native_build.run_ranges(lambda first, last: library.hf_lm_head_backward(
        z.data_ptr(), z.dtype == torch.bfloat16, z.stride(0), first, last, z.shape[1], labels.data_ptr(),
        temperature, lse.data_ptr(), mean.data_ptr(), None if g_lp is None else g_lp.data_ptr(),
        None if g_h is None else g_h.data_ptr(), dz.data_ptr(), dz.stride(0)), _ranges(z.shape[0]))
    return dz
