"""NativeEngine scheduling and features: continuous batching, chunked prefill, admission control,
HF parity, stop strings, penalties, top logprobs, trainer agreement, sleep/wake, bucketed weights."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.inference.native import LogitsRows, NativeEngine
from hybridflow.transfer.weights import iter_buckets
from hybridflow.training.engine import TrainEngine
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory, collate_trajectories

from test_rollout_native_engine import EOS, PAD, PROMPTS, make_engine, make_model, reference_greedy, request

torch.set_num_threads(1)

LONG_PROMPT = [(11 * i + 5) % 250 for i in range(41)]


@pytest.fixture(scope="module")
def reference_model() -> torch.nn.Module:
    return make_model()


def hf_generate_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int, **options) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_tokens, eos_token_id=EOS, pad_token_id=PAD, **options,
        )
    return output[0, len(prompt):].tolist()


class ForceText:
    """A logits processor that makes every row produce ``tokens`` (then EOS), greedy or not."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens + [EOS]

    def __call__(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        targets = torch.tensor([self.tokens[min(int(n), len(self.tokens) - 1)] for n in rows.output_lengths])
        forced = torch.full_like(logits, float("-inf"))
        return forced.scatter(1, targets[:, None], 0.0)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_greedy_outputs_are_token_identical_to_hf_generate(family):
    reference = make_model(family)
    engine = make_engine(make_model(family))
    results = engine.generate_batch([request(p, temperature=0.0, max_tokens=24) for p in PROMPTS + [LONG_PROMPT]])
    for prompt, (trajectory,) in zip(PROMPTS + [LONG_PROMPT], results, strict=True):
        assert trajectory.response_ids == hf_generate_greedy(reference, prompt, 24)


def test_requests_arriving_mid_flight_join_the_running_batch(reference_model):
    engine = make_engine()

    async def main() -> tuple[list[Trajectory], list[Trajectory], int, bool]:
        first = asyncio.ensure_future(engine.generate(request(PROMPTS[1], temperature=0.0, max_tokens=30)))
        while engine.stats.steps < 5:
            await asyncio.sleep(0.001)
        second = await engine.generate(request(PROMPTS[3], temperature=0.0, max_tokens=8))
        steps, first_done = engine.stats.steps, first.done()
        return await first, second, steps, first_done

    first, second, steps_at_second, first_done_then = asyncio.run(main())
    assert first[0].response_ids == reference_greedy(reference_model, PROMPTS[1], 30, {EOS})
    assert second[0].response_ids == reference_greedy(reference_model, PROMPTS[3], 8, {EOS})
    assert not first_done_then and steps_at_second < 30
    assert engine.stats.admitted_while_decoding == 1 and engine.stats.max_running == 2
    assert engine.stats.steps == 30  # the newcomer rode along: no extra steps


def test_seeded_sample_is_the_same_whether_it_joins_mid_flight_or_runs_alone():
    target = request(PROMPTS[2], n=2, temperature=1.0, top_p=0.9, max_tokens=12, seed=77)
    alone = make_engine().generate_batch([target])[0]
    engine = make_engine(seed=3)

    async def main() -> list[Trajectory]:
        busy = [asyncio.ensure_future(engine.generate(request(p, n=3, temperature=1.0, max_tokens=20))) for p in PROMPTS]
        while engine.stats.steps < 4:
            await asyncio.sleep(0.001)
        joined = await engine.generate(target)
        await asyncio.gather(*busy)
        return joined

    joined = asyncio.run(main())
    assert [t.response_ids for t in joined] == [t.response_ids for t in alone]
    assert engine.stats.admitted_while_decoding == 2


def test_long_prompts_are_prefilled_in_chunks_while_decoding_continues(reference_model):
    engine = make_engine(max_prefill_tokens=4)

    async def main() -> tuple[list[Trajectory], list[Trajectory]]:
        first = asyncio.ensure_future(engine.generate(request(PROMPTS[0], temperature=0.0, max_tokens=30)))
        while engine.stats.steps < 2:
            await asyncio.sleep(0.001)
        second = await engine.generate(request(LONG_PROMPT, temperature=0.0, max_tokens=6))
        return await first, second

    first, second = asyncio.run(main())
    assert second[0].response_ids == reference_greedy(reference_model, LONG_PROMPT, 6, {EOS})
    assert first[0].response_ids == reference_greedy(reference_model, PROMPTS[0], 30, {EOS})
    assert engine.stats.prefill_forwards == 1 + 10  # 40 prefix tokens in chunks of 4
    # One token per step for the running request throughout the long prefill: no stall.
    assert engine.stats.steps == 30


def test_admission_is_bounded_by_the_kv_cache_budget(reference_model):
    # make_model: 2 layers x (keys + values) x 2 KV heads x 16 dims x 4 bytes = 512 bytes per position.
    row_bytes = 64 * 512  # rows hold 64 positions (the capacity step)
    engine = make_engine(kv_cache_memory_bytes=4 * row_bytes, max_prefill_prompts=2)  # 2 prompt + 2 decode rows
    prompts = [PROMPTS[i % 4] for i in range(6)]
    results = engine.generate_batch([request(p, temperature=0.0, max_tokens=4 + i) for i, p in enumerate(prompts)])
    assert engine.stats.max_running == 2
    for i, (prompt, (trajectory,)) in enumerate(zip(prompts, results, strict=True)):
        assert trajectory.response_ids == reference_greedy(reference_model, prompt, 4 + i, {EOS})
    assert engine.kv_cache_bytes == 4 * row_bytes
    with pytest.raises(ValueError, match="does not fit the KV cache budget"):
        engine.generate_batch([request(PROMPTS[0], max_tokens=100)])  # 102 positions: 128-position rows


def test_rows_grow_mid_flight_without_disturbing_running_sequences(reference_model):
    engine = make_engine()

    async def main() -> tuple[list[Trajectory], list[Trajectory], int]:
        short = asyncio.ensure_future(engine.generate(request(PROMPTS[0], temperature=0.0, max_tokens=40)))
        while engine.stats.steps < 3:
            await asyncio.sleep(0.001)
        capacity_before = engine._runner.cache.capacity
        long = await engine.generate(request(PROMPTS[1], temperature=0.0, max_tokens=100))
        return await short, long, capacity_before

    short, long, capacity_before = asyncio.run(main())
    assert capacity_before == 64 and engine._runner.cache.capacity == 128
    assert short[0].response_ids == reference_greedy(reference_model, PROMPTS[0], 40, {EOS})
    assert long[0].response_ids == reference_greedy(reference_model, PROMPTS[1], 100, {EOS})


def test_stop_strings_end_the_sample_at_the_token_that_completes_them():
    tokenizer = build_tiny_tokenizer()
    text = tokenizer.encode("abcXYZdef", add_special_tokens=False)
    engine = make_engine(tokenizer=tokenizer, logits_processors=[ForceText(text)])
    stopped, unstopped, no_match = engine.generate_batch([
        request(PROMPTS[0], temperature=0.0, max_tokens=20, stop=["Q", "XY"]),
        request(PROMPTS[0], temperature=1.0, max_tokens=20, seed=1),
        request(PROMPTS[0], temperature=0.0, max_tokens=20, stop=["ZZ"]),
    ])
    assert tokenizer.decode(stopped[0].response_ids) == "abcXY"
    assert stopped[0].finish_reason == "stop" and stopped[0].stop_reason == "XY"
    assert unstopped[0].response_ids == text + [EOS] and unstopped[0].stop_reason == EOS
    assert no_match[0].response_ids == text + [EOS]
    with pytest.raises(ValueError, match="stop strings need an engine built with a tokenizer"):
        make_engine().generate_batch([request(PROMPTS[0], stop=["x"])])


def test_ignore_eos_generates_past_the_engine_eos_but_not_past_stop_tokens():
    engine = make_engine(logits_processors=[ForceText([7, 8])])  # 7, 8, EOS, EOS, ...
    ignoring, stopping, own_stop = engine.generate_batch([
        request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True),
        request(PROMPTS[1], temperature=0.0, max_tokens=5),
        request(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True, stop_token_ids=[8]),
    ])
    assert ignoring[0].response_ids == [7, 8, EOS, EOS, EOS] and ignoring[0].finish_reason == "length"
    assert stopping[0].response_ids == [7, 8, EOS] and stopping[0].finish_reason == "stop"
    assert own_stop[0].response_ids == [7, 8] and own_stop[0].stop_reason == 8


