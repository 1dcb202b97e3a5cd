"""On-policy distillation's teacher behind an OpenAI-compatible server (``hybridflow serve``, vLLM): the client
that scores the student's samples with the server's prompt logprobs.

Each sample is one ``POST /v1/completions``: its prompt is the sample's prompt and response token ids, with
``prompt_logprobs: 0`` (vLLM's field: each prompt token's logprob given the tokens before it) and ``max_tokens:
1`` (the least a server draws); the response tokens' entries of ``choices[0].prompt_logprobs`` are the
teacher's logprobs of the tokens the student wrote. Nothing is re-tokenized, so the server must read the
student's token ids as the student's tokenizer does: ``check_tokenizer`` compares the two through the server's
``/tokenize`` and ``/detokenize`` (vLLM's and ``hybridflow serve``'s) before the run starts; a server without
them is assumed to share the tokenizer, and says so in a warning.

The logprobs are the raw model's (temperature 1), which is what vLLM's prompt_logprobs are.

A server is remote and fallible, as the judge is (``rewards/judge``), and handled alike: a request that
times out, cannot connect or gets a 429/5xx answer is retried up to ``max_retries`` times (waits of
``backoff_s``, doubled each time); a sample still unscored (retries spent, another 4xx, or an answer without
its prompt logprobs) is counted and named in the metrics, and costs that sample its distillation signal, never
the run; a step in which no sample is scored fails, since distillation would otherwise stop unseen. Metrics
per step, each with the role's name (``teacher``, ``teacher_1``, ...):

- ``distill/<role>/failures`` and ``distill/<role>/failure_rate``: samples left unscored, their share;
- ``distill/<role>/timeouts``: of those, the ones whose last attempt timed out;
- ``distill/<role>/retries``: attempts repeated (over all samples).

httpx is imported when a client is built (the ``serve`` or ``judge`` extra).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridflow.config import ConfigError
from hybridflow.config.sections.distillation import TeacherServerConfig

log = logging.getLogger(__name__)

# Answers worth another attempt (the judge's): rate limits and server-side failures.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Text the tokenizer check has the server tokenize: words, digits, punctuation, spaces, newlines, non-ASCII.
TOKENIZER_PROBE = "Teacher check: 12 + 345 = 357.\n  def f(x):\treturn x**2  # café, naïve, 東京, emoji 🙂"
# The student's ids the server detokenizes: the last ones of the vocabulary, where tokenizers that differ by
# added tokens differ, and its special tokens.
PROBED_LAST_IDS = 8


class Outcome(Enum):
    SCORED = "scored"
    TIMEOUT = "timeout"
    ERROR = "error"  # no answer (connection failed, an HTTP error status) or one without the prompt logprobs


@dataclass(frozen=True)
class Scored:
    """One sample's teacher logprobs of its response tokens (None: unscored), how, and the retries it took."""

    logprobs: list[float] | None
    outcome: Outcome
    retries: int
    error: str = ""


