"""A run attached to an existing Ray cluster of three nodes (``trainer.ray_address``).

The cluster is real: a head and two worker nodes, each started by ``ray start`` on this machine
(127.0.0.1) as its own raylet with its own resources, so the ranks land on different nodes as they
would across machines. The head offers no CPU (the controller runs there, as a driver), and the two
worker nodes three CPUs each: room for three one-CPU ranks, so only ``trainer.nnodes=2`` (a placement
group per node, never two on one node), not Ray's PACK, splits four ranks two and two.

What it checks: a resource pool of ``trainer.nnodes=2`` puts bundles 0-1 on one node and 2-3 on
another even where one node fits all four (trivial actors report their node; no training). A run
with trainer.nnodes=2 and two ranks a node trains 3 steps; its placement.json puts actor ranks 0-1
(and the rollout replicas colocated with them) on one node and 2-3 on another; step 1 equals one
in-process rank's on the same global batch, as on one node (tests/e2e/test_e2e_ray.py).

And a lost node (issue 36, item 3): the raylet of the node holding actor rank 1 and rollout replica 1
is SIGKILLed mid-run. With trainer.max_restarts=0 the run stops within a minute naming the node and
the rank; with trainer.max_restarts=1 it rebuilds its worker groups on the nodes left (each fault test
adds a spare node first) and resumes from its checkpoint by itself, to the metrics of a run never killed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_records import per_step

pytest.importorskip("ray")

from ray_cluster import Cluster  # noqa: E402

from hybridflow.cli import main as cli_main  # noqa: E402
from hybridflow.data.tasks.arithmetic import write_arithmetic_task  # noqa: E402
from hybridflow.models.tiny import write_tiny_model  # noqa: E402

# One worker runs this module's tests in turn (pytest-xdist): they share one cluster, and each run takes two of
# its CPUs.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

# A worker node's CPUs: room for three one-CPU ranks, so that two ranks a node is trainer.nnodes' doing, not the
# nodes' size (Ray's PACK would put three on one node).
NODE_CPUS = 3
DIGIT_SHARE_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A head and two worker nodes (the fault tests add one each before they kill one), each worker of
    ``NODE_CPUS``: whatever two nodes the fault tests kill (they may run first: conftest puts the longest
    tests first), two of the four are left, each with room for two ranks."""
    nodes = Cluster.with_head(tmp_path_factory.mktemp("ray_cluster"), num_cpus=0)
    try:
        for name in ("node_a", "node_b"):
            nodes.add_worker(name, NODE_CPUS)
        yield nodes
    finally:
        nodes.stop()


def _run_args(tmp_path: Path) -> list[str]:
    """3 short steps of the tiny model (one torch thread per process: the numbers do not depend on the load)."""
    model_dir = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=32, val_size=4)
    reward = tmp_path / "reward.py"
    reward.write_text(DIGIT_SHARE_REWARD)
    return [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"reward.custom_reward_function.path={reward}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4", "data.max_response_length=4",
        "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.seed=3",
        "actor.use_dynamic_bsz=false", "rollout.dtype=float32", "model.dtype=float32",
    ]


def _on_cluster(cluster: Cluster, ranks_per_node: int = 1) -> list[str]:
    """Actor ranks (each with its rollout replica) on two nodes of the cluster, ``ranks_per_node`` on each."""
    return ["trainer.backend=ray", f"trainer.n_workers={2 * ranks_per_node}", "trainer.nnodes=2",
            f"trainer.ray_address={cluster.address}"]


# Run on the cluster (its environment holds the token): for each trainer.nnodes in argv[2:], a pool of
# four bundles of half a CPU (one three-CPU node fits them all) with a trivial actor in each bundle;
# prints a line of JSON per pool: each bundle's node, and each node group's.
POOL_PROBE = """
import json, sys
from hybridflow.cluster.ray_group import ResourcePool, init_ray
init_ray(sys.argv[1], dashboard=False)
import ray

@ray.remote
class Where:
    def node(self):
        return ray.get_runtime_context().get_node_id()

for nnodes in sys.argv[2:]:
    pool = ResourcePool(4, use_gpu=False, nnodes=int(nnodes), cpus_per_bundle=0.5, timeout_s=60)
    probes = [Where.options(**pool.actor_options(bundle, 1.0)).remote() for bundle in range(4)]
    print(json.dumps({"bundles": ray.get([p.node.remote() for p in probes]), "groups": pool.node_ids}), flush=True)
    pool.close()
"""


