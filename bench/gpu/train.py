"""Step 5 of the GPU kit: the built-in task trained on the GPU through the CLI a user types
(``python -m hybridflow.cli train trainer.device=cuda ...``): the built-in tiny model, its
supervised warm start, 20 GRPO steps. Reported: held-out greedy score before and after, median
s/step, and the rollout's precision (``rollout_dtype``).

    python -m bench.gpu.train --json train.json [--dry-run]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu.common import Results, step_arguments


def main() -> None:
    args = step_arguments(__doc__.split("\n\n")[0]).parse_args()
    results = Results(args.json, "train", args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="gpu-kit-train-"))
    if args.dry_run:
        overrides = ["trainer.device=cpu", "trainer.total_training_steps=2", "trainer.test_freq=2",
                     "warm_start.steps=20", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                     "data.builtin_val_size=16", f"trainer.num_threads={args.threads}",
                     # No bf16 probe on a CPU with bf16 hardware: the dry run checks code, not speed.
                     "rollout.dtype=float32"]
    else:
        overrides = ["trainer.device=cuda", "trainer.total_training_steps=20", "trainer.test_freq=10"]
    overrides += [f"trainer.output_dir={work / 'run'}", f"warm_start.cache_dir={work / 'cache'}",
                  "trainer.progress_bar=false", "trainer.logger=[console,jsonl]"]
    command = [sys.executable, "-m", "hybridflow.cli", "train", *overrides]
    results.put("command", " ".join(command[1:]))
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print(done.stdout[-6000:], flush=True)
    results.put("wall_s", round(time.perf_counter() - start, 1))
    results.put("exit_code", done.returncode)
    metrics_path = work / "run" / "metrics.jsonl"
    if not metrics_path.exists():
        raise SystemExit(f"no metrics written ({metrics_path}); exit code {done.returncode}")
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    vals = [(r["step"], round(r["val/score/mean"], 4)) for r in records if "val/score/mean" in r]
    steps = [r["timing_s/step"] for r in records if "timing_s/step" in r]
    results.put("held_out_score_by_step", vals)
    results.put("median_s_per_step", round(statistics.median(steps), 3) if steps else None)
    dtype_record = work / "run" / "rollout_dtype.json"
    if dtype_record.exists():
        results.put("rollout_dtype", json.loads(dtype_record.read_text()))
    if done.returncode != 0:
        raise SystemExit(f"hybridflow train exited {done.returncode}")


if __name__ == "__main__":
    main()
