"""The rollout worker with ``rollout.multi_turn``: requests run as agent episodes over the real
native engine (loop chosen per row), grouped back per request, seeded, and without agents the
engine serves the requests exactly as before."""

from __future__ import annotations

import pytest
import torch

from hybridflow.agents.parsers import ParsedTurn, ToolCall
from hybridflow.agents.tokens import render_ids
from hybridflow.models.tiny import TinyModelSpec, build_tiny_tokenizer
from hybridflow.types import GenerationRequest, RowFields, SamplingParams
from hybridflow.workers.rollout import AgentSetup, RolloutSetup, RolloutWorker

from test_agents_native_engine import IM_END, steered_model

torch.set_num_threads(1)

TURNS = 3


class AlwaysCalculate:
    """Every turn asks for 6*7, whatever the model wrote."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(items=(ToolCall("calculator", {"expression": "6*7"}),), content=text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The steered tiny model (turns end by themselves) as a model directory on disk."""
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1)
    model = steered_model(spec)
    model.config.tie_word_embeddings = False  # its head is its own: keep it so when loaded back
    out = tmp_path_factory.mktemp("steered") / "model"
    model.save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    return str(out)


def worker(model_dir: str, agent: AgentSetup | None) -> RolloutWorker:
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=16, seed=0, agent=agent)
    return RolloutWorker(0, 1, setup)


def requests(n: int = 2, rows: list[RowFields] | None = None) -> list[GenerationRequest]:
    """Three requests, with ``rows``' fields (none when not given) and group ids 0, 1, 2."""
    tokenizer = build_tiny_tokenizer()
    prompt = render_ids(tokenizer, [{"role": "user", "content": "What is 6*7?"}], add_generation_prompt=True)
    return [GenerationRequest(prompt, SamplingParams(n=n, max_tokens=200, seed=10 + i),
                              row=None if rows is None else rows[i], group_id=i) for i in range(3)]


ROWS = [RowFields(data_source="a"), RowFields(data_source="b", agent_name="single_turn"), RowFields(data_source="c")]


AGENT = AgentSetup(default_agent="tool_agent", tool_config_path="builtin:calculator",
                   tool_parser=f"{__name__}:AlwaysCalculate", max_assistant_turns=TURNS)


def test_requests_run_as_agent_episodes_chosen_per_row(model_dir) -> None:
    rollout = worker(model_dir, AGENT)
    groups = rollout.generate(requests(rows=ROWS))
    assert [len(group) for group in groups] == [2, 2, 2]
    for i, (group, row) in enumerate(zip(groups, ROWS)):
        for t in group:
            assert t.row is row and t.group_id == i  # the request's row and group come along
            if row.agent_name == "single_turn":
                assert t.num_turns == 1 and all(t.loss_mask)
            else:
                assert t.num_turns == TURNS and t.agent.metrics["tool_calls"] == TURNS - 1
                assert 0 in t.loss_mask and t.response_ids.count(IM_END) > TURNS
    again = rollout.generate(requests(rows=ROWS))  # per-request seeds: the same episodes
    assert [[t.response_ids for t in g] for g in again] == [[t.response_ids for t in g] for g in groups]
    with pytest.raises(ValueError, match="needs each request's row fields"):
        rollout.generate(requests())


def test_without_agents_the_engine_serves_requests_directly(model_dir) -> None:
    rollout = worker(model_dir, None)
    assert rollout.agents is None
    direct = rollout.engine.generate_batch(requests())
    named = [RowFields(data_source="a", agent_name="tool_agent")] * 3  # its agent_name ignored: no agents
    through_worker = rollout.generate(requests(rows=named))
    assert [[t.response_ids for t in g] for g in through_worker] == [[t.response_ids for t in g] for g in direct]
    assert all(t.num_turns == 1 and t.agent is None and t.metadata == {} for g in through_worker for t in g)
    assert [[(t.row, t.group_id) for t in g] for g in through_worker] == [[(named[i], i)] * 2 for i in range(3)]
    # The trainer's version reaches the engine: tokens generated after the sync record it.
    rollout.update_weights(list(rollout.model.state_dict().items()), version=9)
    assert all(t.token_versions == [9] * len(t.response_ids) for g in rollout.generate(requests()) for t in g)


def test_bad_names_fail_when_the_worker_is_built(model_dir) -> None:
    with pytest.raises(ValueError, match="unknown built-in tool"):
        worker(model_dir, AgentSetup(default_agent="tool_agent", tool_config_path="builtin:abacus"))
    with pytest.raises(ValueError, match="unknown agent loop"):
        worker(model_dir, AgentSetup(default_agent="three_turn"))


def test_agent_episodes_in_server_mode_are_the_engine_modes_through_http(model_dir) -> None:
    """rollout.mode=server: every turn of every episode goes through the replica's HTTP server,
    and the seeded episodes come out token for token as in engine mode."""
    direct = worker(model_dir, AGENT).generate(requests(rows=ROWS))
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype="float32", device=torch.device("cpu"),
                         max_batch_size=16, seed=0, agent=AGENT, mode="server")
    served = RolloutWorker(0, 1, setup)
    try:
        assert served.client is not None and served.server.url.startswith("http://127.0.0.1:")
        groups = served.generate(requests(rows=ROWS))
        assert served.engine.stats.generated_tokens > 0  # the served engine did the work
    finally:
        served.close()
    for mine, theirs in zip(groups, direct):
        for a, b in zip(mine, theirs):
            assert (a.response_ids, a.loss_mask, a.num_turns) == (b.response_ids, b.loss_mask, b.num_turns)
            assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
