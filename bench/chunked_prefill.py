"""Long prompts arriving while short requests decode: the native engine with chunked prefill (a step
prefills at most ``--budget`` prompt tokens, a long prompt over several steps) vs whole prompts
(``enable_chunked_prefill=False`` with a budget that takes them in one step), issue 32 item 5.

Workload: ``--decoders`` requests with short prompts decode ``--decode-tokens`` tokens each
(``ignore_eos``, greedy); once they have run ``--arrive-after`` steps, ``--long`` requests with
``--long-tokens``-token prompts arrive together and generate ``--long-decode`` tokens. The model is
the ~20M-parameter Qwen2 shape of ``rollout_long_tail.py`` (random weights, fp32), prefix cache off so
that every repeat prefills in full. Both sides are served the same requests, alternating which goes
first, ``--repeats`` times; their tokens must agree.

Reported (median over repeats): the longest gap between two tokens of a decoding request (the stall a
long prefill causes), the wall time of the whole workload and the long requests' latency, with
whole / chunked ratios.

    python bench/chunked_prefill.py --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import torch
from rollout_long_tail import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model  # the ~20M shape, one definition

from hybridflow.inference.native import NativeEngine, TokenEvent
from hybridflow.types import GenerationRequest, SamplingParams


@dataclass(frozen=True)
class Run:
    max_gap_s: float  # longest wait between two tokens of a decoding request
    wall_s: float
    long_latency_s: float  # mean, from arrival to the last token
    tokens: list[list[int]]


async def serve(engine: NativeEngine, args: argparse.Namespace) -> Run:
    stamps: dict[str, list[float]] = {}

    def listener_for(request_id: str):
        def listen(event: TokenEvent) -> None:
            stamps[request_id].append(time.perf_counter())
        return listen

    def make(request_id: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
        return GenerationRequest(prompt_ids=prompt, request_id=request_id,
                                 params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    decoders = []
    first_step = engine.stats.steps  # the counters carry over from earlier runs of this engine
    start = time.perf_counter()
    for k in range(args.decoders):
        rid = f"d{k}"
        stamps[rid] = []
        engine.add_token_listener(rid, listener_for(rid))
        prompt = [(37 * k + 11 * i) % 3000 + 300 for i in range(16)]
        decoders.append(asyncio.ensure_future(engine.generate(make(rid, prompt, args.decode_tokens))))
    while engine.stats.steps - first_step < args.arrive_after:
        await asyncio.sleep(0.0005)
    arrival = time.perf_counter()
    long_prompts = [[(13 * k + 7 * i) % 3000 + 300 for i in range(args.long_tokens)] for k in range(args.long)]
    longs = [engine.generate(make(f"l{k}", p, args.long_decode)) for k, p in enumerate(long_prompts)]
    long_done = []

    async def timed(coroutine):
        result = await coroutine
        long_done.append(time.perf_counter() - arrival)
        return result

    long_results = await asyncio.gather(*(timed(c) for c in longs))
    decoded = await asyncio.gather(*decoders)
    for request_id in stamps:
        engine.remove_token_listener(request_id)
    wall = time.perf_counter() - start
    gaps = [b - a for times in stamps.values() for a, b in zip(times, times[1:])]
    tokens = [t.response_ids for (t,) in [*decoded, *long_results]]
    return Run(max(gaps), wall, statistics.mean(long_done), tokens)


def build(args: argparse.Namespace, chunked: bool) -> NativeEngine:
    budget = args.budget if chunked else args.long * args.long_tokens
    return NativeEngine(model=build_model("qwen2-20m"), eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                        max_batch_size=64, seed=0, max_prefill_tokens=budget, enable_chunked_prefill=chunked,
                        decode_mode="eager", enable_prefix_caching=False)  # every repeat prefills in full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--arrive-after", type=int, default=4)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=768)
    parser.add_argument("--long-decode", type=int, default=8)
    parser.add_argument("--budget", type=int, default=256, help="chunked side's max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"chunked": build(args, True), "whole": build(args, False)}
    asyncio.run(serve(engines["chunked"], args))  # warm-up: first-call allocations out of the figures
    asyncio.run(serve(engines["whole"], args))
    runs: dict[str, list[Run]] = {"chunked": [], "whole": []}
    for repeat in range(args.repeats):
        for name in (["chunked", "whole"] if repeat % 2 == 0 else ["whole", "chunked"]):
            runs[name].append(asyncio.run(serve(engines[name], args)))
    same = all(a.tokens == b.tokens for a, b in zip(runs["chunked"], runs["whole"], strict=True))

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs[name])

    print(f"{args.decoders} decoding requests x {args.decode_tokens} tokens; {args.long} prompts of "
          f"{args.long_tokens} tokens arrive after {args.arrive_after} steps; chunked budget {args.budget}, "
          f"{args.threads} threads, {args.repeats} repeats; same tokens on both sides: {same}")
    print(f"{'':10}{'max token gap s':>17}{'wall s':>10}{'long latency s':>16}")
    for name in ("chunked", "whole"):
        print(f"{name:10}{median(name, 'max_gap_s'):>17.4f}{median(name, 'wall_s'):>10.3f}"
              f"{median(name, 'long_latency_s'):>16.3f}")
    print(f"whole / chunked: max token gap {median('whole', 'max_gap_s') / median('chunked', 'max_gap_s'):.2f}x, "
          f"wall {median('whole', 'wall_s') / median('chunked', 'wall_s'):.2f}x, long latency "
          f"{median('whole', 'long_latency_s') / median('chunked', 'long_latency_s'):.2f}x")


if __name__ == "__main__":
    main()
