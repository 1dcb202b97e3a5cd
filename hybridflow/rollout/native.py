"""NativeEngine: a request-level asynchronous rollout engine over a Hugging Face causal LM.

Works anywhere torch runs (CPU, one GPU) with no inference server, which is what the laptop
default and the tests need. It is not trying to be vLLM; it is trying to be correct, small and
batch-invariant where the RL loop cares (seeded samples, logprobs).

How a request flows
-------------------
``generate()`` validates the request, expands it into ``params.n`` samples, appends them to the
waiting queue and awaits a future. A scheduler coroutine (started on demand on the caller's event
loop, exiting when the queue is empty) repeatedly:

1. takes a *wave* of up to ``max_batch_size`` waiting samples (``_next_wave``);
2. prefills it: the distinct prompts of the wave are left-padded and run once (samples of one
   prompt share that prefill; the cache rows are then repeated), with an attention mask over real
   tokens and position ids that count real tokens only, so a padded prompt sees the same positions
   as an unpadded one;
3. decodes: each step feeds only the newest token of every row with the KV cache and samples the
   next one (``sampling.sample_tokens``). A row finishes on a stop/EOS token (kept in the
   response) or at ``max_tokens``; once enough rows have finished, they are dropped from the
   batch and from the cache so later steps only pay for live rows;
4. resolves a request's future as soon as all of its samples have finished.

Model work runs in a worker thread (``asyncio.to_thread``), one step per hop, so the event loop
keeps serving agent loops and accepting requests while the model computes.

Growing into continuous batching
--------------------------------
Today a new wave starts when the running batch is empty. Continuous batching only changes the
admission point: between two decode steps, take waiting samples into free slots, prefill them
and merge their cache rows into the running cache (left-padding the shorter side). The wave,
``_RunningBatch`` and the per-step bookkeeping (``_record_step``) are already per row for that.

Weights and concurrency
-----------------------
``update_weights`` and every forward pass take the same lock, so new weights land between two
decode steps. Sequences in flight continue under the new weights (their later tokens come from
the new policy); callers that need one policy per trajectory update while the engine is idle.
One engine serves one event loop at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import threading
from collections import deque
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from hybridflow.rollout.sampling import (
    SamplingTensors,
    check_sampling_params,
    is_stop_token,
    make_sample_generator,
    sample_tokens,
)
from hybridflow.types import GenerationRequest, Trajectory

# Finished rows are dropped from the running batch (and its KV cache) once they make up at least
# this share of it. Dropping copies the whole cache once, about what a single decode step already
# spends appending to HF's DynamicCache; keeping a finished row costs its share of every later
# step. 1/8 caps the wasted compute at 12.5% while keeping copies rare in large batches, where
# rows tend to finish one at a time.
COMPACT_MIN_FINISHED_FRACTION = 0.125

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its config name (``rollout.dtype``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown rollout dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from None


@dataclass
class EngineStats:
    """Counters since construction, for metrics, benchmarks and tests."""

    forward_passes: int = 0  # model calls (one per prefill, one per decode step)
    waves: int = 0  # batches started from an empty engine
    prefill_tokens: int = 0  # real prompt tokens run through prefill (padding and shared prompts excluded)
    generated_tokens: int = 0  # tokens appended to responses
    compactions: int = 0  # times finished rows were dropped from a running batch


@dataclass(eq=False)
class _Request:
    """A request in flight; ``future`` resolves once all of its samples have finished."""

    request: GenerationRequest
    future: asyncio.Future[list[Trajectory]]
    samples: list[_Sample] = field(default_factory=list)
    unfinished: int = 0

    @property
    def label(self) -> str:
        return repr(self.request.request_id) if self.request.request_id else "(no request_id)"


@dataclass(eq=False)
class _Sample:
    """Sample ``index`` of ``owner``: one sequence being generated."""

    owner: _Request
    index: int
    max_tokens: int  # params.max_tokens, capped so prompt + response fits the model's context
    generator: torch.Generator | None  # set for seeded requests (see sampling.derive_sample_seed)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def to_trajectory(self) -> Trajectory:
        return Trajectory(
            prompt_ids=list(self.owner.request.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=[1] * len(self.response_ids),
            rollout_logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "abort",
        )


@dataclass(eq=False)
class _RunningBatch:
    """The sequences being decoded together; row ``i`` of every tensor belongs to ``samples[i]``."""

    samples: list[_Sample]
    cache: Any  # transformers Cache (a DynamicCache)
    attention_mask: torch.Tensor  # (B, L) long, 0 on left padding
    next_positions: torch.Tensor  # (B,) long, position id of the token fed next
    last_tokens: torch.Tensor  # (B,) long, the token fed next
    sampling: SamplingTensors
    finished: list[bool]  # finished rows still occupying the batch until the next compaction

    @property
    def size(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class _StepResult:
    """What one forward + sample step produced, as Python lists (one device sync per step)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: list[bool]


