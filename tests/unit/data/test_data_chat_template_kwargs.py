"""data.apply_chat_template_kwargs: the keyword arguments reach the chat template as variables
wherever the policy's prompts are rendered (training and validation rows), and a key hybridflow
sets itself is refused naming the key."""

from __future__ import annotations

import json

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.controller.preflight import agent_setup, resolve_plugins
from hybridflow.data.dataset import RLDataset, check_chat_template_kwargs
from hybridflow.models.tiny import build_tiny_tokenizer

# A template that reads a variable, as gpt-oss's reads reasoning_effort.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(chat_template=EFFORT_TEMPLATE)


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "arithmetic",
           "reward_model": {"ground_truth": "2"}}
    path.write_text(json.dumps(row) + "\n")
    return path


def prompt_text(tokenizer, rows, **kwargs) -> str:
    data = RLDataset.from_files(rows, tokenizer, max_prompt_length=128, **kwargs)
    return tokenizer.decode(data[0].prompt_ids, skip_special_tokens=False)


def test_the_prompt_is_rendered_with_the_templates_variable(tokenizer, rows):
    assert prompt_text(tokenizer, rows, chat_template_kwargs={"reasoning_effort": "medium"}) == (
        "<|im_start|>system\nReasoning: medium<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert "Reasoning" not in prompt_text(tokenizer, rows)  # without them, the template's default


def test_a_key_hybridflow_sets_itself_is_refused(tokenizer, rows):
    with pytest.raises(ValueError, match=r"data.apply_chat_template_kwargs.tokenize: hybridflow sets 'tokenize'"):
        RLDataset.from_files(rows, tokenizer, max_prompt_length=128, chat_template_kwargs={"tokenize": True})
    assert check_chat_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}


def test_verls_command_line_sets_the_mapping_and_the_agents_get_it():
    cfg = load_config(overrides=["+data.apply_chat_template_kwargs.reasoning_effort=medium",
                                 "rollout.multi_turn.enable=true"])
    assert cfg.data.apply_chat_template_kwargs == {"reasoning_effort": "medium"}
    agent = agent_setup(cfg.rollout.multi_turn, cfg.data.apply_chat_template_kwargs)
    assert agent is not None and agent.chat_template_kwargs == {"reasoning_effort": "medium"}


def test_the_run_refuses_a_reserved_key_at_start_up():
    cfg = load_config(overrides=["data.apply_chat_template_kwargs.add_generation_prompt=false"])
    with pytest.raises(ConfigError, match="add_generation_prompt") as info:
        resolve_plugins(cfg)
    assert info.value.key == "data.apply_chat_template_kwargs"


def test_sft_examples_are_rendered_with_the_variables_and_the_loss_stays_on_the_assistant(tokenizer, tmp_path):
    """hybridflow sft reads data.apply_chat_template_kwargs too (verl's SFT datasets do)."""
    from hybridflow.data.sft import SFTColumns, load_sft_examples

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1?"},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    (example,), _ = load_sft_examples([path], tokenizer, SFTColumns(), max_length=None,
                                      template_kwargs={"reasoning_effort": "low"})
    assert tokenizer.decode(example.prompt_ids, skip_special_tokens=False).startswith(
        "<|im_start|>system\nReasoning: low<|im_end|>")
    trained = [t for t, m in zip(example.response_ids, example.loss_mask, strict=True) if m]
    assert tokenizer.decode(trained, skip_special_tokens=False) == "2<|im_end|>\n"
    with pytest.raises(ValueError, match="apply_chat_template_kwargs.tokenize"):
        load_sft_examples([path], tokenizer, SFTColumns(), max_length=None, template_kwargs={"tokenize": True})
