"""The data-parallel ranks of an offline trainer (``hybridflow sft``, ``hybridflow dpo``): one rank in
this process, or ``world`` processes started by forkserver that meet in a torch.distributed group.
Each rank runs the trainer's ``train(rank, world, job, device)``; what rank 0 returns comes back."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, Protocol, TypeVar

import torch

from hybridflow.config import Config
from hybridflow.training import distributed
from hybridflow.workers.sft import rank_device


class RankJob(Protocol):
    """What a rank needs of a trainer's job: the run's config (``trainer.device``)."""

    cfg: Config


J = TypeVar("J", bound=RankJob)
Train = Callable[[int, int, J, torch.device], Any]


def run_ranks(world: int, train: Train[J], job: J, preload: list[str]) -> Any:
    """``train`` on each of ``world`` ranks; rank 0's result. ``train`` and ``job`` cross into the
    rank processes by pickling (``train`` a module-level function); ``preload``: the modules the
    forkserver imports once for every rank."""
    if world == 1:
        return _run_rank(0, 1, 0, train, job)
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(preload)
    with context.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(world, distributed.free_port(), train, job, results), nprocs=world,
                           join=True, start_method="forkserver")
        return results.get("final_val")


def _rank_main(rank: int, world: int, port: int, train: Train[J], job: J, results: MutableMapping[str, Any]) -> None:
    final_val = _run_rank(rank, world, port, train, job)
    if rank == 0:
        results["final_val"] = final_val


def _run_rank(rank: int, world: int, port: int, train: Train[J], job: J) -> Any:
    device = rank_device(job.cfg.trainer.device, rank, world)
    if world > 1:
        distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                       device=device)
    try:
        return train(rank, world, job, device)
    finally:
        if world > 1:
            distributed.dist.destroy_process_group()
