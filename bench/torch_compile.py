"""actor.use_torch_compile on a CPU: the training engine's optimizer step with its decoder layers
compiled vs eager, on one model and one batch in one process (issue 32, item 5).

Both engines start from the same weights and train on the same padded batch (``--batch`` samples of
``--length`` tokens, fixed so that no step recompiles). Reported: the compiled engine's first step
(compiling), then the median of ``--steps`` further steps on each side, their ratio, and the largest
loss difference between the two sides (the same updates, so the same losses up to float rounding).

    python bench/torch_compile.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from rollout_long_tail import build_model  # the ~20M shape, one definition

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import Trajectory, collate_trajectories


def make_batch(batch: int, length: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(batch):
        ids = torch.randint(300, vocab - 100, (length,), generator=generator).tolist()
        half = length // 2
        trajectories.append(Trajectory(prompt_ids=ids[:half], response_ids=ids[half:], loss_mask=[1] * (length - half),
                                       rollout_logprobs=[0.0] * (length - half), finish_reason="length", group_id=i))
    return collate_trajectories(trajectories, pad_token_id=0)


def step_times(engine: TrainEngine, batch, steps: int) -> tuple[float, list[float], list[float]]:
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        loss = agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens)
        return loss, {"loss": float(loss)}

    times, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        losses.append(engine.optimizer_step([batch], loss_fn, temperature=1.0, with_entropy=False)["loss"])
        times.append(time.perf_counter() - start)
    return times[0], times[1:], losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="qwen2-20m", choices=("tiny", "qwen2-20m"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    batch = make_batch(args.batch, args.length, model.config.vocab_size)
    spec = OptimSpec(lr=1e-4)
    eager_first, eager, eager_losses = step_times(TrainEngine(copy.deepcopy(model), spec, torch.device("cpu")), batch,
                                                  args.steps)
    engine = TrainEngine(copy.deepcopy(model), spec, torch.device("cpu"), compile_layers=True)
    compile_first, compiled, compiled_losses = step_times(engine, batch, args.steps)
    assert engine.compiler is not None and engine.compiler.active, "compiling failed: the engine fell back to eager"
    gap = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses, strict=True))
    print(f"{args.model}, {args.batch} x {args.length} tokens, {args.threads} threads, {args.steps} steps each")
    print(f"first step: eager {eager_first:.2f} s, compiled {compile_first:.1f} s (compiling)")
    print(f"median step: eager {statistics.median(eager):.3f} s, compiled {statistics.median(compiled):.3f} s; "
          f"eager / compiled {statistics.median(eager) / statistics.median(compiled):.2f}x; "
          f"largest loss difference {gap:.2e}")


if __name__ == "__main__":
    main()
