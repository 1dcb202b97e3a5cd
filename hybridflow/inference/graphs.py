"""Decode steps at static shapes, replayed from CUDA graphs on a GPU.

Why: on a GPU, a decode step of a small or mid-sized model is bound by kernel launches, not by the
arithmetic or the memory traffic: the compact forward issues about twenty kernels per layer, each a
few microseconds to launch, while each does well under a microsecond of work at small batches. A
CUDA graph records the whole forward once and replays it with one launch.

A graph fixes every shape and every address, so a captured step is the decode forward of one
*batch bucket* and one *key bucket*, reading its inputs from static buffers:

- the batch is padded up to the smallest bucket that holds it (``batch_bucket``). Padding rows are
  the free decode rows right after the live ones (the engine packs live rows at the front): they
  feed the pad token at position 0 and write that position of their own row, which any later
  occupant overwrites (its prompt copy or its first token start at position 0). Their logits are
  dropped. A bucket never exceeds the cache's decode rows, so padding never touches a prompt row;
- the keys each row may read are padded up to a multiple of ``KEY_BUCKET`` positions (capped at
  the cache's capacity), and below ``KEY_BUCKET`` to a power of two of at least ``MIN_KEY_BUCKET``.
  The causal mask comes from the positions alone (``compact.forward``), so the extra keys get no
  weight; bucketing instead of reading the whole capacity keeps the KV traffic of short sequences
  short.

Graphs are captured lazily, on a bucket pair's first use, into one shared memory pool (steps run
one at a time and their logits are consumed before the next, so captures may share intermediate
memory). They stay valid while the weights change in place (``update_weights`` copies into the
same tensors) and are dropped when the KV cache is reallocated (it grew, or slept and woke), since
they read the cache at the addresses they were captured with.

``capture=False`` runs the same padded static step eagerly: the CPU tests check it against the
dynamic forward, and on a GPU it separates a problem of the static shapes from one of the capture.

On a CPU in reduced precision the engine decodes this way by default (``runner.resolve_decode_mode``),
for another reason: oneDNN, which runs a CPU's bf16 matmuls, compiles and keeps a kernel for every
matmul shape it meets, and a decode batch whose rows (1..max_batch_size) and key length (growing
every step) change at every step is a new shape nearly every step; resident memory grew without
bound (docs/figures.md). Bucketed shapes bound the kernels. The runner then pads its prefill forwards
too (``token_bucket`` columns, ``key_bucket`` keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.utils.shapes import geometric_bucket

# Key positions are read in multiples of this: few enough graphs (capacity / KEY_BUCKET per batch
# bucket), little wasted traffic (under KEY_BUCKET positions per row and step).
KEY_BUCKET = 256
# Shorter key lengths read a power of two of at least this many positions (64, 128, then KEY_BUCKET): two
# more buckets per batch bucket, and a step of short sequences no longer reads 256 positions for a few
# dozen real ones. Keys past a row's position get no weight, so the logits are the same to the bit
# (tests/unit/rollout/test_rollout_static_decode.py). Decoding 64 tokens a row after 16-token prompts (a ~20M
# bf16 model, 1 thread), batch 128 took 5-8% fewer CPU-seconds; batch 8 gained within the noise of a loaded
# 2-core machine; a long-tail rollout (lengths median 40, cap 256) 0.87x the CPU-seconds, its resident
# memory as flat as before (docs/figures.md).
MIN_KEY_BUCKET = 64
# Batches up to this pad to a power of two, larger ones to a multiple of BATCH_STEP: at most
# BATCH_STEP - 1 wasted rows, and about max_batch_size / BATCH_STEP graphs per key bucket.
SMALL_BATCH = 16
BATCH_STEP = 16
# Eager runs of a new shape before its capture: lazy initialisation (cuBLAS workspaces, kernel
# selection) must happen outside the graph, on a side stream (CUDA graph capture rules).
WARMUP_RUNS = 2


def batch_bucket(batch: int, limit: int) -> int:
    """The padded batch size for ``batch`` live rows when at most ``limit`` rows exist."""
    if not 1 <= batch <= limit:
        raise ValueError(f"batch_bucket: batch {batch} is outside [1, {limit}]")
    bucket = 1 << (batch - 1).bit_length() if batch <= SMALL_BATCH else -(-batch // BATCH_STEP) * BATCH_STEP
    return min(bucket, limit)


def token_bucket(tokens: int) -> int:
    """The padded width of a prefill forward (``static`` mode on a CPU) for ``tokens`` columns: a power
    of two up to SMALL_BATCH, above it ``utils.shapes.geometric_bucket`` (at most 1/8 of padding), so a
    prompt budget of 2,048 tokens meets about 60 widths."""
    if tokens < 1:
        raise ValueError(f"token_bucket: tokens must be >= 1, got {tokens}")
    return 1 << (tokens - 1).bit_length() if tokens <= SMALL_BATCH else geometric_bucket(tokens)


def key_bucket(key_length: int, capacity: int) -> int:
    """The padded number of key positions for steps whose rows read ``key_length`` of them."""
    if not 1 <= key_length <= capacity:
        raise ValueError(f"key_bucket: key_length {key_length} is outside [1, {capacity}]")
    if key_length < KEY_BUCKET:
        return min(max(MIN_KEY_BUCKET, 1 << (key_length - 1).bit_length()), KEY_BUCKET, capacity)
    return min(-(-key_length // KEY_BUCKET) * KEY_BUCKET, capacity)


class GraphCaptureError(RuntimeError):
    """Capturing a decode step failed (an operation a CUDA graph cannot hold); eager decode works."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (bucket, V): written by every replay


