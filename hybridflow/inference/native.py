"""NativeEngine: a request-level, continuously batching rollout engine for the families of ``families``
(Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, Qwen3-MoE, Mixtral).

Works anywhere torch runs (CPU, one GPU) with no inference server, which is what the laptop
default and the tests need. It is small and batch-invariant where the RL loop cares (seeded
samples, logprobs), and fast where a CPU run pays: per-step overhead and long-tailed lengths.

How a request flows
-------------------
``generate()`` validates the request, gives each of its ``n`` samples a random key
(``sampling.derive_sample_seed``), queues it and awaits a future. A scheduler coroutine (started on
demand on the caller's event loop, exiting when there is nothing left) runs *steps*. Each step:

1. plans on the event-loop thread (``_plan``): finished rows leave the decode batch, waiting
   samples of prefilled prompts take the free rows, and new prompts start prefilling while free
   rows would otherwise stay empty;
2. runs the model in a worker thread (``_execute``): at most one prefill forward over prompt
   chunks (``max_prefill_tokens`` per step, so a long prompt is prefilled in chunks while decoding
   goes on; with ``enable_chunked_prefill=False`` a prompt is never split: one that does not fit
   what is left of the step's budget waits for the next step, and one longer than the whole budget
   is prefilled alone in a step of its own, as SGLang bounds a prefill batch by the larger of its
   budget and the context), then one decode forward over every
   running sequence, then sampling;
3. records the step on the event-loop thread (``_apply``): appends each row's token and logprob,
   finishes rows on a stop token, stop string or ``max_tokens``, resolves a request's future once
   all of its samples are done.

So sequences join and leave the running batch at every step: a long-tailed length distribution
costs the tokens it generates, not ``batch x longest``.

Prefill once per prompt: a prompt's first ``P - 1`` tokens are prefilled once into a prompt slot
of the KV cache (``kv_cache.SlotKVCache``); each of its samples copies them into its own decode row
and starts decoding by feeding the prompt's last token. That makes every row of a decode step
alike (one token in, one token out) and a group of ``n`` samples costs one prefill.

Prefill once per prefix (``enable_prefix_caching``): a prompt slot whose prefill completes and the
row of every sample that finishes are kept, in 16-token blocks named by a chained hash of their
tokens, in a prefix cache (``prefix_cache.PrefixCache``; least recently used blocks are evicted to
stay within the KV budget). A new prompt's longest cached prefix is copied into its slot and only
the rest is prefilled: turn k+1 of an agent episode (turn k's prompt + response + tool output)
prefills the tool output and the tail of the response, and a system prompt shared by many requests
is prefilled once (prompts arriving together wait a step for the first one's blocks). A finished
row is kept up to its response's second-to-last token: the last sampled token was never fed back,
so no keys or values exist for it. Every weight update clears the cache, and a row computed (even
in part) under replaced weights is never kept (a row recomputed after an update, below, is).

Admission control: a sample starts only in a free decode row; the number of rows is
``max_batch_size`` or what fits ``kv_cache_memory_bytes`` at the current row length, whichever is
smaller (the cache grows its rows on demand to the longest ``prompt + max_tokens`` admitted).

Weights and concurrency: partial rollout
----------------------------------------
``update_weights`` and every step take the same lock, so new weights land between two steps. One
engine serves one event loop at a time.

Samples in flight when new weights land are neither restarted nor dropped: they continue from the
tokens they already have, and their later tokens come from the new policy (partial rollout). Every
token records the policy version that produced it (``Trajectory.token_versions``): the ``version``
the trainer passes to ``update_weights``/``weight_update`` (its step), or, without one, the previous
version + 1 (the engine starts at 0, ``policy_version``).

By default (``recompute_stale_kv=True``) a sample's keys and values are recomputed under the new
weights before its next decode step: the first step after an update re-prefills, in forwards of at
most ``max_prefill_tokens`` tokens, every running row (prompt + response so far), every prompt
slot it is about to copy into a new row, and, for a prompt being prefilled in chunks, the chunks
already done. So each token's ``rollout_logprobs`` entry is exactly its version's logprob given
the whole context, which is what a trainer's importance weights against that version need; the
price is one prefill of the running batch per update. The check runs under the lock, in the step
itself, so an update that lands between a step's planning and its forward is caught too.
``recompute_stale_kv=False`` keeps the old keys and values instead (no extra prefill): the later
tokens are then drawn from new weights attending over context encoded by the old ones, so their
logprobs match neither version exactly. Callers that need one policy per trajectory update while
the engine is idle (the synchronous trainer does): then every token carries one version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.graphs import GraphCaptureError, StaticDecoder
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.prefix_cache import CachedBlock, PrefixCache, block_digests
from hybridflow.inference.sampling import (
    RowProfile,
    SamplingTensors,
    check_sampling_params,
    compute_top_logprobs,
    derive_sample_seed,
    refuse_images,
    row_profile,
    row_values,
    sample_tokens,
    split_key,
)
from hybridflow.inference.stopping import StopStrings
from hybridflow.transfer.weights import DEFAULT_BUCKET_BYTES, check_bucket, copy_bucket, iter_buckets
from hybridflow.types import GenerationRequest, Trajectory
from hybridflow.utils.aio import serve_batch

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Share of the free memory the KV cache may take when no budget is given: on a GPU the trainer and
# its optimizer usually share the device; on a CPU the OS, the trainer and the data need the rest.
KV_CACHE_MEMORY_FRACTION = {"cuda": 0.4, "cpu": 0.25}
# Prompt tokens prefilled per step: big enough that short prompts batch into one forward, small
# enough that a long prompt does not stall the running sequences for long (vLLM's default order).
DEFAULT_MAX_PREFILL_TOKENS = 2048
# Prompt slots: prompts being prefilled, or waiting for rows for their samples. Demand-driven
# prefill keeps few of them busy; 64 lets a GRPO batch of 64 prompts prefill together.
DEFAULT_MAX_PREFILL_PROMPTS = 64
# Waiting prompts a step may hold back because another prompt's prefill is computing their next
# prefix block (see _start_prefills); bounds the scan of the queue per step.
MAX_DEFERRED_PROMPTS = 256
# How decode forwards run: "eager" at the exact shapes; "static" padded to bucketed shapes;
# "cuda_graph" static shapes replayed from CUDA graphs (graphs.StaticDecoder). None picks
# cuda_graph on CUDA (launch-bound there) and eager elsewhere (no launch cost to save on a CPU,
# and padding would cost real work).
DECODE_MODES = ("eager", "static", "cuda_graph")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its config name (``rollout.dtype``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown rollout dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from None


def default_kv_cache_bytes(device: torch.device) -> int:
    """``KV_CACHE_MEMORY_FRACTION`` of the device's free memory now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * KV_CACHE_MEMORY_FRACTION["cuda"])
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * KV_CACHE_MEMORY_FRACTION["cpu"])


