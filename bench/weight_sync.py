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

``--sharded`` (issue 15, item 6): the same model sharded with FSDP2 over 2 gloo trainer ranks
(``TrainEngine(data_parallel=True)``), streaming to 1 and to 2 receiving processes (each copies
into a plain model's ``state_dict``, no rollout engine). Two sender paths, alternated run by run:

- ``old``: ``engine.named_weights()`` gathers the whole model onto rank 0 (``get_model_state_dict``),
  then ``send_weights`` streams that list;
- ``new``: ``hybridflow.workers.weight_stream.stream_weights``: buckets planned from the shards' full
  shapes, every sharded tensor as row slices cut at the shard boundaries (and at most a bucket:
  the embedding is larger), each sent to rank 0 by the rank whose shard holds it only when the
  sender asks for it.

Reported per receiver count and bucket size: seconds per sync (rank 0, from the start of the
gather to the receivers' last verdict) and per GB sent, and how much of it rank 0 spent gathering
(summed over the gathers; for ``old`` the whole ``named_weights`` call); the sender's peak extra memory over the
model's parameter bytes, measured as the RSS high-water mark during the sync minus the RSS before
it (``/proc/self/clear_refs`` resets ``VmHWM`` just before). Torch's CPU tensors are invisible to
tracemalloc, and RSS is what the machine pays; glibc is told to serve every block of 128 KiB or
more by mmap (``MALLOC_MMAP_THRESHOLD_``, set before the processes start), so a freed tensor leaves
RSS at once and the next sync's baseline is not inflated by memory kept for reuse. For the new
path the bytes of gathered full tensors alive at once are also counted exactly (a finalizer per
tensor returned by ``distributed.gather_weight`` or ``distributed.gather_rows``): the part of the
peak that the design bounds.
Every process runs 1 torch thread.

    python bench/weight_sync.py --sharded --bucket-mb 4 32 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.multiprocessing as mp
from rollout_long_tail import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model  # the ~20M shape, one definition

from hybridflow.inference.native import NativeEngine
from hybridflow.transfer.weight_transfer import WeightSyncGroup, receive_weights, send_weights
from hybridflow.training import distributed
from hybridflow.training.distributed import free_port

SHARDED_TRAINER_RANKS = 2
# glibc serves blocks from this size by mmap, returned to the OS on free: RSS then tracks live memory.
MALLOC_MMAP_THRESHOLD = 128 * 1024

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


# ------------------------------------------------------------------------------------ sharded
def memory_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (``clear_refs`` 5) and return that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return memory_kib("VmRSS")


class GatheredBytes:
    """Bytes of gathered full tensors and received row slices alive at once (peak), from
    ``distributed.gather_weight`` and ``distributed.gather_rows``, and the seconds spent in them."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.seconds = 0.0
        self._gather = distributed.gather_weight
        self._gather_rows = distributed.gather_rows
        distributed.gather_weight = self._counted
        distributed.gather_rows = self._counted_rows

    def reset(self) -> None:
        self.peak, self.seconds = self.live, 0.0

    def _counted(self, value: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        full = self._gather(value)
        self.seconds += time.perf_counter() - start
        return self._count(full)

    def _counted_rows(self, value: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor | None:
        start = time.perf_counter()
        data = self._gather_rows(value, rows)
        self.seconds += time.perf_counter() - start
        return None if data is None else self._count(data)

    def _count(self, full: torch.Tensor) -> torch.Tensor:
        nbytes = full.numel() * full.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(full, self._freed, nbytes)
        return full

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def sharded_worker(index: int, ports: tuple[int, int], receivers: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    world = 1 + receivers
    if index >= SHARDED_TRAINER_RANKS:
        group = WeightSyncGroup.connect(rank=index - SHARDED_TRAINER_RANKS + 1, world_size=world, host="127.0.0.1",
                                        port=ports[1])
        targets = build_model("qwen2-20m").state_dict()
        for _ in range(len(args.bucket_mb) * 2 * (args.repeats + 1)):
            group.all_gather_text(None)  # every run starts together
            receive_weights(group, targets)
        group.close()
        return
    sharded_trainer(index, ports, world, args, results)


def sharded_trainer(rank: int, ports: tuple[int, int], world: int, args: argparse.Namespace, results: Any) -> None:
    from hybridflow.training.engine import TrainEngine
    from hybridflow.workers.weight_stream import stream_weights

    distributed.init_process_group(rank=rank, world_size=SHARDED_TRAINER_RANKS, master_addr="127.0.0.1",
                                   master_port=ports[0], device=torch.device("cpu"))
    engine = TrainEngine(build_model("qwen2-20m"), None, torch.device("cpu"), data_parallel=True)
    group = WeightSyncGroup.connect(rank=0, world_size=world, host="127.0.0.1", port=ports[1]) if rank == 0 else None
    counter = GatheredBytes()

    def old(bucket_bytes: int) -> None:
        start = time.perf_counter()
        weights = engine.named_weights()  # the whole model on rank 0, [] on rank 1
        counter.seconds = time.perf_counter() - start
        if group is not None:
            send_weights(group, weights, bucket_bytes)

    def new(bucket_bytes: int) -> None:
        stream_weights(engine, rank, group, bucket_bytes)

    rows: dict[tuple[int, str], dict[str, list[float]]] = {}
    for mb in args.bucket_mb:
        for repeat in range(args.repeats + 1):  # the first of each path is an untimed warm-up
            order = (old, new) if repeat % 2 else (new, old)  # alternated, so drift hits both alike
            for path in order:
                distributed.barrier()
                if group is not None:
                    group.all_gather_text(None)
                baseline = reset_peak_rss()
                counter.reset()
                start = time.perf_counter()
                path(mb * MB)
                seconds = time.perf_counter() - start
                extra = (memory_kib("VmHWM") - baseline) * 1024
                if repeat:
                    row = rows.setdefault((mb, path.__name__), {"s": [], "extra": [], "gathered": [], "gather_s": []})
                    row["s"].append(seconds)
                    row["gather_s"].append(counter.seconds)
                    row["extra"].append(extra)
                    row["gathered"].append(counter.peak)
    summary = {f"{mb}:{name}": {k: statistics.median(v) for k, v in row.items()} for (mb, name), row in rows.items()}
    results.put((rank, summary))
    if group is not None:
        group.close()
    distributed.barrier()


def sharded(args: argparse.Namespace, receivers: int) -> dict[int, dict[str, dict[str, float]]]:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    ports = (free_port(), free_port())
    mp.start_processes(sharded_worker, args=(ports, receivers, args, results), nprocs=SHARDED_TRAINER_RANKS + receivers,
                       start_method="spawn")
    return dict(results.get() for _ in range(SHARDED_TRAINER_RANKS))


def main_sharded(args: argparse.Namespace) -> None:
    model = build_model("qwen2-20m")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    sent_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # what a sync moves
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    del model
    print(f"weights: qwen2-20m, {param_bytes / 1e6:.1f} MB fp32 parameters ({sent_bytes / 1e6:.1f} MB per sync: the "
          f"tied LM head is sent under both names; largest tensor {largest / 1e6:.1f} MB), FSDP2 over "
          f"{SHARDED_TRAINER_RANKS} gloo ranks, 1 thread per process, median of {args.repeats}")
    print("extra = RSS high-water during the sync - RSS before it; /model = over the parameter bytes; "
          "gathered = gathered full tensors and row slices alive at once (new path, counted exactly)")
    header = (f"{'recv':>4} {'bucket':>7} {'path':>4} {'s/sync':>7} {'s/GB':>6} {'gather s':>8} {'rank0 extra':>12} "
              f"{'/model':>7} {'rank1 extra':>12} {'gathered':>9} {'/model':>7}")
    print(header)
    for receivers in args.receivers:
        ranks = sharded(args, receivers)
        for mb in args.bucket_mb:
            cells = {}
            for name in ("old", "new"):
                r0, r1 = ranks[0][f"{mb}:{name}"], ranks[1][f"{mb}:{name}"]
                cells[name] = r0
                gathered = f"{r0['gathered'] / MB:7.1f}MB {r0['gathered'] / param_bytes:7.3f}" if name == "new" else ""
                print(f"{receivers:>4} {mb:>5}MB {name:>4} {r0['s']:7.3f} {r0['s'] / (sent_bytes / 1e9):6.2f} "
                      f"{r0['gather_s']:8.3f} {r0['extra'] / MB:10.1f}MB {r0['extra'] / param_bytes:7.3f} {r1['extra'] / MB:10.1f}MB {gathered}")
            old, new = cells["old"], cells["new"]
            print(f"{receivers:>4} {mb:>5}MB new/old: time {new['s'] / old['s']:.2f}x, rank-0 extra memory "
                  f"{new['extra'] / max(old['extra'], 1):.2f}x")


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
    parser.add_argument("--sharded", action="store_true",
                        help="2 FSDP2 trainer ranks to 1 and 2 receivers: full gather then stream vs lockstep stream")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2], help="receiver counts of --sharded")
    args = parser.parse_args()
    if args.sharded:
        # Read by glibc at process start: the spawned processes inherit it.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
        main_sharded(args)
        return
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
