"""Learning of the three loops on the built-in task: held-out score after the same number of
samples, sync vs one_step_off vs fully_async, over several seeds.

Each (loop, seed) is the default GRPO run of ``hybridflow train`` (warm start cached, 1 torch
thread for the trainer, the async loops' rollout thread a second one) for ``--steps`` steps, so
every loop sees the same number of prompts and samples. The figure is the held-out greedy
``val/score/mean`` at each validation, mean ± standard deviation over seeds per loop, and the
difference of each async loop from sync at the last step against the seeds' spread (is it
within noise?). Scores only: wall times here are not comparable (the runs share the machine
with whatever else runs; ``bench/async_long_tail.py`` measures speed).

    python bench/async_learning.py                     # 3 loops x 3 seeds x 40 steps, ~25 min on 2 cores
    python bench/async_learning.py --seeds 1 --steps 4 # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LOOPS = {
    "sync": ["trainer.mode=sync"],
    "one_step_off": ["trainer.mode=one_step_off"],
    "fully_async s=1": ["trainer.mode=fully_async", "async_training.staleness_threshold=1"],
}


def run(loop: str, seed: int, steps: int, work: Path) -> dict[int, float]:
    """Held-out score by step (0 = before training) of one run."""
    out = work / f"{loop.split()[0]}-{seed}"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", *LOOPS[loop], f"trainer.seed={seed}",
           f"trainer.total_training_steps={steps}", "trainer.num_threads=1", f"trainer.output_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{loop} seed {seed} failed:\n{proc.stderr[-3000:]}")
    scores = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val/score/mean" in record:
            scores[int(record.get("step", 0))] = record["val/score/mean"]
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="async-learning-"))
    print(f"run folders: {work}", flush=True)
    results: dict[str, list[dict[int, float]]] = {loop: [] for loop in args.loops}
    for seed in range(1, args.seeds + 1):  # loops alternate within a seed
        for loop in args.loops:
            results[loop].append(run(loop, seed, args.steps, work))
            print(f"{loop:>16} seed {seed}: " + " ".join(f"{s}:{v:.3f}" for s, v in sorted(results[loop][-1].items())),
                  flush=True)
    steps = sorted(set.intersection(*(set(r) for runs in results.values() for r in runs)))
    print("\nheld-out val/score/mean, mean ± std over seeds")
    print(f"{'loop':>16} " + " ".join(f"{'step ' + str(s):>14}" for s in steps))
    for loop, runs in results.items():
        cells = []
        for s in steps:
            values = [r[s] for r in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
        print(f"{loop:>16} " + " ".join(f"{c:>14}" for c in cells))
    last = steps[-1]
    if "sync" not in results:
        return
    base = [r[last] for r in results["sync"]]
    for loop in [name for name in results if name != "sync"]:
        other = [r[last] for r in results[loop]]
        diff = statistics.mean(other) - statistics.mean(base)
        # The standard error of a difference of two means over the seeds: "within noise" when the
        # difference is under two of them.
        se = (statistics.variance(base) / len(base) + statistics.variance(other) / len(other)) ** 0.5 if len(base) > 1 else float("nan")
        verdict = "one seed: no spread" if len(base) < 2 else "within noise" if abs(diff) <= 2 * se else "outside noise"
        print(f"{loop} - sync at step {last}: {diff:+.3f} (2 s.e. = {2 * se:.3f}: {verdict})")


if __name__ == "__main__":
    main()
