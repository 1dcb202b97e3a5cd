"""Scoring: the reward manager's and sandbox's keys, and the reward model's (discriminative or judge)."""

from __future__ import annotations

import re

from hybridflow.config.checks.report import Report
from hybridflow.config.schema import Config


def check_reward_manager(cfg: Config, report: Report) -> None:
    """reward.reward_manager and reward.reward_kwargs: what the built-in scorers cannot take."""
    reward = cfg.reward
    if reward.custom_reward_function.path is None:
        if reward.reward_manager == "batch":
            report.error("reward.reward_manager=batch calls a reward function with lists of samples, which the "
                         "built-in scorers are not; set reward.custom_reward_function.path, or use naive")
        if reward.reward_kwargs:
            report.error(f"reward.reward_kwargs={reward.reward_kwargs} are keyword arguments of "
                         f"reward.custom_reward_function, which is not set (the built-in scorers take none)")


def check_sandbox_fusion(cfg: Config, report: Report) -> None:
    """reward.sandbox_fusion: a usable endpoint, limits in range, and a sample budget that fits a run."""
    sf, reward = cfg.reward.sandbox_fusion, cfg.reward
    if sf.max_concurrent < 1:
        report.error(f"reward.sandbox_fusion.max_concurrent={sf.max_concurrent} must be >= 1")
    if sf.memory_limit_mb < 1:
        report.error(f"reward.sandbox_fusion.memory_limit_mb={sf.memory_limit_mb} must be >= 1")
    if not sf.run_timeout_s > 0:
        report.error(f"reward.sandbox_fusion.run_timeout_s={sf.run_timeout_s} must be > 0")
    if sf.url is None:
        return
    if not sf.url.startswith(("http://", "https://")):
        report.error(f"reward.sandbox_fusion.url={sf.url!r} must be an http:// or https:// URL (the service's "
                     "run_code endpoint)")
    if reward.custom_reward_function.path is not None:
        report.warn("reward.sandbox_fusion.url is used by the built-in scorers only, and "
                    "reward.custom_reward_function.path replaces them (as in verl): the service is not called")
    elif reward.timeout_s <= sf.run_timeout_s:
        report.warn(f"reward.timeout_s={reward.timeout_s} <= reward.sandbox_fusion.run_timeout_s={sf.run_timeout_s}: "
                    "a test case that runs to the service's limit makes its sample an error (score 0) instead of a "
                    "failed case; raise reward.timeout_s")


JUDGE_PLACEHOLDERS = {"prompt": "", "response": "", "ground_truth": ""}


def check_reward_model(cfg: Config, report: Report) -> None:
    """The ``reward_model`` section: what its style needs, and ranges. The model directory itself
    is checked in set-up's ``resolve_plugins`` (it reads config.json)."""
    rm, judge = cfg.reward_model, cfg.reward_model.judge
    if rm.micro_batch_size_per_gpu < 1:
        report.error(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu} must be >= 1")
    if rm.max_length is not None and rm.max_length < 2:
        report.error(f"reward_model.max_length={rm.max_length} must be >= 2 tokens or null")
    if judge.max_concurrency < 1:
        report.error(f"reward_model.judge.max_concurrency={judge.max_concurrency} must be >= 1")
    if judge.timeout_s <= 0:
        report.error(f"reward_model.judge.timeout_s={judge.timeout_s} must be > 0 seconds")
    if judge.max_retries < 0 or judge.backoff_s < 0:
        report.error(f"reward_model.judge.max_retries={judge.max_retries} and backoff_s={judge.backoff_s} must be >= 0")
    if judge.max_tokens < 1:
        report.error(f"reward_model.judge.max_tokens={judge.max_tokens} must be >= 1")
    _check_judge_text(cfg, report)
    if not rm.enable:
        if rm.model.path is not None or judge.base_url is not None:
            report.warn("reward_model.model.path / reward_model.judge.base_url are set but reward_model.enable=false: "
                        "no reward model scores this run")
        return
    if rm.style == "discriminative" and rm.model.path is None:
        report.error("reward_model.model.path is null: reward_model.enable=true with style=discriminative needs a "
                     "local sequence-classification model directory (or set reward_model.style=generative)")
    if rm.style == "generative" and judge.base_url is None:
        report.error("reward_model.judge.base_url is null: reward_model.style=generative needs the judge's "
                     "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    if rm.combine == "replace" and cfg.reward.custom_reward_function.path is not None:
        report.warn("reward.custom_reward_function is set but reward_model.combine=replace: the model's score "
                    "replaces it, so it is never called")


def _check_judge_text(cfg: Config, report: Report) -> None:
    """The judge's template fills in exactly {prompt}, {response}, {ground_truth}; its score regex
    compiles and has a group to read."""
    judge = cfg.reward_model.judge
    try:
        judge.prompt_template.format(**JUDGE_PLACEHOLDERS)
    except (KeyError, IndexError, ValueError) as error:
        report.error(f"reward_model.judge.prompt_template: {error!r} while filling in {{prompt}}, {{response}}, "
                     f"{{ground_truth}}; write a literal brace as {{{{ or }}}}")
    if judge.score_pattern is not None:
        try:
            groups = re.compile(judge.score_pattern).groups
        except re.error as error:
            report.error(f"reward_model.judge.score_pattern={judge.score_pattern!r} is not a regex: {error}")
        else:
            if groups < 1:
                report.error(f"reward_model.judge.score_pattern={judge.score_pattern!r} needs a group around the "
                             "score, e.g. 'Rating: ([0-9.]+)'")
