"""Where a step's memory goes: each phase's peak resident memory, over identical runs, beside the planner.

The workloads, each run ``--repeats`` times in a fresh subprocess (the same work every time):

- ``default``: ``hybridflow train`` with no arguments (the built-in tiny model and task), its first
  ``--steps`` steps;
- ``long_tail``: the ~18M Qwen2-shaped model of ``bench/grpo_step_vs_trl.py`` (16 prompts x 8,
  lognormal lengths capped at 256, the length oracle, one thread), 1 warm-up + ``--steps`` steps;
- ``default_long`` (on request): the default run with every response forced to ``LONG_RESPONSE_TOKENS``
  (no EOS), a third shape for the planner.

Per phase: ``perf/rss_peak_gb/<phase>``, the process's peak resident memory while the phase ran
(the kernel's high-water mark, reset at every phase boundary: ``hybridflow.utils.memory.RSS_PEAKS``),
the largest over the run's steps; then the process's peak over the whole run (child processes, the
reward scorer's, left out), how far the runs spread ((max - min) / min), and the planner's
prediction of that peak (``MemoryPlan.process_peak_bytes``: the largest phase plus the interpreter
and libraries) as predicted / measured. Memory figures do not depend on the machine's load.

    PYTHONPATH=. python bench/memory_timeline.py                          # default and long_tail, 4 runs each
    PYTHONPATH=. python bench/memory_timeline.py --workloads default --repeats 2
    PYTHONPATH=. python bench/memory_timeline.py --workloads default default_long long_tail   # three shapes

Each planned phase (generation, the update) is also printed against its own measured peak: the
plan's largest phase can be one that ran below its worst case (a long-tail step's KV cache).

The workers choose their memory allocator as the ``hybridflow`` command does (``HYBRIDFLOW_ALLOCATOR``,
default ``auto``: jemalloc where the machine has it); ``--allocator system`` measures the C library's
malloc (tuned by ``configure_host_allocator``) for comparison. Each report names the allocator its runs had.

Goals (issue 35): runs within 5% of each other; predicted / measured within 0.85-1.15 for the default run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("default", "long_tail", "default_long")
RSS_PEAK = "perf/rss_peak_gb/"


def _phase_peaks(step_metrics: list[dict]) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for metrics in step_metrics:
        for key, value in metrics.items():
            if key.startswith(RSS_PEAK):
                name = key[len(RSS_PEAK):]
                peaks[name] = max(value, peaks.get(name, 0.0))
    return peaks


# The planner's phases beside the step's measured ones (a phase's peak plus the runtime term).
PLANNED_PHASES = {("rollout", "generation"): "gen", ("actor", "update"): "update_actor"}


def _predicted(cfg) -> tuple[float, dict[str, float]]:
    """The planner's process peak and, per measured phase it plans, that phase's peak plus the runtime, GB."""
    from hybridflow.config.budget import read_model_shape
    from hybridflow.config.plan import plan_memory

    shape = read_model_shape(cfg.model.path, None if cfg.data.train_files else cfg.data.builtin_task)
    plan = plan_memory(cfg, shape, find_fixes=False)
    phases = {PLANNED_PHASES[(p.role, p.phase)]: (p.peak + plan.runtime) / 1e9 for p in plan.phases
              if (p.role, p.phase) in PLANNED_PHASES}
    return plan.process_peak_bytes() / 1e9, phases


# The default run with long responses: the built-in model and task, every response forced to this
# many tokens (the default's cap is 8, and the warm-started model stops after a few): a third shape
# for the planner, the one its worst case (every sample at its longest) describes.
LONG_RESPONSE_TOKENS = 256


def _no_eos(engine) -> None:
    """No sample ends before its length cap: EOS is never drawn (a logits processor of the native engine)."""
    eos = sorted(engine._intake._eos_token_ids)

    def forbid(logits, rows):
        logits = logits.clone()
        logits[:, eos] = float("-inf")
        return logits

    engine._runner.logits_processors = (forbid,)


def run_default(steps: int, work: Path, overrides: tuple[str, ...] = ()) -> dict:
    from hybridflow import api
    from hybridflow.controller.loops import make_trainer
    from hybridflow.controller.setup import build_run

    cfg = api.make_config("grpo", overrides=[
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.save_final=false", "trainer.logger=[]", "trainer.progress_bar=false",
        f"trainer.output_dir={work / 'out-default'}", *overrides,
    ])
    predicted, planned = _predicted(cfg)
    run = build_run(cfg)
    try:
        if overrides:
            _no_eos(run.roles.rollout.groups[0]._workers[0].engine)
        trainer = make_trainer(run)
        metrics = []
        for _ in range(steps):
            trainer.step += 1
            metrics.append(trainer.loop.train_step(trainer.step))
    finally:
        run.close()
    return {"phases": _phase_peaks(metrics), "predicted_gb": predicted, "planned_phases_gb": planned}


def run_long_tail(steps: int, work: Path) -> dict:
    sys.path.insert(0, str(HERE))
    import grpo_step_vs_trl as workload
    import torch

    torch.set_num_threads(1)
    prompts, n, cap = 16, 8, 256
    if not (work / "model").exists():
        workload.write_model(work / "model", quick=False)
        with open(work / "prompts.jsonl", "w") as out:
            for i, text in enumerate(workload.prompt_texts(prompts)):
                out.write(json.dumps({"data_source": "bench", "prompt": [{"role": "user", "content": text}],
                                      "ability": "bench", "reward_model": {"style": "rule", "ground_truth": "0"},
                                      "extra_info": {"index": i}}) + "\n")
        (work / "reward.py").write_text(workload.REWARD_SOURCE)
    spec = dict(work=str(work), prompts=prompts, n=n, max_tokens=cap, max_prompt_length=128, threads=1, warmup=1,
                steps=steps, targets=workload.target_lengths(prompts, n, 32.0, 1.0, cap), kl=False, overrides=[],
                config="defaults")
    predicted, planned = _predicted(workload.hybridflow_config(spec))
    result = workload.run_hybridflow(spec)
    phases = _phase_peaks([{RSS_PEAK + k: v for k, v in s["rss_gb"].items()} for s in result["steps"]])
    return {"phases": phases, "predicted_gb": predicted, "planned_phases_gb": planned}


def worker(workload: str, steps: int, work: str) -> None:
    from hybridflow.utils.allocator import jemalloc_loaded
    from hybridflow.utils.memory import RSS_PEAKS

    if workload == "long_tail":
        result = run_long_tail(steps, Path(work))
    else:
        long = (f"data.max_response_length={LONG_RESPONSE_TOKENS}",) if workload == "default_long" else ()
        result = run_default(steps, Path(work), long)
    result["process_peak_gb"] = RSS_PEAKS.process_peak_bytes() / 1e9
    result["allocator"] = "jemalloc" if jemalloc_loaded() else "the C library's malloc"
    print("RESULT " + json.dumps(result), flush=True)


def run_once(workload: str, steps: int, work: Path, allocator: str | None) -> dict:
    env = {**os.environ, **({"HYBRIDFLOW_ALLOCATOR": allocator} if allocator else {})}
    proc = subprocess.run([sys.executable, __file__, "--worker", workload, "--steps", str(steps), "--work", str(work)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{workload} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def report(workload: str, runs: list[dict]) -> None:
    phases = [p for p in runs[0]["phases"] if p != "step"] + ["step"]
    allocators = sorted({r["allocator"] for r in runs})
    print(f"\n{workload}: peak resident memory per phase, GB (largest over the run's steps), {len(runs)} run(s), "
          f"allocator: {', '.join(allocators)}")
    print(f"| {'phase':16s} | " + " | ".join(f"run {i + 1:<3d}" for i in range(len(runs))) + " |")
    print(f"|{'-' * 18}|" + "|".join("-" * 9 for _ in runs) + "|")
    for phase in phases:
        print(f"| {phase:16s} | " + " | ".join(f"{r['phases'].get(phase, float('nan')):7.2f}" for r in runs) + " |")
    peaks = [r["process_peak_gb"] for r in runs]
    print(f"| {'process peak':16s} | " + " | ".join(f"{p:7.2f}" for p in peaks) + " |")
    spread = (max(peaks) - min(peaks)) / min(peaks)
    predicted = runs[0]["predicted_gb"]
    measured = statistics.median(peaks)
    print(f"spread of the process peaks: {100 * spread:.1f}% (goal <= 5%); planner: {predicted:.2f} GB predicted, "
          f"{measured:.2f} GB measured (median): {predicted / measured:.2f}x (goal 0.85-1.15)")
    # The plan's largest phase can be one that ran below its worst case (generation's KV cache and
    # prefix cache are planned for every sample at its longest): each planned phase against its own peak.
    for phase, planned in runs[0].get("planned_phases_gb", {}).items():
        phase_measured = statistics.median(r["phases"][phase] for r in runs)
        print(f"  {phase}: {planned:.2f} GB planned (its peak + the runtime), {phase_measured:.2f} GB measured: "
              f"{planned / phase_measured:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", nargs="+", default=["default", "long_tail"], choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--allocator", choices=("auto", "jemalloc", "system"),
                        help="HYBRIDFLOW_ALLOCATOR for the runs (default: the environment's, else the command's default)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.work)
        return
    work = Path(tempfile.mkdtemp(prefix="memory-timeline-"))
    for workload in args.workloads:
        runs = []
        for i in range(args.repeats):
            runs.append(run_once(workload, args.steps, work, args.allocator))
            print(f"  {workload} run {i + 1}: process peak {runs[-1]['process_peak_gb']:.2f} GB", flush=True)
        report(workload, runs)
    print(f"work dir: {work}")


if __name__ == "__main__":
    if "--worker" in sys.argv:  # as the hybridflow command does, before anything allocates much
        from hybridflow.utils.allocator import choose_allocator

        choose_allocator()
    main()
