"""Checkpoint folders: ``<root>/global_step_<N>/{actor/, manifest.json, trainer_state.json}``
and ``<root>/latest``.

Writing: everything goes into ``.tmp-global_step_<N>`` (the actor's files, the resolved
config, ``trainer_state.json``), each file flushed to disk; then a manifest with the size and
SHA-256 of every file; then one rename into place; then ``latest``. A kill at any moment
leaves the previous complete checkpoint in charge, and pruning never removes the newest one.

Reading: the manifest is checked first, so a truncated or altered file is reported by name
before anything is parsed. Loading reads JSON and safetensors, and ``torch.load`` only with
``weights_only=True``: never an arbitrary pickle. ``resume_mode=auto`` skips (and reports) a
damaged newest checkpoint and falls back to the newest intact one; ``resume_mode=path``
refuses a damaged one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.utils.faults import maybe_fault

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or altered; the message names the file."""


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(root: Path) -> None:
    """Flush every file the workers wrote (they may not have), so the rename publishes data on disk."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def write_manifest(ckpt: Path) -> dict[str, Any]:
    files = {
        str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    manifest = {"version": MANIFEST_VERSION, "files": files}
    _write_text_atomic(ckpt / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


def verify_checkpoint(ckpt: Path) -> None:
    """Check every file against the manifest; raise ``CheckpointError`` naming the first bad one."""
    manifest_path = ckpt / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint cannot be verified")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is corrupt: {exc}") from exc
    for rel, entry in files.items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint file {path} is truncated or altered: {size} bytes, the manifest says {entry['size']}")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is altered: its SHA-256 differs from the manifest")


class CheckpointManager:
    def __init__(self, root: Path, max_to_keep: int | None) -> None:
        self.root = root
        self.max_to_keep = max_to_keep

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def save(
        self,
        step: int,
        state: dict[str, Any],
        write_actor: Callable[[Path], None],
        extra_files: dict[str, str] | None = None,
    ) -> Path:
        """Write checkpoint ``step``: the actor's files, ``extra_files`` (name -> text), ``state``,
        then the manifest."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"global_step_{step}"
        tmp = self.root / f".tmp-global_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_actor(tmp / "actor")
        for name, text in (extra_files or {}).items():
            _write_text_atomic(tmp / name, text)
        _write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=1))
        maybe_fault("checkpoint_write", step)
        _fsync_tree(tmp)
        write_manifest(tmp)
        # Only a finished folder is renamed into place, so a global_step_<N> folder is complete.
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(self.root / "latest", final.name + "\n")
        self._prune()
        log.info("saved checkpoint %s", final)
        return final

    def _prune(self) -> None:
        if self.max_to_keep is None or self.max_to_keep < 1:
            return
        complete = self.complete_checkpoints()
        # Never delete the newest complete checkpoint, whatever max_to_keep says.
        for _, path in complete[: max(0, len(complete) - self.max_to_keep)]:
            shutil.rmtree(path, ignore_errors=True)

    def find(self, mode: str, path: str | None) -> Path | None:
        """The checkpoint to resume from, verified against its manifest.

        ``auto``: the newest complete checkpoint that passes verification (a damaged one is
        reported and skipped), or None. ``path``: that checkpoint, or ``CheckpointError``.
        """
        if mode == "path":
            if not path:
                raise ValueError("trainer.resume_mode=path needs trainer.resume_from_path")
            p = Path(path)
            if not (p / STATE_FILE).is_file():
                raise FileNotFoundError(f"trainer.resume_from_path={path!r} is not a complete checkpoint (no {STATE_FILE})")
            verify_checkpoint(p)
            return p
        for _, candidate in reversed(self.complete_checkpoints()):
            try:
                verify_checkpoint(candidate)
            except CheckpointError as exc:
                log.error("skipping damaged checkpoint %s: %s", candidate, exc)
                continue
            return candidate
        return None

    @staticmethod
    def load_state(ckpt: Path) -> dict[str, Any]:
        try:
            return json.loads((ckpt / STATE_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"checkpoint state {ckpt / STATE_FILE} is corrupt: {exc}") from exc
