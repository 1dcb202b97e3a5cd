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
    """``hybridflow train <args>``, writing to ``out`` with the warm start cached in ``cache``: killed at
    ``fault`` (``HYBRIDFLOW_FAULT``) in a process of its own when one is given, otherwise in this one."""
    command = ["train", *args, f"warm_start.cache_dir={cache}", f"trainer.output_dir={out}"]
    if fault is None:  # a run nothing kills: in this process (``cli_in_process``)
        return cli_in_process(command)
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *command], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYBRIDFLOW_FAULT": fault})


def cli_in_process(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``hybridflow <args>`` run by ``hybridflow.cli.main`` in this process, as a ``CompletedProcess``
    whose returncode is the command's exit code and whose stderr holds what it logged and printed there.

    For the runs a test compares with, or reads messages from, whose point is not a process of their own
    (an uninterrupted reference, a run that refuses a damaged checkpoint): each skips a new interpreter's
    start, its imports of torch and transformers and its first model load (7-8 CPU-seconds of a 1-step run's
    8 on 2 cores). The runs a test kills, or whose signals and exit by signal it checks, stay subprocesses.
    ``env``: variables set for the call; ``HYBRIDFLOW_FAULT`` is cleared unless ``env`` sets it (a fault that
    signals nothing, such as a non-finite loss: one that kills or signals belongs in a subprocess)."""
    import contextlib
    import io
    import logging

    from hybridflow.cli import main

    err, out = io.StringIO(), io.StringIO()
    # The CLI's own log format: with a handler on the root logger, cli.main's basicConfig adds none of its own.
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    level, saved = root.level, {name: os.environ.get(name) for name in {"HYBRIDFLOW_FAULT", *(env or {})}}
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    os.environ.pop("HYBRIDFLOW_FAULT", None)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(list(args))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["hybridflow", *args], code, out.getvalue(), err.getvalue())
