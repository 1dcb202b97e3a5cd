"""The memory planner: each role's peak device memory per phase, before anything loads.

``hybridflow plan`` and the "Memory" section of ``hybridflow config explain`` read the model's
config.json (``read_model_shape``: no weights) and predict, per rank, what every phase of a step
holds on its device at its peak: parameters, gradients, AdamW state, activations, logits, the
rollout's KV cache, and what the other roles sharing the device keep resident meanwhile. With
``trainer.device_memory_gb`` each phase is checked against the device, and for one that does not
fit the planner re-plans the config with the cheapest change that makes it fit and names it as
an override.

How each term is counted (bytes; N parameters, T tokens of a micro-batch, M of them predicting a
response token, V vocabulary, c = ``lm_head_chunk_rows(V)``):

- Parameters: N x 4 for a trained model (fp32 master weights, also under mixed precision); a
  frozen reference on one rank loads in ``model.dtype``; the rollout's copy in ``rollout.dtype``.
  FSDP2 shards parameters, gradients and AdamW state over ``actor.fsdp_config.fsdp_size`` ranks
  (all data-parallel ranks by default) and, while a layer computes, holds it gathered: two layers
  (the next one prefetched) and the root (embeddings, head) in the compute dtype, plus one layer's
  unsharded fp32 gradient before its reduce-scatter.
- Gradients: N x 4 (fp32). They stay allocated after the first optimizer step (the next step's
  ``zero_grad`` frees them), so every later phase carries them; within an update they are all
  live while the second and later micro-batches run, only the head's at the peak of a single one.
- AdamW: two fp32 moments, N x 8, allocated by the first step; the step itself adds temporaries
  (``torch.optim.AdamW``'s foreach path on a GPU: one fp32 copy of the parameters; the per-tensor
  loop on a CPU: two copies of the largest tensor). ``optimizer_offload`` keeps them off the
  device except during the step; ``param_offload`` (FSDP2: several ranks, or one GPU rank sharded
  over itself) keeps all three off it. ``fsdp_config.model_dtype=bfloat16`` (pure bf16) halves all
  three: 2-byte weights and gradients, two 2-byte moments.
- Activations of a training micro-batch: ``training_bytes_per_token`` (``budget.py``) x T,
  the per-layer count of what a decoder layer saves for backward (checked against the saved
  tensors of the built-in model: within 1%), or the layer inputs plus one layer's set with
  gradient checkpointing; plus a layer's backward working set. Mixed precision on one rank runs
  under autocast: the residual stream and norms stay float32 and the matmuls save bf16 copies of
  the weights. A forward without backward keeps one layer's working set (``FORWARD_*_VALUES``).
- Logits: the engine computes logprobs from the hidden states ``c`` rows at a time
  (``hybridflow/training/lm_head.py``), so at most min(M, c) x V float32 logits are alive, times
  the temporaries of the chunk (``HEAD_FORWARD_TEMPORARIES`` forward, ``HEAD_BACKWARD_TEMPORARIES``
  in backward, which also allocates the head's fp32 weight gradient). Sharded ranks use the
  model's own head: M x V float32 logits, their gradient and a softmax temporary. In a training
  micro-batch the head's backward runs while every layer's saved activations are alive (they add
  up) but before any layer's backward (the larger of the two working sets counts: ``overlap``); in
  a forward without backward the layers' working set is gone when the head runs.
- Shape buckets (CPU, reduced precision): packed micro-batches run at ``bucketed_length`` tokens
  and the head at bucketed rows (``utils.shapes``: up to 1/8 more of both).
- KV cache (native engine): the engine takes ``rollout.kv_cache_memory_bytes``, or unset
  ``KV_CACHE_MEMORY_FRACTION`` of the memory free when it starts (after the actor's parameters and
  its own weights, before any optimizer state), as its budget, and allocates slot rows of
  ``align(prompt + response)`` positions, ``KV_PROMPT_ROWS`` prompt rows plus as many decode rows
  as ``rollout.max_batch_size`` asks and the budget holds; the prefix cache keeps whole blocks of a
  step's finished sequences in what the budget leaves. A budget that holds no sequence beside the
  prompt rows blocks generation (the engine would refuse every request). On AMD CPUs the engine
  keeps a second, oneDNN-packed copy of its fp32 matmul weights.
- The process (CPU): one process whose resident memory is the largest phase's peak plus
  ``PROCESS_RUNTIME_BYTES`` of interpreter and libraries (``MemoryPlan.process_peak_bytes``,
  checked against the default run by ``tests/unit/config/test_config_plan.py``; both workloads of
  ``bench/memory_timeline.py``). Left out: glibc's free heap blocks kept between the update's live
  ones (0.45-0.7 GB at the ~18M long-tail peak; ``utils.memory.configure_host_allocator``).

Micro-batches are planned at their worst case: every sample at ``data.max_prompt_length +
data.max_response_length`` tokens, a micro-batch filled to its token budget.
``bench/memory_planner.py`` checks the actor's update and logprob forward against peaks measured
in the real engine on a CPU (fp32 and bf16 autocast, packed and padded), and the KV cache against
the native engine's own accounting. Modelled but not measured: the GPU-only paths (foreach AdamW,
FSDP2's gathered layers, the sharded ranks' full logits) and the rollout's activations. Left out:
the CUDA context and allocator fragmentation (leave ~10% of a GPU for them), the reward model, and
LoRA (``actor.lora``: planned as full fine-tuning, an over-estimate). Ulysses sequence parallelism (``*.ulysses_sequence_parallel_size``): a group of sp ranks
pools its ranks' samples into micro-batches of sp x the per-rank token budget, each rank holding
1/sp of their tokens and response rows (``_micro_batch_tokens``); the planner proposes it for a
trainer phase that does not fit (not measured against the engine: its bench measures the split
itself, ``bench/sequence_parallel_memory.py``).

Pure functions of the config, no torch (``config/`` is layer 1).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from hybridflow.config.budget import (
    BYTES,
    ModelShape,
    auto_token_budget,
    available_host_memory_bytes,
    cpu_vendor,
    packing_decision,
    training_bytes_per_token,
)
from hybridflow.config.engines import capabilities
from hybridflow.config.schema import Config, FSDPConfig
from hybridflow.config.layout import batch_plan, data_parallel_size, rollout_replicas
from hybridflow.utils.shapes import bucketed_length

GIB = 2**30

# hybridflow.training.lm_head's chunk size (config cannot import training; a test keeps them equal):
# CHUNK_LOGIT_BYTES of float32 logits per chunk, rows clamped to [MIN, MAX].
LM_HEAD_CHUNK_LOGIT_BYTES = 128 << 20
LM_HEAD_MIN_CHUNK_ROWS, LM_HEAD_MAX_CHUNK_ROWS = 64, 8192


def lm_head_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of the chunked LM head (``lm_head.default_chunk_rows``)."""
    return max(LM_HEAD_MIN_CHUNK_ROWS, min(LM_HEAD_MAX_CHUNK_ROWS, LM_HEAD_CHUNK_LOGIT_BYTES // (4 * max(1, vocab_size))))
# Chunk-sized float32 arrays alive at once in the chunked head (each chunk's freed before the next's;
# overwritten in place at last use): forward z and lse's shifted copy (or p); backward p and dz, or z, p,
# dz and a product with an entropy gradient (actor.entropy_coeff != 0).
HEAD_FORWARD_TEMPORARIES, HEAD_BACKWARD_TEMPORARIES, HEAD_BACKWARD_ENTROPY_TEMPORARIES = 2, 2, 4
# A layer's working set per token in a forward without backward, in compute-dtype values: the
# residual, the normed input, q and the attention output (4h), the MLP's gate, up and their product (3i).
FORWARD_HIDDEN_VALUES, FORWARD_MLP_VALUES = 4, 3
# The per-layer backward of a training micro-batch, on top of what the layer saved: the gradients of
# the MLP's intermediates and of the hidden state, in compute-dtype values per token.
BACKWARD_HIDDEN_VALUES, BACKWARD_MLP_VALUES = 2, 3
# hybridflow.inference.native.KV_CACHE_MEMORY_FRACTION, DEFAULT_MAX_PREFILL_PROMPTS,
# DEFAULT_MAX_PREFILL_TOKENS and hybridflow.inference.kv_cache.CAPACITY_ALIGN (a test keeps them equal).
KV_CACHE_MEMORY_FRACTION = {"cuda": 0.4, "cpu": 0.25}
KV_PROMPT_ROWS = 64
PREFILL_TOKENS = 2048
KV_CAPACITY_ALIGN = 64
# hybridflow.inference.prefix_cache.DEFAULT_BLOCK_SIZE: the prefix cache keeps whole blocks of positions.
PREFIX_BLOCK_TOKENS = 16
# hybridflow.inference.compact.ONEDNN_FASTER_VENDORS: on these CPUs the native engine keeps a second,
# oneDNN-packed copy of its fp32 matmul weights, and of its bf16 ones where the CPU has avx512_bf16.
ONEDNN_PACKED_VENDORS = ("AuthenticAMD",)
# Decode: float32 logits of every row, their softmax and the sampling temporary.
DECODE_LOGITS_TEMPORARIES = 3
# What a CPU trainer process keeps resident besides the planned tensors: the interpreter and the
# libraries a run imports (torch, transformers, pandas and pyarrow for the data, hybridflow), their
# first-use caches. Measured on the default run (torch 2.13, Xeon AVX-512, bench/memory_timeline.py):
# 0.60 GB beside the planned tensors at the step's peak (0.835 GB, the largest phase 0.232 GB).
PROCESS_RUNTIME_BYTES = 600 * 10**6


@dataclass(frozen=True)
class PhaseMemory:
    """One role's phase on one rank: the bytes of each term at its peak."""

    role: str
    phase: str
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    kv_cache: int = 0
    others: int = 0  # what the other roles on this device keep resident meanwhile
    notes: tuple[str, ...] = ()
    # Bytes of ``activations`` and ``logits`` never alive together: the head and a layer's working
    # set take turns (in a forward the layers are done when the head runs; in backward the head's
    # backward is done before the last layer's starts), so the peak counts only the larger.
    overlap: int = 0
    blocked: str = ""  # why the phase cannot run whatever its peak (the KV cache holds no sequence)

    @property
    def peak(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.logits - self.overlap
                + self.kv_cache + self.others)


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int | None
    phases: tuple[PhaseMemory, ...]
    notes: tuple[str, ...] = ()
    fixes: dict[tuple[str, str], str] = field(default_factory=dict)  # (role, phase) -> the cheapest fix

    runtime: int = 0  # CPU, one process: its interpreter and libraries (``PROCESS_RUNTIME_BYTES``)

    def process_peak_bytes(self) -> int:
        """The largest phase's peak, plus ``runtime``: on a CPU run with the local backend, the
        one process's peak resident memory (``perf/rss_peak_gb/step``; ``bench/memory_timeline.py``
        compares them). Fits are checked on the phases alone: ``trainer.device_memory_gb`` is what
        the tensors may take."""
        return max(p.peak for p in self.phases) + self.runtime

    def too_big(self) -> list[PhaseMemory]:
        if self.device_bytes is None:
            return []
        return [p for p in self.phases if p.peak > self.device_bytes or p.blocked]


# --------------------------------------------------------------------------- the terms


def _layer_weights(shape: ModelShape) -> int:
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return (shape.num_parameters - embeddings) // shape.num_hidden_layers


def train_activation_bytes(
    shape: ModelShape, tokens: int, *, compute_bytes: int, gradient_checkpointing: bool, autocast: bool = False
) -> int:
    """What a training forward of ``tokens`` keeps until its backward, plus the backward's own
    working set of one layer; under ``autocast`` also the bf16 copies of the layers' weights that
    the matmuls save (once per forward, whatever the tokens)."""
    saved = training_bytes_per_token(shape, compute_bytes=compute_bytes, gradient_checkpointing=gradient_checkpointing,
                                     autocast=autocast)
    weight_copies = shape.num_hidden_layers * _layer_weights(shape) * compute_bytes if autocast and compute_bytes < 4 else 0
    return tokens * saved + layer_backward_bytes(shape, tokens, compute_bytes=compute_bytes) + weight_copies


def layer_backward_bytes(
    shape: ModelShape, tokens: int, *, compute_bytes: int, gradient_checkpointing: bool = False, autocast: bool = False
) -> int:
    """The part of ``train_activation_bytes`` alive only while a layer's backward runs: its
    gradients of the intermediates, and with checkpointing the layer's recomputed set."""
    values = BACKWARD_HIDDEN_VALUES * shape.hidden_size + BACKWARD_MLP_VALUES * shape.intermediate_size
    work = tokens * values * compute_bytes
    if gradient_checkpointing:
        whole = training_bytes_per_token(shape, compute_bytes=compute_bytes, autocast=autocast)
        work += tokens * whole // shape.num_hidden_layers
    return work


def forward_activation_bytes(shape: ModelShape, tokens: int, *, compute_bytes: int, autocast: bool = False) -> int:
    """One layer's working set in a forward without backward (no_grad: nothing is saved). Under
    ``autocast`` the hidden-sized values stay float32 and the layer's weights are cast for it."""
    if autocast and compute_bytes < 4:
        per_token = (FORWARD_HIDDEN_VALUES * shape.hidden_size * 4
                     + FORWARD_MLP_VALUES * shape.intermediate_size * compute_bytes)
        return tokens * per_token + _layer_weights(shape) * compute_bytes
    values = FORWARD_HIDDEN_VALUES * shape.hidden_size + FORWARD_MLP_VALUES * shape.intermediate_size
    return tokens * values * compute_bytes


def logits_bytes(
    shape: ModelShape, rows: int, *, fused: bool, backward: bool, chunk_rows: int | None = None,
    compute_bytes: int = 4, entropy_grad: bool = False,
) -> int:
    """Logits alive at the head's peak for ``rows`` response-predicting positions (a forward
    without backward also holds the last hidden states: ``forward_head_bytes``).

    ``fused`` (one rank, a plain linear head): the chunked head, at most ``chunk_rows`` rows of
    float32 logits times its temporaries, and in backward the head's fp32 weight gradient.
    Otherwise the model's own head: every row's float32 logits, and with backward their
    gradient and a softmax temporary. ``entropy_grad``: the loss differentiates the entropy (an
    entropy bonus), which keeps z beside p in the chunked head's backward."""
    vocab = shape.vocab_size
    chunk_rows = lm_head_chunk_rows(vocab) if chunk_rows is None else chunk_rows
    if fused:
        chunk = min(rows, chunk_rows) * vocab * 4
        if backward:
            temporaries = HEAD_BACKWARD_ENTROPY_TEMPORARIES if entropy_grad else HEAD_BACKWARD_TEMPORARIES
            # The fp32 weight gradient; in a lower compute dtype also the head's weight and dz cast to it.
            cast = (vocab * shape.hidden_size + min(rows, chunk_rows) * vocab) * compute_bytes if compute_bytes < 4 else 0
            return temporaries * chunk + vocab * shape.hidden_size * 4 + cast
        return HEAD_FORWARD_TEMPORARIES * chunk
    return rows * vocab * 4 * (3 if backward else 2)


def forward_head_bytes(
    shape: ModelShape, tokens: int, rows: int, *, fused: bool, compute_bytes: int, autocast: bool = False
) -> int:
    """The head's peak in a forward without backward: the last hidden states of the micro-batch
    (and the rows gathered for the head; float32 under ``autocast``) beside the logits, and in a
    lower compute dtype the chunk's logits before their cast to float32."""
    hidden = (tokens + rows) * shape.hidden_size * (4 if autocast else compute_bytes)
    cast = min(rows, lm_head_chunk_rows(shape.vocab_size)) * shape.vocab_size * compute_bytes if fused and compute_bytes < 4 else 0
    return hidden + cast + logits_bytes(shape, rows, fused=fused, backward=False)


def adamw_step_temporary_bytes(shape: ModelShape, params_per_rank: int, device_type: str) -> int:
    """AdamW's temporaries in ``step``: foreach on a GPU (one fp32 copy of the parameters),
    the per-tensor loop on a CPU (two copies of the largest tensor)."""
    if device_type == "cuda":
        return params_per_rank * 4
    largest = max(shape.vocab_size * shape.hidden_size, shape.hidden_size * shape.intermediate_size)
    return 2 * largest * 4


def kv_bytes_per_position(shape: ModelShape, dtype_bytes: int, tp: int = 1) -> int:
    """Keys and values of one token in every layer (split over ``tp`` ranks)."""
    return 2 * shape.num_hidden_layers * shape.kv_size * dtype_bytes // tp


def prefix_cache_tokens(prompt: int, response: int, n: int, prompts: int) -> int:
    """Positions the prefix cache keeps after a round of ``prompts`` x ``n`` samples: whole
    blocks of each finished sequence's keys (its last token has none), the prompt's blocks
    shared by its samples."""
    block = PREFIX_BLOCK_TOKENS
    shared = prompt // block
    per_sample = max(0, (prompt + response - 1) // block - shared)
    return prompts * (shared + n * per_sample) * block


def _cpu_has_avx512_bf16() -> bool:
    from hybridflow.utils.device import cpu_features  # torch: not before a config error (fast errors)

    return cpu_features().avx512_bf16


def kv_cache_bytes(
    shape: ModelShape, *, budget: int, dtype_bytes: int, longest: int, max_batch_size: int, tp: int = 1,
    prefix_tokens: int = 0,
) -> tuple[int, int]:
    """(bytes the native engine's KV cache takes, decode rows it gets) under ``budget``.

    Slot rows of ``align(longest)`` positions: ``KV_PROMPT_ROWS`` prompt rows and up to
    ``max_batch_size`` decode rows; the prefix cache holds up to ``prefix_tokens`` more
    positions in what the budget leaves. 0 decode rows: nothing fits."""
    per_position = kv_bytes_per_position(shape, dtype_bytes, tp)
    capacity = -(-longest // KV_CAPACITY_ALIGN) * KV_CAPACITY_ALIGN
    row = capacity * per_position
    rows = min(max_batch_size, budget // row - KV_PROMPT_ROWS)
    if rows < 1:
        return 0, 0
    slots = (rows + KV_PROMPT_ROWS) * row
    return slots + min(max(0, budget - slots), prefix_tokens * per_position), rows


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _Layout:
    """How the ranks and roles sit on devices, from the config."""

    device_type: str  # cuda | cpu
    dp: int  # actor (and reference, critic) ranks
    shard: int  # ranks one FSDP2 group shards over (1: one rank)
    fsdp2: bool  # the actor's model is FSDP2-sharded: several ranks, or param_offload on one GPU
    colocated: bool  # the rollout shares the trainers' devices
    tp: int


def _layout(cfg: Config) -> _Layout:
    t = cfg.trainer
    dp = 1 if t.backend == "local" else data_parallel_size(t)
    fsdp = cfg.actor.fsdp_config.fsdp_size
    shard = dp if fsdp in (-1, 0) or fsdp > dp else fsdp
    device_type = "cuda" if t.device == "cuda" else "cpu"
    shard = shard if dp > 1 else 1
    return _Layout(
        device_type=device_type, dp=dp, shard=shard,
        fsdp2=shard > 1 or _offloads_params(cfg.actor.fsdp_config.param_offload, device_type),
        colocated=t.backend == "local" or cfg.rollout.placement == "colocated",
        tp=cfg.rollout.tensor_model_parallel_size if t.backend != "local" else 1,
    )


def _offloads_params(param_offload: bool, device_type: str) -> bool:
    """FSDP2 offloads a role's parameters with param_offload on a GPU, sharded over several ranks or
    over one (a CPU run refuses the key: they are in host memory already)."""
    return param_offload and device_type == "cuda"


def _value_shape(shape: ModelShape) -> ModelShape:
    """The critic: the backbone with a scalar head (hidden -> 1) instead of the LM head."""
    return ModelShape(**{**shape.__dict__, "vocab_size": 1, "tie_word_embeddings": False})


def _gathered_bytes(shape: ModelShape, layout: _Layout, compute_bytes: int) -> int:
    """FSDP2's gathered working set: two layers and the root in the compute dtype, one layer's
    unsharded fp32 gradient."""
    if not layout.fsdp2:
        return 0
    layer = (shape.num_parameters - shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)) \
        // shape.num_hidden_layers
    root = shape.num_parameters - layer * shape.num_hidden_layers
    return (2 * layer + root) * compute_bytes + layer * 4


def _micro_batch_tokens(cfg: Config, budget: int | None, micro_batch_samples: int, samples_per_rank: int,
                        sp: int = 1) -> int:
    """Tokens of the largest micro-batch on one rank: the budget (or a fixed count of samples),
    never more than the rank's samples hold; every sample at its longest. With Ulysses groups of
    ``sp`` ranks a group pools its ranks' samples into micro-batches of ``sp`` x the (per-rank)
    budget, each rank holding 1/sp of their tokens, so a sample longer than the budget fits."""
    longest = max(1, cfg.data.max_prompt_length + cfg.data.max_response_length)
    most = max(1, samples_per_rank * sp) * longest
    if budget is not None:
        group = min(most, max(budget * sp, longest))
    else:
        group = min(most, max(1, micro_batch_samples) * longest)
    return -(-group // sp)


def _response_rows(cfg: Config, tokens: int, packed: bool, sp: int = 1) -> int:
    """Positions that predict a response token in a micro-batch of ``tokens`` per rank: packed,
    the response share of every sample; padded, ``logits_to_keep`` keeps R + 1 per row. With
    ``sp`` ranks a sequence-parallel group's micro-batch is ``sp`` x larger and each rank holds
    1/sp of its rows."""
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    samples = max(1, tokens * sp // max(1, p + r))
    rows = samples * r if packed else samples * (r + 1)
    return -(-rows // sp)


@dataclass(frozen=True)
class _Budgets:
    ppo: int | None
    log_prob: int | None
    ref: int | None
    critic: int | None
    critic_forward: int | None
    reason: str


def _token_budgets(
    cfg: Config, shape: ModelShape, layout: _Layout, device_bytes: int | None, actor_params: int
) -> _Budgets:
    """The token budgets the roles will use: configured, or derived at start-up as the actor does
    (``auto_token_budget`` of the memory free after the actor's parameters)."""
    a, c = cfg.actor, cfg.critic
    if not a.use_dynamic_bsz:
        return _Budgets(None, None, None, None, None, "actor.use_dynamic_bsz=false: fixed micro-batch sizes")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if device_bytes is not None:
        free, label = max(0, device_bytes - actor_params), "trainer.device_memory_gb less the actor's parameters"
    elif layout.device_type == "cpu":
        free, label = available_host_memory_bytes(), "available host memory now"
    else:
        free, label = 1 << 62, "free GPU memory (unknown: the cap)"
    auto = auto_token_budget(
        shape, free, longest, compute_bytes=_compute_bytes(cfg, layout.device_type),
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing, full_logits=layout.fsdp2,
        memory_label=label, device_type=layout.device_type,
    )
    ppo = a.ppo_max_token_len_per_gpu or auto.ppo
    log_prob = a.log_prob_max_token_len_per_gpu or (2 * ppo if a.ppo_max_token_len_per_gpu else auto.log_prob)
    ref = cfg.ref.log_prob_max_token_len_per_gpu or log_prob
    critic = c.ppo_max_token_len_per_gpu or ppo
    critic_forward = c.forward_max_token_len_per_gpu or 2 * critic
    configured = a.ppo_max_token_len_per_gpu is not None
    reason = "configured" if configured else auto.reason
    return _Budgets(ppo, log_prob, ref, critic, critic_forward, reason)


def _trainer_resident(n: int, layout: _Layout, fsdp: FSDPConfig) -> tuple[int, int, int]:
    """(params, grads, optimizer) a trained model keeps on its device between its phases."""
    on_device = not _offloads_params(fsdp.param_offload, layout.device_type)
    per_rank = n // layout.shard
    # Weights, gradients and Adam's two moments in the stored dtype: fp32 master weights, or pure bf16.
    stored = BYTES[fsdp.model_dtype]
    params = per_rank * stored if on_device else 0
    grads = per_rank * stored if on_device else 0
    optimizer = per_rank * 2 * stored if on_device and not fsdp.optimizer_offload else 0
    return params, grads, optimizer


def plan_memory(
    cfg: Config, shape: ModelShape, *, with_critic: bool = False, device_bytes: int | None = None,
    find_fixes: bool = True,
) -> MemoryPlan:
    """Each role's predicted peak per phase on one rank; with ``device_bytes`` (default
    ``trainer.device_memory_gb``) the cheapest fix of each phase that does not fit."""
    if device_bytes is None and cfg.trainer.device_memory_gb is not None:
        device_bytes = int(cfg.trainer.device_memory_gb * GIB)
    layout = _layout(cfg)
    a, r, data = cfg.actor, cfg.rollout, cfg.data
    compute_bytes = _compute_bytes(cfg, layout.device_type)
    n = shape.num_parameters
    notes: list[str] = []
    if cfg.trainer.device == "auto":
        notes.append("trainer.device=auto is planned as a CPU run; set trainer.device=cuda to plan a GPU run")
    packed, _ = packing_decision(a.use_remove_padding, shape.model_type, shape.custom_code)
    fused = not layout.fsdp2  # sharded ranks keep the model's own head (FSDP2 gathers its weight in the root)
    with_reference = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    gathered = _gathered_bytes(shape, layout, compute_bytes)

    # Resident between phases.
    actor_p, actor_g, actor_o = _trainer_resident(n, layout, a.fsdp_config)
    ref_bytes = compute_bytes if layout.shard <= 1 else 4
    # The reference is offloaded with the actor's param_offload (its shards on the CPU between forwards).
    ref_offloaded = _offloads_params(a.fsdp_config.param_offload, layout.device_type)
    ref_p = (n // layout.shard) * ref_bytes if with_reference and not ref_offloaded else 0
    vshape = _value_shape(shape)
    critic_p, critic_g, critic_o = (
        _trainer_resident(vshape.num_parameters, layout, cfg.critic.fsdp_config) if with_critic else (0, 0, 0)
    )
    rollout_dtype = 4 if r.dtype == "float32" or (r.dtype == "auto" and layout.device_type == "cpu") else 2
    embed_head = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    rollout_w = ((n - embed_head) // layout.tp + embed_head) * rollout_dtype if r.name != "sglang" else 0
    packs_dtype = rollout_dtype == 4 or (r.dtype == "bfloat16" and _cpu_has_avx512_bf16())
    if layout.device_type == "cpu" and packs_dtype and r.name == "native" and cpu_vendor() in ONEDNN_PACKED_VENDORS:
        # The layers' matmul weights (q/k/v, o, gate/up, down) and the head: not the norms or biases.
        h, inner = shape.hidden_size, shape.intermediate_size
        per_layer = h * (shape.q_size + 2 * shape.kv_size) + shape.q_size * h + 3 * inner * h
        rollout_w += (shape.num_hidden_layers * per_layer + shape.vocab_size * h) * rollout_dtype
        notes.append("rollout weights: x2 for the oneDNN-packed copy the native engine keeps on this CPU")

    # KV cache: the engine sizes its budget when it starts, after the actor's parameters and its weights.
    longest = data.max_prompt_length + data.max_response_length
    source = f"{KV_CACHE_MEMORY_FRACTION[layout.device_type]:g} of the memory free when it starts"
    if r.kv_cache_memory_bytes is not None:
        budget, source = r.kv_cache_memory_bytes, "rollout.kv_cache_memory_bytes"
    elif device_bytes is not None:
        free_at_start = max(0, device_bytes - (actor_p if layout.colocated else 0) - rollout_w)
        budget = int(free_at_start * KV_CACHE_MEMORY_FRACTION[layout.device_type])
    elif layout.device_type == "cpu":
        budget = int(available_host_memory_bytes() * KV_CACHE_MEMORY_FRACTION["cpu"])
    else:
        budget = 0
    replicas = rollout_replicas(cfg) if cfg.trainer.backend != "local" else 1
    step_tokens = prefix_cache_tokens(data.max_prompt_length, data.max_response_length, r.n,
                                      -(-data.train_batch_size // replicas)) if r.enable_prefix_caching else 0
    blocked = ""
    if budget:
        kv, rows = kv_cache_bytes(shape, budget=budget, dtype_bytes=rollout_dtype, longest=longest,
                                  max_batch_size=r.max_batch_size, tp=layout.tp, prefix_tokens=step_tokens)
        if rows == 0:
            capacity = -(-longest // KV_CAPACITY_ALIGN) * KV_CAPACITY_ALIGN
            row = capacity * kv_bytes_per_position(shape, rollout_dtype, layout.tp)
            blocked = (f"its KV cache budget ({budget / GIB:.2f} GiB: {source}) holds no sequence of {longest} tokens beside the "
                       f"{KV_PROMPT_ROWS} prompt rows the native engine reserves ({(KV_PROMPT_ROWS + 1) * row / GIB:.2f} "
                       f"GiB with one decode row): it would refuse every request")
        elif rows < r.max_batch_size:
            notes.append(f"the KV cache holds {rows} of rollout.max_batch_size={r.max_batch_size} sequences at "
                         f"{longest} tokens: generation runs at most {rows} at once")
    else:
        kv, rows = 0, 0
        notes.append("KV cache: sized from the free GPU memory at start-up; set trainer.device_memory_gb to plan it")
    if not capabilities(r.name).planned_kv_cache:
        notes.append(f"rollout.name={r.name}: its engine sizes its own KV cache; planned as the native engine's")

    # Rollout residency during the training phases (colocated only).
    asleep = r.free_cache_engine
    rollout_during_training = (0 if asleep and r.sleep_level >= 2 else rollout_w) + (0 if asleep else kv)
    if not layout.colocated:
        rollout_during_training = 0
    trainers_resident = actor_p + actor_g + actor_o + ref_p + critic_p + critic_g + critic_o

    budgets = _token_budgets(cfg, shape, layout, device_bytes, actor_p)
    plan = batch_plan(cfg)
    per_rank = plan.samples_per_rank_per_mini_batch
    phases: list[PhaseMemory] = []

    # Rollout: generation. A scheduler step runs its prefill and its decode forward one after the other.
    decode = r.max_batch_size * shape.vocab_size * 4 * DECODE_LOGITS_TEMPORARIES
    prompt_tokens = -(-data.train_batch_size // replicas) * data.max_prompt_length
    prefill = forward_activation_bytes(shape, min(PREFILL_TOKENS, prompt_tokens), compute_bytes=rollout_dtype)
    phases.append(PhaseMemory(
        "rollout", "generation", params=rollout_w, activations=prefill, logits=decode, kv_cache=kv,
        overlap=min(prefill, decode), others=trainers_resident if layout.colocated else 0, blocked=blocked,
    ))

    # Actor: old-logprob forward, update.
    optimizer_offload = a.fsdp_config.optimizer_offload
    # One rank computes in bf16 under autocast over fp32 weights; FSDP2 casts the gathered weights instead,
    # and pure bf16 weights need no cast.
    autocast = compute_bytes < 4 and not layout.fsdp2 and a.fsdp_config.model_dtype == "float32"

    # A CPU in reduced precision runs a packed micro-batch at its shape bucket, the head at bucketed rows
    # (``training.forward.ModelForward``'s bucket_shapes): up to 1/8 more of both than the pack holds.
    shaped = bucketed_length if layout.device_type == "cpu" and compute_bytes < 4 and packed else (lambda n: n)

    def forward_phase(role: str, name: str, model: ModelShape, tokens: int, head: bool, mixed: bool = autocast,
                      sp: int = 1, **terms: int) -> PhaseMemory:
        activations = forward_activation_bytes(model, shaped(tokens), compute_bytes=compute_bytes, autocast=mixed)
        logits = forward_head_bytes(model, shaped(tokens), shaped(_response_rows(cfg, tokens, packed, sp)), fused=fused,
                                    compute_bytes=compute_bytes, autocast=mixed) if head else 0
        return PhaseMemory(role, name, activations=activations, logits=logits, overlap=min(activations, logits),
                           notes=(f"{tokens} tokens per micro-batch",), **terms)

    sp = a.ulysses_sequence_parallel_size
    lp_tokens = _micro_batch_tokens(cfg, budgets.log_prob, a.log_prob_micro_batch_size_per_gpu,
                                    per_rank * plan.mini_batches_per_epoch, sp)
    others_for_actor = ref_p + critic_p + critic_g + critic_o + rollout_during_training
    phases.append(forward_phase("actor", "logprob forward", shape, lp_tokens, True, sp=sp, params=actor_p + gathered,
                                grads=actor_g, optimizer=actor_o, others=others_for_actor))
    tokens = _micro_batch_tokens(cfg, budgets.ppo, a.ppo_micro_batch_size_per_gpu, per_rank, sp)
    micro_batches = max(1, math.ceil(per_rank * longest / tokens))
    checkpointing = cfg.model.enable_gradient_checkpointing
    activations = train_activation_bytes(shape, shaped(tokens), compute_bytes=compute_bytes,
                                         gradient_checkpointing=checkpointing, autocast=autocast)
    logits = logits_bytes(shape, shaped(_response_rows(cfg, tokens, packed, sp)), fused=fused, backward=True,
                          compute_bytes=compute_bytes, entropy_grad=a.entropy_coeff != 0)
    overlap = min(logits, layer_backward_bytes(shape, shaped(tokens), compute_bytes=compute_bytes,
                                               gradient_checkpointing=checkpointing, autocast=autocast))
    # With one micro-batch the peak comes before most gradients exist (the head's is in logits).
    grads_live = actor_g if micro_batches > 1 else 0
    optimizer_fwd = 0 if optimizer_offload else actor_o
    shard = n // layout.shard
    moments = shard * 2 * BYTES[a.fsdp_config.model_dtype]  # on the device for the step, even offloaded between
    step_peak = actor_p + actor_g + moments + adamw_step_temporary_bytes(shape, shard, layout.device_type)
    if _offloads_params(a.fsdp_config.param_offload, layout.device_type):
        step_peak = 0  # FSDP2's CPU offload runs the optimizer step on the CPU
    fwd_bwd = actor_p + gathered + grads_live + optimizer_fwd + activations + logits - overlap
    if step_peak > fwd_bwd:
        phase = PhaseMemory("actor", "update", params=actor_p, grads=actor_g,
                            optimizer=step_peak - actor_p - actor_g, others=others_for_actor,
                            notes=("peak in the optimizer step",))
    else:
        phase = PhaseMemory("actor", "update", params=actor_p + gathered, grads=grads_live, optimizer=optimizer_fwd,
                            activations=activations, logits=logits, overlap=overlap, others=others_for_actor,
                            notes=(f"{tokens} tokens per micro-batch, {micro_batches} micro-batch(es) per rank",))
    phases.append(phase)

    if with_reference:
        ref_sp = cfg.ref.ulysses_sequence_parallel_size or sp
        ref_tokens = _micro_batch_tokens(cfg, budgets.ref, cfg.ref.log_prob_micro_batch_size_per_gpu,
                                         per_rank * plan.mini_batches_per_epoch, ref_sp)
        # A frozen reference on one rank loads in the compute dtype: no autocast.
        phases.append(forward_phase(
            "reference", "logprob forward", shape, ref_tokens, True, mixed=False, sp=ref_sp, params=ref_p + gathered,
            others=actor_p + actor_g + actor_o + critic_p + critic_g + critic_o + rollout_during_training,
        ))
    if with_critic:
        c = cfg.critic
        others = actor_p + actor_g + actor_o + ref_p + rollout_during_training
        csp = c.ulysses_sequence_parallel_size
        ftokens = _micro_batch_tokens(cfg, budgets.critic_forward, c.forward_micro_batch_size_per_gpu,
                                      per_rank * plan.mini_batches_per_epoch, csp)
        phases.append(forward_phase("critic", "values forward", vshape, ftokens, False, params=critic_p + gathered,
                                    grads=critic_g, optimizer=critic_o, others=others))
        ctokens = _micro_batch_tokens(cfg, budgets.critic, c.ppo_micro_batch_size_per_gpu, per_rank, csp)
        c_micro = max(1, math.ceil(per_rank * longest / ctokens))
        c_opt = 0 if c.fsdp_config.optimizer_offload else critic_o
        nv = vshape.num_parameters // layout.shard
        c_step = critic_p + critic_g + nv * 8 + adamw_step_temporary_bytes(vshape, nv, layout.device_type)
        if _offloads_params(c.fsdp_config.param_offload, layout.device_type):
            c_step = 0
        c_fwd = critic_p + gathered + (critic_g if c_micro > 1 else 0) + c_opt + train_activation_bytes(
            vshape, shaped(ctokens), compute_bytes=compute_bytes, gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
            autocast=autocast)
        if c_step > c_fwd:
            phases.append(PhaseMemory("critic", "update", params=critic_p, grads=critic_g,
                                      optimizer=c_step - critic_p - critic_g, others=others))
        else:
            phases.append(PhaseMemory(
                "critic", "update", params=critic_p + gathered, grads=critic_g if c_micro > 1 else 0, optimizer=c_opt,
                activations=c_fwd - critic_p - gathered - (critic_g if c_micro > 1 else 0) - c_opt, others=others,
            ))

    if layout.device_type == "cpu":
        notes.append(f"CPU: the process's peak resident memory is the largest phase plus ~{_size(PROCESS_RUNTIME_BYTES)} "
                     f"of interpreter and libraries: {_size(max(p.peak for p in phases) + PROCESS_RUNTIME_BYTES)}")
    notes.insert(0, f"token budgets: {budgets.ppo} per training micro-batch, {budgets.log_prob} per logprob "
                    f"micro-batch ({budgets.reason})" if budgets.ppo is not None else budgets.reason)
    runtime = PROCESS_RUNTIME_BYTES if layout.device_type == "cpu" else 0
    result = MemoryPlan(device_bytes, tuple(phases), tuple(notes), runtime=runtime)
    if find_fixes and device_bytes is not None:
        fixes = {}
        for p in result.too_big():
            fix = cheapest_fix(cfg, shape, p.role, p.phase, with_critic=with_critic, device_bytes=device_bytes)
            fixes[(p.role, p.phase)] = fix
        result = MemoryPlan(device_bytes, result.phases, result.notes, fixes, runtime=runtime)
    return result


# --------------------------------------------------------------------------- fixes


def _with(cfg: Config, overrides: dict[str, object]) -> Config:
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        *path, name = key.split(".")
        target = out
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return out


def _budget_candidates(cfg: Config, role: str, phase: str) -> list[dict[str, object]]:
    """Smaller token budgets (or micro-batch sizes) for the phase, largest first."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    keys = {
        ("actor", "update"): ("actor.ppo_max_token_len_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
        ("actor", "logprob forward"): ("actor.log_prob_max_token_len_per_gpu", "actor.log_prob_micro_batch_size_per_gpu"),
        ("reference", "logprob forward"): ("ref.log_prob_max_token_len_per_gpu", "ref.log_prob_micro_batch_size_per_gpu"),
        ("critic", "update"): ("critic.ppo_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu"),
        ("critic", "values forward"): ("critic.forward_max_token_len_per_gpu",
                                       "critic.forward_micro_batch_size_per_gpu"),
    }.get((role, phase))
    if keys is None:
        return []
    dynamic = cfg.critic.use_dynamic_bsz if role == "critic" else cfg.actor.use_dynamic_bsz
    if not dynamic:
        return [{keys[1]: s} for s in (64, 32, 16, 8, 4, 2, 1)]
    out, budget = [], 1 << 21
    while budget > longest:
        budget //= 2
        out.append({keys[0]: max(budget, longest)})
    return out


def _fix_candidates(
    cfg: Config, shape: ModelShape, role: str, phase: str, dp: int
) -> list[tuple[str, list[dict[str, object]]]]:
    """(why, overrides to try) in order of cost: what slows a run least comes first."""
    section = "critic" if role == "critic" else "actor"
    out: list[tuple[str, list[dict[str, object]]]] = []
    budgets = _budget_candidates(cfg, role, phase)
    if budgets:
        out.append(("a smaller micro-batch (more, smaller forwards; same math)", budgets))
    if phase == "update" and not cfg.model.enable_gradient_checkpointing:
        out.append(("gradient checkpointing (recomputes each layer's forward in backward, ~1/3 more compute)",
                    [{"model.enable_gradient_checkpointing": True}]))
    sp_key = {"actor": "actor.ulysses_sequence_parallel_size", "reference": "ref.ulysses_sequence_parallel_size",
              "critic": "critic.ulysses_sequence_parallel_size"}.get(role)
    if sp_key is not None and cfg.actor.use_remove_padding and cfg.actor.use_dynamic_bsz:
        current = {"actor": cfg.actor.ulysses_sequence_parallel_size, "critic": cfg.critic.ulysses_sequence_parallel_size,
                   "reference": cfg.ref.ulysses_sequence_parallel_size or cfg.actor.ulysses_sequence_parallel_size}[role]
        sizes = [{sp_key: k} for k in (2, 4, 8) if k > current and dp % k == 0 and shape.num_attention_heads % k == 0]
        if sizes:
            out.append(("split each sequence over more ranks (Ulysses sequence parallelism: an all-to-all around "
                        "attention)", sizes))
    if cfg.rollout.placement == "colocated" or cfg.trainer.backend == "local":
        if not cfg.rollout.free_cache_engine and role != "rollout":
            out.append(("free the KV cache while training", [{"rollout.free_cache_engine": True}]))
        if role != "rollout" and cfg.rollout.sleep_level < 2:
            out.append(("free the rollout's weights too while training",
                        [{"rollout.free_cache_engine": True, "rollout.sleep_level": 2}]))
    if not getattr(cfg, section).fsdp_config.optimizer_offload:
        out.append(("keep the optimizer state on the CPU between steps (a copy each way per step)",
                    [{f"{section}.fsdp_config.optimizer_offload": True}]))
    if role == "rollout":
        sizes = [{"rollout.max_batch_size": b} for b in (128, 64, 32, 16, 8) if b < cfg.rollout.max_batch_size]
        if sizes:
            out.append(("fewer sequences decoded together (fewer decode rows and logits)", sizes))
    if role == "rollout" and cfg.trainer.backend == "ray":
        heads = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size)
        tps = [{"rollout.tensor_model_parallel_size": t} for t in (2, 4, 8) if t > cfg.rollout.tensor_model_parallel_size
               and dp % t == 0 and all(x % t == 0 for x in heads)]
        if tps:
            out.append(("split each rollout replica's weights and KV cache over more ranks (tensor parallel)", tps))
    if role == "rollout" and cfg.trainer.backend == "ray" and cfg.rollout.placement == "colocated":
        out.append(("give the rollout devices of its own", [{"rollout.placement": "split"}]))
    if cfg.trainer.device == "cuda" and not getattr(cfg, section).fsdp_config.param_offload:
        out.append(("keep sharded parameters, gradients and the optimizer on the CPU (slow)",
                    [{f"{section}.fsdp_config.param_offload": True}]))
    ranks = [{"trainer.backend": "ray", "trainer.n_gpus_per_node": k} for k in (2, 4, 8)
             if k > data_parallel_size(cfg.trainer)]
    if ranks:
        out.append(("more ranks to shard parameters, gradients and optimizer state over (FSDP2)", ranks))
    return out


def cheapest_fix(cfg: Config, shape: ModelShape, role: str, phase: str, *, with_critic: bool, device_bytes: int) -> str:
    """The first change, in order of cost, with which ``role``'s ``phase`` fits ``device_bytes``."""
    dp = 1 if cfg.trainer.backend == "local" else data_parallel_size(cfg.trainer)
    tried = []
    for why, candidates in _fix_candidates(cfg, shape, role, phase, dp):
        for overrides in candidates:
            replanned = plan_memory(_with(cfg, overrides), shape, with_critic=with_critic, device_bytes=device_bytes,
                                    find_fixes=False)
            match = [p for p in replanned.phases if (p.role, p.phase) == (role, phase)]
            if match and match[0].peak <= device_bytes and not match[0].blocked:
                keys = " ".join(f"{k}={_show(v)}" for k, v in overrides.items())
                return f"{keys}: {why}; predicted peak {_size(match[0].peak)}"
        tried.append(why)
    return ("no single change fits it (tried: " + "; ".join(tried) + "). A larger device, more ranks, or a "
            "smaller model")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------- output


def _compute_bytes(cfg: Config, device_type: str) -> int:
    """Bytes per element of the training compute (``model.dtype``, ``auto`` by the hardware rule)."""
    from hybridflow.utils.device import train_dtype  # torch: not before a config error (fast errors)

    return BYTES[train_dtype(cfg.model.dtype, device_type)]
