"""What the run reads and how it runs: files and model paths, chat data and images, agent tools and
loops, resume and trainer keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hybridflow.config.budget import VISUAL_BUILTIN_TASKS
from hybridflow.config.checks.report import Report
from hybridflow.config.schema import Config
from hybridflow.utils.files import special_file_kind
from hybridflow.utils.storage import is_remote


def check_raw_chat_and_images(cfg: Config, report: Report) -> None:
    """data.return_raw_chat=false leaves samples without their chat messages, which two readers need; the
    built-in image task writes its images under verl's column name."""
    d, mt = cfg.data, cfg.rollout.multi_turn
    if not d.return_raw_chat:
        if cfg.reward_model.enable:
            report.error("reward_model.enable=true renders each prompt from its chat messages, which "
                         "data.return_raw_chat=false drops; set data.return_raw_chat=true")
        if mt.enable and mt.default_agent_loop == OPENAI_LOOP:
            report.error("rollout.multi_turn.default_agent_loop=openai hands each prompt's chat messages to the agent, "
                         "which data.return_raw_chat=false drops; set data.return_raw_chat=true")
    if not d.train_files and d.builtin_task in VISUAL_BUILTIN_TASKS and d.image_key != "images":
        report.error(f"data.image_key={d.image_key!r} names a column of data.train_files, but the built-in "
                     f"{d.builtin_task} task writes its images under 'images'; leave data.image_key at images")


BUILTIN_TOOLS_PREFIX = "builtin:"
"""``rollout.multi_turn.tool_config_path`` values naming built-in tools: ``builtin:calculator,python``.
The names are checked against the tool registry at start-up (``controller/setup.py``); the
config layer does not import the agent layer."""


OPENAI_LOOP = "openai"
"""The agent loop (``hybridflow.agents.AGENT_LOOPS``) that runs ``rollout.multi_turn.openai_agent``."""


TOOL_TASKS = {"calculator": "calculator"}
"""Built-in tasks (``data.builtin_task``) that are solved with a tool, and the tool they need."""


def check_multi_turn(cfg: Config, report: Report) -> None:
    """rollout.multi_turn: what the agent loop needs, and keys that do nothing while it is off."""
    mt, d = cfg.rollout.multi_turn, cfg.data
    if mt.tool_timeout_s is not None and mt.tool_timeout_s <= 0:
        report.error(f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s} must be > 0 seconds or null")
    source = mt.tool_config_path
    if source is not None and source.startswith(BUILTIN_TOOLS_PREFIX):
        if not [name for name in source[len(BUILTIN_TOOLS_PREFIX):].split(",") if name.strip()]:
            report.error(
                f"rollout.multi_turn.tool_config_path={source!r} names no tool; use e.g. builtin:calculator"
            )
    elif source is not None and not Path(source).expanduser().is_file():
        report.error(
            f"rollout.multi_turn.tool_config_path={source!r} is not an existing file; give a tool YAML file, "
            f"builtin:<name>[,<name>] (calculator, python), or null"
        )
    if mt.default_agent_loop is not None and not mt.default_agent_loop.strip():
        report.error("rollout.multi_turn.default_agent_loop must name an agent loop (e.g. tool_agent) or be null")
    if mt.default_agent_loop == OPENAI_LOOP and not mt.openai_agent:
        report.error(
            "rollout.multi_turn.default_agent_loop=openai needs rollout.multi_turn.openai_agent: the agent function "
            "to run, as package.module:function or path/to/file.py:function"
        )
    if mt.openai_timeout_s <= 0:
        report.error(f"rollout.multi_turn.openai_timeout_s={mt.openai_timeout_s} must be > 0 seconds")
    tool = TOOL_TASKS.get(d.builtin_task)
    if tool is not None and not d.train_files:
        if not mt.enable:
            report.error(
                f"data.builtin_task={d.builtin_task} is solved by calling the {tool} tool: set "
                f"rollout.multi_turn.enable=true and rollout.multi_turn.tool_config_path={BUILTIN_TOOLS_PREFIX}{tool} "
                f"(or start from --preset tool_agent)"
            )
        elif source is None:
            report.error(
                f"data.builtin_task={d.builtin_task} needs the {tool} tool, but rollout.multi_turn.tool_config_path "
                f"is null; set it to {BUILTIN_TOOLS_PREFIX}{tool}"
            )
    if not mt.enable:
        changed = [
            f"rollout.multi_turn.{fld.name}"
            for fld in dataclasses.fields(mt)
            if fld.name != "enable" and getattr(mt, fld.name) != fld.default
        ]
        if changed:
            report.warn(f"{', '.join(changed)} has no effect while rollout.multi_turn.enable=false")


