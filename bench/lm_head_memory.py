"""Peak memory of the logprob forward+backward with a 150k vocabulary: the chunked LM head
(``hybridflow.training.lm_head``, the default) against asking the model for its logits.

A tiny Qwen2-shaped model with Qwen2's vocabulary (151,936 tokens), ``--rows`` response tokens
(``--batch`` samples): each variant runs in a fresh process that builds the model, measures its
resident memory, runs the trainer's forward (``TrainEngine.forward_token_stats``: logprobs and
entropy at temperature 1) and a backward of a loss on them, and reports the process's peak
resident memory (``ru_maxrss``) above that starting point. A third variant runs only the model's
body (hidden states, no head) with a loss on them: subtracting it leaves the logits part, the
figure the chunked head is for. Logprobs and gradients of the two paths are equal within 1e-6
(tests/unit/training/test_training_lm_head.py).

    python bench/lm_head_memory.py            # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

VOCAB = 151_936  # Qwen2's


def measure(variant: str, rows: int, batch: int) -> dict[str, float]:
    import torch

    from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
    from hybridflow.training.engine import OptimSpec, TrainEngine
    from hybridflow.types import Trajectory, collate_trajectories

    torch.set_num_threads(1)
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB)
    model = build_tiny_model(spec, seed=0)
    # A trainable engine (an optimizer spec; no step is taken, so no optimizer state is allocated).
    engine = TrainEngine(model, OptimSpec(lr=0.0), torch.device("cpu"), fused_lm_head=variant == "chunked head")
    model.train()
    g = torch.Generator().manual_seed(0)
    per = rows // batch
    trajectories = [Trajectory(torch.randint(0, VOCAB, (8,), generator=g).tolist(),
                               torch.randint(0, VOCAB, (per,), generator=g).tolist(), [1] * per, [0.0] * per, "stop")
                    for _ in range(batch)]
    data = collate_trajectories(trajectories, pad_token_id=0)
    start = _rss_kib()
    if variant == "body only":
        hidden = engine.forward_pass._hidden_states(input_ids=data.input_ids, attention_mask=data.attention_mask,
                                       position_ids=data.position_ids, use_cache=False)
        hidden.float().square().mean().backward()
    else:
        stats = engine.forward_token_stats(data, temperature=1.0, with_entropy=True)
        (stats.logprobs.mean() + 0.01 * stats.entropy.mean()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_extra_mib": (peak - start) / 1024, "fused": float(engine.fused_lm_head)}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="response tokens in the batch")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(measure(args.worker, args.rows, args.batch)))
        return
    results = {}
    for variant in ("body only", "logits", "chunked head"):
        proc = subprocess.run([sys.executable, __file__, "--worker", variant, "--rows", str(args.rows),
                               "--batch", str(args.batch)], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(lines[-1][len("RESULT "):])
    logits_mib = args.rows * VOCAB * 4 / 2**20
    print(f"vocab {VOCAB}, {args.rows} response tokens ({args.batch} x {args.rows // args.batch}), fp32; one "
          f"(tokens x vocab) fp32 array is {logits_mib:.0f} MiB")
    body = results["body only"]["peak_extra_mib"]
    print("| variant | peak above start, MiB | logits part (minus body only), MiB |\n|---|---:|---:|")
    for variant, r in results.items():
        part = "-" if variant == "body only" else f"{r['peak_extra_mib'] - body:.0f}"
        print(f"| {variant} | {r['peak_extra_mib']:.0f} | {part} |")
    full, chunked = (results[v]["peak_extra_mib"] - body for v in ("logits", "chunked head"))
    print(f"logits part: {full / max(chunked, 1e-9):.1f}x less with the chunked head")


if __name__ == "__main__":
    main()
