"""The ``openai`` agent loop: agents written against the official ``openai`` client, served by the
real episode server over the native engine on a tiny model, recorded and stitched for training."""

from __future__ import annotations

import asyncio
import copy
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner, compute_agent_metrics
from hybridflow.agents.openai_agent import OpenAIAgentLoop, OpenAIEpisode, load_agent_function
from hybridflow.agents.parsers import ParsedTurn, ToolCall
from hybridflow.agents.tokens import render_ids
from hybridflow.agents.tools import ToolRegistry, calculator
from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from hybridflow.rollout import EngineArgs, build_rollout_engine
from hybridflow.training.engine import TrainEngine
from hybridflow.types import UNVERSIONED_TOKEN, RowFields, SamplingParams, collate_trajectories

IM_END, PAD = 258, 256
TEMPERATURE = 0.8
PROMPT = [{"role": "user", "content": "What is 6*7?"}]
SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1)


class AlwaysCalculate:
    """Every turn asks for 6*7, whatever the model wrote (the tiny model cannot write JSON)."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(items=(ToolCall("calculator", {"expression": "6*7"}),), content=text)


def ascii_model() -> torch.nn.Module:
    """A random tiny model whose logits are a fixed bias (printable ASCII, often <|im_end|>) plus
    its own context-dependent logits: turns end by themselves, decode to text that re-encodes to
    the same ids, and a logprob read at the wrong position would differ."""
    model = build_tiny_model(SPEC, seed=0)
    bias = torch.full((SPEC.vocab_size,), -1e4)
    bias[32:127] = 0.0
    bias[IM_END] = 2.5
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        head = model.lm_head.weight.detach().clone() * 30.0
        head[:, 0] = bias / SPEC.hidden_size**0.5
        model.lm_head.weight = torch.nn.Parameter(head)
    return model


class RecordingEngine:
    """The native engine, keeping every sample it returned."""

    def __init__(self, engine) -> None:
        self.engine, self.samples = engine, []

    async def generate(self, request):
        samples = await self.engine.generate(request)
        self.samples.extend(samples)
        return samples


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ascii_model()


@pytest.fixture
def engine(model):
    native = build_rollout_engine("native", EngineArgs(model=copy.deepcopy(model), eos_token_ids=[IM_END],
                                                       pad_token_id=PAD, max_batch_size=8, device="cpu",
                                                       dtype="float32", seed=0))
    return RecordingEngine(native)


def run(function: str, engine, *, n: int = 1, max_tokens: int = 128, timeout_s: float = 60.0, tools: bool = True):
    tokenizer = build_tiny_tokenizer()
    context = AgentContext(tokenizer, tools=ToolRegistry([calculator]) if tools else None,
                           tool_parser=f"{__name__}:AlwaysCalculate", openai_agent=f"{__name__}:{function}",
                           openai_timeout_s=timeout_s)
    prompt_ids = render_ids(tokenizer, PROMPT, add_generation_prompt=True)
    rows = [AgentRow(prompt_ids, RowFields(data_source="x", ground_truth="42", prompt_messages=PROMPT,
                                           agent_name="tool_agent"))]
    runner = AgentRunner(context, default_agent="openai")
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=TEMPERATURE, seed=3)
    return runner.generate_sync(rows, params, engine), tokenizer


def recomputed_logprobs(model, trajectories) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's logprobs of the stitched sequences, the rollout's, and the loss mask."""
    batch = collate_trajectories(trajectories, pad_token_id=PAD)
    trainer = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"))
    logprobs, _ = trainer.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=4)
    return logprobs, batch.rollout_logprobs, batch.response_mask.bool()


# ---------------------------------------------------------------------- agent functions
async def one_completion(episode: OpenAIEpisode) -> float:
    async with AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key) as client:
        reply = await client.chat.completions.create(model=episode.model, messages=episode.messages, logprobs=True)
    choice = reply.choices[0]
    ONE_COMPLETION.append(choice)
    return {"score": 0.5, "chars": float(len(choice.message.content or ""))}


ONE_COMPLETION: list = []


def tool_then_answer(episode: OpenAIEpisode) -> float:
    """The usual agent: call, run the tool calls, send the results back, answer."""
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key)
    messages = list(episode.messages)
    first = client.chat.completions.create(model=episode.model, messages=messages, tools=episode.tools)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    second = client.chat.completions.create(model=episode.model, messages=messages, tools=episode.tools)
    return 1.0 if second.choices[0].message.tool_calls else 0.0


def rewrites_history(episode: OpenAIEpisode) -> float:
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key)
    first = client.chat.completions.create(model=episode.model, messages=episode.messages)
    edited = {"role": "assistant", "content": (first.choices[0].message.content or "") + " (edited)"}
    client.chat.completions.create(model=episode.model, messages=[*episode.messages, edited,
                                                                  {"role": "user", "content": "Go on."}])
    return 0.0


def raises(episode: OpenAIEpisode) -> float:
    OpenAI(base_url=episode.base_url, api_key=episode.api_key).chat.completions.create(
        model=episode.model, messages=episode.messages)
    raise RuntimeError("the agent's own bug")


