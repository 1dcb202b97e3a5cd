"""The GPU kit's driver: every step in its own process and time box, figures into one JSON.

    python scripts/gpu_checks.py OUT_DIR [--dry-run] [--only STEP,...]

(``scripts/gpu_checks.sh`` sets up the python and calls this; use that.) Steps run in value
order; each gets a hard time limit, and a step killed at its limit still hands over what it
wrote so far (each step rewrites its JSON after every figure). After every step
``OUT_DIR/gpu_checks.json`` is rewritten whole, so a run cut short anywhere returns what ran.
``OUT_DIR/gpu_checks.log`` holds every step's output. ``--dry-run`` runs each step's CPU part at
toy sizes (the CPU twin of the GPU machine): imports, APIs, and the logic of every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480
"""The whole run on an H200 must fit 8 minutes: a lent machine gives 15, and starting one costs 1-2."""


@dataclass(frozen=True)
class Step:
    name: str
    time_box_s: int
    what: str


STEPS = [
    Step("env", 30, "versions, device, copy bandwidth and bf16 matrix rate (the ceilings)"),
    Step("pytest_gpu", 90, "every test marked gpu (one GPU; multi-GPU ones skip with the reason)"),
    Step("decode", 150, "native bf16 decode vs HF generate and the HBM roofline, CUDA graphs on/off; "
                        "rollout-vs-trainer logprob mismatch"),
    Step("update", 60, "GRPO actor update on the 0.5B shape: tokens/s, MFU, peak memory; one rank and FSDP2"),
    Step("memory", 60, "planner vs max_memory_allocated; sleep levels 1/2 freeing what they claim; offload"),
    Step("train", 80, "the built-in task, 20 GRPO steps on the GPU through the CLI: held-out score, s/step"),
]
assert sum(s.time_box_s for s in STEPS) <= BUDGET_S
DRY_RUN_SLACK = 4
"""A dry run's time boxes are this many times the GPU's: it checks code on a CPU that may be
shared and loaded (2 cores with a test suite beside it), not the GPU run's timing."""


def gpu_test_files() -> list[str]:
    """Test files that hold a test marked ``gpu`` (collecting only these keeps the run free of
    imports the GPU machine lacks, such as ray in the cluster tests)."""
    marker = re.compile(r"pytest\.mark\.gpu\b")
    files = [p for p in sorted((ROOT / "tests").rglob("test_*.py")) if marker.search(p.read_text())]
    return [str(p.relative_to(ROOT)) for p in files]


def step_command(step: Step, json_path: Path, dry_run: bool, work: Path) -> list[str]:
    if step.name == "pytest_gpu":
        # -o addopts= : no xdist workers, no durations table; one process, tests in file order.
        return [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rs",
                f"--junitxml={work / 'junit.xml'}", *gpu_test_files()]
    return [sys.executable, "-m", f"bench.gpu.{step.name}", "--json", str(json_path), *(["--dry-run"] if dry_run else [])]


def junit_summary(path: Path) -> dict[str, object]:
    """Counts and the failures' and skips' reasons from pytest's JUnit XML."""
    if not path.exists():
        return {"error": "pytest wrote no report"}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if (found := case.find("failure")) is not None or (found := case.find("error")) is not None:
            counts["failed" if found.tag == "failure" else "errors"] += 1
            failures.append({"test": name, "message": (found.get("message") or "")[:400]})
        elif (found := case.find("skipped")) is not None:
            counts["skipped"] += 1
            skips.append({"test": name, "reason": (found.get("message") or "")[:200]})
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skips": skips}


def run_step(step: Step, work: Path, dry_run: bool, log) -> dict[str, object]:
    json_path = work / f"{step.name}.json"
    command = step_command(step, json_path, dry_run, work)
    time_box_s = step.time_box_s * (DRY_RUN_SLACK if dry_run else 1)
    log.write(f"\n=== {step.name} (time box {time_box_s} s): {' '.join(command)}\n")
    log.flush()
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    # A new session, so the time box kills the step's whole process group (its subprocesses too).
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        code = process.wait(timeout=time_box_s)
        status = "ok" if code == 0 else f"exit {code}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        status = "timed out"
    record: dict[str, object] = {"status": status, "seconds": round(time.monotonic() - start, 1),
                                 "time_box_s": time_box_s}
    if step.name == "pytest_gpu":
        record["tests"] = junit_summary(work / "junit.xml")
        # pytest's exit code 5 (nothing collected) and skips in a dry run are not failures.
    elif json_path.exists():
        data = json.loads(json_path.read_text())
        record["figures"], record["errors"] = data["figures"], data["errors"]
        if data["errors"] and status == "ok":
            record["status"] = f"ok with {len(data['errors'])} failed checks"
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="each step's CPU part at toy sizes (no GPU needed)")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    args = parser.parse_args()
    only = {s for s in args.only.split(",") if s}
    unknown = only - {s.name for s in STEPS}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; steps: {', '.join(s.name for s in STEPS)}")
    steps = [s for s in STEPS if not only or s.name in only]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-checks-"))
    report: dict[str, object] = {"dry_run": args.dry_run, "budget_s": BUDGET_S,
                                 "time_boxes_s": {s.name: s.time_box_s for s in steps}, "steps": {}}
    print(f"gpu_checks: {len(steps)} steps, time boxes {sum(s.time_box_s for s in steps)} s of a {BUDGET_S} s budget"
          f"{f' (dry run: toy sizes on the CPU, boxes x{DRY_RUN_SLACK})' if args.dry_run else ''}")
    for s in steps:
        print(f"  {s.name:<11} {s.time_box_s:>4} s  {s.what}")
    started = time.monotonic()
    failed = []
    with open(args.out_dir / "gpu_checks.log", "a") as log:
        for step in steps:
            print(f"--- {step.name} ...", flush=True)
            record = run_step(step, work, args.dry_run, log)
            report["steps"][step.name] = record
            report["elapsed_s"] = round(time.monotonic() - started, 1)
            tmp = args.out_dir / "gpu_checks.json.tmp"
            tmp.write_text(json.dumps(report, indent=1, default=str))
            os.replace(tmp, args.out_dir / "gpu_checks.json")
            tests = record.get("tests", {})
            bad = record["status"] != "ok" or tests.get("failed") or tests.get("errors")
            if bad:
                failed.append(step.name)
            detail = (f"{tests.get('passed')} passed, {tests.get('failed')} failed, {tests.get('skipped')} skipped"
                      if tests else f"{len(record.get('figures', {}))} figures")
            print(f"    {record['status']} in {record['seconds']} s ({detail})", flush=True)
    print(f"gpu_checks: done in {report['elapsed_s']} s; {args.out_dir / 'gpu_checks.json'}"
          f"{'; FAILED: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
