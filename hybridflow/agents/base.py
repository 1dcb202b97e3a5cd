"""The agent-loop protocol, the loop registry, and the runner the rollout worker calls.

An agent loop turns one dataset row into one trajectory by talking to the rollout engine,
possibly over several turns. Every loop returns the same flat per-token ``Trajectory``: the
model's tokens carry ``loss_mask`` 1 and their rollout logprobs, inserted tokens (tool
responses, user turns, template glue) carry ``loss_mask`` 0 and logprob 0.0.

What a loop records of its episode is typed: ``Trajectory.agent``, an ``AgentEpisode``:

- ``name``: the loop that ran it (the runner fills it in when the loop leaves it empty);
- ``metrics``: per-episode numbers, ``{"num_turns", "tool_calls", "tool_errors",
  "tool_timeouts", "user_turns"}`` (floats), aggregated by ``compute_agent_metrics``;
- ``messages`` (multi-turn loops): the turns added after the prompt, as chat messages;
- ``stop``: why the episode ended ("no_tool_call", "max_assistant_turns", "length",
  "interaction_done", "engine_<finish_reason>");
- ``interaction_reward``: the last reward an interaction gave, when it gave one;
- ``reward`` (and ``reward_extra``, its extra numbers): the reward the agent itself gave (the
  ``openai`` loop: what the user's function returned). The reward role uses it instead of the
  rule scorer.

The row's fields reach a loop as the ``metadata`` dict of its ``run`` (verl's row keys:
``data_source``, ``ground_truth``, ``extra_info``, ...; ``RowFields.as_dict``); ``prompt_messages``
is the row's prompt as chat messages (the ``openai`` loop hands them to the user's agent). The
trajectory refers to the row itself (``Trajectory.row``), set by the runner, not by the loop.

How the rollout worker runs a batch::

    runner = AgentRunner(AgentContext(tokenizer, tools=load_tool_config(path)), default_agent="single_turn")
    trajectories = await runner.generate(rows, params, engine)   # or runner.generate_sync(...)
    metrics = compute_agent_metrics(trajectories)

``rows`` are ``AgentRow(prompt_ids, fields, group_id)``; each row runs ``params.n`` episodes
(one GRPO group), all rows' episodes concurrently against the engine, and the trajectories come
back row by row, sample by sample, with the row's fields and ``group_id``. ``params.max_tokens`` is the
response budget of a whole episode (every turn's tokens plus inserted ones).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybridflow.agents.interactions import Interaction
from hybridflow.agents.registry import resolve_object
from hybridflow.agents.tokens import ChatTokenizer
from hybridflow.agents.tools import ToolRegistry
from hybridflow.rewards.sandbox import run_coroutine_sync
from hybridflow.types import AgentEpisode, GenerationRequest, RowFields, Sample, SamplingParams, Trajectory
from hybridflow.utils.aio import all_or_nothing
from hybridflow.utils.seed import derive_seed


# Metric names (``area/name``), the one spelling for trackers and dashboards.
METRIC_NUM_TURNS_MEAN = "num_turns/mean"
METRIC_NUM_TURNS_MAX = "num_turns/max"
METRIC_NUM_TURNS_MIN = "num_turns/min"
METRIC_TOOL_CALLS_MEAN = "tool_calls/mean"
METRIC_TOOL_CALLS_MAX = "tool_calls/max"
METRIC_TOOL_ERROR_RATE = "tool_calls/error_rate"  # per call: malformed, unknown tool, bad arguments, raised
METRIC_TOOL_TIMEOUT_RATE = "tool_calls/timeout_rate"  # per call
# Share of response tokens with loss mask 0 (tool replies, user turns, template glue): tokens the
# policy did not produce, left out of the loss.
METRIC_MASKED_TOKEN_FRACTION = "response_length/masked_fraction"
# The ``openai`` loop (black-box agents): requests that rewrote the recorded history (per batch),
# and the share of episodes whose function raised or ran out of time (reward 0).
METRIC_OPENAI_HISTORY_REWRITES = "agent/openai/history_rewrites"
METRIC_OPENAI_ERROR_RATE = "agent/openai/error_rate"
METRIC_OPENAI_TIMEOUT_RATE = "agent/openai/timeout_rate"

# Keys of the row's ``metadata`` dict a loop's ``run`` takes (``RowFields.as_dict``).
AGENT_NAME_KEY = "agent_name"
PROMPT_MESSAGES_KEY = "prompt_messages"

# Config ``agent_name`` (dataset column) -> ``module:Class``. A class is built as
# ``Class(context: AgentContext)`` and has ``async run(prompt_ids, metadata, params, engine)``.
AGENT_LOOPS: dict[str, str] = {
    "single_turn": "hybridflow.agents.single_turn:SingleTurnAgentLoop",
    "single_turn_agent": "hybridflow.agents.single_turn:SingleTurnAgentLoop",  # verl's name, in its datasets
    "tool_agent": "hybridflow.agents.tool_agent:ToolAgentLoop",
    "openai": "hybridflow.agents.openai_agent:OpenAIAgentLoop",  # the user's agent, over an OpenAI API
}
DEFAULT_AGENT = "single_turn"


class GenerateEngine(Protocol):
    """The part of ``hybridflow.rollout.RolloutEngine`` a loop uses. ``agents/`` and
    ``rollout/`` are siblings in the layering, so the loops name the one method they call
    instead of importing the protocol; every rollout engine satisfies it."""

    async def generate(self, request: GenerationRequest) -> list[Trajectory]: ...


@runtime_checkable
class AgentLoop(Protocol):
    async def run(
        self, prompt_ids: list[int], metadata: dict[str, Any], params: SamplingParams, engine: GenerateEngine
    ) -> Trajectory:
        """One episode from a chat-templated prompt. ``params.n`` is 1 (the runner expands
        groups); ``params.max_tokens`` bounds the whole response; ``params.seed``, when set,
        is this episode's own. The trajectory's ``num_turns`` counts assistant turns."""
        ...


@dataclass
class AgentContext:
    """What the built-in loops are built from (the trainer fills it from
    ``rollout.multi_turn.*``). One context, and one loop per name, serve every episode."""

    tokenizer: ChatTokenizer
    tools: ToolRegistry | None = None
    tool_parser: str = "hermes"  # a TOOL_PARSERS name or module:Class
    max_assistant_turns: int = 5
    max_user_turns: int = 5  # interaction replies per episode
    # verl's max_user_turns (rollout.multi_turn.max_user_turns): turns of tool replies and interaction
    # replies together; once this many happened the episode ends after the next assistant turn. None: no bound.
    max_reply_turns: int | None = None
    max_parallel_tool_calls: int = 8  # calls per turn; more are answered with an error
    interaction: Interaction | None = None
    openai_agent: str | None = None  # the openai loop's function: module:function or file.py:function
    openai_timeout_s: float = 300.0  # the openai loop's limit per episode
    # data.apply_chat_template_kwargs: the template's variables, on every turn as on the prompt.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_assistant_turns", "max_user_turns", "max_parallel_tool_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentContext.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_reply_turns is not None and self.max_reply_turns < 0:
            raise ValueError(f"AgentContext.max_reply_turns must be >= 0, got {self.max_reply_turns}")

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The schemas the prompt's chat template must be rendered with (``tools=``)."""
        return self.tools.schemas() if self.tools is not None else []


