"""A short chaos soak (bench/chaos_soak.py): the trainer SIGKILLed and SIGTERMed at random moments and
at the fault points, its reward worker SIGKILLed, and on Ray an actor rank's and a rollout replica's
process SIGKILLed, each time resumed, and the run still ends with the uninterrupted run's metrics,
losing no step beyond the newest checkpoint."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos_soak.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("chaos_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_run_killed_at_random_ends_with_the_uninterrupted_runs_metrics(tmp_path):
    chaos = load_bench()
    soak = chaos.soak_run(tmp_path, faults=5, seed=3, steps=10)
    report = soak.report()
    injected = sum(soak.injected.values())
    # Every kind struck at least once: the kinds come in rounds of one each, in a random order.
    assert set(soak.injected) == set(chaos.KINDS), report
    assert injected >= 4, report
    assert soak.restarts >= 3, report  # every fault but the reward worker's ends the trainer
    assert soak.steps_lost == 0, report
    assert soak.problems == [], report
    assert soak.survived == injected, report
    assert soak.equal, report


def test_a_kill_while_a_save_prunes_keeps_the_steps_metrics_record(tmp_path):
    """The trainer logged a step's metrics after saving its checkpoint: a kill in between (here
    while the save prunes an old checkpoint) left checkpoint N without step N's record, and the
    resume started at N + 1, so the record was never written. It logs before the save now."""
    chaos = load_bench()
    files = chaos.write_inputs(tmp_path / "inputs")
    out = tmp_path / "run"
    # Checkpoint 3's save prunes checkpoint 1 (max_actor_ckpt_to_keep=2): killed there.
    assert chaos.finish(chaos.start(out, files, 4, "checkpoint_delete@1")) == -9
    assert chaos.newest_checkpoint(out) == 3
    assert chaos.finish(chaos.start(out, files, 4)) == 0
    assert sorted(chaos.per_step(out)) == [0, 1, 2, 3, 4]


def test_ray_ranks_and_replicas_killed_at_random_end_with_the_uninterrupted_runs_metrics(tmp_path, ray_head):
    """Two Ray ranks, each with a rollout replica: an actor rank's process and a replica's are
    SIGKILLed at random moments. The rank's death stops the trainer naming the dead rank (exit 1)
    and the restart resumes from the newest checkpoint; the replica's is survived in the run (its
    requests go to the other replica, it is restarted at the next weight sync) unless it lands
    inside a weight sync, whose broadcast group it breaks: that still stops the trainer naming the
    replica (a known gap, docs/status.md), and the restart resumes. Either way the run ends as the
    uninterrupted one did. Every start attaches to the shared cluster (tests/e2e/conftest.py ``ray_head``),
    which outlives the processes killed on it, instead of starting a cluster of its own."""
    pytest.importorskip("ray")
    chaos = load_bench()
    soak = chaos.soak_run(tmp_path, faults=2, seed=1, steps=5, backend="ray", only=("rank_kill", "replica_kill"),
                          cluster=ray_head)
    report = soak.report()
    assert soak.injected == {"rank_kill": 1, "replica_kill": 1}, report
    log = (tmp_path / "chaos.log").read_text()
    # The rank's death was named: the role, the rank, and that its process exited.
    assert re.search(r"actor rank \d on node \S+ \(id \w+\) died in \S+ \(its process exited\)", log), report
    if soak.outcomes.get("replica_kill: trainer exit 1"):  # it struck a weight sync
        assert soak.outcomes == {"rank_kill: trainer exit 1": 1, "replica_kill: trainer exit 1": 1}, report
        assert soak.exit_codes == {1: 2} and soak.restarts == 2, report
        assert re.search(r"rollout replica \d rank 0 on node \S+ \(id \w+\) died in RolloutWorker.receive_weights "
                         r"\(its process exited\)",
                         log), report
    else:
        assert soak.outcomes == {"rank_kill: trainer exit 1": 1, "replica_kill: restarted, the run went on": 1}, report
        assert soak.exit_codes == {1: 1} and soak.restarts == 1, report
        # The replica's: named with its node, then restarted.
        assert re.search(r"rollout replica \d on node \S+ \(id \w+\) died \(restart 1 of "
                         r"rollout.max_replica_restarts=3 .*rollout replica \d rank 0 on node \S+ \(id \w+\) died in "
                         r"\S+ \(its process "
                         r"exited\)", log), report
        assert re.search(r"rollout replica \d restarted on node", log), report
    assert soak.steps_lost == 0 and soak.problems == [], report
    assert soak.survived == 2 and soak.equal, report
