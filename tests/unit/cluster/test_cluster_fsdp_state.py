"""FSDP2 state handling on a one-rank gloo group in this process: the sharded model's gathered
weights and optimizer state equal the unsharded ones (in the single-process checkpoint layout),
and loading them back restores the same values."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1)


@pytest.fixture
def one_rank_group():
    torch.set_num_threads(1)
    distributed.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1",
                                   master_port=distributed.free_port(), device=torch.device("cpu"))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _adam_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).reshape(2, 6)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def test_optimizer_state_layouts_round_trip() -> None:
    model = build_tiny_model(SPEC, seed=0)
    optimizer = _adam_step(model)
    indexed = optimizer.state_dict()
    names = distributed.optimizer_param_names(model, optimizer)
    named = distributed.indexed_to_named(indexed, names)
    assert set(named["state"]) == {n for n, _ in model.named_parameters()}
    back = distributed.named_to_indexed(named)
    assert back["param_groups"] == indexed["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], indexed["state"][i]["exp_avg"]) for i in indexed["state"])
    with pytest.raises(ValueError, match="parameter counts per group"):
        distributed.indexed_to_named(indexed, [names[0][:-1]])


def test_helpers_are_local_without_a_process_group() -> None:
    assert distributed.world_size() == 1 and not distributed.is_data_parallel() and distributed.is_rank_zero()
    assert distributed.all_reduce_sum([3, 4.5]) == [3.0, 4.5]
    assert distributed.all_reduce_max(7) == 7
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        TrainEngine(build_tiny_model(SPEC, seed=0), OptimSpec(lr=1e-3), torch.device("cpu"), data_parallel=True)
    with pytest.raises(ValueError, match="mixed_precision needs fp32 master weights"):
        TrainEngine(build_tiny_model(SPEC, seed=0).to(torch.bfloat16), None, torch.device("cpu"),
                    mixed_precision=torch.bfloat16)


def test_decoder_layers_come_from_no_split_modules() -> None:
    model = build_tiny_model(SPEC, seed=0)
    assert [type(m).__name__ for m in distributed.decoder_layers(model)] == ["Qwen2DecoderLayer"] * 2
    with pytest.raises(ValueError, match="declares no decoder layer class"):
        distributed.decoder_layers(torch.nn.Linear(2, 2))


def test_sharded_state_gathers_and_loads_like_the_plain_model(one_rank_group) -> None:
    plain = build_tiny_model(SPEC, seed=0)
    sharded = distributed.shard_model(copy.deepcopy(plain))
    assert distributed.is_sharded(sharded) and not distributed.is_sharded(plain)
    plain_optimizer, sharded_optimizer = _adam_step(plain), _adam_step(sharded)

    weights = distributed.gather_model_state(sharded)
    assert all(torch.allclose(weights[k], v, atol=1e-6) for k, v in plain.state_dict().items())
    gathered = distributed.gather_optimizer_state(sharded, sharded_optimizer)
    expected = plain_optimizer.state_dict()
    assert gathered["param_groups"] == expected["param_groups"]
    for i, state in expected["state"].items():
        assert torch.allclose(gathered["state"][i]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-9)

    # Load into a differently initialised sharded copy: the same values come back.
    fresh = distributed.shard_model(build_tiny_model(SPEC, seed=1))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    full = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # tied: saved once, like HF
    missing, unexpected = distributed.load_model_state(fresh, {**full, "stray.weight": torch.zeros(1)})
    assert missing == ["lm_head.weight"] and unexpected == ["stray.weight"]
    distributed.load_optimizer_state(fresh, fresh_optimizer, gathered)
    assert all(torch.equal(distributed.gather_model_state(fresh)[k], v) for k, v in weights.items())
    reloaded = distributed.gather_optimizer_state(fresh, fresh_optimizer)
    assert all(torch.equal(reloaded["state"][i]["exp_avg"], gathered["state"][i]["exp_avg"]) for i in gathered["state"])
