"""Multi-turn token ids, built incrementally, and the check that they match the chat template.

Re-rendering the whole conversation after every turn and re-tokenising it would change the
model's own tokens: decode → encode does not give back the ids the model sampled (a BPE
tokenizer may merge differently), and the trainer would then compute logprobs of tokens the
policy never produced. So the ids grow by appending only:

- the model's tokens exactly as sampled, up to and including its end-of-turn token;
- for each batch of new non-assistant messages (tool responses, a user reply), the tokens the
  chat template puts after an assistant turn for those messages, generation prompt included.

That suffix is cut out of the template itself (``TurnTemplate.delta``): render a fixed probe
conversation ending with an assistant turn, with and without the new messages, and keep what
follows the probe's end-of-turn token. Special tokens are hard boundaries for the tokenizer,
so these tokens are the same ones the full conversation would have there.

``check_token_consistency`` proves it for a finished episode: the incremental ids equal the
full-conversation rendering, and the loss mask covers exactly the model's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hybridflow.types import Trajectory

Message = dict[str, Any]
_MARKER = "\u2063HYBRIDFLOW-PROBE\u2063"  # an invisible separator keeps it from merging with neighbours
_PROBE: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]


class ChatTokenizer(Protocol):
    """The tokenizer methods the agent layer uses (a Hugging Face tokenizer has them)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...


def render_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The chat template's ids for ``messages``, rendered to text and encoded the way the
    dataset renders prompts (no extra special tokens), with ``template_kwargs``
    (``data.apply_chat_template_kwargs``) as the template's variables, as the dataset does."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


class TurnTemplate:
    """What a chat template puts between turns, measured from the template itself."""

    def __init__(self, tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self._tokenizer = tokenizer
        self._tools = tools or None
        # The template's variables change what it puts between turns (a reasoning channel): measured with them.
        self._template_kwargs = dict(template_kwargs or {})
        text = tokenizer.apply_chat_template(_PROBE, tools=self._tools, tokenize=False, **self._template_kwargs)
        if _MARKER not in text:
            raise ValueError("the chat template does not render an assistant message's content verbatim")
        # What follows an assistant message's content: its end-of-turn token, then separators.
        self.tail_ids: list[int] = list(tokenizer.encode(text[text.rindex(_MARKER) + len(_MARKER) :], add_special_tokens=False))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        if not self.tail_ids or (special and self.tail_ids[0] not in special):
            raise ValueError(
                "the chat template does not end an assistant turn with a special token "
                f"(tokens after the content: {self.tail_ids}); incremental multi-turn ids need one"
            )
        self.turn_end_id: int = self.tail_ids[0]
        probe_ids = render_ids(tokenizer, _PROBE, tools=self._tools, template_kwargs=self._template_kwargs)
        self._prefix = probe_ids[: len(probe_ids) - len(self.tail_ids) + 1]  # through the turn end

    def delta(self, messages: Sequence[Message]) -> list[int]:
        """The ids that follow a finished assistant turn (its end-of-turn token) when
        ``messages`` come next, through the next assistant generation prompt."""
        full = render_ids(self._tokenizer, [*_PROBE, *messages], tools=self._tools, add_generation_prompt=True,
                          template_kwargs=self._template_kwargs)
        if full[: len(self._prefix)] != self._prefix:
            raise ValueError(
                "the chat template renders earlier turns differently once later messages follow "
                f"(roles {[m.get('role') for m in messages]}); it cannot be extended incrementally"
            )
        return full[len(self._prefix) :]


class ResponseTokens(Protocol):
    """An episode's response as it grows: its ids, loss mask, rollout logprobs and each token's
    policy version (None once a part came without versions)."""

    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    token_versions: list[int] | None


def append_model_tokens(
    response: ResponseTokens, ids: list[int], logprobs: list[float], versions: list[int] | None
) -> None:
    """Append tokens the policy sampled: loss mask 1, their logprobs and versions. Versions are kept
    only while every completion reports them (one without them drops the record for good)."""
    response.response_ids.extend(ids)
    response.loss_mask.extend([1] * len(ids))
    response.rollout_logprobs.extend(logprobs)
    if response.token_versions is not None and versions is not None:
        response.token_versions.extend(versions)
    else:
        response.token_versions = None


def assistant_spans(
    tokenizer: ChatTokenizer, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[tuple[int, int]]:
    """For each assistant message, the [start, end) token span of its content and end-of-turn
    token in the full rendering: the tokens the model itself generates."""
    tail = TurnTemplate(tokenizer, tools, template_kwargs).tail_ids
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(render_ids(tokenizer, messages[:index], tools=tools, add_generation_prompt=True,
                               template_kwargs=template_kwargs))
        end = len(render_ids(tokenizer, messages[: index + 1], tools=tools, template_kwargs=template_kwargs)) - len(tail) + 1
        spans.append((start, end))
    return spans


def check_token_consistency(
    tokenizer: ChatTokenizer,
    prompt_messages: Sequence[Message],
    trajectory: Trajectory,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """Problems with an agent trajectory's ids and mask (an empty list: consistent).

    ``trajectory.agent.messages`` holds the turns the loop added after the prompt.
    Checks that the prompt ids are the template's rendering of ``prompt_messages``; that
    ``prompt_ids + response_ids`` equal the rendering of the whole conversation (which may only
    go on with the template's closing tokens, or the rest of a turn cut by the length budget);
    and that ``loss_mask`` is 1 on exactly the assistant turns' tokens. Meaningful when the
    model's tokens are the tokenizer's own encoding of their text (true for byte-level
    tokenizers; a BPE model may sample a non-canonical split).
    """
    problems: list[str] = []
    messages = [*prompt_messages, *(trajectory.agent.messages if trajectory.agent is not None else [])]
    expected_prompt = render_ids(tokenizer, prompt_messages, tools=tools, add_generation_prompt=True,
                                 template_kwargs=template_kwargs)
    if expected_prompt != trajectory.prompt_ids:
        problems.append(_first_difference("prompt ids", expected_prompt, trajectory.prompt_ids))
    ids = [*trajectory.prompt_ids, *trajectory.response_ids]
    ends_with_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    full = render_ids(tokenizer, messages, tools=tools, add_generation_prompt=not ends_with_assistant,
                      template_kwargs=template_kwargs)
    if full[: len(ids)] != ids:
        problems.append(_first_difference("conversation ids", full[: len(ids)], ids))
    rest = full[len(ids) :]
    tail = TurnTemplate(tokenizer, tools, template_kwargs).tail_ids
    if rest and trajectory.finish_reason != "length" and rest != tail[len(tail) - len(rest) :]:
        problems.append(f"the rendering continues past the trajectory with {rest[:8]}..., not only closing tokens")
    expected_mask = [0] * len(ids)
    for start, end in assistant_spans(tokenizer, messages, tools, template_kwargs):
        for position in range(start, min(end, len(ids))):
            expected_mask[position] = 1
    response_mask = expected_mask[len(trajectory.prompt_ids) :]
    if response_mask != list(trajectory.loss_mask):
        problems.append(_first_difference("loss mask", response_mask, list(trajectory.loss_mask)))
    return problems


def _first_difference(what: str, expected: Sequence[int], actual: Sequence[int]) -> str:
    for index, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            return f"{what} differ at position {index}: expected {want}, got {got}"
    return f"{what} differ in length: expected {len(expected)}, got {len(actual)}"
