"""A run that fails before its first step takes its new folder with it; results are never lost; one run at a
time holds a folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.cluster.worker_group import LocalWorkerGroup, RankNode
from hybridflow.config import ConfigError, load_config
from hybridflow.controller.run_folder import (
    LOCK_FILE,
    check_shared_folders,
    discard_run_folder_on_failure,
    holds_lock,
    holds_results,
)
from hybridflow.controller.setup import resolve_output_dir


def write_config(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text("trainer: {}\n")
    return out


def test_set_up_files_are_not_results(tmp_path):
    out = write_config(tmp_path / "run")
    assert not holds_results(out)
    (out / "checkpoints").mkdir()
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"header")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/score/mean": 0.3}) + "\n" + '{"step": 1, "cri')
    (out / "timeline.json").write_text('{"traceEvents": []}')  # the run's close writes it, even after a failure
    assert not holds_results(out)  # validation before training and a torn line are no step


@pytest.mark.parametrize(
    "result",
    ["a checkpoint", "a step's metrics", "a file set-up does not write", "a folder set-up does not make"],
)
def test_results_are_recognised(tmp_path, result):
    out = write_config(tmp_path / "run")
    if result == "a checkpoint":
        (out / "checkpoints" / "global_step_1").mkdir(parents=True)
        (out / "checkpoints" / "global_step_1" / "manifest.json").write_text("{}")
    elif result == "a step's metrics":
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    elif result == "a file set-up does not write":
        (out / "notes.txt").write_text("mine")
    else:
        (out / "wandb").mkdir()
    assert holds_results(out)


def fail_in_set_up(cfg, *, after_step: bool = False) -> None:
    """What set-up does before loading the model (folder, config.yaml), then a failure."""
    with pytest.raises(RuntimeError, match="reward function failed"):
        with discard_run_folder_on_failure(cfg):
            out = resolve_output_dir(cfg)
            write_config(out)
            if after_step:
                (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
            raise RuntimeError("reward function failed to load")


def test_a_failed_set_up_leaves_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fail_in_set_up(load_config("dapo"))
    assert not (tmp_path / "runs").exists()  # nor the runs/ folder this first run made


def test_other_runs_folders_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    earlier = write_config(tmp_path / "runs" / "grpo-arithmetic-20250101-000000")
    fail_in_set_up(load_config("grpo"))
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [earlier.name]


def test_a_named_output_folder_goes_too_but_not_its_parents(tmp_path):
    out = tmp_path / "experiments" / "try-3"
    fail_in_set_up(load_config("grpo", overrides=[f"trainer.output_dir={out}"]))
    assert not out.exists() and (tmp_path / "experiments").is_dir()


def test_a_folder_with_results_stays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fail_in_set_up(load_config("grpo"), after_step=True)
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "metrics.jsonl").is_file()


def test_a_folder_that_was_there_before_stays(tmp_path):
    out = write_config(tmp_path / "resumed")  # a run resumed in its own folder
    fail_in_set_up(load_config("grpo", overrides=[f"trainer.output_dir={out}"]))
    assert (out / "config.yaml").is_file()


def test_a_run_that_succeeds_keeps_its_folder(tmp_path):
    cfg = load_config("grpo", overrides=[f"trainer.output_dir={tmp_path / 'run'}"])
    with discard_run_folder_on_failure(cfg):
        write_config(resolve_output_dir(cfg))
    assert (tmp_path / "run" / "config.yaml").is_file()


HOLD = """
import sys, time
from pathlib import Path
from hybridflow.controller.run_folder import lock_run_folder
lock_run_folder(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


def hold_lock(out: Path) -> subprocess.Popen:
    """Another process that holds ``out``'s lock until it is killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_on_a_locked_folder_refuses_naming_the_holder_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = hold_lock(out)
    try:
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        cfg = load_config("grpo", overrides=[f"trainer.output_dir={out}"])
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid} on ") as refused:
            with discard_run_folder_on_failure(cfg):
                resolve_output_dir(cfg)
        assert refused.value.key == "trainer.output_dir"
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written, nothing removed
    finally:
        holder.kill()
        holder.wait()
    # The holder died (SIGKILL: no clean-up); its lock died with it, and the next run takes the folder.
    cfg = load_config("grpo", overrides=[f"trainer.output_dir={out}"])
    with discard_run_folder_on_failure(cfg):
        resolve_output_dir(cfg)
        assert holds_lock(out)
        assert f"pid {os.getpid()} " in (out / LOCK_FILE).read_text()
    assert not holds_lock(out)  # released when the run's block ends


def test_a_new_folder_another_run_holds_is_never_removed_by_a_refused_run(tmp_path):
    """Two runs started together on one new folder: the one refused must not take the folder (and
    the other run's files) with it as a folder it made and that failed."""
    out = tmp_path / "new"
    cfg = load_config("grpo", overrides=[f"trainer.output_dir={out}"])
    with pytest.raises(ConfigError, match="in use by another run"):
        with discard_run_folder_on_failure(cfg):
            out.mkdir()  # the other run made it first, just after this one looked
            holder = hold_lock(out)
            try:
                resolve_output_dir(cfg)
            finally:
                holder.kill()
                holder.wait()
    assert (out / LOCK_FILE).is_file()


def test_the_next_start_removes_what_killed_runs_left_whatever_pid_they_name(tmp_path):
    """A killed run leaves temporary names with its pid; a container's restart gives the next run
    the same pid, and another live process may have it: under the lock none of them is a writer."""
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    (ckpts / "global_step_2").mkdir(parents=True)
    (ckpts / "global_step_2" / "manifest.json").write_text("{}")
    (ckpts / "latest").write_text("global_step_2\n")
    leftovers = {
        out / f".rollout_dtype.json.tmp-{os.getppid()}": "a live pid",
        out / f".write-test-{os.getpid()}": "this process's own pid",
        ckpts / f".latest.tmp-{os.getpid()}": "",
        ckpts / f".latest.tmp-{os.getppid()}": "",
        ckpts / ".trash-global_step_1" / "manifest.json": "{}",
        ckpts / f".tmp-global_step_3-{os.getppid()}" / "trainer_state.json": "{}",
    }
    for path, text in leftovers.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (out / "config.yaml").write_text("trainer: {}\n")
    (out / "notes.tmp-1").write_text("the user's")  # not a name hybridflow writes
    cfg = load_config("grpo", overrides=[f"trainer.output_dir={out}"])
    with discard_run_folder_on_failure(cfg):
        resolve_output_dir(cfg)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "checkpoints", "config.yaml", "notes.tmp-1"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step_2", "latest"]


def test_a_checkpoint_folder_outside_the_run_folder_keeps_a_live_writers_save(tmp_path):
    """Without the run's lock over it (trainer.checkpoint_dir elsewhere) only saves whose writer is
    gone, or is this process, are leftovers."""
    from hybridflow.controller.checkpoint import CheckpointManager

    live = tmp_path / f".tmp-global_step_3-{os.getppid()}"
    own = tmp_path / f".latest.tmp-{os.getpid()}"
    live.mkdir()
    own.write_text("")
    assert CheckpointManager(tmp_path, None).clean_leftovers() == [own.name]
    assert live.is_dir()


def test_a_file_system_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cfg = load_config("grpo", overrides=[f"trainer.output_dir={tmp_path / 'run'}"])
    with caplog.at_level("WARNING"), discard_run_folder_on_failure(cfg):
        out = resolve_output_dir(cfg)
        assert not holds_lock(out)
    assert "No locks available" in caplog.text and "nothing stops a second run" in caplog.text


# ------------------------------------------------------------------ folders every node must share
class NodeView(LocalWorkerGroup):
    """Ranks on a node that sees the trainer's paths elsewhere (``moved``: path prefix -> what the
    node has there instead): the boundary a Ray node's own file system is."""

    def __init__(self, world_size: int, moved: dict[str, str]) -> None:
        super().__init__("actor", lambda r, w: None, world_size)
        self.moved = moved

    def call_all(self, method, probes, token):
        results = []
        for rank in range(self.world_size):
            seen = {key: self._remap(path) if rank == 1 else path for key, path in probes.items()}
            results.append(method(None, seen, token))
        return results

    def _remap(self, path: str) -> str:
        for old, new in self.moved.items():
            path = path.replace(old, new)
        return path

    def nodes(self):
        return [RankNode(f"node-{r}", f"10.0.0.{r + 1}", 100 + r) for r in range(self.world_size)]


def test_a_folder_every_rank_shares_passes_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    check_shared_folders({"trainer.output_dir": out}, "actor", NodeView(2, {}))
    assert list(out.iterdir()) == []


def test_a_folder_local_to_a_worker_node_is_refused_naming_the_node_the_rank_and_the_key(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "run", tmp_path / "node2"
    elsewhere.mkdir()
    with pytest.raises(ConfigError, match=r"trainer.output_dir='.*run' cannot be used by actor rank 1 on node 10.0.0.2 "
                                          r"\(id node-1\): the trainer's files are not there") as error:
        check_shared_folders({"trainer.output_dir": out}, "actor", NodeView(2, {str(out): str(elsewhere)}))
    assert error.value.key == "trainer.output_dir"
    # A path the node cannot write to (here a file where the folder should be).
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    checkpoints = tmp_path / "ckpt"
    with pytest.raises(ConfigError, match=r"trainer.checkpoint_dir=.* actor rank 1 on node 10.0.0.2 .*cannot write there"):
        check_shared_folders({"trainer.output_dir": out, "trainer.checkpoint_dir": checkpoints}, "actor",
                             NodeView(2, {str(checkpoints): str(blocked)}))
    assert [p.name for p in out.iterdir()] == [] and [p.name for p in checkpoints.iterdir()] == []
