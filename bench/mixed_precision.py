"""Training in bf16 mixed precision vs fp32 on this CPU: speed of the update and of the logprob
pass, and what bf16 compute does to the logprobs the policy ratio is built from.

Mixed precision is what ``model.dtype=bfloat16`` gives the actor: fp32 master weights and Adam
state, the forward and backward under ``torch.autocast(bfloat16)`` (one rank; FSDP2's
``MixedPrecisionPolicy`` does the same per shard). Workload: a random ~20M-parameter
Qwen2-shaped model (vocab 4096, hidden 512, 6 layers, GQA 8/2), ``--samples`` sequences of
``--prompt`` + ``--response`` tokens, one optimizer step over ``--micro`` -sample micro-batches, and
a no-grad logprob pass. Both precisions run alternately ``--repeats`` times after a warm-up; medians
are compared in the same run with the same threads.

Agreement: logprobs of the response tokens from the bf16 forward against the fp32 forward of the
same weights (max and mean absolute difference, and the implied |ratio - 1| a PPO clip sees), plus
how far one bf16-mixed optimizer step moves the weights from the fp32 step.

    python bench/mixed_precision.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch


def build_model(seed: int = 0) -> torch.nn.Module:
    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def build_batch(args: argparse.Namespace) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    b, p, r = args.samples, args.prompt, args.response
    ids = torch.randint(0, 4096, (b, p + r), generator=g)
    attention = torch.ones_like(ids)
    batch = TrainBatch(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1),
                       response_mask=torch.ones(b, r), group_ids=torch.arange(b) // 4, rewards=torch.zeros(b),
                       rollout_logprobs=torch.zeros(b, r), prompt_length=p)
    batch.advantages = torch.randn(b, 1, generator=g).expand(b, r).contiguous()
    return batch


def loss_fn_for(batch: TrainBatch):
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        return agg_loss(-mb.advantages * logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    batch = build_batch(args)
    loss_fn = loss_fn_for(batch)
    engines = {
        "fp32": TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-5), torch.device("cpu")),
        "bf16-mixed": TrainEngine(copy.deepcopy(model), OptimSpec(lr=1e-5), torch.device("cpu"),
                                  mixed_precision=torch.bfloat16),
    }
    tokens = int(batch.attention_mask.sum())
    logprobs = {name: e.compute_logprobs(batch, temperature=1.0, micro_batch_size=args.micro)[0] for name, e in engines.items()}
    for e in engines.values():  # warm-up step (and the step the weight comparison uses)
        e.optimizer_step(batch.split(args.micro), loss_fn, temperature=1.0, with_entropy=False)
    times: dict[str, dict[str, list[float]]] = {n: {"update": [], "logprob": []} for n in engines}
    for _ in range(args.repeats):
        for name, e in engines.items():
            start = time.perf_counter()
            e.compute_logprobs(batch, temperature=1.0, micro_batch_size=args.micro)
            times[name]["logprob"].append(time.perf_counter() - start)
            start = time.perf_counter()
            e.optimizer_step(batch.split(args.micro), loss_fn, temperature=1.0, with_entropy=False)
            times[name]["update"].append(time.perf_counter() - start)

    print(f"~{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {args.samples} x "
          f"({args.prompt}+{args.response}) tokens, micro-batch {args.micro}, {args.threads} threads, "
          f"median of {args.repeats}")
    for phase in ("update", "logprob"):
        fp32, bf16 = (statistics.median(times[n][phase]) for n in engines)
        print(f"{phase:8s} fp32 {fp32:6.2f} s ({tokens / fp32:7.0f} tok/s)   bf16-mixed {bf16:6.2f} s "
              f"({tokens / bf16:7.0f} tok/s)   speed-up {fp32 / bf16:.2f}x")
    diff = (logprobs["bf16-mixed"] - logprobs["fp32"]).abs()
    ratio = (logprobs["bf16-mixed"] - logprobs["fp32"]).exp().sub(1).abs()
    print(f"logprob |bf16 - fp32|: max {diff.max():.4f}, mean {diff.mean():.5f}; "
          f"|ratio - 1|: mean {ratio.mean():.5f}, p99 {ratio.flatten().quantile(0.99):.4f}, "
          f"share beyond the 0.2 clip {float((ratio > 0.2).float().mean()):.5f}")
    # The first optimizer step from identical weights: how far does bf16 compute move it.
    a = torch.cat([p.detach().flatten() for p in engines["fp32"].model.parameters()])
    b = torch.cat([p.detach().flatten() for p in engines["bf16-mixed"].model.parameters()])
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    print(f"weights after {args.repeats + 1} steps: |bf16 - fp32| / |fp32 - start| = "
          f"{float((b - a).norm() / (a - start).norm()):.3f}")


if __name__ == "__main__":
    main()
