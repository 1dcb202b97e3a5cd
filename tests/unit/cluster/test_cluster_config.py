"""trainer.backend / n_workers / ray_* validation: each mistake is named before anything starts."""

from __future__ import annotations

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
