"""The native engine's scheduler: which prompts prefill, which samples start in which decode rows,
and which rows decode, one step at a time (``Scheduler.plan`` returns a ``step.StepPlan``). It runs on
the event-loop thread and touches no tensor.

Each step, finished rows leave the decode batch, waiting samples of prefilled prompts take the free
rows, and new prompts start prefilling while free rows would otherwise stay empty. At most
``max_prefill_tokens`` prompt tokens are prefilled per step, so a long prompt is prefilled in chunks
while decoding goes on; with ``enable_chunked_prefill=False`` a prompt is never split: one that does
not fit what is left of the step's budget waits for the next step, and one longer than the whole
budget is prefilled alone in a step of its own (SGLang bounds a prefill batch by the larger of its
budget and the context the same way).

Admission control: a sample starts only in a free decode row; the number of rows is
``max_batch_size`` or what fits the KV cache budget at the current row length, whichever is smaller
(the cache grows its rows on demand to the longest ``prompt + max_tokens`` admitted). So a sample,
once started, always has room to finish: a plan never preempts one.

Prefill once per prefix: a new prompt's longest cached prefix (``prefix_cache.PrefixCache``) is
restored into its slot and only the rest is prefilled (except for a request that scores its prompt,
``SamplingParams.prompt_logprobs``: it prefills the whole prompt); prompts that arrive together and share a
prefix wait a step for the first one's blocks rather than computing them twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.prefix_cache import CachedBlock, PrefixCache, block_digests
from hybridflow.inference.step import (
    Admission,
    EngineRequest,
    EngineSample,
    EngineStats,
    PrefillChunk,
    PrefixRestore,
    RowMove,
    StepPlan,
)

# Waiting prompts a step may hold back because another prompt's prefill is computing their next
# prefix block (see Scheduler._start_prefills); bounds the scan of the queue per step.
MAX_DEFERRED_PROMPTS = 256


class Scheduler:
    """The queues of requests in flight and the decode rows, planned one step at a time.

    ``cache`` is read for sizing only (how many rows fit at a row length) and ``prefix_cache`` for
    lookups (the runner writes both); ``weights_version()`` is the weights' current internal version,
    stamped on a prompt when its keys and values start.
    """

    def __init__(
        self,
        *,
        cache: SlotKVCache,
        prefix_cache: PrefixCache | None,
        prompt_slots: int,
        max_prefill_tokens: int,
        enable_chunked_prefill: bool,
        weights_version: Callable[[], int],
        stats: EngineStats,
    ) -> None:
        self._cache, self._prefix_cache = cache, prefix_cache
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill = enable_chunked_prefill
        self._weights_version = weights_version
        self._stats = stats
        self._waiting: deque[EngineRequest] = deque()  # not yet prefilling
        self._prefilling: list[EngineRequest] = []  # holding a prompt slot, prefill incomplete
        self._ready: deque[EngineRequest] = deque()  # prefilled, some samples not yet started
        self._rows: list[EngineSample | None] = []  # decode row -> sample (None: a hole this step fills)
        self._free_slots = list(range(prompt_slots - 1, -1, -1))

    def enqueue(self, request: EngineRequest) -> None:
        # A one-token prompt has nothing to prefill: its samples start from the prompt token alone.
        (self._ready if request.prefix_length == 0 else self._waiting).append(request)

    def plan(self) -> StepPlan | None:
        """Decide the next step: free finished rows, schedule prefill chunks, admit samples; None when
        nothing is queued or running."""
        self._drop_abandoned()
        live = sum(1 for s in self._rows if s is not None)
        if not (self._waiting or self._prefilling or self._ready or live):
            return None
        budget = self.max_prefill_tokens
        chunks, budget = self._continue_prefills(budget)
        started, restores = self._start_prefills(budget, live)
        chunks += started
        capacity = self._needed_capacity()
        admits: list[tuple[EngineSample, int | None]] = []  # (sample, prompt slot to copy from)
        # Requests still listed as prefilling but complete got there this step (by chunks or by a
        # full prefix-cache hit): _settle_queues moved earlier ones to _ready.
        completing = [r for r in self._prefilling if r.prefilled == r.prefix_length]
        for request in [*self._ready, *completing]:
            take = min(self._free_rows(capacity, live + len(admits)), request.request.params.n - request.admitted)
            if take <= 0:
                break
            admits += [(s, request.prompt_slot) for s in request.samples[request.admitted : request.admitted + take]]
            request.admitted += take
        # Settling may free a prompt slot that this step still copies from: slots are only handed
        # out by _start_prefills, which ran above, so the next reuse comes after this step.
        self._settle_queues()
        moves, placed = self._place_rows(admits)
        if not chunks and not restores and not self._rows:
            # Unreachable while every admitted request fits the cache alone (checked at intake);
            # without this, a scheduling bug would spin here instead of failing loudly.
            raise RuntimeError("NativeEngine scheduler: requests are queued but none can start")
        decode = [s for s in self._rows if s is not None]
        assert len(decode) == len(self._rows), "decode rows must be packed before a step"
        return StepPlan(
            capacity=capacity,
            moves=moves,
            restores=restores,
            chunks=chunks,
            admits=placed,
            decode=decode,
            key_length=max((s.position for s in decode), default=-1) + 1,
            top_logprobs=max((s.owner.request.params.logprobs or 0 for s in decode), default=0),
        )

    # ------------------------------------------------------------------ rows and requests

    def free_row(self, row: int) -> None:
        """A sample in ``row`` finished: the next plan fills or packs the hole."""
        self._rows[row] = None

    def count_in_flight(self) -> int:
        """Samples queued or decoding whose request is still awaited."""
        queued = self._waiting, self._prefilling, self._ready
        pending = sum(r.request.params.n - r.admitted for group in queued for r in group if not r.future.done())
        return pending + sum(1 for s in self._rows if s is not None and not s.owner.future.done())

    def all_requests(self) -> set[EngineRequest]:
        owners = {s.owner for s in self._rows if s is not None}
        return owners | set(self._waiting) | set(self._prefilling) | set(self._ready)

    def started_requests(self) -> set[EngineRequest]:
        """Requests holding a prompt slot or a decode row."""
        return {s.owner for s in self._rows if s is not None} | set(self._prefilling) | set(self._ready)

    def drop_started(self) -> None:
        """Forget every started request (a failed step: their keys and values cannot be trusted);
        waiting ones stay queued."""
        for request in (*self._prefilling, *self._ready):
            self._release_slot(request)
        self._prefilling.clear()
        self._ready.clear()
        self._rows = []

    def drop_everything(self) -> None:
        self.drop_started()
        self._waiting.clear()

    def _drop_abandoned(self) -> None:
        """Stop spending on requests whose caller is gone (cancelled) or that failed."""
        for row, sample in enumerate(self._rows):
            if sample is not None and sample.owner.future.done():
                sample.finish_reason = sample.finish_reason or "abort"
                self._rows[row] = None
        for queue in (self._prefilling, self._ready):
            for request in [r for r in queue if r.future.done()]:
                queue.remove(request)
                self._release_slot(request)
        self._waiting = deque(r for r in self._waiting if not r.future.done())

    def _settle_queues(self) -> None:
        """Move fully prefilled prompts to ``_ready`` and fully started ones out, freeing their slots."""
        for request in [r for r in self._prefilling if r.prefilled == r.prefix_length]:
            self._prefilling.remove(request)
            self._ready.append(request)
        for request in [r for r in self._ready if r.admitted == r.request.params.n]:
            self._ready.remove(request)
            self._release_slot(request)

    def _release_slot(self, request: EngineRequest) -> None:
        if request.prompt_slot is not None:
            self._free_slots.append(request.prompt_slot)
            request.prompt_slot = None

    def _place_rows(self, admits: list[tuple[EngineSample, int | None]]) -> tuple[list[RowMove], list[Admission]]:
        """Give new samples the holes first, then pack the remaining holes with the last live rows.

        Returns the row moves and each new sample's row. Sources are never rows a new sample takes:
        samples are appended only once no hole is left to pack.
        """
        rows = self._rows
        holes = [i for i, s in enumerate(rows) if s is None]
        placed = []
        for sample, slot in admits:
            if holes:
                row = holes.pop(0)
                rows[row] = sample
            else:
                row = len(rows)
                rows.append(sample)
            placed.append(Admission(sample, row, slot))
        moves = []
        while holes:
            while rows and rows[-1] is None:
                rows.pop()
            holes = [h for h in holes if h < len(rows)]
            if not holes:
                break
            hole = holes.pop(0)
            moves.append(RowMove(len(rows) - 1, hole))
            rows[hole] = rows.pop()
        return moves, placed

    # ------------------------------------------------------------------ capacity and prefill

    def _needed_capacity(self) -> int:
        """Cache positions per row for every request started so far (they all hold or will need rows)."""
        started = [s.owner for s in self._rows if s is not None] + [*self._prefilling, *self._ready]
        return max([self._cache.capacity, 1] + [r.cache_length for r in started])

    def _free_rows(self, capacity: int, live: int) -> int:
        """Decode rows still free once rows hold ``capacity`` positions and ``live`` are taken."""
        rows = self._cache.rows_that_fit(self._cache.aligned(max(capacity, self._cache.capacity)))
        return max(0, rows - live)

    def _continue_prefills(self, budget: int) -> tuple[list[PrefillChunk], int]:
        """The next chunk of every prompt already prefilling, oldest first, within ``budget`` tokens."""
        chunks = []
        for request in self._prefilling:
            if budget <= 0:
                break
            end = min(request.prefix_length, request.prefilled + budget)
            assert request.prompt_slot is not None
            chunks.append(PrefillChunk(request, request.prompt_slot, request.prefilled, end))
            budget -= end - request.prefilled
            request.prefilled = end
        return chunks, budget

    def _start_prefills(self, budget: int, live: int) -> tuple[list[PrefillChunk], list[PrefixRestore]]:
        """Start prefilling waiting prompts while their samples would find free rows.

        Demand-driven: prompts already prefilled or prefilling have first claim on the free rows,
        and a new prompt starts only when rows would otherwise stay empty, or when nothing at all is
        running (so the engine always makes progress). A prompt's longest cached prefix is copied
        into its slot (a restore) and only the tokens after it are prefilled.
        """
        claimed = sum(r.request.params.n - r.admitted for r in (*self._ready, *self._prefilling))
        chunks: list[PrefillChunk] = []
        restores: list[PrefixRestore] = []
        producing = self._blocks_in_prefill()
        deferred: list[EngineRequest] = []
        while self._waiting and budget > 0 and self._free_slots:
            request = self._waiting[0]
            free = self._free_rows(max(self._needed_capacity(), request.cache_length), live)
            if claimed >= free and (claimed or live):
                break
            whole = self._uncached_length(request)
            if not self.chunked_prefill and whole > budget and not (
                whole > self.max_prefill_tokens and budget == self.max_prefill_tokens
            ):
                # Prefilled whole or not at all: it starts in a later step, first in line. One longer
                # than the whole budget starts first in a step and has that step to itself.
                break
            self._waiting.popleft()
            if len(deferred) < MAX_DEFERRED_PROMPTS and self._next_block_in_prefill(request, producing):
                # Its next prefix block is being computed by a prompt already prefilling (requests
                # sharing a system prompt arrived together): wait a step and copy it instead.
                deferred.append(request)
                continue
            producing.update(self._prefix_digests(request))
            request.prompt_slot = self._free_slots.pop()
            request.weights_version = self._weights_version()
            blocks = self._lookup(request)
            if blocks:
                restores.append(PrefixRestore(request.prompt_slot, blocks))
            start = len(blocks) * self._prefix_cache.block_size if self._prefix_cache is not None else 0
            end = min(request.prefix_length, start + budget) if self.chunked_prefill else request.prefix_length
            if end > start:
                chunks.append(PrefillChunk(request, request.prompt_slot, start, end))
            budget -= end - start
            request.prefilled = end
            self._prefilling.append(request)
            claimed += request.request.params.n
        self._waiting.extendleft(reversed(deferred))
        return chunks, restores

    # ------------------------------------------------------------------ prefix-cache lookups

    def _uncached_length(self, request: EngineRequest) -> int:
        """Prompt tokens ``request`` would prefill if it started now (its cached prefix is copied)."""
        if self._prefix_cache is None or request.prompt_scores is not None:
            return request.prefix_length
        cached = self._prefix_cache.cached_count(self._prefix_digests(request)) * self._prefix_cache.block_size
        return request.prefix_length - min(cached, request.prefix_length)

    def _prefix_digests(self, request: EngineRequest) -> list[bytes]:
        """The prefix-cache names of ``request``'s prefilled part (none with the cache off)."""
        if self._prefix_cache is None:
            return []
        if request.digests is None:
            request.digests = block_digests(request.prompt[: request.prefix_length], self._prefix_cache.block_size)
        return request.digests

    def _blocks_in_prefill(self) -> set[bytes]:
        """Blocks that prompts now prefilling will add to the prefix cache when they complete."""
        return {d for r in self._prefilling for d in self._prefix_digests(r)}

    def _next_block_in_prefill(self, request: EngineRequest, producing: set[bytes]) -> bool:
        """Whether the first block of ``request`` that is not cached is being prefilled by another
        prompt (progress is certain: that prompt keeps prefilling until it completes or fails)."""
        if self._prefix_cache is None or not producing or request.prompt_scores is not None:
            return False
        digests = self._prefix_digests(request)
        cached = self._prefix_cache.cached_count(digests)
        return cached < len(digests) and digests[cached] in producing

    def _lookup(self, request: EngineRequest) -> list[CachedBlock]:
        """The cached blocks of ``request``'s prefilled part (``prefix_length`` tokens), counted. None for a request
        that scores its prompt: its prefill computes the logits a cached block does not hold."""
        if self._prefix_cache is None or request.prompt_scores is not None:
            return []
        blocks = self._prefix_cache.match_digests(self._prefix_digests(request))
        self._stats.prefix_cache_queries += 1
        self._stats.prefix_cache_query_tokens += request.prefix_length
        self._stats.prefix_cache_hit_tokens += len(blocks) * self._prefix_cache.block_size
        return blocks
