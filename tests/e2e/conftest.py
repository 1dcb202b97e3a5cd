"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybridflow.types import UNVERSIONED_TOKEN


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory every test of this pytest run sees. Under pytest-xdist each worker has its own
    base temp directory inside one run directory: the caches live there, so the workers share
    them, and the warm start's own lock (``prepare_builtin_model``) has one worker build each
    model while the others wait for it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for every test that runs the built-in model with the default
    warm start: the first one pays for the warm start (about a minute), the rest reuse it."""
    return shared_dir(tmp_path_factory, "builtin-cache")


@pytest.fixture(scope="session")
def tool_agent_cache(tmp_path_factory) -> Path:
    """One ``warm_start.cache_dir`` for the tests that train the tool_agent preset with its own warm
    start (several minutes on 2 cores): the first pays for it, the others reuse the cached model."""
    return shared_dir(tmp_path_factory, "tool-agent-cache")


def trained_lags(dump_dir: Path) -> dict[int, list[int]]:
    """Per step of a run's rollout dumps (``trainer.rollout_data_dir``), how many versions behind
    the actor's weights before that step's update (version step - 1) each trained sample's oldest
    token is, read from the versions the engine stamped on its tokens (``version_runs``)."""
    lags: dict[int, list[int]] = {}
    for path in dump_dir.glob("*.jsonl"):
        step = int(path.stem)
        for line in path.read_text().splitlines():
            runs = json.loads(line)["version_runs"]
            assert runs is not None, f"step {step}: a sample without token versions"
            versions = [version for version, _ in runs if version != UNVERSIONED_TOKEN]
            assert versions, f"step {step}: a sample no policy version generated"
            lags.setdefault(step, []).append(step - 1 - min(versions))
    return lags


def assert_trained_within_bound(dump_dir: Path, metrics: dict[int, dict] | None, bound: int) -> None:
    """No trained sample of any dumped step (every sample: the dumps must hold whole steps) lags
    more than ``bound`` versions, and the step's logged histogram (``async/staleness/hist_<k>``,
    fractions of samples) is the one its samples' token versions give (``metrics`` None: a loop
    that logs none, the sync one)."""
    lags = trained_lags(dump_dir)
    assert lags, f"no rollout dumps in {dump_dir}"
    for step, step_lags in sorted(lags.items()):
        assert max(step_lags) <= bound, f"step {step}: a trained sample {max(step_lags)} versions behind (bound {bound})"
        if metrics is None:
            continue
        logged = {k: v for k, v in metrics[step].items() if k.startswith("async/staleness/hist_")}
        expected = {f"async/staleness/hist_{k}": sum(1 for lag in step_lags if lag == k) / len(step_lags)
                    for k in range(bound + 1)}
        assert logged == expected, f"step {step}"


@pytest.fixture
def check_staleness():
    """``assert_trained_within_bound``, for the tests of the asynchronous loops (a fixture: the test
    modules do not import one another)."""
    return assert_trained_within_bound


# Logical CPUs of the shared cluster: the largest run attached to it reserves two ranks in each of two
# resource pools (rollout.placement=split), one CPU per bundle.
RAY_HEAD_CPUS = 4


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One single-node Ray cluster (``ray start``, token authentication) per test process, each xdist
    worker its own, for the Ray runs that kill no node: they attach to it
    (``trainer.ray_address=<address>``, run with its ``env``) instead of each starting and stopping a
    local cluster of its own, whose GCS, raylet and agents cost tens of seconds of CPU on a busy machine.
    A run's ranks and reservations end with its driver, so the next run finds the cluster empty, also
    after its ranks or replicas were killed (by an injected fault: ``HYBRIDFLOW_FAULT`` reaches them in the
    job's runtime environment; or by a SIGKILL from outside). Runs that kill nodes, or that test the
    cluster a run starts itself, keep their own. One run at a time: two drivers on it at once kept its GCS
    and two Ray threads of each driver busy (tests/e2e/test_e2e_replica_restart.py's first test with both
    its runs on it: 100-111 CPU-seconds, against 35 with the faulted run on a cluster of its own)."""
    pytest.importorskip("ray")
    from ray_cluster import Cluster

    cluster = Cluster.with_head(tmp_path_factory.mktemp("ray_head"), num_cpus=RAY_HEAD_CPUS)
    try:
        yield cluster
    finally:
        cluster.stop()
