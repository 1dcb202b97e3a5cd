"""Wall time of the training loops on a long-tailed workload: sync vs one_step_off vs fully_async.

The workload of ``bench/grpo_step_vs_trl.py``: a ~18M-parameter Qwen2-shaped model written as a
local Hugging Face directory, ``--prompts`` prompts x ``--n`` samples per step at temperature 1,
response lengths from a lognormal (median ``--median-tokens``, sigma ``--sigma``, cap
``--max-tokens``) forced by a length oracle in the engine, so every loop generates and trains on
exactly the same tokens: each step takes the next ``--prompts`` prompts of a fixed order, and
prompt i's sample j always has the same length. fp32, AdamW, one optimizer step per batch.

The async loops weight the loss by π_old/π_rollout (``async_training.behaviour_correction``),
which costs an old-logprob forward per step that the sync loop with one optimizer step per batch
skips; ``--configs`` can add the same algorithm on both sides ("sync, 1 thread, IS", and the async
loops "no IS").

Thread budgets: ``trainer.num_threads=1`` for every loop. The sync loop then runs generation and
training one after the other on one core; the asynchronous loops run the rollout in a thread of
its own, so generation and training each get one of the two cores (the CPU stand-in for split
placement: rollout and trainer on separate devices). A sync row with 2 threads is shown for
reference (one loop using both cores for each phase in turn).

Each configuration runs in its own subprocess: ``--warmup`` steps, then ``--steps`` timed ones;
the figure is the trainer's wall time over the timed steps (sum of ``timing_s/step``), the median
over ``--repeats`` rounds in which the configurations alternate. Also shown: the trainer's and
the rollout's idle ratios (``async/trainer_idle_ratio``, ``async/rollout_idle_ratio``) and the
mean staleness.

    python bench/async_long_tail.py                  # ~25 min on 2 cores
    python bench/async_long_tail.py --quick          # smoke run (~2 min)

The run folders stay (printed): ``hybridflow simulate <a sync run> --devices 2 --rollout-fraction
0.5`` predicts the asynchronous loops from the sync run's costs, to compare with the measured rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step_vs_trl import (  # noqa: E402  (the shared workload)
    REWARD_SOURCE,
    force_lengths,
    prompt_texts,
    target_lengths,
    write_model,
)

CONFIGS: dict[str, tuple[list[str], int]] = {  # label -> (overrides, torch threads)
    "sync, 2 threads": (["trainer.mode=sync"], 2),
    "sync, 1 thread": (["trainer.mode=sync"], 1),
    "one_step_off": (["trainer.mode=one_step_off"], 1),
    "fully_async s=1": (["trainer.mode=fully_async", "async_training.staleness_threshold=1"], 1),
    "fully_async s=2": (["trainer.mode=fully_async", "async_training.staleness_threshold=2"], 1),
    "fully_async s=1, completion": (["trainer.mode=fully_async", "async_training.staleness_threshold=1",
                                     "async_training.consume_order=completion"], 1),
    # The same algorithm on both sides: the sync loop with the async loops' behaviour correction
    # (an old-logprob forward per step), and the async loops without it (no extra forward).
    "sync, 1 thread, IS": (["trainer.mode=sync", "algorithm.rollout_correction.rollout_is=token"], 1),
    "one_step_off, no IS": (["trainer.mode=one_step_off", "async_training.behaviour_correction=false"], 1),
    "fully_async s=1, no IS": (["trainer.mode=fully_async", "async_training.staleness_threshold=1",
                                "async_training.behaviour_correction=false"], 1),
}
BASELINE = "sync, 1 thread"
LR = 1e-6


def run_loop(spec: dict) -> dict:
    import torch

    from hybridflow import api
    from hybridflow.controller.loops import make_trainer
    from hybridflow.controller.setup import build_run

    targets = spec["targets"]

    def oracle(logits, rows):
        prompt_rows = [int(r.rsplit(":", 1)[1]) for r in rows.request_ids]
        wanted = torch.tensor([targets[p][s] for p, s in zip(prompt_rows, rows.sample_indices)])
        return force_lengths(logits, rows.output_lengths, wanted)

    work, out = Path(spec["work"]), Path(spec["out"])
    overrides = [
        f"model.path={work / 'model'}", f"data.train_files=[{work / 'prompts.jsonl'}]",
        f"data.val_files=[{work / 'prompts.jsonl'}]", "trainer.val_before_train=false", "trainer.test_freq=0",
        "data.max_prompt_length=128", f"data.max_response_length={spec['max_tokens']}",
        f"data.train_batch_size={spec['prompts']}", f"actor.ppo_mini_batch_size={spec['prompts']}",
        f"rollout.n={spec['n']}", "data.shuffle=false", "warm_start.enable=false",
        f"actor.ppo_micro_batch_size_per_gpu={min(64, spec['prompts'] * spec['n'])}",
        f"actor.log_prob_micro_batch_size_per_gpu={min(128, spec['prompts'] * spec['n'])}",
        f"trainer.total_training_steps={spec['warmup'] + spec['steps']}",
        "trainer.save_freq=0", "trainer.save_final=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.num_threads={spec['threads']}", f"trainer.output_dir={out}", "trainer.resume_mode=disable",
        f"actor.optim.lr={LR}", "actor.optim.weight_decay=0.0", f"reward.custom_reward_function.path={work / 'reward.py'}",
        *spec["overrides"],
    ]
    run = build_run(api.make_config("grpo", overrides=overrides))
    # The validation at the last step is not timed (timing_s/step covers the step only); keep it short.
    run.prompts = dataclasses.replace(run.prompts, val=None)
    try:
        for group in run.roles.rollout.groups:
            group._workers[0].engine._runner.logits_processors = (oracle,)
        make_trainer(run).fit()
    finally:
        run.close()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > spec["warmup"]]
    return {
        "seconds": sum(r["timing_s/step"] for r in timed),
        # The rollout's busy seconds: the step's generation (sync, one_step_off) or the rollout
        # thread's work since the last step (fully_async).
        "gen": sum(r.get("timing_s/gen", r.get("timing_s/rollout_busy", 0.0)) for r in timed),
        "trainer_idle": statistics.mean(r.get("async/trainer_idle_ratio", 0.0) for r in timed),
        "rollout_idle": statistics.mean(r.get("async/rollout_idle_ratio", 0.0) for r in timed),
        "staleness": statistics.mean(r.get("async/staleness/mean", 0.0) for r in timed),
        "partial": statistics.mean(r.get("async/partial_rollout_fraction", 0.0) for r in timed),
        "tokens": sum(r["response_length/mean"] * spec["prompts"] * spec["n"] for r in timed),
        "out": str(out),
    }


def run_config(spec: dict, work: Path, index: int) -> dict:
    path = work / f"spec-{index}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec['label']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 prompts x 4, cap 32: a smoke run")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS)[:5], choices=list(CONFIGS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--median-tokens", type=float, default=32.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        print("RESULT " + json.dumps(run_loop(spec)), flush=True)
        return
    if args.quick:
        args.prompts, args.n, args.max_tokens, args.median_tokens, args.steps, args.repeats = 4, 4, 32, 8.0, 2, 1

    work = Path(tempfile.mkdtemp(prefix="async-long-tail-"))
    write_model(work / "model", args.quick)
    total = args.prompts * (args.warmup + args.steps)
    texts = prompt_texts(total)
    with open(work / "prompts.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"data_source": "bench", "prompt": [{"role": "user", "content": text}],
                                "ability": "bench", "reward_model": {"style": "rule", "ground_truth": "0"},
                                "extra_info": {"index": i}}) + "\n")
    (work / "reward.py").write_text(REWARD_SOURCE)
    targets = target_lengths(total, args.n, args.median_tokens, args.sigma, args.max_tokens)
    flat = [t for row in targets for t in row]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"workload: {'quick: ~0.5M' if args.quick else '~18M'} Qwen2-shaped model, {args.prompts} prompts x "
          f"n={args.n} per step, lognormal lengths (median {args.median_tokens:g}, sigma {args.sigma:g}, cap "
          f"{args.max_tokens}: mean {statistics.mean(flat):.1f}, max {max(flat)}), fp32, {args.warmup} warm-up + "
          f"{args.steps} timed steps")
    print(f"cpu: {cpu}, {os.cpu_count()} cores; median over {args.repeats} alternating round(s); runs in {work}")

    results: dict[str, list[dict]] = {label: [] for label in args.configs}
    for round_ in range(args.repeats):
        for i, label in enumerate(args.configs):
            overrides, threads = CONFIGS[label]
            spec = dict(label=label, work=str(work), out=str(work / f"run-{round_}-{i}"), overrides=overrides,
                        threads=threads, prompts=args.prompts, n=args.n, max_tokens=args.max_tokens,
                        warmup=args.warmup, steps=args.steps, targets=targets)
            result = run_config(spec, work, i)
            results[label].append(result)
            print(f"  round {round_ + 1}: {label:18s} {result['seconds']:7.1f} s", flush=True)

    base = statistics.median(r["seconds"] for r in results[BASELINE]) if BASELINE in results else None
    print(f"\n| loop | wall s ({args.steps} steps) | vs {BASELINE} | trainer idle | rollout idle | staleness | "
          f"partial rollouts |")
    print("|------|------:|------:|------:|------:|------:|------:|")
    for label, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        ratio = f"{base / seconds:.2f}x" if base else "-"
        print(f"| {label} | {seconds:.1f} | {ratio} | {statistics.median(r['trainer_idle'] for r in runs):.2f} | "
              f"{statistics.median(r['rollout_idle'] for r in runs):.2f} | "
              f"{statistics.median(r['staleness'] for r in runs):.2f} | "
              f"{statistics.median(r['partial'] for r in runs):.2f} |")
    print(f"ratios: {BASELINE} wall time / loop wall time on equal tokens (>1: faster)")
    if base:
        # With the rollout and the trainer on a core each, a loop can at best hide the shorter of the
        # sync step's two parts behind the longer: the ceiling of any overlap on this workload.
        gen = statistics.median(r["gen"] for r in results[BASELINE])
        print(f"overlap ceiling: {base / max(gen, base - gen):.2f}x ({BASELINE}: generation {gen:.1f} s, the rest "
              f"{base - gen:.1f} s)")
        check_simulator(results, args.steps)


def check_simulator(results: dict[str, list[dict]], steps: int) -> None:
    """``hybridflow simulate`` given the first sync run (its costs and lengths) predicts the async
    loops at 2 devices split 1/1 (a core each): its error against what they measured."""
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "simulate", results[BASELINE][0]["out"],
                           "--devices", "2", "--rollout-fraction", "0.5", "--staleness", "1,2"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"simulate failed: {proc.stderr[-2000:]}")
        return
    predicted = {}
    for line in proc.stdout.splitlines():  # "<mode> <devices> <split> <step s> ..." rows of the table
        words = line.replace("fully_async s=", "fully_async_s=").split()
        if len(words) > 3 and words[1] == "2" and words[2] == "1/1":
            predicted[words[0].replace("fully_async_s=", "fully_async s=")] = float(words[3])
    print("\n| loop | simulated s/step | measured s/step | error |\n|------|------:|------:|------:|")
    for label, runs in results.items():
        mode = label.split(",")[0]
        if mode in predicted:
            measured = statistics.median(r["seconds"] for r in runs) / steps
            print(f"| {label} | {predicted[mode]:.2f} | {measured:.2f} | {predicted[mode] / measured - 1:+.1%} |")


if __name__ == "__main__":
    main()
