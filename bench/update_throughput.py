"""Actor-update tokens/s on long-tailed lengths: packed + token-budget + balanced vs padded fixed.

Workload: ``--samples`` trajectories (groups of ``--group-size``), prompts uniform in
[``--min-prompt``, ``--max-prompt``] tokens, responses lognormal (median ``--median-response``,
sigma ``--sigma``, capped at ``--max-response``, taken at the distribution's quantiles so the
tail is there for any sample count): the long tail of RL rollouts. One optimizer
step per data-parallel rank over the whole batch, token-mean policy-gradient loss with entropy.

Data parallelism is simulated on one process: each rank's share runs in turn and is timed on
its own; a synchronous step lasts as long as its slowest rank, so

    tokens/s = valid tokens of the batch / max over ranks of the rank's time.

Configurations (the same batch, model and loss):

- ``padded_fixed`` (baseline, today's actor): contiguous even split over ranks, micro-batches of
  ``--micro-batch-size`` rows padded to the batch's prompt + response width.
- ``packed_fixed``: the same micro-batches, each run as one padding-free row.
- ``packed_dynamic``: token-budget micro-batches of ``--max-token-len`` tokens, count agreed
  over ranks, heaviest first.
- ``packed_dynamic_balanced`` (ours): plus KK balancing of samples over ranks by workload.

    python bench/update_throughput.py --threads 1

Prints a line per configuration with tokens/s, the ratio to the baseline, and max/mean over
ranks of the modelled workload and of the measured time. Then the logprob pass (one rank, the
whole batch, no grad) three ways, to show which packed attention to use on this device:
padded fixed micro-batches; packed token-budget micro-batches on transformers' sdpa (block-
diagonal N×N mask detected from position ids); the same on the per-sequence varlen kernel.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.data.batching import (
    WorkloadModel,
    agree_num_micro_batches,
    balanced_partitions,
    flatten_partitions,
    global_seqlen_metrics,
    num_micro_batches_for_budget,
)
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.training.packing import sequence_lengths
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories

PAD_TOKEN_ID = 256  # <|endoftext|> of the built-in tokenizer


@dataclass
class Plan:
    """What each rank runs in one step: its micro-batches, and whether they run packed."""

    name: str
    ranks: list[list[TrainBatch]]
    packed: bool


def response_lengths(args: argparse.Namespace, g: torch.Generator) -> list[int]:
    """Lognormal lengths at the quantile midpoints (i + 0.5) / n, in random order: a faithful
    long tail for any n, with no luck of the draw in how long the longest response is."""
    quantiles = (torch.arange(args.samples, dtype=torch.float64) + 0.5) / args.samples
    z = torch.special.ndtri(quantiles)[torch.randperm(args.samples, generator=g)]
    return [max(1, min(args.max_response, int(args.median_response * math.exp(args.sigma * float(v))))) for v in z]


def build_batch(args: argparse.Namespace) -> TrainBatch:
    g = torch.Generator().manual_seed(args.seed)
    trajectories = []
    for i, response_len in enumerate(response_lengths(args, g)):
        prompt_len = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=g))
        ids = torch.randint(0, 256, (prompt_len + response_len,), generator=g).tolist()
        trajectories.append(
            Trajectory(ids[:prompt_len], ids[prompt_len:], [1] * response_len, [0.0] * response_len, "length",
                       group_id=i // args.group_size)
        )
    batch = collate_trajectories(trajectories, pad_token_id=PAD_TOKEN_ID)
    # Group-relative style advantages: any fixed non-zero signal gives a real backward.
    batch.advantages = torch.randn(batch.batch_size, 1, generator=g) * batch.response_mask
    return batch


def fixed_plan(name: str, batch: TrainBatch, world_size: int, micro_batch_size: int, packed: bool) -> Plan:
    return Plan(name, [share.split(micro_batch_size) for share in batch.chunk(world_size)], packed)


def dynamic_plan(name: str, batch: TrainBatch, world_size: int, max_token_len: int, balance: bool,
                 workload: WorkloadModel) -> tuple[Plan, dict[str, float]]:
    lengths = sequence_lengths(batch)
    partitions = balanced_partitions(lengths, world_size, workload=workload) if balance else [
        list(range(r * len(lengths) // world_size, (r + 1) * len(lengths) // world_size)) for r in range(world_size)
    ]
    metrics = global_seqlen_metrics(lengths, partitions)
    shares = batch.select(flatten_partitions(partitions)).chunk(world_size)
    # Every rank runs the same number of micro-batches (FSDP collectives pair up per forward).
    agreed = agree_num_micro_batches([num_micro_batches_for_budget(sequence_lengths(s), max_token_len) for s in shares])
    ranks = [token_budget_micro_batches(s, max_token_len, num_micro_batches=agreed)[0] for s in shares]
    return Plan(name, ranks, packed=True), metrics


def loss_for(batch: TrainBatch) -> Callable:
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        assert mb.advantages is not None and entropy is not None
        per_token = -mb.advantages * logprobs - 1e-3 * entropy
        return agg_loss(per_token, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    return loss_fn


def time_rank(engine: TrainEngine, micro_batches: list[TrainBatch], loss_fn: Callable, packed: bool) -> float:
    start = time.perf_counter()
    engine.optimizer_step(micro_batches, loss_fn, temperature=1.0, with_entropy=True, use_remove_padding=packed)
    return time.perf_counter() - start


def measure(plans: list[Plan], engine: TrainEngine, loss_fn: Callable, repeats: int) -> list[list[float]]:
    """Median time of each rank's step, per plan. Plans take turns within every repeat, so a
    burst of load from other processes on the machine hits all of them alike."""
    for plan in plans:  # warm-up
        for rank in plan.ranks:
            time_rank(engine, rank, loss_fn, plan.packed)
    runs = [
        [[time_rank(engine, rank, loss_fn, plan.packed) for rank in plan.ranks] for plan in plans]
        for _ in range(repeats)
    ]
    return [
        [statistics.median(run[p][r] for run in runs) for r in range(len(plan.ranks))] for p, plan in enumerate(plans)
    ]


def rank_workloads(plan: Plan, workload: WorkloadModel) -> list[float]:
    return [sum(sum(workload.costs(sequence_lengths(mb))) for mb in rank) for rank in plan.ranks]


def report_logprob_pass(spec: TinyModelSpec, batch: TrainBatch, tokens: int, args: argparse.Namespace) -> None:
    varlen = TrainEngine(build_tiny_model(spec, seed=0), None, torch.device("cpu"))
    sdpa = TrainEngine(build_tiny_model(spec, seed=0), None, torch.device("cpu"), varlen_attention=False)
    budget = dict(micro_batch_size=args.micro_batch_size, max_token_len=args.max_token_len, use_remove_padding=True)
    variants: dict[str, Callable[[], object]] = {
        "padded_fixed": lambda: varlen.compute_logprobs(batch, temperature=1.0, with_entropy=True,
                                                        micro_batch_size=args.micro_batch_size),
        f"packed_dynamic[{sdpa.model.config._attn_implementation} block mask]":
            lambda: sdpa.compute_logprobs(batch, temperature=1.0, with_entropy=True, **budget),
        f"packed_dynamic[{varlen.model.config._attn_implementation}]":
            lambda: varlen.compute_logprobs(batch, temperature=1.0, with_entropy=True, **budget),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round is the warm-up
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            if repeat:
                times[name].append(time.perf_counter() - start)
    base = tokens / statistics.median(times["padded_fixed"])
    print("logprob pass (one rank, whole batch):")
    for name, ts in times.items():
        rate = tokens / statistics.median(ts)
        print(f"  {name:48s} {rate:9.0f} tokens/s  x{rate / base:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--median-response", type=float, default=120.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-token-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed for comparability)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    spec = TinyModelSpec(max_position_embeddings=args.max_prompt + args.max_response)
    kv_size = spec.hidden_size * spec.num_key_value_heads // spec.num_attention_heads
    workload = WorkloadModel.for_transformer(spec.hidden_size, spec.intermediate_size, kv_size=kv_size)
    batch = build_batch(args)
    lengths = sequence_lengths(batch)
    tokens = sum(lengths)
    # lr=0: the weights stay put, so every configuration times the very same computation.
    engine = TrainEngine(build_tiny_model(spec, seed=0), OptimSpec(lr=0.0), torch.device("cpu"))
    loss_fn = loss_for(batch)

    budget = (args.world_size, args.max_token_len)
    dynamic, _ = dynamic_plan("packed_dynamic", batch, *budget, balance=False, workload=workload)
    ours, seqlen_metrics = dynamic_plan("packed_dynamic_balanced", batch, *budget, balance=True, workload=workload)
    plans = [
        fixed_plan("padded_fixed", batch, args.world_size, args.micro_batch_size, packed=False),
        fixed_plan("packed_fixed", batch, args.world_size, args.micro_batch_size, packed=True),
        dynamic,
        ours,
    ]
    print(
        f"workload: {args.samples} samples (prompt {args.min_prompt}-{args.max_prompt}, response lognormal median "
        f"{args.median_response:g} sigma {args.sigma:g} cap {args.max_response}), {tokens} valid tokens, padded width "
        f"{batch.input_ids.shape[1]}; lengths min/median/max "
        f"{min(lengths)}/{int(statistics.median(lengths))}/{max(lengths)}"
    )
    print(
        f"tiny qwen2 {spec.key()}, fp32 cpu, {args.threads} thread(s), world_size {args.world_size} (simulated), "
        f"micro_batch_size {args.micro_batch_size}, max_token_len {args.max_token_len}, median of {args.repeats}, "
        f"attention {engine.model.config._attn_implementation}"
    )
    baseline_rate = None
    for plan, times in zip(plans, measure(plans, engine, loss_fn, args.repeats)):
        rate = tokens / max(times)
        baseline_rate = baseline_rate or rate
        loads = rank_workloads(plan, workload)
        print(
            f"{plan.name:24s} {rate:9.0f} tokens/s  x{rate / baseline_rate:5.2f}  micro-batches/rank "
            f"{[len(r) for r in plan.ranks]}  workload max/mean {max(loads) / statistics.mean(loads):.3f}  "
            f"time max/mean {max(times) / statistics.mean(times):.3f}  rank times {[round(t, 2) for t in times]}"
        )
    print("balance: " + "  ".join(f"{k}={v:g}" for k, v in seqlen_metrics.items()))
    report_logprob_pass(spec, batch, tokens, args)


if __name__ == "__main__":
    main()