def agent_loop_class(name: str) -> type:
    """The class registered as ``name`` (``AGENT_LOOPS``), or at ``module:Class``, checked to be
    a class with an ``async def run`` *before* anything calls it: a row naming ``os:system``
    must not get ``os.system(context)`` run."""
    loop_class = resolve_object(AGENT_LOOPS.get(name, name), "agent loop", known=AGENT_LOOPS)
    if not inspect.isclass(loop_class) or not asyncio.iscoroutinefunction(getattr(loop_class, "run", None)):
        raise TypeError(
            f"agent loop {name!r} ({loop_class!r}) is not a class or has no async run(prompt_ids, metadata, params, "
            f"engine)"
        )
    return loop_class


def build_agent_loop(name: str, context: AgentContext) -> AgentLoop:
    """The loop registered as ``name`` (``AGENT_LOOPS``), or the class at ``module:Class``."""
    loop_class = agent_loop_class(name)
    loop = loop_class(context)
    if not isinstance(loop, AgentLoop) or not asyncio.iscoroutinefunction(loop.run):
        raise TypeError(f"agent loop {name!r} ({loop_class!r}) has no async run(prompt_ids, metadata, params, engine)")
    return loop


def agent_name_of(row: RowFields | None, default: str = DEFAULT_AGENT) -> str:
    """The row's ``agent_name`` (its own, or inside ``extra_info``), else ``default``."""
    if row is None:
        return default
    extra = row.extra_info
    name = row.agent_name or (extra.get(AGENT_NAME_KEY) if isinstance(extra, dict) else None)
    return str(name) if name else default


