"""rollout.max_num_batched_tokens and rollout.enable_chunked_prefill: the native engine's prefill budget
per step (chunked or whole prompts), and what the vLLM and SGLang adapters are given."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.rollout.factory import EngineArgs, build_rollout_engine
from hybridflow.inference.native import NativeEngine
from hybridflow.rollout.sglang_engine import launch_args
from hybridflow.rollout.vllm_engine import scheduler_args
from hybridflow.types import Trajectory

from test_rollout_native_engine import EOS, PAD, PROMPTS, make_engine, make_model, reference_greedy, request

torch.set_num_threads(1)

LONG_PROMPT = [(11 * i + 5) % 250 for i in range(41)]  # 40 tokens to prefill
# Three distinct 11-token prompts (10 to prefill each): no prefix is shared, so no cache hit.
ELEVEN = [[(7 * i + 13 * k + 1) % 250 for i in range(11)] for k in range(3)]


def record_chunks(engine: NativeEngine) -> list[list[tuple[int, int, int]]]:
    """Each step's prefill chunks as (start, end, tokens the prompt prefills), in step order."""
    steps: list[list[tuple[int, int, int]]] = []
    plan = engine._scheduler.plan

    def recording():
        result = plan()
        if result is not None:
            steps.append([(c.start, c.end, c.request.prefix_length) for c in result.chunks])
        return result

    engine._scheduler.plan = recording  # type: ignore[method-assign]
    return steps


def generate(engine: NativeEngine, prompts: list[list[int]], max_tokens: int = 10) -> list[Trajectory]:
    return [t for (t,) in engine.generate_batch([request(p, temperature=0.0, max_tokens=max_tokens) for p in prompts])]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model()


def test_outputs_are_the_same_with_and_without_chunked_prefill(model):
    prompts = [LONG_PROMPT, *PROMPTS, *ELEVEN]
    settings = [
        {"max_prefill_tokens": 4},  # every prompt over 5 tokens is split
        {"max_prefill_tokens": 2048},  # every prompt whole, all in one step
        {"max_prefill_tokens": 48, "enable_chunked_prefill": False},  # whole prompts over several steps
    ]
    runs = [generate(make_engine(model, **s), prompts, max_tokens=12) for s in settings]
    for prompt, first in zip(prompts, runs[0], strict=True):
        assert first.response_ids == reference_greedy(model, prompt, 12, {EOS})
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert a.response_ids == b.response_ids
            assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def test_a_long_prompt_is_prefilled_in_chunks_over_several_steps(model):
    engine = make_engine(model, max_prefill_tokens=8)
    steps = record_chunks(engine)
    (trajectory,) = generate(engine, [LONG_PROMPT], max_tokens=4)
    prefilling = [chunks for chunks in steps if chunks]
    assert [[(start, end) for start, end, _ in chunks] for chunks in prefilling] == [
        [(0, 8)], [(8, 16)], [(16, 24)], [(24, 32)], [(32, 40)]
    ]
    assert engine.stats.prefill_forwards == 5 and engine.stats.prefill_tokens == 40
    assert trajectory.response_ids == reference_greedy(model, LONG_PROMPT, 4, {EOS})


def test_a_long_prompt_prefilling_in_chunks_does_not_stall_a_running_sequence(model):
    engine = make_engine(model, max_prefill_tokens=8)

    async def main() -> int:
        running = asyncio.ensure_future(engine.generate(request(PROMPTS[0], temperature=0.0, max_tokens=20)))
        while engine.stats.steps < 2:
            await asyncio.sleep(0.001)
        await engine.generate(request(LONG_PROMPT, temperature=0.0, max_tokens=2))
        await running
        return engine.stats.steps

    # 20 tokens of the running request, one per step: the 5 chunk steps decoded it too.
    assert asyncio.run(main()) == 20


def test_without_chunking_a_step_stops_at_the_budget_and_never_splits_a_prompt(model):
    engine = make_engine(model, max_prefill_tokens=25, enable_chunked_prefill=False)
    steps = record_chunks(engine)
    generate(engine, ELEVEN, max_tokens=3)
    prefilling = [chunks for chunks in steps if chunks]
    # 10 + 10 fit 25 tokens; the third prompt's 10 would not fit the 5 left, so it waits a step whole.
    assert [[(start, end) for start, end, _ in chunks] for chunks in prefilling] == [[(0, 10), (0, 10)], [(0, 10)]]
    chunked = make_engine(model, max_prefill_tokens=25)
    chunked_steps = record_chunks(chunked)
    generate(chunked, ELEVEN, max_tokens=3)
    assert [[(s, e) for s, e, _ in chunks] for chunks in chunked_steps if chunks] == [[(0, 10), (0, 10), (0, 5)],
                                                                                   [(5, 10)]]


