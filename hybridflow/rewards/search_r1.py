"""Reward for search-R1 question answering (``data_source`` ``searchR1_nq``, ``searchR1_hotpotqa``,
...), with verl's semantics: exact match of the last ``<answer>...</answer>`` against any of the
golden answers, after the usual QA normalisation (lower case, no punctuation, no articles, single
spaces).

verl's rows (``examples/data_preprocess/preprocess_search_r1_dataset.py``) hold the golden answers
as ``reward_model.ground_truth = {"target": [...]}``; the dataset hands a mapping or list ground
truth to the scorer as its JSON text, so ``golden_answers`` reads that text back (a plain string
is one golden answer).

Scores: ``score`` (1.0) for a match, a quarter of it when the response holds more than
``_MAX_ANSWER_TAGS`` opening or closing answer tags (verl's guard against a response that sprays
tags to hit the answer), ``format_score`` (0.0) for an answer that does not match, 0.0 when the
response has no complete answer tags.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

# verl's search-R1 data sources (verl/utils/reward_score/__init__.py).
DATA_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_MAX_ANSWER_TAGS = 10  # verl's: more tags than this and a right answer earns a quarter


def normalize_answer(text: str) -> str:
    """``"The  Eiffel Tower!"`` -> ``"eiffel tower"``: lower case, punctuation and articles dropped,
    whitespace squeezed (the SQuAD normalisation search-R1 uses)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract_answer(solution_str: str) -> str | None:
    """The text of the last complete ``<answer>...</answer>``, stripped, or ``None``."""
    answers = _ANSWER.findall(solution_str)
    return answers[-1].strip() if answers else None


def golden_answers(ground_truth: Any) -> list[str]:
    """The accepted answers: ``{"target": [...]}`` or a list (as objects or as their JSON text), or
    one plain string."""
    value = ground_truth
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return [ground_truth]
        if not isinstance(value, (dict, list)):
            return [ground_truth]  # "1969" is an answer, not the JSON number 1969
    if isinstance(value, dict):
        if "target" not in value:
            raise ValueError(f"search-R1 ground truth {ground_truth!r} has no 'target' (the golden answers)")
        value = value["target"]
    answers = [value] if isinstance(value, str) else list(value)
    return [str(answer) for answer in answers]


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """Exact match of the response's last answer with any golden answer (see the module docstring)."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    predicted = normalize_answer(answer)
    if not any(normalize_answer(golden) == predicted for golden in golden_answers(ground_truth)):
        return format_score
    tags = max(solution_str.count("<answer>"), solution_str.count("</answer>"))
    return score / 4 if tags > _MAX_ANSWER_TAGS else score
