"""Decode throughput against batch size: what the fixed per-step cost does to a long tail's last rows.

At the end of a long tail the native engine decodes a handful of rows; every step then pays its
fixed cost (Python scheduling, small tensor allocations, sampling bookkeeping) over few tokens.
This bench runs a random-weight model (``--model qwen2-20m``: the ~20M Qwen2 shape of
``rollout_long_tail.py``; ``--model tiny``: the built-in ~0.9M model) at each ``--batches`` size
(prompts of ``--prompt-tokens`` random tokens, ``--max-tokens`` sampled tokens each with
``ignore_eos``, one engine sized for the largest batch) and prints tokens per CPU-second
(``time.process_time``: fair on a machine other processes load) and per wall-second, medians
over ``--repeats`` runs interleaved across batch sizes, and the ratio of the smallest-but-one
batch (8 by default) to the largest. The decode steps dominate: prefill is one step of 16 tokens
a row against ``--max-tokens`` decode steps. ``--dtype auto`` is what ``rollout.dtype=auto`` picks
for the model on this CPU (the default run's precision).

Beside each run, the matmuls alone: one decode step's matmuls (every layer's q/k/v, o, gate/up and
down projections and the LM head, at the engine's weights and layout, on random inputs of the
batch's rows) timed in CPU-seconds. Their tokens per CPU-second bound what a decode step can reach
at that batch, whatever the rest of the step costs; at batch 8 they read every weight from memory
for 8 rows. The bound on the ratio is the batch-8 matmuls' rate over the engine's measured rate at
the largest batch.

    python bench/decode_batch_scaling.py --threads 1
    python bench/decode_batch_scaling.py --threads 1 --dtype auto --weight-layouts dense onednn panels
    python bench/decode_batch_scaling.py --threads 1 --profile 8   # cProfile of one batch-8 run
    python bench/decode_batch_scaling.py --threads 1 --dtype auto --phases 8   # CPU-ms per step by phase
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from rollout_compute_bound import build_prompts, engine_run
from rollout_long_tail import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model

from hybridflow.inference.compact import WEIGHT_LAYOUTS, CompactCausalLM, resolve_weight_layout
from hybridflow.inference.native import NativeEngine, resolve_dtype
from hybridflow.rollout.base import choose_rollout_dtype
from hybridflow.utils.device import cpu_features

WARM_UP_TOKENS = 8
# Timed calls of the matmul-only step per measurement (its median is taken).
MATMUL_CALLS = 10


def timed(run) -> tuple[int, float, float]:
    """(tokens, CPU seconds of the whole process, wall seconds) of one run."""
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = run()
    return tokens, time.process_time() - cpu, time.perf_counter() - wall


def build_engine(model: str, dtype: str, batch: int, weight_layout: str) -> NativeEngine:
    return NativeEngine(model=build_model(model), eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                        max_batch_size=batch, dtype=dtype, seed=0, weight_layout=weight_layout)


def matmul_step(compact: CompactCausalLM, batch: int) -> Callable[[], None]:
    """One decode step's matmuls at ``batch`` rows, on the engine's weights in its layout (module docstring)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, compact.embed.shape[1], generator=generator).to(compact.dtype)
    inner = torch.randn(batch, compact.shape.intermediate_size, generator=generator).to(compact.dtype)
    attended = torch.randn(batch, compact.shape.num_heads * compact.shape.head_dim, generator=generator).to(compact.dtype)
    packed = compact._packed or [None] * compact.num_layers

    def run() -> None:
        for layer, pack in zip(compact.layers, packed, strict=True):
            compact._linear(x, layer.qkv_weight, layer.qkv_bias, pack and pack.qkv)
            compact._add_linear_(x.clone(), attended, layer.o_weight, layer.o_bias, pack and pack.o)
            compact._linear(x, layer.gate_up_weight, layer.gate_up_bias, pack and pack.gate_up)
            compact._add_linear_(x.clone(), inner, layer.down_weight, layer.down_bias, pack and pack.down)
        compact._linear(x, compact.lm_head, None, compact._packed_lm_head)

    return run


def matmul_seconds(run: Callable[[], None]) -> float:
    """CPU-seconds of one call of ``run``: the median over ``MATMUL_CALLS`` timed calls after one untimed."""
    run()
    seconds = []
    for _ in range(MATMUL_CALLS):
        start = time.process_time()
        run()
        seconds.append(time.process_time() - start)
    return statistics.median(seconds)


# What --phases times: (owner, attribute, label). Nested phases are indented under the one that calls them.
PHASES = (
    ("scheduler.Scheduler", "plan", "plan the step (Python)"),
    ("runner.ModelRunner", "execute", "run the step (moves, prefill, decode)"),
    ("runner.ModelRunner", "_decode", "  decode (forward + sampling)"),
    ("compact.CompactCausalLM", "forward", "  forwards (the prefill's too)"),
    ("compact.CompactCausalLM", "_linear", "    matmuls: q/k/v, gate/up, head"),
    ("compact.CompactCausalLM", "_add_linear_", "    matmuls: o, down (+ residual)"),
    ("compact.CompactCausalLM", "_attend", "    attention (q.K, softmax, p.V)"),
    ("compact.CompactCausalLM", "_rms_norm", "    RMS norms"),
    ("compact", "_rotate", "    rotary"),
    ("compact.CompactCausalLM", "_activate_", "    MLP activation"),
    ("runner", "sample_tokens", "  sampling (full vocabulary)"),
    ("runner.RowState", "sampling", "  per-row sampling tensors"),
    ("runner.RowState", "advance", "  per-row state update"),
    ("native.NativeEngine", "_apply", "record tokens, finish rows (Python)"),
)


