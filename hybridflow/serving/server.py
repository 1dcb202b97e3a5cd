"""``hybridflow serve``: an OpenAI-compatible HTTP server over the native engine.

    hybridflow serve /models/Qwen2.5-0.5B-Instruct --port 8000
    python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \
        print(c.completions.create(model='/models/Qwen2.5-0.5B-Instruct', prompt='Hi').choices[0].text)"

Endpoints (see docs/serving.md for the fields):

- ``GET /v1/models``, ``GET /health``, ``GET /stats`` (the engine's ``EngineStats`` counters);
- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed as server-sent events
  (``data: {...}`` chunks, then ``data: [DONE]``) when ``stream`` is true;
- ``POST /generate``: tokens in, tokens out for a trainer or an agent loop: ``prompt_ids`` and
  ``sampling_params`` (``hybridflow.types.SamplingParams``' fields) in; per sample the
  ``response_ids``, ``rollout_logprobs``, ``token_versions`` and ``finish_reason`` out, exactly
  what ``NativeEngine.generate`` returns.

Every request runs in the one ``NativeEngine`` on uvicorn's event loop, so concurrent HTTP requests
are continuously batched together like concurrent ``generate`` calls. Bad parameters get a 400
with OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the
field.

A hostile or careless client must not be able to take the server from everyone else, so:

- every size a request controls is bounded (``ServerLimits`` and the ``MAX_*`` constants: samples,
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
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import json
import logging
import math
import os
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from hybridflow.models.loading import eos_token_ids, load_causal_lm
from hybridflow.inference.native import NativeEngine, TokenEvent, resolve_dtype
from hybridflow.inference.sampling import check_sampling_params, is_greedy
from hybridflow.inference.stopping import cut_at_stop
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # the server is an optional extra; the engine itself does not need it
    raise ImportError("hybridflow serve needs FastAPI and uvicorn: pip install 'hybridflow[serve]'") from exc

logger = logging.getLogger(__name__)

# OpenAI's default for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Chat completions default to the rest of the context, capped here: the slot KV cache sizes every
# decode row for the longest prompt + max_tokens admitted, so an uncapped default on a long-context
# model would shrink the batch (or not fit the cache at all) for clients that never set max_tokens.
DEFAULT_CHAT_MAX_TOKENS = 2048
# JSON has no -inf: a logprob below this is reported as this (vLLM's convention).
MIN_REPORTED_LOGPROB = -9999.0
DEFAULT_MAX_BATCH_SIZE = 256  # vLLM's max_num_seqs default
Json = dict[str, Any]
T = TypeVar("T")

# ---- request limits (see ServerLimits for the ones a flag raises)
# Samples one request may ask for (n x prompts): OpenAI's own cap on n. Each sample holds a decode
# row and its Python records; an uncapped n (1e6) took the server to 2.9 GB and held the loop.
DEFAULT_MAX_N = 128
# Top logprobs per token: vLLM's max_logprobs default and OpenAI's top_logprobs cap. Each one is a
# decoded token in the answer, so k x tokens x samples bounds the answer's size.
DEFAULT_MAX_LOGPROBS = 20
# Default HTTP body cap: room for a whole-context prompt as JSON text or token ids (a few bytes a
# token, up to 12 for \u-escaped emoji) with a wide margin, and never under 1 MiB. Tokenizing costs
# ~2 s per MB here, so the cap also bounds the work one request can queue before it is refused.
REQUEST_BYTES_PER_CONTEXT_TOKEN = 32
MIN_DEFAULT_REQUEST_BYTES = 1 << 20
# Stop strings: the engine decodes a tail as long as the longest one after every token of every
# sample, on the event loop, so both their number and their length stay small (OpenAI allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 256
# The smallest positive temperature (vLLM's floor): logits / T overflows float32 to inf, and the
# step's NaNs then fail every request in flight, long before T reaches 1e-45; below 0.01 sampling
# is greedy in all but name anyway, so such a request is refused and pointed at temperature 0.
MIN_TEMPERATURE = 0.01
# Repetition penalty divides (or multiplies) logits: the same overflow outside this range.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_SEED = 2**63 - 1  # seeds are int64, as OpenAI documents them
# ---- off-loop work
# Requests with up to this many characters of text are tokenized on the event loop (a few ms at
# most, for a byte-level tokenizer at ~2 us a character); longer ones, long chat conversations and
# large answers go to the server's threads.
INLINE_TEXT_CHARS = 4096
INLINE_ANSWER_TOKENS = 4096  # answer tokens x (1 + top logprobs) rendered on the loop
# Threads for tokenizing and rendering: the tokenizer releases the GIL, so one huge prompt keeps
# one thread busy while the other, and the inline path, serve everyone else.
SERVER_THREADS = 2
# Names and addresses a loopback-bound server answers to, besides --allowed-hosts.
LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "[::1]")
# Status of an answer nobody reads (the client left): nginx's "client closed request".
CLIENT_CLOSED_REQUEST = 499
# A lone surrogate reaches Python only through a JSON escape (UTF-8 bytes cannot encode one), so
# a body without such an escape needs no further look; a surrogate pair (an escaped emoji) matches
# too and is then found to be fine.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Conversations rendered with the chat template at start-up, in order until one renders: some
# templates insist on a system turn first, which is strict, not broken.
TEMPLATE_PROBES = (
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"}],
)

# ---------------------------------------------------------------------------------------- text


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, a few tokens at a time (vLLM's scheme).

    Each push decodes only the tokens since the last emitted boundary, with the token(s) before it
    as context (so tokenizers that drop a leading space at the start of a decode keep it), and
    emits nothing while the text ends in an incomplete UTF-8 character (U+FFFD).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the context decoded with the new tokens
        self._read_offset = 0  # tokens whose text is already in ``text``

    def push(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += new_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def final_text(tokenizer: Any, response_ids: Sequence[int], stop_reason: int | str | None, include_stop: bool) -> str:
    """The text a finished sample returns: decoded, cut before a matched stop string (``LLM``'s rule)."""
    decoded = tokenizer.decode(list(response_ids), skip_special_tokens=True)
    return cut_at_stop(decoded, stop_reason if isinstance(stop_reason, str) else None, include_stop)


@dataclass(frozen=True)
class _TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] | None


