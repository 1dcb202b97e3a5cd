"""How a schema field is declared: its default and the help text ``config explain`` and docs/config.md show."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def f(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its help text (shown by ``config explain`` and in docs/config.md)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def sub(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


# verl's short dtype spellings (its PrecisionType), read as the schema's names by dtype keys.
DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp32": "float32"}
