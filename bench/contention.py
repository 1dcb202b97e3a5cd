"""The default job on a machine that is not idle: seconds per step alone and beside busy processes.

Laptops and CI runners are rarely idle. A torch CPU job whose OpenMP threads outnumber the cores
it actually gets can collapse (an issue report: 1.2 s/step -> 16 s/step on 2 cores beside one
busy process), because every parallel region waits for its slowest thread, and a thread that
shares its core with a busy process waits for the scheduler. This benchmark measures it: the
default job (built-in model and task, 3 RL steps, ``hybridflow train``'s defaults otherwise) in
a subprocess, alone and beside ``--busy`` processes that spin on the CPU, for each variant, in
alternating order over ``--repeats`` rounds; it prints the median s/step and the slowdown
ratio (beside busy / alone) per variant.

Variants (``--variants``):

- ``default``: what a user gets, no settings: a fixed count by the machine's rule (every core
  but one in-process), recorded so reruns and resumes are bitwise equal.
- ``follow``: ``trainer.num_threads=follow``: every core, fewer while other processes keep cores
  busy (``hybridflow.utils.threads``).
- ``all_cores``: ``trainer.num_threads=<cores>``, a fixed count of every core.
- ``threads1``: ``trainer.num_threads=1``.
- ``passive``: all cores with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads sleep at barriers
  instead of spinning), the usual advice for oversubscribed machines; measured here because it
  is not the answer: it costs 1.6x alone (a futex wake per parallel region) on the built-in
  model.

The warm start is cached (``warm_start.cache_dir``, default the user's cache) before timing, so
the figures are of RL steps only. s/step is the median of ``timing_s/step`` over the job's steps.

    python bench/contention.py                       # default, follow, threads1; 1 busy process, 2 rounds
    python bench/contention.py --variants default follow --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CORES = len(os.sched_getaffinity(0))
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),
    "follow": ({}, ["trainer.num_threads=follow"]),
    "all_cores": ({}, [f"trainer.num_threads={CORES}"]),
    "threads1": ({}, ["trainer.num_threads=1"]),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, [f"trainer.num_threads={CORES}"]),
}
# A process that keeps one core busy, as another program on a laptop would.
BUSY_LOOP = "while True:\n    pass\n"


def train_command(out: Path, cache_dir: str, steps: int, overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "hybridflow.cli", "train", f"trainer.total_training_steps={steps}",
        f"warm_start.cache_dir={cache_dir}", f"trainer.output_dir={out}", "trainer.val_before_train=false",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.save_final=false", "trainer.logger=[jsonl]",
        "trainer.progress_bar=false", *overrides,
    ]


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment without thread settings (each variant sets its own)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_job(variant: str, busy: int, cache_dir: str, steps: int, work: Path) -> float:
    """Median s/step of one job, with ``busy`` spinning processes beside it."""
    env, overrides = VARIANTS[variant]
    out = Path(tempfile.mkdtemp(prefix=f"{variant}-{busy}-", dir=work))
    spinners = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0)
        done = subprocess.run(train_command(out, cache_dir, steps, overrides), env=clean_env(env),
                              capture_output=True, text=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    if done.returncode != 0:
        raise RuntimeError(f"{variant} (busy={busy}) failed:\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["timing_s/step"] for r in records if "timing_s/step" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["default", "follow", "threads1"], choices=list(VARIANTS))
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the job")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", default="~/.cache/hybridflow", help="warm_start.cache_dir")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="contention-"))
    print("warming the built-in model's cache (once) ...", flush=True)
    done = subprocess.run(train_command(work / "warm", args.cache_dir, 1, []), env=clean_env({}),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"warm-up run failed:\n{done.stderr[-4000:]}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"cpu: {cpu}, {os.cpu_count()} cores; job: built-in default, {args.steps} RL steps; "
          f"{args.busy} busy process(es); median over {args.repeats} alternating round(s)")

    results: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.repeats):
        for variant in args.variants:
            for busy in (0, args.busy):
                s = run_job(variant, busy, args.cache_dir, args.steps, work)
                results.setdefault((variant, busy), []).append(s)
                print(f"  round {round_ + 1}: {variant:16s} busy={busy}  {s:7.2f} s/step", flush=True)

    print(f"\n| variant | alone s/step | beside {args.busy} busy s/step | slowdown |")
    print("|---|---:|---:|---:|")
    for variant in args.variants:
        alone = statistics.median(results[(variant, 0)])
        busy = statistics.median(results[(variant, args.busy)])
        print(f"| {variant} | {alone:.2f} | {busy:.2f} | {busy / alone:.2f}x |")
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
