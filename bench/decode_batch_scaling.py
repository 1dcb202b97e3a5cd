"""Decode throughput against batch size: what the fixed per-step cost does to a long tail's last rows.

At the end of a long tail the native engine decodes a handful of rows; every step then pays its
fixed cost (Python scheduling, small tensor allocations, sampling bookkeeping) over few tokens.
This bench runs the ~20M Qwen2-shaped model of ``rollout_long_tail.py`` at each ``--batches``
size (prompts of ``--prompt-tokens`` random tokens, ``--max-tokens`` sampled tokens each with
``ignore_eos``, one engine sized for the largest batch) and prints tokens per CPU-second
(``time.process_time``: fair on a machine other processes load) and per wall-second, medians
over ``--repeats`` runs interleaved across batch sizes, and the ratio of the smallest-but-one
batch (8 by default) to the largest. The decode steps dominate: prefill is one step of 16 tokens
a row against ``--max-tokens`` decode steps.

    python bench/decode_batch_scaling.py --threads 1
    python bench/decode_batch_scaling.py --threads 1 --weight-layouts dense onednn
    python bench/decode_batch_scaling.py --threads 1 --profile 8   # cProfile of one batch-8 run
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from rollout_compute_bound import build_engine, build_prompts, engine_run  # the ~20M shape, one engine set-up

from hybridflow.inference.compact import WEIGHT_LAYOUTS, resolve_weight_layout
from hybridflow.inference.native import resolve_dtype
from hybridflow.utils.device import cpu_features

WARM_UP_TOKENS = 8


def timed(run) -> tuple[int, float, float]:
    """(tokens, CPU seconds of the whole process, wall seconds) of one run."""
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = run()
    return tokens, time.process_time() - cpu, time.perf_counter() - wall


def profile_run(run) -> None:
    """cProfile of one run with the engine's steps inline on the profiled thread.

    The engine runs its steps in a worker thread (``asyncio.to_thread``), which cProfile, being
    per thread, does not see.
    """
    from unittest import mock

    async def inline(function, *args):
        return function(*args)

    profiler = cProfile.Profile()
    with mock.patch("asyncio.to_thread", inline):
        profiler.enable()
        run()
        profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--weight-layouts", nargs="+", default=["auto"], choices=WEIGHT_LAYOUTS,
                        help="one engine each, interleaved with the others (fp32 only: bf16 runs dense)")
    parser.add_argument("--ratio", type=int, nargs=2, default=[8, 128], metavar=("SMALL", "LARGE"))
    parser.add_argument("--profile", type=int, default=0, metavar="BATCH",
                        help="cProfile one run at BATCH (first layout) instead of measuring")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    layouts = list(dict.fromkeys(resolve_weight_layout(w, "cpu", dtype) for w in args.weight_layouts))
    prompts = build_prompts(max(args.batches), args.prompt_tokens)
    engines = {layout: build_engine(args.dtype, max(args.batches), layout) for layout in layouts}
    for engine in engines.values():
        engine_run(engine, prompts, WARM_UP_TOKENS)  # KV cache sizing, first-call allocations
    if args.profile:
        profile_run(lambda: engine_run(engines[layouts[0]], prompts[: args.profile], args.max_tokens))
        return
    per_cpu = {(w, b): [] for w in layouts for b in args.batches}
    per_wall = {(w, b): [] for w in layouts for b in args.batches}
    for _ in range(args.repeats):  # interleaved, so a burst of load hits every size and layout alike
        for layout, engine in engines.items():
            for batch in args.batches:
                tokens, cpu, wall = timed(lambda: engine_run(engine, prompts[:batch], args.max_tokens))
                per_cpu[layout, batch].append(tokens / cpu)
                per_wall[layout, batch].append(tokens / wall)
    print(f"cpu: {cpu_features().describe()}; weight_layout=auto -> {resolve_weight_layout('auto', 'cpu', dtype)}")
    print(f"qwen2-20m {args.dtype}, {args.threads} thread(s), prompt {args.prompt_tokens}, "
          f"{args.max_tokens} tokens a row, median of {args.repeats}")
    small, large = args.ratio
    for layout in layouts:
        for batch in args.batches:
            print(f"{layout:6s} batch {batch:4d}: {statistics.median(per_cpu[layout, batch]):9.1f} tokens/CPU-s "
                  f"{statistics.median(per_wall[layout, batch]):9.1f} tokens/wall-s")
        if small in args.batches and large in args.batches:
            ratio = statistics.median(per_cpu[layout, small]) / statistics.median(per_cpu[layout, large])
            print(f"{layout:6s} batch {small} / batch {large} tokens per CPU-second: {ratio:.2f}")

if __name__ == "__main__":
    main()
