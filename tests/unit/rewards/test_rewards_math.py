r"""MATH-style scoring: the last \boxed{} (balanced braces) compared with math-verify."""

import threading

import pytest
from math_verify import parse

from hybridflow.rewards.math import compute_score, last_boxed_content


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested groups come out whole
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are literals, not grouping
        ("\\boxed{a_{i_{j}}} end", "a_{i_{j}}"),
        ("first \\boxed{3}, finally \\boxed{4}", "4"),  # the last box is the answer
        ("\\fbox{7}", "7"),
        ("\\boxed 5$ done", "5"),  # brace-less form
        ("\\boxed {6}", "6"),
        ("\\boxed{}", ""),
        ("\\boxed{3} and then \\boxed{\\frac{1}{2", None),  # truncated last box: no answer
        ("the answer is 5", None),
        ("\\boxedsomething{5}", None),  # another command, not a box
    ],
)
def test_last_boxed_content(text: str, expected: str | None) -> None:
    assert last_boxed_content(text) == expected


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("The answer is \\boxed{0.5}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("\\boxed{1+x}", "x+1"),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
        ("\\boxed{2}", "Thus the total is $\\boxed{2}$."),  # a full solution as ground truth
    ],
)
def test_math_accepts_equivalent_answers(response: str, ground_truth: str) -> None:
    result = compute_score(response, ground_truth)
    assert result["score"] == 1.0 and result["acc"] is True
    assert result["pred"] == last_boxed_content(response)


@pytest.mark.parametrize(
    ("response", "ground_truth"),
    [
        ("\\boxed{0.6}", "\\frac{1}{2}"),
        ("\\boxed{x-1}", "x+1"),
        ("first \\boxed{3} then \\boxed{4}", "3"),
    ],
)
def test_math_rejects_different_answers(response: str, ground_truth: str) -> None:
    assert compute_score(response, ground_truth)["score"] == 0.0


def test_math_without_a_box_scores_zero_with_an_empty_prediction() -> None:
    assert compute_score("The answer is 0.5", "0.5") == {"score": 0.0, "acc": False, "pred": ""}
    assert compute_score("\\boxed{ }", "0") == {"score": 0.0, "acc": False, "pred": ""}


def test_math_verify_alone_refuses_to_run_off_the_main_thread() -> None:
    """Why math.py switches math-verify's signal-based timeouts off outside the main thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            parse("$\\frac{1}{2}$")
        except BaseException as error:  # noqa: BLE001 - recorded for the assertion
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ValueError)


def test_math_scores_off_the_main_thread() -> None:
    results: list[dict[str, object]] = []
    thread = threading.Thread(target=lambda: results.append(compute_score("\\boxed{0.5}", "\\frac12")))
    thread.start()
    thread.join()
    assert results == [{"score": 1.0, "acc": True, "pred": "0.5"}]