def check_trainer(cfg: Config, report: Report) -> None:
    trainer = cfg.trainer
    if trainer.resume_mode == "path":
        if not trainer.resume_from_path:
            report.error(
                "trainer.resume_mode=path needs trainer.resume_from_path (the checkpoint folder to resume from)"
            )
        elif not Path(trainer.resume_from_path).expanduser().is_dir():
            report.error(f"trainer.resume_from_path={trainer.resume_from_path!r} is not an existing directory")
    elif trainer.resume_from_path is not None:
        report.warn(
            f"trainer.resume_from_path is set but trainer.resume_mode={trainer.resume_mode}: the path is "
            f"ignored; set trainer.resume_mode=path to resume from it"
        )
    if cfg.model.path != "builtin:tiny" and cfg.actor.optim.lr > 1e-4:
        report.warn(
            f"actor.optim.lr={cfg.actor.optim.lr:g} is tuned for the built-in tiny model; RL on 0.5B-7B "
            "models usually uses 1e-6 to 1e-5 (set actor.optim.lr)"
        )
    if cfg.warm_start.enable == "true" and cfg.model.path != "builtin:tiny":
        report.error(
            f"warm_start.enable=true applies to model.path=builtin:tiny only; model.path={cfg.model.path} "
            "is used as loaded (use warm_start.enable=auto)"
        )
    for entry in trainer.phase_timeouts:
        name, sep, value = entry.partition("=")
        try:
            ok = bool(sep and name.strip()) and float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            report.error(f"trainer.phase_timeouts entry {entry!r} must look like <phase>=<seconds>, e.g. gen=3600")
    a, longest = cfg.actor, cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.use_dynamic_bsz:
        for key, value in (("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu),
                           ("actor.log_prob_max_token_len_per_gpu", a.log_prob_max_token_len_per_gpu),
                           ("ref.log_prob_max_token_len_per_gpu", cfg.ref.log_prob_max_token_len_per_gpu)):
            if value is not None and value < longest:
                report.error(
                    f"{key}={value} tokens is below the longest possible sample (data.max_prompt_length + "
                    f"data.max_response_length = {longest}): such a sample fits no micro-batch; use >= {longest}"
                )
    elif a.ppo_max_token_len_per_gpu is not None or a.log_prob_max_token_len_per_gpu is not None:
        report.warn("actor.*_max_token_len_per_gpu has no effect while actor.use_dynamic_bsz=false")
    if trainer.max_consecutive_skips < 1:
        report.error(f"trainer.max_consecutive_skips={trainer.max_consecutive_skips} must be >= 1")
    if trainer.save_freq <= 0 and not trainer.save_final:
        report.warn("trainer.save_freq <= 0 and trainer.save_final=false: this run writes no checkpoint")


def check_files(cfg: Config, report: Report) -> None:
    """Paths the run will open, checked now rather than minutes later."""
    # URLs (s3://, gs://) are checked by set-up, which reaches the server (check_storage in controller/setup.py).
    path = cfg.model.path
    if not path.startswith("builtin:") and not is_remote(path) and not Path(path).expanduser().is_dir():
        report.error(
            f"model.path={path!r} is not an existing directory: use a local Hugging Face model folder "
            f"(config.json + weights) or builtin:tiny"
        )
    for key in ("train_files", "val_files"):
        for i, file in enumerate(getattr(cfg.data, key)):
            if not is_remote(file) and (problem := _file_problem(file)) is not None:
                report.error(f"data.{key}[{i}]={file!r} {problem}")
    reward_path = cfg.reward.custom_reward_function.path
    if reward_path is not None and (problem := _file_problem(reward_path)) is not None:
        report.error(f"reward.custom_reward_function.path={reward_path!r} {problem}")
    template_path = cfg.data.chat_template_path
    if template_path is not None and cfg.data.chat_template is not None:
        report.error("data.chat_template and data.chat_template_path are both set: give the template one way")
    if template_path is not None and (problem := _file_problem(template_path)) is not None:
        report.error(f"data.chat_template_path={template_path!r} {problem}")


def _file_problem(path: str) -> str | None:
    """Why a local path the run will read is not a readable file ("does not exist", "is a FIFO
    (named pipe), not a regular file"), or None."""
    local = Path(path).expanduser()
    if (kind := special_file_kind(local)) is not None:
        return f"is {kind}, not a regular file"
    return None if local.is_file() else "does not exist"
