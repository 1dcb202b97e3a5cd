"""The prefix cache: its block store (hand-checked) and the engine with it on against it off.

With the cache on, greedy tokens must equal the cache-off engine's and sampled logprobs agree
within 1e-5 (fp32): keys and values restored from the cache were computed by the same model at the
same positions, only in a different batch shape.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.rollout.factory import EngineArgs, build_rollout_engine
from hybridflow.inference.native import NativeEngine
from hybridflow.inference.prefix_cache import CachedBlock, PrefixCache, block_digests
from hybridflow.types import Trajectory

from hybridflow.workers.rollout import RolloutSetup

from test_rollout_native_engine import EOS, PAD, make_engine, make_model, reference_greedy, request

torch.set_num_threads(1)

SYSTEM = [(7 * i + 3) % 250 for i in range(37)]  # 2 full blocks and a tail
TOOL = [240, 241, 242, 243, 244]


def block(value: float) -> CachedBlock:
    return CachedBlock(torch.full((1, 1, 2, 4), float(value)), torch.full((1, 1, 4, 2), float(value)))  # 64 bytes


# ---------------------------------------------------------------------- the block store


def test_digests_chain_every_earlier_token():
    a = block_digests(list(range(12)), 4)
    b = block_digests([99] + list(range(1, 12)), 4)
    assert len(a) == 3 and len(block_digests(list(range(11)), 4)) == 2  # whole blocks only
    # Blocks 2 and 3 hold the same tokens in a and b, but what came before differs.
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert block_digests(list(range(12)) + [5, 5], 4) == a


def test_match_returns_the_longest_cached_chain_and_missing_lists_the_rest():
    cache = PrefixCache(block_size=4)
    tokens = list(range(12))
    digests, missing = cache.missing(tokens)
    assert missing == [0, 1, 2]
    cache.insert(digests, {0: block(0), 1: block(1)})
    assert [float(b.keys[0, 0, 0, 0]) for b in cache.match(tokens + [1])] == [0.0, 1.0]
    assert cache.missing(tokens)[1] == [2]
    assert len(cache.match(tokens[:4] + [4, 5, 6, 99] + tokens[8:])) == 1  # diverges in block 2
    assert cache.match([7] + tokens[1:]) == []
    assert cache.nbytes == 2 * 64 and len(cache) == 2


def test_trim_evicts_least_recently_used_chains_from_their_tails():
    cache = PrefixCache(block_size=2)
    old, new = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    cache.insert(block_digests(old, 2), {0: block(1), 1: block(2), 2: block(3)})
    cache.insert(block_digests(new, 2), {0: block(7), 1: block(8)})
    assert cache.trim(4 * 64) == 1
    assert len(cache.match(old)) == 2  # the old chain lost its last block, not its first
    cache.trim(3 * 64)  # match touched the old chain: the new one is least recent now
    assert len(cache.match(new)) == 1 and len(cache.match(old)) == 2
    cache.clear()
    assert cache.nbytes == 0 and cache.match(old) == []


# ---------------------------------------------------------------------- the engine, on vs off


def pair(**kwargs) -> tuple[NativeEngine, NativeEngine]:
    return make_engine(make_model(), **kwargs), make_engine(make_model(), enable_prefix_caching=False, **kwargs)


def assert_same(cached: list[list[Trajectory]], plain: list[list[Trajectory]]) -> None:
    """Same tokens; logprobs within 1e-5."""
    for got, want in zip(cached, plain, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.response_ids == b.response_ids
            assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)


def episodes(engine: NativeEngine, turns: int, starts: list[list[int]], **params) -> list[list[list[Trajectory]]]:
    """Multi-turn episodes served together: turn k+1's prompt is turn k's prompt + its first
    sample's response + a tool output."""
    prompts, results = [list(s) for s in starts], []
    for turn in range(turns):
        outputs = engine.generate_batch([request(p, seed=turn * 10 + i, **params) for i, p in enumerate(prompts)])
        results.append(outputs)
        prompts = [p + out[0].response_ids + TOOL for p, out in zip(prompts, outputs, strict=True)]
    return results


@pytest.mark.parametrize("params", [
    {"temperature": 0.0, "max_tokens": 12},
    {"temperature": 1.0, "max_tokens": 12, "n": 2},
])
def test_multi_turn_episodes_match_the_cache_off_engine_and_prefill_only_new_tokens(params):
    on, off = pair()
    starts = [SYSTEM + [1, 2, 3], SYSTEM[:20] + [9, 9]]
    cached, plain = episodes(on, 3, starts, **params), episodes(off, 3, starts, **params)
    for got, want in zip(cached, plain, strict=True):
        assert_same(got, want)
    assert on.stats.prefix_cache_queries == 6
    assert on.stats.prefix_cache_query_tokens == off.stats.prefill_tokens
    assert on.stats.prefill_tokens == off.stats.prefill_tokens - on.stats.prefix_cache_hit_tokens
    # Turns 2 and 3 find all but the last block's worth of their history cached.
    assert on.stats.prefill_tokens < 0.5 * off.stats.prefill_tokens
    assert 0.5 < on.stats.prefix_cache_hit_rate < 1.0
    assert off.stats.prefix_cache_queries == 0 and off.stats.prefix_cache_hit_rate == 0.0


