"""What a rank that trains on preference pairs does with a batch of them, whatever it computes for
a side: ``hybridflow dpo`` (a policy's sequence log-probabilities, ``hybridflow.workers.dpo``) and
``hybridflow rm`` (a reward model's scores, ``hybridflow.workers.reward_trainer``).

A pair's loss needs both of its sides, so a step's batch holds its pairs' chosen rows, then their
rejected rows (TRL's layout), each row's ``group_ids`` entry its row in that batch, and micro-batches
are cut by pairs, never between a pair's two rows: ``actor.ppo_micro_batch_size_per_gpu`` pairs, or
with a token budget as many pairs as fit (a pair costs its two rows' tokens, packed, or two rows of
the batch's width, padded). Scoring a set of pairs (validation, a frozen reference) splits them over
the ranks in equal shares, so every rank runs the same forwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from hybridflow.algorithms.preference import PADDING_POSITION
from hybridflow.data.batching import token_budget_partitions
from hybridflow.data.preference import PreferencePair
from hybridflow.training import distributed
from hybridflow.training.micro_batches import MicroBatchPlan, agree_num_micro_batches
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories
from hybridflow.utils.threads import adjust_threads
from hybridflow.workers.sft import SFTWorker


def pair_rows(pairs: Sequence[PreferencePair]) -> list[Trajectory]:
    """The rows of a batch of pairs: every chosen side, then every rejected side, in pair order."""
    return [p.chosen for p in pairs] + [p.rejected for p in pairs]


def pair_step_batch(pairs: Sequence[PreferencePair], pad_token_id: int) -> TrainBatch:
    """A step's batch of ``pairs``: their rows, each tagged with its row number in ``group_ids``."""
    batch = collate_trajectories(pair_rows(pairs), pad_token_id)
    return replace(batch, group_ids=torch.arange(2 * len(pairs)))


def whole_pairs(mb: TrainBatch, num_pairs: int) -> int:
    """The k pairs of a micro-batch cut by ``pair_micro_batches`` (k chosen rows, then their k rejected rows;
    a padding pair's two rows at ``PADDING_POSITION``: ``pair_row_weights``)."""
    k = mb.batch_size // 2
    rows = mb.group_ids
    padding = rows[:k] == PADDING_POSITION
    matched = torch.where(padding, rows[k:] == PADDING_POSITION, rows[k:] - num_pairs == rows[:k])
    assert bool((rows[:k] < num_pairs).all()) and bool(matched.all()), \
        "a micro-batch must hold whole pairs, chosen rows first"
    return k


def pair_row_weights(batch: TrainBatch, k: int) -> torch.Tensor:
    """1 on each row of a batch (or micro-batch) of ``k`` pairs that counts, 0 on both rows of a padding
    pair (``PairLayout``).  # (2k,) float"""
    counted = (batch.group_ids[:k] != PADDING_POSITION).float()
    return torch.cat([counted, counted])


def pair_micro_batches(sft: SFTWorker, batch: TrainBatch, num_pairs: int, length_key: str) -> list[TrainBatch]:
    """This rank's step batch (``num_pairs`` chosen rows, then as many rejected) cut by pairs
    (``length_key``: the setting that bounds a side's length, named when a pair is over the budget)."""
    return cut_pairs(batch, num_pairs, sft.plan, sft.cfg.actor.ppo_micro_batch_size_per_gpu,
                     sft.engine.data_parallel, length_key)


def cut_pairs(batch: TrainBatch, num_pairs: int, plan: MicroBatchPlan, micro_batch_size: int, data_parallel: bool,
              length_key: str) -> list[TrainBatch]:
    """``pair_micro_batches`` for any engine: ``plan``'s token budget, else ``micro_batch_size`` pairs each
    (``data_parallel``: the count is agreed over the engine's ranks)."""
    budget = plan.ppo_max_token_len
    if budget is None:
        size = max(1, micro_batch_size)
        groups = [list(range(i, min(i + size, num_pairs))) for i in range(0, num_pairs, size)]
    else:
        if plan.use_remove_padding:  # packed: a pair costs its two rows' valid tokens
            valid = batch.attention_mask.sum(dim=1).tolist()
            costs = [int(valid[i] + valid[num_pairs + i]) for i in range(num_pairs)]
        else:  # padded: two rows of the batch's width
            costs = [2 * int(batch.input_ids.shape[1])] * num_pairs
        if max(costs) > budget:
            raise ValueError(f"a preference pair has {max(costs)} tokens (its two sides), more than the micro-batch "
                             f"budget actor.ppo_max_token_len_per_gpu={budget}; raise it, or lower {length_key}")
        own = len(token_budget_partitions(costs, budget))
        count = agree_num_micro_batches(own, data_parallel)
        groups = token_budget_partitions(costs, budget, num_micro_batches=count)
    return [batch.select(group + [num_pairs + i for i in group]) for group in groups]


def pair_values(sft: SFTWorker, pairs: Sequence[PreferencePair], pad_token_id: int,
                side_values: Callable[[TrainBatch], torch.Tensor]) -> torch.Tensor:
    """(chosen, rejected) values of every pair under the current weights, over all ranks (a collective:
    each rank computes an equal share, a short one padded with copies). ``side_values(batch)`` gives one
    value per row of a batch of pair rows.  # (N, 2)"""
    world, rank = sft.world, sft.rank
    share = math.ceil(len(pairs) / world)
    own = list(pairs[rank * share:(rank + 1) * share])
    real = len(own)
    own += [pairs[0]] * (share - real)
    values = torch.zeros(len(pairs), 2, dtype=torch.float64)
    size = max(1, sft.cfg.data.val_batch_size // 2)
    for start in range(0, share, size):
        adjust_threads()
        chunk = own[start:start + size]
        rows = side_values(collate_trajectories(pair_rows(chunk), pad_token_id)).double()  # (2k,)
        k = len(chunk)
        for i in range(k):
            if start + i < real:
                values[rank * share + start + i] = torch.stack([rows[i], rows[k + i]])
    if world > 1:
        values = torch.tensor(distributed.all_reduce_sum(values.flatten().tolist()), dtype=torch.float64).view(-1, 2)
    return values


__all__ = ["cut_pairs", "pair_micro_batches", "pair_row_weights", "pair_rows", "pair_step_batch", "pair_values",
           "whole_pairs"]
