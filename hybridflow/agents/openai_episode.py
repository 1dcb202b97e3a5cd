"""One black-box agent episode's token history, stitched from the chat requests it makes.

An agent written against the OpenAI API sends whole conversations; RL needs one flat token
sequence per episode (``Trajectory``) whose model tokens are exactly the ones sampled. So every
request is compared with what this episode has already recorded:

- **extension** (the usual agent pattern): the request repeats the messages of the previous
  request and the assistant message returned for it, then adds new ones (tool results, a user
  turn). Only the new messages are rendered, as the chat template puts them after a finished
  assistant turn (``TurnTemplate.delta``, as the built-in tool agent does), and appended with
  loss mask 0. The engine is then fed exactly history + new ids, so the trajectory is what the
  model saw and the trainer's recomputed logprobs match the rollout's.
- **rewrite** (the agent dropped, edited or reordered history): the whole conversation is
  rendered fresh (assistant turns this episode returned as the model's own text), the history is
  cut to its longest common token prefix with that rendering, and the rest is inserted with loss
  mask 0. Model tokens past the cut leave the trajectory; ``history_rewrites`` counts it.

Messages are compared semantically: role, text content, and tool calls by name and parsed
arguments (call ids, ``name`` fields and extra keys are ignored; agents rebuild them freely).

The response budget (``budget``: the episode's ``params.max_tokens``) covers every token after
the prompt, inserted ones included, as in the other loops. ``token_versions`` follows the tokens
through extensions and rewrites: the engine's policy version on model tokens, ``UNVERSIONED_TOKEN``
(-1) on inserted ones (None once an engine recorded none). ``EpisodeRecord`` is plain Python:
the HTTP server (``openai_server``) calls ``prepare`` and ``record`` under the record's lock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.parsers import ToolCall, ToolParser
from hybridflow.agents.tokens import ChatTokenizer, Message, TurnTemplate, append_model_tokens, render_ids
from hybridflow.types import UNVERSIONED_TOKEN

# A normalised message: (role, text, ((tool name, canonical JSON arguments), ...)).
NormalMessage = tuple[str, str, tuple[tuple[str, str], ...]]


def message_text(content: Any) -> str:
    """A message's content as text: a string, None (""), or OpenAI content parts (their texts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments parsed: clients send a JSON string, templates want the object."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _calls(message: Message) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        calls.append((str(function.get("name", "")), _arguments(function.get("arguments"))))
    return calls


def normalize(message: Message) -> NormalMessage:
    """What decides whether two messages are the same turn (see the module docstring)."""
    calls = tuple((name, json.dumps(args, sort_keys=True)) for name, args in _calls(message))
    return str(message.get("role", "")), message_text(message.get("content")).strip(), calls


def template_message(message: Message) -> Message:
    """A request message as chat templates expect it: text content, parsed tool-call arguments."""
    out: Message = {"role": message.get("role"), "content": message_text(message.get("content"))}
    if message.get("name"):
        out["name"] = message["name"]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    calls = _calls(message)
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return out


