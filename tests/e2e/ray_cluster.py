"""Ray clusters started with ``ray start`` on this machine (127.0.0.1), as the end-to-end tests use them.

Imported by tests/e2e/conftest.py and the test modules beside it (pytest puts this folder on
``sys.path``): the multi-node tests build a head and worker nodes of their own, and the Ray runs
that kill nothing attach to one single-node cluster per test process (the ``ray_head`` fixture).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.cluster.ray_group import LOOPBACK_ONLY_ENV
from hybridflow.training.distributed import free_port

NODE_START_TIMEOUT_S = 120.0


def ray_cli() -> str:
    ray = Path(sys.executable).with_name("ray")
    return str(ray) if ray.exists() else shutil.which("ray") or "ray"


def cluster_env(home: Path) -> dict[str, str]:
    """Every process of the cluster and its driver: token authentication, as a shared cluster runs
    (every node and every driver holds the cluster's token; here in the environment), a HOME of the
    test's own (nothing read from or left in the user's ~/.ray), no usage statistics."""
    # Without the loopback-only switch another test module of this process may have set for the
    # clusters hybridflow starts itself (tests/e2e/test_e2e_ray.py): with it, Ray refuses a second node.
    inherited = {k: v for k, v in os.environ.items() if k != LOOPBACK_ONLY_ENV}
    return {**inherited, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


@dataclass
class Cluster:
    """A Ray cluster of ``ray start --block`` processes on 127.0.0.1: a head and worker nodes, each
    worker with a custom resource of its name. Ending a node's process stops its raylet and workers,
    and nothing of any other Ray cluster on the machine (``ray stop`` would)."""

    address: str
    env: dict[str, str]
    root: Path
    session: Path | None = None  # the head's --temp-dir, removed by stop()
    nodes: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    alive: int = 0  # nodes started and not killed

    @classmethod
    def with_head(cls, root: Path, *, num_cpus: int) -> Cluster:
        """A cluster of one head node offering ``num_cpus`` CPUs (0: only the drivers run there),
        its logs and HOME under ``root``."""
        (root / "home").mkdir(exist_ok=True)
        port = free_port()
        # The session folder holds Unix sockets, whose paths may not exceed 107 bytes: a short one in /tmp.
        cluster = cls(f"127.0.0.1:{port}", cluster_env(root / "home"), root,
                      session=Path(tempfile.mkdtemp(prefix="hfray", dir="/tmp")))
        try:
            cluster.start("head", ["--head", f"--port={port}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                                   "--include-dashboard=false", f"--temp-dir={cluster.session}"])
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def start(self, name: str, args: list[str]) -> None:
        """Start node ``name`` and wait until the cluster counts it alive. One node at a time: two
        nodes starting at once on one machine race for the same ports."""
        self.logs.append(self.root / f"{name}.log")
        self.nodes.append(subprocess.Popen([ray_cli(), "start", *args, "--block", "--node-ip-address=127.0.0.1",
                                            "--disable-usage-stats"],
                                           env=self.env, stdout=self.logs[-1].open("w"), stderr=subprocess.STDOUT))
        self.alive += 1
        wait_for_nodes(self.address, self.env, self.alive, self.nodes[-1], self.logs[-1])

    def kill_node_of(self, node_id: str) -> None:
        """Lose node ``node_id``: its raylet SIGKILLed, as when a machine goes away."""
        kill_raylet(node_id)
        self.alive -= 1

    def add_worker(self, name: str, num_cpus: int = 1) -> None:
        """A worker node of ``num_cpus`` CPUs and a custom resource of its name."""
        self.start(name, [f"--address={self.address}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                          f"--resources={json.dumps({name: 1})}"])

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.terminate()
        for node in reversed(self.nodes):
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
        if self.session is not None:
            shutil.rmtree(self.session, ignore_errors=True)


def wait_for_nodes(address: str, env: dict[str, str], count: int, node: subprocess.Popen, log: Path) -> None:
    """Until the newest node (``node``, logging to ``log``) says it started, then until the cluster
    counts ``count`` live nodes (a driver that connects before the head listens would wait on it
    without end: it connects only after the head's own line)."""
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text():
        assert node.poll() is None, f"ray start ended ({node.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no node start within {NODE_START_TIMEOUT_S:.0f} s"
        time.sleep(0.5)
    probe = ("import ray, sys, time\nray.init(address=sys.argv[1], log_to_driver=False)\n"
             "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]): time.sleep(0.5)\n")
    done = subprocess.run([sys.executable, "-c", probe, address, str(count)], env=env, capture_output=True, text=True,
                          timeout=NODE_START_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]


def kill_raylet(node_id: str) -> None:
    """SIGKILL the raylet of node ``node_id`` (a lost node: its processes go with it)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if args and args[0].endswith(b"/raylet") and f"--node_id={node_id}".encode() in args:
            os.kill(int(cmdline.parent.name), signal.SIGKILL)
            return
    raise AssertionError(f"no raylet of node {node_id} on this machine")
