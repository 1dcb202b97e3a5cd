import errno
import json
import logging
import os
import subprocess
import sys

import pytest

from hybridflow.controller import checkpoint as ckpt_module
from hybridflow.controller.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    verify_checkpoint,
    write_manifest,
)


def write_actor(d):
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x")


def snapshot(root):
    """Every file under root with its bytes: equal snapshots mean nothing was lost or changed."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_save_find_and_prune_keep_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, write_actor)
    assert [s for s, _ in mgr.complete_checkpoints()] == [2, 3]
    assert (tmp_path / "latest").read_text().strip() == "global_step_3"
    assert mgr.find("auto", None).name == "global_step_3"
    assert mgr.load_state(mgr.find("auto", None)) == {"step": 3}
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".trash-*"))


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
        raise OSError("disk on fire")

    with pytest.raises(CheckpointError, match=r"could not save checkpoint global_step_2: writing it failed: disk on fire"):
        mgr.save(2, {"step": 2}, boom)
    assert mgr.find("auto", None).name == "global_step_1"
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_rank_that_died_mid_save_is_its_worker_error_not_a_failed_write(tmp_path):
    """A rank's process dying while it writes (its node lost) is a death like one in any other call:
    raised as its ``WorkerError`` (process_died), which the CLI names as a worker error and
    ``trainer.max_restarts`` rebuilds from; the partial save is removed. A worker's own exception
    while writing stays a failed write."""
    from hybridflow.cluster.worker_group import WorkerError

    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)
    death = WorkerError("actor rank 1 on node n (id 1f) died in ActorWorker.save_checkpoint", process_died=True)

    def dies(d):
        d.mkdir()
        (d / "half.bin").write_bytes(b"x")
        raise death

    with pytest.raises(WorkerError) as raised:
        mgr.save(2, {"step": 2}, dies)
    assert raised.value is death and raised.value.process_died
    assert not list(tmp_path.glob(".tmp-*")) and mgr.find("auto", None).name == "global_step_1"

    def raises(d):
        raise WorkerError("actor rank 0 failed in ActorWorker.save_checkpoint: OSError('disk on fire')")

    with pytest.raises(CheckpointError, match="could not save checkpoint global_step_2: writing it failed: actor rank 0"):
        mgr.save(2, {"step": 2}, raises)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # A worker's error reaches the manager wrapped by the worker group.
        RuntimeError("actor rank 0 failed in ActorWorker.save_checkpoint"),
        # safetensors reports the errno in its own words.
        RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
    ],
)
def test_a_full_disk_is_named_and_the_partial_save_removed(tmp_path, error):
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    mgr.save(1, {"step": 1}, write_actor)
    before = snapshot(tmp_path)

    def full(d):
        d.mkdir(parents=True)
        (d / "half.bin").write_bytes(b"half")
        if error.args[0] == "actor rank 0 failed in ActorWorker.save_checkpoint":
            raise error from OSError(errno.ENOSPC, "No space left on device")
        raise error

    with pytest.raises(CheckpointError) as info:
        mgr.save(2, {"step": 2}, full)
    message = str(info.value)
    assert message.startswith(f"could not save checkpoint global_step_2: no space left on {tmp_path};")
    assert "newest: global_step_1" in message and "\n" not in message
    assert snapshot(tmp_path) == before  # the partial save is gone, nothing else changed
    assert not list(tmp_path.glob(".tmp-*"))
    verify_checkpoint(tmp_path / "global_step_1")


def test_torchs_write_failure_is_a_full_disk_only_when_the_disk_is_full(tmp_path, monkeypatch):
    # torch's zip writer drops the errno: "[enforce fail at inline_container.cc:672] . unexpected pos ..."
    mgr = CheckpointManager(tmp_path, max_to_keep=None)

    def torch_fails(d):
        d.mkdir(parents=True)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt_module, "_free_bytes", lambda path: 4096)
    with pytest.raises(CheckpointError, match=rf"global_step_1: no space left on {tmp_path} \(4096 bytes free"):
        mgr.save(1, {"step": 1}, torch_fails)
    monkeypatch.setattr(ckpt_module, "_free_bytes", lambda path: 10 << 30)
    with pytest.raises(CheckpointError, match="torch's writer failed") as info:
        mgr.save(1, {"step": 1}, torch_fails)
    assert "no space" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_a_failed_latest_pointer_keeps_the_published_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    real = ckpt_module._write_text_atomic

    def no_latest(path, text):
        if path.name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(ckpt_module, "_write_text_atomic", no_latest)
    assert mgr.save(1, {"step": 1}, write_actor).name == "global_step_1"
    verify_checkpoint(tmp_path / "global_step_1")


def test_resume_path_errors_name_the_problem(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    with pytest.raises(CheckpointError, match="resume_from_path"):
        mgr.find("path", None)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.find("path", str(tmp_path / "nope"))
    assert mgr.find("auto", None) is None
    bad = tmp_path / "global_step_4"
    bad.mkdir()
    (bad / STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        mgr.load_state(bad)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        mgr.find("path", str(bad))
    (bad / STATE_FILE).write_text('{"step": 3}')
    with pytest.raises(CheckpointError, match="says step 3, but the folder is global_step_4"):
        mgr.load_state(bad)


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
    assert CheckpointManager(tmp_path, max_to_keep=None).find("auto", None).name == "global_step_1"
    (ckpt / "actor" / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="weights.bin is missing"):
        mgr.find("path", str(ckpt))


def test_a_manifest_cannot_list_files_outside_the_checkpoint(tmp_path):
    ckpt = CheckpointManager(tmp_path, max_to_keep=None).save(1, {"step": 1}, write_actor)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"]["../secret"] = {"size": 1, "sha256": "0" * 64}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest.json is corrupt: path '../secret' points outside"):
        verify_checkpoint(ckpt)


def test_an_unlisted_file_fails_verification_by_name(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)
    ckpt = mgr.save(2, {"step": 2}, write_actor)
    planted = ckpt / "actor" / "model" / "zz-extra.safetensors"
    planted.parent.mkdir()
    planted.write_bytes(b"planted")
    with pytest.raises(CheckpointError, match=r"zz-extra.safetensors is not listed in .*manifest.json"):
        verify_checkpoint(ckpt)
    assert CheckpointManager(tmp_path, max_to_keep=None).find("auto", None).name == "global_step_1"
    with pytest.raises(CheckpointError, match=r"cannot resume from trainer.resume_from_path=.*zz-extra.safetensors is not listed"):
        mgr.find("path", str(ckpt))
    assert planted.read_bytes() == b"planted"  # refused, not removed


def test_every_checkpoint_damaged_refuses_and_deletes_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2):
        mgr.save(step, {"step": step}, write_actor)
    (tmp_path / "global_step_2" / "actor" / "weights.bin").write_bytes(b"y")  # altered
    (tmp_path / "global_step_1" / "actor" / "weights.bin").write_bytes(b"")  # truncated
    before = snapshot(tmp_path)

    resumed = CheckpointManager(tmp_path, max_to_keep=2)
    with pytest.raises(CheckpointError) as info:
        resumed.resume("auto", None, load=lambda ckpt: ckpt)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"none of the 2 checkpoint(s) under {tmp_path} verifies and loads")
    assert "global_step_2: checkpoint file" in message and "weights.bin is altered" in message
    assert "global_step_1: checkpoint file" in message and "weights.bin is truncated" in message
    assert "trainer.resume_mode=disable" in message and "Nothing was deleted" in message
    assert snapshot(tmp_path) == before

    # Starting fresh (resume_mode=disable) over them: pruning leaves the damaged ones alone, and
    # a new save of a damaged one's step moves it aside, whole.
    fresh = CheckpointManager(tmp_path, max_to_keep=1)
    fresh.save(1, {"step": 1}, write_actor)
    fresh.save(2, {"step": 2}, write_actor)
    fresh.save(3, {"step": 3}, write_actor)
    assert [s for s, _ in fresh.step_folders()] == [3]
    after = snapshot(tmp_path)
    for name, data in before.items():
        if name.startswith("global_step_"):
            assert after[f"damaged-{name}"] == data, name


def test_pruning_never_deletes_a_damaged_or_unverified_checkpoint(tmp_path, caplog):
    old = CheckpointManager(tmp_path, max_to_keep=None)
    for step in (1, 2, 3):
        old.save(step, {"step": step}, write_actor)
    (tmp_path / "global_step_2" / "actor" / "weights.bin").write_bytes(b"z")
    (tmp_path / "global_step_1" / STATE_FILE).unlink()  # incomplete: cannot be verified
    damaged = {k: v for k, v in snapshot(tmp_path).items() if k.startswith(("global_step_1", "global_step_2"))}

    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    with caplog.at_level(logging.WARNING):
        mgr.save(4, {"step": 4}, write_actor)
        mgr.save(5, {"step": 5}, write_actor)
    assert [s for s, _ in mgr.step_folders()] == [1, 2, 5]  # intact 3 and 4 pruned; 1 and 2 kept
    after = snapshot(tmp_path)
    assert all(after[k] == v for k, v in damaged.items())
    reports = [r.getMessage() for r in caplog.records if "leaving damaged checkpoint" in r.getMessage()]
    assert len(reports) == 2  # each said once, not at every save
    assert any("global_step_1" in r and "incomplete" in r for r in reports)


def test_auto_resume_falls_back_past_checkpoints_that_fail_to_load(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, write_actor)

    def load(ckpt):
        if ckpt.name == "global_step_3":
            raise CheckpointError(f"{ckpt}/actor/optim.pt: refused to load optimizer state: Weights only load failed")
        if ckpt.name == "global_step_2":
            # How a worker group hands over a loader's error: wrapped, the loader's own as the cause.
            try:
                raise CheckpointError(f"{ckpt}/actor/model/model.safetensors is not a readable safetensors file")
            except CheckpointError as exc:
                raise RuntimeError("actor rank 0 failed in ActorWorker.load_checkpoint: ...") from exc
        return mgr.load_state(ckpt)

    resumer = CheckpointManager(tmp_path, max_to_keep=2)
    with caplog.at_level(logging.WARNING):
        found = resumer.resume("auto", None, load=load)
    assert found is not None and found[0].name == "global_step_1" and found[1] == {"step": 1}
    log = caplog.text
    assert "skipping checkpoint" in log and "optim.pt: refused to load optimizer state" in log
    assert "model.safetensors is not a readable safetensors file" in log
    assert "actor rank 0 failed" not in log  # the loader's message, not the wrapper's

    # resume_mode=path refuses the same checkpoint with one line naming the file.
    with pytest.raises(CheckpointError) as info:
        resumer.resume("path", str(tmp_path / "global_step_3"), load=load)
    assert "optim.pt: refused to load optimizer state" in str(info.value) and "\n" not in str(info.value)

    # The two that failed to load are never pruned, though they verify.
    before = snapshot(tmp_path / "global_step_3")
    resumer.save(2, {"step": 2}, write_actor)  # replays step 2: the failed one is moved aside
    resumer.save(4, {"step": 4}, write_actor)
    resumer.save(5, {"step": 5}, write_actor)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["damaged-global_step_2", "global_step_3", "global_step_4", "global_step_5"]
    assert snapshot(tmp_path / "global_step_3") == before


def test_a_loader_error_of_any_kind_becomes_a_checkpoint_error(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)

    def load(ckpt):
        raise KeyError("sampler")

    with pytest.raises(CheckpointError, match=r"global_step_1 could not be loaded: 'sampler'"):
        mgr.resume("path", str(tmp_path / "global_step_1"), load=load)


def test_pruning_renames_before_deleting(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    mgr.save(1, {"step": 1}, write_actor)

    class Killed(BaseException):
        pass

    def kill_mid_delete(point, step):
        if point == "checkpoint_delete":
            raise Killed

    monkeypatch.setattr(ckpt_module, "maybe_fault", kill_mid_delete)
    with pytest.raises(Killed):
        mgr.save(2, {"step": 2}, write_actor)
    # Killed between the rename and the delete: nothing left looks like checkpoint 1.
    assert [p.name for _, p in mgr.step_folders()] == ["global_step_2"]
    assert [p.name for p in tmp_path.glob(".trash-*")] == [f".trash-global_step_1-{os.getpid()}"]
    assert CheckpointManager(tmp_path, max_to_keep=1).find("auto", None).name == "global_step_2"
    assert CheckpointManager(tmp_path, max_to_keep=1).clean_leftovers() == [f".trash-global_step_1-{os.getpid()}"]
    assert not list(tmp_path.glob(".trash-*"))


def test_leftovers_of_killed_writers_are_cleaned_at_start(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)
    dead = dead_pid()
    # This process's own pid names a killed run's files too (a container's restart reuses pids):
    # it writes nothing before it cleans.
    stale = [f".latest.tmp-{dead}", f".tmp-global_step_2-{dead}", ".tmp-global_step_3", ".trash-global_step_0-1",
             f".latest.tmp-{os.getpid()}"]
    live = [f".latest.tmp-{os.getppid()}", f".tmp-global_step_4-{os.getppid()}"]
    for name in stale + live:
        if "latest" in name:
            (tmp_path / name).write_text("global_step_9\n")
        else:
            (tmp_path / name / "actor").mkdir(parents=True)
    assert sorted(CheckpointManager(tmp_path, max_to_keep=None).clean_leftovers()) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*live, "global_step_1", "latest"])
    verify_checkpoint(tmp_path / "global_step_1")


def test_pruning_never_removes_the_only_intact_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step}, write_actor)
    assert [s for s, _ in mgr.complete_checkpoints()] == [3]
    assert mgr.find("auto", None).name == "global_step_3"


def test_write_manifest_lists_nested_files(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c.bin").write_bytes(b"c")
    assert set(write_manifest(tmp_path)["files"]) == {"a/b/c.bin"}


def test_a_failed_publish_puts_the_replaced_checkpoint_back(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    mgr.save(1, {"step": 1}, write_actor)
    before = snapshot(tmp_path)
    real_replace = os.replace

    def refuse_publish(src, dst):
        if os.path.basename(str(src)).startswith(".tmp-global_step_1"):
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.os, "replace", refuse_publish)
    with pytest.raises(CheckpointError, match="could not save checkpoint global_step_1: renaming it into place failed"):
        mgr.save(1, {"step": 1}, write_actor)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    verify_checkpoint(tmp_path / "global_step_1")