class _StreamedChoice:
    """One sample being streamed: emits text only once no stop string can still cut it."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        # A stop string completed by a later token starts at most len(stop) - 1 characters back.
        cut = params.stop and not params.include_stop_str_in_output
        self._holdback = max(len(s) for s in params.stop) - 1 if cut else 0
        self.sent = ""
        self.pending: list[_TokenLogprob] = []  # logprobs of tokens not yet sent with a chunk
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def token_count(self) -> int:
        return len(self._detokenizer.ids)

    def add(self, token: _TokenLogprob) -> None:
        """Add a token without sending text: the last token of a sample, which ``finish`` sends."""
        self.pending.append(token)
        self._detokenizer.push(token.token_id)

    def push(self, token: _TokenLogprob) -> str:
        """Add a token that is not the sample's last; return the text that can be sent now."""
        self.add(token)
        return self._take(self._detokenizer.text[: max(0, len(self._detokenizer.text) - self._holdback)])

    def finish(self, finish_reason: str, stop_reason: int | str | None) -> str:
        """Mark the sample done; return the rest of its final text."""
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        text = final_text(self._tokenizer, self._detokenizer.ids, stop_reason, self._params.include_stop_str_in_output)
        if not text.startswith(self.sent):
            # Incremental decoding diverged from a whole decode (a tokenizer quirk): what was sent
            # cannot be taken back, so the stream ends with the text sent so far.
            logger.warning("streamed text diverged from the final decode; the stream keeps what it sent")
            return ""
        return self._take(text)

    def take_pending(self) -> list[_TokenLogprob]:
        pending, self.pending = self.pending, []
        return pending

    def _take(self, text: str) -> str:
        new_text = text[len(self.sent) :] if len(text) > len(self.sent) else ""
        self.sent += new_text
        return new_text


# ---------------------------------------------------------------------------------------- API schema


class _Body(BaseModel):
    # Unknown fields are a 400 naming them (OpenAI's behaviour), not silently ignored. JSON's
    # NaN / Infinity (which Python's parser accepts) are refused in every float, nested ones too.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """Fields shared by both OpenAI endpoints; vLLM's extras (top_k, min_p, ...) via ``extra_body``."""

    model: str
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted at their no-op values only, since common clients send them by default.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_SamplingBody):
    # A string, a list of strings, a list of token ids or a list of lists of token ids. Typed loosely
    # on purpose: pydantic's union over those types took ~1 s for a 2M-id list, on the event loop;
    # _prompt_items and _check_prompts check the shape, the length first.
    prompt: str | list[Any]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


