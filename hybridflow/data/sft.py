"""Supervised fine-tuning data: chat conversations tokenised with loss on the assistant's tokens only.

Two row schemas, as verl's SFT trainer reads them:

- a ``messages`` column (``sft.messages_key``): a list of chat turns, multi-turn, e.g.
  ``[{"role": "system", ...}, {"role": "user", ...}, {"role": "assistant", ...}, ...]``;
- ``prompt`` / ``response`` columns (``data.prompt_key`` / ``sft.response_key``): the prompt a
  string (one user turn) or a list of messages, the response the assistant's text.

A conversation is rendered with the tokenizer's chat template (or ``data.chat_template``) one
turn at a time: the text a turn adds is the template of the conversation up to and including it
minus the template up to the turn before. An assistant turn is split further at the generation
prompt (``add_generation_prompt=True`` of the turns before it), so its role header is masked and
only what the model itself would write (the content and the template's end-of-turn text) carries
loss. This needs a template whose rendering of a prefix is a prefix of the rendering of the
whole, which chat templates are; one that is not is named, not silently mis-masked.

Each example becomes a ``Trajectory``: the tokens before the first assistant token are its
prompt, the rest its response with the loss mask, so the actor's training engine trains it
unchanged (response-only forward, packing, token-budget micro-batches).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridflow.data.dataset import check_chat_template_kwargs
from hybridflow.data.row_files import DataError, read_records
from hybridflow.data.row_schema import VALID_ROLES
from hybridflow.types import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTColumns:
    """Which columns hold an example (``sft.messages_key``, ``data.prompt_key``, ``sft.response_key``)."""

    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"


@dataclass
class SFTDataStats:
    """What loading kept and skipped, for the log and the run's first metrics."""

    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    truncated: int = 0  # kept, but cut to max_length

    def describe(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return (f"{self.kept} of {self.rows} examples kept ({self.truncated} truncated to the max length)"
                + (f"; skipped: {skipped}" if skipped else ""))


def row_messages(row: Any, columns: SFTColumns, where: str) -> list[dict[str, str]]:
    """The conversation of one row, checked: a ``DataError`` names ``where`` (file and row) and the
    column at fault."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    if columns.messages_key in row and row[columns.messages_key] is not None:
        messages = _check_turns(row[columns.messages_key], columns.messages_key, where)
    elif columns.prompt_key in row or columns.response_key in row:
        for key in (columns.prompt_key, columns.response_key):
            if row.get(key) is None:
                raise DataError(f"{where}: column {key!r} is missing (a prompt/response example needs both "
                                f"{columns.prompt_key!r} and {columns.response_key!r}); the row has "
                                f"{sorted(row)}")
        prompt = row[columns.prompt_key]
        prompt_turns = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                        else _check_turns(prompt, columns.prompt_key, where))
        response = row[columns.response_key]
        if not isinstance(response, str):
            raise DataError(f"{where}: column {columns.response_key!r} must be a string (the assistant's reply), "
                            f"got {type(response).__name__}")
        messages = prompt_turns + [{"role": "assistant", "content": response}]
    else:
        raise DataError(
            f"{where}: no column {columns.messages_key!r} (chat turns) nor {columns.prompt_key!r}/"
            f"{columns.response_key!r}; the row has {sorted(row)} (set sft.messages_key, or data.prompt_key and "
            f"sft.response_key)"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn from")
    return messages


def _check_turns(value: Any, key: str, where: str) -> list[dict[str, str]]:
    if hasattr(value, "tolist"):  # a numpy array from a parquet list column
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: column {key!r} must be a non-empty list of chat messages, got "
                        f"{type(value).__name__ if value is not None else 'null'}")
    turns = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}: column {key!r} message {i} is not an object")
        role, content = message.get("role"), message.get("content")
        if role not in VALID_ROLES:
            raise DataError(f"{where}: column {key!r} message {i} has role {role!r}; expected one of "
                            f"{', '.join(sorted(VALID_ROLES))}")
        if not isinstance(content, str):
            raise DataError(f"{where}: column {key!r} message {i} has no string 'content'")
        turns.append({"role": role, "content": content})
    return turns


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool,
            template_kwargs: Mapping[str, Any] | None = None) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **(template_kwargs or {}))


def _tail(longer: str, prefix: str, what: str) -> str:
    if not longer.startswith(prefix):
        raise DataError(
            f"the chat template does not render {what} as an extension of the turns before it, so the assistant's "
            f"tokens cannot be told apart; use a prefix-stable template (data.chat_template)"
        )
    return longer[len(prefix):]


def assistant_masked_tokens(tokenizer, messages: list[dict[str, str]],
                            template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation: 1 on each assistant turn's content and end-of-turn
    text, 0 on system, user and tool turns and on the assistant's role header. ``template_kwargs``
    (data.apply_chat_template_kwargs) are the template's variables on every rendering."""
    ids: list[int] = []
    mask: list[int] = []

    def add(text: str, weight: int) -> None:
        if text:
            piece = list(tokenizer.encode(text, add_special_tokens=False))
            ids.extend(piece)
            mask.extend([weight] * len(piece))

    before = ""
    for i, message in enumerate(messages):
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False, template_kwargs=template_kwargs)
        if message["role"] == "assistant":
            header = (_render(tokenizer, messages[:i], generation_prompt=True, template_kwargs=template_kwargs) if i
                      else _generation_header(tokenizer, template_kwargs))
            add(_tail(header, before, f"turn {i}'s generation prompt"), 0)
            add(_tail(upto, header, f"assistant turn {i}"), 1)
        else:
            add(_tail(upto, before, f"turn {i}"), 0)
        before = upto
    return ids, mask