def test_multi_turn_episodes_with_static_decode_shapes_match_the_cache_off_engine():
    on, off = pair(decode_mode="static")
    starts = [SYSTEM + [1, 2, 3], SYSTEM[:20] + [9, 9], [5] * 30]
    params = {"temperature": 1.0, "max_tokens": 10, "n": 2}
    for got, want in zip(episodes(on, 3, starts, **params), episodes(off, 3, starts, **params), strict=True):
        assert_same(got, want)
    assert on.stats.prefix_cache_hit_tokens > 0


def test_a_turn_ending_on_a_block_boundary_recomputes_the_unfed_last_token():
    """The row of a finished sample has keys up to its second-to-last response token."""
    on, off = pair()
    prompt = list(range(1, 11))  # 10 tokens: the row ends at 10 + 7 - 1 = 16, one whole block
    for engine in (on, off):
        first = engine.generate_batch([request(prompt, temperature=0.0, max_tokens=7, ignore_eos=True)])
        follow = prompt + first[0][0].response_ids + TOOL
        engine.generate_batch([request(follow, temperature=0.0, max_tokens=6)])
    assert on.stats.prefix_cache_hit_tokens == 16
    assert_same(on.generate_batch([request(follow, temperature=0.0, max_tokens=6)]),
                off.generate_batch([request(follow, temperature=0.0, max_tokens=6)]))


def test_a_shared_system_prompt_is_prefilled_once_per_engine():
    on, off = pair()
    users = [[11, 12], [13, 14, 15], [16], [17, 18, 19, 20]]
    cached, plain = [], []
    for user in users:  # one after another, as separate requests
        cached += on.generate_batch([request(SYSTEM + user, temperature=1.0, max_tokens=6, seed=1)])
        plain += off.generate_batch([request(SYSTEM + user, temperature=1.0, max_tokens=6, seed=1)])
    assert_same(cached, plain)
    assert on.stats.prefix_cache_hit_tokens == 3 * 32  # SYSTEM's two whole blocks, after the first
    assert on.stats.prefill_tokens == off.stats.prefill_tokens - 96


def test_requests_arriving_together_with_one_system_prompt_prefill_it_once():
    """Later arrivals wait a step for the first prompt's blocks instead of computing them again."""
    on, off = pair()
    requests = [request(SYSTEM + [20 + i, 21], temperature=1.0, max_tokens=6, seed=i, n=2) for i in range(5)]
    assert_same(on.generate_batch(requests), off.generate_batch(requests))
    assert on.stats.prefix_cache_hit_tokens == 4 * 32
    assert on.stats.prefill_tokens == off.stats.prefill_tokens - 4 * 32
    # Others that share nothing are not held back.
    other = make_engine(make_model())
    other.generate_batch([request([(9 * j + i) % 250 for j in range(40)], max_tokens=2) for i in range(3)])
    assert other.stats.prefill_forwards == 1


def test_concurrent_requests_sharing_prefixes_match_the_cache_off_engine():
    on, off = pair(max_batch_size=3)  # too few rows for all: later prompts start mid-flight

    async def serve(engine: NativeEngine) -> list[list[Trajectory]]:
        first = [engine.generate(request(SYSTEM + [i], temperature=1.0, max_tokens=10, seed=i, n=2))
                 for i in range(3)]
        results = await asyncio.gather(*first)
        more = [engine.generate(request(SYSTEM + [i] + r[1].response_ids + TOOL, temperature=0.0, max_tokens=8))
                for i, r in enumerate(results)]
        more += [engine.generate(request(SYSTEM + [50 + i, 51], temperature=1.0, max_tokens=8, seed=9))
                 for i in range(4)]
        return list(results) + list(await asyncio.gather(*more))

    assert_same(asyncio.run(serve(on)), asyncio.run(serve(off)))
    assert on.stats.prefix_cache_hit_tokens > 0
    assert on.stats.prefill_tokens < off.stats.prefill_tokens


