"""Study the built-in tiny model's warm start: run hybridflow's own SFT on the built-in task
and report greedy accuracy on the held-out split every ``--eval_every`` steps (snapshots saved).

This is how the defaults of ``warm_start.*`` were chosen, e.g.

    python scripts/make_warm_start.py --steps 600 --eval_every 100 --slip_rate 0.6 --out /tmp/warm
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from hybridflow.controller.sft import SFTSpec, run_sft
from hybridflow.data.tasks.arithmetic import arithmetic_sft_pairs, make_arithmetic_rows
from hybridflow.models.loading import load_tokenizer
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.rewards.arithmetic import compute_score
from hybridflow.inference.native import NativeEngine
from hybridflow.types import GenerationRequest, SamplingParams


def greedy_accuracy(model, tokenizer, rows) -> float:
    import copy

    engine = NativeEngine(model=copy.deepcopy(model), eos_token_ids=[tokenizer.eos_token_id],
                          pad_token_id=tokenizer.pad_token_id, max_batch_size=256)
    requests = []
    for row in rows:
        text = tokenizer.apply_chat_template(list(row["prompt"]), tokenize=False, add_generation_prompt=True)
        requests.append(GenerationRequest(tokenizer.encode(text, add_special_tokens=False),
                                          SamplingParams(n=1, temperature=0.0, max_tokens=8)))
    outs = engine.generate_batch(requests)
    correct = 0
    for row, (traj,) in zip(rows, outs):
        text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
        correct += compute_score(text, row["reward_model"]["ground_truth"]) if traj.finish_reason == "stop" else 0
    return correct / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--train_size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slip_rate", type=float, default=0.0, help="flawed-teacher fraction (warm_start.teacher_slip_rate)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    write_tiny_model(out / "init", TinyModelSpec(), seed=0)
    tokenizer = load_tokenizer(out / "init")
    rows = make_arithmetic_rows(args.train_size, 0, "train")
    val = make_arithmetic_rows(256, 0, "test")
    log = []
    start = time.perf_counter()

    def on_step(step, engine, metrics):
        if step % args.eval_every == 0:
            acc = greedy_accuracy(engine.model, tokenizer, val)
            snap = out / f"step{step}"
            engine.model.save_pretrained(snap, safe_serialization=True)
            tokenizer.save_pretrained(snap)
            log.append({"step": step, "loss": metrics["sft/loss"], "val_greedy_acc": acc,
                        "time_s": time.perf_counter() - start})
            print(json.dumps(log[-1]), flush=True)

    run_sft(out / "init", arithmetic_sft_pairs(rows, args.slip_rate), out / "final",
            SFTSpec(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=0), torch.device("cpu"),
            on_step=on_step)
    (out / "log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