@dataclass
class Completion:
    """One assistant answer, as the server returns it and as the history records it."""

    text: str  # the model's text, tool-call markup included, end-of-turn token excluded
    content: str  # what the client sees as message.content
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def message(self) -> Message:
        """The assistant message as the client will append it to its history."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in self.tool_calls
            ]
        return message


@dataclass
class Prepared:
    """What to generate for one request: the full ids to feed the engine and the token budget left."""

    prompt_ids: list[int]
    max_tokens: int  # 0: the budget is spent, answer "length" without generating


class EpisodeRecord:
    """The token history of one episode (see the module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer, parser: ToolParser, budget: int, turn_end_id: int | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})  # data.apply_chat_template_kwargs
        self.parser = parser
        self.budget = budget
        self.lock = threading.Lock()
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.rollout_logprobs: list[float] = []
        # Per token, its policy version (UNVERSIONED_TOKEN when inserted); None once a completion
        # came from an engine that records none (Trajectory.token_versions).
        self.token_versions: list[int] | None = []
        self.completions = 0
        self.tool_calls = 0
        self.history_rewrites = 0
        self.finish_reason = "stop"
        self.closed = False
        self._seen: list[NormalMessage] = []  # the conversation the history holds, normalised
        self._tools_key: str | None = None
        self._ended_turn = False  # the history ends with the model's end-of-turn token
        self._returned: list[tuple[NormalMessage, str]] = []  # (assistant message, the model's text)
        self._templates: dict[str, TurnTemplate] = {}
        self._turn_end_id = turn_end_id

    # ------------------------------------------------------------------ requests
    def prepare(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None, max_tokens: int | None) -> Prepared:
        """Stitch ``messages`` onto the history (extension or rewrite) and say what to generate."""
        tools = tools or None
        normal = [normalize(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True)
        template = self._template(tools, tools_key)
        if not self.prompt_ids:
            self.prompt_ids = render_ids(self.tokenizer, self._for_template(messages), tools=tools,
                                         add_generation_prompt=True, template_kwargs=self.template_kwargs)
        elif self._extends(normal, tools_key) and (delta := self._delta(template, messages[len(self._seen):])):
            self._insert(delta)
        else:
            self._rewrite(messages, tools)
        self._seen, self._tools_key = normal, tools_key
        remaining = self.budget - len(self.response_ids)
        wanted = remaining if max_tokens is None else min(max_tokens, remaining)
        return Prepared(self.prompt_ids + self.response_ids, max(0, wanted))

    def prepare_text(self, prompt: str, max_tokens: int | None) -> Prepared:
        """A text completion: the prompt's ids are stitched token by token (the history, if it is
        a prefix of them, then the rest inserted; else the common prefix kept, a rewrite)."""
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not self.prompt_ids:
            self.prompt_ids = ids
        else:
            history = self.prompt_ids + self.response_ids
            if ids[: len(history)] != history:
                self.history_rewrites += 1
            self._keep_common_prefix(ids)
        self._seen, self._tools_key, self._ended_turn = [], None, False  # chat requests after it restitch
        remaining = self.budget - len(self.response_ids)
        wanted = remaining if max_tokens is None else min(max_tokens, remaining)
        return Prepared(self.prompt_ids + self.response_ids, max(0, wanted))

    def record(
        self, token_ids: list[int], logprobs: list[float], finish_reason: str, stop_token: bool, parse_tools: bool,
        versions: list[int] | None = None,
    ) -> Completion:
        """Append one completion's model tokens (loss mask 1) and parse it into an answer.
        ``stop_token``: the last token is an EOS / end-of-turn token the engine stopped on;
        ``parse_tools``: the request offered tools, so tool calls in the text are returned as such;
        ``versions``: the engine's policy version of each token (None: not recorded)."""
        append_model_tokens(self, token_ids, logprobs, versions)
        self.completions += 1
        self._ended_turn = stop_token and token_ids[-1:] == [self._turn_end_id]
        content_ids = token_ids[:-1] if stop_token else token_ids
        text = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        completion = self._answer(text, finish_reason, parse_tools)
        completion.token_ids, completion.logprobs = list(token_ids), list(logprobs)
        self.tool_calls += len(completion.tool_calls)
        self._remember(completion)
        return completion

    def record_spent(self) -> Completion:
        """The answer to a request made once the budget is spent: empty, ``length``."""
        completion = Completion(text="", content="", tool_calls=[], finish_reason="length")
        self._ended_turn = False
        self._remember(completion)
        return completion

    # ------------------------------------------------------------------ internals
    def _template(self, tools: list[dict[str, Any]] | None, key: str) -> TurnTemplate:
        if key not in self._templates:
            self._templates[key] = TurnTemplate(self.tokenizer, tools=tools, template_kwargs=self.template_kwargs)
            self._turn_end_id = self._templates[key].turn_end_id
        return self._templates[key]

    def _extends(self, normal: list[NormalMessage], tools_key: str) -> bool:
        """The request is the history's conversation plus new messages, after a finished turn."""
        return (
            self._ended_turn
            and tools_key == self._tools_key
            and len(normal) > len(self._seen)
            and normal[: len(self._seen)] == self._seen
        )

    @staticmethod
    def _delta(template: TurnTemplate, messages: Sequence[Message]) -> list[int] | None:
        """The new messages' ids after a finished turn; None when the template cannot render them
        incrementally (then the request is stitched as a rewrite)."""
        try:
            return template.delta([template_message(m) for m in messages])
        except ValueError:
            return None

    def _insert(self, ids: list[int]) -> None:
        """Append ids the policy did not produce (loss mask 0), cut at the budget."""
        kept = ids[: max(0, self.budget - len(self.response_ids))]
        self.response_ids.extend(kept)
        self.loss_mask.extend([0] * len(kept))
        self.rollout_logprobs.extend([0.0] * len(kept))
        if self.token_versions is not None:
            self.token_versions.extend([UNVERSIONED_TOKEN] * len(kept))

    def _rewrite(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> None:
        """Render the conversation fresh; keep the history's common prefix with it, insert the rest."""
        self.history_rewrites += 1
        self._keep_common_prefix(
            render_ids(self.tokenizer, self._for_template(messages), tools=tools, add_generation_prompt=True,
                       template_kwargs=self.template_kwargs)
        )

    def _keep_common_prefix(self, fresh: list[int]) -> None:
        """Cut the history to its longest common prefix with ``fresh``, then insert the rest of it."""
        history = self.prompt_ids + self.response_ids
        common = 0
        for old, new in zip(history, fresh):
            if old != new:
                break
            common += 1
        if common == 0:  # nothing in common: keep one prompt token so the trajectory has a prompt
            self.prompt_ids = self.prompt_ids[:1]
            del self.response_ids[:], self.loss_mask[:], self.rollout_logprobs[:]
            if self.token_versions is not None:
                del self.token_versions[:]
            self._insert(fresh)
            return
        if common < len(self.prompt_ids):
            # The agent changed the first prompt itself: the part every request kept is the prompt.
            self.prompt_ids = self.prompt_ids[:common]
        keep = common - len(self.prompt_ids)
        del self.response_ids[keep:], self.loss_mask[keep:], self.rollout_logprobs[keep:]
        if self.token_versions is not None:
            del self.token_versions[keep:]
        self._insert(fresh[common:])

    def _for_template(self, messages: Sequence[Message]) -> list[Message]:
        """Messages to render; an assistant message this episode returned becomes the model's own
        text, so its tokens come out as sampled (a template may render tool calls differently)."""
        returned = dict(self._returned)
        out = []
        for message in messages:
            own = returned.get(normalize(message)) if message.get("role") == "assistant" else None
            out.append({"role": "assistant", "content": own} if own is not None else template_message(message))
        return out

    def _answer(self, text: str, finish_reason: str, parse_tools: bool) -> Completion:
        parsed = self.parser.parse(text) if parse_tools else None
        calls = parsed.calls if parsed is not None else []
        if parsed is not None and calls and finish_reason == "stop":
            return Completion(text, parsed.content, calls, "tool_calls")
        return Completion(text, text, [], finish_reason)

    def _remember(self, completion: Completion) -> None:
        self._seen = [*self._seen, normalize(completion.message())]
        self._returned.append((normalize(completion.message()), completion.text))
        # The episode's finish reason is its last answer's: "length" when the budget cut it.
        self.finish_reason = "length" if completion.finish_reason == "length" else "stop"