def hangs(episode: OpenAIEpisode) -> float:
    time.sleep(30)
    return 1.0


async def hangs_async(episode: OpenAIEpisode) -> float:
    await asyncio.sleep(30)
    return 1.0


def returns_garbage(episode: OpenAIEpisode) -> str:
    return "great"


def spends_the_budget(episode: OpenAIEpisode) -> float:
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key)
    messages, reasons = list(episode.messages), []
    for _ in range(6):
        reply = client.chat.completions.create(model=episode.model, messages=messages, max_tokens=6)
        reasons.append(reply.choices[0].finish_reason)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    SPENT.append(reasons)
    return 0.0


SPENT: list = []


def text_completions(episode: OpenAIEpisode) -> float:
    """The legacy completions endpoint: a text prompt, then that prompt + the answer + more text."""
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key)
    first = client.completions.create(model=episode.model, prompt="Q: 6*7?\nA:", max_tokens=8)
    client.completions.create(model=episode.model, prompt="Q: 6*7?\nA:" + first.choices[0].text + "\nQ: again?\nA:",
                              max_tokens=8)
    return 0.0


def refusals(episode: OpenAIEpisode) -> float:
    parsed = urllib.parse.urlparse(episode.base_url)
    assert parsed.hostname == "127.0.0.1"
    body = {"model": episode.model, "messages": episode.messages}
    for field, value in (("stream", True), ("n", 2), ("max_tokens", 0)):
        response = httpx.post(f"{episode.base_url}/chat/completions", json={**body, field: value})
        REFUSED.append((response.status_code, response.json()["error"]["param"]))
    REFUSED.append(httpx.get(f"{episode.base_url}/models").json()["data"][0]["id"])
    REFUSED.append(httpx.get(f"{parsed.scheme}://{parsed.netloc}/episodes/nope/v1/models").status_code)
    return 0.0


REFUSED: list = []


# ---------------------------------------------------------------------- tests
def test_a_completion_records_exactly_what_the_engine_returned(engine, model):
    ONE_COMPLETION.clear()
    (trajectory,), tokenizer = run("one_completion", engine)
    (sample,) = engine.samples
    assert trajectory.prompt_ids == render_ids(tokenizer, PROMPT, add_generation_prompt=True)
    assert trajectory.response_ids == sample.response_ids and trajectory.loss_mask == [1] * len(sample.response_ids)
    assert trajectory.rollout_logprobs == sample.rollout_logprobs
    assert trajectory.token_versions == sample.token_versions == [0] * len(sample.response_ids)
    assert trajectory.num_turns == 1 and trajectory.agent.name == "openai"  # the row's tool_agent ignored
    assert trajectory.agent.reward == 0.5 and trajectory.agent.reward_extra["chars"] >= 0
    choice = ONE_COMPLETION[0]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(sample.rollout_logprobs)
    assert choice.message.content == tokenizer.decode(sample.response_ids[:-1])
    assert choice.finish_reason == "stop" and sample.response_ids[-1] == IM_END


def test_a_tool_calling_agent_gives_one_stitched_trajectory_the_trainer_recomputes(engine, model):
    trajectories, tokenizer = run("tool_then_answer", engine, n=2)
    assert len(engine.samples) == 4
    for trajectory in trajectories:
        assert trajectory.num_turns == 2 and trajectory.agent.metrics["tool_calls"] >= 1
        inserted = [i for i, m in zip(trajectory.response_ids, trajectory.loss_mask) if not m]
        assert tokenizer.decode(inserted, skip_special_tokens=False) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
        # The model's tokens are two engine samples, verbatim, around the inserted ones.
        model_runs = "".join(str(m) for m in trajectory.loss_mask).strip("0").split("0")
        assert len([r for r in model_runs if r]) == 2
        assert trajectory.agent.reward in (0.0, 1.0)
        assert trajectory.agent.metrics["history_rewrites"] == 0
        assert trajectory.token_versions == [0 if m else UNVERSIONED_TOKEN for m in trajectory.loss_mask]
    own = {tuple(s.response_ids) for s in engine.samples}
    for trajectory in trajectories:
        start = trajectory.loss_mask.index(0)
        end = len(trajectory.loss_mask) - trajectory.loss_mask[::-1].index(0)
        assert tuple(trajectory.response_ids[:start]) in own and tuple(trajectory.response_ids[end:]) in own
        # The engine's second prompt was exactly the recorded history: prompt + first turn + inserted.
        assert any(s.prompt_ids == trajectory.prompt_ids + trajectory.response_ids[:end] for s in engine.samples)
    logprobs, rollout, mask = recomputed_logprobs(model, trajectories)
    assert (logprobs[mask] - rollout[mask]).abs().max() < 1e-4
    assert (rollout[~mask] == 0).all()


