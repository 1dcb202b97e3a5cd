"""Mixed precision (bf16 compute over fp32 master weights), HSDP shard groups and offload.

One rank computes under autocast; sharded ranks use FSDP2's policy. Either way the master
weights and the optimizer stay fp32. ``fsdp_size`` changes where parameters live, not the maths:
two gloo ranks replicating one-rank shards train exactly like two ranks sharing one shard group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


@pytest.fixture(autouse=True)
def threads():
    torch.set_num_threads(1)


def random_batch(batch_size: int = 6, prompt: int = 5, response: int = 7, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (batch_size, prompt + response), generator=g)
    attention = torch.ones_like(ids)
    attention[0, prompt + response - 3 :] = 0  # a shorter response
    return TrainBatch(
        input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        response_mask=attention[:, prompt:].float(), group_ids=torch.arange(batch_size),
        rewards=torch.zeros(batch_size), rollout_logprobs=torch.zeros(batch_size, response), prompt_length=prompt,
    )


def token_mean_loss(batch: TrainBatch):
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        return agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    return loss_fn


def test_one_rank_bf16_is_autocast_over_fp32_master_weights() -> None:
    model = build_tiny_model(SPEC, seed=1)
    batch = random_batch()
    fp32 = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-3), torch.device("cpu"))
    mixed = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-3), torch.device("cpu"), mixed_precision=torch.bfloat16)
    ref, _ = fp32.compute_logprobs(batch, temperature=1.0, micro_batch_size=6)
    low, _ = mixed.compute_logprobs(batch, temperature=1.0, micro_batch_size=6)
    assert low.dtype == torch.float32  # logprobs are taken in fp32 from bf16-computed logits
    diff = (low - ref)[batch.response_mask.bool()].abs()
    assert 0 < diff.max() < 0.1  # bf16 really ran (not bitwise fp32), and stays close

    before = [p.detach().clone() for p in mixed.model.parameters()]
    mixed.optimizer_step(batch.split(3), token_mean_loss(batch), temperature=1.0, with_entropy=False)
    params = list(mixed.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(s["exp_avg"].dtype == torch.float32 for s in mixed.optimizer.state.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, params))

    with pytest.raises(ValueError, match="fp32 master weights"):
        TrainEngine(copy.deepcopy(model).to(torch.bfloat16), OptimSpec(lr=1e-3), torch.device("cpu"),
                    mixed_precision=torch.bfloat16)
    with pytest.raises(ValueError, match="offload_params applies to the sharded"):
        TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-3), torch.device("cpu"), offload_params=True)


def test_optimizer_offload_keeps_the_same_update() -> None:
    model = build_tiny_model(SPEC, seed=2)
    batch = random_batch(seed=3)
    results = []
    for offload in (False, True):
        engine = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-3), torch.device("cpu"), offload_optimizer=offload)
        for _ in range(2):
            engine.optimizer_step(batch.split(6), token_mean_loss(batch), temperature=1.0, with_entropy=False)
        assert all(s["exp_avg"].device.type == "cpu" for s in engine.optimizer.state.values())
        results.append([p.detach().clone() for p in engine.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_optimizer_offload_moves_adam_state_off_the_gpu() -> None:
    batch = random_batch()
    engine = TrainEngine(build_tiny_model(SPEC, seed=2), OptimSpec(lr=1e-3), torch.device("cuda"),
                         offload_optimizer=True, mixed_precision=torch.bfloat16)
    engine.optimizer_step(batch.split(6), token_mean_loss(batch), temperature=1.0, with_entropy=False)
    assert all(s["exp_avg"].device.type == "cpu" for s in engine.optimizer.state.values())
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    engine.optimizer_step(batch.split(6), token_mean_loss(batch), temperature=1.0, with_entropy=False)


def _rank_step(rank: int, world: int, port: int, fsdp_size: int, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        _train_one_step(rank, world, fsdp_size, out)  # its engine is gone when the group closes
    finally:
        distributed.close_process_group()


def _train_one_step(rank: int, world: int, fsdp_size: int, out: dict) -> None:
    batch = random_batch(batch_size=8, seed=5)
    shard = batch.chunk(world)[rank]
    engine = TrainEngine(build_tiny_model(SPEC, seed=4), OptimSpec(lr=1e-2), torch.device("cpu"),
                         data_parallel=True, fsdp_size=fsdp_size)
    metrics = engine.optimizer_step([shard], token_mean_loss(batch), temperature=1.0, with_entropy=False)
    weights = dict(engine.named_weights())
    if rank == 0:
        out["grad_norm"] = metrics["actor/grad_norm"]
        out["weights"] = {k: v.clone() for k, v in weights.items()}


def _run_two_ranks(fsdp_size: int) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_step, args=(2, distributed.free_port(), fsdp_size, out), nprocs=2, join=True)
        return dict(out)


def test_hsdp_shard_groups_train_like_full_sharding() -> None:
    """fsdp_size=1 on two ranks: each rank holds whole parameters (replicated), gradients are
    still averaged over both ranks, so the step equals fully sharded training."""
    full, hybrid = _run_two_ranks(-1), _run_two_ranks(1)
    assert hybrid["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-6)
    for name, value in full["weights"].items():
        assert torch.allclose(hybrid["weights"][name], value, atol=1e-6), name
    with pytest.raises(ValueError, match="fsdp_size=0 must divide the 1 data-parallel ranks"):
        distributed.shard_mesh(0)  # (3 on 1 rank is at least the rank count: every rank, as verl)


def test_bf16_mixed_logprobs_of_the_default_model_stay_inside_the_clip() -> None:
    """model.dtype=auto trains the built-in model bf16-mixed on bf16 hardware: the logprobs its update
    sees (packed, under grad) and its logprob passes differ from fp32 by far less than a PPO clip
    of 0.2 (|log ratio| < log 1.2) and, on average, less than the health check's mismatch alarm."""
    from hybridflow.tracking.health import HealthThresholds

    model = build_tiny_model(TinyModelSpec(), seed=3)  # the default run's shape
    batch = random_batch(batch_size=16, prompt=35, response=4, seed=2)
    fp32 = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-3), torch.device("cpu"))
    mixed = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-3), torch.device("cpu"), mixed_precision=torch.bfloat16)
    mask = batch.response_mask.bool()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            ref = fp32.forward_token_stats(batch, 1.0, use_remove_padding=True).logprobs
            low = mixed.forward_token_stats(batch, 1.0, use_remove_padding=True).logprobs
        diff = (low - ref)[mask].abs()
        assert 0 < diff.max() < torch.log(torch.tensor(1.2)), diff.max()
        assert diff.mean() < HealthThresholds().logprob_mismatch