@dataclass(frozen=True)
class LogitsRows:
    """Who the rows of a logits batch are, for logits processors."""

    request_ids: list[str]
    sample_indices: list[int]
    output_lengths: torch.Tensor  # (B,) long: tokens each row has generated before this one


class LogitsProcessor(Protocol):
    """Adjusts the logits a token is *drawn* from (B, V) float32; logprobs stay the model's own."""

    def __call__(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor: ...


@dataclass(frozen=True)
class TokenEvent:
    """One token appended to sample ``sample_index`` of request ``request_id`` (for streaming)."""

    request_id: str
    sample_index: int
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None  # with SamplingParams.logprobs set
    finish_reason: str | None  # set on the sample's last token
    stop_reason: int | str | None
    policy_version: int = 0  # the version of the weights that produced the token


TokenListener = Callable[[TokenEvent], None]
# Builds the engine's forward from its HF model (already on the device and dtype) and its context.
CompactFactory = Callable[[torch.nn.Module, int], CompactCausalLM]


@dataclass
class EngineStats:
    """Counters since construction, for metrics, benchmarks and tests."""

    steps: int = 0  # scheduler steps: each runs at most one prefill and one decode forward
    forward_passes: int = 0  # model calls, prefill and decode
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # prompt tokens run through prefill: P - 1 per request (whatever its n), less its cache hit
    generated_tokens: int = 0  # tokens appended to responses
    admitted_samples: int = 0
    admitted_while_decoding: int = 0  # samples that joined a batch with sequences already decoding
    row_moves: int = 0  # live rows moved into holes left by finished ones
    max_running: int = 0  # the most sequences decoded in one step
    prefix_cache_queries: int = 0  # requests looked up in the prefix cache
    prefix_cache_query_tokens: int = 0  # prompt tokens looked up: P - 1 per request
    prefix_cache_hit_tokens: int = 0  # of those, tokens found cached (not prefilled)
    prefix_cache_evicted_blocks: int = 0
    weight_updates: int = 0
    # Tokens re-prefilled because their keys and values were computed under replaced weights
    # (partial rollout, recompute_stale_kv): running rows and prompt slots, not prefill_tokens.
    recomputed_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found cached (``rollout/prefix_cache_hit_rate``); 0 before any."""
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0


@dataclass(eq=False)
class _Request:
    """A request in flight; ``future`` resolves once all of its samples have finished."""

    request: GenerationRequest
    future: asyncio.Future[list[Trajectory]]
    stop_tokens: frozenset[int]
    stop_strings: StopStrings | None
    cache_length: int  # positions one sample occupies at most: prompt + max_tokens - 1
    samples: list[_Sample] = field(default_factory=list)
    unfinished: int = 0
    prompt_slot: int | None = None  # prompt row of the KV cache while prefilling or holding
    prefilled: int = 0  # prompt tokens already in the prompt slot
    admitted: int = 0  # samples started so far
    weights_version: int = 0  # the engine's weights when this request's keys and values started
    digests: list[bytes] | None = None  # prefix-cache names of the prefilled part's whole blocks

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def prefix_length(self) -> int:
        """Prompt tokens prefilled once for all samples: all but the last, which each sample feeds."""
        return len(self.request.prompt_ids) - 1

    @property
    def label(self) -> str:
        return repr(self.request.request_id) if self.request.request_id else "(no request_id)"


@dataclass(eq=False)
class _Sample:
    """Sample ``index`` of ``owner``: one sequence being generated."""

    owner: _Request
    index: int
    key: int  # 64-bit sampling key (sampling.derive_sample_seed)
    max_tokens: int  # params.max_tokens, capped so prompt + response fits the model's context
    profile: RowProfile
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_versions: list[int] = field(default_factory=list)  # policy version of each response token
    kv_version: int = -1  # the engine's weights when this row's keys and values were computed (-1: none yet)

    @property
    def position(self) -> int:
        """Cache position of the token this sample feeds next."""
        return len(self.owner.request.prompt_ids) - 1 + len(self.response_ids)

    def to_trajectory(self) -> Trajectory:
        return Trajectory(
            prompt_ids=list(self.owner.request.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=[1] * len(self.response_ids),
            rollout_logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "abort",
            top_logprobs=self.top_logprobs,
            stop_reason=self.stop_reason,
            token_versions=list(self.token_versions),
        )


@dataclass(frozen=True)
class _Chunk:
    """Prompt tokens ``[start, end)`` of ``request`` prefilled into its prompt slot this step."""

    request: _Request
    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class _Restore:
    """Prefix-cache blocks copied into a prompt slot before this step's prefill (they are held
    here, so an eviction between planning and executing cannot take them away)."""

    slot: int
    blocks: list[CachedBlock]


@dataclass(frozen=True)
class _Save:
    """Keys and values of ``tokens`` at positions ``[0, len(tokens))`` of cache row ``row``, to keep
    in the prefix cache if the weights are still those of ``weights_version``."""

    row: int
    tokens: list[int]
    weights_version: int


@dataclass
class _Plan:
    """What one step does, decided on the event-loop thread; tensors are touched only in ``_execute``."""

    capacity: int  # cache positions per row needed after this step's admissions
    moves: list[tuple[int, int]]  # (source, destination) decode rows, applied first
    restores: list[_Restore]  # prefix-cache hits, written into prompt slots before the prefill
    chunks: list[_Chunk]
    admits: list[tuple[_Sample, int, int | None]]  # (sample, decode row, prompt slot or None)
    batch_size: int  # decode rows [0, batch_size) run this step
    key_length: int  # positions the decode step attends over
    top_logprobs: int  # the most top-k logprobs any row asked for (0: none)


@dataclass(frozen=True)
class _StepResult:
    """What one step produced, as Python lists (one device sync per step)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None
    top_values: list[list[float]] | None
    policy_version: int = 0  # the weights' version the step's tokens were sampled under
    recomputed_tokens: int = 0  # tokens re-prefilled because their keys and values were stale


class _RowState:
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

    def admit(self, samples: list[_Sample], rows: list[int]) -> None:
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


