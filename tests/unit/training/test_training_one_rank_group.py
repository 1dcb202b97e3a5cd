"""FSDP2 over a one-rank process group: the sharded engine on a single device (gloo on a CPU, NCCL
on one GPU) trains exactly like the unsharded one. This is how the GPU kit runs the sharded path
(DTensor parameters, FSDP2's collectives, parameter offload) on the one GPU it is lent, so it must
mean the same update. The CUDA cases skip without CUDA (the GPU kit runs them)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
DEVICES = [
    pytest.param("cpu", id="cpu-gloo"),
    pytest.param("cuda", id="cuda-nccl", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.fixture
def one_rank_group(request):
    device = torch.device(request.param)
    torch.set_num_threads(1)
    distributed.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1",
                                   master_port=distributed.free_port(), device=device)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def batch_of(samples: int = 6, prompt: int = 5, response: int = 7) -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 250, (samples, prompt + response), generator=g)
    attention = torch.ones_like(ids)
    attention[1, prompt + response - 2:] = 0  # a shorter response
    return TrainBatch(
        input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        response_mask=attention[:, prompt:].float(), group_ids=torch.arange(samples), rewards=torch.zeros(samples),
        rollout_logprobs=torch.zeros(samples, response), prompt_length=prompt,
        advantages=torch.randn(samples, response, generator=g),
    )


def pg_loss(batch: TrainBatch):
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        return agg_loss(-logprobs * mb.advantages, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    return loss_fn


@pytest.mark.parametrize("one_rank_group", DEVICES, indirect=True)
def test_fsdp2_over_one_rank_trains_like_the_unsharded_engine(one_rank_group) -> None:
    device = one_rank_group
    model = build_tiny_model(SPEC, seed=7)
    batch = batch_of()
    plain = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), device, fused_lm_head=False)
    sharded = TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-2), device, data_parallel=True)
    assert distributed.is_sharded(sharded.model) and not distributed.is_sharded(plain.model)
    results = []
    for engine in (plain, sharded):
        norms = [engine.optimizer_step(batch.split(3), pg_loss(batch), temperature=1.0, with_entropy=False)
                 ["actor/grad_norm"] for _ in range(2)]
        results.append((norms, dict(engine.named_weights())))
    (plain_norms, plain_weights), (sharded_norms, sharded_weights) = results
    assert plain_norms == pytest.approx(sharded_norms, rel=1e-5)
    assert plain_weights.keys() == sharded_weights.keys()
    for name, value in plain_weights.items():
        torch.testing.assert_close(sharded_weights[name].cpu(), value.cpu(), rtol=1e-5, atol=1e-6, msg=name)
    # Two steps moved the weights: the comparison is not of two untouched copies.
    assert not torch.equal(plain_weights["model.norm.weight"].cpu(), model.model.norm.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("one_rank_group", ["cuda"], indirect=True)
def test_nccl_collectives_run_on_one_rank(one_rank_group) -> None:
    assert dist.get_backend() == "nccl"
    values = torch.arange(4, dtype=torch.float32, device=one_rank_group)
    dist.all_reduce(values)
    gathered = torch.empty(4, device=one_rank_group)
    dist.all_gather_into_tensor(gathered, values)
    dist.broadcast(values, src=0)
    torch.cuda.synchronize()
    assert gathered.tolist() == values.tolist() == [0.0, 1.0, 2.0, 3.0]
