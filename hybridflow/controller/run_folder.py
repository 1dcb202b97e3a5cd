"""The run's folder: one run at a time in it, and no folder left behind by a run that fails early.

One run at a time: set-up takes an OS file lock on ``LOCK_FILE`` in the folder (``lock_run_folder``)
before it writes anything there, and holds it until the run ends. Two runs writing one folder would
corrupt each other silently (metrics.jsonl with steps 1,1,2,2; each checkpoint whichever run wrote
it last), so a second run refuses to start, naming the holder's pid. ``flock`` locks belong to the
open file, so the kernel releases the lock when its holder dies, SIGKILL included: a stale lock of
a dead run is simply taken over, never a file to delete by hand. Holding the lock, set-up removes
what killed runs left in the folder (``clean_leftovers``): temporary records and the checkpoint
folder's temporary saves, whatever pid they name, since no other run can be writing them.

No folder left behind:

Set-up makes the run's folder and writes ``config.yaml`` into it before it loads the model,
the data and the reward function, so that a mistake there would otherwise leave a folder that
holds nothing but the config (one per attempt, while the user fixes the mistake). The folder
is removed when the run that made it fails while it still holds set-up files only. Anything a
real step wrote (a checkpoint, a metrics record of step 1 or later) and anything we do not
recognise keeps it, and a folder that existed before the run (a resumed run's) is never removed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridflow.cluster.worker_group import WorkerGroup
from hybridflow.config import Config, ConfigError
from hybridflow.controller.checkpoint import CheckpointManager
from hybridflow.controller.rollout_dtype import ROLLOUT_DTYPE_FILE, write_record
from hybridflow.controller.token_budgets import TOKEN_BUDGETS_FILE
from hybridflow.tracking.loggers import METRICS_FILENAME, STEP_KEY, TENSORBOARD_DIRNAME
from hybridflow.tracking.timeline import TIMELINE_FILENAME

log = logging.getLogger(__name__)

DEFAULT_RUNS_DIR = Path("runs")
"""Where a run without ``trainer.output_dir`` makes its folder (relative to the working directory)."""

LOCK_FILE = ".run.lock"
"""The lock a run holds on its folder (``lock_run_folder``); it holds the holder's pid, host and start."""

LEFTOVER = re.compile(r"^\.(?:.+\.tmp-|write-test-)\d+$")
"""A record being replaced (``.<name>.tmp-<pid>``: rollout_dtype.json, the checkpoint manager's files)
or set-up's write test (``.write-test-<pid>``): what a run killed at the wrong moment leaves."""

PLACEMENT_FILE = "placement.json"
"""Where each rank of each role runs (``write_placement``): node id, address and process id, per rank."""

SETUP_FILES = frozenset({"config.yaml", METRICS_FILENAME, TIMELINE_FILENAME, ROLLOUT_DTYPE_FILE, LOCK_FILE,
                         PLACEMENT_FILE, TOKEN_BUDGETS_FILE})
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
    empty); and only while this run holds its lock. However the block ends, the lock set-up took
    on the folder is released.
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
            # Only under this run's own lock: a folder another run holds is that run's.
            if made_here and holds_lock(out) and out.is_dir() and not out.is_symlink() and not holds_results(out):
                _remove(out)
                if given is None and not runs_existed:
                    _remove_if_empty(DEFAULT_RUNS_DIR)
        raise
    finally:
        if cfg.trainer.output_dir is not None:
            release_run_folder(Path(cfg.trainer.output_dir).expanduser())


_held: dict[Path, int] = {}  # run folder (resolved) -> the descriptor of this process's lock on it


def lock_run_folder(out: Path) -> None:
    """Hold ``out``'s lock for this process (module docstring) until ``release_run_folder``; a
    folder this process holds already is held once more. Raises ``ConfigError`` on
    ``trainer.output_dir`` naming the holder when another live process holds it."""
    key = out.resolve()
    if key in _held:
        return
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if not isinstance(error, BlockingIOError):  # a file system without locks (ENOLCK): run unguarded
            os.close(fd)
            log.warning("could not lock %s (%s): nothing stops a second run from writing this folder at the same "
                        "time", out / LOCK_FILE, error.strerror or error)
            return
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not written its pid yet"
        os.close(fd)
        raise ConfigError(f"trainer.output_dir={str(out)!r} is in use by another run ({holder}); two runs in one "
                          f"folder overwrite each other's checkpoints and metrics: wait for it to end, or choose "
                          f"another trainer.output_dir", key="trainer.output_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
              .encode(), 0)
    _held[key] = fd
    clean_leftovers(out)


