r"""Geometry3K grading (verl's geo3k reward and Geo3kTool): notation-blind, value-aware, never right
for an empty or unparseable answer."""

import pytest

from hybridflow.rewards.geo3k import compute_score, grade_answer, normalize_answer


@pytest.mark.parametrize(("answer", "truth"), [
    ("3", "3"),
    ("3.0", "3"),
    (" $60$ ", "60"),
    ("60^{\\circ}", "60"),
    ("60°", "60"),
    ("5 cm", "5"),
    ("5 \\text{units}", "5"),
    ("2\\sqrt3", "2\\sqrt{3}"),
    ("\\dfrac{40}{3}", "\\frac{40}{3}"),
    ("40/3", "\\frac{40}{3}"),
    ("0.5", "\\frac{1}{2}"),
])
def test_the_same_value_in_another_notation_is_right(answer, truth):
    assert grade_answer(answer, truth)


@pytest.mark.parametrize(("answer", "truth"), [
    ("4", "3"),
    ("13.33", "\\frac{40}{3}"),  # a rounding is not the value
    ("3.4641", "2\\sqrt{3}"),
    ("x", "3"),
    ("", "3"),
    ("  $ $ ", "3"),
    ("garbage }{", "3"),
    (None, "3"),
])
def test_another_value_or_no_value_is_wrong(answer, truth):
    assert not grade_answer(answer, truth)


def test_normalize_answer_drops_only_notation():
    assert normalize_answer(" $\\left( 60^{\\circ} \\right)$ ") == "(60)"
    assert normalize_answer("12 \\text{cm}^2") == "12"
    assert normalize_answer("2 \\sqrt { 3 }") == "2\\sqrt{3}"


def test_the_response_score_weighs_answer_and_format_as_verl_does():
    assert compute_score("<think>area</think> so \\boxed{12}", "12") == 1.0
    assert compute_score("so \\boxed{12}", "12") == pytest.approx(0.9)
    assert compute_score("<think>area</think> so \\boxed{13}", "12") == pytest.approx(0.1)
    assert compute_score("<think>area</think> so 12", "12") == 0.0  # no box: no answer, no format
    # The tool's form: the whole text is the answer, nothing for the format.
    assert compute_score("12", "12", use_boxed=False, format_score=0.0) == 1.0