def api_root(url: str) -> str:
    """The server's root from its OpenAI base URL (``/tokenize`` and ``/detokenize`` live beside ``/v1``)."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class TeacherServer:
    """The client of one teacher server at ``url`` (its OpenAI base, up to /v1), named by ``key`` (the config key
    that names it) in its errors and ``role`` in its metrics."""

    def __init__(self, url: str, settings: TeacherServerConfig, *, key: str, role: str) -> None:
        import httpx  # the serve / judge extra: only runs with a teacher server need it

        self.url, self.settings, self.key, self.role = url.rstrip("/"), settings, key, role
        api_key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        if settings.api_key_env and not api_key:
            raise ConfigError(f"distillation.server.api_key_env={settings.api_key_env!r} is not set in the environment",
                              key="distillation.server.api_key_env")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=settings.timeout_s,
                                    limits=httpx.Limits(max_connections=settings.max_concurrency))
        self._pool = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix=f"{role}-server")
        self._model: str | None = settings.model

    # ------------------------------------------------------------------ before the run

    def model(self) -> str:
        """The model name requests carry: distillation.server.model, else the first of the server's /v1/models."""
        if self._model is None:
            models = self._get_json("/models")
            try:
                self._model = str(models["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise ConfigError(f"{self.key}={self.url!r}: /v1/models lists no model ({models!r:.200}); set "
                                  "distillation.server.model", key=self.key) from None
        return self._model

    def max_model_len(self) -> int | None:
        """The context the server reports in /v1/models (vLLM and hybridflow serve do), else None."""
        for card in self._get_json("/models").get("data", []):
            if card.get("id") == self.model() and isinstance(card.get("max_model_len"), int):
                return int(card["max_model_len"])
        return None

    def check_tokenizer(self, student: Any) -> str | None:
        """Refuse (``ConfigError`` on ``key``) a server whose tokenizer reads the student's ids otherwise: the probe
        text tokenized, and the student's last and special ids detokenized, must match. Returns a note when the
        server has no /tokenize to ask (the tokenizer is then assumed the student's), else None."""
        import httpx

        model = self.model()
        probe = TOKENIZER_PROBE + " " + " ".join(sorted(student.get_added_vocab()))
        try:
            answer = self._client.post(f"{api_root(self.url)}/tokenize",
                                       json={"model": model, "prompt": probe, "add_special_tokens": False})
        except httpx.HTTPError as error:
            raise ConfigError(f"{self.key}={self.url!r}: the teacher server does not answer ({error})",
                              key=self.key) from error
        if answer.status_code in (404, 405):
            return (f"{self.key}={self.url!r} has no /tokenize: its tokenizer is assumed to be the student's (it "
                    "scores the student's token ids as they are)")
        theirs = _json(answer).get("tokens")
        ours = student.encode(probe, add_special_tokens=False)
        problems = []
        if theirs != ours:
            problems.append(f"the probe text is {len(ours)} tokens for the student, {_shown(theirs)} for the server")
        vocab = len(student)
        ids = sorted({*range(max(0, vocab - PROBED_LAST_IDS), vocab), *student.all_special_ids})
        for token in ids:
            answer = self._client.post(f"{api_root(self.url)}/detokenize", json={"model": model, "tokens": [token]})
            text = _json(answer).get("prompt")
            if answer.status_code != 200 or text != student.decode([token]):
                problems.append(f"token {token} is {student.decode([token])!r} for the student, "
                                f"{_shown(text if answer.status_code == 200 else answer.text)} for the server")
                break
        if problems:
            raise ConfigError(f"{self.key}={self.url!r} does not share the student's tokenizer (model.path): "
                              f"{'; '.join(problems)}. The teacher scores the student's token ids, so both must "
                              "spell every token alike", key=self.key)
        return None

    def _get_json(self, path: str) -> dict[str, Any]:
        import httpx

        try:
            answer = self._client.get(f"{self.url}{path}")
        except httpx.HTTPError as error:
            raise ConfigError(f"{self.key}={self.url!r}: the teacher server does not answer ({error})",
                              key=self.key) from error
        if answer.status_code != 200:
            raise ConfigError(f"{self.key}={self.url!r}: GET {path} answered {answer.status_code}: "
                              f"{answer.text[:300]}", key=self.key)
        return _json(answer)

    # ------------------------------------------------------------------ each step

    def score(self, samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[list[Scored], dict[str, float]]:
        """Each (prompt ids, response ids) sample's teacher logprobs of its response tokens, in order, and the
        metrics above. Raises ``RuntimeError`` when no sample could be scored."""
        scored = list(self._pool.map(lambda sample: self.score_one(*sample), samples))
        failed = [s for s in scored if s.outcome is not Outcome.SCORED]
        prefix = f"distill/{self.role}"
        metrics = {
            f"{prefix}/failures": float(len(failed)),
            f"{prefix}/failure_rate": len(failed) / max(1, len(scored)),
            f"{prefix}/timeouts": float(sum(s.outcome is Outcome.TIMEOUT for s in failed)),
            f"{prefix}/retries": float(sum(s.retries for s in scored)),
        }
        if failed:
            log.warning("distillation: %s (%s) left %d of %d samples unscored, e.g. %s", self.role, self.url,
                        len(failed), len(scored), failed[0].error or failed[0].outcome.value)
        if scored and len(failed) == len(scored):
            raise RuntimeError(f"distillation: the teacher server {self.url} ({self.key}) scored none of the step's "
                               f"{len(scored)} samples: {failed[0].error or failed[0].outcome.value}")
        return scored, metrics

    def score_one(self, prompt: Sequence[int], response: Sequence[int]) -> Scored:
        """One sample with its retries; never raises for the server's faults."""
        import httpx

        s = self.settings
        body = {"model": self.model(), "prompt": [*prompt, *response], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        outcome, retries, error = Outcome.ERROR, 0, ""
        for attempt in range(s.max_retries + 1):
            if attempt:
                retries += 1
                time.sleep(s.backoff_s * 2 ** (attempt - 1))
            try:
                answer = self._client.post(f"{self.url}/completions", json=body)
            except httpx.TimeoutException as exc:
                outcome, error = Outcome.TIMEOUT, f"timed out ({exc})"
                continue
            except httpx.TransportError as exc:
                outcome, error = Outcome.ERROR, f"{type(exc).__name__}: {exc}"
                continue
            if answer.status_code in RETRY_STATUS:
                outcome = Outcome.TIMEOUT if answer.status_code == 408 else Outcome.ERROR
                error = f"HTTP {answer.status_code}: {answer.text[:300]}"
                continue
            if answer.status_code != 200:  # our request's fault: another attempt fails the same way
                return Scored(None, Outcome.ERROR, retries, f"HTTP {answer.status_code}: {answer.text[:300]}")
            logprobs, problem = response_logprobs(_json(answer), len(prompt), response)
            return Scored(logprobs, Outcome.SCORED if logprobs is not None else Outcome.ERROR, retries, problem)
        return Scored(None, outcome, retries, error)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


def response_logprobs(answer: dict[str, Any], prompt_length: int,
                      response: Sequence[int]) -> tuple[list[float] | None, str]:
    """The response tokens' logprobs in a completion answer's ``choices[0].prompt_logprobs`` (vLLM's shape: a list
    per prompt position, None first, else {token id: {logprob, ...}}), or None and what is wrong with it."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
        if not isinstance(entries, list) or len(entries) != prompt_length + len(response):
            return None, f"prompt_logprobs has {len(entries) if isinstance(entries, list) else entries!r} entries, " \
                         f"not {prompt_length + len(response)}"
        values = [float(entries[prompt_length + t][str(token)]["logprob"]) for t, token in enumerate(response)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return None, f"the answer has no prompt logprobs of the response tokens ({type(exc).__name__}: {exc})"
    return values, ""


def _json(answer: Any) -> dict[str, Any]:
    try:
        value = answer.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
