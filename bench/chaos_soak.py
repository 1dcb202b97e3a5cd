"""Chaos soak: a run killed over and over at random moments ends with the uninterrupted run's metrics.

The run is small and fast (a tiny model on the built-in arithmetic task, ``trainer.num_threads=1``
so every run computes the same numbers, ``trainer.save_freq=1``, the local backend). It runs once
uninterrupted, then again while faults arrive at seeded random moments; after each fault that ends
the trainer the same command is started again (``trainer.resume_mode=auto``) until the run
completes. A fault strikes at a random moment of a trainer's life: during its start-up (a fifth
of them), or a random fraction of a step into one of the next three steps, so every fault lands before
the run ends. Fault kinds:

- ``controller_kill``: SIGKILL of the trainer (an OOM kill, a lost node): no cleanup, no save; the
  restart resumes from the newest complete checkpoint.
- ``controller_term``: SIGTERM (a scheduler's preemption): the trainer finishes the step, saves and
  exits 143 (during start-up, before its handler is installed, it dies at once); the restart
  resumes from that save.
- ``fault_point``: ``HYBRIDFLOW_FAULT=<point>@<step>[:TERM]`` (``hybridflow/utils/faults.py``): the
  signal arrives exactly at the most damaging places, mid checkpoint write, mid prune, after a step.
- ``reward_worker_kill``: SIGKILL of a scoring worker (a child of the trainer, found in /proc): the
  trainer replaces it and goes on (killed while it loads, the trainer starts another).

With ``--backend ray`` the run has two Ray ranks (``trainer.backend=ray trainer.n_workers=2``), each
with a rollout replica beside it in a process of its own (``trainer.hybrid_engine=false``), and two
more kinds strike:

- ``rank_kill``: SIGKILL of an actor rank's process (a lost GPU or node): the trainer stops within a
  bounded time naming the role and rank (exit 1), and the restart resumes from the newest checkpoint.
- ``replica_kill``: SIGKILL of a rollout replica's process: its requests go to the other replica and
  it is restarted at the next weight sync (``rollout.max_replica_restarts``), so the run goes on
  (killed in the instant of a weight sync, it stops the trainer like a rank's death).

Both find their process in the run folder's ``placement.json`` (each rank's pid; a replica's restart
rewrites it).

A fault is *survived* when the run then goes on to complete and nothing beyond the newest complete
checkpoint at the moment of the fault is lost: each restart must resume from that checkpoint (or a
later one, written by a graceful stop). *Steps re-run* are the steps the dead trainer had logged
beyond that checkpoint (work lost to a SIGKILL, at most one step with ``save_freq=1``). At the end
the per-step records of ``metrics.jsonl`` (the last record of each step; wall-clock keys excluded,
and ``reward/worker_restarts``, which counts the reward workers this soak killed) must equal the
uninterrupted run's bitwise.

    python bench/chaos_soak.py --faults 24 --seed 0
    python bench/chaos_soak.py --backend ray --faults 12 --seed 0 --steps 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOLATILE = ("timing_s/", "perf/")  # wall-clock figures differ between any two runs
# Count the faults injected, not the run's numbers.
FAULT_COUNTERS = ("reward/worker_restarts", "rollout/replica_restarts")
# What a replica's death changes besides the samples: the dead one's share of a step was generated
# again by the other (the same tokens, seeded per request), which changes how the work was spread,
# what its prefix cache held, and the rollout's logprobs in the last float32 bits (another batch:
# another order of sums), so the diagnostics comparing them with the trainer's (rollout_corr/).
PLACEMENT_FIGURES = ("rollout/replica_load_imbalance", "rollout/prefix_cache_hit_rate", "rollout_corr/")
# Faults the trainer survives without a restart, and what it did about them.
IN_RUN = {"reward_worker_kill": "replaced, the run went on", "replica_kill": "restarted, the run went on"}
KINDS = ("controller_kill", "controller_term", "fault_point", "reward_worker_kill")
RAY_KINDS = KINDS + ("rank_kill", "replica_kill")
# Where HYBRIDFLOW_FAULT can strike in an RL run, with the signal: mid checkpoint write (SIGKILL, or
# SIGTERM which completes the save), mid prune of old checkpoints, right after a step.
FAULT_POINTS = ("checkpoint_write", "checkpoint_write:TERM", "checkpoint_delete", "after_step", "after_step:TERM")
RESUMED = re.compile(r"resumed from \S*global_step_(\d+)")
RESTART_LIMIT = 200  # a run that needs more restarts than this is stuck, not unlucky


def run_args(steps: int, backend: str = "local") -> list[str]:
    # A process per rank of each role (trainer.hybrid_engine=false): replica_kill kills a replica's own process,
    # which the hybrid engine does not have (replica r lives and dies with actor rank r).
    ray = ["trainer.backend=ray", "trainer.n_workers=2", "trainer.hybrid_engine=false"] if backend == "ray" else []
    return [*ray,
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=4",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=100", "trainer.test_freq=3", "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2", "trainer.num_threads=1", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]", "actor.optim.lr=1e-3", "actor.shuffle=true", "trainer.resume_mode=auto",
    ]


def write_inputs(root: Path) -> list[str]:
    from hybridflow.data.tasks.arithmetic import write_arithmetic_task
    from hybridflow.models.tiny import write_tiny_model

    model = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=8)
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def start(out: Path, files: list[str], steps: int, fault: str = "", backend: str = "local",
          cluster: Any = None) -> subprocess.Popen:
    """A start of the trainer. ``cluster`` (Ray): an existing cluster to attach to instead of starting a local
    one, anything with its ``address`` and the ``env`` its drivers run with (its token; e.g. the tests'
    tests/e2e/ray_cluster.py Cluster). Its ranks get ``fault`` in the job's runtime environment."""
    env = {**(os.environ if cluster is None else cluster.env), "HYBRIDFLOW_FAULT": fault, "OMP_NUM_THREADS": "1"}
    attach = [f"trainer.ray_address={cluster.address}"] if cluster is not None and backend == "ray" else []
    log = open(out.parent / f"{out.name}.log", "a")  # noqa: SIM115 -- the child owns it until it exits
    log.write(f"--- start (HYBRIDFLOW_FAULT={fault!r})\n")
    log.flush()
    return subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli", "train", *files, *run_args(steps, backend), *attach,
         f"trainer.output_dir={out}"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )


