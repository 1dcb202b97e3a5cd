"""A generative reward model: an LLM judge behind an OpenAI-compatible chat endpoint.

Each answer becomes one chat completion request (``JudgeConfig.prompt_template`` filled with the
prompt, the response and the ground truth); the judge's reply is parsed for a score
(``parse_score``). Requests run on ``max_concurrency`` threads over one pooled HTTP client.

A judge is remote and fallible, so, as with the rule scorers, a failure costs a sample, never the
run: a request that times out, cannot connect or gets a 429/5xx answer is retried up to
``max_retries`` times (waits of ``backoff_s``, doubled each time); a judgement that still has no
score (retries spent, another 4xx, or a reply without a score) gets ``failure_score`` and is
counted. Metrics per ``score`` call (counts of judgements, not of attempts):

- ``reward_model/judge/failures``: judgements that got ``failure_score``, for any reason below
  (``reward_model/judge/failure_rate``: their share, which the reward-failure health check reads);
- ``reward_model/judge/timeouts``: of those, the ones whose last attempt timed out;
- ``reward_model/judge/parse_errors``: of those, the ones answered without a score;
- ``reward_model/judge/retries``: attempts repeated (over all judgements).

httpx is imported when a judge is built: the core package does not need it (extra ``judge``).
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridflow.config.schema import JudgeConfig

METRIC_FAILURES = "reward_model/judge/failures"
METRIC_FAILURE_RATE = "reward_model/judge/failure_rate"
METRIC_TIMEOUTS = "reward_model/judge/timeouts"
METRIC_PARSE_ERRORS = "reward_model/judge/parse_errors"
METRIC_RETRIES = "reward_model/judge/retries"

# "Score: 0.8", "score = 1", "**Score:** 0.5": the judge's explicit verdict, preferred over any other number.
SCORE_LINE = re.compile(r"score\W{0,4}[:=]\W{0,4}([-+]?\d*\.?\d+)", re.IGNORECASE)
NUMBER = re.compile(r"[-+]?\d*\.?\d+")
# Answers worth another attempt: rate limits and server-side failures. Other 4xx are our request's
# fault (wrong model name, bad key) and would fail the same way again.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def parse_score(text: str, pattern: str | None = None) -> float | None:
    """The judge's score in ``text``, or None when there is none.

    With ``pattern``: the first group of its last match, as a float, whatever its range. Without:
    the last ``Score: x`` whose x lies in [0, 1]; else the last number in the text that lies in
    [0, 1] (so "7/10" is not read as a score, and "... 3 steps ... 0.9" reads 0.9)."""
    if pattern is not None:
        matches = list(re.finditer(pattern, text))
        return _finite(matches[-1].group(1)) if matches else None
    for candidates in (SCORE_LINE.findall(text), NUMBER.findall(text)):
        values = [v for v in (_finite(c) for c in candidates) if v is not None and 0.0 <= v <= 1.0]
        if values:
            return values[-1]
    return None


def _finite(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class JudgeRequest:
    prompt: str
    response: str
    ground_truth: str


class Outcome(Enum):
    SCORED = "scored"
    TIMEOUT = "timeout"
    ERROR = "error"  # no answer: connection failed, or an HTTP error status
    PARSE_ERROR = "parse_error"  # answered, but without a score


@dataclass(frozen=True)
class Judgement:
    score: float
    outcome: Outcome
    retries: int
    reply: str = ""  # the judge's text (for debugging a template or a parser)


class Judge:
    """The client of the judge that ``settings`` (the ``reward_model.judge`` section, the one home of the
    judge's settings and their defaults) describes; ``api_key`` is sent as a Bearer token (None: none)."""

    def __init__(self, settings: JudgeConfig, api_key: str | None = None) -> None:
        import httpx  # the judge extra: only runs with a generative reward model need it

        if settings.base_url is None:
            raise ValueError("reward_model.judge.base_url is not set: the judge's endpoint, up to /v1")
        self.settings = settings
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=settings.base_url.rstrip("/"), headers=headers, timeout=settings.timeout_s,
            limits=httpx.Limits(max_connections=settings.max_concurrency),
        )
        self._pool = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="judge")

    def score(self, requests: list[JudgeRequest]) -> tuple[list[Judgement], dict[str, float]]:
        """One judgement per request, in order, and the counters above."""
        judgements = list(self._pool.map(self.judge, requests))
        outcomes = [j.outcome for j in judgements]
        failures = sum(o is not Outcome.SCORED for o in outcomes)
        metrics = {
            METRIC_FAILURES: float(failures),
            METRIC_FAILURE_RATE: failures / max(1, len(outcomes)),
            METRIC_TIMEOUTS: float(outcomes.count(Outcome.TIMEOUT)),
            METRIC_PARSE_ERRORS: float(outcomes.count(Outcome.PARSE_ERROR)),
            METRIC_RETRIES: float(sum(j.retries for j in judgements)),
        }
        return judgements, metrics

    def judge(self, request: JudgeRequest) -> Judgement:
        """One request with its retries; never raises for the judge's faults."""
        import httpx

        s = self.settings
        body = self._body(request)
        outcome, retries = Outcome.ERROR, 0
        for attempt in range(s.max_retries + 1):
            if attempt:
                retries += 1
                time.sleep(s.backoff_s * 2 ** (attempt - 1))
            try:
                answer = self._client.post("/chat/completions", json=body)
            except httpx.TimeoutException:
                outcome = Outcome.TIMEOUT
                continue
            except httpx.TransportError:
                outcome = Outcome.ERROR
                continue
            if answer.status_code in RETRY_STATUS:
                outcome = Outcome.TIMEOUT if answer.status_code == 408 else Outcome.ERROR
                continue
            if answer.status_code != 200:
                break  # our request's fault: another attempt fails the same way
            reply = _reply_text(answer)
            value = parse_score(reply, s.score_pattern) if reply is not None else None
            if value is None:
                return Judgement(s.failure_score, Outcome.PARSE_ERROR, retries, reply or "")
            return Judgement(value, Outcome.SCORED, retries, reply or "")
        return Judgement(s.failure_score, outcome, retries)

    def _body(self, request: JudgeRequest) -> dict[str, Any]:
        s = self.settings
        content = s.prompt_template.format(
            prompt=request.prompt, response=request.response, ground_truth=request.ground_truth
        )
        return {"model": s.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": s.max_tokens, "temperature": s.temperature}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


def _reply_text(answer: Any) -> str | None:
    """The first choice's message text of a chat completion, or None for a malformed body."""
    try:
        content = answer.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None
