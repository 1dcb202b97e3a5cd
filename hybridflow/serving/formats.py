"""What an answer looks like: token ids to text (incrementally for a stream, held back while a
stop string could still cut it) and OpenAI's completion and chat shapes of choices, chunks and
logprobs."""

from __future__ import annotations

import abc
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.inference.stopping import cut_at_stop
from hybridflow.types import PromptLogprobs, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

# JSON has no -inf: a logprob below this is reported as this (vLLM's convention).
MIN_REPORTED_LOGPROB = -9999.0
Json = dict[str, Any]


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, a few tokens at a time (vLLM's scheme).

    Each push decodes only the tokens since the last emitted boundary, with the token(s) before it
    as context (so tokenizers that drop a leading space at the start of a decode keep it), and
    emits nothing while the text ends in an incomplete UTF-8 character (U+FFFD).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the context decoded with the new tokens
        self._read_offset = 0  # tokens whose text is already in ``text``

    def push(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += new_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def final_text(tokenizer: Any, response_ids: Sequence[int], stop_reason: int | str | None, include_stop: bool) -> str:
    """The text a finished sample returns: decoded, cut before a matched stop string (``LLM``'s rule)."""
    decoded = tokenizer.decode(list(response_ids), skip_special_tokens=True)
    return cut_at_stop(decoded, stop_reason if isinstance(stop_reason, str) else None, include_stop)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] | None


class StreamedChoice:
    """One sample being streamed: emits text only once no stop string can still cut it."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        # A stop string completed by a later token starts at most len(stop) - 1 characters back.
        cut = params.stop and not params.include_stop_str_in_output
        self._holdback = max(len(s) for s in params.stop) - 1 if cut else 0
        self.sent = ""
        self.pending: list[TokenLogprob] = []  # logprobs of tokens not yet sent with a chunk
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def token_count(self) -> int:
        return len(self._detokenizer.ids)

    def add(self, token: TokenLogprob) -> None:
        """Add a token without sending text: the last token of a sample, which ``finish`` sends."""
        self.pending.append(token)
        self._detokenizer.push(token.token_id)

    def push(self, token: TokenLogprob) -> str:
        """Add a token that is not the sample's last; return the text that can be sent now."""
        self.add(token)
        return self._take(self._detokenizer.text[: max(0, len(self._detokenizer.text) - self._holdback)])

    def finish(self, finish_reason: str, stop_reason: int | str | None) -> str:
        """Mark the sample done; return the rest of its final text."""
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        text = final_text(self._tokenizer, self._detokenizer.ids, stop_reason, self._params.include_stop_str_in_output)
        if not text.startswith(self.sent):
            # Incremental decoding diverged from a whole decode (a tokenizer quirk): what was sent
            # cannot be taken back, so the stream ends with the text sent so far.
            logger.warning("streamed text diverged from the final decode; the stream keeps what it sent")
            return ""
        return self._take(text)

    def take_pending(self) -> list[TokenLogprob]:
        pending, self.pending = self.pending, []
        return pending

    def _take(self, text: str) -> str:
        new_text = text[len(self.sent) :] if len(text) > len(self.sent) else ""
        self.sent += new_text
        return new_text


def _clean_logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_REPORTED_LOGPROB else MIN_REPORTED_LOGPROB


def token_records(trajectory: Trajectory) -> list[TokenLogprob]:
    tops: Sequence[dict[int, float] | None] = trajectory.top_logprobs or [None] * len(trajectory.response_ids)
    return [
        TokenLogprob(token, logprob, top)
        for token, logprob, top in zip(trajectory.response_ids, trajectory.rollout_logprobs, tops, strict=True)
    ]


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class ResponseFormat(abc.ABC):
    """How one endpoint writes choices, chunks and logprobs (completions vs chat)."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, tokenizer: Any, top_logprobs: int | None) -> None:
        self._tokenizer = tokenizer
        self._top_logprobs = top_logprobs  # None: no logprobs in the answer

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    @abc.abstractmethod
    def choice(self, index: int, text: str, tokens: list[TokenLogprob], finish: str | None, stop: Any) -> Json:
        """A finished choice of a non-streamed answer."""

    @abc.abstractmethod
    def delta(self, index: int, text: str, tokens: list[TokenLogprob], finish: str | None, stop: Any) -> Json:
        """A streamed chunk's choice: new ``text`` and the logprobs of ``tokens``."""

    def opening_deltas(self, count: int) -> list[dict[str, Any]]:
        return []


class CompletionFormat(ResponseFormat):
    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def choice(self, index: int, text: str, tokens: list[TokenLogprob], finish: str | None, stop: Any) -> Json:
        logprobs = self._logprobs(tokens) if self._top_logprobs is not None else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    delta = choice  # a streamed completion chunk has the same shape as a choice

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict[str, list[Any]]:
        texts = [self.token_text(t.token_id) for t in tokens]
        offsets = [sum(len(s) for s in texts[:i]) for i in range(len(texts))]
        tops = [
            {self.token_text(i): _clean_logprob(v) for i, v in sorted(t.top.items(), key=lambda kv: -kv[1])}
            if t.top is not None
            else None
            for t in tokens
        ]
        return {
            "tokens": texts,
            "token_logprobs": [_clean_logprob(t.logprob) for t in tokens],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


    def prompt_logprobs(self, prompt_ids: Sequence[int], scored: PromptLogprobs) -> list[Json | None]:
        """vLLM's ``choices[i].prompt_logprobs``: None for the first token, then per prompt token {token id: {logprob,
        rank, decoded_token}} holding that token and the top k (ranked 1..k)."""
        entries: list[Json | None] = [None]
        tops = scored.top or [{}] * len(scored.token_logprobs)
        for token, logprob, rank, top in zip(prompt_ids[1:], scored.token_logprobs, scored.ranks, tops, strict=True):
            ranked = {t: (v, r) for r, (t, v) in enumerate(sorted(top.items(), key=lambda kv: -kv[1]), start=1)}
            ranked[token] = (logprob, rank)
            entries.append({str(t): {"logprob": _clean_logprob(v), "rank": r, "decoded_token": self.token_text(t)}
                            for t, (v, r) in ranked.items()})
        return entries

    def echoed(self, choice: Json, prompt_ids: Sequence[int], scored: PromptLogprobs | None, completion: bool) -> Json:
        """``choice`` with the prompt in front (OpenAI's ``echo``): its text, and its tokens' logprobs (None for the
        first) before the completion's. ``completion`` False: max_tokens 0, the prompt alone."""
        prompt_text = self._tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
        echoed = {**choice, "text": prompt_text + (choice["text"] if completion else "")}
        if not completion:
            echoed["finish_reason"], echoed["stop_reason"] = "length", None
        if choice["logprobs"] is None or scored is None:
            return echoed
        tops = scored.top or [None] * len(scored.ranks)
        tokens = [TokenLogprob(t, v, None if top is None else {**top, t: v})  # the top k and the prompt's token
                  for t, v, top in zip(prompt_ids[1:], scored.token_logprobs, tops, strict=True)]
        head = self._logprobs(tokens)
        first = self.token_text(prompt_ids[0])
        head = {"tokens": [first, *head["tokens"]], "token_logprobs": [None, *head["token_logprobs"]],
                "top_logprobs": [None, *head["top_logprobs"]],
                "text_offset": [0, *(len(first) + o for o in head["text_offset"])]}
        if completion:
            tail = choice["logprobs"]
            shift = sum(len(t) for t in head["tokens"])
            head = {"tokens": head["tokens"] + tail["tokens"],
                    "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
                    "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
                    "text_offset": head["text_offset"] + [shift + o for o in tail["text_offset"]]}
        return {**echoed, "logprobs": head}


class ChatFormat(ResponseFormat):
    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, index: int, text: str, tokens: list[TokenLogprob], finish: str | None, stop: Any) -> Json:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(tokens),
            "finish_reason": finish,
            "stop_reason": stop,
        }

    def delta(self, index: int, text: str, tokens: list[TokenLogprob], finish: str | None, stop: Any) -> Json:
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": self._logprobs(tokens),
            "finish_reason": finish,
            "stop_reason": stop,
        }

    def opening_deltas(self, count: int) -> list[dict[str, Any]]:
        # OpenAI's first chunk of each choice carries the role.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(count)]

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
        if self._top_logprobs is None:
            return None
        return {"content": [self._entry(t) for t in tokens]}

    def _entry(self, token: TokenLogprob) -> dict[str, Any]:
        top = sorted((token.top or {}).items(), key=lambda kv: -kv[1])[: self._top_logprobs]
        return {**self._token(token.token_id, token.logprob), "top_logprobs": [self._token(i, v) for i, v in top]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        # A token holding part of a UTF-8 character decodes to U+FFFD: its own bytes are unknown here.
        raw = None if "\ufffd" in text else list(text.encode("utf-8"))
        return {"token": text, "logprob": _clean_logprob(logprob), "bytes": raw}