def records(out: Path) -> list[dict]:
    """Every whole record of ``metrics.jsonl`` in order (a line cut by a kill is skipped)."""
    path = out / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def per_step(out: Path, ignore: tuple[str, ...] = ()) -> dict[int, dict]:
    """The last record logged for each step (a step re-run after a kill is logged again), without
    the keys that differ between any two runs, nor those starting with one of ``ignore``."""
    return {
        record["step"]: {k: v for k, v in record.items()
                         if not k.startswith((*VOLATILE, *ignore)) and k not in FAULT_COUNTERS}
        for record in records(out)
    }


def newest_checkpoint(out: Path) -> int:
    """The newest complete checkpoint's step (0: none). Saves are atomic renames of a temp folder,
    so a ``global_step_N`` folder is a complete one."""
    steps = [int(p.name.rsplit("_", 1)[1]) for p in (out / "checkpoints").glob("global_step_*") if p.is_dir()]
    return max(steps, default=0)


def children(pid: int) -> list[int]:
    """Direct child pids of ``pid``, from /proc (psutil may not be installed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (2nd field) may hold spaces and parentheses: the ppid follows the last ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def reward_workers(pid: int) -> list[int]:
    """The trainer's scoring workers: its ``spawn`` children other than multiprocessing's tracker."""
    workers = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            workers.append(child)
    return workers


def rank_pids(out: Path, started_at: float, roles: str) -> list[int]:
    """The live processes of the roles ``roles`` picks ("actor": the actor's ranks; "rollout": the
    replicas'), from the placement.json this start wrote (not an older start's)."""
    path = out / "placement.json"
    try:
        if path.stat().st_mtime < started_at:
            return []
        placement = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    pids = [rank["pid"] for role, ranks in placement.items() if role.startswith(roles) for rank in ranks]
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


@dataclass
class Soak:
    injected: Counter = field(default_factory=Counter)
    survived: int = 0
    restarts: int = 0
    steps_rerun: int = 0
    steps_lost: int = 0  # steps lost beyond the newest checkpoint: must stay 0
    exit_codes: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # "<kind>: <what the trainer did>"
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    reference_s: float = 0.0
    equal: bool = False

    def report(self) -> str:
        kinds = ", ".join(f"{kind} {self.injected[kind]}" for kind in RAY_KINDS if self.injected[kind])
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.exit_codes.items()))
        lines = [
            f"faults injected: {sum(self.injected.values())} ({kinds})",
            f"faults survived: {self.survived}",
            f"restarts: {self.restarts} (trainer exit codes {codes})",
            "what each fault did:",
            *(f"  {n} x {outcome}" for outcome, n in sorted(self.outcomes.items())),
            f"steps lost beyond the newest checkpoint: {self.steps_lost}",
            f"steps re-run (done after the newest checkpoint, then killed): {self.steps_rerun}",
            f"wall time: {self.wall_s:.1f} s (the uninterrupted run: {self.reference_s:.1f} s)",
            f"final metrics equal to the uninterrupted run's: {self.equal}",
        ]
        return "\n".join(lines + [f"problem: {p}" for p in self.problems])


def finish(run: subprocess.Popen, timeout_s: float = 600) -> int:
    try:
        return run.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        raise RuntimeError(f"the trainer (pid {run.pid}) hung: still running after {timeout_s:g} s") from None


def resumed_step(log: Path, since: int) -> int | None:
    """The step the start whose log begins at byte ``since`` resumed from (None: it started afresh)."""
    text = log.read_text(errors="replace")[since:]
    match = RESUMED.search(text)
    return int(match.group(1)) if match else None


def fault_point(rng: random.Random, done: int, steps: int) -> str:
    """A ``HYBRIDFLOW_FAULT`` entry at a step the next start will reach (it resumes after ``done``)."""
    if done >= steps:
        return ""  # the run is over: the next start only says so
    where, _, sig = rng.choice(FAULT_POINTS).partition(":")
    # One of the next three steps, not the last (a signal in the last step ends a finished run).
    low, high = done + 1, min(done + 3, steps - 1)
    if where == "checkpoint_delete":
        # checkpoint_delete@k strikes while checkpoint k is pruned, at the save of step k + 2
        # (trainer.max_actor_ckpt_to_keep=2).
        low, high = max(done - 1, 1), min(done + 1, steps - 3)
    if low > high:
        where, low, high = "after_step", done + 1, max(done + 1, steps - 1)
    return f"{where}@{rng.randint(low, high)}" + (f":{sig}" if sig else "")


@dataclass
class Timing:
    """The reference run's start-up (launch to its first logged step) and seconds per step after it."""

    startup_s: float
    step_s: float
    startup_share: float = 0.2  # of the faults strike during start-up (imports, loading, resuming)

    def pace(self, out: Path) -> float:
        """Seconds a step of this run takes: its own last logged step's, where shorter than the
        reference's (a run can go faster than the reference did, e.g. when the reference shared the
        machine with more work; a moment drawn from the reference's pace would then fall after the
        run's end and the fault would never strike)."""
        own = [r["timing_s/step"] for r in records(out) if isinstance(r.get("timing_s/step"), (int, float))]
        return min(self.step_s, own[-1]) if own else self.step_s

    def wait_for_moment(self, run: subprocess.Popen, out: Path, steps: int, rng: random.Random) -> bool:
        """Wait for a random moment of ``run``: during its start-up, or within a random step still to
        come (once the step before it is logged, a random fraction of a step later), so the fault
        lands before the run ends. False if the run ended first."""
        logged = max(per_step(out), default=-1)
        if logged < 0 and rng.random() < self.startup_share:
            try:
                run.wait(timeout=rng.uniform(0.3, self.startup_s))
            except subprocess.TimeoutExpired:
                return True
            return False
        # Step k + 1 runs once step k is logged. Within the next three steps, so that a run of S
        # steps takes about S faults; the last step is excluded: its end is the run's.
        after = min(max(logged, 0) + rng.randint(0, 2), max(logged, steps - 2))
        while run.poll() is None and max(per_step(out), default=-1) < after:
            time.sleep(0.05)
        try:
            run.wait(timeout=rng.uniform(0.0, self.pace(out)))
        except subprocess.TimeoutExpired:
            return True
        return False


