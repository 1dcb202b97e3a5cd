r"""Reward for Geometry3K (``data_source == "hiyouga/geometry3k"``), with verl's semantics.

Geometry3K's answers are short: a number, a fraction, a radical (``2\sqrt{3}``), sometimes with
a degree sign or a unit. ``grade_answer`` says whether a model's answer means the ground truth:
equal after normalising the notation (spaces, ``$``, ``\left``/``\right``, ``\dfrac``, degrees
and unit words), else mathematically equal per math-verify (``\frac{1}{2}`` vs ``0.5``). It
plays the part of the ``mathruler`` grader verl calls, with the same verdicts on these answers.

Two users: ``compute_score`` scores a whole response for the reward (the last ``\boxed{}`` is
the answer; 0.9 for a right answer plus 0.1 for the ``<think>...</think> ... \boxed{}``
format, verl's weights), and the ``calc_geo3k_reward`` tool (``agents/tools.py``) grades the
bare answer the model submits (verl's Geo3kTool: no box needed, no format part).
"""

from __future__ import annotations

import re

from hybridflow.rewards.math import is_equivalent, last_boxed_content

DATA_SOURCE = "hiyouga/geometry3k"

# verl's weight of the format part of the response score.
DEFAULT_FORMAT_SCORE = 0.1

# verl's format: reasoning in <think> tags, then a boxed answer.
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
# Notation that does not change a value: sizing commands, LaTeX spacing, degree marks.
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
# A unit after the number, written as text (Geometry3K's lengths and areas): "5 \text{cm}", "5 units".
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]*\}(\^\{?2\}?)?\s*$")
_WORD_UNIT = re.compile(r"(?<=[0-9}])\s*(?:units?|degrees?|cm|mm|m|in|ft|yd|km)(\^\{?2\}?)?\s*$")


def normalize_answer(answer: str) -> str:
    r"""The answer without notation that does not change its value: ``" $60^{\circ}$ "`` -> ``"60"``."""
    text = answer.strip().strip("$").strip()
    for noise in _NOISE:
        text = text.replace(noise, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _DEGREES.sub("", text)
    text = _TEXT_UNIT.sub("", text).strip()
    text = _WORD_UNIT.sub("", text)
    return re.sub(r"\s+", "", text)


def grade_answer(answer: str | None, ground_truth: str) -> bool:
    """Whether ``answer`` states ``ground_truth``: the same after ``normalize_answer``, or equal
    as mathematics. ``None`` or an empty answer is never right."""
    if answer is None:
        return False
    given, truth = normalize_answer(answer), normalize_answer(str(ground_truth))
    if not given:
        return False
    return given == truth or is_equivalent(given, truth)


def format_reward(solution_str: str) -> float:
    r"""1.0 when the response reasons in ``<think>...</think>`` and then boxes an answer, else 0.0."""
    return 1.0 if _FORMAT.fullmatch(solution_str) else 0.0


def compute_score(
    solution_str: str,
    ground_truth: str,
    use_boxed: bool = True,
    format_score: float = DEFAULT_FORMAT_SCORE,
) -> float:
    r"""``(1 - format_score) * right + format_score * well_formatted``. ``use_boxed``: the answer is
    the last ``\boxed{}`` of the response (the reward); otherwise the whole text is the answer
    (the tool, which also passes ``format_score=0``)."""
    answer = last_boxed_content(solution_str) if use_boxed else solution_str
    right = 1.0 if grade_answer(answer, ground_truth) else 0.0
    return (1.0 - format_score) * right + format_score * format_reward(solution_str)
