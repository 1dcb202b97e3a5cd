"""Resident memory and CPU-seconds of the native engine over many rollout rounds, by dtype and decode mode.

Why: oneDNN, which runs a CPU's bf16 matmuls, compiles and keeps a kernel for every matmul shape it
meets. A decode batch whose rows and key length change at every step, and prefill forwards of
varying widths, are new shapes all the time, so an engine at exact shapes grows resident memory
round after round in bf16 (float32 runs in MKL, which keeps nothing per shape). ``decode_mode=static``
(the default on a CPU in reduced precision) pads decode and prefill to bucketed shapes.

Each configuration (``DTYPE:MODE``) runs in its own process, all at once (same moment, same load):
a ~20M Qwen2-shaped model (``rollout_long_tail.build_model``), ``--rounds`` rounds of 16 prompts x 8
samples with lognormal lengths (median 40, cap 256) forced by a length oracle, a fresh length draw
each round; prefix caching is off, as a trainer's weight update clears it between rollouts. Prints
VmRSS and CPU-seconds after every round, then a summary (last round's RSS, growth over the second
half, CPU-seconds per 1,000 tokens).

    python bench/rollout_shape_memory.py --rounds 10 --configs float32:eager bfloat16:eager bfloat16:static
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout_long_tail import (  # noqa: E402
    EOS_TOKEN_ID, PAD_TOKEN_ID, EngineOracle, build_model, build_prompts, engine_run, target_lengths)

PROMPTS, SAMPLES, MEDIAN, SIGMA, CAP = 16, 8, 40, 1.0, 256


def resident_gb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_one(dtype: str, mode: str, rounds: int, threads: int) -> None:
    """One configuration, in this process: one JSON line per round on stdout."""
    from hybridflow.inference.native import NativeEngine

    torch.set_num_threads(threads)
    prompts = build_prompts(4 * PROMPTS)
    oracle = EngineOracle(target_lengths(PROMPTS, SAMPLES, MEDIAN, SIGMA, CAP, seed=0))
    engine = NativeEngine(model=build_model("qwen2-20m"), eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                          max_batch_size=PROMPTS * SAMPLES, dtype=dtype, seed=0, logits_processors=[oracle],
                          decode_mode=mode, enable_prefix_caching=False)
    cpu0 = time.process_time()
    for r in range(rounds):
        oracle.targets = target_lengths(PROMPTS, SAMPLES, MEDIAN, SIGMA, CAP, seed=r)
        tokens = engine_run(engine, [prompts[(r * PROMPTS + i) % len(prompts)] for i in range(PROMPTS)], SAMPLES, CAP)
        print(json.dumps({"round": r, "tokens": tokens, "rss_gb": resident_gb(),
                          "cpu_s": time.process_time() - cpu0}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=["float32:eager", "bfloat16:eager", "bfloat16:static"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # DTYPE:MODE, run in this process
    args = parser.parse_args()
    if args.one:
        dtype, mode = args.one.split(":")
        run_one(dtype, mode, args.rounds, args.threads)
        return
    children = {config: subprocess.Popen([sys.executable, __file__, "--one", config, "--rounds", str(args.rounds),
                                          "--threads", str(args.threads)], stdout=subprocess.PIPE, text=True)
                for config in args.configs}
    rows = {}
    for config, child in children.items():
        out, _ = child.communicate()
        if child.returncode:
            raise SystemExit(f"{config} failed (exit {child.returncode})")
        rows[config] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for config, rounds in rows.items():
        print(f"{config:18s} RSS GB by round: " + " ".join(f"{r['rss_gb']:.2f}" for r in rounds))
    print(f"\n{'config':18s} {'last RSS GB':>11s} {'growth/round, 2nd half MB':>26s} {'CPU s / 1k tokens':>18s}")
    for config, rounds in rows.items():
        half = rounds[len(rounds) // 2 :]
        growth = (half[-1]["rss_gb"] - half[0]["rss_gb"]) / max(1, len(half) - 1) * 1e3
        per_k = rounds[-1]["cpu_s"] / sum(r["tokens"] for r in rounds) * 1e3
        print(f"{config:18s} {rounds[-1]['rss_gb']:11.2f} {growth:26.1f} {per_k:18.3f}")


if __name__ == "__main__":
    main()
