import json

import pytest

from hybridflow.controller.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    verify_checkpoint,
)


def write_actor(d):
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x")


def test_save_find_and_prune_keep_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, write_actor)
    assert [s for s, _ in mgr.complete_checkpoints()] == [2, 3]
    assert (tmp_path / "latest").read_text().strip() == "global_step_3"
    assert mgr.find("auto", None).name == "global_step_3"
    assert mgr.load_state(mgr.find("auto", None)) == {"step": 3}
    assert not list(tmp_path.glob(".tmp-*"))


def test_incomplete_checkpoint_is_never_chosen(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)
    # A kill during the write of step 2 leaves a temporary folder and no state file.
    (tmp_path / ".tmp-global_step_2" / "actor").mkdir(parents=True)
    (tmp_path / "global_step_3" / "actor").mkdir(parents=True)  # state file missing: incomplete
    assert mgr.find("auto", None).name == "global_step_1"


def test_failed_actor_write_leaves_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    mgr.save(1, {"step": 1}, write_actor)

    def boom(d):
        raise OSError("disk full")

    with pytest.raises(OSError):
        mgr.save(2, {"step": 2}, boom)
    assert mgr.find("auto", None).name == "global_step_1"


def test_resume_path_errors_name_the_problem(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    with pytest.raises(ValueError, match="resume_from_path"):
        mgr.find("path", None)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        mgr.find("path", str(tmp_path / "nope"))
    assert mgr.find("auto", None) is None
    bad = tmp_path / "global_step_4"
    bad.mkdir()
    (bad / STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        mgr.load_state(bad)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        mgr.find("path", str(bad))


def test_manifest_names_the_truncated_altered_or_missing_file(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)
    ckpt = mgr.save(2, {"step": 2}, write_actor, extra_files={"config.yaml": "a: 1\n"})
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
    assert set(manifest) == {"actor/weights.bin", "config.yaml", STATE_FILE}
    verify_checkpoint(ckpt)

    (ckpt / "config.yaml").write_text("a: 2\n")  # same size, other bytes
    with pytest.raises(CheckpointError, match="config.yaml is altered"):
        verify_checkpoint(ckpt)
    (ckpt / "config.yaml").write_text("a: 1\n")
    (ckpt / "actor" / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="weights.bin is truncated"):
        verify_checkpoint(ckpt)
    # auto-resume skips the damaged newest checkpoint and takes the intact one before it
    assert mgr.find("auto", None).name == "global_step_1"
    (ckpt / "actor" / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="weights.bin is missing"):
        mgr.find("path", str(ckpt))


def test_pruning_never_removes_the_only_intact_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, write_actor)
    assert [s for s, _ in mgr.complete_checkpoints()] == [3]
    assert mgr.find("auto", None).name == "global_step_3"
