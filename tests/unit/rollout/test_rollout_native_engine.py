"""NativeEngine against full-forward references on tiny real models (no fakes)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.inference import cpu_kernels
from hybridflow.inference.compact import onednn_packing_available
from hybridflow.inference.native import NativeEngine, resolve_dtype
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory

torch.set_num_threads(1)

EOS, PAD, VOCAB = 258, 256, 272
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [100, 101, 102, 103, 104]]
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def make_model(family: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    """A 2-layer random model whose greedy output depends on the whole context.

    Untied embeddings and a wide init on purpose: the built-in tiny model (tied, std 0.02) greedily
    repeats its last input token, which would let position-id, mask and cache bugs pass unseen.
    """
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config).eval()


def make_engine(model: torch.nn.Module | None = None, **kwargs) -> NativeEngine:
    options = {"eos_token_ids": [EOS], "pad_token_id": PAD, "max_batch_size": 64, "seed": 0}
    options.update(kwargs)
    return NativeEngine(model=model if model is not None else make_model(), **options)


def request(prompt: list[int], request_id: str = "", **params) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(**params), request_id=request_id)


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int, stops: set[int]) -> list[int]:
    """Greedy decoding without a cache: one full forward over the unpadded sequence per token."""
    ids = list(prompt)
    for _ in range(max_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token in stops:
            break
    return ids[len(prompt) :]


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, trajectory: Trajectory, temperature: float) -> torch.Tensor:
    """Teacher-forced log_softmax(logits / T) of each response token (what the trainer computes)."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    logits = model(ids).logits[0, len(trajectory.prompt_ids) - 1 : -1]
    response = torch.tensor(trajectory.response_ids)
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, response[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def reference_model() -> torch.nn.Module:
    return make_model()


@pytest.fixture(scope="module")
def engine() -> NativeEngine:
    """A shared engine for tests that do not change its weights or state."""
    return make_engine()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_batched_with_cache_equals_full_forward_reference(family):
    reference = make_model(family)
    engine = make_engine(make_model(family))
    results = engine.generate_batch([request(p, temperature=0.0, max_tokens=16) for p in PROMPTS])
    for prompt, (trajectory,) in zip(PROMPTS, results, strict=True):
        assert trajectory.prompt_ids == prompt
        assert trajectory.response_ids == reference_greedy(reference, prompt, 16, {EOS})
    # One prefill of the four prompts (all but their last token, which each sample feeds itself),
    # then one decode step per token.
    assert engine.stats.prefill_forwards == 1
    assert engine.stats.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)
    assert engine.stats.steps == 16


def test_rollout_logprobs_equal_teacher_forced_recomputation(engine, reference_model):
    requests = [request(p, temperature=0.7, max_tokens=12, n=2, seed=i) for i, p in enumerate(PROMPTS)]
    requests.append(request(PROMPTS[1], temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, n=2))
    results = engine.generate_batch(requests)
    for trajectories in results:
        for trajectory in trajectories:
            expected = reference_logprobs(reference_model, trajectory, temperature=0.7)
            got = torch.tensor(trajectory.rollout_logprobs)
            assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_greedy_logprobs_use_temperature_one(engine, reference_model):
    (trajectory,) = engine.generate_batch([request(PROMPTS[0], temperature=0.0, max_tokens=6)])[0]
    expected = reference_logprobs(reference_model, trajectory, temperature=1.0)
    assert torch.allclose(torch.tensor(trajectory.rollout_logprobs), expected, atol=1e-5, rtol=0)


def test_trajectory_fields_and_n_samples(engine):
    (trajectories,) = engine.generate_batch([request(PROMPTS[1], n=5, temperature=1.0, max_tokens=7)])
    assert len(trajectories) == 5
    for t in trajectories:
        assert t.prompt_ids == PROMPTS[1]
        assert 1 <= len(t.response_ids) <= 7
        assert t.loss_mask == [1] * len(t.response_ids)
        assert len(t.rollout_logprobs) == len(t.response_ids)
        assert all(lp <= 0.0 for lp in t.rollout_logprobs)
        assert t.group_id == 0
        assert t.finish_reason == ("stop" if t.response_ids[-1] == EOS else "length")
    assert len({tuple(t.response_ids) for t in trajectories}) > 1  # samples differ