def test_a_tiny_budget_evicts_least_recently_used_blocks_and_stays_within_it():
    per_position = 2 * 2 * 2 * 16 * 4  # K and V x layers x KV heads x head_dim x fp32
    block_bytes = 16 * per_position
    slot_bytes = (2 + 2) * 128 * per_position  # 2 decode + 2 prompt rows of 128 positions
    budget = slot_bytes + 3 * block_bytes
    on, off = pair(max_batch_size=2, max_prefill_prompts=2, kv_cache_memory_bytes=budget)
    starts = [[(5 * i + j) % 250 for j in range(40)] for i in range(3)]
    cached = episodes(on, 2, starts, temperature=0.0, max_tokens=40)
    plain = episodes(off, 2, starts, temperature=0.0, max_tokens=40)
    for got, want in zip(cached, plain, strict=True):
        assert_same(got, want)
    assert on.kv_cache_bytes == slot_bytes
    assert 0 < on.prefix_cache_bytes <= budget - on.kv_cache_bytes
    assert on.stats.prefix_cache_evicted_blocks > 0


def test_a_weight_update_invalidates_the_whole_cache():
    donor = make_model(seed=1)
    on = make_engine(make_model())
    prompt = SYSTEM + [1, 2]
    first = on.generate_batch([request(prompt, temperature=0.0, max_tokens=10)])
    assert on.prefix_cache_bytes > 0
    on.update_weights(donor.state_dict().items())
    assert on.prefix_cache_bytes == 0
    hits = on.stats.prefix_cache_hit_tokens
    follow = prompt + first[0][0].response_ids + TOOL
    (after,) = on.generate_batch([request(follow, temperature=0.0, max_tokens=10)])
    assert on.stats.prefix_cache_hit_tokens == hits  # nothing computed with the old weights served
    assert after[0].response_ids == reference_greedy(donor, follow, 10, {EOS})


@pytest.mark.parametrize("recompute", [True, False])
def test_a_row_in_flight_across_a_weight_update_is_kept_only_once_recomputed(recompute):
    donor = make_model(seed=1)
    on = make_engine(make_model(), recompute_stale_kv=recompute)
    results = []

    async def main() -> None:
        running = asyncio.ensure_future(on.generate(request(SYSTEM, temperature=0.0, max_tokens=30, ignore_eos=True)))
        while on.stats.steps < 5:
            await asyncio.sleep(0.001)
        on.update_weights(donor.state_dict().items())
        results.extend(await running)

    asyncio.run(main())
    if not recompute:  # its keys and values are partly the old weights': never kept
        assert on.prefix_cache_bytes == 0
        return
    # Recomputed under the new weights (partial rollout): kept, and serving the next turn exactly.
    assert on.prefix_cache_bytes > 0
    hits = on.stats.prefix_cache_hit_tokens
    follow = SYSTEM + results[0].response_ids + TOOL
    (after,) = on.generate_batch([request(follow, temperature=0.0, max_tokens=10)])
    assert on.stats.prefix_cache_hit_tokens > hits
    assert after[0].response_ids == reference_greedy(donor, follow, 10, {EOS})


def test_sleep_drops_the_cache_and_wake_up_serves_the_same_tokens():
    on, off = pair()
    prompt = SYSTEM + [4, 5]
    on.generate_batch([request(prompt, temperature=0.0, max_tokens=10)])
    assert on.prefix_cache_bytes > 0
    on.sleep()
    assert on.prefix_cache_bytes == 0 and on.kv_cache_bytes == 0
    on.wake_up()
    hits = on.stats.prefix_cache_hit_tokens
    assert_same(on.generate_batch([request(prompt, temperature=0.0, max_tokens=10)]),
                off.generate_batch([request(prompt, temperature=0.0, max_tokens=10)]))
    assert on.stats.prefix_cache_hit_tokens == hits


def test_requests_fully_covered_by_the_cache_start_without_a_prefill():
    on, off = pair()
    prompt = SYSTEM[:33]  # 32 tokens prefilled: exactly two blocks
    for engine in (on, off):
        engine.generate_batch([request(prompt, temperature=0.0, max_tokens=4)])
    forwards = on.stats.prefill_forwards
    assert_same(on.generate_batch([request(prompt, temperature=1.0, max_tokens=6, n=3, seed=2)]),
                off.generate_batch([request(prompt, temperature=1.0, max_tokens=6, n=3, seed=2)]))
    assert on.stats.prefill_forwards == forwards



@pytest.mark.parametrize("enabled", [True, False])
def test_the_factory_passes_enable_prefix_caching_through(enabled):
    engine = build_rollout_engine(
        "native", EngineArgs(model=make_model(), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=4,
                             device="cpu", dtype="float32", enable_prefix_caching=enabled),
    )
    engine.generate_batch([request(SYSTEM, temperature=0.0, max_tokens=2)] * 2)
    assert (engine.stats.prefix_cache_queries > 0) is enabled
    assert RolloutConfig().enable_prefix_caching and RolloutSetup.__dataclass_fields__["enable_prefix_caching"].default
