"""rollout.multi_turn and data.builtin_task: validation errors name the key, names resolve at
start-up (before any model loads), keys that do nothing warn, and the tool_agent preset sets
up the calculator task."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, explain_config, load_config, validate_config
from hybridflow.controller.preflight import agent_name_warning, agent_setup, check_agent_setup
from hybridflow.data import PromptRow


def config(*overrides: str):
    return load_config("grpo", overrides=list(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.builtin_task=calculator"], "set rollout.multi_turn.enable=true"),
        (["data.builtin_task=calculator", "rollout.multi_turn.enable=true"],
         "rollout.multi_turn.tool_config_path is null; set it to builtin:calculator"),
        (["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=/no/such/tools.yaml"],
         "rollout.multi_turn.tool_config_path='/no/such/tools.yaml' is not an existing file"),
        (["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=builtin:,"], "names no tool"),
        (["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_timeout_s=0"],
         "rollout.multi_turn.tool_timeout_s=0"),
        (["rollout.multi_turn.enable=true", "rollout.multi_turn.max_assistant_turns=0"],
         "rollout.multi_turn.max_assistant_turns=0 must be >= 1"),
        (["rollout.multi_turn.enable=true", "rollout.multi_turn.max_parallel_calls=0"],
         "rollout.multi_turn.max_parallel_calls=0 must be >= 1"),
        (["rollout.multi_turn.enable=true", "rollout.multi_turn.max_tool_response_length=8"],
         "rollout.multi_turn.max_tool_response_length=8 must be >= 16"),
    ],
)
def test_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(config(*overrides))
    assert message in str(info.value)


def test_unknown_builtin_task_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="data.builtin_task") as info:
        config("data.builtin_task=calculus")
    assert "calculator" in str(info.value)


def test_multi_turn_keys_warn_while_it_is_off() -> None:
    warnings = validate_config(config("rollout.multi_turn.tool_config_path=builtin:calculator",
                                      "rollout.multi_turn.max_assistant_turns=3"))
    assert warnings == [
        "rollout.multi_turn.tool_config_path, rollout.multi_turn.max_assistant_turns has no effect while "
        "rollout.multi_turn.enable=false"
    ]
    assert validate_config(config()) == []  # the default run: off, nothing set


def test_agent_setup_follows_the_config() -> None:
    assert agent_setup(config().rollout.multi_turn) is None
    on = agent_setup(config("rollout.multi_turn.enable=true", "rollout.multi_turn.max_parallel_calls=2",
                            "rollout.multi_turn.tool_timeout_s=3").rollout.multi_turn)
    assert on is not None and on.default_agent == "tool_agent"  # the default loop when it is on
    assert (on.max_parallel_calls, on.tool_timeout_s, on.tool_parser) == (2, 3.0, "hermes")
    explicit = agent_setup(config("rollout.multi_turn.enable=true",
                                  "rollout.multi_turn.default_agent_loop=single_turn").rollout.multi_turn)
    assert explicit is not None and explicit.default_agent == "single_turn"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.multi_turn.default_agent_loop=three_turn"], "rollout.multi_turn.default_agent_loop: unknown agent loop"),
        (["rollout.multi_turn.format=json5"], "rollout.multi_turn.format: unknown tool parser"),
        (["rollout.multi_turn.tool_config_path=builtin:abacus"],
         "rollout.multi_turn.tool_config_path: 'builtin:abacus': unknown built-in tool(s) abacus"),
    ],
)
def test_names_resolve_before_any_model_loads(overrides: list[str], message: str) -> None:
    cfg = config("rollout.multi_turn.enable=true", *overrides)
    setup = agent_setup(cfg.rollout.multi_turn)
    assert setup is not None
    with pytest.raises(ConfigError) as info:
        check_agent_setup(setup, cfg.data)
    assert message in str(info.value)


def test_the_calculator_task_needs_the_calculator_tool(tmp_path) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - function: hybridflow.agents.tools:format_number\n")
    cfg = config("data.builtin_task=calculator", "rollout.multi_turn.enable=true",
                 f"rollout.multi_turn.tool_config_path={tools}")
    setup = agent_setup(cfg.rollout.multi_turn)
    assert setup is not None
    with pytest.raises(ConfigError, match="needs the calculator tool, but .* gives: format_number"):
        check_agent_setup(setup, cfg.data)
    check_agent_setup(agent_setup(load_config("tool_agent").rollout.multi_turn), load_config("tool_agent").data)


def test_tool_agent_preset_runs_the_calculator_task_with_the_tool_agent() -> None:
    cfg = load_config("tool_agent")
    assert validate_config(cfg) == []
    assert cfg.data.builtin_task == "calculator"
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.tool_config_path == "builtin:calculator" and mt.format == "hermes"
    plan = explain_config(cfg)
    assert "generation: agent episodes (rollout.multi_turn.enable=true)" in plan
    assert "data: the built-in calculator task" in plan


def test_rows_naming_a_loop_warn_when_multi_turn_is_off() -> None:
    def row(agent_name: str | None) -> PromptRow:
        return PromptRow([1], [], "d", "1", "", {}, "f:0", agent_name=agent_name)

    off, on = config().rollout.multi_turn, config("rollout.multi_turn.enable=true").rollout.multi_turn
    rows = [row("tool_agent"), row(None), row("single_turn")]
    message = agent_name_warning(rows, off)
    assert message is not None and message.startswith("1 training rows name an agent loop (agent_name='tool_agent'")
    assert agent_name_warning(rows, on) is None
    assert agent_name_warning([row(None), row("single_turn_agent")], off) is None
