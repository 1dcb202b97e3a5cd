"""Checkpoint save and load on two gloo ranks: gathered (trainer.checkpoint_format=full) vs sharded.

``full``: both ranks gather the whole model and the whole Adam state to rank 0, which writes HF
safetensors and ``optim.pt``. ``sharded``: each rank writes its own shards with
torch.distributed.checkpoint, nothing gathered (``hybridflow.training.sharded_checkpoint``).

Workload: a ~18M-parameter Qwen2 (the built-in tokenizer's vocabulary, 6 layers of width 512:
bench/ray_weight_sync.py's ``20m``), fp32, after one optimizer step so Adam's moments exist
(weights + two moments: ~218 MB in all, ~109 MB per rank's shard), FSDP2 over two gloo ranks, one
torch thread per rank, on the local disk. The formats alternate for ``--repeats`` rounds; each
round saves, then loads what it saved into the same engine.

Measured per rank: wall time of ``TrainEngine.save`` and ``TrainEngine.load`` (median over
rounds), and the peak extra memory of each: the process's peak RSS during the call (``VmHWM``
after resetting it through ``/proc/self/clear_refs``) minus its RSS just before (after
``malloc_trim``, so memory freed by the previous call is not counted as headroom). The shard is
this rank's model and optimizer tensors. Goal: a sharded save's extra memory <= one shard.

    python bench/checkpoint_sharded.py [--repeats 3] [--dir /tmp]

Prints one row per format and rank, then the ratios full / sharded (> 1: sharded is cheaper).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine

FORMATS = ("full", "sharded")
WORLD = 2
SPEC = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                     num_key_value_heads=2)
MIB = 1 << 20


def proc_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def reset_peak_rss() -> int:
    """Give freed heap back to the OS, reset the peak RSS to now; the RSS now in bytes."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return proc_kib("VmRSS") * 1024


def shard_bytes(engine: TrainEngine) -> int:
    """This rank's own model and optimizer tensors (DTensors count their local shard)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(t) for t in engine.model.state_dict().values()]
    tensors += [local(v) for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def populate_adam(engine: TrainEngine) -> None:
    """One optimizer step, so the optimizer state (two moments per parameter) exists."""
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(distributed.rank()))
    engine.model.train()
    engine.optimizer.zero_grad()
    engine.model(input_ids=ids).logits.float().square().mean().backward()
    engine.optimizer.step()
    engine.scheduler.step()


def timed(fn) -> float:
    distributed.barrier()
    start = time.perf_counter()
    fn()
    distributed.barrier()
    return time.perf_counter() - start


def rank_main(rank: int, port: int, root: str, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=WORLD, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        engine = TrainEngine(build_tiny_model(SPEC, seed=0), OptimSpec(lr=1e-4), torch.device("cpu"),
                             data_parallel=True)
        populate_adam(engine)
        results: dict[str, dict[str, list[float]]] = {
            f: {"save_s": [], "load_s": [], "extra": [], "load_extra": []} for f in FORMATS}
        for _ in range(repeats):
            for fmt in FORMATS:
                ckpt = Path(root, fmt)
                before = reset_peak_rss()
                results[fmt]["save_s"].append(timed(lambda: engine.save(ckpt, sharded=fmt == "sharded")))
                results[fmt]["extra"].append(proc_kib("VmHWM") * 1024 - before)
                before = reset_peak_rss()
                results[fmt]["load_s"].append(timed(lambda: engine.load(ckpt)))
                results[fmt]["load_extra"].append(proc_kib("VmHWM") * 1024 - before)
                distributed.barrier()
                if rank == 0:
                    shutil.rmtree(ckpt)
        out[rank] = {"results": results, "shard": shard_bytes(engine),
                     "params": sum(p.numel() for p in engine.model.parameters())}
    finally:
        distributed.dist.destroy_process_group()


def report(out: dict) -> None:
    print(f"{'format':>8} {'rank':>4} {'save s':>8} {'load s':>8} {'save peak extra MiB':>20} "
          f"{'load peak extra MiB':>20} {'shard MiB':>10}")
    medians = {}
    for fmt in FORMATS:
        for rank in range(WORLD):
            r = out[rank]["results"][fmt]
            row = {k: statistics.median(v) for k, v in r.items()}
            medians[fmt, rank] = row
            print(f"{fmt:>8} {rank:>4} {row['save_s']:8.3f} {row['load_s']:8.3f} {row['extra'] / MIB:20.1f} "
                  f"{row['load_extra'] / MIB:20.1f} {out[rank]['shard'] / MIB:10.1f}")
    print(f"params: {out[0]['params'] / 1e6:.1f}M (full size; each rank holds half)")
    for key, label in (("save_s", "save time"), ("load_s", "load time"), ("extra", "save peak extra memory"),
                       ("load_extra", "load peak extra memory")):
        ratios = [medians["full", r][key] / max(medians["sharded", r][key], 1e-9) for r in range(WORLD)]
        print(f"{label} full / sharded: rank 0 {ratios[0]:.2f}x, rank 1 {ratios[1]:.2f}x")
    worst = max(medians["sharded", r]["extra"] / out[r]["shard"] for r in range(WORLD))
    print(f"sharded save peak extra memory / one shard: {worst:.2f} (goal <= 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(rank_main, args=(distributed.free_port(), root, args.repeats, out), nprocs=WORLD, join=True)
            report(dict(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