def phase_run(run, steps_of: Callable[[], int]) -> None:
    """CPU-milliseconds per decode step in each phase of ``PHASES`` over one run (steps inline, as in
    ``profile_run``; ``time.thread_time``, so other processes' load does not count)."""
    import importlib
    from collections import defaultdict
    from unittest import mock

    spent: dict[str, float] = defaultdict(float)

    def timed_call(function, label):
        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] += time.thread_time() - start
        return call

    async def inline(function, *args):
        return function(*args)

    patches = [mock.patch("asyncio.to_thread", inline)]
    for owner, attribute, label in PHASES:
        module, _, cls = owner.partition(".")
        target = importlib.import_module(f"hybridflow.inference.{module}")
        target = getattr(target, cls) if cls else target
        patches.append(mock.patch.object(target, attribute, timed_call(getattr(target, attribute), label)))
    for patch in patches:
        patch.start()
    try:
        steps = steps_of()
        start = time.thread_time()
        run()
        total = time.thread_time() - start
        steps = steps_of() - steps
    finally:
        for patch in reversed(patches):
            patch.stop()
    print(f"{steps} steps, {total / steps * 1e3:.2f} CPU-ms a step (load average {os.getloadavg()[0]:.1f})")
    for _, _, label in PHASES:
        print(f"  {label:38s} {spent[label] / steps * 1e3:7.3f} ms  {spent[label] / total:6.1%}")


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
    parser.add_argument("--model", default="qwen2-20m", choices=("qwen2-20m", "tiny"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="auto: what rollout.dtype=auto picks for --model on this CPU")
    parser.add_argument("--weight-layouts", nargs="+", default=["auto"], choices=WEIGHT_LAYOUTS,
                        help="one engine each, interleaved with the others")
    parser.add_argument("--ratio", type=int, nargs=2, default=[8, 128], metavar=("SMALL", "LARGE"))
    parser.add_argument("--profile", type=int, default=0, metavar="BATCH",
                        help="cProfile one run at BATCH (first layout) instead of measuring")
    parser.add_argument("--phases", type=int, default=0, metavar="BATCH",
                        help="CPU time per step by phase of one run at BATCH (each layout) instead of measuring")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    choice = choose_rollout_dtype(args.dtype, "cpu", model=build_model(args.model), batch=max(args.batches))
    dtype = resolve_dtype(choice.dtype)
    layouts = list(dict.fromkeys(resolve_weight_layout(w, "cpu", dtype) for w in args.weight_layouts))
    prompts = build_prompts(max(args.batches), args.prompt_tokens)
    engines = {layout: build_engine(args.model, choice.dtype, max(args.batches), layout) for layout in layouts}
    for engine in engines.values():
        engine_run(engine, prompts, WARM_UP_TOKENS)  # KV cache sizing, first-call allocations
    if args.profile:
        profile_run(lambda: engine_run(engines[layouts[0]], prompts[: args.profile], args.max_tokens))
        return
    if args.phases:
        for layout, engine in engines.items():
            print(f"{args.model} {choice.dtype}, {layout} weights, decode_mode {engine.decode_mode}, batch {args.phases}:")
            engine_run(engine, prompts[: args.phases], args.max_tokens)  # this batch's first-call costs
            phase_run(lambda: engine_run(engine, prompts[: args.phases], args.max_tokens),
                      lambda: engine.stats.steps)
        return
    matmuls = {(w, b): matmul_step(engines[w]._runner.compact, b) for w in layouts for b in args.batches}
    per_cpu = {(w, b): [] for w in layouts for b in args.batches}
    per_wall = {(w, b): [] for w in layouts for b in args.batches}
    matmul_rate = {(w, b): [] for w in layouts for b in args.batches}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):  # interleaved, so a burst of load hits every size and layout alike
        for layout, engine in engines.items():
            for batch in args.batches:
                tokens, cpu, wall = timed(lambda: engine_run(engine, prompts[:batch], args.max_tokens))
                per_cpu[layout, batch].append(tokens / cpu)
                per_wall[layout, batch].append(tokens / wall)
                matmul_rate[layout, batch].append(batch / matmul_seconds(matmuls[layout, batch]))
        loads.append(os.getloadavg()[0])
    print(f"cpu: {cpu_features().describe()}; {os.cpu_count()} cores; load average (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f} during the runs")
    print(f"{args.model} {choice.dtype} (--dtype {args.dtype}: {choice.reason}), decode_mode "
          f"{next(iter(engines.values())).decode_mode}, {args.threads} thread(s), prompt {args.prompt_tokens}, "
          f"{args.max_tokens} tokens a row, median of {args.repeats}")
    small, large = args.ratio
    median = statistics.median
    for layout in layouts:
        for batch in args.batches:
            print(f"{layout:6s} batch {batch:4d}: {median(per_cpu[layout, batch]):9.1f} tokens/CPU-s "
                  f"{median(per_wall[layout, batch]):9.1f} tokens/wall-s; matmuls alone "
                  f"{median(matmul_rate[layout, batch]):9.1f} tokens/CPU-s")
        if small in args.batches and large in args.batches:
            ratio = median(per_cpu[layout, small]) / median(per_cpu[layout, large])
            bound = median(matmul_rate[layout, small]) / median(per_cpu[layout, large])
            matmul_ratio = median(matmul_rate[layout, small]) / median(matmul_rate[layout, large])
            print(f"{layout:6s} batch {small} / batch {large} tokens per CPU-second: {ratio:.2f} (the batch-{small} "
                  f"matmuls alone / the engine at {large}: {bound:.2f}; matmuls alone at both: {matmul_ratio:.2f})")


if __name__ == "__main__":
    main()
