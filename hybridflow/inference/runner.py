"""The native engine's model runner: executes one ``step.StepPlan`` in a worker thread (row moves,
prefix-cache restores, one prefill forward, admissions, one decode forward, sampling) and returns a
``step.StepResult``. It owns the tensors: the compact forward, the KV cache, the per-row sampling
state, the static decoder (CUDA graphs) and the prefix cache's contents.

Partial rollout (``recompute_stale_kv``): before a step extends or copies keys and values computed
under weights since replaced, it recomputes them under the current ones, checked under the model
lock in the step itself, so an update that lands between planning and executing is caught too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.graphs import GraphCaptureError, StaticDecoder, key_bucket, token_bucket
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.prefix_cache import CachedBlock, PrefixCache
from hybridflow.inference.sampling import RowProfile, SamplingTensors, compute_top_logprobs, row_values, sample_tokens, split_key
from hybridflow.inference.step import (
    Admission,
    EngineSample,
    EngineStats,
    LogitsProcessor,
    LogitsRows,
    PrefillChunk,
    PrefixSave,
    PromptScores,
    StepPlan,
    StepResult,
)
from hybridflow.inference.weight_store import WeightStore

logger = logging.getLogger(__name__)

# How decode forwards run: "eager" at the exact shapes (but for KEY_ALIGN and MIN_MATMUL_ROWS, which every
# mode keeps); "static" padded to bucketed shapes, and
# prefill forwards too; "cuda_graph" static decode shapes replayed from CUDA graphs
# (graphs.StaticDecoder). None picks cuda_graph on CUDA (launch-bound there), static on a CPU in
# reduced precision (oneDNN keeps a compiled kernel per matmul shape: unbucketed shapes grew resident
# memory without bound, graphs module docstring) and eager elsewhere (float32 on a CPU runs in MKL,
# which keeps nothing per shape, and padding would cost real work).
DECODE_MODES = ("eager", "static", "cuda_graph")

# Rows of logits a prompt-scoring prefill materialises at once: bounds its (rows, V) float32 temporaries
# (a 150k vocabulary: 0.6 GB at 1024 rows) whatever the prefill budget.
SCORE_ROWS = 256


class PrefillPart(NamedTuple):
    """Keys and values of ``tokens[start:end]`` written at those positions of prompt slot ``slot``; with
    ``scores``, the outputs at those positions also score tokens ``start + 1 .. end`` (``step.PromptScores``)."""

    slot: int
    tokens: Sequence[int]
    start: int
    end: int
    scores: PromptScores | None = None


def score_next_tokens(
    compact: CompactCausalLM, hidden: torch.Tensor, next_tokens: torch.Tensor, top: int
) -> tuple[list[float], list[int], list[dict[int, float]] | None]:
    """Each row's logprob of its next token from final hidden states (N, h), its rank (1: the most likely) and,
    with ``top`` > 0, the ``top`` most likely {token: logprob}: the raw model's (temperature 1, float32)."""
    logprobs: list[float] = []
    ranks: list[int] = []
    tops: list[dict[int, float]] | None = [] if top else None
    for first in range(0, hidden.shape[0], SCORE_ROWS):
        rows = compact.logits(hidden[first : first + SCORE_ROWS]).float().log_softmax(dim=-1)  # (n, V)
        chosen = rows.gather(1, next_tokens[first : first + SCORE_ROWS, None])  # (n, 1)
        logprobs += chosen[:, 0].tolist()
        ranks += ((rows > chosen).sum(dim=-1) + 1).tolist()
        if tops is not None:
            values, ids = rows.topk(top, dim=-1)
            tops += [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return logprobs, ranks, tops


class RowState:
    """Per-decode-row tensors (positions, tokens, sampling parameters), indexed like the cache rows."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        def longs() -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long, device=device)

        def floats() -> torch.Tensor:
            return torch.ones(rows, dtype=torch.float32, device=device)

        self.vocab_size, self.device = vocab_size, device
        self.positions, self.last_tokens, self.counters, self.top_k = longs(), longs(), longs(), longs()
        self.temperatures, self.top_p, self.min_p, self.penalty = floats(), floats(), floats(), floats()
        self.greedy = torch.zeros(rows, dtype=torch.bool, device=device)
        self.keys = torch.zeros((rows, 2), dtype=torch.long, device=device)
        self.seen: torch.Tensor | None = None  # (rows, V) bool, only once a row has a repetition penalty

    def _tensors(self) -> list[torch.Tensor]:
        tensors = [self.positions, self.last_tokens, self.counters, self.top_k, self.temperatures]
        tensors += [self.top_p, self.min_p, self.penalty, self.greedy, self.keys]
        return tensors + ([self.seen] if self.seen is not None else [])

    def move(self, sources: list[int], destinations: list[int]) -> None:
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(destinations, dtype=torch.long, device=self.device)
        for tensor in self._tensors():
            tensor[dst] = tensor[src]

    def admit(self, samples: list[EngineSample], rows: list[int]) -> None:
        """Start ``samples`` in ``rows``: they feed their prompt's last token at position P - 1."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        values = [row_values(s.owner.request.params) for s in samples]
        columns = list(zip(*values, strict=True))

        def put(tensor: torch.Tensor, column: Sequence[Any]) -> None:
            tensor[index] = torch.tensor(column, dtype=tensor.dtype, device=self.device)

        put(self.positions, [s.position for s in samples])
        put(self.last_tokens, [s.owner.prompt[-1] for s in samples])
        put(self.counters, [len(s.response_ids) for s in samples])
        for tensor, column in zip(
            [self.temperatures, self.greedy, self.top_k, self.top_p, self.min_p, self.penalty], columns, strict=True
        ):
            put(tensor, column)
        self.keys[index] = torch.tensor([split_key(s.key) for s in samples], dtype=torch.long, device=self.device)
        if self.seen is None and any(s.profile.penalty for s in samples):
            self.seen = torch.zeros((self.positions.shape[0], self.vocab_size), dtype=torch.bool, device=self.device)
        if self.seen is not None:
            self.seen[index] = False
            for row, sample in zip(rows, samples, strict=True):
                ids = sample.owner.prompt + sample.response_ids
                self.seen[row, torch.tensor(ids, dtype=torch.long, device=self.device)] = True

    def sampling(self, batch: int, profiles: Sequence[RowProfile]) -> SamplingTensors:
        return SamplingTensors.from_columns(
            temperatures=self.temperatures[:batch],
            greedy=self.greedy[:batch],
            top_k=self.top_k[:batch],
            top_p=self.top_p[:batch],
            min_p=self.min_p[:batch],
            repetition_penalty=self.penalty[:batch],
            keys=self.keys[:batch],
            counters=self.counters[:batch],
            profiles=profiles,
        )

    def advance(self, batch: int, tokens: torch.Tensor) -> None:
        """After a step: every row fed one token and drew ``tokens`` (B,)."""
        self.positions[:batch] += 1
        self.counters[:batch] += 1
        self.last_tokens[:batch] = tokens
        if self.seen is not None:
            self.seen[torch.arange(batch, device=self.device), tokens] = True


# Every step reads its rows' keys in multiples of this many positions (where the decode mode does not pad them
# further: ``graphs.key_bucket``). The attention's sums over a row's key window (the softmax's, p.V's) are then
# split into the same vector lanes and blocks whatever the batch's longest row, so a row's logprobs do not
# depend on the rows beside it: with the exact window they moved by ~1e-6 in fp32 with the batch (engines of
# 1, 4 and 8 rows against 32, bench/batch_invariance.py; 0.0 with it). A multiple of every CPU vector width
# of fp32 (16: AVX-512); the keys past a row's own are masked, so the padding changes no result.
KEY_ALIGN = 16


def aligned_keys(key_length: int, capacity: int) -> int:
    """``key_length`` rounded up to a multiple of ``KEY_ALIGN``, at most the cache's ``capacity``."""
    return min(-(-key_length // KEY_ALIGN) * KEY_ALIGN, capacity)


def resolve_decode_mode(
    decode_mode: str | None, device: torch.device, compact: CompactCausalLM, dtype: torch.dtype = torch.float32
) -> str:
    """``decode_mode`` checked against the device and the model (None: CUDA graphs where they can
    record, static shapes on a CPU in reduced precision, eager elsewhere; see ``DECODE_MODES``)."""
    if decode_mode is None:
        if device.type == "cuda":
            decode_mode = "cuda_graph" if compact.capturable else "eager"
        else:
            decode_mode = "static" if device.type == "cpu" and dtype != torch.float32 else "eager"
    if decode_mode == "cuda_graph" and not compact.capturable:
        raise ValueError("NativeEngine: decode_mode='cuda_graph' cannot record a mixture-of-experts model "
                         "(its routing has data-dependent shapes); use decode_mode='eager'")
    if decode_mode not in DECODE_MODES:
        raise ValueError(f"NativeEngine: decode_mode must be one of {', '.join(DECODE_MODES)}, got {decode_mode!r}")
    if decode_mode == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"NativeEngine: decode_mode='cuda_graph' needs a CUDA device, not {device}")
    return decode_mode


class ModelRunner:
    """Executes step plans on the model (see the module docstring). ``lock`` is the engine's model
    lock: every step holds it, and so does every weight update (``weights``)."""

    def __init__(
        self,
        *,
        compact: CompactCausalLM,
        cache: SlotKVCache,
        prefix_cache: PrefixCache | None,
        weights: WeightStore,
        lock: threading.Lock,
        stats: EngineStats,
        device: torch.device,
        dtype: torch.dtype,
        vocab_size: int,
        max_batch_size: int,
        pad_token_id: int,
        max_prefill_tokens: int,
        decode_mode: str | None,
        logits_processors: Sequence[LogitsProcessor],
        recompute_stale_kv: bool,
    ) -> None:
        self.compact, self.cache, self.prefix_cache = compact, cache, prefix_cache
        self._weights, self._lock, self._stats = weights, lock, stats
        self._device, self._dtype = device, dtype
        self._max_prefill_tokens = max_prefill_tokens
        self.logits_processors = tuple(logits_processors)
        self._recompute_stale_kv = recompute_stale_kv
        self._state = RowState(max_batch_size, vocab_size, self._device)
        self.decode_mode = resolve_decode_mode(decode_mode, self._device, compact, dtype)
        # Static shapes pad the prefill forwards as well (DECODE_MODES): CUDA graphs need it for decode only.
        self.bucket_prefill = self.decode_mode == "static"
        self.static_decoder: StaticDecoder | None = None
        if self.decode_mode != "eager":
            self.static_decoder = StaticDecoder(compact, cache, max_rows=max_batch_size, pad_token_id=pad_token_id,
                                                capture=self.decode_mode == "cuda_graph")
        self._pending_saves: list[PrefixSave] = []  # rows finished in the step being applied

    # ------------------------------------------------------------------ between steps (event-loop thread)

    def release(self) -> None:
        """Free the KV cache, the prefix cache and the graphs (``sleep``; the caller holds the lock)."""
        self.cache.release()
        self.clear_prefix_cache()
        if self.static_decoder is not None:
            self.static_decoder.reset()  # the graphs read the released cache and hold pool memory
        self._state.seen = None

    def discard_cache(self) -> None:
        """A step failed: nothing cached can be trusted. The cache is reallocated zeroed on the next
        step. Stale values past a row's length get attention weight 0, but 0 x NaN is NaN: after
        non-finite logits no cached value can be trusted."""
        self.cache.release()
        self.clear_prefix_cache()

    def clear_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self._pending_saves.clear()

    def drop_pending_saves(self) -> None:
        self._pending_saves.clear()

    def keep_finished(self, sample: EngineSample, row: int) -> None:
        """Queue a finished sample's row for the prefix cache (``save_finished``): prompt +
        response, the last token excepted, whose keys and values would come only from feeding it back."""
        if self.prefix_cache is None:
            return
        tokens = sample.owner.prompt + sample.response_ids[:-1]
        if len(tokens) >= self.prefix_cache.block_size:
            self._pending_saves.append(PrefixSave(row, tokens, sample.kv_version))

    def save_finished(self) -> None:
        """Keep the rows of samples that finished this step (event-loop thread, between steps).

        Copying a few blocks is short next to a step, so it runs here rather than costing a thread
        hop. The lock is only ever busy now with a weight update in another thread, which makes
        these rows stale anyway: they are dropped rather than waited for.
        """
        if not self._pending_saves:
            return
        saves, self._pending_saves = self._pending_saves, []
        if not self._lock.acquire(blocking=False):
            return
        try:
            with torch.inference_mode():
                if self.cache.is_allocated:
                    self._save_rows(saves)
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ one step (worker thread)

    def execute(self, plan: StepPlan) -> StepResult:
        with self._lock, torch.inference_mode():
            cache = self.cache
            if plan.moves:
                sources, destinations = [m.source for m in plan.moves], [m.destination for m in plan.moves]
                cache.move_rows(destinations, sources, plan.key_length)
                self._state.move(sources, destinations)
            if self.prefix_cache is not None:
                # The slot cache has first claim on the budget: make room before it grows.
                self._trim_prefix_cache(cache.planned_nbytes(plan.capacity))
            # After the moves, rows [0, batch_size) are all that must survive a reallocation.
            if not cache.ensure_capacity(plan.capacity, live_rows=plan.batch_size):
                raise RuntimeError(f"KV cache cannot hold {plan.batch_size} rows of {plan.capacity} positions")
            for restore in plan.restores:
                keys = torch.cat([b.keys for b in restore.blocks], dim=-1)
                values = torch.cat([b.values for b in restore.blocks], dim=-2)
                cache.write_positions(cache.prompt_row(restore.slot), keys, values)
            chunks, recomputed = plan.chunks, 0
            if self._recompute_stale_kv:
                # Checked here, under the lock: an update may have landed after the plan was made.
                chunks, recomputed = self._refresh_stale_prompts(plan.chunks, plan.admits)
            if chunks:
                self._prefill_parts([PrefillPart(c.slot, c.request.prompt, c.start, c.end, c.request.prompt_scores)
                                     for c in chunks])
                if self.prefix_cache is not None:
                    self._save_rows([
                        PrefixSave(cache.prompt_row(c.slot), c.request.prompt[: c.end], c.request.weights_version)
                        for c in chunks if c.end == c.request.prefix_length
                    ])
            if plan.admits:
                self._admit(plan.admits)
            if self._recompute_stale_kv and plan.batch_size:
                recomputed += self._recompute_stale_rows(plan.decode)
            if plan.batch_size == 0:
                return StepResult(tokens=[], logprobs=[], top_ids=None, top_values=None, recomputed_tokens=recomputed)
            return replace(self._decode(plan), recomputed_tokens=recomputed)

    def _refresh_stale_prompts(
        self, chunks: list[PrefillChunk], admits: list[Admission]
    ) -> tuple[list[PrefillChunk], int]:
        """Partial rollout, prompt slots: the chunks to prefill so that no slot this step extends or
        copies holds keys and values of replaced weights, and the tokens that costs beyond the plan.

        A chunk that continues a prompt prefilled (or restored from the prefix cache) under older
        weights starts again from position 0; a prefilled prompt whose samples start now is
        prefilled again whole before they copy it (once for all of them).
        """
        current = self._weights.version
        refreshed: list[PrefillChunk] = []
        recomputed = 0
        covered = set()
        for chunk in chunks:
            request = chunk.request
            covered.add(request)
            if request.weights_version != current and chunk.start > 0:
                recomputed += chunk.start
                chunk = PrefillChunk(request, chunk.slot, 0, chunk.end)
            request.weights_version = current
            refreshed.append(chunk)
        for sample, _, slot in admits:
            request = sample.owner
            if slot is None or request in covered or request.weights_version == current:
                continue
            covered.add(request)
            refreshed.append(PrefillChunk(request, slot, 0, request.prefix_length))
            recomputed += request.prefix_length
            request.weights_version = current
        return refreshed, recomputed

    def _recompute_stale_rows(self, decode: list[EngineSample]) -> int:
        """Partial rollout, running rows: re-prefill each row whose keys and values were computed
        under replaced weights (its prompt and the response so far, all but the token it feeds
        next) under the current ones, so its next token's logprob is exact. Returns the tokens."""
        current, base = self._weights.version, self.cache.decode_rows
        parts: list[PrefillPart] = []
        for row, sample in enumerate(decode):
            if sample.kv_version == current:
                continue
            # A decode row r is addressed as prompt slot r - decode_rows (see SlotKVCache.prefill_access).
            parts.append(PrefillPart(row - base, sample.owner.prompt + sample.response_ids, 0, sample.position))
            sample.kv_version = current
        self._prefill_parts(parts)
        return sum(p.end - p.start for p in parts)

    def _save_rows(self, saves: list[PrefixSave]) -> None:
        """Copy the full blocks of each row that the prefix cache lacks into it, then trim it to
        what the budget leaves beside the slot cache."""
        cache, prefix_cache = self.cache, self.prefix_cache
        assert prefix_cache is not None
        size = prefix_cache.block_size
        for save in saves:
            if save.weights_version != self._weights.version:
                continue  # computed, at least in part, with weights since replaced
            digests, missing = prefix_cache.missing(save.tokens)
            blocks = {}
            for index in missing:
                keys, values = cache.read_positions(save.row, index * size, (index + 1) * size)
                blocks[index] = CachedBlock(keys, values)
            prefix_cache.insert(digests, blocks)
        self._trim_prefix_cache(cache.nbytes)

    def _trim_prefix_cache(self, slot_cache_bytes: int) -> None:
        assert self.prefix_cache is not None
        limit = self.cache.memory_budget_bytes - slot_cache_bytes
        self._stats.prefix_cache_evicted_blocks += self.prefix_cache.trim(max(0, limit))

    def _prefill_parts(self, parts: list[PrefillPart]) -> None:
        """Write keys and values of ``tokens[start:end]`` at those positions of slot ``slot``, for
        each ``(slot, tokens, start, end)``, in forwards of at most ``max_prefill_tokens`` tokens
        (or one token per part, when there are more parts than that). Each forward takes the next
        piece of every unfinished part, so a part's later pieces attend over its earlier ones; a
        step's planned chunks fit the budget, so they take one forward."""
        parts = [part for part in parts if part.end > part.start]
        limit = self._max_prefill_tokens
        while parts:
            if sum(p.end - p.start for p in parts) <= limit:
                self._prefill_forward(parts)
                return
            width = max(1, limit // len(parts))
            self._prefill_forward([p._replace(end=min(p.end, p.start + width)) for p in parts])
            parts = [p._replace(start=p.start + width) for p in parts if p.start + width < p.end]

    def _prefill_forward(self, parts: list[PrefillPart]) -> None:
        """One forward over token ranges ``(slot, tokens, start, end)``, right-padded to the longest; the parts
        with ``scores`` get their next tokens' logprobs from its outputs."""
        width = max(p.end - p.start for p in parts)
        key_length = aligned_keys(max(p.end for p in parts), self.cache.capacity)
        if self.bucket_prefill:
            # Padded columns repeat a real position (below) and are never written; keys past a
            # slot's tokens get no weight (the causal mask comes from the positions).
            width = token_bucket(width)
            key_length = key_bucket(key_length, self.cache.capacity)
        ids = torch.zeros((len(parts), width), dtype=torch.long)
        positions = torch.zeros((len(parts), width), dtype=torch.long)
        flat_index, flat_slots, flat_positions = [], [], []
        for i, (slot, tokens, start, end, _) in enumerate(parts):
            length = end - start
            ids[i, :length] = torch.tensor(tokens[start:end])
            # Padding repeats the last real position: in range for RoPE, and its output is unused.
            positions[i] = start + torch.arange(width).clamp(max=length - 1)
            flat_index += range(i * width, i * width + length)
            flat_slots += [slot] * length
            flat_positions += range(start, end)
        device = self._device

        def tensor(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        access = self.cache.prefill_access(
            [p.slot for p in parts], tensor(flat_index), tensor(flat_slots), tensor(flat_positions),
            key_length=key_length,
        )
        scoring = [(i, p) for i, p in enumerate(parts) if p.scores is not None]
        hidden = self.compact.forward(ids.to(device), positions.to(device), access, key_length, with_logits=False,
                                      all_hidden=bool(scoring))
        for i, part in scoring:
            assert hidden is not None and part.scores is not None
            # The output at position p scores the token at p + 1 (end <= prefix_length < len(tokens)).
            following = tensor(list(part.tokens[part.start + 1 : part.end + 1]))
            part.scores.record(part.start, *score_next_tokens(self.compact, hidden[i, : part.end - part.start],
                                                              following, part.scores.top_k))

    def _admit(self, admits: list[Admission]) -> None:
        """Copy each new sample's prompt keys/values into its row and set its row state."""
        copies = [(row, slot) for _, row, slot in admits if slot is not None]
        if copies:
            length = max(s.owner.prefix_length for s, _, _ in admits)
            self.cache.copy_prompts([row for row, _ in copies], [slot for _, slot in copies], length)
        self._state.admit([s for s, _, _ in admits], [row for _, row, _ in admits])
        for sample, _, slot in admits:
            # A one-token prompt has no keys or values to copy: nothing of it can be stale.
            sample.kv_version = sample.owner.weights_version if slot is not None else self._weights.version

    def _decode(self, plan: StepPlan) -> StepResult:
        batch, state, samples = plan.batch_size, self._state, plan.decode
        positions = state.positions[:batch]
        logits: torch.Tensor | None = None
        if self.static_decoder is not None:
            try:
                logits = self.static_decoder.forward(state.last_tokens[:batch], positions, plan.key_length)
            except GraphCaptureError as exc:
                # A model op a graph cannot hold must not end the run: decode eagerly from now on.
                logger.warning("NativeEngine: %s; decoding without CUDA graphs from now on", exc)
                self.static_decoder, self.decode_mode = None, "eager"
        if logits is None:
            keys = aligned_keys(plan.key_length, self.cache.capacity)
            access = self.cache.decode_access(batch, positions, keys)
            logits = self.compact.forward(state.last_tokens[:batch, None], positions[:, None], access, keys)
        assert logits is not None
        sampling = state.sampling(batch, [s.profile for s in samples])
        adjust = self._adjust(samples, state.counters[:batch]) if self.logits_processors else None
        seen = state.seen[:batch] if state.seen is not None else None
        tokens, logprobs = sample_tokens(logits, sampling, seen=seen, adjust=adjust,
                                         kernel=self.compact.weight_layout == "fused")
        # A NaN anywhere in a row's logits makes its log-softmax, hence its sampled logprob, NaN:
        # checking the B logprobs finds it without a pass over the (B, V) logits every step.
        nan_rows = torch.isnan(logprobs)
        if bool(nan_rows.any()):
            labels = sorted({samples[i].owner.label for i in nan_rows.nonzero().flatten().tolist()})
            raise FloatingPointError(
                f"model produced NaN logits for requests {', '.join(labels)} (dtype {self._dtype}); "
                "check the weights last loaded with update_weights"
            )
        top_ids = top_values = None
        if plan.top_logprobs:
            values, ids = compute_top_logprobs(logits, sampling.temperatures, plan.top_logprobs)
            top_ids, top_values = ids.tolist(), values.tolist()
        state.advance(batch, tokens)
        return StepResult(tokens.tolist(), logprobs.tolist(), top_ids, top_values,
                          policy_version=self._weights.policy_version)

    def _adjust(self, samples: list[EngineSample], counters: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        rows = LogitsRows(
            request_ids=[s.owner.request.request_id for s in samples],
            sample_indices=[s.index for s in samples],
            output_lengths=counters,
        )
        processors = self.logits_processors

        def adjust(logits: torch.Tensor) -> torch.Tensor:
            for processor in processors:
                logits = processor(logits, rows)
            return logits

        return adjust