def chaos(out: Path, files: list[str], steps: int, faults: int, rng: random.Random, timing: Timing,
          backend: str = "local", only: tuple[str, ...] | None = None, cluster: Any = None) -> Soak:
    """Run to completion while injecting up to ``faults`` faults at random moments (``timing``);
    every restart is checked against the newest checkpoint that existed when the
    previous trainer died."""
    soak = Soak()
    log = out.parent / f"{out.name}.log"
    queue: list[str] = []

    def next_kind(in_run: bool) -> str | None:
        """The next fault to inject: kinds come in rounds, every kind once per round in a random
        order. A fault point is armed only when a trainer starts, so within a run it waits."""
        if sum(soak.injected.values()) >= faults:
            return None
        for _ in range(2):
            choices = [i for i, kind in enumerate(queue) if not (in_run and kind == "fault_point")]
            if choices:
                return queue.pop(choices[-1])
            kinds = only or (RAY_KINDS if backend == "ray" else KINDS)
            queue[:0] = rng.sample(kinds, len(kinds))
        return None

    floor: int | None = None  # the checkpoint a restart must resume from (at least)
    start_t = time.monotonic()
    while True:
        if soak.restarts > RESTART_LIMIT:
            raise RuntimeError(f"gave up after {soak.restarts} restarts: the run makes no progress")
        armed = ""
        kind = next_kind(in_run=False)
        if kind == "fault_point":
            armed = fault_point(rng, newest_checkpoint(out), steps)
            if not armed:
                queue.append(kind)
        elif kind is not None:
            queue.append(kind)  # a fault for this start's lifetime, taken below
        offset = log.stat().st_size if log.exists() else 0
        records_before = len(records(out))
        started_at = time.time()
        run = start(out, files, steps, armed, backend, cluster)
        started = time.monotonic()
        logged_at_death = None
        last = "fault_point" if armed else None  # the fault that struck last in this start
        while run.poll() is None and not armed:
            kind = next_kind(in_run=True)
            if kind is None:
                break
            if not timing.wait_for_moment(run, out, steps, rng):
                queue.append(kind)  # the run ended first: the fault is still to come
                break
            if last in IN_RUN:  # the trainer survived the last fault: another strikes now
                soak.outcomes[f"{last}: {IN_RUN[last]}"] += 1
                last = None
            if kind == "reward_worker_kill":
                workers = reward_workers(run.pid)
                if workers:
                    os.kill(rng.choice(workers), signal.SIGKILL)
                    soak.injected[kind] += 1
                    last = kind
                else:
                    queue.append(kind)
                continue
            if kind in ("rank_kill", "replica_kill"):
                # A rank's process, once this start has placed its ranks (before that: at the next moment).
                pids = rank_pids(out, started_at, "actor" if kind == "rank_kill" else "rollout replica")
                if not pids:
                    queue.append(kind)
                    continue
                logged_at_death = max(per_step(out), default=0)
                os.kill(rng.choice(pids), signal.SIGKILL)
                soak.injected[kind] += 1
                last = kind
                if kind in IN_RUN:
                    continue
                break
            logged_at_death = max(per_step(out), default=0)
            run.send_signal(signal.SIGKILL if kind == "controller_kill" else signal.SIGTERM)
            soak.injected[kind] += 1
            last = kind
            break
        code = finish(run)
        if armed and code != 0:  # it fired (a point that never comes, say a prune, ends the run normally)
            soak.injected["fault_point"] += 1
        if last is not None and (code != 0 or last in IN_RUN) and (code != 0 or not armed):
            what = IN_RUN[last] if code == 0 else f"trainer exit {code}"
            name = f"fault_point {re.sub(r'@[0-9]+', '', armed)}" if armed else last
            soak.outcomes[f"{name}: {what}"] += 1
        if logged_at_death is None:
            logged_at_death = max(per_step(out), default=0)
        if floor is not None:
            # A restart must carry on from the checkpoint the dead trainer left: its resume line
            # names it, and the first step it logs is the one after it. A start killed before it
            # got that far is judged by the next one.
            resumed = resumed_step(log, offset)
            logged = [record["step"] for record in records(out)[records_before:]]
            first = min(logged, default=None) if resumed is None else resumed + 1
            if first is not None and floor > 0 and first <= floor:
                soak.steps_lost += floor + 1 - max(first, 1)
                soak.problems.append(f"restart {soak.restarts} went back to step {first}, before checkpoint {floor}")
        if code == 0:
            break
        soak.exit_codes[code] += 1
        soak.restarts += 1
        floor = newest_checkpoint(out)
        soak.steps_rerun += max(0, logged_at_death - floor)
    soak.wall_s = time.monotonic() - start_t
    # Every fault that ended a trainer was followed by a restart that resumed in place; every
    # reward worker killed was replaced by the trainer, which completed the run.
    soak.survived = sum(soak.injected.values()) - len(soak.problems)
    return soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=32, help="RL steps of the run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs and their logs here")
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="ray: two Ray ranks, and their actor and rollout processes are killed too")
    parser.add_argument("--only", nargs="+", choices=RAY_KINDS, default=None, help="inject only these kinds")
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="chaos_soak_"))
    root.mkdir(parents=True, exist_ok=True)
    soak = soak_run(root, args.faults, args.seed, args.steps, args.backend, tuple(args.only) if args.only else None)
    print(soak.report())
    print(f"runs and logs: {root}")
    return 0 if soak.equal and not soak.problems and soak.survived == sum(soak.injected.values()) else 1


