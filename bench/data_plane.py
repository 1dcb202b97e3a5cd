"""What passes through the controller's process in fully async training on Ray: the default data
plane (trajectories come back to the controller, which scores, queues and collates them and
ships each actor rank its padded shard) against the by-reference one
(``trainer.data_plane=refs``: the replica scores each group and keeps its tokens in Ray's
object store, the controller holds records, each rank fetches its shard's tokens).

Workload: a random-init tiny model (it rarely stops: responses run to ``--max-tokens``) on the
built-in arithmetic task files, ``--prompts`` prompts x ``--n`` samples a step, ``--ranks`` actor
ranks with one rollout replica each, staleness 1, one torch thread per process. Both runs share
the seed and do the same math.

The controller's traffic is counted in this process, where the controller runs: every result
it takes from a Ray call (``ray.get``), every argument it sends (inline or ``ray.put``), sized as
the data they hold (tensor bytes, 8 bytes a list element of token ids and logprobs, the length of
strings; an object reference counts 28 bytes). Weight syncs are left out (broadcast from actor
rank 0: not through the controller).

    python bench/data_plane.py --steps 4 --max-tokens 256 --repeats 2

The planes alternate for ``--repeats`` runs each on one Ray cluster. Prints per step, for each
plane: bytes into and out of the controller, the step time (each run's median over its steps
2..N, then the median over runs), and the ratios controller / refs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow import api
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

REF_BYTES = 28  # a Ray object id


def data_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """The data ``obj`` holds, as bytes: what pickling it across a process boundary carries, less
    Python's per-object overhead (the same rule for both planes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if type(obj).__name__ == "ObjectRef":
        return REF_BYTES
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (int, float, bool)) or obj is None:
        return 8
    if isinstance(obj, (str, bytes)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(data_bytes(k, seen) + data_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(data_bytes(x, seen) for x in obj)
    if dataclasses.is_dataclass(obj):
        return sum(data_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if hasattr(obj, "__dict__"):
        return sum(data_bytes(v, seen) for v in vars(obj).values())
    return 8


class Traffic:
    """Counts the data crossing this (the controller's) process boundary through Ray calls."""

    def __init__(self) -> None:
        self.received = self.sent = 0

    def install(self) -> None:
        import ray

        from hybridflow.cluster import ray_group

        get, put, submit = ray.get, ray.put, ray_group.RayWorkerGroup._submit
        traffic = self

        def counted_get(refs: Any, *args: Any, **kwargs: Any) -> Any:
            value = get(refs, *args, **kwargs)
            traffic.received += data_bytes(value)
            return value

        def counted_put(value: Any, *args: Any, **kwargs: Any) -> Any:
            traffic.sent += data_bytes(value)
            return put(value, *args, **kwargs)

        def counted_submit(group: Any, calls: list[tuple[int, Any]], method: Any) -> Any:
            traffic.sent += sum(data_bytes(payload) for _, payload in calls)  # a ray.put payload counts REF_BYTES
            return submit(group, calls, method)

        ray.get, ray.put = counted_get, counted_put
        ray_group.RayWorkerGroup._submit = counted_submit  # type: ignore[method-assign]


def run(plane: str, out: Path, files: list[str], args: argparse.Namespace, traffic: Traffic) -> dict[str, float]:
    overrides = [
        *files, f"trainer.output_dir={out}", "trainer.backend=ray", f"trainer.n_workers={args.ranks}",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n // args.ranks}", f"rollout.n={args.n}",
        f"data.max_response_length={args.max_tokens}", f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_final=false", "trainer.num_threads=1",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.mode=fully_async",
        "async_training.staleness_threshold=1", f"trainer.data_plane={plane}", "rollout.dtype=float32",
    ]
    before_in, before_out = traffic.received, traffic.sent
    start = time.perf_counter()
    api.train(api.make_config("grpo", overrides=overrides))
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["response_length/mean"] * args.prompts * args.n for r in records)
    return {
        "in_per_step": (traffic.received - before_in) / args.steps,
        "out_per_step": (traffic.sent - before_out) / args.steps,
        "step_s": statistics.median(r["timing_s/step"] for r in records if r["training/global_step"] >= 2),
        "wall_s": wall, "response_tokens_per_step": tokens / args.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="data_plane_"))
    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=max(64, args.prompts * (args.steps + 2)), val_size=4)
    files = [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]
    import ray

    ray.init(num_cpus=2 * args.ranks + 2, include_dashboard=False, log_to_driver=False)
    traffic = Traffic()
    traffic.install()
    runs: dict[str, list[dict[str, float]]] = {"controller": [], "refs": []}
    for repeat in range(args.repeats):
        for plane in runs:
            runs[plane].append(run(plane, root / f"{plane}{repeat}", files, args, traffic))
    results = {plane: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for plane, rs in runs.items()}
    print(f"fully async on Ray, {args.ranks} actor ranks + {args.ranks} replicas, {args.prompts} prompts x {args.n}, "
          f"max {args.max_tokens} tokens, {args.steps} steps, {args.repeats} run(s) each")
    for plane, r in results.items():
        print(f"  {plane:10s}: {r['in_per_step'] / 1e6:8.3f} MB in, {r['out_per_step'] / 1e6:8.3f} MB out of the "
              f"controller per step ({r['response_tokens_per_step']:.0f} response tokens); step {r['step_s']:.2f} s "
              f"(median), run {r['wall_s']:.1f} s")
    c, f = results["controller"], results["refs"]
    print(f"  controller / refs: {c['in_per_step'] / max(f['in_per_step'], 1):.1f}x in, "
          f"{c['out_per_step'] / max(f['out_per_step'], 1):.1f}x out, step time {c['step_s'] / f['step_s']:.2f}x")


if __name__ == "__main__":
    main()
