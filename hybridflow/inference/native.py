"""NativeEngine: a request-level, continuously batching rollout engine for the families of ``families``
(Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, Qwen3-MoE, Mixtral).

Works anywhere torch runs (CPU, one GPU) with no inference server, which is what the laptop
default and the tests need. It is small and batch-invariant where the RL loop cares (seeded
samples, logprobs), and fast where a CPU run pays: per-step overhead and long-tailed lengths.

How a request flows
-------------------
``generate()`` validates the request, gives each of its ``n`` samples a random key
(``sampling.derive_sample_seed``), queues it and awaits a future. A scheduler coroutine (started on
demand on the caller's event loop, exiting when there is nothing left) runs *steps*, each in three
parts with one owner each:

1. ``scheduler.Scheduler.plan`` decides the step on the event-loop thread and returns a typed
   ``step.StepPlan``: finished rows leave the decode batch, waiting samples of prefilled prompts take
   the free rows, and new prompts start prefilling (in chunks of at most ``max_prefill_tokens`` per
   step) while free rows would otherwise stay empty;
2. ``runner.ModelRunner.execute`` runs the model in a worker thread: at most one prefill forward
   over prompt chunks, then one decode forward over every running sequence, then sampling;
3. ``NativeEngine`` records the step on the event-loop thread: appends each row's token and
   logprob, finishes rows on a stop token, stop string or ``max_tokens``, resolves a request's
   future once all of its samples are done.

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

Admission control (``scheduler``): a sample starts only in a free decode row; the number of rows is
``max_batch_size`` or what fits ``kv_cache_memory_bytes`` at the current row length, whichever is
smaller (the cache grows its rows on demand to the longest ``prompt + max_tokens`` admitted).

Weights and concurrency: partial rollout
----------------------------------------
``update_weights`` (``weight_store.WeightStore``) and every step take the same lock, so new weights
land between two steps. One engine serves one event loop at a time.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.intake import RequestIntake
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.prefix_cache import PrefixCache
from hybridflow.inference.runner import DECODE_MODES, ModelRunner
from hybridflow.inference.scheduler import Scheduler
from hybridflow.inference.step import (
    EngineRequest,
    EngineSample,
    EngineStats,
    LogitsProcessor,
    LogitsRows,
    StepPlan,
    StepResult,
    TokenEvent,
    TokenListener,
)
from hybridflow.inference.weight_store import ApplyBucket, WeightStore, prepare_weights
from hybridflow.transfer.weights import update_weights_in_buckets
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

# Builds the engine's forward from its HF model (already on the device and dtype) and its context.
CompactFactory = Callable[[torch.nn.Module, int], CompactCausalLM]

__all__ = [
    "DECODE_MODES", "DEFAULT_MAX_PREFILL_PROMPTS", "DEFAULT_MAX_PREFILL_TOKENS", "DTYPES", "KV_CACHE_MEMORY_FRACTION",
    "CompactFactory", "EngineStats", "LogitsProcessor", "LogitsRows", "NativeEngine", "TokenEvent", "TokenListener",
    "default_kv_cache_bytes", "resolve_dtype",
]


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
    ``decode_mode`` is one of ``DECODE_MODES`` (None: CUDA graphs on a GPU, bucketed static shapes on a
    CPU in reduced precision, eager elsewhere; see ``runner.DECODE_MODES``).
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

    The engine owns the requests' futures and the public API; its three parts are the scheduler
    (``_scheduler``: plans a step), the model runner (``_runner``: executes one) and the weight
    store (``_weights``: updates, sleep level 2).
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
        device, dtype = torch.device(device), resolve_dtype(dtype)
        prepare_weights(model, device, dtype)
        model.eval()
        vocab_size = int(model.get_input_embeddings().num_embeddings)
        for name, token in [("pad_token_id", pad_token_id)] + [("eos_token_ids", t) for t in eos_token_ids]:
            if not 0 <= token < vocab_size:
                raise ValueError(f"NativeEngine: {name} {token} is outside the vocabulary [0, {vocab_size})")
        if max_model_len is None:
            max_model_len = int(getattr(model.config, "max_position_embeddings"))
        self._max_model_len = max_model_len
        compact = compact_factory(model, max_model_len)
        compact.set_weight_layout(weight_layout, batch_hint=max_batch_size)
        shape = compact.shape
        cache = cache_factory(
            num_layers=compact.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            device=device,
            max_decode_rows=max_batch_size,
            prompt_rows=max_prefill_prompts,
            memory_budget_bytes=kv_cache_memory_bytes or default_kv_cache_bytes(device),
            max_capacity=max_model_len,
        )
        self._intake = RequestIntake(vocab_size=vocab_size, max_model_len=max_model_len,
                                     eos_token_ids=eos_token_ids, tokenizer=tokenizer, cache=cache, seed=seed)
        self.stats = EngineStats()
        # Held by every step and by every weight update: weights never change mid-step.
        lock = threading.Lock()
        self._weights = WeightStore(model, compact, lock)
        prefix_cache = PrefixCache() if enable_prefix_caching else None
        self._runner = ModelRunner(
            compact=compact, cache=cache, prefix_cache=prefix_cache, weights=self._weights, lock=lock,
            stats=self.stats, device=device, dtype=dtype, vocab_size=vocab_size,
            max_batch_size=max_batch_size, pad_token_id=pad_token_id, max_prefill_tokens=max_prefill_tokens,
            decode_mode=decode_mode, logits_processors=logits_processors, recompute_stale_kv=recompute_stale_kv,
        )
        self._scheduler = Scheduler(
            cache=cache, prefix_cache=prefix_cache, prompt_slots=max_prefill_prompts,
            max_prefill_tokens=max_prefill_tokens, enable_chunked_prefill=enable_chunked_prefill,
            weights_version=lambda: self._weights.version, stats=self.stats,
        )
        self._lock, self._device = lock, device
        self._scheduler_task: asyncio.Task[None] | None = None
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        self._asleep = False
        self._token_listeners: dict[str, TokenListener] = {}

    # ------------------------------------------------------------------ public API

    @property
    def model(self) -> torch.nn.Module:
        """The HF model whose weights the engine serves (shared, not copied)."""
        return self._weights.model

    @property
    def policy_version(self) -> int:
        """The version of the weights now served: the last update's ``version`` (0 before any)."""
        return self._weights.policy_version

    @property
    def max_model_len(self) -> int:
        """Longest prompt + response a request may reach."""
        return self._max_model_len

    @property
    def decode_mode(self) -> str:
        """How decode forwards run now (one of ``DECODE_MODES``; ``eager`` after a graph failed to record)."""
        return self._runner.decode_mode

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
    def kv_cache_memory_bytes(self) -> int:
        """The KV cache budget: ``kv_cache_memory_bytes``, or what the engine derived from the memory
        free when it was built (a run records it, ``controller.token_budgets``)."""
        return self._runner.cache.memory_budget_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 while asleep or before the first request)."""
        return self._runner.cache.nbytes

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes the prefix cache holds now (within ``kv_cache_memory_bytes`` with the slot cache)."""
        prefix_cache = self._runner.prefix_cache
        return prefix_cache.nbytes if prefix_cache is not None else 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight storage the engine holds: parameters (fused) and any packed copy; 0
        after ``sleep(level=2)``."""
        return self._weights.nbytes

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        """The ``request.params.n`` samples of one prompt, batched with concurrent requests."""
        loop = asyncio.get_running_loop()
        self._check_accepting(loop)
        owner = self._intake.make(request, loop.create_future(), self._weights.version)
        self._scheduler.enqueue(owner)
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
        return serve_batch(self.generate, requests, self._intake.check)

    # Copies ``(name, tensor)`` pairs into the model by Hugging Face parameter name, in buckets (``weight_update``).
    update_weights = update_weights_in_buckets

    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[ApplyBucket]:
        """Hold the engine between two steps for a whole update that arrives in parts.

        Yields ``apply(bucket)``, which checks one bucket of ``(name, tensor)`` pairs against the
        model whole and copies it in (cast to the engine's dtype and device); names are those of
        ``model.state_dict()`` (tied aliases such as ``lm_head.weight`` are accepted). No step runs
        until the block exits, so a cross-process sync (``weight_transfer.receive_weights(group, targets,
        apply)``) is seen whole by every request, even while others are being served. Tokens
        generated after it record policy version ``version`` (default: the current one + 1);
        samples in flight continue (partial rollout, see the module docstring).
        """
        with self._weights.update(version, on_replace=self._on_weights_replaced) as apply:
            yield apply

    def _on_weights_replaced(self) -> None:
        self.stats.weight_updates += 1
        # Keys and values computed with the old weights must never serve a new request (nor, with
        # recompute_stale_kv, the next token of one in flight).
        self._runner.clear_prefix_cache()

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
        in_flight = self._scheduler.count_in_flight()
        if in_flight:
            raise RuntimeError(
                f"NativeEngine.sleep(): {in_flight} samples are still being generated; "
                "await their requests before sleeping"
            )
        with self._lock:
            self._asleep = True
            self._runner.release()
            if level == 2 and not self._weights.dropped:
                self._weights.drop()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Rebuild the KV cache at its last size and accept requests again (after ``sleep(level=2)``
        the weights come back with the next full weight update, before or after this)."""
        if self._asleep:
            self._runner.cache.rebuild()
        self._asleep = False

    # ------------------------------------------------------------------ intake

    def _check_accepting(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._weights.dropped:
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

    # ------------------------------------------------------------------ steps (event-loop thread)

    async def _serve(self) -> None:
        """Run steps until nothing is queued or running, then exit (``generate`` restarts it)."""
        try:
            # Let requests submitted in the same tick (asyncio.gather) join the first step.
            await asyncio.sleep(0)
            while (plan := self._scheduler.plan()) is not None:
                try:
                    result = await asyncio.to_thread(self._runner.execute, plan)
                except Exception as exc:  # a model or sampling error fails what was in flight
                    self._fail_in_flight(exc)
                    continue
                self._apply(plan, result)
        except BaseException as exc:  # cancelled with the loop: nobody will serve what is queued
            failure = RuntimeError("NativeEngine scheduler stopped before these requests finished")
            failure.__cause__ = exc
            self._fail_requests(self._scheduler.all_requests(), failure)
            self._drop_everything()
            raise

    def _apply(self, plan: StepPlan, result: StepResult) -> None:
        """Append each row's token; finish rows and resolve requests."""
        self.stats.count_step(plan, result)
        for row, sample in enumerate(plan.decode):
            if sample.owner.future.done():
                continue
            sample.append(row, result)
            self.stats.generated_tokens += 1
            if self._token_listeners:
                self._notify(sample)
            if sample.finish_reason is not None:
                self._scheduler.free_row(row)
                self._runner.keep_finished(sample, row)
                owner = sample.owner
                owner.unfinished -= 1
                if owner.unfinished == 0:
                    owner.future.set_result([s.to_trajectory() for s in owner.samples])
        # Now, before the next plan looks anything up: the next turn of an episode that just
        # finished arrives next and should find this turn's keys and values.
        self._runner.save_finished()

    def _notify(self, sample: EngineSample) -> None:
        request_id = sample.owner.request.request_id
        listener = self._token_listeners.get(request_id)
        if listener is None:
            return
        try:
            listener(sample.last_event())
        except Exception:  # a broken listener must not stop the scheduler serving everyone else
            logger.exception("token listener for request %r failed; it is removed", request_id)
            self.remove_token_listener(request_id)

    def _drop_everything(self) -> None:
        self._runner.drop_pending_saves()
        self._scheduler.drop_everything()

    def _fail_in_flight(self, exc: Exception) -> None:
        """A step raised: fail every request that had started, clear the cache, keep the queue."""
        failure = RuntimeError(f"NativeEngine: generation failed: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        self._fail_requests(self._scheduler.started_requests(), failure)
        self._scheduler.drop_started()
        self._runner.discard_cache()

    @staticmethod
    def _fail_requests(owners: Iterable[EngineRequest], failure: BaseException) -> None:
        for owner in owners:
            if not owner.future.done():
                owner.future.set_exception(failure)
