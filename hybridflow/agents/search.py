r"""A client of a search-R1 retrieval server, for the ``search`` tool (verl's SearchTool).

The server is the one verl's search-R1 recipe runs (a dense retriever over a Wikipedia dump):
``POST <url>`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"contents": "<title>\n<text>"}, "score": s}, ...], ...]}``, one
list of documents per query. The model reads them as verl formats them (``format_results``),
so a policy trained on verl's tool sees the same text here.

Bounds, so a slow or broken server costs an episode a tool error and no more:
- ``timeout_s`` is the whole call's budget: waiting for a free slot, every attempt and the
  pauses between them (verl gives each of 10 attempts its own 30 s, minutes per call).
- 5xx answers and refused connections are retried, a pause of ``retry_delay_s`` times the
  attempt number apart, while the budget lasts; a timeout is not retried (the budget is spent).
- ``max_concurrency`` searches run at once per process (verl's num_workers and rate_limit);
  the others wait for a slot, inside their budget.
Every failure raises ``SearchError`` naming the server and what happened; the tool registry
turns it into an error message for the model and a count in its stats.

stdlib only (``urllib``): the core package needs no HTTP client. Proxies follow the
environment (``http_proxy``, ``no_proxy``), as ``requests`` does in verl.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TOPK = 3  # verl's SearchTool topk
DEFAULT_TIMEOUT_S = 30.0  # verl's SearchTool timeout
DEFAULT_MAX_CONCURRENCY = 120  # verl's num_workers and rate_limit
RETRY_DELAY_S = 1.0  # verl's first pause; the n-th pause is n times this
_RETRIED_STATUSES = frozenset({500, 502, 503, 504})  # verl retries these
# A server answer larger than this is not a page of passages; stop reading instead of filling memory.
_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
_ERROR_BODY_CHARS = 200  # how much of a failed answer's body the error quotes

# The keys of hybridflow's ``search`` tool entry ``config`` (verl's ``timeout`` is the entry's timeout_s).
SETTINGS_KEYS = ("retrieval_service_url", "topk", "max_concurrency")
# verl's SearchTool config keys, and the hybridflow key each becomes ("type" is verl's native/mcp switch).
VERL_CONFIG_KEYS = ("retrieval_service_url", "topk", "timeout", "num_workers", "rate_limit",
                    "enable_global_rate_limit", "type")


class SearchError(RuntimeError):
    """A search that got no usable answer from the retrieval server."""


@dataclass(frozen=True)
class _Retry:
    """An attempt that failed in a way another attempt may not: why."""

    problem: str


@dataclass(frozen=True)
class RetrievalSettings:
    """Where and how the ``search`` tool asks: the server, documents per query, the call's time
    budget and how many calls may be in flight."""

    retrieval_service_url: str
    topk: int = DEFAULT_TOPK
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY

    def __post_init__(self) -> None:
        url = self.retrieval_service_url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"search tool: config.retrieval_service_url must be an http(s) URL of the retrieval "
                             f"server (e.g. http://127.0.0.1:8000/retrieve), got {url!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"search tool: config.topk must be an integer >= 1, got {self.topk!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0:
            raise ValueError(f"search tool: timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) \
                or self.max_concurrency < 1:
            raise ValueError(f"search tool: config.max_concurrency must be an integer >= 1, "
                             f"got {self.max_concurrency!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], timeout_s: float | None) -> RetrievalSettings:
        """From a hybridflow tool entry: its ``config`` (``SETTINGS_KEYS``) and its time limit."""
        unknown = sorted(set(config) - set(SETTINGS_KEYS))
        if unknown:
            raise ValueError(f"search tool: unknown config key(s) {unknown}; known: {', '.join(SETTINGS_KEYS)}")
        if "retrieval_service_url" not in config:
            raise ValueError("search tool: config.retrieval_service_url is required (the retrieval server's URL, "
                             "e.g. http://127.0.0.1:8000/retrieve)")
        budget = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        return cls(timeout_s=budget, **dict(config))


def settings_from_verl(config: Mapping[str, Any]) -> tuple[dict[str, Any], float | None]:
    """verl's SearchTool ``config`` as a hybridflow ``search`` entry's ``config`` and ``timeout_s``.

    verl bounds concurrency twice (a pool of ``num_workers`` threads and a cluster-wide semaphore
    of ``rate_limit`` while ``enable_global_rate_limit``); here one per-process bound, the
    smaller of the two."""
    unknown = sorted(set(config) - set(VERL_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown SearchTool config key(s) {unknown}; verl's are {', '.join(VERL_CONFIG_KEYS)}")
    if config.get("type", "native") != "native":
        raise ValueError(f"SearchTool config.type={config['type']!r}: only verl's native tools are read here")
    workers = config.get("num_workers", DEFAULT_MAX_CONCURRENCY)
    limits = [workers, config.get("rate_limit", DEFAULT_MAX_CONCURRENCY)]
    made: dict[str, Any] = {
        "retrieval_service_url": config.get("retrieval_service_url"),
        "topk": config.get("topk", DEFAULT_TOPK),
        "max_concurrency": min(limits) if config.get("enable_global_rate_limit", True) else workers,
    }
    timeout = config.get("timeout")
    return made, None if timeout is None else float(timeout)


def format_results(answer: Any) -> str:
    """The server's answer as verl's SearchTool shows it: ``{"result": "<passages>"}`` in JSON, each
    query's documents as ``Doc i (Title: <first line>)\\n<rest>``, queries apart by ``---``."""
    per_query = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(per_query, list):
        raise SearchError(f"the retrieval server's answer has no 'result' list: {str(answer)[:_ERROR_BODY_CHARS]}")
    blocks = []
    for documents in per_query:
        if not isinstance(documents, list):
            raise SearchError(f"the retrieval server's 'result' holds {type(documents).__name__}, not a list of "
                              f"documents per query")
        blocks.append("\n\n".join(_document_text(index, item) for index, item in enumerate(documents)))
    if not any(blocks):
        return json.dumps({"result": "No search results found."})
    return json.dumps({"result": "\n---\n".join(blocks)}, ensure_ascii=False)


