"""A run folder's ``metrics.jsonl`` as the end-to-end tests read it.

Imported by the test modules beside it (pytest puts this folder on ``sys.path``): one reader, so
every test skips a line a kill cut short the same way and compares the same figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def cli_train(args: list[str], out: Path, cache: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """``hybridflow train <args>`` in a process of its own, writing to ``out`` with the warm start
    cached in ``cache``, killed at ``fault`` (``HYBRIDFLOW_FAULT``) when one is given."""
    env = {**os.environ, "HYBRIDFLOW_FAULT": fault or ""}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", *args, f"warm_start.cache_dir={cache}",
                           f"trainer.output_dir={out}"], capture_output=True, text=True, timeout=300, env=env)
