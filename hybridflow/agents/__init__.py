"""Agent loops over the rollout engine: single-turn and tool-calling multi-turn episodes.

- ``base``: the ``AgentLoop`` protocol, ``AgentContext``, the loop registry (``AGENT_LOOPS``,
  chosen per row by ``agent_name``), ``AgentRunner`` (what the rollout worker calls),
  ``compute_agent_metrics`` and ``answer_view`` (the final assistant turn, what a reward scores).
- ``single_turn``, ``tool_agent``: the built-in loops.
- ``openai_agent``: the ``openai`` loop, a user's black-box agent written against the OpenAI API
  (``OpenAIEpisode`` is what it gets); ``openai_server``: the OpenAI-compatible server on
  127.0.0.1 it talks to (FastAPI, imported only when the loop runs); ``openai_episode``: how its
  requests are stitched into one trajectory. ``examples/``: agents to copy.
- ``tokens``: incremental multi-turn token ids and ``check_token_consistency``.
- ``parsers``: tool-call parsers (``<tool_call>`` JSON); ``tools``: tool declaration, the
  registry that runs calls, the built-ins (``calculator``, ``python``, the GSM8K and Geometry3K
  grading tools, ``search``) and verl's tool files; ``search``: the retrieval-server client
  behind the ``search`` tool; ``interactions``: the optional user simulator.

Layering: agents/ sits on types, utils, models and rewards (the sandbox); it never imports
training/, workers/, controller/, config/ or ray, and reaches the engine only through the
``generate`` method it calls.
"""

from hybridflow.agents.base import (
    AGENT_LOOPS,
    AgentContext,
    AgentLoop,
    AgentRow,
    AgentRunner,
    GenerateEngine,
    agent_name_of,
    answer_view,
    build_agent_loop,
    compute_agent_metrics,
    final_turn_start,
)
from hybridflow.agents.interactions import Interaction, InteractionResponse, build_interaction
from hybridflow.agents.openai_agent import OpenAIEpisode
from hybridflow.agents.parsers import TOOL_PARSERS, HermesToolParser, MalformedCall, ParsedTurn, ToolCall, build_tool_parser
from hybridflow.agents.tokens import TurnTemplate, check_token_consistency, render_ids
from hybridflow.agents.tools import BUILTIN_TOOLS, Tool, ToolRegistry, ToolResult, load_tool_config, load_tools, tool

__all__ = [
    "AGENT_LOOPS",
    "BUILTIN_TOOLS",
    "TOOL_PARSERS",
    "AgentContext",
    "AgentLoop",
    "AgentRow",
    "AgentRunner",
    "GenerateEngine",
    "HermesToolParser",
    "Interaction",
    "InteractionResponse",
    "MalformedCall",
    "OpenAIEpisode",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "TurnTemplate",
    "agent_name_of",
    "answer_view",
    "build_agent_loop",
    "build_interaction",
    "build_tool_parser",
    "check_token_consistency",
    "compute_agent_metrics",
    "final_turn_start",
    "load_tool_config",
    "load_tools",
    "render_ids",
    "tool",
]
