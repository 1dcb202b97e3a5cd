"""The reward_model config: what each style needs fails at start-up naming the key, the model
directory is checked before any weights load, and ``config explain`` says what scores the answers."""

from __future__ import annotations

import json

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config.explain import explain_config
from hybridflow.controller.preflight import check_reward_model
from hybridflow.models.tiny import write_tiny_reward_model

JUDGE = ["reward_model.enable=true", "reward_model.style=generative", "reward_model.judge.base_url=http://127.0.0.1:1/v1"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["reward_model.enable=true"], "reward_model.model.path is null"),
        (["reward_model.enable=true", "reward_model.style=generative"], "reward_model.judge.base_url is null"),
        (["reward_model.style=judge"], "reward_model.style"),
        (["reward_model.combine=mean"], "reward_model.combine"),
        (["reward_model.micro_batch_size_per_gpu=0"], "reward_model.micro_batch_size_per_gpu=0 must be >= 1"),
        (["reward_model.max_length=1"], "reward_model.max_length=1 must be >= 2"),
        ([*JUDGE, "reward_model.judge.max_concurrency=0"], "reward_model.judge.max_concurrency=0 must be >= 1"),
        ([*JUDGE, "reward_model.judge.timeout_s=0"], "reward_model.judge.timeout_s=0.0 must be > 0"),
        ([*JUDGE, "reward_model.judge.prompt_template=Rate {answer}"], "reward_model.judge.prompt_template"),
        ([*JUDGE, "reward_model.judge.score_pattern=Rating=\\d+"], "needs a group around the score"),
        ([*JUDGE, "reward_model.judge.score_pattern=Rating=(\\d+"], "is not a regex"),
    ],
)
def test_reward_model_errors_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config("grpo", overrides=overrides))
    assert expected in str(info.value)


def test_a_model_without_enable_is_a_warning() -> None:
    warnings = validate_config(load_config("grpo", overrides=["reward_model.model.path=/somewhere"]))
    assert any("reward_model.enable=false" in w for w in warnings)


def test_the_model_directory_must_be_a_scalar_sequence_classifier(tmp_path) -> None:
    rm = write_tiny_reward_model(tmp_path / "rm")
    causal = tmp_path / "causal"  # only config.json is read: a causal LM's will do
    causal.mkdir()
    config = json.loads((rm / "config.json").read_text()) | {"architectures": ["Qwen2ForCausalLM"]}
    (causal / "config.json").write_text(json.dumps(config))
    check_reward_model(load_config("grpo", overrides=["reward_model.enable=true", f"reward_model.model.path={rm}"]))
    for path, expected in [(causal, "not a *ForSequenceClassification"), (tmp_path / "none", "not a local directory")]:
        cfg = load_config("grpo", overrides=["reward_model.enable=true", f"reward_model.model.path={path}"])
        with pytest.raises(ConfigError, match="reward_model.model.path") as info:
            check_reward_model(cfg)
        assert expected in str(info.value)


def test_a_missing_api_key_variable_names_the_key(monkeypatch) -> None:
    monkeypatch.delenv("HF_TEST_JUDGE_KEY", raising=False)
    cfg = load_config("grpo", overrides=[*JUDGE, "reward_model.judge.api_key_env=HF_TEST_JUDGE_KEY"])
    with pytest.raises(ConfigError, match="reward_model.judge.api_key_env=HF_TEST_JUDGE_KEY"):
        check_reward_model(cfg)
    monkeypatch.setenv("HF_TEST_JUDGE_KEY", "secret")
    check_reward_model(cfg)


def test_explain_says_what_scores_the_answers() -> None:
    assert "no reward model: the rule scorers" in explain_config(load_config("grpo"))
    judge = explain_config(load_config("grpo", overrides=[*JUDGE, "reward_model.combine=replace"]))
    assert "a generative judge, judge at http://127.0.0.1:1/v1" in judge
    assert "its score replaces the rule score (reward_model.combine=replace)" in judge
