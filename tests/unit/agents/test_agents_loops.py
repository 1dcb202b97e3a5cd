"""Agent loops and the runner: turn limits, budgets, malformed calls, interactions, per-row
loop choice, concurrency and metrics, against a scripted engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridflow.agents.base import (
    AgentContext,
    AgentRow,
    AgentRunner,
    build_agent_loop,
    compute_agent_metrics,
)
from hybridflow.agents.interactions import InteractionResponse, build_interaction
from hybridflow.agents.tokens import render_ids
from hybridflow.agents.tools import ToolRegistry, calculator, tool
from hybridflow.types import AgentEpisode, RowFields, SamplingParams, Trajectory

CALL = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
SLEEP_S = 0.4


@tool(timeout_s=5)
async def nap(seconds: float) -> str:
    """Sleep (asynchronously) and report."""
    await asyncio.sleep(seconds)
    return "rested"


@tool(timeout_s=5)
def blocking_nap(seconds: float) -> str:
    """Sleep in a thread (a sync tool that blocks)."""
    time.sleep(seconds)
    return "rested"


def prompt_ids(tokenizer, question: str = "What is 6*7?") -> list[int]:
    return render_ids(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)


def runner_for(tokenizer, default_agent: str = "tool_agent", **context) -> AgentRunner:
    context.setdefault("tools", ToolRegistry([calculator, nap, blocking_nap]))
    return AgentRunner(AgentContext(tokenizer, **context), default_agent=default_agent)


def run_rows(runner: AgentRunner, engine, rows: list[AgentRow], **params) -> list[Trajectory]:
    return runner.generate_sync(rows, SamplingParams(**{"max_tokens": 400, **params}), engine)


def test_single_turn_returns_the_engine_sample(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: "42")
    rows = [AgentRow(prompt_ids(tokenizer), RowFields(data_source="d", ground_truth="42"), group_id=7)]
    trajectories = run_rows(runner_for(tokenizer, "single_turn"), engine, rows, n=3, seed=5)
    assert len(trajectories) == 3 and {t.group_id for t in trajectories} == {7}
    first = trajectories[0]
    assert tokenizer.decode(first.response_ids, skip_special_tokens=False) == "42<|im_end|>"
    assert first.num_turns == 1 and first.loss_mask == [1, 1, 1]
    assert first.row.ground_truth == "42" and first.agent.name == "single_turn"
    assert all(request.params.n == 1 for request in engine.requests)
    seeds = [request.params.seed for request in engine.requests]
    assert len(set(seeds)) == 3  # every episode of the group samples differently


def test_tool_call_then_answer(tokenizer, scripted) -> None:
    def reply(text: str, turn: int) -> str:
        return CALL.format("calculator", '{"expression": "6*7"}') if turn == 0 else "42"

    (trajectory,) = run_rows(runner_for(tokenizer), scripted(reply), [AgentRow(prompt_ids(tokenizer))])
    assert trajectory.num_turns == 2 and trajectory.finish_reason == "stop"
    assert trajectory.agent.stop == "no_tool_call"
    assert trajectory.agent.messages[1] == {"role": "tool", "content": "42", "name": "calculator"}
    assert trajectory.agent.messages[-1]["content"] == "42"  # the final answer
    inserted = [i for i, m in enumerate(trajectory.loss_mask) if m == 0]
    assert inserted and all(trajectory.rollout_logprobs[i] == 0.0 for i in inserted)
    assert all(trajectory.rollout_logprobs[i] < 0 for i, m in enumerate(trajectory.loss_mask) if m == 1)
    assert trajectory.agent.metrics == {
        "num_turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "user_turns": 0.0
    }


def test_max_assistant_turns_stops_and_skips_the_last_calls(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: CALL.format("calculator", '{"expression": "1+1"}'))
    runner = runner_for(tokenizer, max_assistant_turns=3)
    (trajectory,) = run_rows(runner, engine, [AgentRow(prompt_ids(tokenizer))])
    assert trajectory.num_turns == 3 and len(engine.requests) == 3
    assert trajectory.agent.stop == "max_assistant_turns"
    assert trajectory.agent.metrics["tool_calls"] == 2.0  # the third turn's call never ran
    assert trajectory.agent.messages[-1]["role"] == "assistant"
    assert trajectory.loss_mask[-1] == 1  # ends on the model's own end of turn


def test_length_budget_covers_the_whole_episode(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: CALL.format("calculator", '{"expression": "1+1"}'))
    for budget in (30, 90, 123):
        (trajectory,) = run_rows(runner_for(tokenizer, max_assistant_turns=50), engine, [AgentRow(prompt_ids(tokenizer))], max_tokens=budget)
        assert len(trajectory.response_ids) == budget and trajectory.finish_reason == "length"
        assert trajectory.agent.stop == "length"
    # Each turn was asked for at most what was left of the budget.
    assert all(request.params.max_tokens <= 123 for request in engine.requests)


def test_malformed_and_unknown_calls_are_answered_and_counted(tokenizer, scripted) -> None:
    def reply(text: str, turn: int) -> str:
        if turn == 0:
            return "<tool_call>{nope}</tool_call>" + CALL.format("teleport", "{}") + CALL.format("calculator", '{"expression": "2*3"}')
        return "done"

    (trajectory,) = run_rows(runner_for(tokenizer), scripted(reply), [AgentRow(prompt_ids(tokenizer))])
    responses = [m["content"] for m in trajectory.agent.messages if m["role"] == "tool"]
    assert responses[0].startswith("Error: the tool call is not valid JSON")
    assert responses[1].startswith("Error: unknown tool 'teleport'")
    assert responses[2] == "6"
    metrics = trajectory.agent.metrics
    assert (metrics["tool_calls"], metrics["tool_errors"]) == (3.0, 2.0)


def test_too_many_calls_in_one_turn(tokenizer, scripted) -> None:
    calls = "".join(CALL.format("calculator", f'{{"expression": "{i}+0"}}') for i in range(5))
    engine = scripted(lambda text, turn: calls if turn == 0 else "ok")
    runner = runner_for(tokenizer, max_parallel_tool_calls=3)
    (trajectory,) = run_rows(runner, engine, [AgentRow(prompt_ids(tokenizer))], max_tokens=1000)
    responses = [m["content"] for m in trajectory.agent.messages if m["role"] == "tool"]
    assert responses[:3] == ["0", "1", "2"]
    assert all("at most 3 tool calls per turn" in r for r in responses[3:])


@pytest.mark.parametrize("tool_name", ["nap", "blocking_nap"])
def test_calls_of_one_turn_run_concurrently(tokenizer, scripted, tool_name: str) -> None:
    calls = "".join(CALL.format(tool_name, f'{{"seconds": {SLEEP_S}}}') for _ in range(4))
    engine = scripted(lambda text, turn: calls if turn == 0 else "ok")
    started = time.monotonic()
    (trajectory,) = run_rows(runner_for(tokenizer), engine, [AgentRow(prompt_ids(tokenizer))])
    assert time.monotonic() - started < 3 * SLEEP_S  # serial would be 4 x SLEEP_S
    assert trajectory.agent.metrics["tool_calls"] == 4.0


@pytest.mark.parametrize("tool_name", ["nap", "blocking_nap"])
def test_a_sleeping_tool_does_not_serialise_other_episodes(tokenizer, scripted, tool_name: str) -> None:
    episodes = 8
    engine = scripted(lambda text, turn: CALL.format(tool_name, f'{{"seconds": {SLEEP_S}}}') if turn == 0 else "ok", delay_s=0.01)
    rows = [AgentRow(prompt_ids(tokenizer, f"q{i}"), group_id=i) for i in range(episodes)]
    started = time.monotonic()
    trajectories = run_rows(runner_for(tokenizer), engine, rows)
    elapsed = time.monotonic() - started
    assert elapsed < 3 * SLEEP_S, f"{episodes} episodes with a {SLEEP_S} s tool took {elapsed:.2f} s"
    assert engine.max_in_flight == episodes  # every episode's request reached the engine at once
    assert [t.group_id for t in trajectories] == list(range(episodes))
    assert all(t.num_turns == 2 for t in trajectories)


def test_max_concurrent_episodes_bounds_the_engine_load(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: "ok", delay_s=0.02)
    runner = AgentRunner(AgentContext(tokenizer), default_agent="tool_agent", max_concurrent_episodes=2)
    run_rows(runner, engine, [AgentRow(prompt_ids(tokenizer)) for _ in range(6)])
    assert engine.max_in_flight == 2


class Quizmaster:
    """Says "wrong" until the assistant answers 42, then ends with a reward."""

    def __init__(self, answer: str = "42") -> None:
        self.answer = answer

    async def respond(self, messages, metadata):
        if self.answer in messages[-1]["content"]:
            return InteractionResponse(done=True, reward=1.0)
        return InteractionResponse(reply="Wrong, try again.", reward=0.0)


def test_interaction_replies_ends_and_rewards(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: ["41", "40", "42"][turn])
    runner = runner_for(tokenizer, interaction=build_interaction(f"{__name__}:Quizmaster", answer="42"))
    (trajectory,) = run_rows(runner, engine, [AgentRow(prompt_ids(tokenizer))])
    assert trajectory.num_turns == 3 and trajectory.agent.stop == "interaction_done"
    assert trajectory.agent.interaction_reward == 1.0
    assert trajectory.agent.metrics["user_turns"] == 2.0
    user_text = tokenizer.decode(
        [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask) if m == 0], skip_special_tokens=False
    )
    assert user_text.count("Wrong, try again.") == 2  # user turns carry loss mask 0


def test_interaction_user_turn_limit(tokenizer, scripted) -> None:
    runner = runner_for(tokenizer, interaction=Quizmaster(), max_user_turns=1)
    (trajectory,) = run_rows(runner, scripted(lambda text, turn: "no idea"), [AgentRow(prompt_ids(tokenizer))])
    assert trajectory.num_turns == 2 and trajectory.agent.stop == "max_user_turns"
    assert trajectory.agent.interaction_reward == 0.0


class EchoLoop:
    """A custom loop from a module path: returns the prompt reversed, no engine call."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context

    async def run(self, prompt_ids, metadata, params, engine):
        ids = list(reversed(prompt_ids))[:3]
        return Trajectory(prompt_ids, ids, [1] * len(ids), [0.0] * len(ids), "stop", metadata={"custom": True})


