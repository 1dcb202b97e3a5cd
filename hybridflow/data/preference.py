"""Preference pairs: a prompt with a ``chosen`` and a ``rejected`` response, as verl and TRL store them.

Row forms (TRL's preference dataset types), from parquet or JSON lines:

- standard: ``{"prompt": "text", "chosen": "text", "rejected": "text"}`` (the prompt one user turn);
- conversational: ``{"prompt": [messages], "chosen": [assistant turns], "rejected": [assistant turns]}``;
- implicit prompt: ``{"chosen": [whole conversation], "rejected": [whole conversation]}``: the prompt is
  the turns the two share from the start (TRL's ``extract_prompt``), and what follows must be assistant
  turns on both sides.

Each side is tokenised as ``hybridflow sft`` tokenises a conversation (``data.sft.assistant_masked_tokens``,
the chat template turn by turn): the prompt's tokens, then the response's with loss on the assistant's own
text and end-of-turn token. The two sides share the prompt's tokens, so a pair is two ``Trajectory``s the
training engine runs unchanged (packing, token budgets).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.data.dataset import check_chat_template_kwargs
from hybridflow.data.row_files import DataError
from hybridflow.data.sft import SFTDataStats, _check_turns, assistant_masked_tokens, tokenise_rows
from hybridflow.types import Trajectory


Message = dict[str, str]


@dataclass(frozen=True)
class PreferenceColumns:
    """Which columns hold a pair (``data.prompt_key``, ``dpo.chosen_key``, ``dpo.rejected_key``)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


@dataclass(frozen=True)
class PreferencePair:
    """One pair as the engine trains it: the two sides share ``chosen.prompt_ids``."""

    chosen: Trajectory
    rejected: Trajectory


def _side(value: Any, key: str, where: str) -> list[Message]:
    """A response column as chat turns: a string is one assistant turn."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if value is None:
        raise DataError(f"{where}: column {key!r} is missing or null")
    return _check_turns(value, key, where)


def _shared_prefix(a: list[Message], b: list[Message]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def row_conversations(row: Any, columns: PreferenceColumns, where: str) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt turns, chosen turns, rejected turns) of one row, checked; a ``DataError`` names ``where``
    (file and row) and the column at fault."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    missing = [k for k in (columns.chosen_key, columns.rejected_key) if row.get(k) is None]
    if missing:
        raise DataError(f"{where}: column {missing[0]!r} is missing (a preference pair needs {columns.chosen_key!r} "
                        f"and {columns.rejected_key!r}; set dpo.chosen_key / dpo.rejected_key); the row has "
                        f"{sorted(row)}")
    chosen = _side(row[columns.chosen_key], columns.chosen_key, where)
    rejected = _side(row[columns.rejected_key], columns.rejected_key, where)
    prompt_value = row.get(columns.prompt_key)
    if prompt_value is not None:
        prompt = ([{"role": "user", "content": prompt_value}] if isinstance(prompt_value, str)
                  else _check_turns(prompt_value, columns.prompt_key, where))
    else:  # implicit prompt: the turns both conversations open with
        shared = _shared_prefix(chosen, rejected)
        if shared == 0:
            raise DataError(f"{where}: no column {columns.prompt_key!r}, and {columns.chosen_key!r} and "
                            f"{columns.rejected_key!r} share no opening turn to take as the prompt")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for key, turns in ((columns.chosen_key, chosen), (columns.rejected_key, rejected)):
        if not turns:
            raise DataError(f"{where}: column {key!r} has no response after the prompt")
        wrong = [t["role"] for t in turns if t["role"] != "assistant"]
        if wrong:
            raise DataError(f"{where}: column {key!r}'s response has a {wrong[0]!r} turn; a preference response is "
                            f"the assistant's turns only")
    return prompt, chosen, rejected


def _response(tokenizer, prompt: list[Message], turns: list[Message], max_length: int | None,
              template_kwargs: Mapping[str, Any] | None) -> tuple[Trajectory | None, bool]:
    """The prompt + ``turns`` as a trajectory whose response starts after the prompt's tokens (earlier
    assistant turns in the prompt carry no loss), cut to ``max_length`` from the end; None when no
    response token is left."""
    ids, mask = assistant_masked_tokens(tokenizer, prompt + turns, template_kwargs)
    prompt_tokens = len(assistant_masked_tokens(tokenizer, prompt, template_kwargs)[0])
    mask = [0] * prompt_tokens + mask[prompt_tokens:]
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    if 1 not in mask[prompt_tokens:]:
        return None, truncated
    first = prompt_tokens + mask[prompt_tokens:].index(1)
    response = ids[first:]
    return Trajectory(ids[:first], response, mask[first:], [0.0] * len(response), finish_reason="stop"), truncated


def preference_pair(tokenizer, prompt: list[Message], chosen: list[Message], rejected: list[Message],
                    max_length: int | None, template_kwargs: Mapping[str, Any] | None = None,
                    ) -> tuple[PreferencePair | None, bool]:
    """One pair tokenised (and whether a side was cut); None when a side has no response token left."""
    a, cut_a = _response(tokenizer, prompt, chosen, max_length, template_kwargs)
    b, cut_b = _response(tokenizer, prompt, rejected, max_length, template_kwargs)
    if a is None or b is None:
        return None, cut_a or cut_b
    if a.prompt_ids != b.prompt_ids:  # the template's generation header differs by response: not a pair
        raise DataError("the chosen and rejected conversations tokenise to different prompts")
    return PreferencePair(a, b), cut_a or cut_b


# How a checked row becomes a pair: (tokenizer, prompt, chosen, rejected, max_length, template kwargs) ->
# (pair or None when a side has nothing left to train on, whether a side was cut).
PairMaker = Callable[[Any, list[Message], list[Message], list[Message], "int | None", "Mapping[str, Any] | None"],
                     "tuple[PreferencePair | None, bool]"]


def load_preference_pairs(
    paths: Sequence[str | os.PathLike[str]], tokenizer, columns: PreferenceColumns, *, max_length: int | None,
    on_bad_row: str = "error", template_kwargs: Mapping[str, Any] | None = None,
    make_pair: PairMaker = preference_pair,
) -> tuple[list[PreferencePair], SFTDataStats]:
    """Every row of ``paths`` as a pair. A malformed row is a ``DataError`` naming file, row and column,
    or with ``on_bad_row="skip"`` (``data.on_bad_row``) dropped, counted and logged with that same line;
    a pair left with no response token on a side after ``max_length`` is skipped and counted.
    ``make_pair`` tokenises a row (default: a policy's pair; ``hybridflow rm`` renders a reward model's)."""
    template_kwargs = check_chat_template_kwargs(template_kwargs or {})

    def pair(row: Any, where: str) -> tuple[PreferencePair | None, bool]:
        prompt, chosen, rejected = row_conversations(row, columns, where)
        try:
            return make_pair(tokenizer, prompt, chosen, rejected, max_length, template_kwargs)
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from exc

    return tokenise_rows(paths, pair, on_bad_row=on_bad_row, what="preference", item="preference pair",
                         empty="with no response token within the max length")


__all__ = ["PairMaker", "PreferenceColumns", "PreferencePair", "load_preference_pairs", "preference_pair", "row_conversations"]
