"""How a role cuts its batches into forwards: the one home of micro-batch planning and cutting.

Two decisions, made once when a role's engine is built (``plan_micro_batches``), and the cutting
they govern at every call:

- **Packed or padded** (``actor.use_remove_padding``): ``hybridflow.config.budget.packing_decision``
  on the loaded model's family.
- **The token budget** (``actor.use_dynamic_bsz``): the configured ``*_max_token_len_per_gpu``,
  or ``auto_token_budget`` from the model's shape and the memory free on the engine's device,
  chosen here at run time; with several ranks every rank takes the smallest rank's budget.
  ``config/budget.py`` and ``config/plan.py`` compute the same numbers for ``config explain``
  before anything runs; they never cut a batch.

Cutting: a mini-batch's training micro-batches (``train_micro_batches``) and a logprob pass's
(``logprob_micro_batches``, with the row order to undo) hold a fixed number of samples, or, with a
budget, as many as fit it (``token_budget_micro_batches``: packed ones cost their valid tokens,
padded ones rows x their own width; the partitions themselves are the pure functions of
``hybridflow.data.batching`` on lengths). FSDP2 runs collectives in each forward and backward, so
ranks agree on the count (``agree_num_micro_batches``) and a call refuses to start when they would
not run the same number (``check_same_count``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridflow.config.budget import (
    BYTES,
    ModelShape,
    auto_token_budget,
    available_host_memory_bytes,
    packing_decision,
)
from hybridflow.data.batching import padded_budget_partitions, token_budget_partitions
from hybridflow.training import distributed
from hybridflow.training.packing import sequence_lengths
from hybridflow.types import TrainBatch


class PlannedEngine(Protocol):
    """What planning reads of a ``TrainEngine`` (a protocol, so the engine may import this module)."""

    model: torch.nn.Module
    device: torch.device
    autocast_dtype: torch.dtype | None  # one rank's mixed-precision compute dtype
    fused_lm_head: bool  # logits never materialised: the budget leaves them out
    data_parallel: bool  # ranks agree on budgets and counts


@dataclass(frozen=True)
class MicroBatchPlan:
    """How a role cuts its batches into forwards (``config explain`` prints the same decisions)."""

    use_remove_padding: bool
    ppo_max_token_len: int | None  # None: fixed-size micro-batches (use_dynamic_bsz=false)
    log_prob_max_token_len: int | None
    notes: tuple[str, ...]

    def per_rank_budgets(self, sequence_parallel_size: int = 1) -> tuple[int | None, int | None]:
        """(update budget, forward budget) as the ``*_max_token_len_per_gpu`` keys count them: one
        rank's tokens (a Ulysses group's budgets, above, are sp times that)."""
        sp = sequence_parallel_size
        return (None if self.ppo_max_token_len is None else self.ppo_max_token_len // sp,
                None if self.log_prob_max_token_len is None else self.log_prob_max_token_len // sp)


def plan_micro_batches(
    engine: PlannedEngine,
    *,
    use_remove_padding: bool,
    use_dynamic_bsz: bool,
    ppo_max_token_len: int | None,
    log_prob_max_token_len: int | None,
    longest_sample: int,
    gradient_checkpointing: bool = False,
    remove_padding_key: str = "actor.use_remove_padding",
    sequence_parallel_size: int = 1,
) -> MicroBatchPlan:
    """Packed or padded (``hybridflow.config.budget.packing_decision`` on the loaded model), and
    the token budgets: the configured ones, or ``auto_token_budget`` from the model's shape and
    the free memory of the engine's device. With several ranks every rank takes the smallest
    rank's budget (a collective), so all cut their batches alike. With Ulysses groups of
    ``sequence_parallel_size`` ranks each rank holds 1/sp of a micro-batch's tokens, so the
    budgets (per rank) are multiplied by sp to count the group's micro-batch, as verl does."""
    # config.auto_map names modeling code shipped with the checkpoint (trust_remote_code).
    shape = ModelShape.from_config(engine.model.config.to_dict())
    packed, why = packing_decision(use_remove_padding, shape.model_type, custom_code=shape.custom_code,
                                   key=remove_padding_key)
    notes = [f"{'packed' if packed else 'padded'} micro-batches: {why}"]
    ppo, log_prob = None, None
    if use_dynamic_bsz:
        ppo, log_prob = _token_budgets(engine, shape, notes, ppo_max_token_len, log_prob_max_token_len,
                                       longest_sample, gradient_checkpointing)
    sp = sequence_parallel_size
    if sp == 1:
        return MicroBatchPlan(packed, ppo, log_prob, tuple(notes))
    if not packed:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} splits packed sequences, but this role runs padded "
                         f"micro-batches ({notes[0]})")
    notes.append(f"Ulysses sequence parallel over {sp} ranks: the token budgets count a group's micro-batch (x{sp})")
    return MicroBatchPlan(packed, None if ppo is None else ppo * sp, None if log_prob is None else log_prob * sp,
                          tuple(notes))


