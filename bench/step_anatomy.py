"""Where one GRPO step's time and memory go: each phase's seconds, CPU-seconds, FLOP/s against the
machine's matmul bound and peak memory, beside TRL's ``GRPOTrainer`` on the same work (issue 35).

Two workloads, both through ``bench/grpo_step_vs_trl.py``'s machinery (its length oracle, reward,
TRL runner and hybridflow config, so both sides generate and train on the same tokens):

- ``default``: the built-in model's shape (``hybridflow.models.tiny``, ~0.9M parameters, its
  byte-level tokenizer, random weights), 32 prompts x 8 samples, responses of 2-4 tokens (what
  ``hybridflow train`` logs on the arithmetic task), prompts of ``Q<i>: ...`` questions;
- ``longtail``: grpo_step_vs_trl's ~18M Qwen2 shape, 16 prompts x 8, lognormal response lengths
  (median 32, sigma 1, cap 256).

Each configuration runs in its own subprocess, one torch thread, ``--warmup`` steps then ``--steps``
timed ones (medians): hybridflow with ``model.dtype=auto`` (the default: bf16-mixed on a CPU with
avx512_bf16/amx_bf16, float32 elsewhere) and with ``model.dtype=float32``; TRL (micro-batch 64,
no gradient checkpointing: grpo_step_vs_trl's baseline, fp32, bf16 off).

The step table, per hybridflow phase (``timing_s/*``; ``perf/rss_peak_gb/*``):
- CPU-s: this process's CPU-seconds in the phase (every thread; the reward scorer's subprocess not
  counted). ``gen`` and ``reward`` share one window (scoring overlaps generation), so their CPU is
  the whole of ``phases.collect``, shown on ``gen``;
- GFLOP: matmul FLOPs of the phase's real tokens (``step_flops``): 2 per weight per token, the
  causal attention's 2·L²·hidden per layer, the LM head over the rows it scores; a backward twice
  its forward, the head's recompute once more. Generation counts every sample's prompt and
  response (the work of a model without a prefix cache);
- fraction: the CPU-seconds the matmul probe (``bench/update_bound.py``'s ``Bound``) needs for those
  FLOPs at the phase's shapes, in the phase's compute dtype, over the CPU-seconds measured.

TRL has two parts, generation (its ``generate``) and the rest of the step; hybridflow's rows are
grouped the same way for the ratios, TRL / hybridflow (above 1: hybridflow is faster or smaller).
The actor update is then cut into forward, LM head, backward and optimizer by
``bench/update_bound.py`` on the same lengths, in the dtype each configuration trained in.

    python bench/step_anatomy.py                         # both workloads (~15 min on 2 cores)
    python bench/step_anatomy.py --workloads default --steps 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpo_step_vs_trl as vs_trl
import update_bound

GEN_PHASES = ("gen", "reward")  # one window: scoring overlaps generation
FORWARD_PHASES = ("old_log_prob", "ref")  # a forward over every token, the head over the response rows
UPDATE_PHASE = "update_actor"
CONFIGS = {"auto": ["model.dtype=auto"], "float32": ["model.dtype=float32"], "trl": None}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    model: str  # "builtin" (hybridflow.models.tiny) or "18M" (grpo_step_vs_trl's shape)
    prompts: int
    n: int
    median_tokens: float
    sigma: float
    max_tokens: int


WORKLOADS = {
    "default": WorkloadSpec("default", "builtin", 32, 8, 3.0, 0.2, 4),
    "longtail": WorkloadSpec("longtail", "18M", 16, 8, 32.0, 1.0, 256),
}


# --------------------------------------------------------------------------------------------
# FLOPs (pure: tests/unit/core/test_bench_step_anatomy.py)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    linears: tuple[tuple[int, int], ...]  # (in, out) of every decoder linear layer, the head excluded
    hidden: int
    vocab: int
    layers: int

    @classmethod
    def of(cls, model) -> ModelShape:
        return cls(tuple(update_bound.linear_shapes(model)), model.config.hidden_size,
                   model.get_output_embeddings().out_features, model.config.num_hidden_layers)


def step_flops(shape: ModelShape, prompts: list[int], responses: list[int], decode_rows: int,
               max_rows: int = 4096) -> update_bound.Flops:
    """Matmul FLOPs of one step's phases as ``update_bound.Flops`` GEMMs (rows, in, out, count),
    the rows capped at ``max_rows`` with the count scaled (the probe's rate is flat beyond it).
    Generation's decoder GEMMs run ``decode_rows`` rows at a time (the batch width of a decode step)."""
    lengths = [p + r for p, r in zip(prompts, responses, strict=True)]
    tokens, rows = sum(lengths), sum(responses)
    attention = float(sum(2 * shape.layers * length * length * shape.hidden for length in lengths))
    flops = update_bound.Flops()

    def gemm(phase: str, m: int, k: int, n: int, count: float) -> None:
        if m > 0:
            flops.gemms.setdefault(phase, []).append((min(m, max_rows), k, n, count * m / min(m, max_rows)))

    for phase, passes, head_passes in (("gen", 1, 1), *((p, 1, 1) for p in FORWARD_PHASES), (UPDATE_PHASE, 3, 4)):
        width = decode_rows if phase == "gen" else tokens
        for k, n in shape.linears:
            gemm(phase, width, k, n, passes * tokens / width)
        gemm(phase, min(rows, width) if phase == "gen" else rows, shape.hidden, shape.vocab,
             head_passes * rows / (min(rows, width) if phase == "gen" else rows))
        flops.attention[phase] = passes * attention
    return flops


# --------------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------------


class CpuLedger:
    """This process's CPU-seconds per hybridflow phase, per step: wraps ``PhaseTimer.phase`` (and
    ``phases.collect``, the generation-and-scoring window whose parts the timer books with ``add``)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}

    def install(self) -> None:
        from hybridflow.controller import phases
        from hybridflow.utils.timer import PhaseTimer

        ledger, phase, collect = self, PhaseTimer.phase, phases.collect

        @contextlib.contextmanager
        def timed_phase(timer, name):
            cpu0 = time.process_time()
            with phase(timer, name):
                yield
            ledger.note(name, time.process_time() - cpu0)

        def timed_collect(*args, **kwargs):
            cpu0 = time.process_time()
            try:
                return collect(*args, **kwargs)
            finally:
                ledger.note("gen", time.process_time() - cpu0)

        PhaseTimer.phase, phases.collect = timed_phase, timed_collect

    def note(self, name: str, cpu: float) -> None:
        self._current[name] = self._current.get(name, 0.0) + cpu
        if name == "step":  # the step's phase closes last
            self.steps.append(self._current)
            self._current = {}


def worker_main(spec_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    children = vs_trl.ChildRSS()
    if spec["config"] == "trl":  # grpo_step_vs_trl.CONFIGS["trl"]: micro-batch 64, no checkpointing
        result = vs_trl.run_trl(spec)
    else:
        ledger = CpuLedger()
        ledger.install()
        result = vs_trl.run_hybridflow(spec)
        for step, cpu in zip(result["steps"], ledger.steps[spec["warmup"]:], strict=True):
            step["cpu_s"] = cpu
        out = Path(spec["out"])
        result["record"] = json.loads((out / "token_budgets.json").read_text())["budgets"]
        # An explicit model.dtype is the config's, not recorded (only auto's choice is).
        result["record"].setdefault("model.dtype", spec["config"])
        result["rollout_dtype"] = json.loads((out / "rollout_dtype.json").read_text())["dtype"]
    result["peak_rss_gb"] = (vs_trl.own_peak_rss_bytes() + children.stop()) / 1e9
    print("RESULT " + json.dumps(result), flush=True)


def run_config(spec: dict, work: Path) -> dict:
    path = work / f"anatomy-{spec['config']}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec['config']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# --------------------------------------------------------------------------------------------
# The parent: workload, runs, tables
# --------------------------------------------------------------------------------------------


def write_workload(w: WorkloadSpec, work: Path) -> tuple[list[str], list[list[int]]]:
    if w.model == "builtin":
        from hybridflow.models.tiny import write_tiny_model

        write_tiny_model(work / "model")
    else:
        vs_trl.write_model(work / "model", quick=False)
    texts = vs_trl.prompt_texts(w.prompts)
    with open(work / "prompts.jsonl", "w") as out:
        for i, text in enumerate(texts):
            out.write(json.dumps({"data_source": "bench", "prompt": [{"role": "user", "content": text}],
                                  "ability": "bench", "reward_model": {"style": "rule", "ground_truth": "0"},
                                  "extra_info": {"index": i}}) + "\n")
    (work / "reward.py").write_text(vs_trl.REWARD_SOURCE)
    return texts, vs_trl.target_lengths(w.prompts, w.n, w.median_tokens, w.sigma, w.max_tokens)


def prompt_token_lengths(work: Path, texts: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    chat = (tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts)
    return [len(tokenizer.encode(text, add_special_tokens=False)) for text in chat]


def median_of(steps: list[dict], get) -> float:
    return statistics.median(get(s) for s in steps)


def phase_rows(result: dict, flops: update_bound.Flops, bound: update_bound.Bound, dtypes: dict[str, str]) -> list:
    """(phase, s, CPU-s, GFLOP, fraction, peak GB) of each phase hybridflow timed, step last."""
    import torch

    steps = result["steps"]
    names = [k for k in steps[0]["timing"] if k not in ("step", "reward")] + ["step"]
    rows = []
    for name in names:
        wall = median_of(steps, lambda s: s["timing"].get(name, 0.0) + (s["timing"].get("reward", 0.0)
                                                                          if name == "gen" else 0.0))
        cpu = median_of(steps, lambda s: s["cpu_s"].get(name, 0.0)) if name in steps[0]["cpu_s"] else None
        peak = median_of(steps, lambda s: s["rss_gb"].get(name, 0.0)) if name in steps[0]["rss_gb"] else None
        gflop = fraction = None
        if name in flops.gemms:
            gflop = flops.total(name) / 1e9
            dtype = torch.bfloat16 if dtypes["rollout" if name == "gen" else "train"] == "bfloat16" else torch.float32
            _, bound_cpu = bound.seconds(flops, name, dtype)
            fraction = bound_cpu / cpu if cpu else None
        rows.append(("gen+reward" if name == "gen" else name, wall, cpu, gflop, fraction, peak))
    return rows


def fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def step_table(label: str, rows: list) -> str:
    lines = [f"{label}", f"  {'phase':<16} {'s':>7} {'CPU-s':>7} {'GFLOP':>7} {'fraction':>8} {'peak GB':>7}"]
    for name, wall, cpu, gflop, fraction, peak in rows:
        lines.append(f"  {name:<16} {fmt(wall, '.3f', 7)} {fmt(cpu, '.3f', 7)} {fmt(gflop, '.2f', 7)} "
                     f"{fmt(fraction, '.2f', 8)} {fmt(peak, '.2f', 7)}")
    return "\n".join(lines)


def versus_trl(label: str, ours: dict, trl: dict) -> str:
    """Generation, the rest of the step and the whole step, TRL / ours by wall and by CPU-seconds."""
    o, t = ours["steps"], trl["steps"]
    parts = {
        "generation": (median_of(o, lambda s: s["gen"]), median_of(o, lambda s: s["cpu_s"].get("gen", 0.0)),
                       median_of(t, lambda s: s["gen"]), median_of(t, lambda s: s["gen_cpu"])),
        "rest of step": (median_of(o, lambda s: s["step"] - s["gen"]),
                         median_of(o, lambda s: s["cpu_s"]["step"] - s["cpu_s"].get("gen", 0.0)),
                         median_of(t, lambda s: s["step"] - s["gen"]), median_of(t, lambda s: s["cpu"] - s["gen_cpu"])),
        "whole step": (median_of(o, lambda s: s["step"]), median_of(o, lambda s: s["cpu_s"]["step"]),
                       median_of(t, lambda s: s["step"]), median_of(t, lambda s: s["cpu"])),
    }
    lines = [f"{label} vs TRL (TRL / hybridflow: above 1, hybridflow is faster or smaller)",
             f"  {'part':<14} {'ours s':>7} {'ours CPU':>8} {'TRL s':>7} {'TRL CPU':>8} {'wall x':>7} {'CPU x':>7}"]
    for name, (ow, oc, tw, tc) in parts.items():
        lines.append(f"  {name:<14} {ow:7.2f} {oc:8.2f} {tw:7.2f} {tc:8.2f} {tw / ow:7.2f} {tc / max(oc, 1e-9):7.2f}")
    lines.append(f"  {'peak RSS GB':<14} {ours['peak_rss_gb']:7.2f} {'':8} {trl['peak_rss_gb']:7.2f} {'':8} "
                 f"{trl['peak_rss_gb'] / ours['peak_rss_gb']:7.2f}   (ours / TRL {ours['peak_rss_gb'] / trl['peak_rss_gb']:.2f})")
    return "\n".join(lines)


def run_workload(w: WorkloadSpec, args: argparse.Namespace, bound: update_bound.Bound) -> None:
    import torch

    work = Path(tempfile.mkdtemp(prefix=f"step-anatomy-{w.name}-"))
    texts, targets = write_workload(w, work)
    prompts = prompt_token_lengths(work, texts)
    sample_prompts = [p for p in prompts for _ in range(w.n)]
    responses = [t for row in targets for t in row]
    print(f"\n== {w.name}: {w.prompts} prompts x {w.n}, prompt tokens {min(prompts)}-{max(prompts)}, response tokens "
          f"{min(responses)}-{max(responses)} (mean {statistics.mean(responses):.1f}, {sum(responses)} in all), "
          f"{args.threads} thread(s), {args.warmup} warm-up + {args.steps} timed step(s); work dir {work}", flush=True)
    base = dict(work=str(work), prompts=w.prompts, n=w.n, max_tokens=w.max_tokens, max_prompt_length=128,
                threads=args.threads, warmup=args.warmup, steps=args.steps, targets=targets, prompt_texts=texts, kl=False)
    results = {}
    for config in args.configs:
        out = work / f"out-{config}"
        overrides = [*(CONFIGS[config] or []), f"trainer.output_dir={out}"]
        results[config] = run_config(dict(base, config=config, out=str(out), overrides=overrides), work)
        print(f"  {config}: {median_of(results[config]['steps'], lambda s: s['step']):.2f} s/step", flush=True)
    from hybridflow.models.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(TinyModelSpec()) if w.model == "builtin" else update_bound.longtail_model()
    shape = ModelShape.of(model)
    flops = step_flops(shape, sample_prompts, responses, decode_rows=w.prompts * w.n)
    for config, result in results.items():
        if config == "trl":
            continue
        dtypes = {"train": result["record"]["model.dtype"], "rollout": result["rollout_dtype"]}
        label = (f"hybridflow, model.dtype={config} (trained in {dtypes['train']}, rollout in {dtypes['rollout']}), "
                 f"peak RSS {result['peak_rss_gb']:.2f} GB")
        print(step_table(label, phase_rows(result, flops, bound, dtypes)))
        if "trl" in results:
            print(versus_trl(f"hybridflow, model.dtype={config}", result, results["trl"]))
    # The update cut into phases, on the same lengths, in each configuration's training dtype.
    precisions = sorted({r["record"]["model.dtype"] for c, r in results.items() if c != "trl"})
    if precisions:
        budget = next(r["record"]["actor.ppo_max_token_len_per_gpu"] for c, r in results.items() if c != "trl")
        workload = update_bound.Workload(w.name, lambda: build_tiny_model(TinyModelSpec()) if w.model == "builtin"
                                         else update_bound.longtail_model(), sample_prompts, responses, w.n)
        torch.set_num_threads(args.threads)
        update_bound.run_workload(workload, argparse.Namespace(precisions=precisions, repeats=args.update_repeats,
                                                               max_token_len=budget, optimizers=False), bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--update-repeats", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    import torch

    from hybridflow.utils.device import cpu_features, rule_train_dtype

    torch.set_num_threads(args.threads)
    dtype, why = rule_train_dtype("cpu")
    print(f"{cpu_features().describe()}; torch {torch.__version__}; model.dtype=auto here: {dtype} ({why})")
    bound = update_bound.Bound()
    for name in args.workloads:
        run_workload(WORKLOADS[name], args, bound)


if __name__ == "__main__":
    main()
