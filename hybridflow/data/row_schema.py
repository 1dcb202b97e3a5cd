"""verl's row schema, checked row by row: the prompt's messages and roles, data source, ability, reward
model and ground truth, extra info and agent name. Each problem is a ``BadRowReason`` and a message
naming the column."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hybridflow.data.row_files import BadRowReason, DataError, Record, value_type_name


VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})


class RowProblem(Exception):
    """Internal: a row is malformed. Carries the reason code and a message without location."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class _ValidRow:
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: str
    ability: str
    extra_info: dict[str, Any]
    agent_name: str | None


def _check_messages(value: Any, prompt_key: str) -> list[dict[str, Any]]:
    if value is None:
        raise RowProblem(BadRowReason.PROMPT_MISSING, f"{prompt_key!r} is missing")
    if isinstance(value, str):
        raise RowProblem(
            BadRowReason.PROMPT_INVALID,
            f"{prompt_key!r} must be a list of chat messages, got a plain string "
            f'(wrap it as [{{"role": "user", "content": ...}}])',
        )
    if not isinstance(value, list):
        raise RowProblem(
            BadRowReason.PROMPT_INVALID, f"{prompt_key!r} must be a list of chat messages, got {value_type_name(value)}"
        )
    if not value:
        raise RowProblem(BadRowReason.PROMPT_INVALID, f"{prompt_key!r} is an empty list of messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        label = f"{prompt_key!r} message {i}"
        if not isinstance(message, dict):
            raise RowProblem(BadRowReason.MESSAGE_INVALID, f"{label} is not a dict (got {value_type_name(message)})")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise RowProblem(BadRowReason.MESSAGE_INVALID, f"{label} has no {key!r}")
            if not isinstance(message[key], str):
                raise RowProblem(
                    BadRowReason.MESSAGE_INVALID,
                    f"{label} {key!r} must be a string, got {value_type_name(message[key])}",
                )
        if message["role"] not in VALID_ROLES:
            raise RowProblem(
                BadRowReason.ROLE_INVALID,
                f"{label} has role {message['role']!r}; expected one of {', '.join(sorted(VALID_ROLES))}",
            )
        messages.append(dict(message))
    return messages


def _ground_truth_text(value: Any) -> str:
    """The ground truth as text: scalars as written, a list or a mapping as its JSON text (verl's
    search-R1 rows hold ``{"target": [golden answers]}``; the scorer reads the JSON back).

    An integral float becomes an integer string ("72", not "72.0"): parquet writers promote an
    integer column with a missing value to float64, and "72.0" would fail exact-match scorers.
    """
    label = "'reward_model.ground_truth'"
    if isinstance(value, bool):  # bool is an int subclass; True is never a meant answer
        raise RowProblem(BadRowReason.GROUND_TRUTH_INVALID,
                          f"{label} must be a string, number, list or mapping, got bool")
    if isinstance(value, str):
        if not value.strip():
            raise RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} is an empty string")
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} is {value} (a missing value?)")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, dict)):
        kind = "list" if isinstance(value, list) else "mapping"
        if not value:
            raise RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} is an empty {kind}")
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} {kind} is not JSON-serialisable: {exc}")
    raise RowProblem(
        BadRowReason.GROUND_TRUTH_INVALID,
        f"{label} must be a string, number, list or mapping, got {value_type_name(value)}",
    )


def validate_row(value: Any, prompt_key: str) -> _ValidRow:
    """Check one row against the schema; raise ``RowProblem`` for the first problem found.

    A null optional field (``ability``, ``extra_info``, ``agent_name``) counts as absent:
    parquet stores a field that some rows lack as null in the others.
    """
    if not isinstance(value, dict):
        raise RowProblem(BadRowReason.NOT_AN_OBJECT, f"expected an object, got {value_type_name(value)}")
    messages = _check_messages(value.get(prompt_key), prompt_key)

    data_source = value.get("data_source")
    if data_source is None:
        raise RowProblem(BadRowReason.DATA_SOURCE_MISSING, "'data_source' is missing")
    if not isinstance(data_source, str) or not data_source:
        raise RowProblem(
            BadRowReason.DATA_SOURCE_INVALID,
            f"'data_source' must be a non-empty string, got {value_type_name(data_source)} {data_source!r}",
        )

    ability = value.get("ability")
    if ability is None:
        ability = ""
    elif not isinstance(ability, str):
        raise RowProblem(BadRowReason.ABILITY_INVALID, f"'ability' must be a string, got {value_type_name(ability)}")

    reward_model = value.get("reward_model")
    if reward_model is None:
        raise RowProblem(BadRowReason.REWARD_MODEL_MISSING, "'reward_model' is missing")
    if not isinstance(reward_model, dict):
        raise RowProblem(
            BadRowReason.REWARD_MODEL_INVALID,
            f"'reward_model' must be a dict like {{'style': 'rule', 'ground_truth': ...}}, "
            f"got {value_type_name(reward_model)}",
        )
    if reward_model.get("ground_truth") is None:
        raise RowProblem(BadRowReason.GROUND_TRUTH_MISSING, "'reward_model' has no 'ground_truth'")
    ground_truth = _ground_truth_text(reward_model["ground_truth"])

    extra_info = value.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise RowProblem(
            BadRowReason.EXTRA_INFO_INVALID, f"'extra_info' must be a dict, got {value_type_name(extra_info)}"
        )
    agent_name = value.get("agent_name")
    if agent_name is not None and (not isinstance(agent_name, str) or not agent_name.strip()):
        raise RowProblem(
            BadRowReason.AGENT_NAME_INVALID,
            f"'agent_name' must name an agent loop (e.g. 'tool_agent'), got {value_type_name(agent_name)} {agent_name!r}",
        )
    return _ValidRow(messages, data_source, ground_truth, ability, dict(extra_info), agent_name)


def check_prompt_column(path: str, records: list[Record], prompt_key: str) -> None:
    """Fail fast when no row of a file has the prompt column: a wrong ``prompt_key`` (or the
    wrong file), not thousands of individually bad rows, and never something to skip."""
    objects = [r.value for r in records if isinstance(r.value, dict)]
    if not objects or any(prompt_key in obj for obj in objects):
        return
    columns = sorted({key for obj in objects[:100] for key in obj})
    raise DataError(
        f"{path}: no row has the prompt column {prompt_key!r} (columns: {', '.join(columns)}); "
        "is prompt_key right, and is this a file in verl's row schema?"
    )
