"""Can one rollout replica, running alone in its process, use a second core? Two ways, against one engine on
one torch thread, on the same requests (each request seeded, so every way must give the same samples):

- ``threads``: the same engine with 2 torch intra-op threads (each op split over the cores);
- ``engines``: two engines in two Python threads, half the requests each, one torch thread each (what two
  replicas in one process would do; the GIL is held between ops).

This is issue 35's "use the second core when one replica runs alone". The engines decode one token a row
per step, and at a long tail's batch sizes a step is ~250 small ops. A thread team's fork and join, or the
GIL handed between two Python threads, costs about as much as each op's work. Replicas in processes of their
own (``bench/rollout_replicas.py``) share neither.

    python bench/lone_replica_cores.py --model qwen2-20m --batches 8 32 128
    python bench/lone_replica_cores.py --model tiny --batches 8 32 128

Wall-clock ratios: run it on an idle machine (it says the load average). Two threads on a core that
another process keeps busy are several times slower (``bench/contention.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
from rollout_compute_bound import build_prompts
from rollout_long_tail import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model

from hybridflow.inference.native import NativeEngine
from hybridflow.rollout.base import choose_rollout_dtype
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory
from hybridflow.utils.device import cpu_features


def engine(model: str, dtype: str, rows: int) -> NativeEngine:
    return NativeEngine(model=build_model(model), eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                        max_batch_size=rows, dtype=dtype, seed=0)


def outputs(results: list[list[Trajectory]]) -> list[tuple[list[int], list[float]]]:
    return [(t.response_ids, t.rollout_logprobs) for group in results for t in group]


def on_threads(requests: list[GenerationRequest], jobs: list[tuple[NativeEngine, slice]],
               torch_threads: int = 1) -> list[list[Trajectory]]:
    """Each (engine, its share of ``requests``) in a Python thread of its own with ``torch_threads``."""
    results: list[list[list[Trajectory]]] = [[] for _ in jobs]

    def work(index: int, eng: NativeEngine, share: slice) -> None:
        # torch's count is per OS thread, and the engine runs its steps on threads it starts from this one.
        torch.set_num_threads(torch_threads)
        results[index] = eng.generate_batch(requests[share])

    threads = [threading.Thread(target=work, args=(i, eng, share)) for i, (eng, share) in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [group for part in results for group in part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2-20m", choices=("qwen2-20m", "tiny"))
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one untimed (medians)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dtype = choose_rollout_dtype("auto", torch.device("cpu"), model=build_model(args.model)).dtype
    print(f"cpu: {cpu_features().describe()}; {os.cpu_count()} cores; load average (1 min) "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"{args.model} {dtype} (rollout.dtype=auto), {args.max_tokens} tokens a row, medians of {args.repeats}")
    loads = []
    for batch in args.batches:
        requests = [GenerationRequest(prompt_ids=prompt, request_id=str(i),
                                      params=SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                                            ignore_eos=True, logprobs=0, seed=i))
                    for i, prompt in enumerate(build_prompts(batch, 16))]
        one, first, second = engine(args.model, dtype, batch), engine(args.model, dtype, batch // 2), \
            engine(args.model, dtype, batch - batch // 2)
        half = batch // 2
        ways = {
            "1 thread": lambda: on_threads(requests, [(one, slice(None))]),
            "2 threads": lambda: on_threads(requests, [(one, slice(None))], torch_threads=2),
            "2 engines": lambda: on_threads(requests, [(first, slice(0, half)), (second, slice(half, None))]),
        }
        walls: dict[str, list[float]] = {name: [] for name in ways}
        cpus: dict[str, list[float]] = {name: [] for name in ways}
        samples = {}
        for round_ in range(args.repeats + 1):
            for name, run in ways.items():  # interleaved, so a change of load hits every way alike
                cpu, wall = time.process_time(), time.perf_counter()
                got = run()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if round_:
                    walls[name].append(wall)
                    cpus[name].append(cpu)
                else:
                    samples[name] = outputs(got)
        loads.append(os.getloadavg()[0])
        base = statistics.median(walls["1 thread"])
        parts = []
        for name in ways:
            wall = statistics.median(walls[name])
            parts.append(f"{name} {batch * args.max_tokens / wall:7.0f} tokens/s ({base / wall:.2f}x, "
                         f"CPU/wall {statistics.median(cpus[name]) / wall:.2f})")
        differ = [name for name in ways if samples[name] != samples["1 thread"]]
        same = "every way" if not differ else f"NOT in {differ}"
        print(f"batch {batch:4d}: " + "; ".join(parts) + f"; same samples as 1 thread: {same}", flush=True)
    print(f"load average (1 min) after each batch size: {', '.join(f'{x:.2f}' for x in loads)}")


if __name__ == "__main__":
    main()
