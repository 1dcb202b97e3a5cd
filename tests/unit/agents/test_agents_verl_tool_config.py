"""verl's tool config files (``tools: - class_name: ..., config: {...}, tool_schema: {...}``) read by
rollout.multi_turn.tool_config_path: a verl class with a built-in of the same meaning becomes it, under
verl's schema; any other is refused naming the class and what to write instead."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridflow.agents.parsers import ToolCall
from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.tokens import render_ids
from hybridflow.agents.tools import load_tools
from hybridflow.types import RowFields, SamplingParams
from hybridflow.rewards.sandbox import sandbox_unavailable_reason

# verl's examples/sglang_multiturn/config/tool_config/sandbox_fusion_tool_config.yaml, as verl ships it.
SANDBOX_FUSION = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "https://xxx.apigateway-cn-beijing.volceapi.com/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native

    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""

# verl's gsm8k_tool_config.yaml.
GSM8K = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tool_config.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.skipif(sandbox_unavailable_reason() is not None, reason="no sandbox isolation here")
def test_sandbox_fusion_is_the_python_tool_under_verls_schema(tmp_path):
    registry = load_tools(write(tmp_path, SANDBOX_FUSION))
    assert registry.names == ["code_interpreter"]
    (schema,) = registry.schemas()
    assert schema["function"]["description"] == "A tool for executing code."
    assert schema["function"]["parameters"]["required"] == ["code"]
    result = asyncio.run(registry.call(ToolCall("code_interpreter", {"code": "print(6 * 7)"})))
    assert (result.status, result.text) == ("ok", "42\n")
    # verl's default_timeout is the program's time limit, enforced by the sandbox itself.
    quick = load_tools(write(tmp_path, SANDBOX_FUSION.replace("default_timeout: 30", "default_timeout: 1")))
    stuck = asyncio.run(quick.call(ToolCall("code_interpreter", {"code": "while True: pass"})))
    assert stuck.status == "ok" and "[killed: timeout]" in stuck.text


@pytest.mark.parametrize("text, match", [
    (GSM8K.replace("verl.tools.gsm8k_tool.Gsm8kTool", "verl.tools.mcp_search_tool.MCPSearchTool"),
     r"verl tool class verl\.tools\.mcp_search_tool\.MCPSearchTool has no hybridflow equivalent \(it calls a "
     r"search tool of an MCP server.*'function: my_package\.tools:my_tool'"),
    (GSM8K.replace("verl.tools.gsm8k_tool.Gsm8kTool", "my_lab.tools.WeatherTool"),
     r"my_lab\.tools\.WeatherTool has no hybridflow equivalent \(hybridflow does not run verl's tool classes"),
    (SANDBOX_FUSION.replace('default_language: "python"', 'default_language: "cpp"'),
     r"default_language='cpp': hybridflow's code interpreter runs Python only"),
    (SANDBOX_FUSION.replace("            code:\n", "            language:\n              type: string\n"
                                              "            code:\n"),
     r"declares \['language'\], but hybridflow's python tool takes only 'code'"),
    (GSM8K.replace("            answer:\n", "            steps:\n              type: string\n            answer:\n"),
     r"declares \['steps'\], but hybridflow's calc_gsm8k_reward tool takes only 'answer'"),
])
def test_what_has_no_equivalent_is_refused_naming_the_class(tmp_path, text, match):
    with pytest.raises(ValueError, match=match) as error:
        load_tools(write(tmp_path, text))
    assert "tools[0]" in str(error.value)  # which entry of which file


# A row of verl's multi-turn GSM8K data (examples/data_preprocess/gsm8k_multiturn_w_tool.py): the tool's
# ground truth is in extra_info.tools_kwargs, the reward's in reward_model.ground_truth (the same answer).
VERL_ROW = {"data_source": "openai/gsm8k", "ground_truth": "72",
            "extra_info": {"need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}


def call(registry, answer, row):
    return asyncio.run(registry.call(ToolCall("calc_gsm8k_reward", {"answer": answer}), row))


def test_gsm8k_tool_replies_with_the_answers_reward(tmp_path):
    """verl's Gsm8kTool: the answer is scored as a GSM8K final answer against the row's ground truth, the
    reply is verl's "Current parsed answer=... reward=..." text."""
    registry = load_tools(write(tmp_path, GSM8K))
    assert registry.names == ["calc_gsm8k_reward"]
    assert registry.schemas()[0]["function"]["parameters"]["required"] == ["answer"]
    right = call(registry, "72", VERL_ROW)
    assert (right.status, right.text) == ("ok", "Current parsed answer='72' reward=1.0")
    assert call(registry, "#### 72", VERL_ROW).text == "Current parsed answer='#### 72' reward=1.0"
    assert call(registry, "1,234", {**VERL_ROW, "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {
        "create_kwargs": {"ground_truth": "1234"}}}}}).text.endswith("reward=1.0")  # the scorer's normalisation
    assert call(registry, "71", VERL_ROW).text == "Current parsed answer='71' reward=0.0"
    assert call(registry, "I do not know", VERL_ROW).text.endswith("reward=0.0")
    # verl's tools_kwargs wins; a row without them is checked against its own ground truth.
    assert call(registry, "72", {**VERL_ROW, "ground_truth": "5"}).text.endswith("reward=1.0")
    assert call(registry, "5", {"ground_truth": "5", "extra_info": {}}).text.endswith("reward=1.0")
    missing = call(registry, "5", {"extra_info": {}})
    assert missing.status == "error" and "no ground truth" in missing.text
    # Built in by name too, under verl's tool name, so verl's tools_kwargs reach it.
    assert call(load_tools("builtin:calc_gsm8k_reward"), "72", VERL_ROW).text.endswith("reward=1.0")


