"""The ``data`` section: datasets, lengths, prompt ordering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.fields import f, sub


@dataclass
class SamplerConfig:
    class_path: str | None = f(
        None, "Where the class that orders the training prompts lives: pkg://package.module, a file (path.py or "
        "file://path.py), or module:Class. None: the built-in seeded shuffle (data.shuffle, data.seed). verl's key "
        "and protocol: class(data_source, data_config) is a torch Sampler over dataset indices; its update(batch) "
        "(if any) gets each step's trained samples; state_dict/load_state_dict (if any) resume it. See "
        "hybridflow/data/sampler_plugin.py.",
    )
    class_name: str | None = f(None, "The sampler class's name in class_path (verl's key).")


@dataclass
class DataConfig:
    train_files: list[str] = f(
        [], "Parquet or JSONL files in verl's row schema (one path alone is a list of one, as verl takes it); local "
        "paths or object-storage URLs (s3://bucket/train.parquet, gs://..., see storage.*). Empty: the built-in "
        "arithmetic task.", single_as_list=True,
    )
    val_files: list[str] = f([], "Held-out files for validation (one path alone: a list of one; local or a URL, as "
                                 "train_files). Empty: the built-in task's test split.", single_as_list=True)
    chat_template: str | None = f(
        None, "A Jinja chat template used instead of the tokenizer's for the policy's prompts and agent turns (and "
        "saved with exports). None: the tokenizer's own. verl's actor_rollout_ref.model.custom_chat_template.",
    )
    chat_template_path: str | None = f(
        None, "A file holding the chat template (instead of data.chat_template; not both).",
    )
    prompt_key: str = f("prompt", "Column holding the chat messages of the prompt.")
    image_key: str = f(
        "images", "Column holding a row's images for a vision-language model (verl's key and default; each image as "
        "bytes, a {bytes, path} dict or a path; one <image> placeholder per image in the messages' text).",
    )
    return_raw_chat: bool = f(
        True,
        "Keep each prompt's chat messages with its samples (their row's prompt_messages, verl's raw_prompt) beside the "
        "chat-templated token ids the rollout generates from. The openai agent loop hands them to the agent and the "
        "reward model renders them with its own template, so both need true. false: samples carry token ids only "
        "(less to hold and ship per sample). verl's default (true) and key; unlike verl, hybridflow's rollout never "
        "applies the template itself.",
    )
    max_prompt_length: int = f(64, "Longest prompt in tokens, after the chat template.")
    max_response_length: int = f(8, "Most tokens generated per response.")
    train_batch_size: int = f(32, "Prompts per training step (each yields rollout.n samples).")
    val_batch_size: int = f(256, "Prompts per validation generation call.")
    truncation: str = f(
        "error",
        "What to do with a prompt longer than max_prompt_length when filter_overlong_prompts is "
        "false: error | left | right.",
        choices=("error", "left", "right"),
    )
    filter_overlong_prompts: bool = f(True, "Drop prompts longer than max_prompt_length (count reported).")
    on_bad_row: str = f(
        "error",
        "A malformed row: error (name file, row and problem) | skip (drop it and count it).",
        choices=("error", "skip"),
    )
    gen_batch_size: int | None = f(
        None,
        "Prompts per generation round when algorithm.filter_groups is on (DAPO draws more rounds until "
        "train_batch_size prompts survive the filter). None: train_batch_size.",
    )
    shuffle: bool = f(True, "Shuffle the training prompts each epoch (seeded, resumable).")
    seed: int | None = f(None, "Sampler seed. None: trainer.seed.")
    sampler: SamplerConfig = sub(
        SamplerConfig, "A sampler class of your own deciding the prompts' order, e.g. a curriculum that learns from "
        "each step's rewards (verl's data.sampler; replaces data.shuffle).",
    )
    apply_chat_template_kwargs: dict[str, Any] = f(
        {}, "Extra keyword arguments of every tokenizer.apply_chat_template call that renders the policy's chat: "
        "training and validation prompts, the agent loops' turns and hybridflow sft's examples (verl's key), e.g. "
        "{reasoning_effort: medium} "
        "for gpt-oss or {enable_thinking: false} for Qwen3; the chat template reads them as variables.",
    )
    builtin_task: str = f(
        "arithmetic",
        "The built-in task used when train_files is empty: arithmetic (carry-free sums, answered directly) | "
        "calculator (products of two-digit numbers, solved by calling the calculator tool; needs "
        "rollout.multi_turn.enable=true and the calculator tool, as in --preset tool_agent) | colour_square "
        "(which colour is the square in a generated image; needs a vision-language model.path and "
        "rollout.name=hf_vision; no warm start yet).",
        choices=("arithmetic", "calculator", "colour_square"),
    )
    builtin_train_size: int = f(4096, "Rows of the built-in task's training split.")
    builtin_val_size: int = f(256, "Rows of the built-in task's test split.")