class BrokenLoop(EchoLoop):
    async def run(self, prompt_ids, metadata, params, engine):
        await asyncio.sleep(0.01)
        raise KeyError("missing field")


def test_agent_name_picks_the_loop_per_row(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: "plain")
    rows = [
        AgentRow(prompt_ids(tokenizer), RowFields(agent_name="single_turn")),
        AgentRow(prompt_ids(tokenizer), RowFields(extra_info={"agent_name": f"{__name__}:EchoLoop"})),
        AgentRow(prompt_ids(tokenizer)),  # the runner's default
    ]
    trajectories = run_rows(runner_for(tokenizer, default_agent="tool_agent"), engine, rows)
    assert [t.agent.name for t in trajectories] == ["single_turn", f"{__name__}:EchoLoop", "tool_agent"]
    assert trajectories[1].metadata == {"custom": True}  # a custom loop's own record, carried as it is


def test_a_failing_loop_names_its_row_and_stops_the_batch(tokenizer, scripted) -> None:
    engine = scripted(lambda text, turn: "slow", delay_s=5.0)
    rows = [AgentRow(prompt_ids(tokenizer)),
            AgentRow(prompt_ids(tokenizer), RowFields(agent_name=f"{__name__}:BrokenLoop"))]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"agent loop '.*BrokenLoop' failed on row 1 \(sample 0\)"):
        run_rows(runner_for(tokenizer), engine, rows)
    assert time.monotonic() - started < 2.0  # the slow episode was cancelled, not awaited


