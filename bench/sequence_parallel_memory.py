"""Ulysses sequence parallelism vs none: activation memory per rank against sequence length, and
the longest sequence that fits a fixed activation budget, on two gloo CPU ranks.

Both runs use the same two ranks, FSDP2 over both, and one packed sequence of L tokens (a
quarter prompt, three quarters response) per training step: with ``sp=1`` each rank forwards
the whole sequence (two data-parallel ranks), with ``sp=2`` the two ranks split it (one
data-parallel rank of two sequence-parallel ranks).

What is measured: the bytes autograd saves for the backward during one training forward (the
loss included), per rank, through ``torch.autograd.graph.saved_tensors_hooks``: every saved
tensor's storage counted once, parameters and views of them (leaves that require grad: the
weights FSDP2 gathered) left out because they do not grow with L. Saved tensors all live until
the backward starts, so this total is their peak; it is what grows with the sequence and what a
token budget has to fit. With sp=2 it includes what the exchanges add (each rank's q, k, v and
attention output over all N tokens for half the heads).
Not counted: transient buffers inside one op (never more than one layer's attention or MLP
workspace), the gathered weights, gradients and optimizer state (the same for both runs). The
CPU allocator has no peak counter (``tracemalloc`` does not see torch's allocations), which is
why the saved bytes are counted directly.

Cross-check (``--profile-lengths``): ``torch.profiler`` with ``profile_memory=True`` records every
CPU allocation and free of the step; the peak of their running sum (above where the step began)
is everything the step held at once: activations, transients, gradients, Adam's moments (first
step) and the gathered weights. The parts that do not grow with L keep its ratio below the saved
bytes' one at short lengths.

The longest sequence within ``--budget-mib`` is found by bisection over L in steps of
``--step`` tokens, measuring each candidate (both ranks agree on every decision).

    python bench/sequence_parallel_memory.py --budget-mib 64 --profile-search

Measured (2-core CPU, torch 2.13, a 4-layer hidden-128 Qwen2 with 4 heads / 2 KV heads): saved
activations per rank 49.3 / 25.0 MiB at L=1024, 98.7 / 50.1 at 2048, 197.3 / 100.1 at 4096
(sp=1 / sp=2, 1.97x less each); the longest sequence within 64 MiB is 1280 tokens with sp=1 and
2560 with sp=2: 2.00x. The profiler's peak of all allocations (three runs): 54.1 / 28.3-28.8
MiB at 1024 (1.88-1.91x), 105.1-105.5 / 55.9-56.4 at 2048 (1.86-1.88x), and within 64 MiB 1152
vs 2304 tokens: 2.00x.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch

SP = 2
WORLD = 2


def build_model(seed: int = 0) -> torch.nn.Module:
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def one_sequence(length: int) -> TrainBatch:
    g = torch.Generator().manual_seed(length)
    p = length // 4
    r = length - p
    ids = torch.randint(0, 512, (1, length), generator=g)
    attention = torch.ones_like(ids)
    return TrainBatch(input_ids=ids, attention_mask=attention, position_ids=attention.cumsum(-1) - 1,
                      response_mask=torch.ones(1, r), group_ids=torch.zeros(1, dtype=torch.long),
                      rewards=torch.zeros(1), rollout_logprobs=torch.zeros(1, r),
                      advantages=torch.randn(1, r, generator=g), prompt_length=p)


class SavedBytes:
    """Bytes of the storages autograd saves for backward (parameters left out)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # A linear layer saves its weight transposed: a view whose base is the parameter.
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def measure(engine: TrainEngine, length: int) -> int:
    """Saved-activation bytes of one training step on a sequence of ``length`` tokens, the most
    any rank saved (so every rank takes the same decisions)."""
    batch = one_sequence(length)
    num_tokens = distributed.all_reduce_sum(batch_counts(batch.response_mask))[0]
    saved = SavedBytes()

    def loss_fn(mb, logprobs, entropy):
        per_token = -logprobs * mb.advantages
        return agg_loss(per_token, mb.response_mask, "token-mean", global_num_tokens=num_tokens, dp_size=WORLD), {}

    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        engine.optimizer_step([batch], loss_fn, temperature=1.0, with_entropy=False, use_remove_padding=True)
    return distributed.all_reduce_max(saved.total)