def _bundle_nodes(cluster: Cluster, *nnodes: int) -> list[dict[str, list[str]]]:
    done = subprocess.run([sys.executable, "-c", POOL_PROBE, cluster.address, *map(str, nnodes)], env=cluster.env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(nnodes):]]


def test_a_pool_of_two_nodes_puts_each_nodes_bundles_on_a_node_of_its_own(cluster):
    """trainer.nnodes=2: bundles 0-1 (ranks 0-1 of every role) on one node, 2-3 on another, though
    one node fits all four; the head (no CPU) holds none. trainer.nnodes=1 keeps Ray's PACK, which
    puts all four on one node: the layout trainer.nnodes changes."""
    two, one = _bundle_nodes(cluster, 2, 1)
    bundles = two["bundles"]
    assert bundles[0] == bundles[1] != bundles[2] == bundles[3], two
    assert two["groups"] == [bundles[0], bundles[2]], two
    assert len(set(one["bundles"])) == 1 and one["groups"] == [], one
    assert one["bundles"][0] in bundles, (one, two)  # a worker node, not the head


def test_two_nodes_of_two_actor_ranks_on_an_existing_cluster_train_like_one_local_rank(tmp_path, cluster):
    common = _run_args(tmp_path)
    runs = {"local": [], "cluster": _on_cluster(cluster, ranks_per_node=2)}
    # The local run through the CLI's main in this process (torch and transformers are imported already: a
    # process of its own spends most of a short run starting up); the cluster's a CLI process with its token.
    assert cli_main(["train", *common, f"trainer.output_dir={tmp_path / 'local'}"]) == 0
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", *common, *runs["cluster"],
           f"trainer.output_dir={tmp_path / 'cluster'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cluster.env)
    assert done.returncode == 0, f"cluster: {done.stderr[-4000:]}"
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in runs}
    assert [r["step"] for r in records["cluster"]] == [1, 2, 3]

    # Where the ranks ran (trainer.nnodes=2): actor ranks 0-1 on one worker node, 2-3 on another
    # (either node holds three), and each rollout replica beside its actor rank.
    placement = json.loads((tmp_path / "cluster" / "placement.json").read_text())
    actor_nodes = [rank["node_id"] for rank in placement["actor"]]
    assert len(actor_nodes) == 4 and actor_nodes[0] == actor_nodes[1] != actor_nodes[2] == actor_nodes[3], placement
    replicas = {int(role.split()[-1]): placement[role][0]["node_id"] for role in placement
                if role.startswith("rollout replica")}
    assert [replicas[k] for k in sorted(replicas)] == actor_nodes, placement

    # Step 1 as one in-process rank computes it on the same global batch.
    local, cluster = records["local"][0], records["cluster"][0]
    assert cluster["critic/score/mean"] == local["critic/score/mean"]
    assert cluster["rollout/generated_tokens"] == local["rollout/generated_tokens"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert cluster[key] == pytest.approx(local[key], abs=1e-5), key


# ------------------------------------------------------------------------------- a lost node
LOST_NODE_BOUND_S = 60.0  # issue 36: a lost node stops the step within a minute, naming it
# What a restart changes by design besides the wall clock: its own count.
RESTART_DEPENDENT = ("trainer/restarts",)


def _start(args: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 -- the child owns it until it exits
    return subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "train", *args, f"trainer.output_dir={out}"],
                            stdout=log, stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"})


def _lose_a_node_in_step_two(cluster: Cluster, out: Path, run: subprocess.Popen) -> tuple[str, float]:
    """Once checkpoint 1 is saved (step 2 is running), kill the raylet of actor rank 1's node;
    returns that node's id and when it was killed."""
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "global_step_1").is_dir():
        assert run.poll() is None, out.with_suffix(".log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint 1 within 300 s"
        time.sleep(0.05)
    node_id = json.loads((out / "placement.json").read_text())["actor"][1]["node_id"]
    cluster.kill_node_of(node_id)
    return node_id, time.monotonic()


def test_a_lost_node_stops_the_run_within_a_minute_naming_the_node_and_the_rank(tmp_path, cluster):
    """trainer.max_restarts=0: the raylet of a node holding an actor rank and a rollout replica is
    killed mid-run; the run stops (exit 1) within a minute, its last line naming that node and a
    rank that ran there. Its checkpoint stands for the same command to resume from."""
    cluster.add_worker("node_c", NODE_CPUS)  # the room a restart would take: this run must not take it
    out = tmp_path / "run"
    run = _start([*_run_args(tmp_path), *_on_cluster(cluster), "trainer.save_freq=1"], out, cluster.env)
    node_id, killed = _lose_a_node_in_step_two(cluster, out, run)
    code = run.wait(timeout=300)
    stopped_s = time.monotonic() - killed
    log = out.with_suffix(".log").read_text()
    assert code == 1, log[-3000:]
    assert stopped_s <= LOST_NODE_BOUND_S, (stopped_s, log[-3000:])
    # The CLI's one line (Ray's own report of the lost raylet may print after it).
    stop = [line for line in log.splitlines() if line.startswith("worker error:")]
    assert len(stop) == 1, log[-3000:]
    # The hybrid engine (the default): actor rank 1 and rollout replica 1 share bundle 1's process, so whichever
    # call met its death first names the node, the process and the other role that died with it.
    assert re.search(rf"(actor rank 1|rollout replica 1 rank 0) on node \S+ \(id {node_id}\) \(the process of bundle 1, "
                     rf"pid \d+, shared with (rollout replica 1 rank 0|actor rank 1)\) died", stop[0]), stop[0]
    assert "trainer.max_restarts=0" in stop[0], stop[0]


def test_with_max_restarts_a_lost_node_is_rebuilt_elsewhere_and_the_run_ends_as_an_unkilled_one(tmp_path, cluster):
    """trainer.max_restarts=1: the same fault; the controller tears the worker groups down, rebuilds
    them on the nodes with room and resumes from checkpoint 1 by itself, and steps 2 and 3 log what
    a run that was never killed logs (one torch thread per process: bitwise)."""
    cluster.add_worker("node_d", NODE_CPUS)  # the room the rebuilt groups take
    args = [*_run_args(tmp_path), *_on_cluster(cluster), "trainer.save_freq=1", "trainer.max_restarts=1"]
    reference, faulted = tmp_path / "reference", tmp_path / "faulted"
    done = _start(args, reference, cluster.env).wait(timeout=600)
    assert done == 0, reference.with_suffix(".log").read_text()[-3000:]
    run = _start(args, faulted, cluster.env)
    node_id, _ = _lose_a_node_in_step_two(cluster, faulted, run)
    code = run.wait(timeout=600)
    log = faulted.with_suffix(".log").read_text()
    assert code == 0, log[-3000:]
    # Why it restarted, named: the node and a rank on it; then the resume from checkpoint 1.
    assert re.search(rf"restart 1 of trainer.max_restarts=1: .*{node_id}", log), log[-3000:]
    assert re.search(r"resumed from \S+global_step_1 at step 1", log), log[-3000:]
    # The rebuilt ranks run on the nodes left.
    placement = json.loads((faulted / "placement.json").read_text())
    assert node_id not in {rank["node_id"] for ranks in placement.values() for rank in ranks}, placement
    expected, got = per_step(reference), per_step(faulted)
    assert sorted(got) == [1, 2, 3]
    assert [got[step]["trainer/restarts"] for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in (1, 2, 3):
        for key in RESTART_DEPENDENT:
            got[step].pop(key), expected[step].pop(key)
    assert got == expected