class NativeEngine:
    """Continuous-batching generation for one HF model of a supported family (see the module docstring).

    The engine takes ownership of ``model``: it is moved to ``device``, its parameters are cast to
    ``dtype`` (buffers such as RoPE frequencies keep their precision), and its q/k/v and gate/up
    weights become views of fused tensors that the engine's compact forward uses
    (``compact.CompactCausalLM``); the HF model keeps working and shares every weight.
    ``eos_token_ids`` end every request (unless ``ignore_eos``) in addition to its own
    ``stop_token_ids``. ``max_model_len`` (default: the config's ``max_position_embeddings``) caps
    prompt + response; a response that reaches it finishes with ``"length"``. ``tokenizer`` is
    needed only for stop strings. ``logits_processors`` adjust the logits tokens are drawn from.
    ``decode_mode`` is one of ``DECODE_MODES`` (None: CUDA graphs on a GPU, eager elsewhere).
    ``weight_layout`` is how the matmul weights are laid out (``compact.WEIGHT_LAYOUTS``; ``auto``
    packs a copy for oneDNN on CPUs where that was measured faster, see ``compact``).
    ``compact_factory(model, max_model_len)`` and ``cache_factory(**SlotKVCache arguments)`` build
    the forward and the KV cache; the defaults are the single-device ones, and
    ``tensor_parallel.build_tp_engine`` passes sharded ones that mirror every forward and cache
    change to the other ranks of a tensor-parallel replica.
    ``enable_prefix_caching`` keeps the keys and values of finished prompts and samples
    (``prefix_cache``) so that a request opening with an already computed prefix (the next turn
    of an agent episode, a shared system prompt) prefills only the rest; the cache takes what
    ``kv_cache_memory_bytes`` leaves beside the slot cache and is cleared by every weight update.
    ``recompute_stale_kv`` recomputes the keys and values of samples in flight under new weights
    (exact per-version logprobs; see "partial rollout" in the module docstring); False keeps them.
    ``max_prefill_tokens`` is a step's budget of prompt tokens (``rollout.max_num_batched_tokens``);
    ``enable_chunked_prefill=False`` never splits a prompt over steps (vLLM's meaning); a prompt
    with more tokens to prefill than the whole budget is prefilled alone in a step of its own
    (SGLang's rule; hybridflow's vLLM adapter raises vLLM's budget to the context for the same).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_batch_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        seed: int = 0,
        max_model_len: int | None = None,
        tokenizer: Any = None,
        kv_cache_memory_bytes: int | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        max_prefill_prompts: int = DEFAULT_MAX_PREFILL_PROMPTS,
        logits_processors: Sequence[LogitsProcessor] = (),
        decode_mode: str | None = None,
        weight_layout: str = "auto",
        compact_factory: CompactFactory = CompactCausalLM.from_hf,
        cache_factory: Callable[..., SlotKVCache] = SlotKVCache,
        enable_prefix_caching: bool = True,
        recompute_stale_kv: bool = True,
        enable_chunked_prefill: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"NativeEngine: max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1 or max_prefill_prompts < 1:
            raise ValueError("NativeEngine: max_prefill_tokens and max_prefill_prompts must be >= 1")
        self._device = torch.device(device)
        self._dtype = resolve_dtype(dtype)
        model.to(device=self._device)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
            data = parameter.data.to(dtype=self._dtype)
            # sleep(level=2) frees weights by resizing their storage in place, which memory-mapped
            # checkpoint tensors (from_pretrained on a CPU) do not allow: the engine copies those.
            parameter.data = data if data.untyped_storage().resizable() else data.clone()
        self._model = model.eval()
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        for name, token in [("pad_token_id", pad_token_id)] + [("eos_token_ids", t) for t in eos_token_ids]:
            if not 0 <= token < self._vocab_size:
                raise ValueError(f"NativeEngine: {name} {token} is outside the vocabulary [0, {self._vocab_size})")
        if max_model_len is None:
            max_model_len = int(getattr(model.config, "max_position_embeddings"))
        self._max_model_len = max_model_len
        self._compact = compact_factory(model, max_model_len)
        self._compact.set_weight_layout(weight_layout, batch_hint=max_batch_size)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._pad_token_id = pad_token_id
        self._max_batch_size = max_batch_size
        self._tokenizer = tokenizer
        self._max_prefill_tokens = max_prefill_tokens
        self._chunked_prefill = enable_chunked_prefill
        self._logits_processors = tuple(logits_processors)
        self._generator = torch.Generator()
        self._generator.manual_seed(seed)
        shape = self._compact.shape
        self._cache = cache_factory(
            num_layers=self._compact.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=self._dtype,
            device=self._device,
            max_decode_rows=max_batch_size,
            prompt_rows=max_prefill_prompts,
            memory_budget_bytes=kv_cache_memory_bytes or default_kv_cache_bytes(self._device),
            max_capacity=max_model_len,
        )
        self._state = _RowState(max_batch_size, self._vocab_size, self._device)
        self._static_decoder = self._build_static_decoder(decode_mode)
        self._prefix_cache = PrefixCache() if enable_prefix_caching else None
        self._pending_saves: list[_Save] = []  # rows finished in the step being applied
        # Bumped by every weight update: keys and values computed under another version are stale.
        # Internal and always increasing, unlike the policy version a caller may set (and repeat).
        self._weights_version = 0
        self._policy_version = 0  # what Trajectory.token_versions records (update_weights' version)
        self._recompute_stale_kv = recompute_stale_kv
        # Set by sleep(level=2): the weights' storage is freed until a full weight update.
        self._dropped_weights: list[tuple[torch.UntypedStorage, int]] | None = None

        self._waiting: deque[_Request] = deque()  # not yet prefilling
        self._prefilling: list[_Request] = []  # holding a prompt slot, prefill incomplete
        self._ready: deque[_Request] = deque()  # prefilled, some samples not yet started
        self._rows: list[_Sample | None] = []  # decode row -> sample (None: a hole this step fills)
        self._free_slots = list(range(max_prefill_prompts - 1, -1, -1))
        self._scheduler_task: asyncio.Task[None] | None = None
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        # Held by every step and by update_weights: weights never change mid-step.
        self._model_lock = threading.Lock()
        self._asleep = False
        self._token_listeners: dict[str, TokenListener] = {}
        self.stats = EngineStats()

    def _build_static_decoder(self, decode_mode: str | None) -> StaticDecoder | None:
        if decode_mode is None:
            capture = self._device.type == "cuda" and self._compact.capturable
            decode_mode = "cuda_graph" if capture else "eager"
        if decode_mode == "cuda_graph" and not self._compact.capturable:
            raise ValueError("NativeEngine: decode_mode='cuda_graph' cannot record a mixture-of-experts model "
                             "(its routing has data-dependent shapes); use decode_mode='eager'")
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"NativeEngine: decode_mode must be one of {', '.join(DECODE_MODES)}, got {decode_mode!r}")
        if decode_mode == "cuda_graph" and self._device.type != "cuda":
            raise ValueError(f"NativeEngine: decode_mode='cuda_graph' needs a CUDA device, not {self._device}")
        self.decode_mode = decode_mode
        if decode_mode == "eager":
            return None
        return StaticDecoder(self._compact, self._cache, max_rows=self._max_batch_size,
                             pad_token_id=self._pad_token_id, capture=decode_mode == "cuda_graph")

    # ------------------------------------------------------------------ public API

    @property
    def model(self) -> torch.nn.Module:
        """The HF model whose weights the engine serves (shared, not copied)."""
        return self._model

    @property
    def policy_version(self) -> int:
        """The version of the weights now served: the last update's ``version`` (0 before any)."""
        return self._policy_version

    @property
    def max_model_len(self) -> int:
        """Longest prompt + response a request may reach."""
        return self._max_model_len

    def add_token_listener(self, request_id: str, listener: TokenListener) -> None:
        """Report every token generated for ``request_id`` to ``listener`` as it is sampled
        (streaming). Listeners run on the event-loop thread inside a scheduler step: they must be
        quick and never block (``asyncio.Queue.put_nowait`` is the intended use)."""
        if not request_id:
            raise ValueError("NativeEngine: a listened request needs a non-empty request_id")
        if request_id in self._token_listeners:
            raise ValueError(f"NativeEngine: request {request_id!r} already has a token listener")
        self._token_listeners[request_id] = listener

    def remove_token_listener(self, request_id: str) -> None:
        self._token_listeners.pop(request_id, None)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 while asleep or before the first request)."""
        return self._cache.nbytes

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes the prefix cache holds now (within ``kv_cache_memory_bytes`` with the slot cache)."""
        return self._prefix_cache.nbytes if self._prefix_cache is not None else 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight storage the engine holds: parameters (fused) and any packed copy; 0
        after ``sleep(level=2)``."""
        packed = sum(t.numel() * t.element_size() for t in self._compact.packed_tensors())
        return sum(nbytes for _, nbytes in self._weight_storages()) + packed

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        """The ``request.params.n`` samples of one prompt, batched with concurrent requests."""
        loop = asyncio.get_running_loop()
        self._check_accepting(loop)
        owner = self._make_request(request, loop.create_future())
        # A one-token prompt has nothing to prefill: its samples start from the prompt token alone.
        (self._ready if owner.prefix_length == 0 else self._waiting).append(owner)
        if self._scheduler_task is None or self._scheduler_task.done():
            self._scheduler_loop = loop
            self._scheduler_task = loop.create_task(self._serve(), name="NativeEngine.scheduler")
        return await owner.future

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        """Serve ``requests`` concurrently from synchronous code; results in request order.

        Runs a private event loop (``asyncio.run``) that is closed, with its worker threads, before
        returning. Called from code that is itself inside a running event loop (a notebook, an
        async worker calling sync helpers), it runs that private loop in a short-lived thread,
        because the caller's loop is blocked for the duration of this call anyway.
        """
        return serve_batch(self.generate, requests, self._check_request)

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        version: int | None = None,
    ) -> None:
        """Copy ``(name, tensor)`` pairs into the model by Hugging Face parameter name.

        Names are those of ``model.state_dict()`` (tied aliases such as ``lm_head.weight`` are
        accepted). Pairs are applied in buckets of at most ``max_bucket_bytes`` (``weights``):
        each bucket is checked whole, then cast to the engine's dtype and device and copied. The
        lock is held across all buckets, so no step sees half-updated weights. On an error the
        earlier buckets have already been applied: resend them all. ``version`` is the policy
        version tokens generated from now on record (default: the current one + 1).
        """
        with self.weight_update(version=version) as apply:
            for bucket in iter_buckets(weights, max_bucket_bytes):
                apply(bucket)

    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[Callable[[list[tuple[str, torch.Tensor]]], None]]:
        """Hold the engine between two steps for a whole update that arrives in parts.

        Yields ``apply(bucket)``, which checks one bucket of ``(name, tensor)`` pairs against the
        model and copies it in (cast to the engine's dtype and device). No step runs until the
        block exits, so a cross-process sync (``weight_transfer.receive_weights(group, targets,
        apply)``) is seen whole by every request, even while others are being served. Tokens
        generated after it record policy version ``version`` (default: the current one + 1);
        samples in flight continue (partial rollout, see the module docstring).
        """
        targets = self._model.state_dict(keep_vars=True)
        covered: set[int] = set()  # ids of the parameters written, for a restore after sleep(level=2)

        def apply(bucket: list[tuple[str, torch.Tensor]]) -> None:
            check_bucket(bucket, targets)
            copy_bucket(bucket, targets)
            covered.update(id(targets[name]) for name, _ in bucket)

        with self._model_lock, torch.no_grad():
            # Keys and values computed with the old weights must never serve a new request (nor,
            # with recompute_stale_kv, the next token of one in flight).
            self._weights_version += 1
            self._policy_version = self._policy_version + 1 if version is None else int(version)
            self.stats.weight_updates += 1
            self._clear_prefix_cache()
            restoring = self._dropped_weights is not None
            if restoring:
                self._restore_weight_storage()
            try:
                yield apply
                if restoring:
                    self._check_restored(covered)
            except BaseException:
                if restoring:
                    self._drop_weight_storage()
                raise
            finally:
                # The fused tensors changed through the HF parameters (their views); a packed copy
                # of them must follow before the next step (also after a failed update, which
                # may have applied some buckets).
                if self._dropped_weights is None:
                    self._compact.repack()

    def sleep(self, level: int = 1) -> None:
        """Release generation memory; ``generate`` refuses requests until ``wake_up``.

        Level 1 frees the KV cache and the prefix cache; the weights stay resident (a colocated
        trainer typically owns and updates them in place). Level 2 also frees the weights' storage
        (fused, packed and HF parameters keep their shapes, with no memory behind them): the next
        weight update must then cover every parameter, and generating before one raises. Requires
        an idle engine. On CUDA the allocator's cached blocks are returned to the device.
        """
        if level not in (1, 2):
            raise ValueError(f"NativeEngine.sleep(): level must be 1 or 2, got {level!r}")
        in_flight = self._count_in_flight()
        if in_flight:
            raise RuntimeError(
                f"NativeEngine.sleep(): {in_flight} samples are still being generated; "
                "await their requests before sleeping"
            )
        with self._model_lock:
            self._asleep = True
            self._cache.release()
            self._clear_prefix_cache()
            if self._static_decoder is not None:
                self._static_decoder.reset()  # the graphs read the released cache and hold pool memory
            self._state.seen = None
            if level == 2 and self._dropped_weights is None:
                self._drop_weight_storage()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Rebuild the KV cache at its last size and accept requests again (after ``sleep(level=2)``
        the weights come back with the next full weight update, before or after this)."""
        if self._asleep:
            self._cache.rebuild()
        self._asleep = False

    # ------------------------------------------------------------------ weight storage (sleep level 2)

    def _weight_storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        """Each distinct storage behind the parameters (fused tensors included), with its bytes now.
        The packed copy is opaque to torch (no storage to resize): it is dropped and rebuilt whole."""
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for parameter in self._model.parameters():
            storage = parameter.data.untyped_storage()
            seen.setdefault(storage._cdata, (storage, storage.nbytes()))
        return list(seen.values())

    def _drop_weight_storage(self) -> None:
        """Free every weight's storage in place: views keep their shape, offset and stride, so the
        HF model and the compact forward point at the same tensors once it is re-allocated."""
        self._compact.release_packed()
        storages = self._weight_storages()
        for storage, _ in storages:
            if not storage.resizable():
                raise RuntimeError(
                    "NativeEngine.sleep(level=2): a weight lives in storage that cannot be freed in place "
                    "(memory-mapped or borrowed from another library); use sleep(level=1)"
                )
        for storage, _ in storages:
            storage.resize_(0)
        self._dropped_weights = storages

    def _restore_weight_storage(self) -> None:
        assert self._dropped_weights is not None
        for storage, nbytes in self._dropped_weights:
            storage.resize_(nbytes)
        # Zeros rather than whatever the allocator hands back, so a parameter that a failed update
        # missed can never read as plausible weights.
        for parameter in self._model.parameters():
            parameter.data.zero_()
        self._dropped_weights = None

    def _check_restored(self, covered: set[int]) -> None:
        """After ``sleep(level=2)`` a weight update must bring back every parameter."""
        names = {id(parameter): name for name, parameter in self._model.named_parameters()}
        missing = [name for key, name in names.items() if key not in covered]
        if missing:
            shown = ", ".join(repr(n) for n in sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
            raise RuntimeError(
                f"NativeEngine: the weights were dropped by sleep(level=2) and this update left {len(missing)} "
                f"parameters unset ({shown}); send every parameter (model.state_dict()) with update_weights"
            )

    def _clear_prefix_cache(self) -> None:
        if self._prefix_cache is not None:
            self._prefix_cache.clear()
        self._pending_saves.clear()

    # ------------------------------------------------------------------ intake

    def _check_accepting(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._dropped_weights is not None:
            raise RuntimeError(
                "NativeEngine has no weights: sleep(level=2) dropped them; load every parameter with "
                "update_weights(model.state_dict().items()) (and wake_up()) before generate()"
            )
        if self._asleep:
            raise RuntimeError("NativeEngine is asleep: call wake_up() before generate()")
        task, bound = self._scheduler_task, self._scheduler_loop
        if task is None or task.done() or bound is loop:
            return
        if bound is not None and bound.is_closed():
            # The previous loop died without finishing its scheduler; nobody can await its requests.
            self._drop_everything()
            self._scheduler_task = None
            return
        raise RuntimeError(
            "NativeEngine is serving requests on another event loop; one engine serves one loop "
            "at a time (await generate() on that loop, or wait for it to finish)"
        )

    def _check_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` naming the request when it cannot be served by this engine."""
        refuse_images(request, "native")
        label = repr(request.request_id) if request.request_id else "(no request_id)"
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError(f"request {label}: empty prompt_ids (at least one token is needed)")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self._vocab_size:
            position = next(i for i, t in enumerate(prompt) if not 0 <= t < self._vocab_size)
            raise ValueError(
                f"request {label}: prompt_ids[{position}] = {prompt[position]} is outside the "
                f"vocabulary [0, {self._vocab_size})"
            )
        if len(prompt) >= self._max_model_len:
            raise ValueError(
                f"request {label}: prompt of {len(prompt)} tokens leaves no room to generate within "
                f"the model's context of {self._max_model_len} tokens"
            )
        try:
            check_sampling_params(request.params, self._vocab_size)
        except ValueError as exc:
            raise ValueError(f"request {label}: {exc}") from None
        if request.params.stop and self._tokenizer is None:
            raise ValueError(f"request {label}: stop strings need an engine built with a tokenizer")
        length = len(prompt) + self._max_tokens(request) - 1
        if not self._cache.fits_alone(length):
            raise ValueError(
                f"request {label}: one sequence of {length} positions does not fit the KV cache budget of "
                f"{self._cache.memory_budget_bytes} bytes (kv_cache_memory_bytes)"
            )

    def _max_tokens(self, request: GenerationRequest) -> int:
        return min(request.params.max_tokens, self._max_model_len - len(request.prompt_ids))

    def _make_request(self, request: GenerationRequest, future: asyncio.Future[list[Trajectory]]) -> _Request:
        self._check_request(request)
        params = request.params
        max_tokens = self._max_tokens(request)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_token_ids))
        owner = _Request(
            request=request,
            future=future,
            stop_tokens=frozenset(stops),
            stop_strings=StopStrings(self._tokenizer, params.stop) if params.stop else None,
            cache_length=len(request.prompt_ids) + max_tokens - 1,
            unfinished=params.n,
            weights_version=self._weights_version,
        )
        # Unseeded requests draw a seed from the engine's generator: reproducible given the engine
        # seed and the order requests arrive in, and the same per-sample streams as seeded ones.
        seed = params.seed if params.seed is not None else self._draw_seed()
        profile = row_profile(params)
        for index in range(params.n):
            sample = _Sample(
                owner=owner, index=index, key=derive_sample_seed(seed, index), max_tokens=max_tokens, profile=profile
            )
            if params.logprobs is not None:
                sample.top_logprobs = []
            owner.samples.append(sample)
        return owner

    def _draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._generator))

    def _count_in_flight(self) -> int:
        queued = self._waiting, self._prefilling, self._ready
        pending = sum(r.request.params.n - r.admitted for group in queued for r in group if not r.future.done())
        return pending + sum(1 for s in self._rows if s is not None and not s.owner.future.done())

    # ------------------------------------------------------------------ scheduling (event-loop thread)

    async def _serve(self) -> None:
        """Run steps until nothing is queued or running, then exit (``generate`` restarts it)."""
        try:
            # Let requests submitted in the same tick (asyncio.gather) join the first step.
            await asyncio.sleep(0)
            while (plan := self._plan()) is not None:
                try:
                    result = await asyncio.to_thread(self._execute, plan)
                except Exception as exc:  # a model or sampling error fails what was in flight
                    self._fail_in_flight(exc)
                    continue
                self._apply(plan, result)
        except BaseException as exc:  # cancelled with the loop: nobody will serve what is queued
            failure = RuntimeError("NativeEngine scheduler stopped before these requests finished")
            failure.__cause__ = exc
            self._fail_requests(self._all_requests(), failure)
            self._drop_everything()
            raise

    def _plan(self) -> _Plan | None:
        """Decide the next step: free finished rows, schedule prefill chunks, admit samples."""
        self._drop_abandoned()
        live = sum(1 for s in self._rows if s is not None)
        if not (self._waiting or self._prefilling or self._ready or live):
            return None
        budget = self._max_prefill_tokens
        chunks, budget = self._continue_prefills(budget)
        started, restores = self._start_prefills(budget, live)
        chunks += started
        capacity = self._needed_capacity()
        admits: list[tuple[_Sample, int | None]] = []  # (sample, prompt slot to copy from)
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
        live_rows = [s for s in self._rows if s is not None]
        return _Plan(
            capacity=capacity,
            moves=moves,
            restores=restores,
            chunks=chunks,
            admits=placed,
            batch_size=len(self._rows),
            key_length=max((s.position for s in live_rows), default=-1) + 1,
            top_logprobs=max((s.owner.request.params.logprobs or 0 for s in live_rows), default=0),
        )

    def _needed_capacity(self) -> int:
        """Cache positions per row for every request started so far (they all hold or will need rows)."""
        started = [s.owner for s in self._rows if s is not None] + [*self._prefilling, *self._ready]
        return max([self._cache.capacity, 1] + [r.cache_length for r in started])

    def _free_rows(self, capacity: int, live: int) -> int:
        """Decode rows still free once rows hold ``capacity`` positions and ``live`` are taken."""
        rows = self._cache.rows_that_fit(self._cache.aligned(max(capacity, self._cache.capacity)))
        return max(0, rows - live)

    def _continue_prefills(self, budget: int) -> tuple[list[_Chunk], int]:
        """The next chunk of every prompt already prefilling, oldest first, within ``budget`` tokens."""
        chunks = []
        for request in self._prefilling:
            if budget <= 0:
                break
            end = min(request.prefix_length, request.prefilled + budget)
            assert request.prompt_slot is not None
            chunks.append(_Chunk(request, request.prompt_slot, request.prefilled, end))
            budget -= end - request.prefilled
            request.prefilled = end
        return chunks, budget

    def _start_prefills(self, budget: int, live: int) -> tuple[list[_Chunk], list[_Restore]]:
        """Start prefilling waiting prompts while their samples would find free rows.

        Demand-driven: prompts already prefilled or prefilling have first claim on the free rows,
        and a new prompt starts only when rows would otherwise stay empty, or when nothing at all is
        running (so the engine always makes progress). A prompt's longest cached prefix is copied
        into its slot (a restore) and only the tokens after it are prefilled.
        """
        claimed = sum(r.request.params.n - r.admitted for r in (*self._ready, *self._prefilling))
        chunks: list[_Chunk] = []
        restores: list[_Restore] = []
        producing = self._blocks_in_prefill()
        deferred: list[_Request] = []
        while self._waiting and budget > 0 and self._free_slots:
            request = self._waiting[0]
            free = self._free_rows(max(self._needed_capacity(), request.cache_length), live)
            if claimed >= free and (claimed or live):
                break
            whole = self._uncached_length(request)
            if not self._chunked_prefill and whole > budget and not (
                whole > self._max_prefill_tokens and budget == self._max_prefill_tokens
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
            request.weights_version = self._weights_version
            blocks = self._lookup(request)
            if blocks:
                restores.append(_Restore(request.prompt_slot, blocks))
            start = len(blocks) * self._prefix_cache.block_size if self._prefix_cache is not None else 0
            end = min(request.prefix_length, start + budget) if self._chunked_prefill else request.prefix_length
            if end > start:
                chunks.append(_Chunk(request, request.prompt_slot, start, end))
            budget -= end - start
            request.prefilled = end
            self._prefilling.append(request)
            claimed += request.request.params.n
        self._waiting.extendleft(reversed(deferred))
        return chunks, restores

    def _uncached_length(self, request: _Request) -> int:
        """Prompt tokens ``request`` would prefill if it started now (its cached prefix is copied)."""
        if self._prefix_cache is None:
            return request.prefix_length
        cached = self._prefix_cache.cached_count(self._prefix_digests(request)) * self._prefix_cache.block_size
        return request.prefix_length - min(cached, request.prefix_length)

    def _prefix_digests(self, request: _Request) -> list[bytes]:
        """The prefix-cache names of ``request``'s prefilled part (none with the cache off)."""
        if self._prefix_cache is None:
            return []
        if request.digests is None:
            request.digests = block_digests(request.prompt[: request.prefix_length], self._prefix_cache.block_size)
        return request.digests

    def _blocks_in_prefill(self) -> set[bytes]:
        """Blocks that prompts now prefilling will add to the prefix cache when they complete."""
        return {d for r in self._prefilling for d in self._prefix_digests(r)}

    def _next_block_in_prefill(self, request: _Request, producing: set[bytes]) -> bool:
        """Whether the first block of ``request`` that is not cached is being prefilled by another
        prompt (progress is certain: that prompt keeps prefilling until it completes or fails)."""
        if self._prefix_cache is None or not producing:
            return False
        digests = self._prefix_digests(request)
        cached = self._prefix_cache.cached_count(digests)
        return cached < len(digests) and digests[cached] in producing

    def _lookup(self, request: _Request) -> list[CachedBlock]:
        """The cached blocks of ``request``'s prefilled part (``prefix_length`` tokens), counted."""
        if self._prefix_cache is None:
            return []
        blocks = self._prefix_cache.match_digests(self._prefix_digests(request))
        self.stats.prefix_cache_queries += 1
        self.stats.prefix_cache_query_tokens += request.prefix_length
        self.stats.prefix_cache_hit_tokens += len(blocks) * self._prefix_cache.block_size
        return blocks

    def _settle_queues(self) -> None:
        """Move fully prefilled prompts to ``_ready`` and fully started ones out, freeing their slots."""
        for request in [r for r in self._prefilling if r.prefilled == r.prefix_length]:
            self._prefilling.remove(request)
            self._ready.append(request)
        for request in [r for r in self._ready if r.admitted == r.request.params.n]:
            self._ready.remove(request)
            self._release_slot(request)

    def _release_slot(self, request: _Request) -> None:
        if request.prompt_slot is not None:
            self._free_slots.append(request.prompt_slot)
            request.prompt_slot = None

    def _place_rows(
        self, admits: list[tuple[_Sample, int | None]]
    ) -> tuple[list[tuple[int, int]], list[tuple[_Sample, int, int | None]]]:
        """Give new samples the holes first, then pack the remaining holes with the last live rows.

        Returns the row moves (source, destination) and each new sample's row. Sources are never
        rows a new sample takes: samples are appended only once no hole is left to pack.
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
            placed.append((sample, row, slot))
        moves = []
        while holes:
            while rows and rows[-1] is None:
                rows.pop()
            holes = [h for h in holes if h < len(rows)]
            if not holes:
                break
            hole = holes.pop(0)
            moves.append((len(rows) - 1, hole))
            rows[hole] = rows.pop()
        return moves, placed

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

    def _all_requests(self) -> set[_Request]:
        owners = {s.owner for s in self._rows if s is not None}
        return owners | set(self._waiting) | set(self._prefilling) | set(self._ready)

    def _drop_everything(self) -> None:
        self._pending_saves.clear()
        for request in (*self._prefilling, *self._ready):
            self._release_slot(request)
        self._waiting.clear()
        self._prefilling.clear()
        self._ready.clear()
        self._rows = []

    def _fail_in_flight(self, exc: Exception) -> None:
        """A step raised: fail every request that had started, clear the cache, keep the queue."""
        failure = RuntimeError(f"NativeEngine: generation failed: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        started = {s.owner for s in self._rows if s is not None} | set(self._prefilling) | set(self._ready)
        self._fail_requests(started, failure)
        for request in (*self._prefilling, *self._ready):
            self._release_slot(request)
        self._prefilling.clear()
        self._ready.clear()
        self._rows = []
        # Reallocated zeroed on the next step. Stale values past a row's length get attention weight
        # 0, but 0 x NaN is NaN: after non-finite logits no cached value can be trusted.
        self._cache.release()
        self._clear_prefix_cache()

    @staticmethod
    def _fail_requests(owners: Iterable[_Request], failure: BaseException) -> None:
        for owner in owners:
            if not owner.future.done():
                owner.future.set_exception(failure)

    def _apply(self, plan: _Plan, result: _StepResult) -> None:
        """Append each row's token; finish rows and resolve requests."""
        self.stats.steps += 1
        self.stats.forward_passes += (1 if plan.chunks else 0) + (1 if plan.batch_size else 0)
        self.stats.prefill_forwards += 1 if plan.chunks else 0
        self.stats.prefill_tokens += sum(c.end - c.start for c in plan.chunks)
        self.stats.admitted_samples += len(plan.admits)
        if plan.batch_size > len(plan.admits):
            self.stats.admitted_while_decoding += len(plan.admits)
        self.stats.row_moves += len(plan.moves)
        self.stats.recomputed_tokens += result.recomputed_tokens
        self.stats.max_running = max(self.stats.max_running, plan.batch_size)
        for row in range(plan.batch_size):
            sample = self._rows[row]
            if sample is None or sample.owner.future.done():
                continue
            self._append(sample, row, result)
            if sample.finish_reason is not None:
                self._rows[row] = None
                self._keep_finished(sample, row)
                owner = sample.owner
                owner.unfinished -= 1
                if owner.unfinished == 0:
                    owner.future.set_result([s.to_trajectory() for s in owner.samples])
        if self._pending_saves:
            # Now, before the next plan looks anything up: the next turn of an episode that just
            # finished arrives next and should find this turn's keys and values.
            self._save_finished()

    def _keep_finished(self, sample: _Sample, row: int) -> None:
        """Queue a finished sample's row for the prefix cache (saved at the end of ``_apply``):
        prompt + response, the last token excepted, whose keys and values would come only from
        feeding it back."""
        if self._prefix_cache is None:
            return
        tokens = sample.owner.prompt + sample.response_ids[:-1]
        if len(tokens) >= self._prefix_cache.block_size:
            self._pending_saves.append(_Save(row, tokens, sample.kv_version))

    def _append(self, sample: _Sample, row: int, result: _StepResult) -> None:
        token = result.tokens[row]
        sample.response_ids.append(token)
        sample.logprobs.append(result.logprobs[row])
        sample.token_versions.append(result.policy_version)
        self.stats.generated_tokens += 1
        if sample.top_logprobs is not None and result.top_ids is not None and result.top_values is not None:
            k = sample.owner.request.params.logprobs or 0
            top = dict(zip(result.top_ids[row][:k], result.top_values[row][:k], strict=True))
            top.setdefault(token, result.logprobs[row])
            sample.top_logprobs.append(top)
        owner = sample.owner
        if token in owner.stop_tokens:
            sample.finish_reason, sample.stop_reason = "stop", token
        elif owner.stop_strings is not None and (matched := owner.stop_strings.match(sample.response_ids)):
            sample.finish_reason, sample.stop_reason = "stop", matched
        elif len(sample.response_ids) >= sample.max_tokens:
            sample.finish_reason = "length"
        if self._token_listeners:
            self._notify(sample)

    def _notify(self, sample: _Sample) -> None:
        request_id = sample.owner.request.request_id
        listener = self._token_listeners.get(request_id)
        if listener is None:
            return
        event = TokenEvent(
            request_id=request_id, sample_index=sample.index, token_id=sample.response_ids[-1],
            logprob=sample.logprobs[-1], top_logprobs=sample.top_logprobs[-1] if sample.top_logprobs else None,
            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
            policy_version=sample.token_versions[-1],
        )
        try:
            listener(event)
        except Exception:  # a broken listener must not stop the scheduler serving everyone else
            logger.exception("token listener for request %r failed; it is removed", request_id)
            self.remove_token_listener(request_id)

    # ------------------------------------------------------------------ model work (worker thread)

    def _execute(self, plan: _Plan) -> _StepResult:
        with self._model_lock, torch.inference_mode():
            cache = self._cache
            if plan.moves:
                sources, destinations = (list(side) for side in zip(*plan.moves, strict=True))
                cache.move_rows(destinations, sources, plan.key_length)
                self._state.move(sources, destinations)
            if self._prefix_cache is not None:
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
                # Checked here, under the lock: an update may have landed after _plan.
                chunks, recomputed = self._refresh_stale_prompts(plan.chunks, plan.admits)
            if chunks:
                self._prefill(chunks)
                if self._prefix_cache is not None:
                    self._save_rows([
                        _Save(cache.prompt_row(c.slot), c.request.prompt[: c.end], c.request.weights_version)
                        for c in chunks if c.end == c.request.prefix_length
                    ])
            if plan.admits:
                self._admit(plan.admits)
            if self._recompute_stale_kv and plan.batch_size:
                recomputed += self._recompute_stale_rows(plan.batch_size)
            if plan.batch_size == 0:
                return _StepResult(tokens=[], logprobs=[], top_ids=None, top_values=None, recomputed_tokens=recomputed)
            return replace(self._decode(plan), recomputed_tokens=recomputed)

    def _refresh_stale_prompts(
        self, chunks: list[_Chunk], admits: list[tuple[_Sample, int, int | None]]
    ) -> tuple[list[_Chunk], int]:
        """Partial rollout, prompt slots: the chunks to prefill so that no slot this step extends or
        copies holds keys and values of replaced weights, and the tokens that costs beyond the plan.

        A chunk that continues a prompt prefilled (or restored from the prefix cache) under older
        weights starts again from position 0; a prefilled prompt whose samples start now is
        prefilled again whole before they copy it (once for all of them).
        """
        current = self._weights_version
        refreshed: list[_Chunk] = []
        recomputed = 0
        covered: set[_Request] = set()
        for chunk in chunks:
            request = chunk.request
            covered.add(request)
            if request.weights_version != current and chunk.start > 0:
                recomputed += chunk.start
                chunk = _Chunk(request, chunk.slot, 0, chunk.end)
            request.weights_version = current
            refreshed.append(chunk)
        for sample, _, slot in admits:
            request = sample.owner
            if slot is None or request in covered or request.weights_version == current:
                continue
            covered.add(request)
            refreshed.append(_Chunk(request, slot, 0, request.prefix_length))
            recomputed += request.prefix_length
            request.weights_version = current
        return refreshed, recomputed

    def _recompute_stale_rows(self, batch: int) -> int:
        """Partial rollout, running rows: re-prefill each row whose keys and values were computed
        under replaced weights (its prompt and the response so far, all but the token it feeds
        next) under the current ones, so its next token's logprob is exact. Returns the tokens."""
        current, base = self._weights_version, self._cache.decode_rows
        parts: list[tuple[int, Sequence[int], int, int]] = []
        for row in range(batch):
            sample = self._rows[row]
            if sample is None or sample.kv_version == current:
                continue
            # A decode row r is addressed as prompt slot r - decode_rows (see SlotKVCache.prefill_access).
            parts.append((row - base, sample.owner.prompt + sample.response_ids, 0, sample.position))
            sample.kv_version = current
        self._prefill_parts(parts)
        return sum(end - start for _, _, start, end in parts)

    def _save_finished(self) -> None:
        """Keep the rows of samples that finished this step (event-loop thread, between steps).

        Copying a few blocks is short next to a step, so it runs here rather than costing a thread
        hop. The lock is only ever busy now with a weight update in another thread, which makes
        these rows stale anyway: they are dropped rather than waited for.
        """
        saves, self._pending_saves = self._pending_saves, []
        if not self._model_lock.acquire(blocking=False):
            return
        try:
            with torch.inference_mode():
                if self._cache.is_allocated:
                    self._save_rows(saves)
        finally:
            self._model_lock.release()

    def _save_rows(self, saves: list[_Save]) -> None:
        """Copy the full blocks of each row that the prefix cache lacks into it, then trim it to
        what the budget leaves beside the slot cache."""
        cache, prefix_cache = self._cache, self._prefix_cache
        assert prefix_cache is not None
        size = prefix_cache.block_size
        for save in saves:
            if save.weights_version != self._weights_version:
                continue  # computed, at least in part, with weights since replaced
            digests, missing = prefix_cache.missing(save.tokens)
            blocks = {}
            for index in missing:
                keys, values = cache.read_positions(save.row, index * size, (index + 1) * size)
                blocks[index] = CachedBlock(keys, values)
            prefix_cache.insert(digests, blocks)
        self._trim_prefix_cache(cache.nbytes)

    def _trim_prefix_cache(self, slot_cache_bytes: int) -> None:
        assert self._prefix_cache is not None
        limit = self._cache.memory_budget_bytes - slot_cache_bytes
        self.stats.prefix_cache_evicted_blocks += self._prefix_cache.trim(max(0, limit))

    def _prefill(self, chunks: list[_Chunk]) -> None:
        """Prefill prompt chunks into their prompt slots (one forward when they fit the budget,
        as a step's planned chunks do)."""
        self._prefill_parts([(c.slot, c.request.prompt, c.start, c.end) for c in chunks])

    def _prefill_parts(self, parts: list[tuple[int, Sequence[int], int, int]]) -> None:
        """Write keys and values of ``tokens[start:end]`` at those positions of slot ``slot``, for
        each ``(slot, tokens, start, end)``, in forwards of at most ``max_prefill_tokens`` tokens
        (or one token per part, when there are more parts than that). Each forward takes the next
        piece of every unfinished part, so a part's later pieces attend over its earlier ones."""
        parts = [part for part in parts if part[3] > part[2]]
        limit = self._max_prefill_tokens
        while parts:
            if sum(end - start for _, _, start, end in parts) <= limit:
                self._prefill_forward(parts)
                return
            width = max(1, limit // len(parts))
            self._prefill_forward([(slot, tokens, start, min(end, start + width))
                                   for slot, tokens, start, end in parts])
            parts = [(slot, tokens, start + width, end) for slot, tokens, start, end in parts if start + width < end]

    def _prefill_forward(self, parts: list[tuple[int, Sequence[int], int, int]]) -> None:
        """One forward over token ranges ``(slot, tokens, start, end)``, right-padded to the longest."""
        width = max(end - start for _, _, start, end in parts)
        ids = torch.zeros((len(parts), width), dtype=torch.long)
        positions = torch.zeros((len(parts), width), dtype=torch.long)
        flat_index, flat_slots, flat_positions = [], [], []
        for i, (slot, tokens, start, end) in enumerate(parts):
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

        key_length = max(end for _, _, _, end in parts)
        access = self._cache.prefill_access(
            [slot for slot, _, _, _ in parts], tensor(flat_index), tensor(flat_slots), tensor(flat_positions),
            key_length=key_length,
        )
        self._compact.forward(ids.to(device), positions.to(device), access, key_length, with_logits=False)

    def _admit(self, admits: list[tuple[_Sample, int, int | None]]) -> None:
        """Copy each new sample's prompt keys/values into its row and set its row state."""
        copies = [(row, slot) for _, row, slot in admits if slot is not None]
        if copies:
            length = max(s.owner.prefix_length for s, _, _ in admits)
            self._cache.copy_prompts([row for row, _ in copies], [slot for _, slot in copies], length)
        self._state.admit([s for s, _, _ in admits], [row for _, row, _ in admits])
        for sample, _, slot in admits:
            # A one-token prompt has no keys or values to copy: nothing of it can be stale.
            sample.kv_version = sample.owner.weights_version if slot is not None else self._weights_version

    def _decode(self, plan: _Plan) -> _StepResult:
        batch, state = plan.batch_size, self._state
        samples = [s for s in self._rows[:batch] if s is not None]
        assert len(samples) == batch, "decode rows must be packed before a step"
        positions = state.positions[:batch]
        logits: torch.Tensor | None = None
        if self._static_decoder is not None:
            try:
                logits = self._static_decoder.forward(state.last_tokens[:batch], positions, plan.key_length)
            except GraphCaptureError as exc:
                # A model op a graph cannot hold must not end the run: decode eagerly from now on.
                logger.warning("NativeEngine: %s; decoding without CUDA graphs from now on", exc)
                self._static_decoder, self.decode_mode = None, "eager"
        if logits is None:
            access = self._cache.decode_access(batch, positions, plan.key_length)
            logits = self._compact.forward(state.last_tokens[:batch, None], positions[:, None], access, plan.key_length)
        assert logits is not None
        sampling = state.sampling(batch, [s.profile for s in samples])
        adjust = self._adjust(samples, state.counters[:batch]) if self._logits_processors else None
        seen = state.seen[:batch] if state.seen is not None else None
        tokens, logprobs = sample_tokens(logits, sampling, seen=seen, adjust=adjust)
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
        return _StepResult(tokens.tolist(), logprobs.tolist(), top_ids, top_values, policy_version=self._policy_version)

    def _adjust(self, samples: list[_Sample], counters: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        rows = LogitsRows(
            request_ids=[s.owner.request.request_id for s in samples],
            sample_indices=[s.index for s in samples],
            output_lengths=counters,
        )

        def adjust(logits: torch.Tensor) -> torch.Tensor:
            for processor in self._logits_processors:
                logits = processor(logits, rows)
            return logits

        return adjust

