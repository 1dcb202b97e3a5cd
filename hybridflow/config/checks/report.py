"""Collecting a validation's findings, and the small helpers its messages share (a key's value and help
text, divisors and multiples near a value, ``a, b or c`` lists)."""

from __future__ import annotations

import dataclasses

from hybridflow.config.schema import Config, key_value


def key_help(cfg: Config, path: str) -> str:
    section_path, _, name = path.rpartition(".")
    section = key_value(cfg, section_path) if section_path else cfg
    fld = {f.name: f for f in dataclasses.fields(section)}[name]
    return str(fld.metadata.get("help", ""))


def divisors_near(n: int, target: int, count: int = 3) -> list[int]:
    """Up to ``count`` divisors of ``n`` closest to ``target``, ascending."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return sorted(sorted(divisors, key=lambda d: (abs(d - target), -d))[:count])


def multiples_near(step: int, target: int) -> list[int]:
    """The multiples of ``step`` just below and above ``target`` (positive ones only)."""
    below = (target // step) * step
    return [m for m in (below, below + step) if m > 0]


def or_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


class Report:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, message: str) -> None:
        self.errors.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