class TokensRequest(_Body):
    prompt_ids: list[Any] = Field(min_length=1)  # integers; checked by _check_prompts, length first
    # hybridflow.types.SamplingParams' own fields and checks (its __post_init__ errors are 400s).
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)


# ---------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
# Pydantic names union branches in error locations ("str", "list[int]"): not part of the field path.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param_from_location(location: Sequence[int | str]) -> tuple[str | None, bool]:
    """The dotted field path of a pydantic error location, and whether it ran into a union branch."""
    parts: list[str] = []
    for part in location[1:] if location and location[0] == "body" else location:
        if isinstance(part, str) and ("[" in part or part in _TYPE_TAGS):
            return ".".join(parts) or None, True
        parts.append(str(part))
    return ".".join(parts) or None, False


def _validation_error(exc: RequestValidationError) -> ApiError:
    """A pydantic error as a 400 naming the field (the first error is enough to act on)."""
    first = exc.errors()[0]
    param, union = _param_from_location(first.get("loc", ()))
    message = str(first.get("msg", "invalid request"))
    if first.get("type") in ("extra_forbidden", "unexpected_keyword_argument"):
        message = "this server does not support this parameter"
    elif union:  # the first branch's complaint ("should be a valid string") would mislead
        message = "none of the accepted types matches this value (see docs/serving.md)"
    elif param and (named := _SAMPLING_FIELD.search(message)):
        param = f"{param}.{named.group(1)}"  # SamplingParams' own checks name the inner field
    return ApiError(400, f"{param}: {message}" if param else message, param)


def _value_error(exc: ValueError, *, prefix: str = "", fallback: str | None = None) -> ApiError:
    """A ``SamplingParams`` or engine refusal as a 400, naming the sampling field its message names."""
    message = str(exc)
    named = _SAMPLING_FIELD.search(message)
    return ApiError(400, message, f"{prefix}{named.group(1)}" if named else fallback)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


# ---------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for, beyond the model's context; ``hybridflow serve`` flags set them.

    A request over a limit is refused before any work is queued for it: 400 naming the field and
    the limit (413 for the body). The fixed bounds (stop strings, temperature, ...) are the
    ``MAX_*`` / ``MIN_*`` constants of this module.
    """

    max_n: int = DEFAULT_MAX_N  # samples per request: n x the number of prompts (--max-n)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # logprobs / top_logprobs (--max-logprobs)
    max_request_bytes: int | None = None  # HTTP body; None: default_request_bytes(context) (--max-request-bytes)

    def __post_init__(self) -> None:
        for name in ("max_n", "max_logprobs", "max_request_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1, got {value}")


def default_request_bytes(max_model_len: int) -> int:
    return max(MIN_DEFAULT_REQUEST_BYTES, REQUEST_BYTES_PER_CONTEXT_TOKEN * max_model_len)


@dataclass
class ServerStats:
    """The server's own counters, reported by ``GET /stats`` next to the engine's."""

    cancelled_requests: int = 0  # API calls whose generation stopped because the client left


# ---------------------------------------------------------------------------------------- guards


def host_name(host_header: str) -> str:
    """The name or address of a ``Host`` header, without its port: ``[::1]:8000`` -> ``::1``."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal, bracketed so its colons are not a port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") > 1:  # an unbracketed IPv6 address (not valid HTTP, but unambiguous)
        return host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


class HostCheck:
    """Which ``Host`` headers a server answers: loopback names and addresses, plus ``extra``.

    A web page can point a DNS name of its own at 127.0.0.1 (DNS rebinding) and then read a
    loopback-bound server's answers as same-origin; its requests still carry that name in ``Host``,
    which is what is checked. ``"*"`` in ``extra`` allows every host.
    """

    def __init__(self, extra: Collection[str] = ()) -> None:
        self.extra = frozenset(host_name(h) for h in extra)

    def allows(self, host_header: str | None) -> bool:
        if "*" in self.extra:
            return True
        if not host_header:
            return False
        name = host_name(host_header)
        return is_loopback(name) or name in self.extra