class NativeEngine:
    """Batched KV-cache generation for one Hugging Face causal LM (see the module docstring).

    The engine takes ownership of ``model``: it is moved to ``device``, its parameters are cast to
    ``dtype`` (buffers such as RoPE frequencies keep their precision) and it is put in eval mode.
    ``eos_token_ids`` end every request in addition to its own ``stop_token_ids``.
    ``max_model_len`` (default: the config's ``max_position_embeddings``) caps prompt + response;
    a response that reaches it finishes with ``"length"``.
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
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"NativeEngine: max_batch_size must be >= 1, got {max_batch_size}")
        self._device = torch.device(device)
        self._dtype = resolve_dtype(dtype)
        model.to(device=self._device)
        for parameter in model.parameters():
            parameter.data = parameter.data.to(dtype=self._dtype)
        self._model = model.eval()
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        for name, token in [("pad_token_id", pad_token_id)] + [("eos_token_ids", t) for t in eos_token_ids]:
            if not 0 <= token < self._vocab_size:
                raise ValueError(f"NativeEngine: {name} {token} is outside the vocabulary [0, {self._vocab_size})")
        self._eos_token_ids = list(eos_token_ids)
        self._pad_token_id = pad_token_id
        self._max_batch_size = max_batch_size
        if max_model_len is None:
            max_model_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self._max_model_len: int | None = max_model_len
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)

        self._waiting: deque[_Sample] = deque()
        self._wave: list[_Sample] = []  # samples taken from the queue for the current batch
        self._scheduler_task: asyncio.Task[None] | None = None
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        # Held by every forward pass and by update_weights: weights never change mid-forward.
        self._model_lock = threading.Lock()
        self._asleep = False
        self.stats = EngineStats()

    # ------------------------------------------------------------------ public API

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        """The ``request.params.n`` samples of one prompt, batched with concurrent requests."""
        loop = asyncio.get_running_loop()
        self._check_accepting(loop)
        owner = self._make_request(request, loop.create_future())
        self._waiting.extend(owner.samples)
        if self._scheduler_task is None or self._scheduler_task.done():
            self._scheduler_loop = loop
            self._scheduler_task = loop.create_task(self._schedule(), name="NativeEngine.scheduler")
        return await owner.future

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        """Serve ``requests`` concurrently from synchronous code; results in request order.

        Runs a private event loop (``asyncio.run``) that is closed, with its worker threads, before
        returning. Called from code that is itself inside a running event loop (a notebook, an
        async worker calling sync helpers), it runs that private loop in a short-lived thread,
        because the caller's loop is blocked for the duration of this call anyway.
        """
        for position, request in enumerate(requests):
            try:
                self._check_request(request)
            except ValueError as exc:
                raise ValueError(f"generate_batch: requests[{position}]: {exc}") from None
        if not requests:
            return []

        async def serve() -> list[list[Trajectory]]:
            return list(await asyncio.gather(*(self.generate(r) for r in requests)))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(serve())
        return _run_in_fresh_thread(serve())

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the model by Hugging Face parameter name.

        Names are those of ``model.state_dict()`` (tied aliases such as ``lm_head.weight`` are
        accepted). Values are cast to the engine's dtype and device. Pairs are applied as they
        stream in, so on an error the earlier pairs have already been applied: resend them all.
        """
        targets = self._model.state_dict(keep_vars=True)
        with self._model_lock, torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    close = difflib.get_close_matches(name, list(targets), n=3)
                    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                    raise ValueError(f"update_weights: unknown parameter {name!r}{hint}")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"update_weights: parameter {name!r} has shape {tuple(target.shape)} in the "
                        f"rollout model but {tuple(tensor.shape)} was sent"
                    )
                target.copy_(tensor)

    def sleep(self) -> None:
        """Release cached generation memory; ``generate`` refuses requests until ``wake_up``.

        The KV cache lives only while a batch is decoding, so sleeping requires an idle engine;
        on CUDA the allocator's cached blocks are returned to the device. Weights stay resident
        (a colocated trainer typically owns and updates them in place).
        """
        in_flight = self._count_in_flight()
        if in_flight:
            raise RuntimeError(
                f"NativeEngine.sleep(): {in_flight} samples are still being generated; "
                "await their requests before sleeping"
            )
        self._asleep = True
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Accept requests again after ``sleep`` (the cache is rebuilt per batch on demand)."""
        self._asleep = False

    # ------------------------------------------------------------------ intake

    def _check_accepting(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._asleep:
            raise RuntimeError("NativeEngine is asleep: call wake_up() before generate()")
        task, bound = self._scheduler_task, self._scheduler_loop
        if task is None or task.done() or bound is loop:
            return
        if bound is not None and bound.is_closed():
            # The previous loop died without finishing its scheduler; nobody can await its requests.
            self._waiting.clear()
            self._wave = []
            self._scheduler_task = None
            return
        raise RuntimeError(
            "NativeEngine is serving requests on another event loop; one engine serves one loop "
            "at a time (await generate() on that loop, or wait for it to finish)"
        )

    def _check_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` naming the request when it cannot be served by this model."""
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
        if self._max_model_len is not None and len(prompt) >= self._max_model_len:
            raise ValueError(
                f"request {label}: prompt of {len(prompt)} tokens leaves no room to generate within "
                f"the model's context of {self._max_model_len} tokens"
            )
        try:
            check_sampling_params(request.params, self._vocab_size)
        except ValueError as exc:
            raise ValueError(f"request {label}: {exc}") from None

    def _make_request(self, request: GenerationRequest, future: asyncio.Future[list[Trajectory]]) -> _Request:
        self._check_request(request)
        params = request.params
        max_tokens = params.max_tokens
        if self._max_model_len is not None:
            max_tokens = min(max_tokens, self._max_model_len - len(request.prompt_ids))
        owner = _Request(request=request, future=future, unfinished=params.n)
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = make_sample_generator(params.seed, index, self._device)
            owner.samples.append(_Sample(owner=owner, index=index, max_tokens=max_tokens, generator=generator))
        return owner

    def _count_in_flight(self) -> int:
        waiting = sum(1 for s in self._waiting if not s.owner.future.done())
        # Counted from the moment a wave leaves the queue, so a prefill in progress counts too.
        running = sum(1 for s in self._wave if s.finish_reason is None and not s.owner.future.done())
        return waiting + running

    # ------------------------------------------------------------------ scheduling

    async def _schedule(self) -> None:
        """Serve waves until the queue is empty, then exit (``generate`` restarts it)."""
        try:
            # Let requests submitted in the same tick (asyncio.gather) join the first wave.
            await asyncio.sleep(0)
            while wave := self._next_wave():
                await self._run_wave(wave)
        except BaseException as exc:  # cancelled with the loop: nobody will serve what is queued
            failure = RuntimeError("NativeEngine scheduler stopped before these requests finished")
            failure.__cause__ = exc
            self._fail_requests({s.owner for s in self._waiting}, failure)
            self._waiting.clear()
            raise

    def _next_wave(self) -> list[_Sample]:
        """Up to ``max_batch_size`` waiting samples, skipping those nobody awaits any more."""
        wave: list[_Sample] = []
        while self._waiting and len(wave) < self._max_batch_size:
            sample = self._waiting.popleft()
            if not sample.owner.future.done():  # done early: cancelled by its caller, or failed
                wave.append(sample)
        return wave

    async def _run_wave(self, wave: list[_Sample]) -> None:
        self.stats.waves += 1
        self._wave = wave
        try:
            batch, step = await asyncio.to_thread(self._prefill, wave)
            self._record_step(batch, step)
            while not all(batch.finished):
                step = await asyncio.to_thread(self._decode_step, batch)
                self._record_step(batch, step)
        except Exception as exc:  # a model or sampling error fails this wave's requests only
            failure = RuntimeError(f"NativeEngine: generation failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self._fail_requests({s.owner for s in wave}, failure)
        except BaseException as exc:  # cancelled mid-wave (its loop is shutting down)
            failure = RuntimeError("NativeEngine scheduler stopped before these requests finished")
            failure.__cause__ = exc
            self._fail_requests({s.owner for s in wave}, failure)
            raise
        finally:
            self._wave = []

    @staticmethod
    def _fail_requests(owners: Iterable[_Request], failure: BaseException) -> None:
        for owner in owners:
            if not owner.future.done():
                owner.future.set_exception(failure)

    def _record_step(self, batch: _RunningBatch, step: _StepResult) -> None:
        """Append each live row's token; finish rows and resolve requests (event-loop thread)."""
        appended = 0
        for row, sample in enumerate(batch.samples):
            if batch.finished[row]:
                continue
            owner = sample.owner
            if owner.future.done():  # its caller was cancelled or it failed: stop spending on it
                batch.finished[row] = True
                sample.finish_reason = "abort"
                continue
            sample.response_ids.append(step.tokens[row])
            sample.logprobs.append(step.logprobs[row])
            appended += 1
            if step.stopped[row]:
                sample.finish_reason = "stop"
            elif len(sample.response_ids) >= sample.max_tokens:
                sample.finish_reason = "length"
            else:
                continue
            batch.finished[row] = True
            owner.unfinished -= 1
            if owner.unfinished == 0:
                owner.future.set_result([s.to_trajectory() for s in owner.samples])
        self.stats.generated_tokens += appended

    # ------------------------------------------------------------------ model work (worker thread)

    def _new_cache(self) -> Any:
        try:
            # With the config, sliding-window layers get sliding caches (transformers >= 4.56).
            return DynamicCache(config=self._model.config)
        except TypeError:  # older transformers: no config argument, full-attention layers only
            return DynamicCache()

    def _prefill(self, wave: list[_Sample]) -> tuple[_RunningBatch, _StepResult]:
        """Run the wave's distinct prompts once, left-padded, and sample each row's first token."""
        prompt_row: dict[tuple[int, ...], int] = {}
        rows = [prompt_row.setdefault(tuple(s.owner.request.prompt_ids), len(prompt_row)) for s in wave]
        prompts = list(prompt_row)
        width = max(len(p) for p in prompts)
        device = self._device
        input_ids = torch.full((len(prompts), width), self._pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # Positions count real tokens only: the same positions an unpadded prompt would get.
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        with self._model_lock, torch.inference_mode():
            cache = self._new_cache()
            output = self._model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            self.stats.forward_passes += 1
            self.stats.prefill_tokens += sum(len(p) for p in prompts)
            logits = output.logits[:, -1, :]
            cache = output.past_key_values
            if len(prompts) != len(wave):  # samples of one prompt share its prefill: repeat rows
                index = torch.tensor(rows, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                logits, attention_mask = logits[index], attention_mask[index]
            params = [s.owner.request.params for s in wave]
            batch = _RunningBatch(
                samples=list(wave),
                cache=cache,
                attention_mask=attention_mask,
                next_positions=attention_mask.sum(dim=1),
                last_tokens=torch.empty(0, dtype=torch.long, device=device),
                sampling=SamplingTensors.from_params(params, self._eos_token_ids, device),
                finished=[False] * len(wave),
            )
            return batch, self._sample(batch, logits)

    def _decode_step(self, batch: _RunningBatch) -> _StepResult:
        """Feed every row its newest token with the cache and sample the next one."""
        with self._model_lock, torch.inference_mode():
            if _worth_compacting(sum(batch.finished), batch.size):
                self._compact(batch)
            ones = torch.ones((batch.size, 1), dtype=batch.attention_mask.dtype, device=self._device)
            batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
            output = self._model(
                input_ids=batch.last_tokens[:, None],
                attention_mask=batch.attention_mask,
                position_ids=batch.next_positions[:, None],
                past_key_values=batch.cache,
                use_cache=True,
            )
            self.stats.forward_passes += 1
            batch.cache = output.past_key_values
            batch.next_positions = batch.next_positions + 1
            return self._sample(batch, output.logits[:, -1, :])

    def _sample(self, batch: _RunningBatch, logits: torch.Tensor) -> _StepResult:
        nan_rows = torch.isnan(logits).any(dim=-1)
        if bool(nan_rows.any()):
            labels = sorted({batch.samples[i].owner.label for i in nan_rows.nonzero().flatten().tolist()})
            raise FloatingPointError(
                f"model produced NaN logits for requests {', '.join(labels)} (dtype {self._dtype}); "
                "check the weights last loaded with update_weights"
            )
        generators = [s.generator for s in batch.samples]
        tokens, logprobs = sample_tokens(logits, batch.sampling, generators, self._generator)
        stopped = is_stop_token(tokens, batch.sampling.stop_token_ids)
        batch.last_tokens = tokens
        return _StepResult(tokens=tokens.tolist(), logprobs=logprobs.tolist(), stopped=stopped.tolist())

    def _compact(self, batch: _RunningBatch) -> None:
        """Drop finished rows from every per-row tensor and from the KV cache."""
        keep = [row for row, done in enumerate(batch.finished) if not done]
        index = torch.tensor(keep, dtype=torch.long, device=self._device)
        batch.cache.batch_select_indices(index)
        batch.samples = [batch.samples[row] for row in keep]
        batch.attention_mask = batch.attention_mask[index]
        batch.next_positions = batch.next_positions[index]
        batch.last_tokens = batch.last_tokens[index]
        batch.sampling = batch.sampling.select(index)
        batch.finished = [False] * len(keep)
        self.stats.compactions += 1


def _worth_compacting(num_finished: int, batch_size: int) -> bool:
    """Whether to drop finished rows before the next step (see COMPACT_MIN_FINISHED_FRACTION)."""
    return 0 < num_finished < batch_size and num_finished >= COMPACT_MIN_FINISHED_FRACTION * batch_size


def _run_in_fresh_thread(coroutine: Coroutine[Any, Any, list[list[Trajectory]]]) -> list[list[Trajectory]]:
    """Run ``coroutine`` on a new event loop in a thread that is joined before returning."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="NativeEngine") as pool:
        return pool.submit(asyncio.run, coroutine).result()
