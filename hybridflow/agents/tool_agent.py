"""The tool-calling agent loop: generate → parse tool calls → run them concurrently → append
their responses → generate again.

An episode ends when a turn makes no tool call (and no interaction replies), after
``max_assistant_turns`` turns, when the response budget (``params.max_tokens`` over the whole
episode) runs out, or when the engine stops a turn some other way (length, abort, a stop token
that is not the template's end of turn).

Token ids grow incrementally (see ``tokens.py``): the model's tokens as sampled, with loss mask
1 and their logprobs; tool responses and user replies as the chat template renders them after
an assistant turn, with loss mask 0 and logprob 0.0. Inserted tokens count towards the budget
and are cut at it. ``Trajectory.token_versions`` (partial rollout) holds each model token's policy
version as the engine recorded it (a turn may span a weight update) and ``UNVERSIONED_TOKEN`` (-1)
for inserted tokens; it is None when the engine records no versions. Top logprobs
(``params.logprobs``) are not collected: they would have no entries for the inserted tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.base import AgentContext, GenerateEngine, episode_metrics
from hybridflow.agents.parsers import MalformedCall, ParsedTurn, ToolCall, build_tool_parser
from hybridflow.agents.tokens import Message, TurnTemplate, append_model_tokens
from hybridflow.agents.tools import ToolRegistry, ToolResult
from hybridflow.types import UNVERSIONED_TOKEN, AgentEpisode, GenerationRequest, SamplingParams, Trajectory
from hybridflow.utils.seed import derive_seed


@dataclass
class _Episode:
    """The growing response of one episode and its counters."""

    prompt_ids: list[int]
    budget: int  # response tokens allowed over the whole episode
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    # Per token, its policy version (UNVERSIONED_TOKEN when inserted); None once a turn came from
    # an engine that records none.
    token_versions: list[int] | None = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    num_turns: int = 0
    user_turns: int = 0
    reply_turns: int = 0  # turns of tool replies and of interaction replies (verl's user turns)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    finish_reason: str = "stop"
    stop: str = "no_tool_call"
    interaction_reward: float | None = None

    @property
    def remaining(self) -> int:
        return self.budget - len(self.response_ids)

    def add_model_tokens(self, ids: list[int], logprobs: list[float], versions: list[int] | None) -> None:
        append_model_tokens(self, ids, logprobs, versions)

    def insert(self, ids: list[int]) -> bool:
        """Append tokens the policy did not produce, cut at the budget; ``False`` if cut."""
        kept = ids[: max(0, self.remaining)]
        self.response_ids.extend(kept)
        self.loss_mask.extend([0] * len(kept))
        self.rollout_logprobs.extend([0.0] * len(kept))
        if self.token_versions is not None:
            self.token_versions.extend([UNVERSIONED_TOKEN] * len(kept))
        return len(kept) == len(ids)

    def end(self, finish_reason: str, stop: str) -> None:
        self.finish_reason, self.stop = finish_reason, stop

    def count(self, results: list[ToolResult]) -> None:
        self.tool_calls += len(results)
        self.tool_errors += sum(result.status == "error" for result in results)
        self.tool_timeouts += sum(result.status == "timeout" for result in results)

    def trajectory(self) -> Trajectory:
        record = AgentEpisode(
            metrics=episode_metrics(self.num_turns, self.tool_calls, self.tool_errors, self.tool_timeouts,
                                    self.user_turns),
            messages=self.messages, stop=self.stop, interaction_reward=self.interaction_reward,
        )
        return Trajectory(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.rollout_logprobs,
            finish_reason=self.finish_reason,
            num_turns=self.num_turns,
            agent=record,
            token_versions=self.token_versions,
        )


class ToolAgentLoop:
    """Multi-turn tool use over any rollout engine (see the module docstring)."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context
        self.tools = context.tools if context.tools is not None else ToolRegistry([])
        self.parser = build_tool_parser(context.tool_parser)
        self.template = TurnTemplate(context.tokenizer, tools=context.tool_schemas(),
                                     template_kwargs=context.chat_template_kwargs)

    async def run(
        self, prompt_ids: list[int], metadata: dict[str, Any], params: SamplingParams, engine: GenerateEngine
    ) -> Trajectory:
        episode = _Episode(prompt_ids=list(prompt_ids), budget=params.max_tokens)
        last_turn = self.context.max_assistant_turns - 1
        for turn in range(self.context.max_assistant_turns):
            text = await self._assistant_turn(episode, params, engine, turn)
            if text is None:
                break
            messages = await self._environment_turn(episode, text, metadata, is_last=turn == last_turn)
            if messages is None:
                break
            if not episode.insert(self.template.delta(messages)):
                episode.end("length", "length")
                break
        return episode.trajectory()

    async def _assistant_turn(
        self, episode: _Episode, params: SamplingParams, engine: GenerateEngine, turn: int
    ) -> str | None:
        """Generate one turn; its text if it ended with the template's end of turn, else None."""
        if episode.remaining <= 0:
            episode.end("length", "length")
            return None
        seed = None if params.seed is None else derive_seed(params.seed, turn)
        turn_params = dataclasses.replace(params, n=1, max_tokens=episode.remaining, seed=seed, logprobs=None)
        request = GenerationRequest(prompt_ids=episode.prompt_ids + episode.response_ids, params=turn_params)
        (sample,) = await engine.generate(request)
        episode.add_model_tokens(sample.response_ids, sample.rollout_logprobs, sample.token_versions)
        episode.num_turns += 1
        ended = sample.finish_reason == "stop" and sample.response_ids[-1:] == [self.template.turn_end_id]
        content_ids = sample.response_ids[:-1] if ended else sample.response_ids
        text = self.context.tokenizer.decode(content_ids, skip_special_tokens=False)
        episode.messages.append({"role": "assistant", "content": text})
        if not ended:
            reason = sample.finish_reason
            episode.end(reason, "length" if reason == "length" else f"engine_{reason}")
            return None
        return text

    async def _environment_turn(
        self, episode: _Episode, text: str, metadata: dict[str, Any], is_last: bool
    ) -> list[Message] | None:
        """The messages that answer the assistant's turn, or None when the episode ends."""
        limit = self.context.max_reply_turns
        if limit is not None and episode.reply_turns >= limit:
            # verl's max_user_turns: checked after the assistant turn, before its calls or the user.
            episode.end("stop", "max_user_turns")
            return None
        parsed = self.parser.parse(text) if len(self.tools) else ParsedTurn()
        if not parsed.items:
            messages = await self._ask_interaction(episode, metadata, is_last)
        elif is_last:  # no turn left to read the responses: do not run the calls
            episode.end("stop", "max_assistant_turns")
            messages = None
        else:
            messages = await self._run_tools(episode, parsed, metadata)
        if messages is not None:
            episode.reply_turns += 1
            episode.messages.extend(messages)
        return messages

    async def _run_tools(self, episode: _Episode, parsed: ParsedTurn, row: dict[str, Any]) -> list[Message]:
        items = list(parsed.items)
        results = await asyncio.gather(*(self._call(item, index, row) for index, item in enumerate(items)))
        episode.count(results)
        messages: list[Message] = []
        for item, result in zip(items, results):
            message: Message = {"role": "tool", "content": result.text}
            if isinstance(item, ToolCall):
                message["name"] = item.name
            messages.append(message)
        return messages

    async def _call(self, item: ToolCall | MalformedCall, index: int, row: dict[str, Any]) -> ToolResult:
        if isinstance(item, MalformedCall):
            return ToolResult(f"Error: {item.error}", "error")
        limit = self.context.max_parallel_tool_calls
        if index >= limit:
            return ToolResult(f"Error: at most {limit} tool calls per turn; this call was not run", "error")
        return await self.tools.call(item, row)  # a tool that scores the answer reads the row's ground truth

    async def _ask_interaction(self, episode: _Episode, metadata: dict[str, Any], is_last: bool) -> list[Message] | None:
        interaction = self.context.interaction
        if interaction is None:
            episode.end("stop", "no_tool_call")
            return None
        # Asked even on the last turn: its reward is wanted whether or not the dialogue goes on.
        response = await interaction.respond(list(episode.messages), metadata)
        if response.reward is not None:
            episode.interaction_reward = float(response.reward)
        if response.done or response.reply is None:
            episode.end("stop", "interaction_done")
            return None
        if is_last:
            episode.end("stop", "max_assistant_turns")
            return None
        if episode.user_turns >= self.context.max_user_turns:
            episode.end("stop", "max_user_turns")
            return None
        episode.user_turns += 1
        return [{"role": "user", "content": response.reply}]
