"""Checkpoint folders: ``<root>/global_step_<N>/{actor/, critic/ (PPO with a critic), manifest.json,
trainer_state.json}``
and ``<root>/latest``.

Writing: everything goes into ``.tmp-global_step_<N>-<pid>`` (the actor's files, the resolved
config, ``trainer_state.json``), each file flushed to disk; then a manifest with the size and
SHA-256 of every file; then one rename into place; then ``latest``. A kill at any moment
leaves the previous complete checkpoint in charge. A write that fails (a full disk, most often)
removes its partial folder and raises ``CheckpointError`` ("no space left on <path>"); the
trainer stops or goes on without that checkpoint (``trainer.on_save_error``).

Deleting: only a checkpoint known to be intact (written by this manager, or verified by it) is
ever deleted, and first renamed to ``.trash-*`` so a kill mid-delete leaves nothing that looks
like a checkpoint. A damaged one is left in place, reported, and not counted by pruning; one
in the way of a new save of its step is renamed to ``damaged-global_step_<N>``. Leftovers of
killed saves and prunes are removed when a run starts (``clean_leftovers``).

Reading: the manifest is checked first, so a truncated, altered or unlisted file is reported
by name before anything is parsed; loaders then read only files the manifest lists. Loading
reads JSON and safetensors, and ``torch.load`` only with ``weights_only=True``: never an
arbitrary pickle. A sharded checkpoint's ``.metadata`` (``torch.distributed.checkpoint``'s
index, a pickle) is listed and verified like any file, then read by an unpickler that builds only
DCP's own metadata records (``hybridflow.training.sharded_checkpoint``). ``resume_mode=auto`` takes the newest checkpoint that verifies *and* loads,
reporting each newer one it skipped, and refuses to start over when none does;
``resume_mode=path`` refuses a checkpoint that fails either.

Object storage (``trainer.checkpoint_dir=s3://...``, ``RemoteCheckpoints``): the local folder
above stages every checkpoint, written as described; the finished folder is then uploaded
file by file, ``manifest.json`` last, so a remote folder without its manifest is an upload that
was cut short and is never resumed from (a later save of that step replaces it). Pruning deletes
a remote manifest first for the same reason. Resuming downloads the newest remote checkpoint
with a manifest that is newer than every intact local one into a ``.tmp-`` folder, verifies it
against its manifest and renames it into the local folder; the local resume above then loads
it. Every rank's files of a sharded checkpoint are in the local folder when it is published (the
ranks share the controller's disk), so the controller uploads them all: remote storage stages
through that disk, and multi-node runs need it shared.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from hybridflow.utils.errors import CheckpointError, causes, find_cause, one_line
from hybridflow.utils.faults import maybe_fault
from hybridflow.utils.files import give_default_modes
from hybridflow.utils.storage import Storage, StorageError, join, sha256_file

log = logging.getLogger(__name__)

T = TypeVar("T")

STEP_DIR = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
LATEST_FILE = "latest"
# Working names in the checkpoint root. None matches STEP_DIR, so none is ever resumed from.
TMP_DIR = re.compile(r"^\.tmp-global_step_\d+(?:-(\d+))?$")  # a save in progress (writer pid; older saves had none)
TMP_FILE = re.compile(r"^\..+\.tmp-(\d+)$")  # _write_text_atomic's temporary file (writer pid)
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted
DAMAGED_PREFIX = "damaged-"  # a damaged checkpoint moved out of the way of a new save of its step
# torch's zip writer reports a failed write as "[enforce fail at inline_container.cc:...]" and
# drops the errno; with less than this free on the disk afterwards, the failure was a full disk.
LOW_SPACE_BYTES = 64 << 20
TORCH_WRITER_FAILURE = ("inline_container.cc", "PytorchStreamWriter failed")

__all__ = [
    "MANIFEST_FILE", "STATE_FILE", "CheckpointError", "CheckpointManager", "RemoteCheckpoints", "verify_checkpoint",
    "write_manifest",
]


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_tree(root: Path) -> None:
    """Flush every file the workers wrote (they may not have), so the rename publishes data on disk."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (a power cut must not undo a publish or a delete)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself still happened
    finally:
        os.close(fd)


