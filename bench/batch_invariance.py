"""Does a sample depend on the batch it decodes in? The same seeded requests (prompts of mixed lengths,
responses of mixed lengths) on engines that hold at most 1, 4 or 8 rows at a time, against one that
holds all of them: how many samples' tokens differ, and the largest logprob difference among those
whose tokens agree. Zero and 0.0 mean a sample is the same to the bit whatever else is batched: what
lets 1 or 2 replicas, a long tail's last rows and the asynchronous loops' changing batches give the
same samples.

    python bench/batch_invariance.py --model qwen2-20m     # bf16 here where avx512_bf16 (rollout.dtype=auto)
    python bench/batch_invariance.py --model tiny          # the built-in model's shape, fp32

Numerics, not timing: the figures do not depend on the load.
"""

from __future__ import annotations

import argparse

import torch
from lone_replica_cores import engine, outputs
from rollout_compute_bound import build_prompts
from rollout_long_tail import build_model

from hybridflow.rollout.base import choose_rollout_dtype
from hybridflow.types import GenerationRequest, SamplingParams
from hybridflow.utils.device import cpu_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2-20m", choices=("qwen2-20m", "tiny"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="the engines' max_batch_size")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dtype = choose_rollout_dtype(args.dtype, torch.device("cpu"), model=build_model(args.model)).dtype
    # Prompts of 8 to 47 tokens and responses of 32 to 71: rows join and leave the batch at different steps.
    prompts = [prompt[: 8 + (i * 5) % 40] for i, prompt in enumerate(build_prompts(args.requests, 48))]
    requests = [GenerationRequest(prompt_ids=prompt, request_id=str(i), params=SamplingParams(
        temperature=1.0, max_tokens=32 + (i * 7) % 40, ignore_eos=True, logprobs=0, seed=i))
        for i, prompt in enumerate(prompts)]
    print(f"cpu: {cpu_features().describe()}; {args.model} {dtype}; {args.requests} seeded requests")
    reference = outputs(engine(args.model, dtype, args.requests).generate_batch(requests))
    for rows in args.rows:
        got = outputs(engine(args.model, dtype, rows).generate_batch(requests))
        differ = sum(a[0] != b[0] for a, b in zip(reference, got, strict=True))
        same = [(a[1], b[1]) for a, b in zip(reference, got, strict=True) if a[0] == b[0]]
        largest = max((abs(x - y) for a, b in same for x, y in zip(a, b, strict=True)), default=0.0)
        print(f"at most {rows:3d} rows vs {args.requests}: {differ}/{args.requests} samples' tokens differ; "
              f"largest logprob difference where they agree {largest:.2e}")


if __name__ == "__main__":
    main()
