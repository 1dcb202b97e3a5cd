"""A run folder's ``metrics.jsonl`` as the end-to-end tests read it.

Imported by the test modules beside it (pytest puts this folder on ``sys.path``): one reader, so
every test skips a line a kill cut short the same way and compares the same figures."""

from __future__ import annotations

import json
from pathlib import Path

WALL_CLOCK = ("timing_s/", "perf/")
"""Key prefixes of wall-clock figures, which differ between any two runs of the same work."""


def records(out: Path) -> list[dict]:
    """Every complete record of the run folder ``out``, in the order logged."""
    complete = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            complete.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return complete


def per_step(out: Path, volatile: tuple[str, ...] = WALL_CLOCK) -> dict[int, dict]:
    """The last record of each step (a step re-run after a kill is logged again), without the
    keys that start with any of ``volatile``."""
    return {record["step"]: {k: v for k, v in record.items() if not k.startswith(volatile)}
            for record in records(out)}
