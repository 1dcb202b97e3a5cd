"""rollout.tensor_model_parallel_size > 1 reaches vLLM's tensor_parallel_size and SGLang's --tp-size (their
config-building functions; neither engine is needed), and the config accepts it for them."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import load_config, validate_config
from hybridflow.rollout.factory import ROLLOUT_ENGINES, _tensor_parallel_arg
from hybridflow.rollout.sglang_engine import launch_args
from hybridflow.rollout.vllm_engine import engine_kwargs


def test_vllm_engine_args_carry_the_tensor_parallel_size() -> None:
    common = dict(dtype="bfloat16", seed=0, max_batch_size=8, enable_prefix_caching=True, enforce_eager=False,
                  kv_cache_bytes=None, on_gpu=True, chunking={})
    assert engine_kwargs("/m", **common, tensor_parallel_size=4)["tensor_parallel_size"] == 4
    assert engine_kwargs("/m", **common)["tensor_parallel_size"] == 1


def test_sglang_launch_args_carry_the_tp_size() -> None:
    common = dict(dtype="bfloat16", seed=0, max_batch_size=8, enforce_eager=False, enable_prefix_caching=True,
                  device=torch.device("cuda", 0))
    args = launch_args(**common, tensor_parallel_size=2)
    assert args[args.index("--tp-size") + 1] == "2"
    assert "--tp-size" not in launch_args(**common)


def test_only_engines_that_split_a_model_themselves_take_the_size() -> None:
    assert ROLLOUT_ENGINES["vllm"].own_tensor_parallel and ROLLOUT_ENGINES["sglang"].own_tensor_parallel
    assert not ROLLOUT_ENGINES["native"].own_tensor_parallel  # its TP spans processes (inference/tensor_parallel.py)
    assert _tensor_parallel_arg(ROLLOUT_ENGINES["vllm"], "vllm", 4) == {"tensor_parallel_size": 4}
    assert _tensor_parallel_arg(ROLLOUT_ENGINES["native"], "native", 1) == {}
    with pytest.raises(ValueError, match="does not split a model over devices itself"):
        _tensor_parallel_arg(ROLLOUT_ENGINES["native"], "native", 2)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_config_passes_tp_to_vllm_and_sglang(engine: str) -> None:
    cfg = load_config(overrides=[f"rollout.name={engine}", "rollout.tensor_model_parallel_size=2",
                                 "trainer.n_gpus_per_node=4", "trainer.device=cuda", "rollout.top_p=1",
                                 "data.train_batch_size=16", "actor.ppo_mini_batch_size=8"])
    assert cfg.trainer.backend == "ray"  # four GPUs: four processes
    validate_config(cfg)  # no refusal of TP for these engines (what this machine lacks is machine_problems')


def test_a_replicas_first_rank_builds_the_engine_over_all_its_devices(monkeypatch, tmp_path) -> None:
    """An engine that splits the model itself (vLLM, SGLang; a recording stand-in here) is built once per
    replica, by rank 0, with the replica's size; its other ranks build none (they hold their devices)."""
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
    from hybridflow.rollout.factory import EngineArgs, EngineSpec
    from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

    model_dir = write_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2,
                                                               num_key_value_heads=1))
    builds: list[EngineArgs] = []

    def build(args: EngineArgs) -> object:
        builds.append(args)
        return object()

    monkeypatch.setitem(ROLLOUT_ENGINES, "own_tp", EngineSpec(build=build, loads_own_weights=True,
                                                              own_tensor_parallel=True))
    setup = RolloutSetup(model_path=str(model_dir), engine="own_tp", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=4, seed=0)
    leader, other = RolloutWorker(0, 2, setup), RolloutWorker(1, 2, setup)
    assert len(builds) == 1 and builds[0].tensor_parallel_size == 2
    assert leader.engine is not None and other.engine is None
