"""The default agent loop: one generation, no tools (what plain RLHF/RLVR rollouts do)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridflow.agents.base import AgentContext, GenerateEngine, episode_metrics
from hybridflow.types import AgentEpisode, GenerationRequest, SamplingParams, Trajectory


class SingleTurnAgentLoop:
    """Sends the prompt once and returns the engine's sample as it is (``num_turns`` 1)."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context

    async def run(
        self, prompt_ids: list[int], metadata: dict[str, Any], params: SamplingParams, engine: GenerateEngine
    ) -> Trajectory:
        request = GenerationRequest(prompt_ids=list(prompt_ids), params=dataclasses.replace(params, n=1))
        (sample,) = await engine.generate(request)
        sample.prompt_ids = list(prompt_ids)
        sample.num_turns = 1
        sample.agent = AgentEpisode(metrics=episode_metrics(num_turns=1))
        return sample