class StaticDecoder:
    """Decode forwards at bucketed static shapes: replayed CUDA graphs, or eager (``capture=False``)."""

    def __init__(
        self, model: CompactCausalLM, cache: SlotKVCache, *, max_rows: int, pad_token_id: int, capture: bool
    ) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        self.model, self.cache, self.capture = model, cache, capture
        self.pad_token_id = pad_token_id
        device = model.device
        self._tokens = torch.full((max_rows, 1), pad_token_id, dtype=torch.long, device=device)
        self._positions = torch.zeros((max_rows, 1), dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._cache_generation = -1
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # graphs captured so far (a step figure for tests and logs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph and its memory (the engine sleeps, or the cache was reallocated)."""
        self._graphs.clear()
        self._cache_generation = -1

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, key_length: int) -> torch.Tensor:
        """Logits (B, V) of rows ``[0, B)`` feeding ``tokens`` (B,) at ``positions`` (B,).

        The returned tensor is overwritten by the next call: consume it first.
        """
        batch = int(tokens.shape[0])
        # A graph per bucket costs capture time and pool memory, so graphs take coarse row buckets;
        # an eager static step (a CPU's) only needs a bounded set of shapes, and every padded row
        # is real work there: rows round up by at most 1/8 (token_bucket).
        limit = self.cache.decode_rows
        bucket = batch_bucket(batch, limit) if self.capture else min(token_bucket(batch), limit)
        keys = key_bucket(key_length, self.cache.capacity)
        self._tokens[:batch, 0] = tokens
        self._positions[:batch, 0] = positions
        self._tokens[batch:bucket] = self.pad_token_id
        self._positions[batch:bucket] = 0
        if not self.capture:
            return self._step(bucket, keys)[:batch]
        self._drop_stale_graphs()
        captured = self._graphs.get((bucket, keys))
        if captured is None:
            captured = self._graphs[(bucket, keys)] = self._capture(bucket, keys)
        captured.graph.replay()
        return captured.logits[:batch]

    def _step(self, bucket: int, keys: int) -> torch.Tensor:
        access = self.cache.decode_access(bucket, self._positions[:bucket, 0], keys)
        logits = self.model.forward(self._tokens[:bucket], self._positions[:bucket], access, keys)
        assert logits is not None
        return logits

    def _drop_stale_graphs(self) -> None:
        generation = self.cache.generation
        if generation != self._cache_generation:
            self.reset()
            self._cache_generation = generation

    def _capture(self, bucket: int, keys: int) -> _Captured:
        # The warm-up runs write the same keys and values the replay will write (same inputs), so
        # running them for real changes nothing the step would not.
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._step(bucket, keys)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        try:
            return self._record(bucket, keys)
        except Exception as exc:  # whatever the capture hit, the step itself is fine eagerly
            raise GraphCaptureError(f"capturing the decode step (batch {bucket}, {keys} keys) failed: "
                                    f"{type(exc).__name__}: {exc}") from exc

    def _record(self, bucket: int, keys: int) -> _Captured:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine steps in a worker thread; CUDA work another thread does meanwhile
        # (a colocated trainer, a server's tokenisation) must neither join nor break the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._step(bucket, keys)
        self.captures += 1
        return _Captured(graph, logits)
