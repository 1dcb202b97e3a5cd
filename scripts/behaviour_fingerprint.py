"""Record, or check, what three short fixed-thread runs log, so that a refactor can show it changed
no number: the default command, the PPO preset and a fully-async run (issue 34's "behaviour
unchanged: a fixed-seed default run, a PPO run and a fully-async run log bitwise the same metrics
before and after").

    python scripts/behaviour_fingerprint.py --write before.json     # on the old commit
    python scripts/behaviour_fingerprint.py --check before.json     # on the new one: exit 1 on a difference

Wall-clock figures (``timing_s/``, ``perf/``, the async idle ratios, and in the fully-async run the
rollout thread's work counters, booked to the step current when the work was done) are left out;
every other metric of every step must be equal to the bit. A key the recorded fingerprint lacks is
a new metric, not a changed number: it is listed apart ("added keys") and does not fail the check;
a recorded key the new runs no longer log does. The runs share a warm-start cache (``--cache``) so
the built-in model's supervised warm start is made once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VOLATILE = ("timing_s/", "perf/")
WALL_CLOCK_RATIOS = ("async/rollout_idle_ratio", "async/trainer_idle_ratio")  # shares of wall time
# In the fully-async run the rollout thread's work counters are booked to whichever step is current
# when the work is done, which depends on how the two threads were scheduled (under load the same
# tokens land one step earlier); what was trained on, and its losses, is compared to the bit.
WHEN_DONE = {"fully_async": ("rollout/generated_tokens", "rollout/prefill_tokens", "rollout/prefix_cache_hit",
                             "rollout/replica_load_imbalance", "async/queue_size",
                             "health/zero_variance_group_fraction")}  # of the groups generated meanwhile
COMMON = ["trainer.total_training_steps=3", "trainer.num_threads=1", "trainer.progress_bar=false",
          "trainer.logger=[jsonl]", "trainer.val_before_train=true"]
RUNS: dict[str, list[str]] = {
    "default": [],
    "ppo": ["--preset", "ppo"],
    "fully_async": ["trainer.mode=fully_async", "async_training.staleness_threshold=1"],
}


def run_one(name: str, out: Path, cache: Path, extra: list[str] = ()) -> dict[str, dict]:
    command = [sys.executable, "-m", "hybridflow.cli", "train", *RUNS[name], *COMMON, *extra,
               f"warm_start.cache_dir={cache}", f"trainer.output_dir={out}"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HYBRIDFLOW_FAULT": ""})
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    steps: dict[str, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kept = {k: v for k, v in record.items() if not k.startswith((*VOLATILE, *WHEN_DONE.get(name, ())))
                and k not in WALL_CLOCK_RATIOS}
        steps.setdefault(str(record["step"]), {}).update(kept)
    return steps


def _compared(run: str, key: str) -> bool:
    # (a fingerprint recorded before the volatile keys were left out still holds them)
    return not key.startswith((*VOLATILE, *WHEN_DONE.get(run, ()))) and key not in WALL_CLOCK_RATIOS


def differences(before: dict, after: dict) -> list[str]:
    """Every recorded number that the new runs changed or no longer log (keys they add are not
    differences: ``added_keys``)."""
    found = []
    for run in before:
        for step, metrics in before[run].items():
            new = after.get(run, {}).get(step)
            if new is None:
                found.append(f"{run} step {step}: missing")
                continue
            for key in sorted(k for k in metrics if _compared(run, k)):
                if key not in new:
                    found.append(f"{run} step {step} {key}: {metrics[key]!r} -> no longer logged")
                elif metrics[key] != new[key]:
                    found.append(f"{run} step {step} {key}: {metrics[key]!r} -> {new[key]!r}")
    return found


def added_keys(before: dict, after: dict) -> dict[str, list[str]]:
    """Per run, the metric keys the new runs log at some recorded step and the fingerprint lacks."""
    added: dict[str, list[str]] = {}
    for run in before:
        keys = {k for step, metrics in before[run].items() for k in after.get(run, {}).get(step, {})
                if k not in metrics and _compared(run, k)}
        if keys:
            added[run] = sorted(keys)
    return added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, help="record the fingerprint to this file")
    mode.add_argument("--check", type=Path, help="compare against a recorded fingerprint")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hybridflow-fingerprint-cache")
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="run these only")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides added to every run (e.g. model.dtype=float32: a changed default's opt-out)")
    args = parser.parse_args()
    names = args.only or list(RUNS)
    with tempfile.TemporaryDirectory() as scratch:
        found = {name: run_one(name, Path(scratch) / name, args.cache, args.override) for name in names}
    if args.write:
        args.write.write_text(json.dumps(found, indent=1, sort_keys=True))
        print(f"wrote {args.write}: " + ", ".join(f"{n} {len(s)} steps" for n, s in found.items()))
        return
    recorded = json.loads(args.check.read_text())
    before = {n: recorded[n] for n in names}
    diffs = differences(before, found)
    for line in diffs[:40]:
        print(line)
    for run, keys in added_keys(before, found).items():
        print(f"{run}: {len(keys)} added keys (new metrics, not differences): {', '.join(keys)}")
    print(f"{len(diffs)} differences in {', '.join(names)}")
    raise SystemExit(1 if diffs else 0)


if __name__ == "__main__":
    main()
