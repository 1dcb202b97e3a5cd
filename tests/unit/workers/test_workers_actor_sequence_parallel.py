"""The actor with actor.ulysses_sequence_parallel_size=2 on two gloo ranks is one data-parallel
rank: handed the two halves of a batch (as a worker group's split_gather does), the ranks pool
them, and return the old logprobs of their own rows and the metrics of the same update as one
actor on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.config.schema import ActorConfig
from hybridflow.models.tiny import write_tiny_model
from hybridflow.training import distributed
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.actor import ActorSetup, ActorWorker

SP = 2
METRICS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "rollout_corr/log_ratio_abs_mean")


def _actor(model_dir: str, rank: int, world: int) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=2, use_remove_padding=True, use_dynamic_bsz=True,
                      ppo_max_token_len_per_gpu=24, log_prob_max_token_len_per_gpu=24, entropy_coeff=0.01,
                      ulysses_sequence_parallel_size=world)
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=0.9,
                       rollout_n=4, total_optimizer_steps=10, max_response_length=12, max_prompt_length=6)
    return ActorWorker(rank, world, cfg, setup)


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts, responses = [2, 6, 3, 5, 4, 2, 6, 3], [12, 1, 7, 2, 10, 3, 1, 5]
    trajectories = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.randint(0, 256, (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [-1.0] * r, "stop", group_id=i // 4))
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    return batch


def _run(actor: ActorWorker, batch) -> dict:
    old = actor.compute_old_logprobs(batch).logprobs
    return {"old_logprobs": old, "metrics": actor.update_actor(batch), "plan": actor.plan}


def _rank(rank: int, world: int, port: int, model_dir: str, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        out[rank] = _run(_actor(model_dir, rank, world), _batch().chunk(world)[rank])
    finally:
        distributed.close_process_group()


def test_a_sequence_parallel_actor_group_acts_as_one_data_parallel_rank(tmp_path) -> None:
    torch.set_num_threads(1)
    model_dir = str(write_tiny_model(tmp_path / "model"))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(SP, distributed.free_port(), model_dir, out), nprocs=SP, join=True)
        ranks = [out[r] for r in range(SP)]
    expected = _run(_actor(model_dir, 0, 1), _batch())
    mask = _batch().response_mask.bool()
    old = torch.cat([r["old_logprobs"] for r in ranks])  # as the controller glues split_gather's results
    assert torch.allclose(old[mask], expected["old_logprobs"][mask], atol=1e-5, rtol=0)
    # The group's token budget counts its micro-batch: each rank holds half of its tokens.
    assert ranks[0]["plan"].ppo_max_token_len == SP * expected["plan"].ppo_max_token_len
    for rank in ranks:
        for key in METRICS:
            assert rank["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5, abs=1e-6), key
