"""Step time of the same one-rank RL job: in-process worker groups vs the Ray backend.

Workload: a random-init tiny model (``TinyModelSpec``) on the built-in arithmetic task files,
``--prompts`` prompts x ``--n`` samples per step, ``--steps`` steps, one torch thread, no
checkpoint. Both runs share the seed, so they draw the same samples and do the same math; the
Ray run adds what the backend costs: a process per role (actor, rollout), arguments and results
through Ray's object store, the weights crossing two process boundaries at every sync. Step 1
(warm-up: first forwards, Ray workers' first calls) is left out. The backends alternate for
``--repeats`` runs each (the Ray cluster is started once and reused), and the median over all
timed steps is compared, so load from other processes hits both sides alike.

    python bench/ray_overhead.py --steps 6 --repeats 2

Prints median seconds per step and per phase for each backend and the ratio ray / local
(1.0 means no overhead). Start-up (Ray cluster, rank processes) is reported separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridflow import api
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

PHASES = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights", "timing_s/old_log_prob")


def run(backend: str, out: Path, model_dir: Path, train: Path, val: Path,
        args: argparse.Namespace) -> tuple[list[dict[str, float]], float]:
    """Each timed step's phase times (steps 2..N) and the whole run's wall time."""
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={out}", f"trainer.backend={backend}", f"data.train_batch_size={args.prompts}",
        # Two mini-batches per step: the old-logprob pass runs too.
        f"actor.ppo_mini_batch_size={args.prompts // 2}",
        f"actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n // 2}",
        f"rollout.n={args.n}", f"data.max_response_length={args.max_tokens}",
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_final=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        # A process per role, what this measures (and docs/figures.md records); the default shares one process
        # per bundle (trainer.hybrid_engine, bench/hybrid_engine.py), and a local run ignores the key.
        "trainer.hybrid_engine=false",
    ]
    start = time.perf_counter()
    api.train(api.make_config("grpo", overrides=overrides))
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("training/global_step", 0) >= 2]
    return [{p: r[p] for p in PHASES if p in r} for r in timed], wall


def _medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median of each phase over the steps that timed it."""
    phases = [p for p in PHASES if any(p in step for step in steps)]
    return {p: statistics.median(step[p] for step in steps if p in step) for p in phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs per backend, alternating")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is the untimed warm-up)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_tiny_model(root / "model")
        train, val = write_arithmetic_task(root / "data", train_size=max(64, args.prompts * args.steps), val_size=4)
        steps: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
        walls: dict[str, list[float]] = {"local": [], "ray": []}
        for repeat in range(args.repeats):
            for backend in ("local", "ray"):
                timed, wall = run(backend, root / f"{backend}-{repeat}", model_dir, train, val, args)
                steps[backend] += timed
                walls[backend].append(wall)
    local, ray = (_medians(steps[backend]) for backend in ("local", "ray"))
    print(f"\none-rank job, {args.prompts} prompts x {args.n} samples, {args.repeats} x {args.steps - 1} timed "
          f"steps per backend (median s):")
    print(f"{'phase':<26}{'local':>10}{'ray':>10}{'ray/local':>11}")
    for phase in PHASES:
        if phase in local and phase in ray:
            ratio = ray[phase] / local[phase] if local[phase] > 0 else float("nan")
            print(f"{phase:<26}{local[phase]:>10.4f}{ray[phase]:>10.4f}{ratio:>10.2f}x")
    print(f"whole run incl. start-up (first run; later Ray runs reuse the cluster): local {walls['local'][0]:.1f} s, "
          f"ray {walls['ray'][0]:.1f} s")
    print(f"step-time ratio ray / local: {ray['timing_s/step'] / local['timing_s/step']:.2f}x "
          f"({ray['timing_s/step'] - local['timing_s/step']:+.3f} s/step)")


if __name__ == "__main__":
    main()
