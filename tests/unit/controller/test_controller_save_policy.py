"""trainer.on_save_error: a failed save stops the run with its one-line CheckpointError, or
(warn) is logged and training goes on; either way the earlier checkpoints are intact."""

from __future__ import annotations

import errno
import logging
from types import SimpleNamespace

import pytest

from hybridflow.controller.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from hybridflow.controller.trainer import Trainer
from hybridflow.tracking.timeline import Timeline


def write_actor(d):
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x")


def full_disk(d):
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"half")
    raise OSError(errno.ENOSPC, "No space left on device")


def trainer(tmp_path, policy: str) -> SimpleNamespace:
    """Just what Trainer.save_checkpoint reads: the policy, and a save that hits a full disk."""
    manager = CheckpointManager(tmp_path, max_to_keep=1)
    manager.save(1, {"step": 1}, write_actor)
    return SimpleNamespace(
        cfg=SimpleNamespace(trainer=SimpleNamespace(on_save_error=policy)),
        run=SimpleNamespace(timeline=Timeline.disabled()),
        _save_checkpoint=lambda: manager.save(2, {"step": 2}, full_disk),
    )


def test_stop_ends_the_run_with_one_line(tmp_path):
    with pytest.raises(CheckpointError) as info:
        Trainer.save_checkpoint(trainer(tmp_path, "stop"))
    assert str(info.value).startswith(f"could not save checkpoint global_step_2: no space left on {tmp_path};")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "latest"]
    verify_checkpoint(tmp_path / "global_step_1")


def test_warn_logs_and_goes_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert Trainer.save_checkpoint(trainer(tmp_path, "warn")) is None  # fit() must not claim a save
    assert "no space left on" in caplog.text and "trainer.on_save_error=warn" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "latest"]
    verify_checkpoint(tmp_path / "global_step_1")
