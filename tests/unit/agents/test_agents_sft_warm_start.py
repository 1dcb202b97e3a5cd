"""The tool task's warm start teaches exactly the token sequences the tool agent will produce: a
conversation pair becomes the same ids and loss mask as an episode in which the model writes the
same turns, and a staged warm start is cached under a key naming every stage."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.tokens import render_ids
from hybridflow.agents.tools import ToolRegistry, calculator
from hybridflow.controller.sft import SFTSpec, SFTStage, prepare_builtin_model, sft_trajectories
from hybridflow.data.tasks.calculator import calculator_sft_pairs, make_calculator_rows
from hybridflow.models.tiny import TinyModelSpec
from hybridflow.types import RowFields, SamplingParams

torch.set_num_threads(1)


def test_a_conversation_pair_is_tokenised_like_the_agent_episode(tokenizer, scripted) -> None:
    rows = make_calculator_rows(40, 0, "train")
    pairs = [pair for pair in calculator_sft_pairs(rows, 0.5) if isinstance(pair[1], list)][:3]
    assert pairs
    for messages, turns in pairs:
        (example,) = sft_trajectories([(messages, turns)], tokenizer)
        own_turns = [turn["content"] for turn in turns if turn["role"] == "assistant"]
        engine = scripted(lambda text, turn, own_turns=own_turns: own_turns[turn])
        runner = AgentRunner(AgentContext(tokenizer, tools=ToolRegistry([calculator])), default_agent="tool_agent")
        prompt_ids = render_ids(tokenizer, messages, add_generation_prompt=True)
        (episode,) = runner.generate_sync([AgentRow(prompt_ids)], SamplingParams(max_tokens=200), engine)
        assert episode.agent.metrics["tool_calls"] == 1  # the call ran and was answered
        assert example.prompt_ids == episode.prompt_ids
        assert example.response_ids == episode.response_ids
        assert example.loss_mask == episode.loss_mask


def test_a_direct_answer_pair_keeps_the_single_turn_form(tokenizer) -> None:
    (example,) = sft_trajectories([([{"role": "user", "content": "What is 11 * 99?"}], "1089")], tokenizer)
    assert tokenizer.decode(example.response_ids, skip_special_tokens=False) == "1089<|im_end|>"
    assert example.loss_mask == [1] * 5


def test_a_conversation_must_end_with_an_assistant_turn(tokenizer) -> None:
    with pytest.raises(ValueError, match="must end with an assistant turn"):
        sft_trajectories([([{"role": "user", "content": "?"}], [{"role": "tool", "content": "1"}])], tokenizer)


def test_stages_run_in_order_and_enter_the_cache_key(tmp_path, monkeypatch) -> None:
    runs: list[tuple[int, int, float, str]] = []

    def fake_run_sft(model_dir, pairs, out_dir, spec, device, **_):  # the SFT itself is tested elsewhere
        runs.append((spec.steps, spec.seed, spec.lr, pairs[0][1]))
        shutil.copytree(model_dir, out_dir)

    monkeypatch.setattr("hybridflow.controller.sft.run_sft", fake_run_sft)
    spec = SFTSpec(steps=3, batch_size=2, lr=1e-3, seed=5)
    small = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1)
    first = [([{"role": "user", "content": "a"}], "first")]
    later = [([{"role": "user", "content": "b"}], "later")]
    common = dict(pairs=first, pairs_key="k", spec=spec, device=torch.device("cpu"), model_spec=small)
    staged = prepare_builtin_model(tmp_path / "cache", stages=[SFTStage(later, 2, lr=5e-4)], **common)
    assert runs == [(3, 5, 1e-3, "first"), (2, 6, 5e-4, "later")]  # each stage: its steps, shuffle, lr
    single = prepare_builtin_model(tmp_path / "cache", **common)
    assert staged != single and (single / "config.json").is_file()
    assert prepare_builtin_model(tmp_path / "cache", stages=[SFTStage(later, 2, lr=5e-4)], **common) == staged
    assert prepare_builtin_model(tmp_path / "cache", stages=[SFTStage(later, 2)], **common) != staged
    assert len(runs) == 5  # the cached staged model was reused; the other lr trained anew


def test_runs_started_together_share_one_warm_start(tmp_path, monkeypatch) -> None:
    """A second run asking for a warm start that another is building waits for it and reuses the
    result, rather than training its own copy (a sweep, or parallel test workers, on one cache)."""
    runs: list[str] = []
    started, release = threading.Event(), threading.Event()

    def slow_run_sft(model_dir, pairs, out_dir, spec, device, **_):
        runs.append(threading.current_thread().name)
        started.set()
        release.wait(timeout=30)
        shutil.copytree(model_dir, out_dir)

    monkeypatch.setattr("hybridflow.controller.sft.run_sft", slow_run_sft)
    small = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1)
    common = dict(pairs=[([{"role": "user", "content": "a"}], "x")], pairs_key="k", model_spec=small,
                  spec=SFTSpec(steps=3, batch_size=2, lr=1e-3, seed=5), device=torch.device("cpu"))
    results: dict[str, object] = {}

    def prepare(name: str) -> None:
        results[name] = prepare_builtin_model(tmp_path / "cache", **common)

    first = threading.Thread(target=prepare, args=("first",), name="first")
    first.start()
    assert started.wait(timeout=30)
    second = threading.Thread(target=prepare, args=("second",), name="second")
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive(), "the second run must wait for the warm start in progress"
    release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert runs == ["first"]
    assert results["first"] == results["second"] and (results["second"] / "config.json").is_file()
