"""Multi-turn agent-like episodes with the native engine's prefix cache on vs off (issue 15, item 4).

Workload: ``--episodes`` episodes served concurrently, each ``--turns`` turns long. Every episode
opens with the same ``--system-tokens`` system prompt and its own ``--user-tokens`` question; turn
k+1's prompt is turn k's prompt + its response (``--response-tokens``, sampled at temperature 1,
``ignore_eos`` so that both sides generate the same lengths) + a ``--tool-tokens`` "tool output".
The model is the ~20M-parameter Qwen2 shape of ``rollout_long_tail.py`` (random weights, fp32),
with fixed torch threads.

Both engines are built from the same weights and served the same episodes, alternating which goes
first, ``--repeats`` times; each repeat draws new questions, tool outputs and seeds. Between
repeats each engine receives a weight sync (the same weights), as between training steps: that
empties the cache, so every repeat starts cold apart from what it computes itself. The responses
of the two sides are compared token by token: restored keys and values come from decode steps
rather than one prefill forward, so fp32 logprobs differ in the last bits (~2e-6 measured), and
once in a few thousand draws the sampler's inverse-CDF lands between two adjacent token ids on the
two sides; the episode then continues differently (same lengths, so the prefill counts are
unaffected). The count of episodes with identical tokens is printed.

Reported (median over repeats): prefill tokens per episode (tokens actually run through prefill),
wall time of the concurrent episodes and the mean episode latency, the hit rate, and the off / on
ratios.

    python bench/prefix_cache.py --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import torch
from rollout_long_tail import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model  # the ~20M shape, one definition

from hybridflow.inference.native import NativeEngine
from hybridflow.types import GenerationRequest, SamplingParams

VOCAB_LOW, VOCAB_HIGH = 300, 4000  # ordinary token ids of the 4096-token model, clear of specials


@dataclass(frozen=True)
class Run:
    prefill_tokens_per_episode: float
    wall_s: float
    episode_s: float  # mean latency of one episode, all served concurrently
    hit_rate: float
    responses: list[list[int]]


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


async def episode(
    engine: NativeEngine, args: argparse.Namespace, seed: int, system: list[int]
) -> tuple[float, list[int]]:
    rng = random.Random(seed)
    prompt = system + random_tokens(rng, args.user_tokens)
    responses: list[int] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        params = SamplingParams(
            temperature=1.0, max_tokens=args.response_tokens, ignore_eos=True, seed=seed * 100 + turn
        )
        (trajectory,) = await engine.generate(GenerationRequest(prompt_ids=prompt, params=params))
        responses += trajectory.response_ids
        prompt = prompt + trajectory.response_ids + random_tokens(rng, args.tool_tokens)
    return time.perf_counter() - start, responses


def serve(engine: NativeEngine, args: argparse.Namespace, repeat: int, system: list[int]) -> Run:
    stats = engine.stats
    prefilled, looked_up, hits = stats.prefill_tokens, stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens

    async def main() -> list[tuple[float, list[int]]]:
        seeds = [repeat * 1000 + e for e in range(args.episodes)]
        return list(await asyncio.gather(*(episode(engine, args, s, system) for s in seeds)))

    start = time.perf_counter()
    results = asyncio.run(main())
    wall = time.perf_counter() - start
    queried = stats.prefix_cache_query_tokens - looked_up
    return Run(
        prefill_tokens_per_episode=(stats.prefill_tokens - prefilled) / args.episodes,
        wall_s=wall,
        episode_s=statistics.mean(t for t, _ in results),
        hit_rate=(stats.prefix_cache_hit_tokens - hits) / queried if queried else 0.0,
        responses=[r for _, r in results],
    )


def build_engine(args: argparse.Namespace, enable_prefix_caching: bool) -> NativeEngine:
    return NativeEngine(
        model=build_model("qwen2-20m"),
        eos_token_ids=[EOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
        max_batch_size=args.episodes,
        kv_cache_memory_bytes=args.kv_cache_mb * 2**20,
        enable_prefix_caching=enable_prefix_caching,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=48)
    parser.add_argument("--tool-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    system = random_tokens(random.Random(-1), args.system_tokens)
    engines = {"on": build_engine(args, True), "off": build_engine(args, False)}
    weights = {k: v.clone() for k, v in engines["off"].model.state_dict().items()}
    warm = argparse.Namespace(**{**vars(args), "turns": 1, "response_tokens": 4})
    for engine in engines.values():
        serve(engine, warm, -1, system)  # first-call allocations, KV cache sizing

    runs: dict[str, list[Run]] = {"on": [], "off": []}
    same = 0
    for repeat in range(args.repeats):
        order = ["on", "off"] if repeat % 2 == 0 else ["off", "on"]
        for side in order:
            engines[side].update_weights(weights.items())  # a weight sync: the cache starts empty
            runs[side].append(serve(engines[side], args, repeat, system))
        same += sum(a == b for a, b in zip(runs["on"][-1].responses, runs["off"][-1].responses, strict=True))

    def median(side: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs[side])

    turn_prompts = [args.system_tokens + args.user_tokens + k * (args.response_tokens + args.tool_tokens)
                    for k in range(args.turns)]
    print(f"episodes {args.episodes} x {args.turns} turns, prompts {turn_prompts} tokens, responses "
          f"{args.response_tokens}, tool outputs {args.tool_tokens}, system prompt {args.system_tokens} shared; "
          f"qwen2-20m fp32, {args.threads} thread(s), median of {args.repeats} alternating repeats; "
          f"episodes with identical tokens on both sides: {same}/{args.repeats * args.episodes}")
    print(f"{'':>5} {'prefill tok/episode':>20} {'wall s':>8} {'episode s':>10} {'hit rate':>9}")
    for side in ("off", "on"):
        print(f"{side:>5} {median(side, 'prefill_tokens_per_episode'):>20.1f} {median(side, 'wall_s'):>8.3f} "
              f"{median(side, 'episode_s'):>10.3f} {median(side, 'hit_rate'):>9.3f}")
    prefill = median("off", "prefill_tokens_per_episode") / median("on", "prefill_tokens_per_episode")
    print(f"off/on: prefill tokens {prefill:.2f}x, "
          f"wall {median('off', 'wall_s') / median('on', 'wall_s'):.2f}x, "
          f"episode {median('off', 'episode_s') / median('on', 'episode_s'):.2f}x")


if __name__ == "__main__":
    main()
