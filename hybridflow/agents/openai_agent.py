"""The ``openai`` agent loop: a user's black-box agent, written against the OpenAI API, trained on.

The user's function (``rollout.multi_turn.openai_agent``, ``module:function`` or
``path/to/file.py:function``) gets one ``OpenAIEpisode`` and returns the episode's reward::

    def run_episode(episode: OpenAIEpisode) -> float | dict:      # or ``async def``
        client = OpenAI(base_url=episode.base_url, api_key=episode.api_key)
        reply = client.chat.completions.create(model=episode.model, messages=episode.messages,
                                               tools=episode.tools or None)
        ...
        return score            # or {"score": score, "other": 1.0}: the other numbers are logged

Every completion the function makes goes to this process's ``EpisodeServer`` (``openai_server``)
and is recorded token by token; when the function returns, the episode's tokens become one
``Trajectory`` (``openai_episode`` says how requests are stitched), carrying the returned reward
in ``Trajectory.agent.reward``, which the reward role uses instead of the rule scorer.

``async def`` functions are awaited on the episode's event loop; plain functions run in a daemon
thread of their own, so they can use the synchronous ``OpenAI`` client (and a hung one cannot keep
the process from exiting). An episode has ``timeout_s``; a function that raises, times out or
returns no number gets reward 0, is counted (``agent_errors`` / ``agent_timeouts``) and the step
goes on. A hung *async* function that never yields to its loop cannot be interrupted: keep
blocking work in plain functions.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import logging
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.agents.base import (
    PROMPT_MESSAGES_KEY,
    AgentContext,
    GenerateEngine,
    episode_metrics,
)
from hybridflow.agents.openai_episode import EpisodeRecord
from hybridflow.agents.parsers import build_tool_parser
from hybridflow.agents.registry import resolve_object
from hybridflow.types import AgentEpisode, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

OPENAI_LOOP = "openai"  # this loop's AGENT_LOOPS name
MODEL_NAME = "hybridflow-policy"  # what ``GET /models`` lists; requests may name any model
API_KEY = "hybridflow"  # not checked: the episode's URL is its capability


@dataclass(frozen=True)
class OpenAIEpisode:
    """What the user's agent function gets for one episode."""

    base_url: str  # http://127.0.0.1:<port>/episodes/<id>/v1, for OpenAI(base_url=...)
    api_key: str  # any string works; given so clients that insist on one are satisfied
    model: str  # the name to pass as model= (any name is served by the policy)
    messages: list[dict[str, Any]]  # the row's prompt as chat messages
    tools: list[dict[str, Any]]  # rollout.multi_turn.tool_config_path's tools as OpenAI schemas (may be empty)
    metadata: dict[str, Any]  # the row's fields: data_source, ground_truth, ability, extra_info, source
    max_tokens: int  # the response budget of the whole episode (every completion and inserted message)
    episode_id: str = ""


AgentFunction = Callable[[OpenAIEpisode], Any]


def load_agent_function(spec: str) -> AgentFunction:
    """The function at ``module:function`` or ``path/to/file.py:function``, checked to take one
    argument. Raises ValueError or TypeError saying what is wrong with ``spec``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{spec!r} is not 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        module = _import_file(Path(target).expanduser().resolve())
        fn = getattr(module, name, None)
        if fn is None:
            raise ValueError(f"{spec!r}: {target} defines no {name!r}")
    else:
        fn = resolve_object(spec, "openai agent function")
    if not callable(fn) or inspect.isclass(fn):
        raise TypeError(f"{spec!r} is not a function: {fn!r}")
    try:
        inspect.signature(fn).bind(None)
    except TypeError as error:
        raise TypeError(f"{spec!r} cannot be called as {name}(episode): {error}") from None
    except ValueError:
        pass  # no introspectable signature
    return fn


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise ValueError(f"{file} is not a file")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    module_name = f"hybridflow_openai_agent_{''.join(c if c.isalnum() else '_' for c in file.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{file} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        sys.modules.pop(module_name, None)
        raise ValueError(f"importing {file} raised {type(error).__name__}: {error}") from error
    return module


def parse_reward(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, extra numbers)`` from what the function returned: a number, or a dict with a
    numeric ``"score"`` (its other numeric values are the extras). Raises ValueError otherwise."""
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"the returned dict has no 'score' key (keys: {sorted(value)})")
        extra = {str(k): float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"the reward must be a finite number or a dict with a 'score', got {value!r}")
    return float(value), extra


@dataclass
class _Outcome:
    reward: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # "error" | "timeout" | None