def _token_budgets(
    engine: PlannedEngine, shape: ModelShape, notes: list[str], ppo_max_token_len: int | None,
    log_prob_max_token_len: int | None, longest_sample: int, gradient_checkpointing: bool,
) -> tuple[int, int]:
    """One rank's (update, logprob) token budgets, each configured or derived; the note says which."""
    if ppo_max_token_len is not None and log_prob_max_token_len is not None:
        notes.append(f"token budget: {ppo_max_token_len} tokens per training micro-batch, {log_prob_max_token_len} "
                     f"per logprob micro-batch (configured)")
        return ppo_max_token_len, log_prob_max_token_len
    if engine.device.type == "cuda":
        free, label = torch.cuda.mem_get_info(engine.device)[0], "free GPU memory"
    else:
        free, label = available_host_memory_bytes(), "available host memory"
    dtype = engine.autocast_dtype or next(engine.model.parameters()).dtype
    auto = auto_token_budget(
        shape, free, longest_sample, compute_bytes=BYTES.get(str(dtype).removeprefix("torch."), 4),
        gradient_checkpointing=gradient_checkpointing, full_logits=not engine.fused_lm_head, memory_label=label,
        device_type=engine.device.type,
    )
    ppo = ppo_max_token_len if ppo_max_token_len is not None else auto.ppo
    log_prob = log_prob_max_token_len if log_prob_max_token_len is not None else auto.log_prob
    if engine.data_parallel:
        ppo, log_prob = -distributed.all_reduce_max(-ppo), -distributed.all_reduce_max(-log_prob)
    notes.append(f"token budget: {ppo} tokens per training micro-batch, {log_prob} per logprob micro-batch "
                 f"({auto.reason})")
    return ppo, log_prob


# ------------------------------------------------------------------ cutting
def _budget_partitions(
    batch: TrainBatch, max_token_len: int, num_micro_batches: int | None, padded: bool
) -> list[list[int]]:
    if not padded:
        return token_budget_partitions(sequence_lengths(batch), max_token_len, num_micro_batches=num_micro_batches)
    valid = batch.attention_mask
    prompts = valid[:, : batch.prompt_length].sum(dim=1).tolist()
    responses = valid[:, batch.prompt_length :].sum(dim=1).tolist()
    return padded_budget_partitions(prompts, responses, max_token_len, num_micro_batches=num_micro_batches)


def token_budget_micro_batches(
    batch: TrainBatch, max_token_len: int, *, num_micro_batches: int | None = None, padded: bool = False
) -> tuple[list[TrainBatch], list[list[int]]]:
    """Micro-batches of at most ``max_token_len`` tokens each, heaviest first.

    Packed (``padded=False``) a micro-batch costs its valid tokens, and samples are balanced
    over micro-batches (KK); padded it costs rows x its own width, and samples of similar
    length are grouped (``hybridflow.data.batching.padded_budget_partitions``).
    ``num_micro_batches``: the count agreed over data-parallel ranks (``agree_num_micro_batches``
    over every rank's ``num_token_budget_micro_batches``); None uses this batch's own minimum.
    Returns the micro-batches and the row indices of ``batch`` each one holds.
    """
    partitions = _budget_partitions(batch, max_token_len, num_micro_batches, padded)
    return [batch.select(part) for part in partitions], partitions


def num_token_budget_micro_batches(batch: TrainBatch, max_token_len: int, *, padded: bool = False) -> int:
    """How many token-budget micro-batches this rank needs on its own (before agreement)."""
    return len(_budget_partitions(batch, max_token_len, None, padded))


def agree_num_micro_batches(local_count: int, data_parallel: bool) -> int:
    """The micro-batch count every rank runs: the largest any rank needs. FSDP2 runs
    collectives in each forward and backward, so ranks must run the same number."""
    return distributed.all_reduce_max(local_count) if data_parallel else local_count


def check_same_count(count: int, where: str, data_parallel: bool) -> None:
    """Refuse, on every rank at once, a call where ranks would run different numbers of
    forwards (each rank would wait forever in the other's missing all-gather)."""
    if not data_parallel:
        return
    low, high = -distributed.all_reduce_max(-count), distributed.all_reduce_max(count)
    if low != high:
        raise RuntimeError(
            f"{where}: ranks have between {low} and {high} micro-batches; every rank must run the same "
            f"number (agree on it with agree_num_micro_batches)"
        )


def train_micro_batches(engine: PlannedEngine, plan: MicroBatchPlan, mini: TrainBatch,
                        micro_batch_size: int) -> list[TrainBatch]:
    """A mini-batch's training micro-batches: ``micro_batch_size`` samples each, or, with a token
    budget (``plan.ppo_max_token_len``), as many as every rank agrees on. Actor and critic alike."""
    budget, padded = plan.ppo_max_token_len, not plan.use_remove_padding
    if budget is None:
        return mini.split(micro_batch_size)
    count = agree_num_micro_batches(num_token_budget_micro_batches(mini, budget, padded=padded), engine.data_parallel)
    return token_budget_micro_batches(mini, budget, num_micro_batches=count, padded=padded)[0]


def logprob_micro_batches(
    batch: TrainBatch, micro_batch_size: int | None, max_token_len: int | None, num_micro_batches: int | None,
    padded: bool, data_parallel: bool,
) -> tuple[list[TrainBatch], torch.Tensor | None]:
    """Micro-batches for a forward-only pass and, when they reorder rows, the row ids in their
    order (``in_row_order`` undoes it). With a budget and several ranks, the count is agreed
    unless ``num_micro_batches`` forces one."""
    if max_token_len is not None:
        if data_parallel and num_micro_batches is None:
            local_count = num_token_budget_micro_batches(batch, max_token_len, padded=padded)
            num_micro_batches = agree_num_micro_batches(local_count, data_parallel)
        micro_batches, partitions = token_budget_micro_batches(
            batch, max_token_len, num_micro_batches=num_micro_batches, padded=padded
        )
        return micro_batches, torch.tensor([i for part in partitions for i in part], dtype=torch.long)
    if micro_batch_size is None:
        raise ValueError("compute_logprobs needs micro_batch_size or max_token_len")
    return batch.split(micro_batch_size), None


def in_row_order(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Rows computed in micro-batch order ``order`` (row ids) put back in the batch's order."""
    if order is None:
        return values
    restored = torch.empty_like(values)
    restored[order] = values
    return restored