def test_stop_token_ends_the_sample_and_is_included(engine, reference_model):
    greedy = reference_greedy(reference_model, PROMPTS[0], 10, set())
    stop = greedy[3]
    first = greedy.index(stop)
    stopping = request(PROMPTS[0], temperature=0.0, max_tokens=10, stop_token_ids=[stop])
    (trajectory,) = engine.generate_batch([stopping])[0]
    assert trajectory.response_ids == greedy[: first + 1]
    assert trajectory.finish_reason == "stop"
    assert len(trajectory.rollout_logprobs) == first + 1


def test_engine_eos_ids_stop_every_request(reference_model):
    greedy = reference_greedy(reference_model, PROMPTS[2], 10, set())
    eos = greedy[2]
    engine = make_engine(eos_token_ids=[EOS, eos])
    (trajectory,) = engine.generate_batch([request(PROMPTS[2], temperature=0.0, max_tokens=10)])[0]
    assert trajectory.response_ids == greedy[: greedy.index(eos) + 1]
    assert trajectory.finish_reason == "stop"


def test_max_tokens_finishes_with_length(engine):
    (short,), (long,) = engine.generate_batch(
        [request(PROMPTS[3], temperature=0.0, max_tokens=1), request(PROMPTS[3], temperature=0.0, max_tokens=9)]
    )
    assert len(short.response_ids) == 1 and short.finish_reason == "length"
    assert len(long.response_ids) == 9 and long.finish_reason == "length"
    assert long.response_ids[0] == short.response_ids[0]


def test_response_is_capped_by_the_model_context(reference_model):
    engine = make_engine(max_model_len=10)
    (trajectory,) = engine.generate_batch([request(PROMPTS[1], temperature=0.0, max_tokens=50)])[0]
    assert len(trajectory.response_ids) == 10 - len(PROMPTS[1])
    assert trajectory.finish_reason == "length"
    with pytest.raises(ValueError, match="no room to generate"):
        engine.generate_batch([request(list(range(10)), max_tokens=1)])


def test_seeded_request_is_reproducible_whatever_else_is_batched():
    target = request(PROMPTS[1], n=3, temperature=1.0, top_p=0.9, max_tokens=10, seed=1234)
    alone = make_engine().generate_batch([target])[0]
    crowd = [
        request(PROMPTS[0], n=4, temperature=1.0, max_tokens=14),
        request(PROMPTS[2], n=2, temperature=0.5, top_k=5, max_tokens=6, seed=1),
        request(PROMPTS[3], temperature=0.0, max_tokens=3),
    ]
    engine = make_engine(seed=99)  # a different engine generator as well
    mixed = engine.generate_batch([*crowd[:2], target, *crowd[2:]])[2]
    # A small batch splits the request across waves of different composition.
    split = make_engine(max_batch_size=2).generate_batch([crowd[2], target])[1]
    for other in (mixed, split):
        assert [t.response_ids for t in other] == [t.response_ids for t in alone]
        for a, b in zip(alone, other, strict=True):
            assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)
    assert len({tuple(t.response_ids) for t in alone}) == 3  # its samples use distinct streams
    reseeded = request(PROMPTS[1], n=3, temperature=1.0, top_p=0.9, max_tokens=10, seed=1235)
    different_seed = make_engine().generate_batch([reseeded])[0]
    assert [t.response_ids for t in different_seed] != [t.response_ids for t in alone]