class OpenAIAgentLoop:
    """Runs the configured agent function once per episode (see the module docstring)."""

    # The user's function is the whole agent: as the default loop it runs every row, whatever
    # agent_name the dataset gives (the built-in calculator rows name tool_agent, for one).
    runs_every_row = True
    _server: Any = None  # one EpisodeServer per process, shared by every loop
    _server_lock = threading.Lock()

    def __init__(self, context: AgentContext) -> None:
        if not context.openai_agent:
            raise ValueError("the openai agent loop needs rollout.multi_turn.openai_agent (module:function)")
        self.context = context
        self.function = load_agent_function(context.openai_agent)
        self.parser = build_tool_parser(context.tool_parser)
        self.timeout_s = context.openai_timeout_s

    @classmethod
    def server(cls) -> Any:
        """The process's episode server, started on first use."""
        with cls._server_lock:
            if cls._server is None:
                from hybridflow.agents.openai_server import EpisodeServer  # FastAPI only when this loop runs

                server = EpisodeServer()
                server.start()
                cls._server = server
            return cls._server

    async def run(
        self, prompt_ids: list[int], metadata: dict[str, Any], params: SamplingParams, engine: GenerateEngine
    ) -> Trajectory:
        from hybridflow.agents.openai_server import LiveEpisode

        messages = metadata.get(PROMPT_MESSAGES_KEY)
        if not isinstance(messages, list):
            raise ValueError(f"the openai agent loop needs the row's chat messages in metadata[{PROMPT_MESSAGES_KEY!r}] "
                             "(data.return_raw_chat=true keeps them)")
        server = self.server()
        record = EpisodeRecord(self.context.tokenizer, self.parser, params.max_tokens,
                               template_kwargs=self.context.chat_template_kwargs)
        live = LiveEpisode(record, engine, asyncio.get_running_loop(), params, MODEL_NAME)
        episode_id = server.register(live)
        row = {k: v for k, v in metadata.items() if k != PROMPT_MESSAGES_KEY}
        episode = OpenAIEpisode(
            base_url=server.base_url(episode_id), api_key=API_KEY, model=MODEL_NAME,
            messages=[dict(m) for m in messages], tools=self.context.tool_schemas(), metadata=row,
            max_tokens=params.max_tokens, episode_id=episode_id,
        )
        try:
            outcome = await self._call(episode)
        finally:
            server.unregister(episode_id)
        return self._trajectory(record, prompt_ids, outcome)

    async def _call(self, episode: OpenAIEpisode) -> _Outcome:
        """The function's reward, or reward 0 and why it failed; never raises (but on cancel)."""
        try:
            value = await asyncio.wait_for(self._invoke(episode), self.timeout_s)
            reward, extra = parse_reward(value)
            return _Outcome(reward, extra)
        except asyncio.TimeoutError:
            logger.warning("openai agent episode %s: no result after %.0f s; reward 0", episode.episode_id, self.timeout_s)
            return _Outcome(failure="timeout")
        except Exception as error:
            logger.warning("openai agent episode %s failed; reward 0: %s: %s", episode.episode_id,
                           type(error).__name__, error, exc_info=error)
            return _Outcome(failure="error")

    async def _invoke(self, episode: OpenAIEpisode) -> Any:
        if inspect.iscoroutinefunction(self.function):
            return await self.function(episode)
        result = await _in_daemon_thread(self.function, episode)
        return await result if inspect.isawaitable(result) else result

    def _trajectory(self, record: EpisodeRecord, row_prompt: list[int], outcome: _Outcome) -> Trajectory:
        with record.lock:
            record.closed = True
            # No request made: the row's own prompt (the dataset's rendering) and an empty response.
            prompt = list(record.prompt_ids) or list(row_prompt)
            counters = {
                "history_rewrites": float(record.history_rewrites),
                "agent_errors": float(outcome.failure == "error"),
                "agent_timeouts": float(outcome.failure == "timeout"),
            }
            agent_metrics = {**episode_metrics(record.completions, record.tool_calls), **counters}
            stop = {"error": "agent_error", "timeout": "agent_timeout"}.get(outcome.failure or "", "agent_returned")
            return Trajectory(
                prompt_ids=prompt,
                response_ids=list(record.response_ids),
                loss_mask=list(record.loss_mask),
                rollout_logprobs=list(record.rollout_logprobs),
                token_versions=None if record.token_versions is None else list(record.token_versions),
                finish_reason=record.finish_reason,
                num_turns=record.completions,
                # Named here: this loop runs every row, over the row's own agent_name.
                agent=AgentEpisode(name=OPENAI_LOOP, metrics=agent_metrics, stop=stop, reward=outcome.reward,
                                   reward_extra=outcome.extra),
            )


async def _in_daemon_thread(function: AgentFunction, episode: OpenAIEpisode) -> Any:
    """``function(episode)`` in a daemon thread; awaiting it can be cancelled (the thread is then
    abandoned: Python cannot stop it, but being a daemon it cannot block the process's exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            result: Any = function(episode)
            outcome = (future.set_result, result)
        except BaseException as error:  # reported to the episode, not raised in a stray thread
            outcome = (future.set_exception, error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the episode was given up long ago
            pass

    threading.Thread(target=target, name=f"openai-agent-{episode.episode_id[:8]}", daemon=True).start()
    return await future