def test_repetition_penalty_greedy_matches_hf_generate(reference_model):
    engine = make_engine()
    results = engine.generate_batch([request(p, temperature=0.0, max_tokens=20, repetition_penalty=1.8) for p in PROMPTS])
    plain = engine.generate_batch([request(p, temperature=0.0, max_tokens=20) for p in PROMPTS])
    for prompt, (trajectory,) in zip(PROMPTS, results, strict=True):
        assert trajectory.response_ids == hf_generate_greedy(reference_model, prompt, 20, repetition_penalty=1.8)
    assert [r[0].response_ids for r in results] != [r[0].response_ids for r in plain]


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, trajectory: Trajectory, temperature: float) -> torch.Tensor:
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    logits = model(ids).logits[0, len(trajectory.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1)  # (R, V)


def test_min_p_only_draws_tokens_within_the_threshold(reference_model):
    engine = make_engine()
    results = engine.generate_batch([request(p, n=4, temperature=1.0, min_p=0.3, max_tokens=10, seed=i)
                                     for i, p in enumerate(PROMPTS)])
    for trajectories in results:
        for t in trajectories:
            logprobs = teacher_forced(reference_model, t, 1.0)
            chosen = logprobs.gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)
            assert torch.all(chosen >= logprobs.max(dim=-1).values + torch.log(torch.tensor(0.3)) - 1e-5)


