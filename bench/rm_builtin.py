"""``hybridflow rm``'s figure on the built-in pairs: the held-out pair accuracy of the command a user runs
(no arguments: 100 steps of 32 pairs from the built-in teacher), and the CPU-seconds it took.

The run is the CLI itself in a child process with one torch thread (``OMP_NUM_THREADS=1``,
``trainer.num_threads=1``); its CPU time is the child's user + system time, so it includes the start-up
and, on a first run on a machine, the warm start, teacher and pairs it builds and caches (run it twice
for the cached figure). ``--min`` turns it into a check: exit 1 when the accuracy is below it.

    python bench/rm_builtin.py                     # the default command: 0.832 at step 100, ~32 CPU-s (bf16-mixed)
    python bench/rm_builtin.py model.dtype=float32 # 0.852, ~45 CPU-s; the figures below are float32's
    python bench/rm_builtin.py rm.head_lr=null     # any override, e.g. the body's lr for the head too
    python bench/rm_builtin.py rm.builtin_prompts=4096 trainer.total_training_steps=300   # 0.871, ~100 CPU-s

(Intel Xeon with avx512_bf16/AMX, where model.dtype=auto is bf16-mixed; cached warm start, teacher and pairs;
docs/guide.md has the rest.) On an AMD EPYC Zen 4, whose warm start and so pairs differ (mostly one-digit
slips), the default command ranks 0.629 bf16-mixed, 0.652 float32, and the recipe that reaches 0.90 there is
hybridflow rm's preset: two added layers, all questions and 1,000 steps in float32 (0.949/0.918/0.922 at step
1000 over seeds 1/2/3, ~390 CPU-s; bf16-mixed learns the slips later: 0.785 at step 700 where float32 is at 0.879):

    python bench/rm_builtin.py --preset builtin trainer.seed=1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="hybridflow rm overrides (default: none)")
    parser.add_argument("--min", type=float, default=None, help="fail (exit 1) below this held-out accuracy")
    parser.add_argument("--preset", default=None, help="hybridflow rm's preset (e.g. builtin)")
    args = parser.parse_args()
    preset = ["--preset", args.preset] if args.preset else []
    with tempfile.TemporaryDirectory(prefix="rm-bench-") as out:
        command = [sys.executable, "-m", "hybridflow.cli", "rm", *preset, *args.overrides, "trainer.num_threads=1",
                   "trainer.logger=[jsonl]", "rm.export=false", f"trainer.output_dir={out}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, check=False, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        curve = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    held_out = [(r["step"], r["val/rm/accuracy"]) for r in curve if "val/rm/accuracy" in r]
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print("hybridflow rm " + " ".join([*preset, *args.overrides]))
    print("held-out pair accuracy by step: " + " ".join(f"{s}:{a:.3f}" for s, a in held_out))
    print(f"final {held_out[-1][1]:.3f} in {cpu_s:.0f} CPU-s (one torch thread; {cpu_name()})")
    if args.min is not None and held_out[-1][1] < args.min:
        print(f"below --min {args.min}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
