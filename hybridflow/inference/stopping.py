"""Stop strings: end a sample when its decoded text contains one of the request's strings.

Token-level stops (EOS, ``stop_token_ids``) are a set lookup in the engine; stop strings need the
text, so they need the tokenizer. Decoding a whole response every step would cost O(length) per
token; only a tail window is decoded instead. The window is the longest stop string's length in
tokens (every token yields at least one character, except special tokens and partial UTF-8 bytes)
plus ``WINDOW_SLACK_TOKENS`` for those. A string is checked after every token, so the first window
that contains it is the one whose newest token completed it.

What the sample keeps (vLLM's behaviour): the response token ids run up to and including the token
that completed the stop string (a token may carry text past it); the decoded text is cut before
the string unless ``include_stop_str_in_output`` (``cut_at_stop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WINDOW_SLACK_TOKENS = 8


class StopStrings:
    """Finds the first of ``stops`` that a response's decoded tail contains."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        if not stops:
            raise ValueError("StopStrings needs at least one stop string")
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._window = max(len(s) for s in stops) + WINDOW_SLACK_TOKENS

    def match(self, response_ids: Sequence[int]) -> str | None:
        """The stop string present in the decoded tail of ``response_ids``, or None."""
        text = self._tokenizer.decode(list(response_ids[-self._window :]), skip_special_tokens=True)
        for stop in self._stops:
            if stop in text:
                return stop
        return None


def cut_at_stop(text: str, stop: str | None, include_stop: bool) -> str:
    """``text`` up to the first occurrence of ``stop`` (kept when ``include_stop``)."""
    if stop is None:
        return text
    at = text.find(stop)
    if at < 0:
        return text
    return text[: at + len(stop)] if include_stop else text[:at]
