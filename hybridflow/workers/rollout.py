"""The rollout role: turns generation requests into trajectories with a rollout engine.

Two paths, chosen once at construction:

- no agent settings (``rollout.multi_turn.enable=false``): each request goes straight to the
  engine's ``generate_batch``, exactly as a plain RLHF/RLVR rollout;
- with ``AgentSetup``: each request runs as ``n`` agent episodes (``hybridflow.agents``),
  the loop picked per row by its ``agent_name`` (else the default loop), every episode
  concurrently against the same engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.agents import AgentContext, AgentRow, AgentRunner, load_tools
from hybridflow.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.rollout import build_rollout_engine
from hybridflow.types import GenerationRequest, Trajectory


@dataclass
class AgentSetup:
    """``rollout.multi_turn``, resolved: what the worker builds its agent runner from."""

    default_agent: str  # the loop for rows without an agent_name
    tool_config_path: str | None = None  # a YAML file, builtin:<name>[,...], or None (no tools)
    tool_parser: str = "hermes"
    max_assistant_turns: int = 5
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_timeout_s: float | None = None  # None: each tool's own limit


@dataclass
class RolloutSetup:
    model_path: str
    engine: str
    dtype: str
    device: torch.device
    max_batch_size: int
    seed: int
    trust_remote_code: bool = False
    agent: AgentSetup | None = None  # None: single-turn generation, no agent loop


def build_agent_runner(tokenizer: Any, setup: AgentSetup) -> AgentRunner:
    """The runner for ``setup``: tools loaded and every named loop and parser resolved, so a bad
    name fails here, at start-up, not on the first batch."""
    tools = load_tools(setup.tool_config_path, setup.max_tool_response_length, setup.tool_timeout_s)
    context = AgentContext(
        tokenizer,
        tools=tools,
        tool_parser=setup.tool_parser,
        max_assistant_turns=setup.max_assistant_turns,
        max_parallel_tool_calls=setup.max_parallel_calls,
    )
    return AgentRunner(context, default_agent=setup.default_agent)


class RolloutWorker:
    def __init__(self, rank: int, world_size: int, setup: RolloutSetup) -> None:
        self.rank = rank
        tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code)
        # The engine owns its own copy of the weights (possibly in another dtype); the trainer
        # pushes updates with update_weights after each step.
        model = load_causal_lm(setup.model_path, device=setup.device, trust_remote_code=setup.trust_remote_code)
        self.engine = build_rollout_engine(
            setup.engine,
            model=model,
            eos_token_ids=eos_token_ids(setup.model_path, tokenizer),
            pad_token_id=int(tokenizer.pad_token_id),
            max_batch_size=setup.max_batch_size,
            device=setup.device,
            dtype=setup.dtype,
            seed=setup.seed + rank,
            tokenizer=tokenizer,
        )
        self.agents = None if setup.agent is None else build_agent_runner(tokenizer, setup.agent)

    def generate(
        self, requests: list[GenerationRequest], metadata: Sequence[dict[str, Any]] | None = None
    ) -> list[list[Trajectory]]:
        """Each request's ``n`` trajectories, in request order.

        ``metadata`` holds each request's row fields (``agent_name``, ``extra_info``, ...): the
        agent loops read them, and each trajectory's metadata starts from them. Without agents
        it is not needed and the engine serves the requests directly.
        """
        if self.agents is None:
            return self.engine.generate_batch(requests)
        if metadata is None or len(metadata) != len(requests):
            raise ValueError("RolloutWorker.generate with agent loops needs one metadata dict per request")
        rows = [AgentRow(list(r.prompt_ids), dict(m), group_id=i) for i, (r, m) in enumerate(zip(requests, metadata))]
        episodes = self.agents.generate_sync(rows, [r.params for r in requests], self.engine)
        grouped: list[list[Trajectory]] = [[] for _ in requests]
        for trajectory in episodes:
            grouped[trajectory.group_id].append(trajectory)
        return grouped

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(weights)
