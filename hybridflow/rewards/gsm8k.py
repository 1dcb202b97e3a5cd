"""Reward for GSM8K (``data_source == "openai/gsm8k"``), with verl's semantics.

The prompt asks the model to end with ``#### <answer>``. Two extraction modes:

- ``strict`` (default): the answer is the number after the last ``"#### "`` marker. This also
  checks the format, which is what RL should reinforce.
- ``flexible``: the answer is the last number anywhere in the tail, marker or not (useful to
  measure a model that was not trained on the format). Unlike verl, a trailing ``.``/``,`` is
  dropped first, so "The answer is 72." reads as 72 (verl compares "72." and scores it wrong).

Only the last ``_TAIL_CHARS`` characters are searched, as verl does: the answer is at the end,
and a regular expression over a long, possibly degenerate response would cost time for nothing.
Scores: ``score`` (1.0) when the extracted answer equals the ground truth, ``format_score``
(0.0) when an answer was found but is wrong, and 0.0 when none was found.
"""

from __future__ import annotations

import re
from typing import Any, Literal

DATA_SOURCE = "openai/gsm8k"

_TAIL_CHARS = 300
_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]+")
# Matches of the number pattern that carry no digit are not answers (a lone "-" or ".").
_NOT_A_NUMBER = frozenset({"", ".", ",", "-"})

ExtractionMethod = Literal["strict", "flexible"]


def _normalize(number: str) -> str:
    """Drop thousands separators and a currency sign: ``"$1,234"`` -> ``"1234"``."""
    return number.replace(",", "").replace("$", "").strip()


def extract_solution(solution_str: str, method: ExtractionMethod = "strict") -> str | None:
    """The answer the response gives, normalised, or ``None`` if it gives none.

    Raises:
        ValueError: ``method`` is neither ``"strict"`` nor ``"flexible"``.
    """
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        answers = _STRICT_ANSWER.findall(tail)
        return _normalize(answers[-1]) if answers else None
    if method == "flexible":
        for candidate in reversed(_ANY_NUMBER.findall(tail)):
            candidate = candidate.rstrip(".,")  # sentence punctuation, not part of the number
            if candidate not in _NOT_A_NUMBER:
                return _normalize(candidate)
        return None
    raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: ExtractionMethod = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    **kwargs: Any,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score`` if an answer
    was found but differs, 0.0 if there is none. The comparison is on normalised strings, so
    ``"1,234"`` matches ``"1234"`` but ``"18.0"`` does not match ``"18"`` (verl behaves the same).
    """
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == _normalize(str(ground_truth)) else format_score
