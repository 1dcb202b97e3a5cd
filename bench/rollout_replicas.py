"""Generated tokens/s of rollout replicas on a long-tailed GRPO workload: 2 replicas x 1 thread vs
1 replica x 2 threads vs 1 replica x 1 thread.

Workload (as ``rollout_long_tail.py``): ``--prompts`` chat prompts x ``--n`` samples, temperature 1,
responses ending with EOS at per-sample lognormal lengths (median ``--median-tokens``, cap
``--max-tokens``), forced by the same length oracle on every side, so every configuration
generates exactly the same tokens.

Each replica is its own process holding a ``NativeEngine`` (built once, warmed up, then reused),
as a Ray rollout rank is. The controller's ``ReplicaRouter`` places each prompt on a replica (fewest
in-flight tokens, heaviest first); a round sends every replica its prompts at once and ends when
the last replica is done, timed in this process. Configurations alternate within each round;
medians over ``--repeats`` rounds, then the ratios.

    python bench/rollout_replicas.py --model qwen2-20m --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_long_tail import (  # noqa: E402
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    EngineOracle,
    add_workload_args,
    build_model,
    build_prompts,
    engine_run,
    target_lengths,
)

from hybridflow.rollout.router import ReplicaRouter, RouteRequest  # noqa: E402

CONFIGS = {"1 replica x 1 thread": (1, 1), "1 replica x 2 threads": (1, 2), "2 replicas x 1 thread": (2, 1)}


def replica_main(connection: Connection, args: argparse.Namespace, threads: int) -> None:
    """One replica: build and warm the engine, then serve rounds of (prompt indices) until None."""
    from hybridflow.inference.native import NativeEngine

    torch.set_num_threads(threads)
    prompts = build_prompts(args.prompts)
    targets = target_lengths(args.prompts, args.n, args.median_tokens, args.sigma, args.max_tokens)
    engine = NativeEngine(model=build_model(args.model), eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                          max_batch_size=args.max_batch_size, seed=0, logits_processors=[EngineOracle(targets)])
    engine_run(engine, prompts[:2], 2, 8)  # warm-up: first-call allocations
    connection.send("ready")
    while (indices := connection.recv()) is not None:
        # Request ids are the prompts' global indices: the oracle looks their lengths up by them.
        from hybridflow.types import GenerationRequest, SamplingParams

        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
        requests = [GenerationRequest(prompts[i], params, request_id=str(i)) for i in indices]
        results = engine.generate_batch(requests) if requests else []
        connection.send(sum(len(t.response_ids) for group in results for t in group))


class Replicas:
    """``count`` replica processes of ``threads`` torch threads each."""

    def __init__(self, count: int, threads: int, args: argparse.Namespace) -> None:
        context = mp.get_context("spawn")
        self.connections: list[Connection] = []
        self.processes = []
        for _ in range(count):
            parent, child = context.Pipe()
            process = context.Process(target=replica_main, args=(child, args, threads), daemon=True)
            process.start()
            self.connections.append(parent)
            self.processes.append(process)
        for connection in self.connections:
            assert connection.recv() == "ready"

    def run(self, placed: list[list[int]]) -> tuple[int, float]:
        start = time.perf_counter()
        for connection, indices in zip(self.connections, placed, strict=True):
            connection.send(indices)
        tokens = sum(connection.recv() for connection in self.connections)
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        for connection in self.connections:
            connection.send(None)
        for process in self.processes:
            process.join(timeout=30)


def place(count: int, prompts: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    tickets = ReplicaRouter(count).place([RouteRequest(len(p), args.n, args.max_tokens) for p in prompts])
    return [[i for i, t in enumerate(tickets) if t.replica == r] for r in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser, model="qwen2-20m")
    args = parser.parse_args()

    prompts = build_prompts(args.prompts)
    targets = target_lengths(args.prompts, args.n, args.median_tokens, args.sigma, args.max_tokens)
    print(f"workload: {args.prompts} prompts x n={args.n}, {int(targets.sum())} response tokens (lognormal median "
          f"{args.median_tokens:g}, sigma {args.sigma:g}, cap {args.max_tokens}), model {args.model}, "
          f"{os.cpu_count()} CPUs")
    sides = {name: Replicas(count, threads, args) for name, (count, threads) in CONFIGS.items()}
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    try:
        for round_ in range(args.repeats):
            names = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                tokens, seconds = sides[name].run(place(CONFIGS[name][0], prompts, args))
                assert tokens == int(targets.sum()), (name, tokens)
                rates[name].append(tokens / seconds)
                print(f"  round {round_ + 1}: {name}: {tokens / seconds:,.0f} tokens/s ({seconds:.2f} s)", flush=True)
    finally:
        for side in sides.values():
            side.close()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, value in medians.items():
        print(f"{name}: {value:,.0f} generated tokens/s (median of {args.repeats})")
    two, wide, one = medians["2 replicas x 1 thread"], medians["1 replica x 2 threads"], medians["1 replica x 1 thread"]
    print(f"2 replicas x 1 thread vs 1 replica x 2 threads: {two / wide:.2f}x; vs 1 replica x 1 thread: {two / one:.2f}x")


if __name__ == "__main__":
    main()
