"""verl's tool config files (``tools: - class_name: ..., config: {...}, tool_schema: {...}``) read by
rollout.multi_turn.tool_config_path: a verl class with a built-in of the same meaning becomes it, under
verl's schema; any other is refused naming the class and what to write instead."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridflow.agents.parsers import ToolCall
from hybridflow.agents.tools import load_tools
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
    (GSM8K, r"verl tool class verl\.tools\.gsm8k_tool\.Gsm8kTool has no hybridflow equivalent \(it checks the "
            r"model's answer against the row's ground truth.*'function: my_package\.tools:my_tool'"),
    (GSM8K.replace("verl.tools.gsm8k_tool.Gsm8kTool", "my_lab.tools.WeatherTool"),
     r"my_lab\.tools\.WeatherTool has no hybridflow equivalent \(hybridflow does not run verl's tool classes"),
    (SANDBOX_FUSION.replace('default_language: "python"', 'default_language: "cpp"'),
     r"default_language='cpp': hybridflow's code interpreter runs Python only"),
    (SANDBOX_FUSION.replace("            code:\n", "            language:\n              type: string\n"
                                              "            code:\n"),
     r"declares \['language'\], but hybridflow's code interpreter takes only 'code'"),
])
def test_what_has_no_equivalent_is_refused_naming_the_class(tmp_path, text, match):
    with pytest.raises(ValueError, match=match) as error:
        load_tools(write(tmp_path, text))
    assert "tools[0]" in str(error.value)  # which entry of which file