def test_without_chunking_a_prompt_longer_than_the_budget_is_prefilled_whole_in_a_step_of_its_own(model):
    """SGLang's bound (the larger of the budget and the context): verl's examples turn chunking off with a
    budget below their longest prompt, and the prompt is still prefilled whole, alone in its step."""
    engine = make_engine(model, max_prefill_tokens=16, enable_chunked_prefill=False)
    steps = record_chunks(engine)
    long, short = generate(engine, [LONG_PROMPT, PROMPTS[1]])
    prefilling = [[(start, end) for start, end, _ in chunks] for chunks in steps if chunks]
    assert prefilling[0] == [(0, 40)]  # the 40 tokens at once, nothing else in that step
    assert [(0, len(PROMPTS[1]) - 1)] in prefilling[1:]
    assert long.response_ids == reference_greedy(model, LONG_PROMPT, 10, {EOS})
    assert short.response_ids == reference_greedy(model, PROMPTS[1], 10, {EOS})


def test_the_rollout_factory_gives_the_native_engine_the_budget(model):
    engine = build_rollout_engine(
        "native", EngineArgs(model=make_model(), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=4,
                             device="cpu", dtype="float32", max_num_batched_tokens=12, enable_chunked_prefill=False),
    )
    steps = record_chunks(engine)
    generate(engine, ELEVEN[:2], max_tokens=2)
    assert [len(chunks) for chunks in steps if chunks] == [1, 1]  # 10 + 10 > 12: one whole prompt a step


def test_vllm_gets_the_budget_and_chunking_on_a_gpu():
    assert scheduler_args(4096, True, on_gpu=True, longest=32768) == {
        "enable_chunked_prefill": True, "max_num_batched_tokens": 4096}
    assert scheduler_args(None, True, on_gpu=True, longest=32768) == {}  # vLLM's own default
    # Whole prompts need a step budget of a full sequence (vLLM refuses to start otherwise).
    assert scheduler_args(4096, False, on_gpu=True, longest=32768) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 32768}
    assert scheduler_args(65536, False, on_gpu=True, longest=32768) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 65536}


def test_vllm_on_a_cpu_prefills_whole_prompts():
    assert scheduler_args(8192, True, on_gpu=False, longest=128) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert scheduler_args(None, True, on_gpu=False, longest=128) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 2048}


def test_sglang_gets_the_budget_as_its_chunk_size_and_prefill_tokens():
    def flags(**kwargs) -> dict[str, str]:
        args = launch_args(dtype="bfloat16", seed=0, max_batch_size=8, enforce_eager=False, enable_prefix_caching=True,
                           device=torch.device("cuda", 0), **kwargs)
        return {a: b for a, b in zip(args, args[1:], strict=False) if a in ("--chunked-prefill-size",
                                                                             "--max-prefill-tokens")}

    assert flags(max_num_batched_tokens=4096) == {"--chunked-prefill-size": "4096", "--max-prefill-tokens": "4096"}
    assert flags(max_num_batched_tokens=4096, enable_chunked_prefill=False) == {
        "--chunked-prefill-size": "-1", "--max-prefill-tokens": "4096"}
    assert flags() == {}


def test_chunked_prefill_off_with_a_budget_below_a_whole_sequence_is_a_note():
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.config.validate import validate_config

    lengths = ["data.max_prompt_length=512", "data.max_response_length=512"]
    validate_config(make_config(overrides=[*lengths, "rollout.enable_chunked_prefill=false",
                                           "rollout.max_num_batched_tokens=1024"]))
    validate_config(make_config(overrides=[*lengths, "rollout.max_num_batched_tokens=256"]))  # chunked: any budget
    # Below a whole sequence: a note (every engine prefills a longer prompt whole, in a step of its own).
    (warning,) = [w for w in validate_config(make_config(overrides=[
        *lengths, "rollout.enable_chunked_prefill=false", "rollout.max_num_batched_tokens=1000"]))
        if "max_num_batched_tokens" in w]
    assert "max_num_batched_tokens=1000 below a whole sequence" in warning and "step of its own" in warning
    with pytest.raises(ConfigError, match=r"rollout\.max_num_batched_tokens=0 must be >= 1"):
        validate_config(make_config(overrides=["rollout.max_num_batched_tokens=0"]))



def test_a_run_built_from_the_config_gives_its_rollout_engine_the_budget(tmp_path):
    from hybridflow.config import load_config
    from hybridflow.controller.setup import build_run
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model", TinyModelSpec(num_hidden_layers=1), seed=0)
    cfg = load_config("grpo", overrides=[
        f"model.path={model_dir}", f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]",
        "trainer.progress_bar=false", "trainer.num_threads=1", "trainer.timeline=false",
        "rollout.max_num_batched_tokens=96", "rollout.enable_chunked_prefill=false",
    ])
    run = build_run(cfg)
    try:
        engine = run.roles.rollout.groups[0]._workers[0].engine
        assert (engine._scheduler.max_prefill_tokens, engine._scheduler.chunked_prefill) == (96, False)
    finally:
        run.close()
