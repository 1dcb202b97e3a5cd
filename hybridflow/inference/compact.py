"""A compact inference forward for the Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 2 / Gemma 3 /
Qwen3-MoE / Mixtral families over a slot KV cache.

Why not the Hugging Face modules: on a CPU or a small GPU, a decode step of a small model is
dominated by per-op framework overhead, not arithmetic. HF's forward spends most of a step in mask
construction, cache bookkeeping and module dispatch; this one issues about twenty tensor ops per
layer (fused q/k/v and gate/up projections, one rotary pass over queries and keys together) and
reads keys and values straight out of a preallocated cache (``kv_cache.SlotKVCache``).

The weights are the Hugging Face model's own: ``CompactCausalLM.from_hf`` concatenates the q/k/v
and gate/up projections into fused tensors and then points the HF parameters at views of them,
so the HF model and this forward share one copy of every weight. ``update_weights`` therefore
writes through the HF parameter names (``model.state_dict()``) and both forwards see it.

What is supported (checked in ``from_hf``, with a clear error otherwise): decoder-only models with
RMSNorm, rotary embeddings of any static type (default, linear, llama3, yarn: taken from the HF
rotary module's ``inv_freq`` and ``attention_scaling``), grouped-query attention, SiLU-gated MLP,
optional q/k/v/o and MLP biases (Qwen2, Llama ``attention_bias``/``mlp_bias``), optional per-head
q/k RMSNorm (Qwen3, Gemma 3), tied or untied embeddings, sliding-window layers (a mask), checkpoints
whose q/k/v and gate/up projections are already fused (Phi-3), and Gemma's numerics (``1 + weight``
norms, scaled embeddings, sandwich norms, soft-capped scores and logits, a tanh-GELU gate, per
layer-type rotary frequencies), mixture-of-experts layers (HF's routers, the chosen experts as a
dense loop; such a model decodes eagerly). What differs per family is the table in ``families``.
Not supported: RoPE types whose frequencies depend on the sequence length (dynamic, longrope) and
partial rotary embeddings.

Numerics follow HF's order of operations (RMSNorm in float32 then cast, softmax in float32), so
fp32 logits agree with HF's to ~1e-5 (tests check 1e-4).

Weight layouts (``set_weight_layout``): ``dense`` runs every matmul on the fused tensors above
(``F.linear``: MKL on a CPU). ``onednn`` keeps, beside them, a copy of every matmul weight packed
in oneDNN's blocked layout for this CPU, so a decode step's matmuls read the weights the way the
kernels consume them instead of re-packing all of them on every call: +11% matmul throughput and
+7% per fp32 decode step at batch 128 on an AVX2 AMD EPYC (on the AVX-512 Xeon measured before,
no gain), for one more copy of the matmul weights in memory. The packed copy is derived state:
``repack()`` rebuilds it from the fused tensors after a weight update (the engine does so when
``weight_update`` ends). ``resolve_weight_layout("auto", ...)`` picks it only where it was
measured faster.

bf16 weights pack too. There the dense ``F.linear`` already runs in oneDNN, on the weights' plain
layout; the packed copy is laid out the way its kernels read it: a decode step's matmuls at batch 8 of a ~20M
Qwen2-shaped model take 4.8 CPU-ms instead of 6.9 (1.45x), and 27.1 instead of 29.3 at batch 128, and
the engine decodes batch 8 1.26x faster, on an AMD EPYC Zen 4 (avx512_bf16, 1 thread, 2 cores shared
at load ~4.5; bench/decode_batch_scaling.py, docs/figures.md). The kernels are the
same, so the results are the dense layout's to the bit: the bias rides in the kernel as in
``F.linear``, and the residual add of the o and down projections rides on it as a sum post-op (one
rounding to bf16, like the dense path's ``addmm_``), where adding a rounded product would round twice.
Keeping o and down dense instead (``addmm_``) saves a third of the copy but measured 7% slower for
the step's matmuls at batch 8 (5.1 against 4.8 ms; the dense step 6.7 ms), so they pack too.

``panels`` (bf16 on CPUs with avx512_bf16 and no AMX) runs the matmuls in this package's own kernel
(``cpu_kernels``) on a copy packed in panels of 48 columns: the same bits as oneDNN's (it checks), one
decode step's matmuls at 8 rows 1.8x faster than the ``onednn`` layout's and the same at 128 rows,
with no row minimum (the kernel's sums do not depend on the row count). ``fused`` is ``panels`` with
each one-token decode layer in two kernel calls (``cpu_decode``: the norms, rotary, attention and
activation too), where the model's family allows, and the engine's plain sampling in one
(``cpu_kernels.sample``, chosen by the runner); it rounds like the rest only up to the last bit of
a bf16 value, so it is a layout of its own. ``auto`` picks ``fused`` on the CPUs of
``ONEDNN_FASTER_VENDORS`` where the kernel builds. The kernels are single-threaded, and the fused decode runs
on them whatever the torch threads, so a rollout samples the same at any thread count; with more than one
thread, a matmul of ``THREADED_MATMUL_ROWS`` or more rows (a prefill's) runs in oneDNN's threaded kernels on
the dense weights instead, with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.inference import cpu_kernels
from hybridflow.inference.cpu_decode import FusedDecoder, unfusable
from hybridflow.inference.families import DYNAMIC_ROPE_TYPES, FAMILIES, Family, Numerics, config_problem
from hybridflow.utils.device import CpuFeatures, cpu_features


# Fewest rows a matmul of the engine runs. Matmul libraries take kernels of their own for a few rows (a
# matrix-vector product at 1 row; on the CPU MKL's fp32 GEMM at 1-3 rows, oneDNN's packed kernels at 1) that sum
# in another order than the kernels for more rows, so a row's logprobs would depend on how many rows decoded
# beside it: a long tail's last rows, a replica left with few rows, a short prefill chunk. Measured on an AMD
# EPYC Zen 4: rows of F.linear at M = 1-3 differ from the same rows at M = 256 in fp32 (M = 4..128 equal them
# to the bit); oneDNN's packed fp32 and bf16 at M = 1 only; a ~20M bf16 model on engines of 1 row sampled other
# tokens in 25 of 32 seeded samples than on one of 32 rows, 0 now (bench/batch_invariance.py). Fewer rows are
# repeated up to this many (``min_rows``): the extra rows read no extra weights, so a memory-bound step at batch 1
# costs little more (~20M bf16: -4%; the built-in fp32 model, all per-op cost: -10 to -20% at batches 1-3).
MIN_MATMUL_ROWS = 4


def min_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (N, K) with its rows repeated to ``MIN_MATMUL_ROWS`` when it has fewer (the first N are ``x``)."""
    rows = x.shape[0]
    return x if rows >= MIN_MATMUL_ROWS else x.repeat(-(-MIN_MATMUL_ROWS // rows), 1)[:MIN_MATMUL_ROWS]


@dataclass
class LayerWeights:
    """One decoder layer's tensors. Fused tensors are the storage; HF parameters are views of them."""

    input_norm: torch.Tensor  # (h,)
    qkv_weight: torch.Tensor  # ((H + 2 KV) D, h): q rows, then k rows, then v rows
    qkv_bias: torch.Tensor | None  # ((H + 2 KV) D,)
    q_norm: torch.Tensor | None  # (D,) Qwen3 per-head RMSNorm on queries
    k_norm: torch.Tensor | None  # (D,)
    o_weight: torch.Tensor  # (h, H D)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # (h,)
    gate_up_weight: torch.Tensor | None  # (2 I, h): gate rows, then up rows; None in a mixture-of-experts layer
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor | None  # (h, I); None in a mixture-of-experts layer
    down_bias: torch.Tensor | None
    # Gemma's sandwich norms: on the attention output and on the MLP output (post_norm is then the
    # norm before the MLP, HF's pre_feedforward_layernorm).
    attn_out_norm: torch.Tensor | None = None  # (h,)
    mlp_out_norm: torch.Tensor | None = None  # (h,)
    # A mixture-of-experts layer (Qwen3-MoE, Mixtral) instead of the MLP: the router and the HF
    # experts' own stacked tensors.
    router: torch.Tensor | None = None  # (E, h)
    experts_gate_up: torch.Tensor | None = None  # (E, 2 I_e, h): gate rows, then up rows
    experts_down: torch.Tensor | None = None  # (E, h, I_e)


WEIGHT_LAYOUTS = ("auto", "dense", "onednn", "panels", "fused")
KERNEL_LAYOUTS = ("panels", "fused")  # the package's own kernels (cpu_kernels)
# CPU vendors where the oneDNN layout was measured faster than dense matmuls (module docstring): fp32
# on an AVX2 EPYC; bf16 on a Zen 4 EPYC with avx512_bf16 (packing bf16 elsewhere is unmeasured).
ONEDNN_FASTER_VENDORS = ("AuthenticAMD",)
# The weight dtypes the oneDNN layout takes: float16 packing needs avx_ne_convert or avx512_fp16 (torch's
# error on this Zen 4) and was never measured.
ONEDNN_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack fp32 or bf16 linear weights for oneDNN on ``device`` (CPU builds with
    oneDNN, bf16 where oneDNN runs bf16 on this CPU; the packing and matmul ops are the ones
    torch.compile's CPU backend uses)."""
    return (
        device.type == "cpu"
        and dtype in ONEDNN_PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


def resolve_weight_layout(
    layout: str, device: torch.device | str, dtype: torch.dtype, cpu: CpuFeatures | None = None
) -> str:
    """``auto`` on CPUs of ``ONEDNN_FASTER_VENDORS``: for bf16 ``fused`` where the CPU has avx512_bf16
    and no AMX and the kernel builds (``cpu_kernels``), else ``onednn`` where the CPU has avx512_bf16; for
    fp32 ``onednn`` (where it is available). ``dense`` elsewhere. An explicit layout is kept
    (``set_weight_layout`` checks it)."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; expected one of {', '.join(WEIGHT_LAYOUTS)}")
    if layout != "auto":
        return layout
    device = torch.device(device)
    if not onednn_packing_available(device, dtype):
        return "dense"
    cpu = cpu or cpu_features()
    if dtype == torch.bfloat16 and not cpu.avx512_bf16:
        return "dense"
    if (dtype == torch.bfloat16 and cpu.vendor in ONEDNN_FASTER_VENDORS and cpu_kernels.hardware_reason(cpu) is None
            and cpu_kernels.available()):
        return "fused"
    return "onednn" if cpu.vendor in ONEDNN_FASTER_VENDORS else "dense"


def layouts_round_alike(first: str, second: str, dtype: torch.dtype) -> bool:
    """Whether two resolved layouts give the same numbers to the bit in ``dtype``: the same layout; or in bf16
    any two of ``dense``, ``onednn`` and ``panels``, which sum in oneDNN's order (the residual adds fused,
    rounding once as ``addmm_`` does; tests/unit/rollout/test_rollout_compact.py checks it). In fp32 the dense
    layout is MKL's, which sums in another order; ``fused`` rounds its own way outside the matmuls."""
    return first == second or (dtype == torch.bfloat16 and "fused" not in (first, second))


# A packed matmul weight: oneDNN's blocked layout (a tensor), the kernel's panels, or None (dense).
Packed = torch.Tensor | cpu_kernels.Panels | None


@dataclass(frozen=True)
class _PackedLayer:
    """One layer's matmul weights packed (copies of the fused tensors)."""

    qkv: Packed
    o: Packed
    gate_up: Packed  # None in a mixture-of-experts layer (its experts run dense)
    down: Packed


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int  # H
    num_kv_heads: int  # KV
    head_dim: int  # D
    intermediate_size: int  # I

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


# What a forward needs from the cache for one layer: write this step's keys and values (B, C, KV, D)
# and get back every key and value the queries may attend to: keys transposed (B, KV, D, L), values
# (B, KV, L, D) (see kv_cache for why keys are stored transposed).
KVAccess = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class CompactCausalLM:
    """Inference-only forward of a supported HF causal LM; see the module docstring."""

    def __init__(
        self,
        *,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        layers: list[LayerWeights],
        shape: AttentionShape,
        rms_norm_eps: float,
        rotary: list[tuple[torch.Tensor, float]],
        max_positions: int,
        layer_rotary: list[int] | None = None,
        sliding_windows: list[int | None] | None = None,
        numerics: Numerics | None = None,
    ) -> None:
        self.embed = embed  # (V, h)
        self.lm_head = lm_head  # (V, h); the same tensor as embed when tied
        self.final_norm = final_norm
        self.layers = layers
        self.shape = shape
        self.eps = rms_norm_eps
        # Per layer: the sliding window W (a query at p sees keys p - W < k <= p), or None for all keys.
        # A window of at least max_positions hides no key this forward will see: None (no mask).
        windows = list(sliding_windows) if sliding_windows is not None else [None] * len(layers)
        self.sliding_windows = [None if w is None or w >= max_positions else w for w in windows]
        self.numerics = numerics or Numerics()
        self.dtype = embed.dtype
        self.device = embed.device
        # Rotary tables: (inv_freq, attention scaling) each, and each layer's index into them.
        self.rotary = rotary
        self.layer_rotary = list(layer_rotary) if layer_rotary is not None else [0] * len(layers)
        self._rotary_tables = [self._rotary_table(inv_freq, scaling, max_positions) for inv_freq, scaling in rotary]
        n = self.numerics
        self._scale = n.attention_scale if n.attention_scale is not None else shape.head_dim**-0.5
        # HF multiplies by its float32 scale buffer cast to the weights' dtype.
        self._embed_scale = None if n.embed_scale is None else torch.tensor(n.embed_scale).to(self.dtype).item()
        # Whether a forward can be recorded as a CUDA graph: routing tokens to experts has
        # data-dependent shapes, so a mixture-of-experts model decodes eagerly.
        self.capturable = all(layer.router is None for layer in layers)
        self.weight_layout = "dense"
        self._batch_hint = 1
        self._packed: list[_PackedLayer] | None = None
        self._packed_lm_head: Packed = None
        self._fused: FusedDecoder | None = None  # the fused layout's decode layers (cpu_decode)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_positions(self) -> int:
        return int(self._rotary_tables[0][0].shape[0])

    def _rotary_table(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for every position, as HF computes them (float32, scaled, then cast): (L, D) each.

        rotate_half's sign is folded into the sin table: rotate_half(x) sin = swap_halves(x) sin_signed
        exactly (negation is exact), so the rotary pass needs no negated copy of x.
        """
        positions = torch.arange(max_positions, dtype=torch.float32, device=self.device)
        freqs = positions[:, None] * inv_freq.to(device=self.device, dtype=torch.float32)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos = (angles.cos() * scaling).to(self.dtype)
        sin = (angles.sin() * scaling).to(self.dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def from_hf(model: torch.nn.Module, max_positions: int) -> CompactCausalLM:
        """Share ``model``'s weights (already on the target device and dtype) with a compact forward.

        Re-points the q/k/v and gate/up parameters of ``model`` at views of fused tensors; the HF
        model keeps working and keeps its parameter names. Raises ``ValueError`` for unsupported
        architectures, naming what is not supported.
        """
        config = model.config
        _check_supported(model)
        base = model.model
        shape = AttentionShape(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=base.layers[0].self_attn.head_dim,
            intermediate_size=config.intermediate_size,
        )
        family = FAMILIES[config.model_type]
        numerics = family.numerics(config)
        layers = [_fuse_layer(layer, family, numerics) for layer in base.layers]
        rotary, layer_rotary = family.rotary(base.rotary_emb, config)
        return CompactCausalLM(
            embed=base.embed_tokens.weight.data,
            lm_head=model.lm_head.weight.data,
            final_norm=base.norm.weight.data,
            layers=layers,
            shape=shape,
            rms_norm_eps=float(config.rms_norm_eps),
            rotary=rotary,
            max_positions=max_positions,
            layer_rotary=layer_rotary,
            sliding_windows=[family.sliding_window(config, i) for i in range(len(layers))],
            numerics=numerics,
        )

    # ------------------------------------------------------------------ weight layout

    def set_weight_layout(self, layout: str, batch_hint: int = 1) -> None:
        """Run the matmuls on ``dense`` weights or on an ``onednn`` packed copy (module docstring).

        ``batch_hint`` is the usual number of rows a matmul sees (the decode batch); oneDNN picks
        its blocking for it, and any number of rows still works. Raises ``ValueError`` when the
        layout is unknown or cannot run on this device and dtype.
        """
        layout = resolve_weight_layout(layout, self.device, self.dtype)
        if layout == "onednn" and not onednn_packing_available(self.device, self.dtype):
            raise ValueError(
                f"weight layout 'onednn' needs float32 or bfloat16 weights on a CPU and a torch built with oneDNN "
                f"(got {self.dtype} on {self.device}); use 'dense'"
            )
        if layout in KERNEL_LAYOUTS and (self.dtype != torch.bfloat16 or self.device.type != "cpu"
                                         or not cpu_kernels.available()):
            raise ValueError(f"weight layout {layout!r} needs bfloat16 weights on a CPU where the bf16 kernels run (got "
                             f"{self.dtype} on {self.device}; {cpu_kernels.unavailable_reason() or 'kernels available'}); "
                             "use 'onednn' or 'dense'")
        self.weight_layout, self._batch_hint = layout, max(1, batch_hint)
        self.repack()

    def repack(self) -> None:
        """Rebuild the packed copy from the fused tensors; call after their values change."""
        self._fused = None
        if self.weight_layout == "dense":
            self._packed = self._packed_lm_head = None
            return

        def pack(weight: torch.Tensor | None) -> Packed:
            if weight is None:
                return None
            if self.weight_layout in KERNEL_LAYOUTS:
                return cpu_kernels.pack(weight)  # None for a shape the kernel declines: that weight runs dense
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self._batch_hint)

        self._packed = [
            _PackedLayer(qkv=pack(w.qkv_weight), o=pack(w.o_weight), gate_up=pack(w.gate_up_weight),
                         down=pack(w.down_weight))
            for w in self.layers
        ]
        self._packed_lm_head = pack(self.lm_head)
        if self.weight_layout == "fused":
            reason = unfusable(self)
            self._fused = FusedDecoder(self) if reason is None else None

    def packed_tensors(self) -> list[torch.Tensor]:
        """The packed copy's tensors (none with the dense layout), for memory accounting."""
        if self._packed is None:
            return []
        packed = [t for p in self._packed for t in (p.qkv, p.o, p.gate_up, p.down)] + [self._packed_lm_head]
        return [t.data if isinstance(t, cpu_kernels.Panels) else t for t in packed if t is not None]

    def release_packed(self) -> None:
        """Drop the packed copy (the engine's sleep level 2); ``repack`` rebuilds it."""
        self._packed = self._packed_lm_head = None
        self._fused = None

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: Packed) -> torch.Tensor:
        """x W^T (+ b) on the packed copy when there is one (x (N, K) → (N, out)); at least ``MIN_MATMUL_ROWS``
        but in the kernel's panels, whose sums do not depend on the row count."""
        if isinstance(packed, cpu_kernels.Panels):
            if _kernel_runs(x.shape[0]):
                return cpu_kernels.linear(x, packed, bias)
            packed = None  # many rows on several threads: oneDNN's threaded kernels on the dense weights, the same bits
        if x.shape[0] < MIN_MATMUL_ROWS:
            return self._linear(min_rows(x), weight, bias, packed)[: x.shape[0]]
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def _add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, packed: Packed) -> None:
        """``residual += x W^T (+ b)`` in place; with a bias in HF's order, residual + (x W^T + b).

        Dense and bias-free, the add rides on the matmul (addmm with beta = 1): one pass fewer.
        Fewer than ``MIN_MATMUL_ROWS`` rows are added as that many, but in the kernel's panels.
        """
        if isinstance(packed, cpu_kernels.Panels) and bias is None:
            if _kernel_runs(x.shape[0]):
                cpu_kernels.add_linear_(residual, x, packed)  # the add rounded once in the kernel, as oneDNN's post-op
                return
            packed = None  # many rows on several threads: addmm_ on the dense weights, the same bits
        if residual.shape[0] < MIN_MATMUL_ROWS:
            padded = min_rows(residual)
            self._add_linear_(padded, min_rows(x), weight, bias, packed)
            residual.copy_(padded[: residual.shape[0]])
            return
        if packed is None and bias is None:
            residual.addmm_(x, weight.t())
        elif packed is not None and bias is None and residual.dtype == torch.bfloat16:
            # The add as the kernel's sum post-op: rounded once, as addmm_ rounds (module docstring).
            residual.copy_(torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add"))
        else:
            residual.add_(self._linear(x, weight, bias, packed))

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_access: KVAccess,
        key_length: int,
        with_logits: bool = True,
        all_hidden: bool = False,
    ) -> torch.Tensor | None:
        """Run ``input_ids`` (B, C) at ``positions`` (B, C) and return the last column's logits (B, V).

        Every sequence attends to the keys at positions ``<=`` its query's position among the first
        ``key_length`` cache positions that ``kv_access`` returns (after writing this step's keys),
        so the positions alone define the causal mask: no padding mask is needed as long as each
        row's cache holds that sequence's tokens at positions below its queries. Prefill, which
        needs no logits (each sample feeds the prompt's last token itself), passes
        ``with_logits=False`` and skips the LM head. ``all_hidden=True`` returns every column's final hidden
        state instead (B, C, h), for ``logits`` of the columns a caller picks (a prefill that scores its prompt).
        """
        hidden = F.embedding(input_ids, self.embed)  # (B, C, h)
        if self._embed_scale is not None:
            hidden.mul_(self._embed_scale)
        # Per rotary table: cos and signed sin at the positions, (B, C, 1, D) each.
        rotations = {k: (cos[positions].unsqueeze(2), sin[positions].unsqueeze(2))
                     for k, (cos, sin) in enumerate(self._rotary_tables) if k in self.layer_rotary}
        key_positions = torch.arange(key_length, device=self.device)
        masks = {window: self._mask(key_positions, positions, window) for window in set(self.sliding_windows)}
        if self._fused is not None and input_ids.shape[1] == 1 and not all_hidden:
            batch = input_ids.shape[0]
            return self._fused.decode(hidden.view(batch, -1),
                                      [tuple(t.view(batch, -1) for t in rotations[k]) for k in self.layer_rotary],
                                      [masks[w].view(batch, -1) for w in self.sliding_windows], kv_access, key_length,
                                      head=self._fused.head if with_logits else None)
        for index, layer in enumerate(self.layers):
            packed = self._packed[index] if self._packed is not None else None
            cos, sin = rotations[self.layer_rotary[index]]
            mask = masks[self.sliding_windows[index]]
            hidden = self._layer(index, layer, packed, hidden, cos, sin, mask, kv_access)
        if all_hidden:
            return hidden
        return self.logits(hidden[:, -1]) if with_logits else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states (N, h) → (N, V): the final norm, the head, Gemma's soft cap."""
        return self._head(self._rms_norm(hidden, self.final_norm))

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed hidden states (N, h) → (N, V), with Gemma's soft cap."""
        logits = self._linear(normed, self.lm_head, None, self._packed_lm_head)
        cap = self.numerics.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def _mask(self, key_positions: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Additive float32 mask (B, 1, 1, C, L), shaped for scores viewed as (B, KV, G, C, L): 0 where
        a query at ``positions`` (B, C) sees a key (causal, and within ``window`` when one is set)."""
        visible = key_positions[None, None, :] <= positions[:, :, None]  # (B, C, L)
        if window is not None:
            visible &= key_positions[None, None, :] > positions[:, :, None] - window
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=self.device)
        return mask.masked_fill_(~visible, float("-inf"))[:, None, None]

    def _layer(
        self,
        index: int,
        layer: LayerWeights,
        packed: _PackedLayer | None,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv_access: KVAccess,
    ) -> torch.Tensor:
        """One decoder layer; updates ``hidden`` (B, C, h), which this forward owns, in place."""
        s = self.shape
        batch, length, width = hidden.shape
        rows = hidden.view(batch * length, width)  # (B C, h): the residual stream
        qkv = self._linear(self._rms_norm(rows, layer.input_norm), layer.qkv_weight, layer.qkv_bias,
                           None if packed is None else packed.qkv)
        qkv = qkv.view(batch, length, s.num_heads + 2 * s.num_kv_heads, s.head_dim)  # (B, C, H+2KV, D)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = self._rms_norm(qkv[:, :, : s.num_heads], layer.q_norm)
            k = self._rms_norm(qkv[:, :, s.num_heads : s.num_heads + s.num_kv_heads], layer.k_norm)
            qk = _rotate(torch.cat([q, k], dim=2), cos, sin)
        else:
            # Queries and keys are adjacent heads: one rotary pass serves both.
            qk = _rotate(qkv[:, :, : s.num_heads + s.num_kv_heads], cos, sin)
        q, k = qk[:, :, : s.num_heads], qk[:, :, s.num_heads :]
        v = qkv[:, :, s.num_heads + s.num_kv_heads :]
        keys, values = kv_access(index, k, v)  # (B, KV, D, L), (B, KV, L, D)
        attended = self._attend(q, keys, values, mask)  # (B, C, H D)
        self._add_output(rows, attended.view(batch * length, -1), layer.o_weight, layer.o_bias,
                         None if packed is None else packed.o, layer.attn_out_norm)
        normed = self._rms_norm(rows, layer.post_norm)
        if layer.router is not None:
            rows.add_(self._experts(normed, layer))
            return hidden
        assert layer.gate_up_weight is not None and layer.down_weight is not None
        gate_up = self._linear(normed, layer.gate_up_weight, layer.gate_up_bias, None if packed is None else packed.gate_up)
        gate, up = gate_up.split(s.intermediate_size, dim=-1)
        # act(gate) * up written over gate: gate_up is this layer's own buffer, and the down
        # projection reads the strided (B C, I) view without a copy.
        self._add_output(rows, self._activate_(gate).mul_(up), layer.down_weight, layer.down_bias,
                         None if packed is None else packed.down, layer.mlp_out_norm)
        return hidden

    def _activate_(self, gate: torch.Tensor) -> torch.Tensor:
        """The MLP gate's activation, in place."""
        if self.numerics.activation == "gelu_tanh":
            return gate.copy_(F.gelu(gate, approximate="tanh"))
        return F.silu(gate, inplace=True)

    def _experts(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """A mixture-of-experts layer on ``x`` (N, h) → (N, h), in HF's order of operations.

        The router's softmax in float32, the top k, renormalised over them where the family does
        (``normalize_top_k``) and cast to the model's dtype where it does (``router_weights_in_model_dtype``);
        then each chosen expert, in ascending order, runs its dense gated MLP on its tokens and adds
        their weighted outputs.
        """
        n = self.numerics
        assert layer.router is not None and layer.experts_gate_up is not None and layer.experts_down is not None
        logits = self._linear(x, layer.router, None, None)  # (N, E)
        weights, chosen = logits.float().softmax(dim=-1).topk(n.experts_per_token, dim=-1)  # (N, k) each
        if n.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if n.router_weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            tokens, slots = torch.where(chosen == expert)
            gate, up = self._linear(x[tokens], layer.experts_gate_up[expert], None, None).chunk(2, dim=-1)
            hidden = self._linear(self._activate_(gate) * up, layer.experts_down[expert], None, None)
            out.index_add_(0, tokens, (hidden * weights[tokens, slots, None]).to(out.dtype))
        return out

    def _add_output(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    packed: Packed, out_norm: torch.Tensor | None) -> None:
        """``residual += x W^T (+ b)``, normalised by ``out_norm`` first when there is one (Gemma)."""
        if out_norm is None:
            self._add_linear_(residual, x, weight, bias, packed)
        else:
            residual.add_(self._rms_norm(self._project(x, weight, bias, packed), out_norm))

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: Packed) -> torch.Tensor:
        """An output projection (o, down): ``x W^T (+ b)``; the tensor-parallel forward reduces its partial sums."""
        return self._linear(x, weight, bias, packed)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention without repeating keys: each KV head serves its G query heads.

        q (B, C, H, D), keys (B, KV, D, L), values (B, KV, L, D), mask (B, 1, 1, C, L) → (B, C, H D).
        """
        s = self.shape
        batch, length = q.shape[0], q.shape[1]
        grouped = q.reshape(batch, length, s.num_kv_heads, s.group_size, s.head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(batch, s.num_kv_heads, s.group_size * length, s.head_dim)
        scores = torch.matmul(grouped, keys)  # (B, KV, G C, L), a fresh tensor: scaled and masked in place
        scores = scores.view(batch, s.num_kv_heads, s.group_size, length, -1).float().mul_(self._scale)
        cap = self.numerics.attention_softcap
        if cap is not None:
            scores = scores.div_(cap).tanh_().mul_(cap)
        scores = scores.add_(mask)
        probs = scores.softmax(dim=-1).to(q.dtype).view(batch, s.num_kv_heads, s.group_size * length, -1)
        out = torch.matmul(probs, values)  # (B, KV, G C, D)
        out = out.view(batch, s.num_kv_heads, s.group_size, length, s.head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(batch, length, s.num_heads * s.head_dim)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        offset = self.numerics.norm_offset
        if offset:
            # Gemma's order: normalise and scale by (offset + weight) in float32, then cast.
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (offset + weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        # HF's order for half precision: normalise in float32, cast, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)


# Rows from which a panels matmul on several torch threads runs in oneDNN's threaded kernels instead (the kernel is
# single-threaded; both give the same bits, so this changes speed only): a prefill's, not a decode step's.
THREADED_MATMUL_ROWS = 64


def _kernel_runs(rows: int) -> bool:
    """Whether a panels matmul of ``rows`` rows runs in the kernel: always on one torch thread; on more, where
    splitting it over threads would not pay (a decode step's few rows)."""
    return rows < THREADED_MATMUL_ROWS or torch.get_num_threads() == 1


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1).

    ``sin_signed`` is sin with its first half negated, so rotate_half(x) sin = (x2, x1) sin_signed
    exactly: three passes (swap, multiply, multiply-add) instead of five.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)


def _check_supported(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    problem = config_problem(config.to_dict() if config is not None else {})
    if problem is not None:
        raise ValueError(f"{problem} ({type(model).__name__})")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:  # Gemma 3: one per layer type
        if kind in DYNAMIC_ROPE_TYPES:
            raise ValueError(f"the native rollout engine does not support rope_type {kind!r}")


def _fuse(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Concatenate along dim 0 and return the fused tensor with a view of it for each part."""
    fused = torch.cat([p.detach() for p in parts], dim=0)
    views, start = [], 0
    for part in parts:
        views.append(fused[start : start + part.shape[0]])
        start += part.shape[0]
    return fused, views


def _fuse_linears(linears: list[torch.nn.Module], what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fuse the weights (and biases) of ``linears`` and point each module at its view; one linear
    (a checkpoint that fuses them itself, Phi-3) is used as it is."""
    if len(linears) == 1:
        (linear,) = linears
        return linear.weight.data, None if linear.bias is None else linear.bias.data
    weight, views = _fuse([m.weight for m in linears])
    for module, view in zip(linears, views, strict=True):
        module.weight.data = view
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        raise ValueError(f"the native rollout engine needs all or none of the {what} projections to have a bias")
    bias, views = _fuse(biases)
    for module, view in zip(linears, views, strict=True):
        module.bias.data = view
    return weight, bias


def _fuse_layer(layer: torch.nn.Module, family: Family, numerics: Numerics) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _fuse_linears([getattr(attn, name) for name in family.qkv], "q/k/v")
    experts = getattr(mlp, "experts", None)  # a mixture-of-experts layer: the router is mlp.gate
    if experts is not None:
        gate_up_weight, gate_up_bias, down_weight, down_bias = None, None, None, None
    else:
        gate_up_weight, gate_up_bias = _fuse_linears([getattr(mlp, name) for name in family.gate_up], "gate/up")
        down_weight = mlp.down_proj.weight.data
        down_bias = None if mlp.down_proj.bias is None else mlp.down_proj.bias.data
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.data,
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm.weight.data,
        k_norm=None if k_norm is None else k_norm.weight.data,
        o_weight=attn.o_proj.weight.data,
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.data,
        # HF's post_attention_layernorm is the norm before the MLP, except in Gemma's sandwich.
        post_norm=(layer.pre_feedforward_layernorm if numerics.sandwich_norms else layer.post_attention_layernorm).weight.data,
        attn_out_norm=layer.post_attention_layernorm.weight.data if numerics.sandwich_norms else None,
        mlp_out_norm=layer.post_feedforward_layernorm.weight.data if numerics.sandwich_norms else None,
        router=None if experts is None else mlp.gate.weight.data,
        experts_gate_up=None if experts is None else experts.gate_up_proj.data,
        experts_down=None if experts is None else experts.down_proj.data,
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        down_weight=down_weight,
        down_bias=down_bias,
    )