@torch.no_grad()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_decodes_the_same_to_the_bit_alone_or_beside_others(dtype):
    """A matmul over a few rows takes a kernel of its own (a matrix-vector product at one row; MKL's fp32
    GEMM at 1-3) that sums in another order: a long tail's last rows, or a replica left with few rows, gave
    other logprobs (in bf16 on a ~20M model, other tokens) than the same rows decoded beside others. The
    engine runs at least compact.MIN_MATMUL_ROWS rows in every matmul, so one row and three take the same
    kernels (that 4 rows and 128 then agree too is the library's own doing: measured, not asserted here).
    Prompts of one length, run to the same length, so that every step attends over the same keys whatever
    the batch (the key window's own part: the next test)."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [42, 43, 44, 45, 46], [100, 101, 102, 103, 104]]
    requests = [request(prompt, n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=7 + i)
                for i, prompt in enumerate(prompts)]
    alone = make_engine(dtype=dtype, max_batch_size=1).generate_batch(requests)
    beside = make_engine(dtype=dtype, max_batch_size=3).generate_batch(requests)
    for one, many in zip(alone, beside, strict=True):
        assert [t.response_ids for t in one] == [t.response_ids for t in many]
        assert [t.rollout_logprobs for t in one] == [t.rollout_logprobs for t in many]


@torch.no_grad()
def test_a_rows_logprobs_do_not_depend_on_how_far_back_the_longest_row_beside_it_reads():
    """The same seeded row decoded beside a short prompt and beside a long one: the step's key window is the
    longest row's, and the attention's sums over it (softmax, p.V) split into other vector lanes when the
    window's length moves within a vector; fp32 logprobs moved by ~1e-6. The engine reads keys in multiples
    of runner.KEY_ALIGN, so the extra keys are whole masked vectors and change no sum."""
    target = request([5, 6, 7], temperature=1.0, max_tokens=10, ignore_eos=True, seed=11)
    short = request([9, 10], temperature=1.0, max_tokens=10, ignore_eos=True, seed=12)
    long = request(list(range(20, 60)), temperature=1.0, max_tokens=10, ignore_eos=True, seed=13)
    near = make_engine(dtype="float32", max_batch_size=2).generate_batch([target, short])[0][0]
    far = make_engine(dtype="float32", max_batch_size=2).generate_batch([target, long])[0][0]
    assert near.response_ids == far.response_ids
    assert near.rollout_logprobs == far.rollout_logprobs


def test_unseeded_requests_follow_the_engine_seed():
    requests = [request(p, n=2, temperature=1.0, max_tokens=8) for p in PROMPTS]
    first = make_engine(seed=5).generate_batch(requests)
    again = make_engine(seed=5).generate_batch(requests)
    other = make_engine(seed=6).generate_batch(requests)
    ids = lambda results: [[t.response_ids for t in ts] for ts in results]  # noqa: E731
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    results = engine.generate_batch(
        [request(p, temperature=0.0, max_tokens=10) for p in PROMPTS]
        + [request(p, temperature=1.3, top_k=1, max_tokens=10) for p in PROMPTS]
        + [request(p, temperature=1.3, top_p=1e-6, max_tokens=10) for p in PROMPTS]
    )
    greedy = [r[0].response_ids for r in results[:4]]
    assert [r[0].response_ids for r in results[4:8]] == greedy
    assert [r[0].response_ids for r in results[8:]] == greedy


def test_rows_finishing_early_are_dropped_without_changing_results(engine, reference_model):
    # Different max_tokens in one batch: rows finish at different steps and the live rows are packed.
    lengths = [2, 3, 16, 5, 16, 1, 8, 16]
    requests = [request(PROMPTS[i % 4], temperature=0.0, max_tokens=m) for i, m in enumerate(lengths)]
    before = engine.stats.row_moves
    results = engine.generate_batch(requests)
    assert engine.stats.row_moves > before
    for i, ((trajectory,), m) in enumerate(zip(results, lengths, strict=True)):
        assert trajectory.response_ids == reference_greedy(reference_model, PROMPTS[i % 4], m, {EOS})


def test_concurrent_requests_are_batched_together():
    engine = make_engine(max_batch_size=32)
    max_tokens = 6

    async def main() -> list[list[Trajectory]]:
        prompts = [[(7 * i + j) % 250 for j in range(1 + i % 5)] for i in range(20)]
        requests = [request(p, temperature=1.0, max_tokens=max_tokens) for p in prompts]
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = asyncio.run(main())
    assert len(results) == 20 and all(len(r) == 1 for r in results)
    assert engine.stats.max_running == 20
    # Sequential serving would need up to 20 * max_tokens steps; one batch needs at most max_tokens.
    assert engine.stats.steps <= max_tokens
    assert engine.stats.generated_tokens == sum(len(r[0].response_ids) for r in results)


def test_requests_beyond_max_batch_size_wait_for_free_rows(reference_model):
    engine = make_engine(max_batch_size=3)
    results = engine.generate_batch([request(p, temperature=0.0, max_tokens=5, n=2) for p in PROMPTS])
    assert engine.stats.max_running == 3  # 8 samples through 3 rows
    for prompt, trajectories in zip(PROMPTS, results, strict=True):
        expected = reference_greedy(reference_model, prompt, 5, {EOS})
        assert [t.response_ids for t in trajectories] == [expected, expected]


def test_samples_of_one_prompt_share_its_prefill(engine):
    before = engine.stats.prefill_tokens
    engine.generate_batch([request(PROMPTS[1], n=6, temperature=1.0, max_tokens=2)])
    assert engine.stats.prefill_tokens - before == len(PROMPTS[1]) - 1


def test_update_weights_changes_outputs_and_restores_them():
    donor = make_model(seed=1)
    engine = make_engine()
    original = {k: v.clone() for k, v in make_model().state_dict().items()}
    prompt_requests = [request(p, temperature=0.0, max_tokens=8) for p in PROMPTS]
    before = engine.generate_batch(prompt_requests)
    engine.update_weights(donor.state_dict().items())
    after = engine.generate_batch(prompt_requests)
    assert [r[0].response_ids for r in after] != [r[0].response_ids for r in before]
    for prompt, (trajectory,) in zip(PROMPTS, after, strict=True):
        assert trajectory.response_ids == reference_greedy(donor, prompt, 8, {EOS})
    engine.update_weights(original.items())
    restored = engine.generate_batch(prompt_requests)
    assert [r[0].response_ids for r in restored] == [r[0].response_ids for r in before]


LAYOUTS = ["dense"] + (["onednn"] if onednn_packing_available(torch.device("cpu"), torch.float32) else [])


def outputs(engine: NativeEngine) -> list[list[tuple[list[int], list[float]]]]:
    """Sampled (seeded, n=2) and greedy responses to every prompt, with their logprobs."""
    requests = [request(p, temperature=1.0, max_tokens=8, seed=i, n=2) for i, p in enumerate(PROMPTS)]
    requests += [request(p, temperature=0.0, max_tokens=8) for p in PROMPTS]
    return [[(t.response_ids, t.rollout_logprobs) for t in r] for r in engine.generate_batch(requests)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_after_bucketed_updates_the_fused_engine_matches_one_loaded_with_the_new_weights(layout):
    donor = make_model(seed=1)
    engine = make_engine(weight_layout=layout)
    outputs(engine)  # the old weights have served
    # Buckets of one tensor each: q, k and v (and gate and up) of a layer arrive separately.
    engine.update_weights(donor.state_dict().items(), max_bucket_bytes=4096)
    fused = engine._runner.compact.layers[1]  # the fused tensors the compact forward reads
    attention, mlp = donor.model.layers[1].self_attn, donor.model.layers[1].mlp
    assert torch.equal(fused.qkv_weight, torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                                    attention.v_proj.weight]))
    assert fused.qkv_bias is not None
    assert torch.equal(fused.qkv_bias, torch.cat([attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]))
    assert torch.equal(fused.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert outputs(engine) == outputs(make_engine(make_model(seed=1), weight_layout=layout))

    # A partial update (one slice of each fused tensor) through weight_update, as a sync applies it.
    mixed = make_model(seed=1)
    partial = {name: make_model(seed=2).state_dict()[name]
               for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    mixed.load_state_dict(partial, strict=False)
    with engine.weight_update() as apply:
        apply(list(partial.items()))
    assert outputs(engine) == outputs(make_engine(mixed, weight_layout=layout))


BF16_PACKED = ((["onednn"] if onednn_packing_available(torch.device("cpu"), torch.bfloat16) else [])
               + (["panels"] if cpu_kernels.available() else []))


@pytest.mark.skipif(not BF16_PACKED, reason="neither oneDNN bf16 nor the bf16 kernel on this CPU")
@pytest.mark.parametrize("layout", BF16_PACKED or ["onednn"])
@pytest.mark.parametrize("decode_mode", ["static", "eager"])
def test_a_bf16_engine_on_packed_weights_samples_the_dense_engines_tokens_and_logprobs(decode_mode, layout):
    # The packed layouts are auto's choice for bf16 on some CPUs because they are the same arithmetic, faster.
    dense = make_engine(dtype="bfloat16", weight_layout="dense", decode_mode=decode_mode)
    packed = make_engine(dtype="bfloat16", weight_layout=layout, decode_mode=decode_mode)
    assert packed._runner.compact.weight_layout == layout
    assert outputs(packed) == outputs(dense)
    donor = make_model(seed=1)
    for engine in (dense, packed):  # the packed copy follows an update (repack)
        engine.update_weights(donor.state_dict().items())
    assert outputs(packed) == outputs(dense)


def test_a_weight_update_in_parts_is_seen_whole_by_requests_served_meanwhile():
    donor = make_model(seed=1)
    engine = make_engine()
    results: list = []
    weights = list(donor.state_dict().items())
    with engine.weight_update() as apply:
        apply(weights[: len(weights) // 2])
        worker = threading.Thread(target=lambda: results.extend(
            engine.generate_batch([request(PROMPTS[0], temperature=0.0, max_tokens=8)])))
        worker.start()
        worker.join(timeout=0.3)
        assert worker.is_alive() and engine.stats.steps == 0  # no step runs on half-new weights
        apply(weights[len(weights) // 2 :])
    worker.join(timeout=60)
    assert results[0][0].response_ids == reference_greedy(donor, PROMPTS[0], 8, {EOS})


def test_update_weights_rejects_unknown_names_and_wrong_shapes():
    engine = make_engine()
    with pytest.raises(ValueError, match=r"unknown parameter 'model.layers.0.mlp.gate.weight'.*gate_proj"):
        engine.update_weights([("model.layers.0.mlp.gate.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(64,\).*\(65,\) was sent"):
        engine.update_weights([("model.norm.weight", torch.zeros(65))])


def test_update_weights_accepts_tied_aliases_and_casts_dtype():
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=1))
    engine = NativeEngine(model=model, eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=4, dtype="bfloat16")
    new = torch.randn_like(model.lm_head.weight, dtype=torch.float32)
    engine.update_weights([("lm_head.weight", new)])
    embed = model.get_input_embeddings().weight
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, new.to(torch.bfloat16))  # tied: the embedding is the same tensor


def test_bfloat16_generation_keeps_rope_buffers_in_float32():
    model = make_model()
    engine = make_engine(model, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    (trajectory,) = engine.generate_batch([request(PROMPTS[1], temperature=0.7, max_tokens=6, seed=3)])[0]
    assert len(trajectory.response_ids) >= 1
    assert all(lp <= 0.0 and lp > -100 for lp in trajectory.rollout_logprobs)


def test_bad_requests_name_the_request_and_the_problem(engine):
    with pytest.raises(ValueError, match=r"request 'r1': empty prompt_ids"):
        engine.generate_batch([request([], request_id="r1")])
    with pytest.raises(ValueError, match=r"requests\[1\]: request 'r2': prompt_ids\[2\] = 272 is outside"):
        engine.generate_batch([request([1]), request([1, 2, VOCAB], request_id="r2")])
    with pytest.raises(ValueError, match=r"request \(no request_id\): SamplingParams.top_k"):
        asyncio.run(engine.generate(request([1], top_k=0)))
    assert engine.generate_batch([]) == []


def test_nan_weights_fail_the_requests_clearly_and_the_engine_recovers():
    engine = make_engine()
    good = engine.model.state_dict()["model.norm.weight"].clone()
    engine.update_weights([("model.norm.weight", torch.full_like(good, float("nan")))])
    with pytest.raises(RuntimeError, match=r"NaN logits for requests 'bad'"):
        engine.generate_batch([request(PROMPTS[0], request_id="bad", max_tokens=3)])
    engine.update_weights([("model.norm.weight", good)])
    assert len(engine.generate_batch([request(PROMPTS[0], max_tokens=3)])[0]) == 1


def test_sleep_refuses_requests_until_wake_up(engine):
    engine.sleep()
    try:
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate_batch([request(PROMPTS[0], max_tokens=2)])
    finally:
        engine.wake_up()
    assert len(engine.generate_batch([request(PROMPTS[0], max_tokens=2)])) == 1


def test_sleep_while_generating_is_refused():
    engine = make_engine()

    async def main() -> None:
        task = asyncio.ensure_future(engine.generate(request(PROMPTS[0], max_tokens=30)))
        await asyncio.sleep(0)  # queued, not yet taken into a batch
        with pytest.raises(RuntimeError, match="1 samples are still being generated"):
            engine.sleep()
        while engine.stats.steps == 0:
            await asyncio.sleep(0)
        # Taken off the queue and decoding: its KV cache rows are in use.
        with pytest.raises(RuntimeError, match="1 samples are still being generated"):
            engine.sleep()
        await task
        engine.sleep()  # idle again
        engine.wake_up()

    asyncio.run(main())


def test_cancelled_request_stops_and_others_finish():
    engine = make_engine()

    async def main() -> tuple[list[Trajectory], int]:
        doomed = asyncio.ensure_future(engine.generate(request(PROMPTS[0], max_tokens=100, temperature=0.0)))
        kept = asyncio.ensure_future(engine.generate(request(PROMPTS[1], max_tokens=20, temperature=0.0)))
        while engine.stats.steps < 3:  # let a few decode steps run
            await asyncio.sleep(0.001)
        doomed.cancel()
        result = await kept
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return result, engine.stats.steps

    result, steps = asyncio.run(main())
    assert len(result[0].response_ids) == 20
    # Serving ended with the 20-token request: the cancelled 100-token sample did not hold it open.
    assert steps == 20


def test_generate_batch_leaves_no_threads_and_works_inside_a_running_loop(engine):
    threads = threading.active_count()
    engine.generate_batch([request(p, max_tokens=3) for p in PROMPTS])
    assert threading.active_count() == threads

    async def sync_helper_called_from_async_code() -> list[list[Trajectory]]:
        return engine.generate_batch([request(PROMPTS[0], max_tokens=3)])

    assert len(asyncio.run(sync_helper_called_from_async_code())) == 1
    assert threading.active_count() == threads


def test_one_engine_serves_successive_event_loops(engine):
    for _ in range(3):
        (trajectory,) = asyncio.run(engine.generate(request(PROMPTS[2], max_tokens=2)))
        assert len(trajectory.response_ids) >= 1


def test_constructor_validates_its_arguments():
    with pytest.raises(ValueError, match="max_batch_size"):
        make_engine(max_batch_size=0)
    with pytest.raises(ValueError, match=r"eos_token_ids 999 is outside"):
        make_engine(eos_token_ids=[999])
    with pytest.raises(ValueError, match="unknown rollout dtype 'fp8'"):
        resolve_dtype("fp8")
