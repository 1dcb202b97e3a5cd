"""Checkpoint folders: ``<root>/global_step_<N>/{actor/, trainer_state.json}`` and ``<root>/latest``.

A checkpoint is written under a temporary name and renamed into place only when complete,
then ``latest`` is replaced atomically: a kill at any moment leaves the previous complete
checkpoint in charge. Loading reads JSON and safetensors, and ``torch.load`` only with
``weights_only=True`` — never an arbitrary pickle.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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

    def save(self, step: int, state: dict[str, Any], write_actor: Callable[[Path], None]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"global_step_{step}"
        tmp = self.root / f".tmp-global_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_actor(tmp / "actor")
        # The state file goes last: its presence marks the folder complete.
        _write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=1))
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
        """The checkpoint to resume from: ``auto`` = newest complete one (or None), ``path`` = that one."""
        if mode == "path":
            if not path:
                raise ValueError("trainer.resume_mode=path needs trainer.resume_from_path")
            p = Path(path)
            if not (p / STATE_FILE).is_file():
                raise FileNotFoundError(f"trainer.resume_from_path={path!r} is not a complete checkpoint (no {STATE_FILE})")
            return p
        complete = self.complete_checkpoints()
        return complete[-1][1] if complete else None

    @staticmethod
    def load_state(ckpt: Path) -> dict[str, Any]:
        try:
            return json.loads((ckpt / STATE_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"checkpoint state {ckpt / STATE_FILE} is corrupt: {exc}") from exc
