"""On-policy distillation (the ``distillation`` section): the teachers that score the student's samples and
how their per-token reverse KL mixes with the task's advantages (docs/algorithms.md, "On-policy
distillation").

The student is the actor (model.path); everything about its training is the RL run's own keys
(algorithm.adv_estimator for the task part, actor.*, rollout.*). A teacher is a frozen causal LM loaded
like the reference model, one rank per actor rank, and must share the student's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.fields import f, sub

BUILTIN_TEACHER = "builtin:tiny-teacher"
"""``distillation.teacher.path`` of the built-in arithmetic teacher: the warm-started built-in model trained further
on correct answers only (cached like the warm start)."""


def is_teacher_server(path: str) -> bool:
    """Whether a teacher path names an OpenAI-compatible server (its URL) rather than a model to load."""
    return path.startswith(("http://", "https://"))


@dataclass
class TeacherConfig:
    path: str | None = f(
        None, "The teacher: a local Hugging Face causal LM directory (or a hub id) with the student's tokenizer, "
        f"or {BUILTIN_TEACHER} (the built-in arithmetic task's teacher: the warm-started built-in model after "
        "distillation.builtin_teacher_steps more SFT steps on correct answers), or the URL of an OpenAI-compatible "
        "server that returns prompt logprobs, up to /v1 (`hybridflow serve` or vLLM; distillation.server.*). "
        "Scores the rows whose data_source distillation.teachers does not name; null: only those rows may be "
        "trained on.",
    )
    trust_remote_code: bool = f(False, "Let the teachers' model folders (this one and distillation.teachers') run "
                                       "their own code (as model.trust_remote_code).")


@dataclass
class TeacherServerConfig:
    """How a teacher behind an OpenAI-compatible server is asked: one /v1/completions request per sample, its
    prompt the sample's prompt and response token ids, prompt_logprobs 0 (vLLM's field), max_tokens 1."""

    model: str | None = f(None, "The model name sent with each request. None: the first model of the server's "
                                "/v1/models.")
    api_key_env: str | None = f(None, "The environment variable holding the API key (sent as a Bearer token). "
                                      "None: no key.")
    max_concurrency: int = f(8, "Requests in flight at once, per server.")
    timeout_s: float = f(120.0, "Limit of one request; a request past it counts in distill/teacher_server/timeouts.")
    max_retries: int = f(2, "Retries of a request that timed out, failed to connect or got a 429/5xx answer.")
    backoff_s: float = f(0.5, "Wait before the first retry; doubled before each further one.")


@dataclass
class DistillationConfig:
    """The student (the actor) samples; each teacher scores every sampled token; the advantage of a token adds
    −kl_coef x (log π_student − log π_teacher) of it to reward_weight x the task estimator's advantage."""

    enable: bool = f(False, "Distil from the teacher(s) during RL (on-policy distillation).")
    teacher: TeacherConfig = sub(TeacherConfig, "The default teacher (rows of any data_source).")
    teachers: dict[str, str] = f(
        {}, "Teachers by data_source: {data_source: model path or server URL}; a row of a data_source named here is "
        "scored by that teacher, the others by distillation.teacher.path. Each distinct path is one frozen model.",
    )
    server: TeacherServerConfig = sub(TeacherServerConfig, "Teachers behind a server (a path that is an http(s) "
                                      "URL): requests, timeouts, retries.")
    kl_coef: float = f(
        1.0, "Weight of the distillation advantage: each token's advantage gains −kl_coef x (log π_student − "
        "log π_teacher) of its sampled token (Thinking Machines' kl_penalty_coef). >= 0.",
    )
    reward_weight: float = f(
        1.0, "Weight of the task estimator's advantage (algorithm.adv_estimator on the reward) in the mix: 0 is "
        "pure distillation, 1 adds the two as they are. >= 0.",
    )
    discount: float = f(
        0.0, "γ in [0, 1]: a token's distillation advantage also sums the later tokens' terms discounted by γ "
        "(Thinking Machines' kl_discount_factor). 0: each token's own reverse KL only.",
    )
    log_prob_micro_batch_size_per_gpu: int = f(128, "Samples per teacher logprob forward on one rank.")
    log_prob_max_token_len_per_gpu: int | None = f(
        None, "Token budget of a teacher's micro-batch when actor.use_dynamic_bsz is on. None: the actor's logprob "
        "budget as the run uses it (recorded with the run, so a resume cuts the teachers' micro-batches alike); "
        "set it for a teacher much larger than the student.",
    )
    builtin_teacher_steps: int = f(
        200, f"{BUILTIN_TEACHER}: SFT steps on the arithmetic task's correct answers after the student's warm start "
        "(warm_start.batch_size and lr): the warm-started student unlearns its flawed teacher's slip, so the teacher "
        "answers right where the student slips. Cached beside the warm start.",
    )