def clean_leftovers(out: Path) -> list[str]:
    """Remove what killed runs left in ``out``, whose lock this process holds: temporary records
    (``LEFTOVER``) and the checkpoint folder's leftovers (``CheckpointManager.clean_leftovers``),
    whatever pid they name. Returns the names removed."""
    removed = [p.name for p in out.iterdir() if LEFTOVER.match(p.name) and p.is_file()]
    for name in removed:
        (out / name).unlink(missing_ok=True)
    if removed:
        log.info("removed what a killed run left in %s: %s", out, ", ".join(removed))
    return removed + CheckpointManager(out / "checkpoints", None).clean_leftovers(exclusive=True)


def holds_lock(out: Path) -> bool:
    """Whether this process holds ``out``'s lock."""
    return out.resolve() in _held


def release_run_folder(out: Path) -> None:
    """Give up this process's lock on ``out`` (nothing when it holds none). The file stays: a run
    that opened it to wait would otherwise lock a file that a third run no longer sees."""
    fd = _held.pop(out.resolve(), None)
    if fd is not None:
        os.close(fd)


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


def write_placement(output_dir: Path, groups: list[tuple[str, WorkerGroup[Any]]]) -> Path:
    """Record where every rank of every role runs (``PLACEMENT_FILE``), replacing the file whole:
    on a Ray cluster of several nodes, which node holds which rank is the first thing to know when
    one of them fails. A resumed run writes its own (its ranks may land elsewhere); a replica's
    restart, or an elastic run's change of replicas, writes it again (``ReplicaPool.on_change``)."""
    record = {role: [{"rank": rank, "node_id": node.node_id, "address": node.address, "pid": node.pid}
                     for rank, node in enumerate(group.nodes())] for role, group in groups}
    path = output_dir / PLACEMENT_FILE
    write_record(path, record)
    return path


def check_shared_folders(folders: dict[str, Path], role: str, group: WorkerGroup[Any]) -> None:
    """Refuse a run whose ranks cannot write where checkpoints and exports go: each rank of
    ``group`` (on a Ray cluster, perhaps on another node) reads a token this process wrote into
    each of ``folders`` (config key -> folder; proving it sees the same folder, not a local one of
    its own node) and writes a file of its own there. A ``ConfigError`` names the key, the folder,
    the node and the rank. A probe left by a killed run is a ``LEFTOVER``, cleaned at the next start."""
    token = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    probes = {}
    for key, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)  # set-up checked this process can (resolve_output_dir)
        probes[key] = folder / f".write-test-{os.getpid()}"
        probes[key].write_text(token)
    try:
        found = group.call_all(probe_folders, {key: str(path) for key, path in probes.items()}, token)
    finally:
        for probe in probes.values():
            probe.unlink(missing_ok=True)
    for rank, (node, failures) in enumerate(zip(group.nodes(), found, strict=True)):
        for key, problem in failures.items():
            raise ConfigError(
                f"{key}={str(folders[key])!r} cannot be used by {role} rank {rank} on node {node.address} (id "
                f"{node.node_id}): {problem}. Every node writes its ranks' checkpoint shards and exports there: use a "
                f"folder all nodes share at the same path (a network file system), or trainer.checkpoint_dir=<object "
                f"storage URL>", key=key)


def probe_folders(_worker: Any, probes: dict[str, str], token: str) -> dict[str, str]:
    """On a rank (``check_shared_folders``): for each key, what is wrong with its folder (nothing: fine)."""
    failures = {}
    for key, probe in probes.items():
        path = Path(probe)
        try:
            if path.read_text() != token:
                failures[key] = "that path holds another folder there than the trainer's (one local to the node)"
                continue
            own = path.parent / f".rank-probe-{socket.gethostname()}.tmp-{os.getpid()}"
            own.write_text(token)
            own.unlink()
        except FileNotFoundError:
            failures[key] = "the trainer's files are not there (a folder local to the node, not a shared one)"
        except OSError as error:
            failures[key] = f"it cannot write there ({error.strerror or error})"
    return failures
