"""Weight sync on the Ray backend: rollout.weight_sync=object_store vs broadcast, same RL job.

``object_store``: actor rank 0 returns the full weights to the controller through Ray's object
store, and the controller sends them on to the rollout process the same way (two pickled copies
of the model through the controller per step). ``broadcast``: actor rank 0 streams them straight
to the rollout process in 32 MB buckets over a gloo group (``hybridflow.transfer.weight_transfer``).

Workload: a one-rank GRPO job (actor and rollout each a Ray actor process) on a random-init model,
``--model tiny`` (the built-in ~0.9M-parameter Qwen2) or ``--model 20m`` (a ~18M-parameter Qwen2
of the same family, 72 MB in fp32), ``--prompts`` prompts x ``--n`` samples, one torch thread per
process, no checkpoint. Both modes share the seed, so they draw the same samples and do the same
math. Step 1 (warm-up) is left out; the modes alternate for ``--repeats`` runs each in one Ray
cluster, and the median of ``timing_s/update_weights`` over all timed steps is compared.

    python bench/ray_weight_sync.py --model tiny
    python bench/ray_weight_sync.py --model 20m

Prints the median sync time per mode and the ratio object_store / broadcast (> 1: broadcast is
faster), and the median step time of each mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from hybridflow import api
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, write_tiny_model

MODES = ("object_store", "broadcast")
PHASES = ("timing_s/update_weights", "timing_s/step")
# The built-in tokenizer's vocabulary with a wider, deeper body: 6 layers of width 512 (the shape
# of bench/rollout_long_tail.py's qwen2-20m, with this tokenizer's 272-token vocabulary).
MODELS = {
    "tiny": TinyModelSpec(),
    "20m": TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=2),
}


def run(
    mode: str, out: Path, model_dir: Path, train: Path, val: Path, args: argparse.Namespace
) -> list[dict[str, float]]:
    """The phase times of each timed step (steps 2..N) of one Ray run in ``mode``."""
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={out}", "trainer.backend=ray", f"rollout.weight_sync={mode}",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n}", f"rollout.n={args.n}",
        f"data.max_response_length={args.max_tokens}", f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_final=false", "trainer.num_threads=1",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        # Both transports between processes: the rollout in a process of its own (a broadcast keeps one anyway).
        "trainer.hybrid_engine=false",
    ]
    api.train(api.make_config("grpo", overrides=overrides))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{p: r[p] for p in PHASES} for r in records if r.get("training/global_step", 0) >= 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is the untimed warm-up)")
    torch.set_num_threads(1)
    spec = MODELS[args.model]
    weights = build_tiny_model(spec).state_dict()
    megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    steps: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_tiny_model(root / "model", spec)
        train, val = write_arithmetic_task(root / "data", train_size=max(64, args.prompts * args.steps), val_size=4)
        for repeat in range(args.repeats):
            for mode in MODES:
                steps[mode] += run(mode, root / f"{mode}-{repeat}", model_dir, train, val, args)
    median = {mode: {p: statistics.median(s[p] for s in steps[mode]) for p in PHASES} for mode in MODES}
    print(f"\n--model {args.model}: {megabytes:.1f} MB of weights (state dict, fp32), one actor rank, "
          f"{args.repeats} x {args.steps - 1} timed steps per mode (median s):")
    print(f"{'mode':<14}{'update_weights':>16}{'step':>10}")
    for mode in MODES:
        print(f"{mode:<14}{median[mode]['timing_s/update_weights']:>16.4f}{median[mode]['timing_s/step']:>10.4f}")
    ratio = median["object_store"]["timing_s/update_weights"] / median["broadcast"]["timing_s/update_weights"]
    print(f"timing_s/update_weights ratio object_store / broadcast: {ratio:.2f}x")


if __name__ == "__main__":
    main()
