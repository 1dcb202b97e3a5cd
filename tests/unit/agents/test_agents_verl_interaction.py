"""verl's interaction files (``interaction: - name, class_name, config``) read by
rollout.multi_turn.interaction_config_path: verl's Gsm8kInteraction is built in with verl's checks and
replies; each row picks its interaction by extra_info.interaction_kwargs.name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridflow.agents.base import AgentRow
from hybridflow.agents.interactions import Gsm8kInteraction, load_interaction_config
from hybridflow.agents.tokens import render_ids
from hybridflow.config import ConfigError, load_config
from hybridflow.controller.preflight import agent_setup, check_agent_setup
from hybridflow.types import RowFields, SamplingParams
from hybridflow.workers.rollout import build_agent_runner

# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml
GSM8K = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""

# A row of verl's multi-turn GSM8K data with its interaction's arguments.
ROW = {"data_source": "openai/gsm8k", "ground_truth": "72",
       "extra_info": {"interaction_kwargs": {"name": "gsm8k", "query": "How many?", "ground_truth": "72"}}}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "interaction_config.yaml"
    path.write_text(text)
    return str(path)


def respond(interaction, answer: str, row=ROW):
    return asyncio.run(interaction.respond([{"role": "assistant", "content": answer}], row))


def test_gsm8k_interaction_checks_the_last_answer_strictly(tmp_path):
    interaction = load_interaction_config(write(tmp_path, GSM8K))
    right = respond(interaction, "6 * 12 = 72\n#### 72")
    assert (right.reply, right.done, right.reward) == (Gsm8kInteraction.CORRECT, True, 1.0)
    wrong = respond(interaction, "#### 71")
    assert (wrong.reply, wrong.done, wrong.reward) == (Gsm8kInteraction.RETRY, False, 0.0)
    assert respond(interaction, "the answer is 72").reward == 0.0  # strict: no "#### ", no answer
    # The interaction's ground truth wins; a row without interaction_kwargs.ground_truth uses its own.
    other = {**ROW, "extra_info": {"interaction_kwargs": {"name": "gsm8k"}}, "ground_truth": "5"}
    assert respond(interaction, "#### 5", other).done
    with pytest.raises(ValueError, match="names no interaction"):
        respond(interaction, "#### 72", {"ground_truth": "72", "extra_info": {}})
    with pytest.raises(ValueError, match="'quiz' is not in the interaction file"):
        respond(interaction, "#### 72", {**ROW, "extra_info": {"interaction_kwargs": {"name": "quiz"}}})


@pytest.mark.parametrize("text, match", [
    (GSM8K.replace("verl.interactions.gsm8k_interaction.Gsm8kInteraction", "verl.interactions.weather.Chat"),
     r"interaction\[0\]: verl interaction class verl\.interactions\.weather\.Chat has no hybridflow equivalent"),
    ("interaction: []\n", r"must be a mapping with an 'interaction' list"),
    (GSM8K.replace("config: {}", "config: {temperature: 2}"), r"does not take config"),
])
def test_what_has_no_equivalent_is_refused_naming_the_entry(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_interaction_config(write(tmp_path, text))


def test_verls_interaction_config_path_reaches_the_agent_loop(tmp_path, tokenizer, scripted):
    """verl's key is honoured; config explain's check resolves the file; an episode answered wrong, then
    right, gets verl's replies as user turns and ends on the right answer."""
    path = write(tmp_path, GSM8K)
    cfg = load_config(overrides=["actor_rollout_ref.rollout.multi_turn.enable=true",
                                 f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={path}"])
    setup = agent_setup(cfg.rollout.multi_turn)
    assert setup is not None and setup.interaction_config_path == path
    check_agent_setup(setup, cfg.data)
    runner = build_agent_runner(tokenizer, setup)
    prompt = render_ids(tokenizer, [{"role": "user", "content": "How many?"}], add_generation_prompt=True)
    engine = scripted(lambda text, turn: ["#### 71", "#### 72", "#### 73"][turn])
    (episode,) = runner.generate_sync([AgentRow(prompt, RowFields(**ROW))], SamplingParams(max_tokens=400), engine)
    assert episode.agent.stop == "interaction_done" and episode.num_turns == 2
    assert episode.agent.interaction_reward == 1.0
    assert [m["content"] for m in episode.agent.messages if m["role"] == "user"] == [
        Gsm8kInteraction.RETRY]
    bad = load_config(overrides=["rollout.multi_turn.enable=true",
                                 f"rollout.multi_turn.interaction_config_path={write(tmp_path, 'x: 1')}"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.interaction_config_path: interaction config"):
        check_agent_setup(agent_setup(bad.rollout.multi_turn), bad.data)


def test_verls_max_user_turns_counts_tool_and_interaction_replies(tmp_path, tokenizer, scripted):
    """verl's max_user_turns: after an assistant turn, once that many reply turns (tool replies and the
    interaction's together) happened, the episode ends there, its calls not run; 0 or null: no bound."""
    from hybridflow.agents.base import AgentContext, AgentRunner
    from hybridflow.agents.tools import ToolRegistry, calculator

    prompt = render_ids(tokenizer, [{"role": "user", "content": "How many?"}], add_generation_prompt=True)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*12"}}</tool_call>'
    # tool, wrong answer (the interaction replies), tool, ...: reply turns 1, 2, 3.
    engine = scripted(lambda text, turn: [call, "#### 71", call, "#### 72", call][turn])

    def run(limit):
        context = AgentContext(tokenizer, tools=ToolRegistry([calculator]), max_assistant_turns=5,
                               interaction=load_interaction_config(write(tmp_path, GSM8K)), max_reply_turns=limit)
        (episode,) = AgentRunner(context, default_agent="tool_agent").generate_sync(
            [AgentRow(prompt, RowFields(**ROW))], SamplingParams(max_tokens=600), engine)
        return episode

    capped = run(2)
    assert capped.num_turns == 3 and capped.agent.stop == "max_user_turns"
    assert [m["role"] for m in capped.agent.messages] == ["assistant", "tool", "assistant", "user",
                                                                       "assistant"]  # the third turn's call not run
    free = run(None)
    assert free.num_turns == 4 and free.agent.stop == "interaction_done"
    cfg = load_config(overrides=["actor_rollout_ref.rollout.multi_turn.enable=true",
                                 "actor_rollout_ref.rollout.multi_turn.max_user_turns=5"])
    assert agent_setup(cfg.rollout.multi_turn).max_user_turns == 5