def host_check_for(bind_host: str, allowed_hosts: Collection[str] = ()) -> HostCheck | None:
    """The check a server bound to ``bind_host`` applies: loopback-bound servers answer loopback
    names (and ``allowed_hosts``); others answer every host unless ``allowed_hosts`` is given."""
    if is_loopback(bind_host) or allowed_hosts:
        return HostCheck([*allowed_hosts, bind_host])
    return None


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RequestGuard:
    """ASGI middleware run before routing: the ``Host`` check, then the body's size.

    The body is read here, up to ``max_body_bytes`` (refused with 413 past it, without reading the
    rest), and handed on whole; later ``receive`` calls reach the server, so the endpoints still
    see the client's disconnect.
    """

    def __init__(self, app: Any, *, host_check: HostCheck | None, max_body_bytes: int) -> None:
        self.app, self.host_check, self.max_body_bytes = app, host_check, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.host_check is not None and not self.host_check.allows(headers.get("host")):
            await self._refuse(scope, receive, send, self._host_error(headers.get("host")))
            return
        too_large = ApiError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
            "(raise it with hybridflow serve --max-request-bytes)",
            code="request_too_large",
        )
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            error = too_large if declared.isdigit() else ApiError(400, f"invalid Content-Length {declared!r}")
            await self._refuse(scope, receive, send, error)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._refuse(scope, receive, send, too_large)
                return
            if not message.get("more_body", False):
                break
        if (error := _lone_surrogate_error(bytes(body))) is not None:
            await self._refuse(scope, receive, send, error)
            return
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _host_error(host: str | None) -> ApiError:
        shown = repr(host) if host else "(none)"
        return ApiError(
            421,
            f"Host header {shown} is not allowed: this server answers requests addressed to "
            f"{', '.join(LOOPBACK_HOST_NAMES)} (protection against DNS rebinding); to reach it under "
            "another name, start it with hybridflow serve --allowed-hosts NAME",
            code="host_not_allowed",
        )

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def _lone_surrogate_error(body: bytes) -> ApiError | None:
    """A 400 naming the first string (or key) of a JSON body that holds a lone surrogate; None
    when there is none, or when the body is not JSON (the endpoint then says so)."""
    if SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    # Iterative, in document order: the body's depth is the client's to choose.
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if (position := _lone_surrogate_at(node)) is not None:
                return ApiError(400, f"{path or 'the body'}: {_surrogate_reason(node, position)}", path or None)
        elif isinstance(node, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            for key in node:
                if (position := _lone_surrogate_at(key)) is not None:
                    where = f"the key {ascii(key)}" + (f" in {path}" if path else "")
                    return ApiError(400, f"{where}: {_surrogate_reason(key, position)}", path or None)
            stack.extend((item, f"{path}.{key}" if path else key) for key, item in reversed(node.items()))
    return None


def _lone_surrogate_at(text: str) -> int | None:
    """The position of the first lone surrogate in ``text``, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _surrogate_reason(text: str, position: int) -> str:
    # The surrogate is shown escaped: the character itself cannot be written as UTF-8.
    return (
        f"character {position} is a lone surrogate (\\u{ord(text[position]):04x}), which is not Unicode text; "
        "send text as UTF-8, and escape a character beyond U+FFFF as a pair (\\ud83d\\ude00)"
    )


async def _client_gone(receive: Receive) -> None:
    """Return once the client has disconnected (the request's body has been read already).

    uvicorn's ``receive`` waits until the connection closes; a server that kept answering with
    empty body messages instead would make this spin, so after a few it stops listening.
    """
    for _ in range(16):
        if (await receive())["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------------------- requests


def _sampling_params(body: _SamplingBody, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """OpenAI fields to ``SamplingParams``; unset fields keep OpenAI's defaults."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported by this server (use repetition_penalty)", name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    top_k = body.top_k if body.top_k not in (None, 0) else -1
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=stops,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise _value_error(exc) from None


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message for the chat template, with OpenAI's content parts joined into one string."""
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", f"messages.{index}.content")
            texts.append(part["text"])
        data["content"] = "".join(texts)
    return data


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
            raise _value_error(exc, fallback=self.prompt_field) from None
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
            return _value_error(exc, fallback=self.prompt_field)
        return ApiError(503, f"the engine cannot take requests now: {exc}")


def _clean_logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_REPORTED_LOGPROB else MIN_REPORTED_LOGPROB


def _token_records(trajectory: Trajectory) -> list[_TokenLogprob]:
    tops: Sequence[dict[int, float] | None] = trajectory.top_logprobs or [None] * len(trajectory.response_ids)
    return [
        _TokenLogprob(token, logprob, top)
        for token, logprob, top in zip(trajectory.response_ids, trajectory.rollout_logprobs, tops, strict=True)
    ]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


# ---------------------------------------------------------------------------------------- formats


class _Format(abc.ABC):
    """How one endpoint writes choices, chunks and logprobs (completions vs chat)."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, tokenizer: Any, top_logprobs: int | None) -> None:
        self._tokenizer = tokenizer
        self._top_logprobs = top_logprobs  # None: no logprobs in the answer

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    @abc.abstractmethod
    def choice(self, index: int, text: str, tokens: list[_TokenLogprob], finish: str | None, stop: Any) -> Json:
        """A finished choice of a non-streamed answer."""

    @abc.abstractmethod
    def delta(self, index: int, text: str, tokens: list[_TokenLogprob], finish: str | None, stop: Any) -> Json:
        """A streamed chunk's choice: new ``text`` and the logprobs of ``tokens``."""

    def opening_deltas(self, count: int) -> list[dict[str, Any]]:
        return []


class _CompletionFormat(_Format):
    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def choice(self, index: int, text: str, tokens: list[_TokenLogprob], finish: str | None, stop: Any) -> Json:
        logprobs = self._logprobs(tokens) if self._top_logprobs is not None else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    delta = choice  # a streamed completion chunk has the same shape as a choice

    def _logprobs(self, tokens: list[_TokenLogprob]) -> dict[str, list[Any]]:
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = [sum(len(s) for s in texts[:i]) for i in range(len(texts))]
        tops = [
            {self.token_text(i): _clean_logprob(v) for i, v in sorted(t.top.items(), key=lambda kv: -kv[1])}
            if t.top is not None
            else None
            for t in tokens
        ]
        return {
            "tokens": texts,
            "token_logprobs": [_clean_logprob(t.logprob) for t in tokens],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class _ChatFormat(_Format):
    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, index: int, text: str, tokens: list[_TokenLogprob], finish: str | None, stop: Any) -> Json:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(tokens),
            "finish_reason": finish,
            "stop_reason": stop,
        }

    def delta(self, index: int, text: str, tokens: list[_TokenLogprob], finish: str | None, stop: Any) -> Json:
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": self._logprobs(tokens),
            "finish_reason": finish,
            "stop_reason": stop,
        }

    def opening_deltas(self, count: int) -> list[dict[str, Any]]:
        # OpenAI's first chunk of each choice carries the role.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(count)]

    def _logprobs(self, tokens: list[_TokenLogprob]) -> dict[str, Any] | None:
        if self._top_logprobs is None:
            return None
        return {"content": [self._entry(t) for t in tokens]}

    def _entry(self, token: _TokenLogprob) -> dict[str, Any]:
        top = sorted((token.top or {}).items(), key=lambda kv: -kv[1])[: self._top_logprobs]
        return {**self._token(token.token_id, token.logprob), "top_logprobs": [self._token(i, v) for i, v in top]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        # A token holding part of a UTF-8 character decodes to U+FFFD: its own bytes are unknown here.
        raw = None if "\ufffd" in text else list(text.encode("utf-8"))
        return {"token": text, "logprob": _clean_logprob(logprob), "bytes": raw}


# ---------------------------------------------------------------------------------------- server


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
                for index, t in enumerate(trajectories)
            ]
            usage = _usage(len(body.prompt_ids), sum(len(t.response_ids) for t in trajectories))
            return {"request_id": generation.request_id, "samples": samples, "usage": usage}

        return await self._render(answer, _answer_work(trajectories, params))

    # -------------------------------------------------------------- OpenAI endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        for name, value, allowed in (("echo", body.echo, False), ("suffix", body.suffix, None)):
            if value != allowed:
                raise ApiError(400, f"{name} is not supported by this server", name)
        if body.best_of not in (None, body.n):
            raise ApiError(400, "best_of is not supported by this server (use n)", "best_of")
        items = _prompt_items(body.prompt)
        params = _sampling_params(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, body.logprobs)
        # Every bound that does not need the tokens is checked before tokenizing (the costly part).
        self._check_sampling(params, len(items), "", prompt_field="prompt")
        prompts = await self._tokenize(items)
        self._check_prompts(prompts, "prompt")
        fmt = _CompletionFormat(self.tokenizer, body.logprobs)
        return await self._respond(request, body, prompts, params, fmt, "prompt")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        requested = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, requested or 1, top)
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        names = {"logprobs": "top_logprobs", "max_tokens": max_tokens_field}
        self._check_sampling(params, 1, "", prompt_field="messages", names=names)
        prompt = await self._chat_prompt(body.messages)
        self._check_prompts([prompt], "messages")
        if requested is None:  # the default needs the prompt's length
            default = max(1, min(DEFAULT_CHAT_MAX_TOKENS, self.max_model_len - len(prompt)))
            params = dataclasses.replace(params, max_tokens=default)
        return await self._respond(request, body, [prompt], params, _ChatFormat(self.tokenizer, top), "messages")

    # -------------------------------------------------------------- shared machinery

    async def _respond(
        self,
        request: Request,
        body: _SamplingBody,
        prompts: list[list[int]],
        params: SamplingParams,
        fmt: _Format,
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
                    records = _token_records(t)
                    choices.append(fmt.choice(p * params.n + s, text, records, t.finish_reason, t.stop_reason))
            completion_tokens = sum(len(t.response_ids) for ts in results for t in ts)
            usage = _usage(sum(len(p) for p in prompts), completion_tokens)
            return {**head, "object": fmt.object_name, "choices": choices, "usage": usage}

        return await self._render(answer, sum(_answer_work(ts, params) for ts in results))

    async def _results_unless_gone(self, job: _Job, request: Request) -> list[list[Trajectory]] | None:
        """The job's results, or None if the client disconnected first (the job is then cancelled,
        so a client that timed out does not leave its generation running)."""
        results = asyncio.ensure_future(job.results())
        gone = asyncio.ensure_future(_client_gone(request.receive))
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
        self, job: _Job, fmt: _Format, head: dict[str, Any], params: SamplingParams, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE chunks as tokens arrive; closes the job (cancelling generation) if the client leaves."""
        assert job.events is not None
        order = {r.request_id: i for i, r in enumerate(job.requests)}
        choices = [_StreamedChoice(self.tokenizer, params) for _ in range(len(job.requests) * params.n)]
        try:
            for delta in fmt.opening_deltas(len(choices)):
                yield _sse({**head, "choices": [delta]})
            while (event := await job.events.get()) is not None:
                index = order[event.request_id] * params.n + event.sample_index
                if (chunk := self._on_token(fmt, index, choices[index], event)) is not None:
                    yield _sse({**head, "choices": [chunk]})
            results = await job.results()
            # Samples whose tokens were not all reported (no hook) finish from their trajectories.
            for p, trajectories in enumerate(results):
                for s, trajectory in enumerate(trajectories):
                    index = p * params.n + s
                    if (chunk := self._catch_up(fmt, index, choices[index], trajectory)) is not None:
                        yield _sse({**head, "choices": [chunk]})
            if include_usage:
                completion_tokens = sum(c.token_count for c in choices)
                usage = _usage(sum(len(r.prompt_ids) for r in job.requests), completion_tokens)
                yield _sse({**head, "choices": [], "usage": usage})
        except ApiError as exc:  # headers are sent: the error travels as a chunk (vLLM's convention)
            yield _sse(exc.body())
        finally:  # also when the client left: starlette then cancels this generator
            self._close(job)
        yield _sse("[DONE]")

    def _close(self, job: _Job) -> None:
        if job.close():
            self.stats.cancelled_requests += 1
            logger.info("client left: cancelled request %s", job.requests[0].request_id)

    def _on_token(self, fmt: _Format, index: int, choice: _StreamedChoice, event: TokenEvent) -> Json | None:
        token = _TokenLogprob(event.token_id, event.logprob, event.top_logprobs)
        if event.finish_reason is not None:
            # Not pushed first: the text up to a stop string's start may only be sent once cut.
            choice.add(token)
            text = choice.finish(event.finish_reason, event.stop_reason)
            return fmt.delta(index, text, choice.take_pending(), event.finish_reason, event.stop_reason)
        text = choice.push(token)
        if not text:
            return None  # nothing printable yet; its logprobs ride with the next chunk
        return fmt.delta(index, text, choice.take_pending(), None, None)

    def _catch_up(self, fmt: _Format, index: int, choice: _StreamedChoice, trajectory: Trajectory) -> Json | None:
        if choice.finish_reason is not None:
            return None
        for token in _token_records(trajectory)[choice.token_count :]:
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
        conversation = [_message_dict(i, m) for i, m in enumerate(messages)]

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
        if params.logprobs is not None and params.logprobs > limits.max_logprobs:
            raise refuse("logprobs", f"{params.logprobs} exceeds this server's limit of {limits.max_logprobs} "
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
            raise _value_error(exc, prefix=prefix) from None

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


def _prompt_items(prompt: str | list[Any]) -> list[str | list[Any]]:
    """The prompts of a completion request: a text, or a list of texts or token-id lists, or one
    token-id list. Only the outer shape is checked here; the ids are checked once bounded."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):  # one prompt of token ids
        return [prompt]
    for position, item in enumerate(prompt):
        if not isinstance(item, (str, list)):
            where = f"prompt.{position}"
            raise ApiError(400, f"{where}: must be a string or a list of token ids", where)
    return prompt


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
    _install_error_handlers(app)
    body_bytes = limits.max_request_bytes or default_request_bytes(max_model_len)
    app.add_middleware(RequestGuard, host_check=host_check, max_body_bytes=body_bytes)
    # response_model=None: answers are built as plain JSON already; no second validation pass.
    app.get("/health", response_model=None)(server.health)
    app.get("/stats", response_model=None)(server.server_stats)
    app.get("/v1/models", response_model=None)(server.models)
    app.post("/v1/completions", response_model=None)(server.completions)
    app.post("/v1/chat/completions", response_model=None)(server.chat_completions)
    app.post("/generate", response_model=None)(server.generate_tokens)
    return app


# ---------------------------------------------------------------------------------------- launching


class ServeError(Exception):
    """A reason ``hybridflow serve`` cannot start, as one line: what failed, where, and the fix."""


def chat_template_source(model_dir: Path) -> str:
    """Where transformers read the default chat template of ``model_dir`` from: the file to fix."""
    jinja = model_dir / "chat_template.jinja"  # takes priority over tokenizer_config.json's entry
    return str(jinja) if jinja.is_file() else f"{model_dir / 'tokenizer_config.json'}'s chat_template"


def check_chat_template(tokenizer: Any, source: str) -> None:
    """Render the tokenizer's chat template on small conversations (``TEMPLATE_PROBES``) as a chat
    request would be; ``ServeError`` naming ``source`` when it renders none. No template: chat
    requests get a 400 saying so, and completions work, so there is nothing to check."""
    if getattr(tokenizer, "chat_template", None) is None:
        logger.info("the model has no chat template: /v1/chat/completions answers 400, /v1/completions works")
        return
    first: Exception | None = None
    for conversation in TEMPLATE_PROBES:
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            tokenizer.encode(text, add_special_tokens=False)
            return
        except Exception as exc:  # jinja's syntax and runtime errors, raise_exception, anything a template does
            first = first or exc
    assert first is not None
    line = getattr(first, "lineno", None)  # jinja's TemplateSyntaxError knows the template line
    where = f" at line {line}" if line else ""
    raise ServeError(
        f"the chat template in {source} cannot render a one-message conversation: {type(first).__name__}{where}: "
        f"{_one_line(first).rstrip('.')}; fix the template (or delete it to serve /v1/completions only)"
    ) from first


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, short enough to read (library messages can be pages)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def check_serve_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """``model_dir`` if it is a local HF model directory; otherwise ``ServeError``."""
    path = Path(model_dir).expanduser()
    fix = "point it at a Hugging Face model directory (config.json, *.safetensors, tokenizer files) or use builtin:tiny"
    if not path.is_dir():
        raise ServeError(f"model_dir {str(model_dir)!r} is not a local directory (hybridflow never downloads); {fix}")
    if not (path / "config.json").is_file():
        raise ServeError(f"model_dir {str(path)!r} has no config.json; {fix}")
    return path


def build_server_engine(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_model_len: int | None = None,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = None,
) -> tuple[NativeEngine, Any, int]:
    """Load a local HF directory: the engine, its tokenizer, and the context length it serves.

    What a user can get wrong (the directory, its files, the engine settings) raises ``ServeError``;
    the library's own exception is logged at debug level.
    """
    from transformers import AutoTokenizer

    path = check_serve_model_dir(model_dir)
    if max_model_len is not None and max_model_len < 2:
        raise ServeError(f"--max-model-len {max_model_len} leaves no room for a prompt and a token; use 2 or more")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for bad files
        logger.debug("tokenizer load failed", exc_info=True)
        raise ServeError(
            f"cannot load the tokenizer from {path}: {_one_line(exc)}; the directory needs the model's "
            "tokenizer files (tokenizer.json or tokenizer_config.json)"
        ) from exc
    check_chat_template(tokenizer, chat_template_source(path))  # before the weights: seconds, not minutes
    try:
        model = load_causal_lm(path, dtype=resolve_dtype(dtype), device=device)
        eos = eos_token_ids(path, tokenizer)
    except Exception as exc:
        logger.debug("model load failed", exc_info=True)
        raise ServeError(
            f"cannot load the model from {path}: {_one_line(exc)}; the directory needs config.json and "
            "*.safetensors weights of a causal LM the native engine supports (hybridflow/inference/families.py)"
        ) from exc
    pad = tokenizer.pad_token_id
    max_model_len = max_model_len or int(model.config.max_position_embeddings)
    try:
        engine = NativeEngine(
            model=model,
            eos_token_ids=eos,
            pad_token_id=eos[0] if pad is None else int(pad),
            max_batch_size=max_batch_size,
            device=device,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
        )
    except (ValueError, NotImplementedError) as exc:  # unsupported architecture, bad sizes
        logger.debug("engine start failed", exc_info=True)
        raise ServeError(
            f"cannot serve the model in {path}: {_one_line(exc)}; check --max-batch-size, --max-model-len "
            "and --dtype"
        ) from exc
    return engine, tokenizer, max_model_len


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable from outside


def warn_if_exposed(host: str) -> bool:
    """Log a loud warning when ``host`` is not a loopback address; True if it is exposed."""
    if is_loopback(host):
        return False
    logger.warning(
        "!!! hybridflow serve is listening on %s: anyone who can reach this address can use the model. "
        "The server has no authentication; bind 127.0.0.1 and use an SSH tunnel or a proxy instead. !!!",
        host,
    )
    return True


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), or ``ServeError`` saying why not.

    Bound before the model loads, so a taken port fails in a second rather than after the load.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, OverflowError, UnicodeError) as exc:
        raise ServeError(f"cannot listen on --host {host!r} --port {port}: {_one_line(exc)}; use an address "
                         "of this machine (127.0.0.1 by default) and a port in 0-65535") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn does: restarts do not wait
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror or _one_line(exc)}; pick another --port or stop "
            "the process that uses it"
        ) from exc
    return sock


