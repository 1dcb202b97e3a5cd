"""A run that fails before its first step leaves no folder behind in ``runs/``.

Set-up makes the run's folder and writes ``config.yaml`` into it before it loads the model,
the data and the reward function, so that a mistake there would otherwise leave a folder that
holds nothing but the config (one per attempt, while the user fixes the mistake). The folder
is removed when the run that made it fails while it still holds set-up files only. Anything a
real step wrote (a checkpoint, a metrics record of step 1 or later) and anything we do not
recognise keeps it, and a folder that existed before the run (a resumed run's) is never removed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridflow.config import Config
from hybridflow.controller.rollout_dtype import ROLLOUT_DTYPE_FILE
from hybridflow.tracking.loggers import METRICS_FILENAME, STEP_KEY, TENSORBOARD_DIRNAME
from hybridflow.tracking.timeline import TIMELINE_FILENAME

log = logging.getLogger(__name__)

DEFAULT_RUNS_DIR = Path("runs")
"""Where a run without ``trainer.output_dir`` makes its folder (relative to the working directory)."""

SETUP_FILES = frozenset({"config.yaml", METRICS_FILENAME, TIMELINE_FILENAME, ROLLOUT_DTYPE_FILE})
"""Files set-up writes before the first step; the metrics file counts only while it holds no step.
The timeline (trainer.timeline) never counts: closing the run writes it, whatever the run reached;
the steps it shows are in metrics.jsonl too."""

SETUP_DIRS = frozenset({"checkpoints", TENSORBOARD_DIRNAME})
"""Folders made at set-up: checkpoints count once they hold a file, tensorboard never on its own
(its event files are opened at set-up; the steps it shows are in metrics.jsonl too)."""


def holds_results(out: Path) -> bool:
    """Whether ``out`` holds anything worth keeping: a file under ``checkpoints/``, a metrics
    record of a training step (step 1 or later), or anything set-up does not write."""
    for entry in out.iterdir():
        if entry.name == "checkpoints" and entry.is_dir() and not entry.is_symlink():
            if any(p.is_file() or p.is_symlink() for p in entry.rglob("*")):
                return True
        elif entry.name == TENSORBOARD_DIRNAME and entry.is_dir() and not entry.is_symlink():
            continue
        elif entry.name == METRICS_FILENAME and entry.is_file():
            if _has_step_records(entry):
                return True
        elif entry.name not in SETUP_FILES or not entry.is_file() or entry.is_symlink():
            return True
    return False


def _has_step_records(metrics: Path) -> bool:
    """A record of step 1 or later (step 0 is the validation before training)."""
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial last line of a killed writer
        step = record.get(STEP_KEY) if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 1:
            return True
    return False


@contextmanager
def discard_run_folder_on_failure(cfg: Config) -> Iterator[None]:
    """Remove the folder the run in this block made when the block fails before it holds results.

    The folder counts as made by this run when ``trainer.output_dir`` did not exist before the
    block; without ``trainer.output_dir``, when set-up's ``runs/<experiment>-<time>`` name was
    not in ``runs/`` before (and ``runs/`` itself goes too when the run made it and it is left
    empty).
    """
    given = cfg.trainer.output_dir
    existed = given is not None and Path(given).expanduser().exists()
    runs_existed = DEFAULT_RUNS_DIR.is_dir()
    runs_before = set(os.listdir(DEFAULT_RUNS_DIR)) if given is None and runs_existed else set()
    try:
        yield
    except BaseException:
        chosen = cfg.trainer.output_dir  # set-up fills it in when it names the folder
        if chosen is not None and not existed:
            out = Path(chosen).expanduser()
            made_here = given is not None or out.name not in runs_before
            if made_here and out.is_dir() and not out.is_symlink() and not holds_results(out):
                _remove(out)
                if given is None and not runs_existed:
                    _remove_if_empty(DEFAULT_RUNS_DIR)
        raise


def _remove(out: Path) -> None:
    try:
        shutil.rmtree(out)
    except OSError as error:  # the run's own error is the one to report
        log.warning("could not remove %s, which holds no results of the failed run: %s", out, error)
        return
    log.info("removed %s: the run failed before it wrote any results", out)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (another run's folder appeared) or already gone
