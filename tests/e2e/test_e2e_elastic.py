"""An elastic rollout on a real Ray cluster (issue 36, item 5): a node joins and leaves mid-run.

The cluster is started with ``ray start`` on this machine (tests/e2e/test_e2e_ray_multinode.py): a
head without CPUs (the controller's) and node A with two, one for the actor's rank and one for rollout
replica 0 (``rollout.placement=split``). The run (``rollout.elastic=true``, 1 to 2 replicas) stops
itself after step 1 (``HYBRIDFLOW_FAULT=after_step@1:STOP``, SIGSTOP), node B joins with one CPU, and
the run goes on: at the weight sync that ends step 2 it starts replica 1 on node B, which gets the
weights by the broadcast and serves step 3. After step 3 the run stops again, node B leaves (its
``ray start --block`` process ended), and step 4 is served by replica 0 alone; the sync that ends it
removes replica 1, for which no node has room. Every step's samples and metrics are those of a run
with one replica throughout (per-request seeds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from ray_cluster import Cluster  # noqa: E402

from hybridflow.data.tasks.arithmetic import write_arithmetic_task  # noqa: E402
from hybridflow.models.tiny import write_tiny_model  # noqa: E402

# The worker that runs the other `ray start` clusters (tests/e2e/test_e2e_ray_multinode.py), one at a time.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

STOP_TIMEOUT_S = 600.0
# What the number of replicas changes by design, not the samples: the count, and how the work was
# spread over the replicas (step 4's dead replica 1 served nothing; per-replica throughput is perf/).
REPLICA_DEPENDENT = ("rollout/replicas", "rollout/replica_load_imbalance")
VOLATILE = ("timing_s/", "perf/")
# The rollout's logprobs of a request batched with other neighbours: the same tokens (seeded per
# request), logprobs equal to float32 rounding (tests/e2e/test_e2e_replica_restart.py).
ROLLOUT_LOGPROBS = ("rollout_corr/",)


def _args(tmp_path: Path) -> list[str]:
    model = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=32, val_size=4)
    return [
        f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.backend=ray",
        "trainer.n_workers=1", "rollout.placement=split", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "rollout.n=2", "data.max_response_length=8", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.save_final=false", "trainer.num_threads=1", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]", "trainer.seed=5", "trainer.total_training_steps=4",
        "trainer.rollout_data_dir=samples", "rollout.dtype=float32",
    ]


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


def _wait_stopped(run: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while not _stopped(run.pid):
        assert run.poll() is None, f"the run ended ({run.returncode}) before it stopped:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the run did not stop within {STOP_TIMEOUT_S:.0f} s"
        time.sleep(0.5)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _samples(out: Path, step: int) -> tuple[list[dict], list[float]]:
    rows = [json.loads(line) for line in (out / "samples" / f"{step}.jsonl").read_text().splitlines()]
    return rows, [p for row in rows for p in row.pop("logprobs")]


def test_replicas_follow_nodes_that_join_and_leave_and_the_steps_equal_a_fixed_replica_runs(tmp_path: Path) -> None:
    args = _args(tmp_path)
    fixed, grown = tmp_path / "fixed", tmp_path / "elastic"
    # The run with one replica throughout, on a one-node cluster of its own, beside the elastic one.
    reference = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "train", *args,
                                  f"trainer.output_dir={fixed}"], stdout=fixed.with_suffix(".log").open("w"),
                                 stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    cluster = Cluster.with_head(tmp_path, num_cpus=0)
    log = grown.with_suffix(".log")
    run = None
    try:
        cluster.start("node_a", [f"--address={cluster.address}", "--num-cpus=2", "--num-gpus=0",
                                 f"--resources={json.dumps({'node_a': 1})}"])
        run = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.cli", "train", *args, f"trainer.ray_address={cluster.address}",
             "rollout.elastic=true", "rollout.min_replicas=1", "rollout.max_replicas=2", f"trainer.output_dir={grown}"],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
            env={**cluster.env, "OMP_NUM_THREADS": "1", "HYBRIDFLOW_FAULT": "after_step@1:STOP,after_step@3:STOP"})
        # Between steps 1 and 2: node B joins, with one CPU.
        _wait_stopped(run, log)
        cluster.add_worker("node_b")
        run.send_signal(signal.SIGCONT)
        # Between steps 3 and 4: replica 1 runs on node B; then node B leaves (its ray start process ends).
        _wait_stopped(run, log)
        placement = json.loads((grown / "placement.json").read_text())
        replica_nodes = [placement[f"rollout replica {k}"][0]["node_id"] for k in (0, 1)]
        assert replica_nodes[0] == placement["actor"][0]["node_id"] != replica_nodes[1], placement
        cluster.nodes[2].terminate()
        cluster.nodes[2].wait(timeout=120)
        cluster.alive -= 1
        run.send_signal(signal.SIGCONT)
        assert run.wait(timeout=STOP_TIMEOUT_S) == 0, log.read_text()[-4000:]
        assert reference.wait(timeout=STOP_TIMEOUT_S) == 0, fixed.with_suffix(".log").read_text()[-4000:]
    finally:
        for process in [p for p in (run, reference) if p is not None and p.poll() is None]:
            process.kill()
        cluster.stop()

    text = log.read_text()
    records, expected = _records(grown), _records(fixed)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # One replica, then two from the sync that ended step 2 (node B joined), one again once node B left.
    assert [r["rollout/replicas"] for r in records] == [1.0, 1.0, 2.0, 1.0]
    assert "rollout replica 1 added on node" in text, text[-4000:]
    assert "rollout replica 1 on node" in text and "removed: it died and the cluster has no room for it" in text
    # The new replica served step 3, with the weights the sync gave it (checked: rollout.verify_weight_sync).
    assert records[2]["perf/rollout/replica_1/tokens_per_s"] > 0
    assert records[2]["timing_s/verify_weight_sync"] >= 0
    assert "rollout replica 1" not in json.loads((grown / "placement.json").read_text())
    assert all(r["rollout/replica_restarts"] == 0 for r in records)  # a removal is no restart
    # The same samples and step metrics as the run with one replica throughout.
    for step in (1, 2, 3, 4):
        (rows, logprobs), (expected_rows, expected_logprobs) = _samples(grown, step), _samples(fixed, step)
        assert rows == expected_rows, step
        assert logprobs == pytest.approx(expected_logprobs, abs=1.5e-4), step
    for got, want in zip(records, expected, strict=True):
        keys = {k for k in got.keys() | want.keys() if not k.startswith(VOLATILE + REPLICA_DEPENDENT)}
        for key in sorted(keys):
            if key.startswith(ROLLOUT_LOGPROBS):
                assert got[key] == pytest.approx(want[key], abs=1e-6), (got["step"], key)
            else:
                assert got.get(key) == want.get(key), (got["step"], key)