def reference_run(out: Path, files: list[str], steps: int, backend: str = "local", cluster: Any = None) -> Timing:
    """The uninterrupted run, timed: launch to its first logged step, and seconds per step after it."""
    t0 = time.monotonic()
    run = start(out, files, steps, backend=backend, cluster=cluster)
    first = last = None
    while run.poll() is None:
        logged = max(per_step(out), default=-1)
        if first is None and logged >= 0:
            first = time.monotonic() - t0
        if logged == steps and last is None:
            last = time.monotonic() - t0
        time.sleep(0.05)
    if run.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed (exit {run.returncode}); see {out}.log")
    total = time.monotonic() - t0
    first = first if first is not None else total / 2
    return Timing(startup_s=first, step_s=max(((last or total) - first) / steps, 0.05))


def soak_run(root: Path, faults: int, seed: int, steps: int, backend: str = "local",
             only: tuple[str, ...] | None = None, cluster: Any = None) -> Soak:
    """The uninterrupted run, then the run under ``faults`` faults of every kind (or of ``only``); on Ray,
    every start attached to ``cluster`` if given (``start``), else each on a local cluster of its own."""
    files = write_inputs(root / "inputs")
    t0 = time.monotonic()
    timing = reference_run(root / "reference", files, steps, backend, cluster)
    reference_s = time.monotonic() - t0
    soak = chaos(root / "chaos", files, steps, faults, random.Random(seed), timing, backend, only, cluster)
    soak.reference_s = reference_s
    ignore = PLACEMENT_FIGURES if backend == "ray" else ()
    expected, got = per_step(root / "reference", ignore), per_step(root / "chaos", ignore)
    soak.equal = expected == got and sorted(got) == list(range(steps + 1))
    missing = sorted(set(expected) - set(got))
    if missing:
        soak.problems.append(f"steps {missing} have no record in metrics.jsonl although the run went past them")
    differ = [s for s in sorted(set(expected) & set(got)) if expected[s] != got[s]]
    if differ:
        soak.problems.append(f"steps {differ} differ from the uninterrupted run")
    return soak


if __name__ == "__main__":
    sys.exit(main())