def episode_metrics(
    num_turns: int, tool_calls: int = 0, tool_errors: int = 0, tool_timeouts: int = 0, user_turns: int = 0
) -> dict[str, float]:
    """The ``agent_metrics`` record of one episode."""
    return {
        "num_turns": float(num_turns),
        "tool_calls": float(tool_calls),
        "tool_errors": float(tool_errors),
        "tool_timeouts": float(tool_timeouts),
        "user_turns": float(user_turns),
    }


def compute_agent_metrics(trajectories: Sequence[Sample]) -> dict[str, float]:
    """``num_turns/{mean,max,min}``, ``tool_calls/{mean,max}`` (per episode) and the tool
    error and timeout rates (per call) over a batch."""
    if not trajectories:
        return {}
    turns = [float(t.num_turns) for t in trajectories]
    records = [t.agent.metrics if t.agent is not None else {} for t in trajectories]
    calls = [r.get("tool_calls", 0.0) for r in records]
    total_calls = sum(calls)
    tokens = sum(t.response_length for t in trajectories)
    masked = sum(t.response_length - t.policy_tokens for t in trajectories)
    return {
        METRIC_NUM_TURNS_MEAN: sum(turns) / len(turns),
        METRIC_NUM_TURNS_MAX: max(turns),
        METRIC_NUM_TURNS_MIN: min(turns),
        METRIC_TOOL_CALLS_MEAN: total_calls / len(calls),
        METRIC_TOOL_CALLS_MAX: max(calls),
        METRIC_TOOL_ERROR_RATE: sum(r.get("tool_errors", 0.0) for r in records) / total_calls if total_calls else 0.0,
        METRIC_TOOL_TIMEOUT_RATE: sum(r.get("tool_timeouts", 0.0) for r in records) / total_calls if total_calls else 0.0,
        METRIC_MASKED_TOKEN_FRACTION: masked / tokens if tokens else 0.0,
        **_openai_metrics(records),
    }


