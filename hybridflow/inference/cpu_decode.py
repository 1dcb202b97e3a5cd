"""A decode step's layers in two kernel calls each (``cpu_kernels.c``), for bf16 models of the plain Llama shape.

Why: at the end of a long tail a decode step holds a few rows, and the compact forward spends it in
about forty tensor ops per layer (norms, rotary, the attention's matmuls, softmax and reshapes, the
activation), each a few microseconds of dispatch and allocation over a few kilobytes of data: on a
~20M Qwen2-shaped model at 8 rows, 3-4 CPU-ms of a 7 ms step besides the matmuls (AMD EPYC Zen 4,
one thread; ``bench/decode_batch_scaling.py --phases 8``). Here a layer is two calls: RMSNorm, q/k/v and
rotary; then this step's keys and values into the cache (the kernel writes them where the access is
the cache's own ``kv_cache.DecodeAccess``; any other ``KVAccess`` is called between the two), the
attention, the o projection onto the residual, RMSNorm, gate/up, SiLU and the down projection onto
the residual. The matmuls are ``cpu_kernels.linear``'s (oneDNN's bits); the rest follows HF's order
of operations and roundings (the kernel file says which), with float32 sums and exp of its own, so a
value can differ from the unfused forward's in its last bf16 bit (tests/unit/rollout/test_rollout_cpu_decode.py
bounds it). Each row is computed alone and masked keys add exact zeros, so a row's result depends
neither on the rows beside it nor on how far the longest of them reads.

Used (``CompactCausalLM.forward``) for one-token decode forwards of the ``fused`` layout, at any torch thread
count (the kernels are single-threaded; with several threads a step of ``SPLIT_ROWS`` rows or more runs its
two halves on two threads), where ``unfusable`` finds nothing the kernel does not do: Gemma's numerics, per-head q/k norms,
experts, biases other than q/k/v's, a head_dim that is not a multiple of 16 (or over 128), a projection
a subclass reduces across ranks (tensor parallel), a weight the panels declined.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hybridflow.inference import cpu_kernels

# compact.CompactCausalLM, which imports this module (so not imported here), and its KVAccess.
CompactCausalLM = Any
KVAccess = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_HEAD_DIM = 128  # the kernel keeps a head's output in 8 vectors
MAX_GROUP = 16  # query heads per KV head: the kernel keeps one vector each
# Rows from which a step on several torch threads splits its rows over two Python threads, the second half on a
# helper thread: the kernels let go of the GIL, and a row's result does not depend on the rows beside it, so the
# bits are the same as one thread's. A ~20M bf16 model's decode, as two engines in two threads against one
# (bench/lone_replica_cores.py): 0.84x at 8 rows, 1.40x at 32, 1.77x at 128 (AMD EPYC Zen 4).
SPLIT_ROWS = 32
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _helper_thread() -> ThreadPoolExecutor:
    """The one helper thread that decodes the second half of a split step (shared by the process's engines)."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused-decode")
        return _helper


class LayerParams(ctypes.Structure):
    """cpu_kernels.c's LayerParams: one layer's tensors (addresses) and k blocks."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_bias", _P), ("o", _P), ("gate_up", _P),
                ("down", _P), ("qkv_k_block", _I), ("o_k_block", _I), ("gate_up_k_block", _I), ("down_k_block", _I)]


class StepParams(ctypes.Structure):
    """cpu_kernels.c's StepParams: the step's sizes, scratch buffers and the cache views' strides."""

    _fields_ = [("rows", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
                ("eps", _F), ("scale", _F), ("normed", _P), ("qkv", _P), ("attended", _P), ("gate_up", _P),
                ("scores", _P), ("key_stride_row", _I), ("key_stride_head", _I), ("key_stride_dim", _I),
                ("value_stride_row", _I), ("value_stride_head", _I), ("value_stride_pos", _I), ("key_length", _I),
                ("positions", _P)]


def unfusable(compact: CompactCausalLM) -> str | None:
    """What in ``compact`` the fused layer does not do, or None when it can run every layer."""
    n, s = compact.numerics, compact.shape
    if compact.weight_layout not in ("panels", "fused") or compact.dtype != torch.bfloat16:
        return "weights not packed in panels in bf16"
    if n.norm_offset or n.attention_softcap is not None or n.activation != "silu" or n.sandwich_norms:
        return "Gemma's numerics"
    if s.head_dim % cpu_kernels.LANES or s.head_dim > MAX_HEAD_DIM or s.intermediate_size % cpu_kernels.LANES:
        return f"head_dim {s.head_dim} / intermediate_size {s.intermediate_size}"
    if s.group_size > MAX_GROUP:
        return f"{s.group_size} query heads per KV head"
    if any(getattr(type(compact), name).__qualname__ != f"CompactCausalLM.{name}" for name in ("_add_linear_", "_project")):
        return "projections reduced across ranks"  # a subclass's (tensor parallel): the kernel adds locally
    for layer, packed in zip(compact.layers, compact._packed or [], strict=False):
        if layer.q_norm is not None or layer.router is not None:
            return "per-head q/k norms or experts"
        if layer.o_bias is not None or layer.gate_up_bias is not None or layer.down_bias is not None:
            return "biases besides q/k/v's"
        if not all(isinstance(p, cpu_kernels.Panels) for p in (packed.qkv, packed.o, packed.gate_up, packed.down)):
            return "a weight the panels declined"
    return None if compact._packed else "no packed weights"


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class FusedDecoder:
    """The fused layers of one ``CompactCausalLM``; built again whenever its packed weights are (``repack``)."""

    def __init__(self, compact: CompactCausalLM) -> None:
        self.compact = compact
        self.layers = []
        for layer, packed in zip(compact.layers, compact._packed or [], strict=True):
            params = LayerParams(
                input_norm=layer.input_norm.data_ptr(), post_norm=layer.post_norm.data_ptr(),
                qkv=packed.qkv.data.data_ptr(), qkv_bias=_address(layer.qkv_bias), o=packed.o.data.data_ptr(),
                gate_up=packed.gate_up.data.data_ptr(), down=packed.down.data.data_ptr(),
                qkv_k_block=packed.qkv.k_block, o_k_block=packed.o.k_block, gate_up_k_block=packed.gate_up.k_block,
                down_k_block=packed.down.k_block)
            self.layers.append(params)
        # The addresses above are the compact's tensors': it keeps them (the norms, the packed copy) alive.
        self.library = cpu_kernels.library()

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head on (N, h) rows, in the kernels at any thread count (Gemma's soft cap, which
        ``unfusable`` refuses anyway, would still be applied by ``_head``)."""
        c = self.compact
        normed = cpu_kernels.rms_norm(rows, c.final_norm, c.eps)
        if isinstance(c._packed_lm_head, cpu_kernels.Panels) and c.numerics.final_softcap is None:
            return cpu_kernels.linear(normed, c._packed_lm_head)
        return c._head(normed)

    def decode(self, rows: torch.Tensor, rotations: list[tuple[torch.Tensor, torch.Tensor]],
               masks: list[torch.Tensor], kv_access: KVAccess, key_length: int,
               head: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
        """``run``, then ``head`` (the final norm and LM head) on the rows when given: its logits. With
        ``SPLIT_ROWS`` rows or more on several torch threads, and a cache access that can be cut by rows
        (``kv_cache.DecodeAccess.row_range``), the second half of the rows runs on the helper thread meanwhile."""
        batch = rows.shape[0]
        if batch < SPLIT_ROWS or torch.get_num_threads() < 2 or not hasattr(kv_access, "row_range"):
            self.run(rows, rotations, masks, kv_access, key_length)
            return None if head is None else head(rows)

        def part(start: int, end: int) -> torch.Tensor | None:
            self.run(rows[start:end], [(cos[start:end], sin[start:end]) for cos, sin in rotations],
                     [mask[start:end] for mask in masks], kv_access.row_range(start, end), key_length)
            return None if head is None else head(rows[start:end])

        half = batch // 2
        second = _helper_thread().submit(part, half, batch)
        first = part(0, half)
        last = second.result()
        return None if first is None or last is None else torch.cat([first, last])

    def run(self, rows: torch.Tensor, rotations: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor],
            kv_access: KVAccess, key_length: int) -> None:
        """Every layer on ``rows`` (B, h), the residual stream, in place. Per layer: its rotary rows (cos, signed
        sin: (B, D) each, contiguous) and its additive float32 mask (B, L), contiguous."""
        c, s = self.compact, self.compact.shape
        batch, width = rows.shape
        qkv_width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        normed = torch.empty(batch, width, dtype=torch.bfloat16)
        qkv = torch.empty(batch, qkv_width, dtype=torch.bfloat16)
        attended = torch.empty(batch, s.num_heads * s.head_dim, dtype=torch.bfloat16)
        gate_up = torch.empty(batch, 2 * s.intermediate_size, dtype=torch.bfloat16)
        group = s.num_heads // s.num_kv_heads
        scores = torch.empty(group * -(-key_length // cpu_kernels.LANES) * cpu_kernels.LANES, dtype=torch.float32)
        step = StepParams(rows=batch, hidden=width, heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                          intermediate=s.intermediate_size, eps=c.eps, scale=c._scale, normed=normed.data_ptr(),
                          qkv=qkv.data_ptr(), attended=attended.data_ptr(), gate_up=gate_up.data_ptr(),
                          scores=scores.data_ptr(), key_length=key_length)
        heads = qkv.view(batch, 1, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        k = heads[:, :, s.num_heads : s.num_heads + s.num_kv_heads]
        v = heads[:, :, s.num_heads + s.num_kv_heads :]
        # kv_cache.DecodeAccess hands over the cache itself: the kernel writes this step's keys and values (no two
        # scatters a layer). Any other access is called between a layer's two kernel calls.
        direct = getattr(kv_access, "direct", None)
        if direct is not None:
            cache_keys, cache_values, positions = self._point_at_cache(step, *direct)  # positions: held for the kernel
            key_layer, value_layer = (t.stride(0) * t.element_size() for t in (cache_keys, cache_values))
        step_ref, residual = ctypes.byref(step), ctypes.c_void_p(rows.data_ptr())
        for index, params in enumerate(self.layers):
            cos, sin = rotations[index]
            params_ref = ctypes.byref(params)
            self.library.hf_decode_qkv(params_ref, step_ref, residual, ctypes.c_void_p(cos.data_ptr()),
                                       ctypes.c_void_p(sin.data_ptr()))
            if direct is not None:
                key_address = cache_keys.data_ptr() + index * key_layer
                value_address = cache_values.data_ptr() + index * value_layer
            else:
                keys, values = kv_access(index, k, v)  # (B, KV, D, L), (B, KV, L, D): views of the cache
                if index == 0:
                    self._check_views(step, keys, values)
                key_address, value_address = keys.data_ptr(), values.data_ptr()
            self.library.hf_decode_attend_mlp(params_ref, step_ref, residual, ctypes.c_void_p(key_address),
                                              ctypes.c_void_p(value_address), ctypes.c_void_p(masks[index].data_ptr()))

    @staticmethod
    def _check_views(step: StepParams, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take the strides of an access's (B, KV, D, L) keys and (B, KV, L, D) values, the same for every layer."""
        if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.shape[-1] != step.key_length:
            raise ValueError(f"the fused decode needs the cache's key positions and value dims contiguous and "
                             f"{step.key_length} keys; got keys {tuple(keys.shape)} {keys.stride()}, values "
                             f"{values.stride()}")
        step.key_stride_row, step.key_stride_head, step.key_stride_dim = keys.stride()[:3]
        step.value_stride_row, step.value_stride_head, step.value_stride_pos = values.stride()[:3]

    @staticmethod
    def _point_at_cache(step: StepParams, keys: torch.Tensor, values: torch.Tensor,
                        positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Set ``step`` to write this step's keys and values at ``positions`` (B,) of the cache's own keys (layers,
        rows, KV, D, capacity) and values (layers, rows, KV, capacity, D); return them and the int64 positions
        whose address ``step`` holds (the caller keeps them alive)."""
        positions = positions.to(torch.int64).contiguous()
        # The kernel writes and reads by address: what torch's indexing would refuse must be refused here.
        capacity = keys.shape[-1]
        low, high = torch.aminmax(positions)
        if positions.numel() != step.rows or step.key_length > capacity or int(low) < 0 or int(high) >= step.key_length:
            raise IndexError(f"fused decode: positions {int(low)}..{int(high)} of {positions.numel()} rows and "
                             f"{step.key_length} keys do not fit {step.rows} rows of a cache of {capacity} positions "
                             "(each row's position must be below the keys read)")
        FusedDecoder._check_views(step, keys[0, :, :, :, : step.key_length], values[0, :, :, : step.key_length])
        step.positions = positions.data_ptr()
        return keys, values, positions
