"""The OpenAI-compatible HTTP server the ``openai`` agent loop puts in front of the rollout engine.

One server per process (the rollout worker's), on ``127.0.0.1`` and a free port, in a daemon
thread with its own event loop. Each episode gets its own base URL,
``http://127.0.0.1:<port>/episodes/<episode id>/v1``, so every call is charged to its episode
whatever client the agent uses; the id is random (128 bits), so it also keeps other local
processes from writing into a run's episodes.

Endpoints under that base URL: ``POST /chat/completions`` (messages, tools, max_tokens or
max_completion_tokens, stop, logprobs), ``POST /completions`` (a text prompt) and
``GET /models``. ``stream=true`` and ``n>1`` are refused with OpenAI's 400 error body naming the
field. Sampling parameters sent by the client (temperature, top_p, seed, ...) are ignored: the
episode's training parameters apply, because RL needs the samples to come from the distribution
it trains on.

Generation goes through the engine's ``generate`` on the event loop the episode runs on (the
engine serves one loop; the server's own loop only parses, stitches and answers), so any
engine that satisfies ``GenerateEngine`` works. Stitching is ``openai_episode.EpisodeRecord``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.openai_episode import Completion, EpisodeRecord, Prepared
from hybridflow.types import GenerationRequest, SamplingParams
from hybridflow.utils.seed import derive_seed

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
except ImportError as exc:  # an optional extra, like ``hybridflow serve``
    raise ImportError("the openai agent loop needs FastAPI and uvicorn: pip install 'hybridflow[serve]'") from exc

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"  # loopback only: the agents run in this process
_START_TIMEOUT_S = 30.0


class ApiError(Exception):
    """A refusal in OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
        return JSONResponse(body, status_code=self.status)


@dataclass
class LiveEpisode:
    """An episode the server answers for: its record, and where and how to generate."""

    record: EpisodeRecord
    engine: Any  # a GenerateEngine
    loop: asyncio.AbstractEventLoop  # the loop the episode (and the engine) run on
    params: SamplingParams  # the episode's training sampling parameters
    model: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time per episode
    in_flight: set[concurrent.futures.Future] = field(default_factory=set)


class EpisodeServer:
    """The HTTP server and the episodes it serves (see the module docstring)."""

    def __init__(self) -> None:
        self._episodes: dict[str, LiveEpisode] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> None:
        """Start serving (once; later calls return at once)."""
        with self._lock:
            if self._thread is not None:
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            self.port = sock.getsockname()[1]
            config = uvicorn.Config(build_app(self), host=HOST, log_level="warning", access_log=False, lifespan="off")
            self._server = uvicorn.Server(config)
            server = self._server
            self._thread = threading.Thread(
                target=lambda: asyncio.run(server.serve(sockets=[sock])), name="openai-agent-server", daemon=True
            )
            self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the openai agent server did not start on {HOST}:{self.port}")
            time.sleep(0.01)

    def close(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5.0)

    def base_url(self, episode_id: str) -> str:
        return f"http://{HOST}:{self.port}/episodes/{episode_id}/v1"

    def register(self, episode: LiveEpisode) -> str:
        """Serve ``episode`` under a new random id; returns the id."""
        episode_id = uuid.uuid4().hex
        with self._lock:
            self._episodes[episode_id] = episode
        return episode_id

    def unregister(self, episode_id: str) -> None:
        """Stop serving the episode: later requests get a 404, a generation in flight is cancelled
        (its sequences leave the engine's batch) and nothing more is recorded."""
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is None:
            return
        with episode.record.lock:
            episode.record.closed = True
        for future in list(episode.in_flight):
            future.cancel()

    def episode(self, episode_id: str) -> LiveEpisode:
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise ApiError(404, f"no running episode {episode_id!r} (it ended, or the URL is wrong)", kind="not_found_error")
        return episode

    # ------------------------------------------------------------------ generation
    async def complete(
        self, episode_id: str, prepare: Callable[[EpisodeRecord], Prepared], parse_tools: bool, stop: list[str]
    ) -> tuple[Completion, int]:
        """Stitch a request with ``prepare(record)``, generate, record; the answer and the number
        of prompt tokens it was generated from."""
        episode = self.episode(episode_id)
        record = episode.record
        async with episode.lock:
            with record.lock:
                if record.closed:
                    raise ApiError(404, f"episode {episode_id!r} has ended", kind="not_found_error")
                prepared = prepare(record)
                if prepared.max_tokens == 0:
                    return record.record_spent(), len(prepared.prompt_ids)
                index = record.completions
            sample = await self._generate(episode, prepared.prompt_ids, prepared.max_tokens, index, stop, episode_id)
            with record.lock:
                if record.closed:
                    raise ApiError(404, f"episode {episode_id!r} ended during this request", kind="not_found_error")
                stop_token = sample.finish_reason == "stop" and not isinstance(sample.stop_reason, str)
                completion = record.record(
                    list(sample.response_ids), list(sample.rollout_logprobs), sample.finish_reason, stop_token,
                    parse_tools, versions=sample.token_versions,
                )
        return completion, len(prepared.prompt_ids)

    async def _generate(
        self, episode: LiveEpisode, prompt_ids: list[int], max_tokens: int, index: int, stop: list[str], episode_id: str
    ) -> Any:
        base = episode.params
        # Each completion of an episode gets its own seed derived from the episode's, as the tool agent's turns do.
        seed = None if base.seed is None else derive_seed(base.seed, index)
        params = dataclasses.replace(base, n=1, max_tokens=max_tokens, seed=seed, stop=list(stop), logprobs=None)
        request = GenerationRequest(prompt_ids=prompt_ids, params=params, request_id=f"{episode_id}-{index}")
        try:
            future = asyncio.run_coroutine_threadsafe(episode.engine.generate(request), episode.loop)
        except RuntimeError as error:  # the episode's loop is closed: the batch is over
            raise ApiError(503, f"episode {episode_id!r} is no longer running: {error}", kind="server_error") from None
        episode.in_flight.add(future)
        try:
            (sample,) = await asyncio.wrap_future(future)
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            raise ApiError(404, f"episode {episode_id!r} ended during this request", kind="not_found_error") from None
        except ValueError as error:  # the engine refused the request (a stop string it cannot match, ...)
            raise ApiError(400, f"the engine refused the request: {error}") from None
        finally:
            episode.in_flight.discard(future)
        return sample


