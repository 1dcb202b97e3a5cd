"""A run attached to an existing Ray cluster of three nodes (``trainer.ray_address``).

The cluster is real: a head and two worker nodes, each started by ``ray start`` on this machine
(127.0.0.1) as its own raylet with its own resources, so the ranks land on different nodes as they
would across machines. The head offers no CPU (the controller runs there, as a driver), and each
worker node one CPU: the actor's two ranks (one bundle of one CPU each) cannot share a node.

What it checks: the run trains 3 steps; its placement.json names a different node for each actor
rank (and the rollout replicas colocated with them); step 1 equals one in-process rank's on the
same global batch, as on one node (tests/e2e/test_e2e_ray.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

from hybridflow.cluster.ray_group import LOOPBACK_ONLY_ENV  # noqa: E402
from hybridflow.data.tasks.arithmetic import write_arithmetic_task  # noqa: E402
from hybridflow.models.tiny import write_tiny_model  # noqa: E402
from hybridflow.training.distributed import free_port  # noqa: E402

pytestmark = pytest.mark.slow

NODE_START_TIMEOUT_S = 120.0
DIGIT_SHARE_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n"
)


def _ray_cli() -> str:
    ray = Path(sys.executable).with_name("ray")
    return str(ray) if ray.exists() else shutil.which("ray") or "ray"


def _cluster_env(home: Path) -> dict[str, str]:
    """Every process of the cluster and its driver: token authentication, as a shared cluster runs
    (every node and every driver holds the cluster's token; here in the environment), a HOME of the
    test's own (nothing read from or left in the user's ~/.ray), no usage statistics."""
    # Without the loopback-only switch another test module of this process may have set for the
    # clusters hybridflow starts itself (tests/e2e/test_e2e_ray.py): with it, Ray refuses a second node.
    inherited = {k: v for k, v in os.environ.items() if k != LOOPBACK_ONLY_ENV}
    return {**inherited, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """(the head's address, the environment to reach it): a head and two worker nodes, each a
    ``ray start --block`` process (ending it stops that node's raylet and workers, and nothing of
    any other Ray cluster on the machine, which ``ray stop`` would)."""
    root = tmp_path_factory.mktemp("ray_cluster")
    env = _cluster_env(root / "home")
    (root / "home").mkdir()
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    logs = [root / f"{name}.log" for name in ("head", "node_a", "node_b")]
    # The session folder holds Unix sockets, whose paths may not exceed 107 bytes: a short one in /tmp.
    session = Path(tempfile.mkdtemp(prefix="hfray", dir="/tmp"))
    nodes = [subprocess.Popen([_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=0", "--num-gpus=0",
                               "--include-dashboard=false", f"--temp-dir={session}", *common],
                              env=env, stdout=logs[0].open("w"), stderr=subprocess.STDOUT)]
    try:
        _wait_for_nodes(address, env, 1, nodes, logs)
        # One after the other: two nodes starting at once on one machine race for the same ports.
        for count, name in enumerate(("node_a", "node_b"), start=2):
            nodes.append(subprocess.Popen(
                [_ray_cli(), "start", f"--address={address}", "--num-cpus=1", "--num-gpus=0",
                 f"--resources={json.dumps({name: 1})}", *common],
                env=env, stdout=logs[count - 1].open("w"), stderr=subprocess.STDOUT))
            _wait_for_nodes(address, env, count, nodes, logs)
        yield address, env
    finally:
        for node in reversed(nodes):
            node.terminate()
        for node in reversed(nodes):
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
        shutil.rmtree(session, ignore_errors=True)


def _wait_for_nodes(address: str, env: dict[str, str], count: int, nodes: list[subprocess.Popen],
                    logs: list[Path]) -> None:
    """Until the newest node says it started, then until the cluster counts ``count`` live nodes
    (a driver that connects before the head listens would wait on it without end: it connects
    only after the head's own line)."""
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while "Ray runtime started" not in logs[len(nodes) - 1].read_text():
        for node, log in zip(nodes, logs):
            assert node.poll() is None, f"ray start ended ({node.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no node start within {NODE_START_TIMEOUT_S:.0f} s"
        time.sleep(0.5)
    probe = ("import ray, sys, time\nray.init(address=sys.argv[1], log_to_driver=False)\n"
             "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]): time.sleep(0.5)\n")
    done = subprocess.run([sys.executable, "-c", probe, address, str(count)], env=env, capture_output=True, text=True,
                          timeout=NODE_START_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_actor_ranks_on_two_nodes_of_an_existing_cluster_train_like_one_local_rank(tmp_path, three_nodes):
    address, env = three_nodes
    model_dir = write_tiny_model(tmp_path / "model")
    train, val = write_arithmetic_task(tmp_path / "data", train_size=32, val_size=4)
    reward = tmp_path / "reward.py"
    reward.write_text(DIGIT_SHARE_REWARD)
    common = [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"reward.custom_reward_function.path={reward}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4", "data.max_response_length=4",
        "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.seed=3",
        "actor.use_dynamic_bsz=false", "rollout.dtype=float32",
    ]
    runs = {"local": [],
            "cluster": ["trainer.backend=ray", "trainer.n_workers=2", f"trainer.ray_address={address}"]}
    for name, extra in runs.items():
        cmd = [sys.executable, "-m", "hybridflow.cli", "train", *common, *extra, f"trainer.output_dir={tmp_path / name}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in runs}
    assert [r["step"] for r in records["cluster"]] == [1, 2, 3]

    # Where the ranks ran: the two actor ranks on two different worker nodes (not the head), and
    # each rollout replica beside its actor rank.
    placement = json.loads((tmp_path / "cluster" / "placement.json").read_text())
    actor_nodes = [rank["node_id"] for rank in placement["actor"]]
    assert len(actor_nodes) == 2 and len(set(actor_nodes)) == 2, placement
    replicas = [placement[role][0]["node_id"] for role in sorted(placement) if role.startswith("rollout replica")]
    assert sorted(replicas) == sorted(actor_nodes), placement

    # Step 1 as one in-process rank computes it on the same global batch.
    local, cluster = records["local"][0], records["cluster"][0]
    assert cluster["critic/score/mean"] == local["critic/score/mean"]
    assert cluster["rollout/generated_tokens"] == local["rollout/generated_tokens"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert cluster[key] == pytest.approx(local[key], abs=1e-5), key