def _openai_metrics(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """The ``agent/openai/*`` metrics, when the batch ran the openai loop (its records have them)."""
    records = [r for r in records if "history_rewrites" in r]
    if not records:
        return {}
    return {
        METRIC_OPENAI_HISTORY_REWRITES: sum(r["history_rewrites"] for r in records),
        METRIC_OPENAI_ERROR_RATE: sum(r.get("agent_errors", 0.0) for r in records) / len(records),
        METRIC_OPENAI_TIMEOUT_RATE: sum(r.get("agent_timeouts", 0.0) for r in records) / len(records),
    }


def final_turn_start(loss_mask: Sequence[int]) -> int:
    """Where the last assistant turn of a response starts: just after its last inserted
    (loss mask 0) token; 0 when the policy produced every token (a single-turn response)."""
    for position in range(len(loss_mask) - 1, -1, -1):
        if not loss_mask[position]:
            return position + 1
    return 0


def answer_view(trajectory: Trajectory) -> Trajectory:
    """The trajectory as its reward should see it: the response cut to the final assistant
    turn, so a scorer reads the model's answer, not the tool replies before it (empty when the
    episode ended on inserted tokens: it gave no answer). A single-turn trajectory comes back
    as it is; otherwise a shallow copy, so the caller copies the reward back."""
    start = final_turn_start(trajectory.loss_mask)
    if start == 0:
        return trajectory
    return dataclasses.replace(
        trajectory,
        response_ids=trajectory.response_ids[start:],
        loss_mask=trajectory.loss_mask[start:],
        rollout_logprobs=trajectory.rollout_logprobs[start:],
        token_versions=None if trajectory.token_versions is None else trajectory.token_versions[start:],
        top_logprobs=None,
    )


@dataclass
class AgentRow:
    """One prompt to run: chat-templated ids, the row's fields (its request's), its group id."""

    prompt_ids: list[int]
    fields: RowFields | None = None
    group_id: int = 0


class AgentRunner:
    """Runs rows through their agent loops, many episodes at once.

    Args:
        context: What the loops are built from.
        default_agent: The loop for rows without an ``agent_name``.
        max_concurrent_episodes: Episodes in flight at once (``None``: all of them). The engine
            batches the concurrent requests; a slow tool only holds its own episode.
    """

    def __init__(
        self, context: AgentContext, default_agent: str = DEFAULT_AGENT, max_concurrent_episodes: int | None = None
    ) -> None:
        if max_concurrent_episodes is not None and max_concurrent_episodes < 1:
            raise ValueError(f"max_concurrent_episodes must be >= 1 or None, got {max_concurrent_episodes}")
        self.context = context
        self.default_agent = default_agent
        self.max_concurrent_episodes = max_concurrent_episodes
        self._loops: dict[str, AgentLoop] = {}
        # A bad default fails at start-up, not on the first batch. A loop that declares
        # ``runs_every_row`` (the openai loop: the user's agent is the whole harness) overrides
        # the rows' agent_name when it is the default.
        self.every_row = bool(getattr(self.loop(default_agent), "runs_every_row", False))

    def loop(self, name: str) -> AgentLoop:
        """The loop for ``name``, built on first use and then shared."""
        if name not in self._loops:
            self._loops[name] = build_agent_loop(name, self.context)
        return self._loops[name]

    async def generate(
        self, rows: Sequence[AgentRow], params: SamplingParams | Sequence[SamplingParams], engine: GenerateEngine
    ) -> list[Trajectory]:
        """``n`` episodes per row, run concurrently; row-major order, ``group_id`` set.

        ``params`` is shared by every row, or one per row (each row's own ``n`` and seed, as
        the trainer seeds each prompt). A loop that raises (a bug, or the engine failing)
        cancels the other episodes and the error propagates, naming the row and the loop.
        """
        per_row = [params] * len(rows) if isinstance(params, SamplingParams) else list(params)
        if len(per_row) != len(rows):
            raise ValueError(f"AgentRunner.generate: {len(per_row)} sampling params for {len(rows)} rows")
        limit = asyncio.Semaphore(self.max_concurrent_episodes or max(1, sum(p.n for p in per_row)))
        episodes = [
            self._episode(row, index, sample, row_params, engine, limit)
            for index, (row, row_params) in enumerate(zip(rows, per_row))
            for sample in range(row_params.n)
        ]
        return await all_or_nothing(episodes)

    async def generate_row(
        self, row: AgentRow, index: int, params: SamplingParams, engine: GenerateEngine
    ) -> list[Trajectory]:
        """The ``params.n`` episodes of one row, as ``generate`` runs them when the row sits at
        ``index`` (the same seeds): what a streaming caller awaits per prompt group.
        ``max_concurrent_episodes`` bounds this row's episodes, not the other rows'."""
        limit = asyncio.Semaphore(self.max_concurrent_episodes or max(1, params.n))
        return await all_or_nothing([self._episode(row, index, sample, params, engine, limit)
                                      for sample in range(params.n)])

    def generate_sync(
        self, rows: Sequence[AgentRow], params: SamplingParams | Sequence[SamplingParams], engine: GenerateEngine
    ) -> list[Trajectory]:
        """``generate`` for synchronous callers."""
        return run_coroutine_sync(self.generate(rows, params, engine))

    async def _episode(
        self,
        row: AgentRow,
        index: int,
        sample: int,
        params: SamplingParams,
        engine: GenerateEngine,
        limit: asyncio.Semaphore,
    ) -> Trajectory:
        name = self.default_agent if self.every_row else agent_name_of(row.fields, self.default_agent)
        seed = None if params.seed is None else derive_seed(params.seed, index, sample)
        episode_params = dataclasses.replace(params, n=1, seed=seed)
        metadata = row.fields.as_dict() if row.fields is not None else {}
        async with limit:
            try:
                trajectory = await self.loop(name).run(list(row.prompt_ids), metadata, episode_params, engine)
            except Exception as error:
                raise RuntimeError(f"agent loop {name!r} failed on row {index} (sample {sample}): {error}") from error
        # The episode's sample refers to its row and group, as an engine's sample does to its request's.
        trajectory.row, trajectory.group_id = row.fields, row.group_id
        if trajectory.agent is None:
            trajectory.agent = AgentEpisode(name=name)
        elif not trajectory.agent.name:
            trajectory.agent.name = name
        return trajectory