def _document_text(index: int, item: Any) -> str:
    contents = (item.get("document") or {}).get("contents") if isinstance(item, dict) else None
    if not isinstance(contents, str):
        raise SearchError(f"a document in the retrieval server's answer has no document.contents text: "
                          f"{str(item)[:_ERROR_BODY_CHARS]}")
    title, _, text = contents.partition("\n")
    return f"Doc {index + 1} (Title: {title})\n{text}"


class RetrievalClient:
    """Sends searches to one retrieval server within the settings' bounds. Thread-safe: the search
    tool is sync, so each call runs in its own thread (``ToolRegistry``)."""

    def __init__(self, settings: RetrievalSettings, retry_delay_s: float = RETRY_DELAY_S) -> None:
        self.settings = settings
        self.retry_delay_s = retry_delay_s
        self._slots = threading.BoundedSemaphore(settings.max_concurrency)

    def search(self, queries: list[str]) -> str:
        """The documents for ``queries``, formatted for the model; ``SearchError`` when the server
        gives none within ``timeout_s``."""
        deadline = time.monotonic() + self.settings.timeout_s
        if not self._slots.acquire(timeout=self.settings.timeout_s):
            raise SearchError(f"no free search slot within {self.settings.timeout_s:g} s "
                              f"({self.settings.max_concurrency} searches in flight)")
        try:
            return format_results(self._post(queries, deadline))
        finally:
            self._slots.release()

    def _post(self, queries: list[str], deadline: float) -> Any:
        url = self.settings.retrieval_service_url
        body = json.dumps({"queries": queries, "topk": self.settings.topk, "return_scores": True}).encode()
        attempt = 0
        while True:
            attempt += 1
            outcome = self._attempt(url, body, deadline)
            if not isinstance(outcome, _Retry):
                return outcome  # the decoded answer
            pause = self.retry_delay_s * attempt
            if time.monotonic() + pause >= deadline:
                raise SearchError(f"retrieval server {url}: {outcome.problem} (gave up after {attempt} "
                                  f"attempt(s) in the {self.settings.timeout_s:g} s budget)")
            time.sleep(pause)

    def _attempt(self, url: str, body: bytes, deadline: float) -> Any:
        """The decoded answer of one POST, or why it is worth another try (``_Retry``); raises
        ``SearchError`` for what another try would not fix."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SearchError(f"retrieval server {url} gave no answer within {self.settings.timeout_s:g} s")
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=remaining) as response:
                raw = response.read(_MAX_RESPONSE_BYTES + 1)
                # A bounded read returns short instead of raising when the server hangs up early;
                # ``length`` is what its Content-Length promised and never came.
                cut_short = len(raw) <= _MAX_RESPONSE_BYTES and bool(response.length)
        except urllib.error.HTTPError as error:
            detail = error.read(_ERROR_BODY_CHARS).decode("utf-8", "replace")
            if error.code in _RETRIED_STATUSES:
                return _Retry(f"HTTP {error.code} {detail}".rstrip())
            raise SearchError(f"retrieval server {url} answered HTTP {error.code}: {detail}") from None
        except TimeoutError:
            raise SearchError(f"retrieval server {url} gave no answer within {self.settings.timeout_s:g} s") from None
        except urllib.error.URLError as error:
            if isinstance(error.reason, TimeoutError):
                raise SearchError(f"retrieval server {url} gave no answer within "
                                  f"{self.settings.timeout_s:g} s") from None
            return _Retry(f"cannot connect ({error.reason})")
        except (OSError, http.client.HTTPException) as error:  # a connection reset or cut halfway through
            return _Retry(f"connection failed ({type(error).__name__}: {error})")
        if cut_short:
            return _Retry(f"connection failed (the answer was cut short after {len(raw)} bytes)")
        if len(raw) > _MAX_RESPONSE_BYTES:
            raise SearchError(f"retrieval server {url} answered more than {_MAX_RESPONSE_BYTES} bytes")
        try:
            return json.loads(raw)
        except ValueError:
            raise SearchError(f"retrieval server {url} answered something that is not JSON: "
                              f"{raw[:_ERROR_BODY_CHARS].decode('utf-8', 'replace')}") from None
