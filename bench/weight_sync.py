"""Weight sync time for the ~20M-parameter Qwen2-shaped model: in-process vs across 2 processes.

- ``in_process``: ``NativeEngine.update_weights(trainer.named_parameters())`` with the trainer
  model and the engine in one process (colocated roles).
- ``cross_process``: rank 0 holds the trainer model and runs ``send_weights``; rank 1 holds the
  engine and runs ``receive_weights(apply=engine.update_weights)``; a standalone gloo group on
  loopback (``WeightSyncGroup.connect``). Timed on the sender from the first header to the final
  verdict, i.e. until the receiver has applied every bucket.
- ``raw_broadcast`` (the transport bound): one gloo broadcast of a buffer the size of the weights,
  no manifest, no copies, no apply; ``cross/raw`` is what the protocol and the copies cost on top.

Each is timed per bucket size (``--bucket-mb``), one untimed warm-up then ``--repeats`` runs;
medians, and GB/s of weight bytes (fp32 trainer weights; the engine casts to ``--dtype``). The
in-process run uses ``--threads``; the two processes share the same cores, ``--threads // 2``
each by default.

    python bench/weight_sync.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.multiprocessing as mp
from rollout_long_tail import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model  # the ~20M shape, one definition

from hybridflow.rollout.native import NativeEngine
from hybridflow.rollout.weight_transfer import WeightSyncGroup, receive_weights, send_weights
from hybridflow.training.distributed import free_port

MB = 1024 * 1024


def build_engine(dtype: str) -> NativeEngine:
    return NativeEngine(
        model=build_model("qwen2-20m"), eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
        max_batch_size=8, dtype=dtype, kv_cache_memory_bytes=64 * MB,
    )


def trainer_weights() -> dict[str, torch.Tensor]:
    """The trainer's parameters (tied aliases once, as ``named_parameters`` lists them)."""
    return {name: p.detach() for name, p in build_model("qwen2-20m").named_parameters()}


def median_s(run: Callable[[], object], repeats: int, before: Callable[[], object] = lambda: None) -> float:
    """Median seconds of ``run`` after one untimed warm-up; ``before`` runs untimed before each."""
    before()
    run()
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(args: argparse.Namespace) -> dict[int, float]:
    weights, engine = trainer_weights(), build_engine(args.dtype)
    return {
        mb: median_s(partial(engine.update_weights, weights.items(), max_bucket_bytes=mb * MB), args.repeats)
        for mb in args.bucket_mb
    }


def cross_process_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(args.process_threads)
    group = WeightSyncGroup.connect(rank=rank, world_size=2, host="127.0.0.1", port=port)

    def barrier() -> None:  # both ranks start each timed run together
        group.all_gather_text(None)

    if rank == 0:
        results.put(sender_timings(group, args, barrier))
    else:
        run_receiver(group, args, barrier)
    group.close()


def sender_timings(group: WeightSyncGroup, args: argparse.Namespace, barrier: Callable[[], None]) -> dict[str, Any]:
    weights = trainer_weights()
    timings = {
        mb: median_s(partial(send_weights, group, weights.items(), mb * MB), args.repeats, barrier)
        for mb in args.bucket_mb
    }
    raw = torch.empty(group.broadcast_json(sum(t.numel() * t.element_size() for t in weights.values())), dtype=torch.uint8)
    return {"sync": timings, "raw": median_s(lambda: group.broadcast(raw), args.repeats, barrier)}


def run_receiver(group: WeightSyncGroup, args: argparse.Namespace, barrier: Callable[[], None]) -> None:
    """The sender's mirror image, call for call."""
    engine = build_engine(args.dtype)
    targets = engine.model.state_dict()
    for _ in args.bucket_mb:
        median_s(lambda: receive_weights(group, targets, engine.update_weights), args.repeats, barrier)
    raw = torch.empty(group.broadcast_json(), dtype=torch.uint8)
    median_s(lambda: group.broadcast(raw), args.repeats, barrier)


def cross_process(args: argparse.Namespace) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(cross_process_worker, args=(free_port(), args, results), nprocs=2, start_method="spawn")
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[4, 16, 32, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the in-process run")
    parser.add_argument(
        "--process-threads", type=int, default=None,
        help="threads of each of the 2 processes (default threads // 2: the two share the same cores; "
        "more oversubscribes them, and every parallel copy then waits for a descheduled thread)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the engine's dtype")
    args = parser.parse_args()
    args.process_threads = args.process_threads or max(1, args.threads // 2)
    torch.set_num_threads(args.threads)

    weights = trainer_weights()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    local = in_process(args)
    remote = cross_process(args)
    print(
        f"weights: qwen2-20m, {len(weights)} tensors, {total / 1e6:.1f} MB fp32 -> engine {args.dtype}; "
        f"{args.threads} threads in process, {args.process_threads} in each of 2 processes, median of {args.repeats}"
    )
    print(f"raw_broadcast (gloo, one buffer)      {remote['raw'] * 1e3:8.1f} ms  {total / remote['raw'] / 1e9:6.2f} GB/s")
    for mb in args.bucket_mb:
        ours, colocated = remote["sync"][mb], local[mb]
        print(f"bucket {mb:4d} MB  in_process           {colocated * 1e3:8.1f} ms  {total / colocated / 1e9:6.2f} GB/s")
        print(
            f"bucket {mb:4d} MB  cross_process        {ours * 1e3:8.1f} ms  {total / ours / 1e9:6.2f} GB/s  "
            f"cross/in_process {ours / colocated:5.2f}x  cross/raw {ours / remote['raw']:5.2f}x"
        )


if __name__ == "__main__":
    main()