def test_unknown_loops_fail_at_construction(tokenizer) -> None:
    with pytest.raises(ValueError, match="known names: openai, single_turn, single_turn_agent, tool_agent"):
        AgentRunner(AgentContext(tokenizer), default_agent="three_turn")
    with pytest.raises(TypeError, match="has no async run"):
        build_agent_loop(f"{__name__}:Quizmaster", AgentContext(tokenizer))


def test_batch_metrics() -> None:
    def trajectory(turns: int, calls: float, errors: float, timeouts: float, mask: list[int]) -> Trajectory:
        record = {"tool_calls": calls, "tool_errors": errors, "tool_timeouts": timeouts}
        n = len(mask)
        return Trajectory([1], [2] * n, mask, [0.0] * n, "stop", num_turns=turns, agent=AgentEpisode(metrics=record))

    metrics = compute_agent_metrics(
        [trajectory(1, 0, 0, 0, [1]), trajectory(3, 4, 1, 1, [1, 0, 0, 1]), trajectory(2, 4, 2, 0, [1, 0, 1])]
    )
    assert metrics == {
        "num_turns/mean": 2.0,
        "num_turns/max": 3.0,
        "num_turns/min": 1.0,
        "tool_calls/mean": pytest.approx(8 / 3),
        "tool_calls/max": 4.0,
        "tool_calls/error_rate": 3 / 8,
        "tool_calls/timeout_rate": 1 / 8,
        "response_length/masked_fraction": 3 / 8,  # 3 inserted tokens of 8
    }
    assert compute_agent_metrics([]) == {}
