"""The ``reward`` and ``reward_model`` sections: rule scorers, sandboxes, reward models, judges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.fields import f, sub


@dataclass
class CustomRewardConfig:
    path: str | None = f(None, "Python file defining a reward function.")
    name: str = f("compute_score", "Function name in that file.")


@dataclass
class OverlongBufferConfig:
    enable: bool = f(False, "DAPO overlong shaping: penalise responses that run into the last buffer tokens.")
    len: int | None = f(
        None,
        "Buffer length in tokens: a response longer than max_response_length - len loses "
        "(length - (max_response_length - len)) / len x penalty_factor. None: max_response_length // 5.",
    )
    penalty_factor: float = f(1.0, "Penalty at max_response_length (linear from 0 at the buffer's start).")
    max_response_length: int | None = f(
        None,
        "Where the buffer ends, in tokens (verl's reward_model.reward_kwargs.max_resp_len): the penalty is 0 up to "
        "max_response_length - len and reaches -penalty_factor here (more past it). None: data.max_response_length.",
    )


@dataclass
class SandboxFusionConfig:
    url: str | None = f(
        None,
        "A SandboxFusion service's run_code endpoint (https://host/run_code). Set: rows of data_source codecontests, "
        "apps, codeforces or taco are scored there (the fraction of their first 10 test cases passed), as verl "
        "does; hybridflow/code keeps the local sandbox. Built-in scoring only (not with custom_reward_function).",
    )
    max_concurrent: int = f(64, "Requests in flight to the service at most, over all scoring processes.")
    memory_limit_mb: int = f(1024, "The memory limit the service gives each run.")
    run_timeout_s: float = f(
        10.0, "The service's compile and run time limits per test case; a sample's requests all end by 0.9 x "
        "reward.timeout_s, and a service that fails or answers late makes the sample an error (score 0).",
    )


@dataclass
class RewardConfig:
    custom_reward_function: CustomRewardConfig = sub(
        CustomRewardConfig, "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict."
    )
    timeout_s: float = f(10.0, "Per-sample scoring timeout; a timed-out sample scores 0 and is counted.")
    num_workers: int = f(1, "Scoring worker processes.")
    startup_timeout_s: float = f(
        60.0, "How long a scoring worker may take to start and load the reward function (an import that hangs fails "
        "the run at start-up after this).",
    )
    overlong_buffer: OverlongBufferConfig = sub(OverlongBufferConfig, "DAPO's soft overlong punishment.")
    sandbox_fusion: SandboxFusionConfig = sub(
        SandboxFusionConfig, "Code rewards run by a SandboxFusion service (verl's reward_model.sandbox_fusion)."
    )
    reward_manager: str = f(
        "naive",
        "How responses are scored (verl's reward managers, verl's key): naive (the reward function once per sample) | "
        "batch (once per scoring call with lists: fn(data_sources, solution_strs, ground_truths, extra_infos) -> a "
        "list of results; needs custom_reward_function; a call covers a step's samples, or each part of them scored "
        "as it finishes) | dapo (per sample, with DAPO's overlong penalty of reward.overlong_buffer, which verl reads "
        "from reward_kwargs.overlong_buffer_cfg; --preset dapo) | prime (per sample in a pool of scoring processes, "
        "as verl's prime: at least as many as the CPU's cores, up to 64, whatever reward.num_workers). Every "
        "manager here scores in supervised processes with reward.timeout_s per sample.",
        choices=("naive", "batch", "dapo", "prime"),
    )
    reward_kwargs: dict[str, Any] = f(
        {}, "Extra keyword arguments of every call of custom_reward_function (verl passes reward_model.reward_kwargs "
        "to its manager, and custom_reward_function.reward_kwargs to the function); needs a custom function.",
    )



DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n{ground_truth}\n\n"
    "Answer to grade:\n{response}\n\nHow correct and helpful is the answer? Reply with a single line "
    "'Score: x' where x is a number from 0 (wrong) to 1 (fully correct)."
)


@dataclass
class RewardModelModelConfig:
    path: str | None = f(
        None,
        "A local Hugging Face sequence-classification directory (AutoModelForSequenceClassification, num_labels=1, "
        "a decoder whose head reads the last token) with its own tokenizer and chat template. style=discriminative.",
    )
    trust_remote_code: bool = f(False, "Allow the reward model's custom modelling code.")


@dataclass
class JudgeConfig:
    base_url: str | None = f(
        None, "The OpenAI-compatible endpoint of the judge, up to /v1 (e.g. http://127.0.0.1:8000/v1, what "
        "`hybridflow serve` or vLLM serves). style=generative.",
    )
    model: str = f("judge", "The model name sent in each chat completion request.")
    api_key_env: str | None = f(
        None, "The environment variable holding the API key (sent as a Bearer token). None: no key."
    )
    prompt_template: str = f(
        DEFAULT_JUDGE_TEMPLATE,
        "The judge's user message; {prompt} (the prompt's last user message), {response} (the decoded "
        "response) and {ground_truth} are filled in (other braces must be doubled).",
    )
    score_pattern: str | None = f(
        None,
        "A regex whose first group is the score (the last match counts). None: the last 'Score: x', else the "
        "last number in the reply that lies in [0, 1]. A reply without one is a parse error.",
    )
    max_concurrency: int = f(8, "Judge requests in flight at once.")
    timeout_s: float = f(60.0, "Limit of one request; a request past it counts in reward_model/judge/timeouts.")
    max_retries: int = f(2, "Retries of a request that timed out, failed to connect or got a 429/5xx answer.")
    backoff_s: float = f(0.5, "Wait before the first retry; doubled before each further one.")
    failure_score: float = f(
        0.0, "The score of a judgement that failed (no answer after the retries, or a reply without a score)."
    )
    max_tokens: int = f(256, "max_tokens of each judge request.")
    temperature: float = f(0.0, "Sampling temperature of the judge (0: greedy).")


@dataclass
class RewardModelConfig:
    """verl's ``reward_model`` section: a learned reward beside (or instead of) the rule scorers."""

    enable: bool = f(False, "Score responses with a reward model too (style picks which).")
    style: str = f(
        "discriminative",
        "discriminative: a sequence classifier (model.path) run in its own worker group | generative: an LLM "
        "judge behind an OpenAI-compatible endpoint (judge.*).",
        choices=("discriminative", "generative"),
    )
    model: RewardModelModelConfig = sub(RewardModelModelConfig, "The discriminative reward model.")
    micro_batch_size_per_gpu: int = f(16, "Sequences per reward-model forward on one rank.")
    max_length: int | None = f(
        None,
        "Longest rendered prompt+response in reward-model tokens; a longer one loses tokens from its start "
        "(the prompt first), keeping the response's end where the head reads the score. None: the model's "
        "max_position_embeddings.",
    )
    combine: str = f(
        "add",
        "How the model's score meets the rule reward: add (rule score + model score; every row needs a rule "
        "scorer) | replace (the model's score alone; rows need no rule scorer).",
        choices=("add", "replace"),
    )
    judge: JudgeConfig = sub(JudgeConfig, "The generative judge (style=generative).")
