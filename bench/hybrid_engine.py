"""verl's hybrid engine on Ray (``trainer.hybrid_engine=true``) against a process per rank: what a run costs.

One 2-rank, 1-step GRPO run with a KL loss (so the reference role is there too) on the tiny model and
the arithmetic task, started as ``hybridflow train`` in a subprocess, with the colocated roles in one
Ray process per placement bundle (fused, the default) or in a process each (unfused). The two
alternate ``--repeats`` times; medians. While a run lives its process tree is sampled every 0.2 s:

- wall: the command's wall time (start-up of Ray and every rank process included);
- tree CPU-s: user + system seconds of every process of the tree (the driver, Ray's own daemons,
  the rank processes), read from ``/proc/<pid>/stat`` at the last sample that saw each;
- rank CPU-s, rank processes: the same for the processes hosting workers alone (``ray::RankHost`` /
  ``ray::RoleHost``), and how many there were;
- peak RSS: the largest sum of resident memory over the tree, and over the rank processes.

The step's numbers are the same either way (tests/e2e/test_e2e_ray.py checks it); this measures what
the processes cost. The local cluster starts fresh for each run (no ``RAY_ADDRESS``).

    python bench/hybrid_engine.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIGIT_SHARE_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n"
)
RUN = [
    "data.train_batch_size=8", "rollout.n=4", "data.max_response_length=4", "trainer.total_training_steps=1",
    "trainer.val_before_train=false", "trainer.num_threads=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
    "trainer.seed=3", "model.dtype=float32", "rollout.dtype=float32", "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=8", "actor.use_kl_loss=true", "trainer.backend=ray", "trainer.n_workers=2",
]
TICKS = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float | None:
    parts = read(f"/proc/{pid}/stat").rsplit(")", 1)
    if len(parts) != 2:
        return None
    fields = parts[1].split()  # from field 3 (state) on: utime is field 14, stime 15
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    for line in read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def is_rank_process(pid: int) -> bool:
    name = read(f"/proc/{pid}/cmdline").split("\0")[0]
    return name.startswith("ray::") and ("RankHost" in name or "RoleHost" in name)


def measure(command: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu: dict[int, float] = {}
    ranks: set[int] = set()
    peak_tree = peak_ranks = 0
    while proc.poll() is None:
        tree = process_tree(proc.pid)
        ranks |= {pid for pid in tree if is_rank_process(pid)}
        for pid in tree:
            seconds = cpu_seconds(pid)
            if seconds is not None:
                cpu[pid] = max(cpu.get(pid, 0.0), seconds)
        peak_tree = max(peak_tree, sum(rss_bytes(pid) for pid in tree))
        peak_ranks = max(peak_ranks, sum(rss_bytes(pid) for pid in tree if pid in ranks))
        time.sleep(0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr.read()[-3000:]}")
    return {"wall": time.perf_counter() - start, "tree_cpu": sum(cpu.values()),
            "rank_cpu": sum(cpu.get(pid, 0.0) for pid in ranks), "processes": len(ranks),
            "peak_tree_gb": peak_tree / 2**30, "peak_ranks_gb": peak_ranks / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from hybridflow.data.tasks.arithmetic import write_arithmetic_task
    from hybridflow.models.tiny import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hybrid-engine-"))
    model = write_tiny_model(work / "model")
    train, val = write_arithmetic_task(work / "data", train_size=32, val_size=4)
    (work / "reward.py").write_text(DIGIT_SHARE_REWARD)
    base = [sys.executable, "-m", "hybridflow.cli", "train", f"model.path={model}", f"data.train_files=[{train}]",
            f"data.val_files=[{val}]", f"reward.custom_reward_function.path={work / 'reward.py'}", *RUN]
    load = os.getloadavg()[0]
    results: dict[str, list[dict[str, float]]] = {"unfused": [], "fused": []}
    for round_ in range(args.repeats):
        for mode in results:
            out = work / f"{mode}-{round_}"
            result = measure([*base, f"trainer.output_dir={out}", f"trainer.hybrid_engine={str(mode == 'fused').lower()}"])
            results[mode].append(result)
            print(f"  round {round_ + 1} {mode:8s} " + " ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    print(f"\n2 Ray ranks, 1 GRPO step with a KL reference, tiny model; {args.repeats} round(s), medians; "
          f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(f"| {'':8s} | wall s | tree CPU-s | rank CPU-s | rank processes | peak RSS tree | peak RSS ranks |")
    print("|----------|-------:|-----------:|-----------:|---------------:|--------------:|---------------:|")
    medians = {mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for mode, runs in results.items()}
    for mode, m in medians.items():
        print(f"| {mode:8s} | {m['wall']:6.1f} | {m['tree_cpu']:10.1f} | {m['rank_cpu']:10.1f} | {m['processes']:14.0f} | "
              f"{m['peak_tree_gb']:10.2f} GB | {m['peak_ranks_gb']:11.2f} GB |")
    u, f = medians["unfused"], medians["fused"]
    print(f"fused / unfused: wall {f['wall'] / u['wall']:.2f}x, tree CPU-s {f['tree_cpu'] / u['tree_cpu']:.2f}x, "
          f"rank CPU-s {f['rank_cpu'] / u['rank_cpu']:.2f}x, peak RSS tree {f['peak_tree_gb'] / u['peak_tree_gb']:.2f}x, "
          f"ranks {f['peak_ranks_gb'] / u['peak_ranks_gb']:.2f}x")


if __name__ == "__main__":
    main()