def test_a_history_rewrite_is_counted_and_the_trajectory_stays_consistent(engine, model):
    (trajectory,), tokenizer = run("rewrites_history", engine)
    assert trajectory.agent.metrics["history_rewrites"] == 1
    assert compute_agent_metrics([trajectory])["agent/openai/history_rewrites"] == 1
    first, second = engine.samples
    # The first turn's text survives the cut; its end-of-turn token and the edit do not.
    assert trajectory.response_ids[: len(first.response_ids) - 1] == first.response_ids[:-1]
    assert trajectory.response_ids[-len(second.response_ids):] == second.response_ids
    assert second.prompt_ids == trajectory.prompt_ids + trajectory.response_ids[: -len(second.response_ids)]
    text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=False)
    assert " (edited)<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n" in text
    logprobs, rollout, mask = recomputed_logprobs(model, [trajectory])
    assert (logprobs[mask] - rollout[mask]).abs().max() < 1e-4
    assert int(mask.sum()) == len(first.response_ids) - 1 + len(second.response_ids)
    # Versions were cut and inserted with the tokens.
    assert trajectory.token_versions == [0 if m else UNVERSIONED_TOKEN for m in trajectory.loss_mask]


@pytest.mark.parametrize("function", ["raises", "hangs", "hangs_async", "returns_garbage"])
def test_a_failing_agent_function_gets_reward_zero_and_is_counted(engine, function):
    start = time.monotonic()
    (trajectory,), _ = run(function, engine, timeout_s=1.5)
    assert time.monotonic() - start < 20
    assert trajectory.agent.reward == 0.0
    metrics = compute_agent_metrics([trajectory])
    timeout = function.startswith("hangs")
    assert metrics["agent/openai/timeout_rate"] == float(timeout)
    assert metrics["agent/openai/error_rate"] == float(not timeout)
    if function == "raises":  # the completion it made is still recorded
        assert trajectory.num_turns == 1 and trajectory.response_ids == engine.samples[0].response_ids
    if timeout:
        assert trajectory.response_ids == [] and trajectory.num_turns == 0


def test_the_response_budget_covers_the_whole_episode(engine):
    SPENT.clear()
    (trajectory,), _ = run("spends_the_budget", engine, max_tokens=20, tools=False)
    assert len(trajectory.response_ids) <= 20 and trajectory.finish_reason == "length"
    assert SPENT[0][-1] == "length"  # once spent, requests get an empty "length" answer, not an error
    assert len(engine.samples) < 6


def test_the_server_refuses_streaming_and_several_choices_and_binds_loopback(engine):
    REFUSED.clear()
    run("refusals", engine)
    assert REFUSED[:3] == [(400, "stream"), (400, "n"), (400, "max_tokens")]
    assert REFUSED[3] == "hybridflow-policy" and REFUSED[4] == 404
    server = OpenAIAgentLoop.server()
    assert server.base_url("x").startswith("http://127.0.0.1:")
    tcp = Path("/proc/net/tcp")
    if tcp.exists():  # Linux: the listening socket's local address is 127.0.0.1 (0100007F), not 0.0.0.0
        listening = [line.split()[1] for line in tcp.read_text().splitlines()[1:] if line.split()[3] == "0A"]
        assert f"0100007F:{server.port:04X}" in listening


def test_agent_functions_from_a_file_and_bad_names(tmp_path):
    file = tmp_path / "my_agent.py"
    file.write_text("def run(episode):\n    return 1.0\n")
    assert load_agent_function(f"{file}:run")(None) == 1.0
    for spec, message in ((f"{file}:missing", "defines no 'missing'"), ("no_such_module_xyz:run", "cannot import"),
                          (f"{__name__}:SPENT", "not a function"), ("json", "not 'module:function'")):
        with pytest.raises((ValueError, TypeError), match=message):
            load_agent_function(spec)


def test_config_errors_name_the_key(tmp_path):
    base = ["rollout.multi_turn.enable=true", "rollout.multi_turn.default_agent_loop=openai"]
    with pytest.raises(ConfigError, match="rollout.multi_turn.openai_agent"):
        validate_config(load_config("tool_agent", overrides=base))
    from hybridflow.controller.preflight import resolve_plugins

    cfg = load_config("tool_agent", overrides=[*base, "rollout.multi_turn.openai_agent=no_such_module_xyz:run"])
    validate_config(cfg)
    with pytest.raises(ConfigError, match="rollout.multi_turn.openai_agent"):
        resolve_plugins(cfg)


def test_text_completions_are_stitched_token_by_token(engine, model):
    (trajectory,), tokenizer = run("text_completions", engine, tools=False)
    first, second = engine.samples
    assert tokenizer.decode(trajectory.prompt_ids) == "Q: 6*7?\nA:" and trajectory.num_turns == 2
    assert second.prompt_ids == trajectory.prompt_ids + trajectory.response_ids[: -len(second.response_ids)]
    logprobs, rollout, mask = recomputed_logprobs(model, [trajectory])
    assert (logprobs[mask] - rollout[mask]).abs().max() < 1e-4
    # Whether the first answer ended on <|im_end|> (dropped from its text, so a rewrite) or not.
    assert trajectory.agent.metrics["history_rewrites"] == float(first.response_ids[-1] == IM_END)
