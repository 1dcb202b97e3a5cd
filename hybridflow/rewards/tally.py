"""Reward metrics kept as per-sample values until they are reported, so that scoring a batch in
parts (each prompt group as its samples finish, while the rest of the round is generated) reports
exactly the metrics of scoring it whole.

    tally = RewardTally()
    tally.add("reward/error_rate", "mean", [0.0, 1.0])
    tally.merge(other_part)
    tally.metrics()   # {"reward/error_rate": 0.5, ...}

Each metric has a kind: ``mean`` (over its samples), ``sum`` (restarts), ``max`` or ``min``.
Means are exact sums (``math.fsum``) over every sample, so the order parts arrive in does not
change a digit. A metric added as a ``fallback`` is reported only when no part has the same
metric as a primary one (an agent's own extras under the scorer's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

KINDS = ("mean", "sum", "max", "min")


@dataclass
class RewardTally:
    values: dict[str, tuple[str, list[float]]] = field(default_factory=dict)
    fallbacks: dict[str, tuple[str, list[float]]] = field(default_factory=dict)

    def add(self, key: str, kind: str, values: Iterable[float], *, fallback: bool = False) -> None:
        if kind not in KINDS:
            raise ValueError(f"RewardTally: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        table = self.fallbacks if fallback else self.values
        known, kept = table.setdefault(key, (kind, []))
        if known != kind:
            raise ValueError(f"RewardTally: {key!r} is a {known} metric, not a {kind} one")
        kept.extend(float(v) for v in values)

    def merge(self, other: RewardTally) -> RewardTally:
        """Add ``other``'s values to this tally (in place); returns it."""
        for key, (kind, values) in other.values.items():
            self.add(key, kind, values)
        for key, (kind, values) in other.fallbacks.items():
            self.add(key, kind, values, fallback=True)
        return self

    def metrics(self) -> dict[str, float]:
        """Each metric over every sample added (a metric without values is left out, except a
        ``sum``, which is 0)."""
        out: dict[str, float] = {}
        for table in (self.values, self.fallbacks):
            for key, (kind, values) in table.items():
                if key in out or (not values and kind != "sum"):
                    continue
                if kind == "mean":
                    out[key] = math.fsum(values) / len(values)
                elif kind == "sum":
                    out[key] = math.fsum(values)
                else:
                    out[key] = max(values) if kind == "max" else min(values)
        return out
