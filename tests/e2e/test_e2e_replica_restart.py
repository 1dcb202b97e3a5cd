"""A rollout replica's process SIGKILLed mid-generation on Ray (issue 36, item 2): its requests go
to the other replica with their seeds, it is restarted at the next weight sync and given the
current weights (verified), and the run logs what a run without the fault logs; one death past
``rollout.max_replica_restarts`` stops the run naming the replica and its node."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from hybridflow.data.tasks.arithmetic import write_arithmetic_task  # noqa: E402
from hybridflow.models.tiny import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

# What a replica's death changes by design, not the samples: the restart count, wall-clock figures,
# and how the step's work was spread over the replicas (the dead one's share was generated again
# by the other, with its own prefix cache).
FAULT_DEPENDENT = ("rollout/replica_restarts", "rollout/replica_load_imbalance", "rollout/prefix_cache_hit_rate")
VOLATILE = ("timing_s/", "perf/")
# Figures of the rollout's logprobs: a request generated again in another batch draws the same tokens
# (seeded per request) with logprobs equal to float32 rounding, not to the bit (the batch's shape
# changes the order of the sums); the training figures, computed by the actor, are bitwise equal.
ROLLOUT_LOGPROBS = ("rollout_corr/",)
LOGPROB_ATOL = 1e-6


def _args(tmp_path: Path) -> list[str]:
    model = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=32, val_size=4)
    return [
        f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.backend=ray",
        "trainer.n_workers=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=2",
        "data.max_response_length=16", "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.save_final=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        "trainer.seed=5", "rollout.verify_weight_sync=true", "trainer.rollout_data_dir=samples",
        # Each replica in a process of its own, the fault-free runs too: a replica killed and restarted alone is
        # what these compare (under the hybrid engine replica r lives and dies with actor rank r).
        "trainer.hybrid_engine=false",
    ]


def _start(args: list[str], out: Path, steps: int, fault: str = "", ray_head=None) -> subprocess.Popen:
    """A run on a Ray cluster of its own (its ranks read ``fault`` from its environment), or, fault-free, on
    ``ray_head`` (tests/e2e/conftest.py). The faulted runs run beside another, and two drivers at once on
    one cluster cost several times the CPU (ray_head's docstring): each keeps a cluster of its own."""
    env = {**os.environ, "HYBRIDFLOW_FAULT": fault, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if ray_head is not None:
        assert not fault, "a faulted run here has a cluster of its own: it runs beside another"
        env = {**ray_head.env, "OMP_NUM_THREADS": "1"}
        args = [*args, f"trainer.ray_address={ray_head.address}"]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 -- the child owns it until it exits
    return subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "train", *args,
                             f"trainer.total_training_steps={steps}", f"trainer.output_dir={out}", *extra(fault)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def extra(fault: str) -> list[str]:
    return ["rollout.max_replica_restarts=1"] if fault else []


def _steps(out: Path, steps: int) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE) and k not in FAULT_DEPENDENT}
            for r in records if r["step"] <= steps}


def _samples(out: Path, step: int) -> tuple[list[dict], list[float]]:
    """The step's dumped samples (trainer.rollout_data_dir), and apart their rollout logprobs (dumped
    rounded to 4 decimals: float32 rounding may flip the last one)."""
    rows = [json.loads(line) for line in (out / "samples" / f"{step}.jsonl").read_text().splitlines()]
    return rows, [p for row in rows for p in row.pop("logprobs")]


def test_a_replica_killed_mid_generation_is_restarted_and_the_steps_equal_the_fault_free_runs(
        tmp_path: Path, ray_head) -> None:
    args = _args(tmp_path)
    reference, faulted = tmp_path / "reference", tmp_path / "faulted"
    # Replica 1 dies at its first take of step 1 (serving version 0) and, once restarted, of step 3
    # (version 2): the first death is recovered, the second is one past rollout.max_replica_restarts=1.
    runs = [_start(args, reference, 3, ray_head=ray_head),
            _start(args, faulted, 3, "replica_take/rollout_replica_1@0,replica_take/rollout_replica_1@2")]
    codes = [run.wait(timeout=600) for run in runs]
    log = faulted.with_suffix(".log").read_text()
    assert codes[0] == 0, reference.with_suffix(".log").read_text()[-3000:]
    assert codes[1] == 1, log[-3000:]
    # The first death: recovered, the replica restarted before step 2's generation.
    assert re.search(r"rollout replica 1 on node \S+ \(id \w+\) died \(restart 1 of rollout.max_replica_restarts=1",
                     log), log[-3000:]
    assert "rollout replica 1 restarted on node" in log
    records = [json.loads(line) for line in (faulted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["rollout/replica_restarts"] for r in records] == [1.0, 1.0]
    # Step 2 was generated by both replicas, the restarted one with the weights after step 1, checked.
    assert records[1]["timing_s/verify_weight_sync"] >= 0
    # The same samples (tokens, rewards, advantages) and the same step metrics as the run without the fault.
    for step in (1, 2):
        (rows, logprobs), (expected_rows, expected_logprobs) = _samples(faulted, step), _samples(reference, step)
        assert rows == expected_rows
        assert logprobs == pytest.approx(expected_logprobs, abs=1.5e-4)
    expected, got = _steps(reference, 2), _steps(faulted, 2)
    for step in (1, 2):
        for key in [k for k in expected[step] if k.startswith(ROLLOUT_LOGPROBS)]:
            assert got[step].pop(key) == pytest.approx(expected[step].pop(key), abs=LOGPROB_ATOL), key
    assert got == expected
    # The second death: the run stops, naming the replica, its node and the bound.
    assert re.search(r"rollout replica 1 on node \S+ \(id \w+\) died and was not restarted: "
                     r"rollout.max_replica_restarts=1 restarts of it were used up", log), log[-3000:]


def test_across_a_replica_restart_no_trained_sample_exceeds_the_staleness_bound_in_the_async_modes(
        tmp_path: Path, check_staleness) -> None:
    """The asynchronous loops generate beside training: a replica killed mid-generation hands its
    requests to the other one, comes back at the next weight sync, and every step still trains on
    samples within the loop's staleness bound (one-step-off: 1 version; fully async: the threshold)."""
    args = _args(tmp_path)
    fault = "replica_take/rollout_replica_1@0"
    modes = {"one_step_off": (["trainer.mode=one_step_off"], 1.0),
             "fully_async": (["trainer.mode=fully_async", "async_training.staleness_threshold=1"], 1.0)}
    runs = {mode: _start([*args, *extra_args], tmp_path / mode, 3, fault) for mode, (extra_args, _) in modes.items()}
    for mode, run in runs.items():
        log = (tmp_path / f"{mode}.log")
        assert run.wait(timeout=600) == 0, f"{mode}: {log.read_text()[-3000:]}"
        assert "rollout replica 1 restarted on node" in log.read_text(), mode
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3], mode
        assert records[-1]["rollout/replica_restarts"] == 1.0, mode
        bound = modes[mode][1]
        assert all(r["async/staleness/max"] <= bound for r in records), (mode, [r["async/staleness/max"] for r in records])
        # Sample by sample, from the versions the replicas (the restarted one too) stamped on the tokens.
        check_staleness(tmp_path / mode / "samples", {r["step"]: r for r in records}, int(bound))
