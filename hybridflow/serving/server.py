"""``hybridflow serve``: an OpenAI-compatible HTTP server over the native engine.

    hybridflow serve /models/Qwen2.5-0.5B-Instruct --port 8000
    python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \
        print(c.completions.create(model='/models/Qwen2.5-0.5B-Instruct', prompt='Hi').choices[0].text)"

Endpoints (see docs/serving.md for the fields):

- ``GET /v1/models``, ``GET /health``, ``GET /stats`` (the engine's ``EngineStats`` counters);
- ``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served tokenizer, which a client that sends token
  ids (a distillation run's teacher client) compares with its own;
- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed as server-sent events
  (``data: {...}`` chunks, then ``data: [DONE]``) when ``stream`` is true; completions also score their
  prompt: vLLM's ``prompt_logprobs`` (``choices[i].prompt_logprobs``) and OpenAI's ``echo``;
- ``POST /generate``: tokens in, tokens out for a trainer or an agent loop: ``prompt_ids`` and
  ``sampling_params`` (``hybridflow.types.SamplingParams``' fields) in; per sample the
  ``response_ids``, ``rollout_logprobs``, ``token_versions`` and ``finish_reason`` out, exactly
  what ``NativeEngine.generate`` returns.

Every request runs in the one ``NativeEngine`` on uvicorn's event loop, so concurrent HTTP requests
are continuously batched together like concurrent ``generate`` calls. Bad parameters get a 400
with OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the
field.

A hostile or careless client must not be able to take the server from everyone else, so:

- every size a request controls is bounded (``schema.ServerLimits`` and its ``MAX_*`` constants: samples,
  ``max_tokens``, logprobs, stop strings, the body's bytes, the prompt's tokens), and every number
  must be finite and in a range the sampler handles; a refusal names the field and the limit;
- the event loop only plans and routes: model steps run in a worker thread (``NativeEngine``), and
  tokenizing, chat templating and rendering anything large run in the server's own threads, so
  ``/health`` and small requests are answered while a huge prompt is being tokenized;
- a request whose client has gone (closed the connection, timed out) is cancelled: its sequences
  leave the engine's batch at the next step, streamed or not;
- bound to a loopback address, the server answers only requests addressed to a loopback name
  (the ``Host`` header), so a web page cannot reach it through DNS rebinding;
- text must be Unicode: a lone surrogate (``"\\ud800"``, an escape JSON allows) in any string of
  the body is a 400 naming the field, found before the body reaches an endpoint.

``hybridflow serve`` renders the model's chat template once before it loads the weights: a template
that cannot render a plain conversation stops the start-up, naming its file, rather than failing
every chat request later with a 400 that would blame the client.

Token streaming: ``NativeEngine.add_token_listener`` reports every token the engine appends to a
listener registered under the request id, on the event-loop thread. Text is detokenized
incrementally (``IncrementalDetokenizer``) and held back while it could still be cut by a stop
string, so the streamed chunks concatenate to exactly the text a non-streamed request returns.

The pieces: this module holds the endpoints (``OpenAIServer``) and ``create_app``; ``schema`` the
request bodies, the limits and the conversion to ``SamplingParams``; ``errors`` OpenAI's error
answers; ``guards`` the middleware (``Host`` check, body size, lone surrogates) and the watch for a
client that left; ``formats`` detokenizing and the answers' shapes; ``launch`` ``hybridflow serve``
and ``ServerThread``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from hybridflow.inference.native import NativeEngine, TokenEvent
from hybridflow.inference.sampling import check_sampling_params, is_greedy
from hybridflow.serving.errors import ApiError, install_error_handlers, value_error
from hybridflow.serving.formats import (
    ChatFormat,
    CompletionFormat,
    Json,
    ResponseFormat,
    StreamedChoice,
    TokenLogprob,
    final_text,
    sse,
    token_records,
    token_usage,
)
from hybridflow.serving.guards import (
    HostCheck,
    Receive,
    RequestGuard,
    Scope,
    Send,
    client_gone,
)
from hybridflow.serving.schema import (
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingBody,
    ServerLimits,
    DetokenizeRequest,
    TokenizeRequest,
    TokensRequest,
    default_request_bytes,
    message_dict,
    prompt_items,
    sampling_params,
)
from hybridflow.serving.web import FastAPI, Request, Response, StreamingResponse
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

# OpenAI's default for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Chat completions default to the rest of the context, capped here: the slot KV cache sizes every
# decode row for the longest prompt + max_tokens admitted, so an uncapped default on a long-context
# model would shrink the batch (or not fit the cache at all) for clients that never set max_tokens.
DEFAULT_CHAT_MAX_TOKENS = 2048
T = TypeVar("T")

# ---- off-loop work
# Requests with up to this many characters of text are tokenized on the event loop (a few ms at
# most, for a byte-level tokenizer at ~2 us a character); longer ones, long chat conversations and
# large answers go to the server's threads.
INLINE_TEXT_CHARS = 4096
INLINE_ANSWER_TOKENS = 4096  # answer tokens x (1 + top logprobs) rendered on the loop
# Threads for tokenizing and rendering: the tokenizer releases the GIL, so one huge prompt keeps
# one thread busy while the other, and the inline path, serve everyone else.
SERVER_THREADS = 2
# Status of an answer nobody reads (the client left): nginx's "client closed request".
CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServerStats:
    """The server's own counters, reported by ``GET /stats`` next to the engine's."""

    cancelled_requests: int = 0  # API calls whose generation stopped because the client left


@dataclass
class _Job:
    """The engine requests of one API call (one per prompt), started together."""

    engine: NativeEngine
    requests: list[GenerationRequest]
    prompt_field: str  # the API field a prompt error names ("prompt", "messages", "prompt_ids")
    events: asyncio.Queue[TokenEvent | None] | None = None  # token events when streaming; None ends
    tasks: list[asyncio.Task[list[Trajectory]]] = field(default_factory=list)
    closed: bool = False

    async def start(self) -> None:
        """Queue every request; refusals (bad parameters, an asleep engine) raise ``ApiError`` now."""
        if self.events is not None:
            for request in self.requests:
                self.engine.add_token_listener(request.request_id, self.events.put_nowait)
        self.tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in self.requests]
        # generate() checks a request before its first await: one turn of the loop surfaces refusals.
        await asyncio.sleep(0)
        for task in self.tasks:
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                self.close()
                raise self._refusal(exc)
        if self.events is not None:
            events = self.events
            asyncio.gather(*self.tasks, return_exceptions=True).add_done_callback(lambda _: events.put_nowait(None))

    async def results(self) -> list[list[Trajectory]]:
        try:
            return list(await asyncio.gather(*self.tasks))
        except ValueError as exc:
            raise value_error(exc, fallback=self.prompt_field) from None
        except RuntimeError as exc:
            raise ApiError(500, str(exc)) from None

    def close(self) -> bool:
        """Stop generating for a caller that is gone (cancelled requests leave the engine's batch at
        the next step); True if some generation was still running. Later calls do nothing."""
        if self.closed:
            return False
        self.closed = True
        running = any(not task.done() for task in self.tasks)
        for task in self.tasks:
            task.cancel()
        for request in self.requests:
            self.engine.remove_token_listener(request.request_id)
        return running

    def _refusal(self, exc: BaseException) -> ApiError:
        if isinstance(exc, ValueError):
            return value_error(exc, fallback=self.prompt_field)
        return ApiError(503, f"the engine cannot take requests now: {exc}")


class OpenAIServer:
    """The endpoints over one engine and tokenizer; ``create_app`` mounts them on a FastAPI app."""

    def __init__(
        self,
        engine: NativeEngine,
        tokenizer: Any,
        *,
        model_name: str,
        max_model_len: int,
        limits: ServerLimits | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.limits = limits or ServerLimits()
        model: Any = engine.model  # an HF PreTrainedModel
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.created = int(time.time())
        self.stats = ServerStats()
        # Tokenizing, chat templating and rendering large answers: never on the event loop.
        self._threads = concurrent.futures.ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="hybridflow-serve")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------- plain endpoints

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def server_stats(self) -> dict[str, float]:
        engine = self.engine.stats
        return {**asdict(engine), "prefix_cache_hit_rate": engine.prefix_cache_hit_rate, **asdict(self.stats)}

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "hybridflow",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: the served tokenizer's ids of a text (a client compares them with its own)."""
        self._check_model(body.model)
        if len(body.prompt) > INLINE_TEXT_CHARS:
            raise ApiError(400, f"prompt: at most {INLINE_TEXT_CHARS} characters", "prompt")
        tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/detokenize``: the served tokenizer's text of ids."""
        self._check_model(body.model)
        if any(not 0 <= t < self.vocab_size for t in body.tokens):
            raise ApiError(400, f"tokens: ids outside the vocabulary [0, {self.vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def generate_tokens(self, body: TokensRequest, request: Request) -> Response:
        """Tokens in, tokens out: ``NativeEngine.generate``'s trajectories as JSON."""
        params = body.sampling_params
        self._check_sampling(params, 1, "sampling_params.", prompt_field="prompt_ids")
        self._check_prompts([body.prompt_ids], "prompt_ids")
        generation = GenerationRequest(body.prompt_ids, params, body.request_id or f"gen-{uuid.uuid4().hex}")
        job = _Job(self.engine, [generation], "prompt_ids")
        await job.start()
        results = await self._results_unless_gone(job, request)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        (trajectories,) = results

        def answer() -> Json:
            samples = [
                {
                    "index": index,
                    "response_ids": t.response_ids,
                    "rollout_logprobs": t.rollout_logprobs,
                    "token_versions": t.token_versions,
                    "finish_reason": t.finish_reason,
                    "stop_reason": t.stop_reason,
                    "top_logprobs": [sorted(top.items(), key=lambda kv: -kv[1]) for top in t.top_logprobs]
                    if t.top_logprobs is not None
                    else None,
                }
                | ({"prompt_logprobs": asdict(t.prompt_logprobs)} if t.prompt_logprobs is not None else {})
                for index, t in enumerate(trajectories)
            ]
            usage = token_usage(len(body.prompt_ids), sum(len(t.response_ids) for t in trajectories))
            return {"request_id": generation.request_id, "samples": samples, "usage": usage}

        return await self._render(answer, _answer_work(trajectories, params))

    # -------------------------------------------------------------- OpenAI endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        if body.suffix is not None:
            raise ApiError(400, "suffix is not supported by this server", "suffix")
        if body.best_of not in (None, body.n):
            raise ApiError(400, "best_of is not supported by this server (use n)", "best_of")
        for name, asked in (("echo", body.echo), ("prompt_logprobs", body.prompt_logprobs is not None)):
            if asked and body.stream:
                raise ApiError(400, f"{name} is not supported with stream=true by this server", name)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens=0 needs echo=true (scoring the prompt: echo + logprobs + max_tokens 0)",
                           "max_tokens")
        items = prompt_items(body.prompt)
        # The engine draws at least one token: max_tokens 0 draws one and the answer leaves it out.
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else max(1, body.max_tokens)
        params = sampling_params(body, max_tokens, body.logprobs)
        # Scores: what prompt_logprobs asks, or, for an echo with logprobs, what the echoed tokens need.
        scores = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs if body.echo else None
        params = dataclasses.replace(params, prompt_logprobs=scores)
        names = {"prompt_logprobs": "logprobs" if body.prompt_logprobs is None else "prompt_logprobs"}
        # Every bound that does not need the tokens is checked before tokenizing (the costly part).
        self._check_sampling(params, len(items), "", prompt_field="prompt", names=names)
        prompts = await self._tokenize(items)
        self._check_prompts(prompts, "prompt")
        fmt = CompletionFormat(self.tokenizer, body.logprobs)
        return await self._respond(request, body, prompts, params, fmt, "prompt")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        requested = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, requested or 1, top)
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        names = {"logprobs": "top_logprobs", "max_tokens": max_tokens_field}
        self._check_sampling(params, 1, "", prompt_field="messages", names=names)
        prompt = await self._chat_prompt(body.messages)
        self._check_prompts([prompt], "messages")
        if requested is None:  # the default needs the prompt's length
            default = max(1, min(DEFAULT_CHAT_MAX_TOKENS, self.max_model_len - len(prompt)))
            params = dataclasses.replace(params, max_tokens=default)
        return await self._respond(request, body, [prompt], params, ChatFormat(self.tokenizer, top), "messages")

    # -------------------------------------------------------------- shared machinery

    async def _respond(
        self,
        request: Request,
        body: SamplingBody,
        prompts: list[list[int]],
        params: SamplingParams,
        fmt: ResponseFormat,
        prompt_field: str,
    ) -> Any:
        response_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        requests = [GenerationRequest(p, params, f"{response_id}-{i}") for i, p in enumerate(prompts)]
        events: asyncio.Queue[TokenEvent | None] | None = asyncio.Queue() if body.stream else None
        job = _Job(self.engine, requests, prompt_field, events)
        await job.start()
        head = {"id": response_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(job, fmt, {**head, "object": fmt.chunk_object_name}, params, include_usage)
            return _ClosingStreamingResponse(stream, on_close=lambda: self._close(job))
        results = await self._results_unless_gone(job, request)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

        def answer() -> Json:
            choices = []
            for p, trajectories in enumerate(results):
                for s, t in enumerate(trajectories):
                    text = final_text(self.tokenizer, t.response_ids, t.stop_reason, params.include_stop_str_in_output)
                    records = token_records(t)
                    choice = fmt.choice(p * params.n + s, text, records, t.finish_reason, t.stop_reason)
                    choices.append(self._with_prompt(fmt, body, prompts[p], t, choice))
            completion_tokens = sum(len(t.response_ids) for ts in results for t in ts)
            if getattr(body, "max_tokens", None) == 0:  # echo's prompt alone: the drawn token is not answered
                completion_tokens = 0
            usage = token_usage(sum(len(p) for p in prompts), completion_tokens)
            return {**head, "object": fmt.object_name, "choices": choices, "usage": usage}

        work = sum(_answer_work(ts, params) for ts in results)
        if params.prompt_logprobs is not None:
            work += sum(len(p) for p in prompts) * params.n * (1 + params.prompt_logprobs)
        return await self._render(answer, work)

    @staticmethod
    def _with_prompt(fmt: ResponseFormat, body: SamplingBody, prompt: list[int], trajectory: Trajectory,
                     choice: Json) -> Json:
        """A completion choice with what the request asked about its prompt: vLLM's ``prompt_logprobs``, OpenAI's
        ``echo`` (max_tokens 0: the prompt alone)."""
        if not isinstance(fmt, CompletionFormat) or not isinstance(body, CompletionRequest):
            return choice
        if body.prompt_logprobs is not None:
            assert trajectory.prompt_logprobs is not None, "the engine scores the prompts it is asked to"
            choice = {**choice, "prompt_logprobs": fmt.prompt_logprobs(prompt, trajectory.prompt_logprobs)}
        if body.echo:
            choice = fmt.echoed(choice, prompt, trajectory.prompt_logprobs, completion=body.max_tokens != 0)
        return choice

    async def _results_unless_gone(self, job: _Job, request: Request) -> list[list[Trajectory]] | None:
        """The job's results, or None if the client disconnected first (the job is then cancelled,
        so a client that timed out does not leave its generation running)."""
        results = asyncio.ensure_future(job.results())
        gone = asyncio.ensure_future(client_gone(request.receive))
        try:
            await asyncio.wait([results, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled itself
            gone.cancel()
            if not results.done():
                results.cancel()
                self._close(job)
        if results.cancelled():
            return None
        return results.result()  # raises the job's ApiError

    async def _render(self, answer: Callable[[], Json], work: int) -> Response:
        """``answer()`` as a JSON response, built and serialized off the loop when it is large
        (decoding every token of every sample and its top logprobs adds up)."""

        def render() -> bytes:
            return json.dumps(answer(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

        content = render() if work <= INLINE_ANSWER_TOKENS else await self._off_loop(render)
        return Response(content, media_type="application/json")

    async def _off_loop(self, function: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, function)

    async def _stream(
        self, job: _Job, fmt: ResponseFormat, head: dict[str, Any], params: SamplingParams, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE chunks as tokens arrive; closes the job (cancelling generation) if the client leaves."""
        assert job.events is not None
        order = {r.request_id: i for i, r in enumerate(job.requests)}
        choices = [StreamedChoice(self.tokenizer, params) for _ in range(len(job.requests) * params.n)]
        try:
            for delta in fmt.opening_deltas(len(choices)):
                yield sse({**head, "choices": [delta]})
            while (event := await job.events.get()) is not None:
                index = order[event.request_id] * params.n + event.sample_index
                if (chunk := self._on_token(fmt, index, choices[index], event)) is not None:
                    yield sse({**head, "choices": [chunk]})
            results = await job.results()
            # Samples whose tokens were not all reported (no hook) finish from their trajectories.
            for p, trajectories in enumerate(results):
                for s, trajectory in enumerate(trajectories):
                    index = p * params.n + s
                    if (chunk := self._catch_up(fmt, index, choices[index], trajectory)) is not None:
                        yield sse({**head, "choices": [chunk]})
            if include_usage:
                completion_tokens = sum(c.token_count for c in choices)
                usage = token_usage(sum(len(r.prompt_ids) for r in job.requests), completion_tokens)
                yield sse({**head, "choices": [], "usage": usage})
        except ApiError as exc:  # headers are sent: the error travels as a chunk (vLLM's convention)
            yield sse(exc.body())
        finally:  # also when the client left: starlette then cancels this generator
            self._close(job)
        yield sse("[DONE]")

    def _close(self, job: _Job) -> None:
        if job.close():
            self.stats.cancelled_requests += 1
            logger.info("client left: cancelled request %s", job.requests[0].request_id)

    def _on_token(self, fmt: ResponseFormat, index: int, choice: StreamedChoice, event: TokenEvent) -> Json | None:
        token = TokenLogprob(event.token_id, event.logprob, event.top_logprobs)
        if event.finish_reason is not None:
            # Not pushed first: the text up to a stop string's start may only be sent once cut.
            choice.add(token)
            text = choice.finish(event.finish_reason, event.stop_reason)
            return fmt.delta(index, text, choice.take_pending(), event.finish_reason, event.stop_reason)
        text = choice.push(token)
        if not text:
            return None  # nothing printable yet; its logprobs ride with the next chunk
        return fmt.delta(index, text, choice.take_pending(), None, None)

    def _catch_up(self, fmt: ResponseFormat, index: int, choice: StreamedChoice, trajectory: Trajectory) -> Json | None:
        if choice.finish_reason is not None:
            return None
        for token in token_records(trajectory)[choice.token_count :]:
            choice.add(token)
        text = choice.finish(trajectory.finish_reason, trajectory.stop_reason)
        return fmt.delta(index, text, choice.take_pending(), trajectory.finish_reason, trajectory.stop_reason)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            message = f"model {model!r} does not exist; this server serves {self.model_name!r}"
            raise ApiError(404, message, "model", "model_not_found")

    async def _tokenize(self, items: list[str | list[Any]]) -> list[list[Any]]:
        """Token ids for each text (token-id prompts pass through): on the loop when the texts are
        short in total, otherwise in one of the server's threads."""

        def encode() -> list[list[Any]]:
            return [self.tokenizer.encode(item) if isinstance(item, str) else item for item in items]

        size = sum(len(item) for item in items if isinstance(item, str))
        return encode() if size <= INLINE_TEXT_CHARS else await self._off_loop(encode)

    async def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError(400, "the served model has no chat template; use /v1/completions", "messages")
        conversation = [message_dict(i, m) for i, m in enumerate(messages)]

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # a template may reject roles or orders (jinja raise_exception)
                raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None
            # The template already holds the special tokens: the tokenizer must not add more.
            return self.tokenizer.encode(text, add_special_tokens=False)

        # Rendering a template is Python (it holds the GIL) but short for short conversations.
        size = sum(len(str(m.get("content") or "")) for m in conversation)
        return render() if size <= INLINE_TEXT_CHARS and len(conversation) <= 64 else await self._off_loop(render)

    def _check_sampling(
        self,
        params: SamplingParams,
        prompt_count: int,
        prefix: str,
        *,
        prompt_field: str,
        names: Mapping[str, str] | None = None,
    ) -> None:
        """The request's sampling fields against the engine's rules and this server's limits, as
        400s naming the API field (``prefix`` + the field's API name). Needs no tokens, so it runs
        before a prompt is tokenized."""
        aliases = names or {}

        def refuse(name: str, message: str) -> ApiError:
            where = prefix + aliases.get(name, name)
            return ApiError(400, f"{where}: {message}", where)

        limits = self.limits
        samples = params.n * prompt_count
        if samples > limits.max_n:
            how_many = f"{params.n}" if prompt_count == 1 else f"{prompt_count} prompts x n={params.n} = {samples}"
            field_name = "n" if params.n > 1 or prompt_count == 1 else prompt_field
            raise refuse(field_name, f"{how_many} samples exceed this server's limit of {limits.max_n} "
                         "per request (hybridflow serve --max-n)")
        if params.max_tokens > self.max_model_len:
            raise refuse("max_tokens", f"{params.max_tokens} is more than the model's context of "
                         f"{self.max_model_len} tokens (hybridflow serve --max-model-len)")
        for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > limits.max_logprobs:
                raise refuse(name, f"{value} exceeds this server's limit of {limits.max_logprobs} "
                             "(hybridflow serve --max-logprobs)")
        if not is_greedy(params) and params.temperature < MIN_TEMPERATURE:
            raise refuse("temperature", f"{params.temperature} is below the smallest positive temperature, "
                         f"{MIN_TEMPERATURE}; use 0 for greedy decoding")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= params.repetition_penalty <= high:
            raise refuse("repetition_penalty", f"{params.repetition_penalty} is outside [{low}, {high}]")
        if params.top_k > self.vocab_size:
            raise refuse("top_k", f"{params.top_k} is more than the vocabulary of {self.vocab_size} tokens "
                         "(-1 or 0: no top-k filter)")
        if params.seed is not None and not -MAX_SEED - 1 <= params.seed <= MAX_SEED:
            raise refuse("seed", f"{params.seed} is not a 64-bit integer")
        if len(params.stop) > MAX_STOP_STRINGS:
            raise refuse("stop", f"{len(params.stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
            raise refuse("stop", f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise refuse("stop_token_ids", f"{len(params.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                         "are allowed")
        try:
            check_sampling_params(params, self.vocab_size)
        except ValueError as exc:
            raise value_error(exc, prefix=prefix) from None

    def _check_prompts(self, prompts: Sequence[list[Any]], prompt_field: str) -> None:
        """The checks the engine would make on the prompts, raised as 400s that name the API field."""
        for position, prompt in enumerate(prompts):
            where = f"{prompt_field}" if len(prompts) == 1 else f"{prompt_field}.{position}"
            if not prompt:
                raise ApiError(400, f"{where} has no tokens", where)
            # Length first: it bounds the scan below by the context, whatever the client sent.
            if len(prompt) >= self.max_model_len:
                raise ApiError(
                    400, f"{where} has {len(prompt)} tokens; the model's context is {self.max_model_len}", where
                )
            if any(type(t) is not int for t in prompt):  # bool is an int subclass: refused too
                raise ApiError(400, f"{where}: must be a string or a list of token ids (integers)", where)
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise ApiError(400, f"{where} has token ids outside the vocabulary [0, {self.vocab_size})", where)


def _answer_work(trajectories: Sequence[Trajectory], params: SamplingParams) -> int:
    """Roughly how many token decodes rendering these samples takes."""
    return sum(len(t.response_ids) for t in trajectories) * (1 + (params.logprobs or 0))


class _ClosingStreamingResponse(StreamingResponse):
    """A stream that runs ``on_close`` however it ends: finished, failed, cancelled because the
    client left, or cancelled before its generator ever started (which then never runs its own
    ``finally``, and would leave its generation running)."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(
    engine: NativeEngine,
    tokenizer: Any,
    *,
    model_name: str,
    max_model_len: int | None = None,
    limits: ServerLimits | None = None,
    host_check: HostCheck | None = HostCheck(),
) -> FastAPI:
    """A FastAPI app serving ``engine``; run it on one event loop (uvicorn's), which the engine then uses.

    ``max_model_len`` defaults to the engine's. ``host_check`` (default: loopback names only) is
    the ``Host`` header rule; pass ``host_check_for(bind_host, allowed_hosts)`` for the address the
    app is served on, or None to answer every host.
    """
    if max_model_len is None:
        max_model_len = engine.max_model_len
    limits = limits or ServerLimits()
    server = OpenAIServer(engine, tokenizer, model_name=model_name, max_model_len=max_model_len, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    app = FastAPI(title="hybridflow", summary="OpenAI-compatible generation with the native engine", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    body_bytes = limits.max_request_bytes or default_request_bytes(max_model_len)
    app.add_middleware(RequestGuard, host_check=host_check, max_body_bytes=body_bytes)
    # response_model=None: answers are built as plain JSON already; no second validation pass.
    app.get("/health", response_model=None)(server.health)
    app.get("/stats", response_model=None)(server.server_stats)
    app.get("/v1/models", response_model=None)(server.models)
    app.post("/v1/completions", response_model=None)(server.completions)
    app.post("/v1/chat/completions", response_model=None)(server.chat_completions)
    app.post("/generate", response_model=None)(server.generate_tokens)
    app.post("/tokenize", response_model=None)(server.tokenize)
    app.post("/detokenize", response_model=None)(server.detokenize)
    return app