def profiled_peak(engine: TrainEngine, length: int) -> int:
    """Cross-check of ``measure``: the peak, above where the step started, of every CPU allocation
    and free the profiler records (``profile_memory=True``) during the whole step: forward,
    backward and optimizer, transients, gradients, Adam's first moments and FSDP2's gathered
    weights included; the most any rank reached. A column of the table only (slower)."""
    from torch.profiler import ProfilerActivity, profile

    batch = one_sequence(length)
    num_tokens = distributed.all_reduce_sum(batch_counts(batch.response_mask))[0]

    def loss_fn(mb, logprobs, entropy):
        per_token = -logprobs * mb.advantages
        return agg_loss(per_token, mb.response_mask, "token-mean", global_num_tokens=num_tokens, dp_size=WORLD), {}

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.optimizer_step([batch], loss_fn, temperature=1.0, with_entropy=False, use_remove_padding=True)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    peak = max(itertools.accumulate((e.nbytes() for e in events), initial=0))
    return distributed.all_reduce_max(int(peak))


def longest_within(engine: TrainEngine, budget: int, step: int, cache: dict[int, int], measure=measure) -> int:
    """The longest L (a multiple of ``step``) whose bytes (``measure``) fit ``budget``: doubling,
    then bisection."""

    def fits(length: int) -> bool:
        if length not in cache:
            cache[length] = measure(engine, length)
        return cache[length] <= budget

    low, high = 0, step
    while fits(high):
        low, high = high, high * 2
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _rank(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(args.threads)
    distributed.init_process_group(rank=rank, world_size=WORLD, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        engines = {sp: TrainEngine(build_model(), OptimSpec(lr=1e-4), torch.device("cpu"), data_parallel=True,
                                   sequence_parallel_size=sp) for sp in (1, SP)}
        budget = int(args.budget_mib * 2**20)
        result: dict[str, dict] = {"table": {}, "longest": {}}
        caches: dict[int, dict[int, int]] = {1: {}, SP: {}}
        for length in args.lengths:
            row = {f"sp{sp}": measure(engine, length) for sp, engine in engines.items()}
            if length in args.profile_lengths:
                row |= {f"profiled_sp{sp}": profiled_peak(engine, length) for sp, engine in engines.items()}
            result["table"][length] = row
        for sp, engine in engines.items():
            result["longest"][f"sp{sp}"] = longest_within(engine, budget, args.step, caches[sp])
            if args.profile_search:
                result["longest"][f"profiled_sp{sp}"] = longest_within(engine, budget, args.step, {}, profiled_peak)
        if rank == 0:
            out.update(result)
    finally:
        distributed.dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=float, default=64.0, help="saved-activation budget per rank")
    parser.add_argument("--step", type=int, default=128, help="granularity of the longest-sequence search")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--profile-lengths", type=int, nargs="*", default=[1024, 2048],
                        help="lengths of the table that also get the profiler's peak of all allocations")
    parser.add_argument("--profile-search", action="store_true",
                        help="also search the longest sequence whose profiler peak fits the budget (slower)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(distributed.free_port(), args, out), nprocs=WORLD, join=True)
        result = dict(out)
    mib = 2**20
    print(f"saved activations per rank (MiB), one packed sequence, {WORLD} gloo ranks:")
    print(f"{'L':>7} {'sp=1':>9} {'sp=2':>9} {'sp1/sp2':>8}   profiler peak of all allocations: "
          f"{'sp=1':>9} {'sp=2':>9} {'sp1/sp2':>8}")
    for length, row in sorted(result["table"].items()):
        line = f"{length:>7} {row['sp1'] / mib:>9.2f} {row[f'sp{SP}'] / mib:>9.2f} {row['sp1'] / row[f'sp{SP}']:>8.2f}"
        if "profiled_sp1" in row:
            one, two = row["profiled_sp1"], row[f"profiled_sp{SP}"]
            line += f"   {'':>33} {one / mib:>9.2f} {two / mib:>9.2f} {one / two:>8.2f}"
        print(line)
    one, two = result["longest"]["sp1"], result["longest"][f"sp{SP}"]
    ratio = two / one if one else float("nan")  # nan: not even --step tokens fit the budget with sp=1
    print(f"longest sequence within {args.budget_mib:g} MiB per rank (step {args.step}): sp=1 {one}, sp=2 {two}, "
          f"ratio sp2/sp1 {ratio:.2f}x")
    if args.profile_search:
        one_p, two_p = result["longest"]["profiled_sp1"], result["longest"][f"profiled_sp{SP}"]
        print(f"  the same with the profiler's peak of all allocations: sp=1 {one_p}, sp=2 {two_p}, ratio sp2/sp1 "
              f"{two_p / one_p if one_p else float('nan'):.2f}x")
    print(json.dumps({"budget_mib": args.budget_mib, "longest": result["longest"], "ratio": round(ratio, 3),
                      "table": result["table"]}))


if __name__ == "__main__":
    main()