def serve(
    model_dir: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info",
    limits: ServerLimits | None = None,
    allowed_hosts: Collection[str] = (),
    **engine_kwargs: Any,
) -> None:
    """Load the model and serve it with uvicorn until interrupted (``hybridflow serve``).

    Raises ``ServeError`` (one line) for what the user can fix: the directory, the port, settings.
    """
    import uvicorn

    check_serve_model_dir(model_dir)
    sock = bind_socket(host, port)
    try:
        engine, tokenizer, max_model_len = build_server_engine(model_dir, **engine_kwargs)
        app = create_app(
            engine,
            tokenizer,
            model_name=served_model_name or str(model_dir),
            max_model_len=max_model_len,
            limits=limits,
            host_check=host_check_for(host, allowed_hosts),
        )
        warn_if_exposed(host)  # last thing before the "serving on" line, where it is seen
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        logger.info("hybridflow serve: %s on http://%s:%d/v1", served_model_name or model_dir, shown, bound_port)
        uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
    finally:
        sock.close()


class ServerThread:
    """An app served by uvicorn on ``host`` (a free port) in a daemon thread with its own event
    loop: how a rollout replica serves its engine over HTTP (``rollout.mode=server``) while its
    worker goes on taking the controller's calls. The engine then runs on that thread's loop only.

    Start-up is bounded (``start_timeout_s``): a server that is not answering by then is an error
    naming ``name``, not a hang. ``close`` stops it and waits for the thread.
    """

    def __init__(self, app: FastAPI, *, name: str, host: str = "127.0.0.1", start_timeout_s: float = 30.0) -> None:
        import threading

        import uvicorn

        self.name = name
        self._sock = bind_socket(host, 0)
        bound_host, port = self._sock.getsockname()[:2]
        self.url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{port}"
        # No access log: a training step makes hundreds of requests.
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"server-{name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                why = f": {_one_line(self._error)}" if self._error is not None else f" within {start_timeout_s:g} s"
                raise ServeError(f"{name}: the HTTP server did not start{why}")
            time.sleep(0.01)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as error:  # reported by __init__ (start-up) or logged (later)
            self._error = error
            logger.exception("%s: the HTTP server stopped", self.name)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