def _not_a_writer(pid: int) -> bool:
    """Whether a temporary name's writer ``pid`` cannot be writing it now: gone, or this process
    (which writes none before it cleans)."""
    return pid == os.getpid() or not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def write_manifest(ckpt: Path) -> dict[str, Any]:
    files = {
        p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    manifest = {"version": MANIFEST_VERSION, "files": files}
    _write_text_atomic(ckpt / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


def _read_manifest(manifest_path: Path) -> dict[str, tuple[int, str]]:
    """{relative path: (size, sha256)}, or ``CheckpointError`` for anything malformed."""
    try:
        files = json.loads(manifest_path.read_text())["files"]
        listed = {}
        for rel, entry in files.items():
            parts = PurePosixPath(rel).parts
            # A listed path must stay inside the checkpoint: no absolute paths, no "..".
            if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
                raise ValueError(f"path {rel!r} points outside the checkpoint")
            size, sha = entry["size"], entry["sha256"]
            if not isinstance(size, int) or not isinstance(sha, str):
                raise ValueError(f"entry {rel!r} has no integer size and string sha256")
            listed[rel] = (size, sha)
        return listed
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is corrupt: {one_line(exc)}") from exc


def verify_checkpoint(ckpt: Path) -> None:
    """Check every file against the manifest; raise ``CheckpointError`` naming the first bad one.

    A file the manifest does not list is refused too: loaders read only listed files, and an
    extra file in a checkpoint was put there by something other than the writer."""
    manifest_path = ckpt / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint cannot be verified")
    files = _read_manifest(manifest_path)
    for path in sorted(ckpt.rglob("*")):
        rel = path.relative_to(ckpt).as_posix()
        if not path.is_dir() and rel != MANIFEST_FILE and rel not in files:
            raise CheckpointError(
                f"checkpoint file {path} is not listed in {manifest_path}: a checkpoint holding unlisted files is "
                f"refused (move the file out of the checkpoint to use it)"
            )
    for rel, (expected_size, sha) in files.items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != expected_size:
            raise CheckpointError(f"checkpoint file {path} is truncated or altered: {size} bytes, the manifest says {expected_size}")
        if sha256_file(path) != sha:
            raise CheckpointError(f"checkpoint file {path} is altered: its SHA-256 differs from the manifest")


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _write_failure(root: Path, exc: BaseException) -> str:
    """Why a save failed, in a few words: "no space left on <root>" when it was a full disk."""
    for cause in causes(exc):
        text = str(cause)
        if isinstance(cause, OSError) and cause.errno == errno.EDQUOT or "Disk quota exceeded" in text:
            return f"no space left on {root} (disk quota exceeded)"
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC or "No space left on device" in text or "os error 28" in text:
            return f"no space left on {root}"
    torch_failure = next((c for c in causes(exc) if any(m in str(c) for m in TORCH_WRITER_FAILURE)), None)
    if torch_failure is not None:
        free = _free_bytes(root)
        if free is not None and free < LOW_SPACE_BYTES:
            return f"no space left on {root} ({free} bytes free; torch's writer said: {one_line(torch_failure)})"
        return f"torch's writer failed under {root} ({one_line(torch_failure)}); {free} bytes are free there"
    return f"writing it failed: {one_line(exc)}"


def _load_failure(ckpt: Path, exc: BaseException) -> str:
    """The loader's own ``CheckpointError`` (it names the file), wherever the worker group and
    Ray wrapped it; else the first line of what went wrong."""
    named = find_cause(exc, CheckpointError)
    if named is not None:
        return str(named)
    return f"{ckpt} could not be loaded: {one_line(exc)}"


class CheckpointManager:
    def __init__(self, root: Path, max_to_keep: int | None) -> None:
        self.root = root
        self.max_to_keep = max_to_keep
        # What this manager knows about the step folders under root, by name. Only intact ones
        # may be deleted; a damaged one is reported once and left alone.
        self._intact: set[str] = set()
        self._damaged: dict[str, str] = {}
        self._reported: set[str] = set()

    def step_folders(self) -> list[tuple[int, Path]]:
        """Every ``global_step_<N>`` folder, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        return [(step, p) for step, p in self.step_folders() if (p / STATE_FILE).is_file()]

    # ---------------------------------------------------------------- housekeeping
    def clean_leftovers(self, exclusive: bool = False) -> list[str]:
        """Remove what killed saves and prunes left behind: folders being deleted (``.trash-*``),
        and temporary save folders and ``latest`` files whose writer is no longer running, or is
        this process (a killed run's pid taken again, as a container's restart gives its trainer
        the same one, is no writer), or any writer when ``exclusive`` (the caller holds the run
        folder's lock, so no other run writes here). Never touches a ``global_step_<N>`` folder.
        Returns the names removed."""
        if not self.root.is_dir():
            return []
        removed = []
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(TRASH_PREFIX):
                stale = True
            elif m := TMP_DIR.match(p.name):
                stale = exclusive or m.group(1) is None or _not_a_writer(int(m.group(1)))
            elif m := TMP_FILE.match(p.name):
                stale = exclusive or _not_a_writer(int(m.group(1)))
            else:
                continue
            if not stale:
                continue
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove %s, left by an interrupted save or deletion: %s", p, exc)
                continue
            removed.append(p.name)
        if removed:
            log.info("removed leftovers of interrupted checkpoint saves or deletions in %s: %s", self.root, ", ".join(removed))
        return removed

    def _status(self, ckpt: Path) -> str | None:
        """None when ``ckpt`` is intact, else why it is damaged. Verified once per manager."""
        if ckpt.name in self._intact:
            return None
        if ckpt.name not in self._damaged:
            try:
                if not (ckpt / STATE_FILE).is_file():
                    raise CheckpointError(f"{ckpt} is incomplete: it has no {STATE_FILE}")
                verify_checkpoint(ckpt)
            except CheckpointError as exc:
                self._damaged[ckpt.name] = str(exc)
            else:
                self._intact.add(ckpt.name)
                return None
        return self._damaged[ckpt.name]

    def _report_damaged(self, ckpt: Path, reason: str) -> None:
        if ckpt.name not in self._reported:
            self._reported.add(ckpt.name)
            log.warning(
                "leaving damaged checkpoint %s in place (%s); it does not count toward trainer.max_ckpt_to_keep: "
                "inspect it, then delete or move it yourself", ckpt, reason,
            )

    def _delete(self, step: int, ckpt: Path) -> None:
        """Rename, then delete: a kill halfway leaves a ``.trash-*`` folder, never a half-deleted
        ``global_step_<N>`` that still looks like a checkpoint."""
        trash = self.root / f"{TRASH_PREFIX}{ckpt.name}-{os.getpid()}"
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(ckpt, trash)
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", ckpt, exc)
            return
        _fsync_dir(self.root)
        maybe_fault("checkpoint_delete", step)
        shutil.rmtree(trash, ignore_errors=True)
        self._intact.discard(ckpt.name)

    def _prune(self, keep: Path) -> None:
        """Keep ``keep`` (just saved) and the newest intact others, ``max_to_keep`` in all; delete
        older intact ones; leave damaged ones alone and say so."""
        if self.max_to_keep is None or self.max_to_keep < 1:
            return
        kept = 1
        for step, ckpt in reversed(self.step_folders()):
            if ckpt == keep:
                continue
            reason = self._status(ckpt)
            if reason is not None:
                self._report_damaged(ckpt, reason)
            elif kept < self.max_to_keep:
                kept += 1
            else:
                self._delete(step, ckpt)

    def _set_aside(self, final: Path) -> Path | None:
        """Clear the way for a new save of the same step: an intact folder goes to the trash
        (returned, deleted once the new one is in place), a damaged one is renamed
        ``damaged-<name>`` and kept."""
        reason = self._status(final)
        if reason is None:
            trash = self.root / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            return trash
        aside = self.root / f"{DAMAGED_PREFIX}{final.name}"
        n = 1
        while aside.exists():
            n += 1
            aside = self.root / f"{DAMAGED_PREFIX}{final.name}-{n}"
        os.replace(final, aside)
        self._damaged.pop(final.name, None)
        log.warning("moved damaged checkpoint %s aside to %s before saving that step again (%s); nothing in it was deleted",
                    final, aside.name, reason)
        return None

    # ---------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: dict[str, Any],
        write_actor: Callable[[Path], None],
        extra_files: dict[str, str] | None = None,
        write_roles: dict[str, Callable[[Path], None]] | None = None,
    ) -> Path:
        """Write checkpoint ``step``: the actor's files, other roles' (``write_roles``: folder name
        -> writer, e.g. the critic's), ``extra_files`` (name -> text), ``state``, then the manifest. A failed write raises ``CheckpointError`` after removing the partial
        folder; the checkpoints already there are untouched. A worker whose process died mid-write
        raises its ``WorkerError`` as it is (the partial folder removed too)."""
        final = self.root / f"global_step_{step}"
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.clean_leftovers()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            write_actor(tmp / "actor")
            for folder, write in (write_roles or {}).items():
                write(tmp / folder)
            for name, text in (extra_files or {}).items():
                _write_text_atomic(tmp / name, text)
            _write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=1))
            maybe_fault("checkpoint_write", step)
            # safetensors writes model.safetensors with mode 0600: publish what others may read.
            give_default_modes(tmp)
            _fsync_tree(tmp)
            write_manifest(tmp)
        except Exception as exc:
            # Here, not at the top: the CLI reads this module before a config error, where torch is not imported yet.
            from hybridflow.cluster.worker_group import WorkerError

            died = find_cause(exc, WorkerError)
            if died is not None and died.process_died:
                # A rank's process died mid-save (its node lost): a fault of the run, not of the write, left to
                # what handles a death in any other call (the CLI's worker error; trainer.max_restarts rebuilds).
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            reason = _write_failure(self.root, exc)  # before the cleanup frees the space
            shutil.rmtree(tmp, ignore_errors=True)
            previous = [p.name for _, p in self.step_folders()]
            raise CheckpointError(
                f"could not save checkpoint {final.name}: {reason}; the partial save was removed and the checkpoints "
                f"already there are untouched (newest: {previous[-1] if previous else 'none'})"
            ) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # Ctrl-C mid-write: leave no partial folder
            raise
        # Only a finished folder is renamed into place, so a global_step_<N> folder is complete.
        trash = None
        try:
            trash = self._set_aside(final) if final.exists() else None
            os.replace(tmp, final)
        except OSError as exc:
            if trash is not None and not final.exists():
                os.replace(trash, final)  # put the one it was to replace back
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not save checkpoint {final.name}: renaming it into place failed: {one_line(exc)}; the partial "
                f"save was removed and the checkpoints already there are untouched"
            ) from exc
        _fsync_dir(self.root)
        self._intact.add(final.name)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        try:
            _write_text_atomic(self.root / LATEST_FILE, final.name + "\n")
        except OSError as exc:
            # Resuming scans the folders and never reads this pointer: the checkpoint stands.
            log.warning("saved checkpoint %s but could not update %s: %s", final, self.root / LATEST_FILE, exc)
        self._prune(keep=final)
        log.info("saved checkpoint %s", final)
        return final

    def adopt(self, downloaded: Path, name: str) -> Path:
        """Rename the verified checkpoint folder ``downloaded`` (in this root) into place as
        ``name``; a damaged folder of that name is moved aside first (``damaged-<name>``)."""
        final = self.root / name
        trash = self._set_aside(final) if final.exists() else None
        os.replace(downloaded, final)
        _fsync_dir(self.root)
        self._intact.add(final.name)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return final

    def newest_intact_step(self) -> int | None:
        """The step of the newest complete checkpoint here that verifies, or None."""
        for step, ckpt in reversed(self.complete_checkpoints()):
            if self._status(ckpt) is None:
                return step
        return None

    # -------------------------------------------------------------------- resume
    def find(self, mode: str, path: str | None) -> Path | None:
        """The checkpoint to resume from, verified against its manifest (nothing is loaded).

        ``auto``: the newest one that verifies (each damaged newer one is reported and
        skipped), None when there is none, ``CheckpointError`` when every one is damaged.
        ``path``: that checkpoint, or ``CheckpointError``.
        """
        found = self.resume(mode, path, load=None)
        return None if found is None else found[0]

    def resume(self, mode: str, path: str | None, load: Callable[[Path], T] | None) -> tuple[Path, T | None] | None:
        """(checkpoint, ``load(checkpoint)``) for the checkpoint to resume from.

        ``load`` reads the checkpoint into the trainer; any error it raises counts as damage to
        that checkpoint. ``auto``: the newest checkpoint that verifies and loads; each newer one
        that does not is logged with its reason and left in place. None when there is no
        checkpoint; ``CheckpointError`` when there are some and none verifies and loads (never a
        silent start from step 0). ``path``: that checkpoint or ``CheckpointError``.
        """
        if mode == "path":
            if not path:
                raise CheckpointError("trainer.resume_mode=path needs trainer.resume_from_path (the checkpoint folder)")
            ckpt = Path(path).expanduser()
            try:
                return ckpt, self._open(ckpt, load)
            except CheckpointError as exc:
                raise CheckpointError(f"cannot resume from trainer.resume_from_path={path}: {exc}") from exc
        skipped: list[str] = []
        for _, ckpt in reversed(self.step_folders()):
            try:
                result = self._open(ckpt, load)
            except CheckpointError as exc:
                self._damaged[ckpt.name] = str(exc)
                self._intact.discard(ckpt.name)
                skipped.append(f"{ckpt.name}: {exc}")
                log.error("skipping checkpoint %s: %s", ckpt, exc)
                continue
            self._intact.add(ckpt.name)
            if skipped:
                log.warning("using checkpoint %s; skipped %d newer one(s) that failed verification or loading, left "
                            "in place: %s", ckpt, len(skipped), "; ".join(skipped))
            return ckpt, result
        if skipped and load is None:
            raise CheckpointError(f"none of the {len(skipped)} checkpoint(s) under {self.root} is intact: {'; '.join(skipped)}")
        if skipped:
            raise CheckpointError(
                f"none of the {len(skipped)} checkpoint(s) under {self.root} verifies and loads, so there is nothing "
                f"to resume from and training will not silently start over: {'; '.join(skipped)}. Nothing was "
                f"deleted. To start fresh, set trainer.resume_mode=disable (the damaged checkpoints are kept, never "
                f"deleted) or choose another trainer.output_dir, or move {self.root} away"
            )
        return None

    def _open(self, ckpt: Path, load: Callable[[Path], T] | None) -> T | None:
        if not (ckpt / STATE_FILE).is_file():
            raise CheckpointError(f"{ckpt} is not a complete checkpoint: it has no {STATE_FILE}")
        verify_checkpoint(ckpt)
        if load is None:
            return None
        try:
            return load(ckpt)
        except Exception as exc:
            raise CheckpointError(_load_failure(ckpt, exc)) from exc

    @staticmethod
    def load_state(ckpt: Path) -> dict[str, Any]:
        """``trainer_state.json``: a JSON object whose ``step`` matches the folder's."""
        path = ckpt / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"checkpoint state {path} is corrupt: {one_line(exc)}") from exc
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise CheckpointError(f"checkpoint state {path} is corrupt: it has no integer 'step'")
        m = STEP_DIR.match(ckpt.name)
        if m and int(m.group(1)) != state["step"]:
            raise CheckpointError(f"checkpoint state {path} says step {state['step']}, but the folder is {ckpt.name}")
        return state


class RemoteCheckpoints:
    """The copy of a run's checkpoints in object storage (``trainer.checkpoint_dir`` as a URL),
    kept beside the local ``CheckpointManager`` that stages them (see the module docstring)."""

    def __init__(self, url: str, storage: Storage, max_to_keep: int | None) -> None:
        self.url = url.rstrip("/")
        self.storage = storage
        self.max_to_keep = max_to_keep

    def complete_checkpoints(self) -> list[tuple[int, str]]:
        """(step, URL) of every remote ``global_step_<N>`` folder with its manifest, oldest first."""
        found = []
        for name in self.storage.listdir(self.url):
            m = STEP_DIR.match(name)
            if m and self.storage.exists(join(self.url, name, MANIFEST_FILE)):
                found.append((int(m.group(1)), join(self.url, name)))
        return sorted(found)

    def upload(self, ckpt: Path) -> str:
        """Upload the local checkpoint folder ``ckpt`` (already verified and published), manifest
        last; then ``latest``; then prune. ``CheckpointError`` when the upload fails (the local
        checkpoint stands)."""
        dest = join(self.url, ckpt.name)
        try:
            # A folder of this step already there (an earlier run, an upload cut short) goes first,
            # its manifest before the rest, so it never mixes with the new files.
            self.storage.remove(dest, first=(MANIFEST_FILE,))
            self.storage.upload(ckpt, dest, last=(MANIFEST_FILE,))
        except StorageError as exc:
            raise CheckpointError(f"saved checkpoint {ckpt} locally but could not upload it to trainer.checkpoint_dir="
                                  f"{self.url}: {exc}") from exc
        try:
            self.storage.write_text(join(self.url, LATEST_FILE), ckpt.name + "\n")
        except StorageError as exc:
            log.warning("uploaded checkpoint %s but could not update %s: %s", dest, join(self.url, LATEST_FILE), exc)
        self._prune(keep=dest)
        log.info("uploaded checkpoint %s", dest)
        return dest

    def _prune(self, keep: str) -> None:
        if self.max_to_keep is None or self.max_to_keep < 1:
            return
        complete = [url for _, url in self.complete_checkpoints() if url != keep]
        for url in complete[: max(0, len(complete) - (self.max_to_keep - 1))]:
            try:
                self.storage.remove(url, first=(MANIFEST_FILE,))
            except StorageError as exc:
                log.warning("could not delete old checkpoint %s: %s", url, exc)

    def download(self, url: str, local: CheckpointManager) -> Path:
        """The remote checkpoint ``url`` copied into ``local``'s folder and verified against its
        manifest before it takes its name there (a partial or altered download never does)."""
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if not STEP_DIR.match(name):
            raise CheckpointError(f"{url} is not a checkpoint folder (global_step_<N>)")
        local.root.mkdir(parents=True, exist_ok=True)
        tmp = local.root / f".tmp-{name}-{os.getpid()}"  # a TMP_DIR name: clean_leftovers removes it if killed
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if not self.storage.exists(join(url, MANIFEST_FILE)):
                raise CheckpointError(f"{url} has no {MANIFEST_FILE}: its upload did not finish")
            self.storage.download(url, tmp)
            if not (tmp / STATE_FILE).is_file():
                raise CheckpointError(f"{url} is not a complete checkpoint: it has no {STATE_FILE}")
            verify_checkpoint(tmp)
        except StorageError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not download checkpoint {url}: {exc}") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("downloaded checkpoint %s to %s", url, local.root / name)
        return local.adopt(tmp, name)

    def pull_newest(self, local: CheckpointManager) -> Path | None:
        """Download the newest remote checkpoint newer than every intact local one (skipping, with
        its reason, each that fails to download or verify); None when the local ones are as new."""
        have = local.newest_intact_step()
        for step, url in reversed(self.complete_checkpoints()):
            if have is not None and step <= have:
                return None
            try:
                return self.download(url, local)
            except CheckpointError as exc:
                log.error("skipping remote checkpoint %s: %s", url, exc)
        return None