def _generation_header(tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The assistant header of a conversation that opens with the assistant (no turn before it):
    what the template puts before an assistant turn's content."""
    probe = [{"role": "assistant", "content": "\x00"}]
    text = _render(tokenizer, probe, generation_prompt=False, template_kwargs=template_kwargs)
    return text[: text.index("\x00")] if "\x00" in text else ""


def sft_example(tokenizer, messages: list[dict[str, str]], max_length: int | None,
                truncation: str = "right", template_kwargs: Mapping[str, Any] | None = None,
                ) -> tuple[Trajectory | None, bool]:
    """One conversation as a trajectory (prompt: the tokens before the first assistant token),
    and whether it was truncated. None when no assistant token is left within ``max_length``."""
    ids, mask = assistant_masked_tokens(tokenizer, messages, template_kwargs)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        if truncation == "error":
            raise DataError(f"{len(ids)} tokens, more than the max length {max_length} (sft.truncation=error)")
        ids, mask = ids[:max_length], mask[:max_length]
    if 1 not in mask:
        return None, truncated
    first = mask.index(1)
    response, loss_mask = ids[first:], mask[first:]
    traj = Trajectory(ids[:first], response, loss_mask, [0.0] * len(response), finish_reason="stop")
    return traj, truncated


def load_sft_examples(
    paths: Sequence[str | os.PathLike[str]], tokenizer, columns: SFTColumns, *, max_length: int | None,
    truncation: str = "right", on_bad_row: str = "error", template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[Trajectory], SFTDataStats]:
    """Every row of ``paths`` (parquet or JSON lines) as a training example. A malformed row is a
    ``DataError`` naming file, row and column, or with ``on_bad_row="skip"`` (``data.on_bad_row``)
    dropped, counted and logged with that same line; an example left with no assistant token after
    truncation to ``max_length`` is skipped, counted and warned about (a long prompt should not
    stop a run over a whole dataset). ``template_kwargs``: data.apply_chat_template_kwargs."""
    template_kwargs = check_chat_template_kwargs(template_kwargs or {})

    def example(row: Any, where: str) -> tuple[Trajectory | None, bool]:
        messages = row_messages(row, columns, where)
        try:
            return sft_example(tokenizer, messages, max_length, truncation, template_kwargs)
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from exc

    return tokenise_rows(paths, example, on_bad_row=on_bad_row, what="SFT", item="SFT example",
                         empty="with no assistant token within the max length")


_Item = TypeVar("_Item")


def tokenise_rows(
    paths: Sequence[str | os.PathLike[str]], make: Callable[[Any, str], tuple[_Item | None, bool]], *,
    on_bad_row: str, what: str, item: str, empty: str,
) -> tuple[list[_Item], SFTDataStats]:
    """Every row of ``paths`` (parquet or JSON lines) made into an ``item`` by ``make(row, where)``:
    the item, or None when nothing trainable is left (counted as ``empty``), and whether it was
    truncated. A ``DataError`` (a malformed row, naming file, row and column) stops the load, or with
    ``on_bad_row="skip"`` drops the row, counted and logged with that same line. Raises
    ``DataError`` when no row gave an item."""
    stats = SFTDataStats()
    items: list[_Item] = []
    for path in paths:
        for record in read_records(path):
            stats.rows += 1
            where = f"{path} {record.where}"
            try:
                if record.parse_error is not None:
                    raise DataError(f"{where}: {record.parse_error}")
                made, truncated = make(record.value, where)
            except DataError as exc:
                if on_bad_row != "skip":
                    raise
                stats.skipped["malformed (data.on_bad_row=skip)"] += 1
                log.warning("skipped: %s", exc)
                continue
            if made is None:
                stats.skipped[empty] += 1
                continue
            stats.kept += 1
            stats.truncated += int(truncated)
            items.append(made)
    if stats.skipped:
        log.warning("%s data %s: %s", what, ", ".join(map(str, paths)), stats.describe())
    if not items:
        raise DataError(f"{', '.join(map(str, paths))}: no usable {item} ({stats.describe()})")
    return items, stats