# ---------------------------------------------------------------------- HTTP
def build_app(server: EpisodeServer) -> FastAPI:
    app = FastAPI(title="hybridflow openai agent server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # The agent sees OpenAI's error body (its client raises); the run's log keeps the traceback.
        logger.error("openai agent server: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error").response()

    @app.get("/episodes/{episode_id}/v1/models")
    async def models(episode_id: str) -> dict[str, Any]:
        episode = server.episode(episode_id)
        return {"object": "list", "data": [{"id": episode.model, "object": "model", "created": 0, "owned_by": "hybridflow"}]}

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, request: Request) -> JSONResponse:
        episode = server.episode(episode_id)
        body = await _body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of message objects", "messages")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list of tool objects", "tools")
        max_tokens = _max_tokens(body)
        completion, prompt_tokens = await server.complete(
            episode_id, lambda record: record.prepare(messages, tools, max_tokens), bool(tools), _stop(body)
        )
        tokenizer = episode.record.tokenizer if body.get("logprobs") else None
        return JSONResponse(_chat_response(completion, prompt_tokens, tokenizer, str(body.get("model") or episode.model)))

    @app.post("/episodes/{episode_id}/v1/completions")
    async def completions(episode_id: str, request: Request) -> JSONResponse:
        episode = server.episode(episode_id)
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be one non-empty string (token-id and batched prompts are not "
                                "supported)", "prompt")
        max_tokens = _max_tokens(body, default=16)
        completion, prompt_tokens = await server.complete(
            episode_id, lambda record: record.prepare_text(prompt, max_tokens), False, _stop(body)
        )
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": str(body.get("model") or episode.model),
            "choices": [{"index": 0, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": None}],
            "usage": _usage(prompt_tokens, len(completion.token_ids)),
        })

    return app


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise ApiError(400, "stream=true is not supported by the hybridflow agent server; send non-streaming requests",
                       "stream")
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"n={n}: the hybridflow agent server returns one choice per request (n=1)", "n")
    return body


def _max_tokens(body: dict[str, Any], default: int | None = None) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"'{key}' must be an integer >= 1, got {value!r}", key)
        return value
    return default


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ApiError(400, "'stop' must be a string or a list of strings", "stop")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_response(completion: Completion, prompt_tokens: int, tokenizer: Any | None, model: str) -> dict[str, Any]:
    """OpenAI's chat.completion object; per-token logprobs when ``tokenizer`` is given (asked for)."""
    message = completion.message()
    if completion.tool_calls:
        for index, call in enumerate(message["tool_calls"]):
            call["id"] = f"call_{uuid.uuid4().hex[:24]}_{index}"
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": completion.finish_reason, "logprobs": None}
    if tokenizer is not None:
        choice["logprobs"] = {"content": [
            {"token": (text := tokenizer.decode([token], skip_special_tokens=False)), "logprob": logprob,
             "bytes": list(text.encode()), "top_logprobs": []}
            for token, logprob in zip(completion.token_ids, completion.logprobs)
        ]}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [choice], "usage": _usage(prompt_tokens, len(completion.token_ids)),
    }
