"""Checkpoints, exports and the built-in model are readable like any file this user writes.

safetensors writes ``model.safetensors`` through a 0600 temporary file; what we publish must
have the usual mode (0o666 & ~umask) instead.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.controller.checkpoint import CheckpointManager
from hybridflow.controller.export import export_checkpoint
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

SMALL = TinyModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)


@pytest.fixture(params=[0o022, 0o027])
def umask(request) -> Iterator[int]:
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def test_safetensors_writes_0600_which_is_why_this_matters(umask, tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
    assert modes(tmp_path) == {"w.safetensors": 0o600}


def test_a_checkpoint_holds_no_private_file(umask, tmp_path):
    def write_actor(d: Path) -> None:
        d.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, d / "model.safetensors")

    ckpt = CheckpointManager(tmp_path, max_to_keep=None).save(1, {"step": 1}, write_actor, {"config.yaml": "a: 1\n"})
    found = modes(ckpt)
    assert "actor/model.safetensors" in found and "config.yaml" in found
    assert set(found.values()) == {0o666 & ~umask}, found
    assert modes(tmp_path)["latest"] == 0o666 & ~umask


def test_the_built_in_model_and_an_export_are_readable(umask, tmp_path):
    def write_actor(d: Path) -> None:
        write_tiny_model(d / "model", SMALL)
        assert set(modes(d).values()) == {0o666 & ~umask}

    CheckpointManager(tmp_path / "run" / "checkpoints", max_to_keep=None).save(1, {"step": 1}, write_actor)
    # A checkpoint saved before modes were fixed: the export must not copy its private mode along.
    os.chmod(tmp_path / "run" / "checkpoints" / "global_step_1" / "actor" / "model" / "model.safetensors", 0o600)
    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    found = modes(out)
    assert "model.safetensors" in found
    assert set(found.values()) == {0o666 & ~umask}, found