def test_gsm8k_tool_in_an_episode_reads_its_rows_ground_truth(tmp_path, tokenizer, scripted):
    """Through the tool agent loop: each episode's call is scored against its own row."""
    registry = load_tools(write(tmp_path, GSM8K))
    runner = AgentRunner(AgentContext(tokenizer, tools=registry), default_agent="tool_agent")

    def reply(text: str, turn: int) -> str:
        return ('<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>'
                if turn == 0 else "#### 72")

    prompt = render_ids(tokenizer, [{"role": "user", "content": "How many?"}], add_generation_prompt=True)
    rows = [AgentRow(prompt, RowFields(**VERL_ROW)), AgentRow(prompt, RowFields(ground_truth="8", extra_info={}))]
    right, wrong = runner.generate_sync(rows, SamplingParams(max_tokens=400), scripted(reply))
    assert right.agent.messages[1]["content"] == "Current parsed answer='72' reward=1.0"
    assert wrong.agent.messages[1]["content"] == "Current parsed answer='72' reward=0.0"


# verl's own tool files (examples/sglang_multiturn/config/tool_config/, copied as they ship).
VERL_TOOL_CONFIGS = Path(__file__).parents[2] / "data" / "verl_tool_configs"

# A row of verl's multi-turn Geometry3K data (examples/data_preprocess/geo3k_multiturn_w_tool.py).
GEO3K_ROW = {"data_source": "hiyouga/geometry3k", "ground_truth": "\\frac{40}{3}",
             "extra_info": {"need_tools_kwargs": True,
                            "tools_kwargs": {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "\\frac{40}{3}"}}}}}


def geo3k(registry, answer, row):
    return asyncio.run(registry.call(ToolCall("calc_geo3k_reward", {"answer": answer}), row))


def test_verls_geo3k_tool_file_is_the_geo3k_grading_tool():
    """verl's Geo3kTool: the bare answer graded against the row's ground truth (1.0 / 0.0), verl's reply."""
    registry = load_tools(str(VERL_TOOL_CONFIGS / "geo3k_tool_config.yaml"))
    assert registry.names == ["calc_geo3k_reward"]
    assert registry.schemas()[0]["function"]["description"].startswith("A tool for calculating the reward of geo3k.")
    right = geo3k(registry, "\\dfrac{40}{3}", GEO3K_ROW)
    assert (right.status, right.text) == ("ok", "Current parsed answer='\\\\dfrac{40}{3}' reward=1.0")
    assert geo3k(registry, "40/3", GEO3K_ROW).text.endswith("reward=1.0")
    assert geo3k(registry, "13", GEO3K_ROW).text == "Current parsed answer='13' reward=0.0"
    unparseable = geo3k(registry, "}{ no idea", GEO3K_ROW)
    assert (unparseable.status, unparseable.text[-10:]) == ("ok", "reward=0.0")
    # verl's tools_kwargs win over the row's ground truth; without them the row's own is used.
    assert geo3k(registry, "\\frac{40}{3}", {**GEO3K_ROW, "ground_truth": "7"}).text.endswith("reward=1.0")
    assert geo3k(registry, "7", {"ground_truth": "7", "extra_info": {}}).text.endswith("reward=1.0")
    missing = geo3k(registry, "7", {"extra_info": {}})
    assert missing.status == "error" and "no ground truth" in missing.text
    assert geo3k(load_tools("builtin:calc_geo3k_reward"), "40/3", GEO3K_ROW).text.endswith("reward=1.0")


def test_geo3k_tool_in_an_episode_grades_against_its_own_row(tokenizer, scripted):
    registry = load_tools(str(VERL_TOOL_CONFIGS / "geo3k_tool_config.yaml"))
    runner = AgentRunner(AgentContext(tokenizer, tools=registry), default_agent="tool_agent")

    def reply(text: str, turn: int) -> str:
        return ('<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": "60"}}</tool_call>'
                if turn == 0 else "\\boxed{60}")

    prompt = render_ids(tokenizer, [{"role": "user", "content": "Find x."}], add_generation_prompt=True)
    rows = [AgentRow(prompt, RowFields(extra_info={"tools_kwargs": {"calc_geo3k_reward": {
                "create_kwargs": {"ground_truth": "60"}}}})),
            AgentRow(prompt, RowFields(ground_truth="30", extra_info={}))]
    right, wrong = runner.generate_sync(rows, SamplingParams(max_tokens=400), scripted(reply))
    assert right.agent.messages[1]["content"] == "Current parsed answer='60' reward=1.0"
    assert wrong.agent.messages[1]["content"] == "Current parsed answer='60' reward=0.0"


def test_a_built_in_without_settings_refuses_a_config(tmp_path):
    with pytest.raises(ValueError, match=r"tools\[0\]: the calc_geo3k_reward tool takes no config, got \['topk'\]"):
        load_tools(write(tmp_path, "tools:\n  - name: calc_geo3k_reward\n    config: {topk: 3}\n"))