def test_top_logprobs_come_from_the_same_distribution(reference_model):
    engine = make_engine()
    (trajectory,) = engine.generate_batch([request(PROMPTS[1], temperature=0.7, max_tokens=8, logprobs=3, seed=5)])[0]
    assert trajectory.top_logprobs is not None and len(trajectory.top_logprobs) == len(trajectory.response_ids)
    expected = teacher_forced(reference_model, trajectory, 0.7)
    for position, (top, token) in enumerate(zip(trajectory.top_logprobs, trajectory.response_ids, strict=True)):
        values, ids = expected[position].topk(3)
        assert set(ids.tolist()) <= set(top) and token in top and len(top) in (3, 4)
        for token_id, value in top.items():
            assert value == pytest.approx(expected[position, token_id].item(), abs=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_sampled_logprobs_match_the_trainers_recomputation(family):
    model = make_model(family)
    engine = make_engine(copy.deepcopy(model))
    requests = [request(p, n=3, temperature=0.8, top_p=0.95, max_tokens=12, seed=i) for i, p in enumerate(PROMPTS)]
    trajectories = [t for group in engine.generate_batch(requests) for t in group]
    batch = collate_trajectories(trajectories, pad_token_id=PAD)
    trainer = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"))
    logprobs, _ = trainer.compute_logprobs(batch, temperature=0.8, micro_batch_size=4)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max().item() < 1e-4


def test_sleep_releases_the_kv_cache_and_wake_up_rebuilds_it():
    engine = make_engine()
    requests = [request(p, temperature=0.0, max_tokens=6) for p in PROMPTS]
    before = engine.generate_batch(requests)
    allocated = engine.kv_cache_bytes
    assert allocated > 0
    engine.sleep()
    assert engine.kv_cache_bytes == 0
    engine.wake_up()
    assert engine.kv_cache_bytes == allocated
    assert [r[0].response_ids for r in engine.generate_batch(requests)] == [r[0].response_ids for r in before]


def test_update_weights_in_small_buckets_changes_outputs(reference_model):
    donor = make_model(seed=1)
    engine = make_engine()
    requests = [request(p, temperature=0.0, max_tokens=8) for p in PROMPTS]
    before = engine.generate_batch(requests)
    engine.update_weights(donor.state_dict().items(), max_bucket_bytes=4096)
    after = engine.generate_batch(requests)
    assert [r[0].response_ids for r in after] != [r[0].response_ids for r in before]
    for prompt, (trajectory,) in zip(PROMPTS, after, strict=True):
        assert trajectory.response_ids == reference_greedy(donor, prompt, 8, {EOS})


def test_a_bad_bucket_is_refused_before_any_of_it_is_written():
    engine = make_engine()
    norm = engine.model.state_dict()["model.norm.weight"].clone()
    bucket = [("model.norm.weight", torch.zeros_like(norm)), ("model.nope", torch.zeros(3))]
    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        engine.update_weights(bucket)
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], norm)


def test_iter_buckets_bounds_bucket_bytes():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 25, 5, 100, 1])]  # float32: 4 bytes each
    buckets = list(iter_buckets(tensors, max_bucket_bytes=120))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5"]]
    with pytest.raises(ValueError, match="max_bucket_bytes"):
        list(iter_buckets(tensors, max_bucket_bytes=0))


def test_one_token_prompts_need_no_prefill(reference_model):
    engine = make_engine()
    (trajectory,) = engine.generate_batch([request([42], temperature=0.0, max_tokens=5)])[0]
    assert trajectory.response_ids == reference_greedy(reference_model, [42], 5, {EOS})
    assert engine.stats.prefill_forwards == 0


def test_engine_built_by_the_factory_serves_a_request_end_to_end():
    engine = NativeEngine(model=make_model(), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=2)
    (trajectories,) = engine.generate_batch([GenerationRequest([1, 2], SamplingParams(n=5, max_tokens=3))])
    assert len(trajectories) == 5 and engine.stats.max_running == 2
