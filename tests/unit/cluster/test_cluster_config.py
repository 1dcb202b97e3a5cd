"""trainer.backend / n_workers / ray_* validation: each mistake is named before anything starts."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from hybridflow.config import ConfigError, batch_plan, load_config, validate_config
from hybridflow.config.layout import data_parallel_size


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(overrides=list(overrides)))
    return str(info.value)


def test_n_workers_sets_the_data_parallel_size_of_the_batch_arithmetic() -> None:
    cfg = load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4", "trainer.n_gpus_per_node=2"])
    assert data_parallel_size(cfg.trainer) == 4
    assert batch_plan(cfg).samples_per_rank_per_step == 32 * 8 // 4
    assert data_parallel_size(load_config(overrides=["trainer.n_gpus_per_node=2", "trainer.nnodes=3"]).trainer) == 6
    message = _errors("trainer.backend=ray", "trainer.n_workers=3")
    assert "dp=3 data-parallel ranks (trainer.n_workers=3)" in message


def test_several_ranks_need_the_ray_backend() -> None:
    message = _errors("trainer.n_workers=2")
    assert "trainer.backend=local runs every role in this process with one rank" in message
    assert "trainer.n_workers=2 asks for 2 data-parallel ranks; use trainer.backend=ray" in message


def test_bad_worker_counts_and_devices_are_named() -> None:
    assert "trainer.n_workers=0 must be >= 1 or null" in _errors("trainer.n_workers=0")
    message = _errors("trainer.backend=ray", "trainer.n_workers=2", "trainer.device=cuda")
    assert "trainer.n_workers=2 counts CPU ranks, but trainer.device=cuda" in message
    assert "allowed values: local, ray" in _errors("trainer.backend=slurm")


def test_ray_keys_without_ray_warn() -> None:
    overrides = ["trainer.ray_address=10.0.0.1:6379", "trainer.ray_dashboard=true", "trainer.max_restarts=2"]
    warnings = validate_config(load_config(overrides=overrides))
    assert any("trainer.ray_address=10.0.0.1:6379 has no effect with trainer.backend=local" in w for w in warnings)
    assert any("trainer.max_restarts=2 has no effect with trainer.backend=local" in w for w in warnings)
    assert "trainer.max_restarts=-1 must be >= 0" in _errors("trainer.max_restarts=-1")
    assert any("trainer.ray_dashboard=True has no effect" in w for w in warnings)
    joined = validate_config(load_config(overrides=[
        "trainer.backend=ray", "trainer.ray_address=10.0.0.1:6379", "trainer.ray_dashboard=true"]))
    assert any("keeps its own dashboard settings" in w for w in joined)


# ------------------------------------------------------------------------- trainer.nnodes on Ray
def test_nnodes_splits_cpu_ranks_evenly_or_is_refused_naming_both_keys() -> None:
    message = _errors("trainer.backend=ray", "trainer.n_workers=3", "trainer.nnodes=2")
    assert "trainer.n_workers=3 ranks do not split evenly over trainer.nnodes=2 nodes" in message
    four = load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4", "trainer.nnodes=2",
                                  "trainer.ray_address=10.0.0.1:6379", "rollout.tensor_model_parallel_size=4"])
    # A tensor-parallel replica wider than a node's ranks crosses the network every step: said, not refused.
    assert any("some replicas span two nodes" in w for w in validate_config(four))


def test_nnodes_above_one_needs_a_cluster_to_join(monkeypatch) -> None:
    from hybridflow.controller.preflight import machine_problems

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    alone = load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4", "trainer.nnodes=2"])
    assert [p.key for p in machine_problems(alone)] == ["trainer.nnodes"]
    joined = load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4", "trainer.nnodes=2",
                                    "trainer.ray_address=10.0.0.1:6379"])
    assert machine_problems(joined) == []
    # RAY_ADDRESS (what `ray job submit` sets for its driver) is a cluster to join too.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert machine_problems(alone) == []


def test_the_joined_cluster_is_the_configured_address_else_ray_address(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert load_config(overrides=["trainer.backend=ray"]).trainer.joined_ray_address() is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert load_config(overrides=["trainer.backend=ray"]).trainer.joined_ray_address() == "10.0.0.2:6379"
    configured = load_config(overrides=["trainer.backend=ray", "trainer.ray_address=10.0.0.1:6379"])
    assert configured.trainer.joined_ray_address() == "10.0.0.1:6379"  # the config wins over the environment
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert load_config(overrides=["trainer.backend=ray"]).trainer.joined_ray_address() is None


def test_explain_says_which_ranks_share_a_node() -> None:
    from hybridflow.config.explain import explain_config

    def nodes_line(*overrides: str) -> str:
        out = explain_config(load_config(overrides=["trainer.backend=ray", *overrides]))
        return next(line.strip() for line in out.splitlines() if line.strip().startswith("nodes:"))

    two = nodes_line("trainer.n_workers=4", "trainer.nnodes=2", "trainer.ray_address=10.0.0.1:6379")
    assert "trainer.nnodes=2 Ray placement groups of 2 bundle(s)" in two and "ranks 0-1, ranks 2-3;" in two
    assert "STRICT_PACK" in two and "placement.json" in two
    one = nodes_line("trainer.n_workers=2")
    assert "one Ray placement group of 2 bundle(s)" in one and "PACK" in one
    # trainer.backend=local: no Ray nodes to place on.
    assert not any(line.strip().startswith("nodes:") for line in explain_config(load_config()).splitlines())


def test_a_pool_refuses_nodes_that_do_not_divide_its_bundles_before_touching_ray() -> None:
    from hybridflow.cluster.ray_group import ResourcePool

    with pytest.raises(ValueError, match="trainer.nnodes=2 must divide the pool's 3 bundles"):
        ResourcePool(3, use_gpu=False, nnodes=2)


def test_two_node_groups_never_share_a_node_and_the_error_names_the_layout() -> None:
    """On a one-node Ray cluster that fits all four bundles, trainer.nnodes=2 cannot be placed: the
    second group may not join the first's node. nnodes=1 (PACK) fits there, bundle r in place r."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    from hybridflow.cluster.ray_group import NoRoomError, ResourcePool, init_ray

    leftover = sys.modules.get("ray")
    assert leftover is None or not leftover.is_initialized(), (
        "an earlier test in this process left Ray connected: init_ray would keep its cluster, not start one of 4 CPUs")
    init_ray(None, dashboard=False, num_cpus=4)  # before Ray's import: a cluster on 127.0.0.1 only
    import ray

    try:
        with pytest.raises(NoRoomError) as info:
            ResourcePool(4, use_gpu=False, nnodes=2, cpus_per_bundle=0.5, timeout_s=3)
        message = str(info.value)
        assert "trainer.nnodes=2 nodes of 2 bundles of {'CPU': 0.5} each" in message
        assert f"placed on {ray.get_runtime_context().get_node_id()}, no other node had room" in message
        deadline = time.monotonic() + 30  # the first group is given back (Ray frees it a moment later)
        while ray.available_resources().get("CPU") != 4.0:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.1)
        one = ResourcePool(4, use_gpu=False, cpus_per_bundle=0.5)
        try:
            assert len(one.groups) == 1
            options = one.actor_options(3, 0.5)
            assert options["scheduling_strategy"].placement_group_bundle_index == 3
        finally:
            one.close()
    finally:
        ray.shutdown()


def test_a_joined_cluster_gets_the_runs_fault_and_module_path_in_the_jobs_environment(monkeypatch) -> None:
    """The ranks of an existing cluster do not inherit the driver's environment (a local cluster's do):
    what they must see travels in the job's runtime environment, the injected fault
    (``HYBRIDFLOW_FAULT``) with the module path, and nothing of it when no fault is set."""
    ray = pytest.importorskip("ray")
    from hybridflow.cluster.ray_group import init_ray
    from hybridflow.utils import faults

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv(faults.ENV, "after_step@3")
    init_ray("127.0.0.1:6379", dashboard=False)
    monkeypatch.delenv(faults.ENV)
    init_ray("127.0.0.1:6379", dashboard=False)
    with_fault, without = (call["runtime_env"]["env_vars"] for call in calls)
    assert calls[0]["address"] == "127.0.0.1:6379"
    assert with_fault[faults.ENV] == "after_step@3" and faults.ENV not in without
    assert with_fault["PYTHONPATH"] == without["PYTHONPATH"] != ""
