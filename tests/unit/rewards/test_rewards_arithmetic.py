"""The arithmetic scorer is strict on purpose: only the bare integer the warm start teaches."""

import pytest

from hybridflow.rewards.arithmetic import compute_score


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("95", "95", 1.0),
        ("  95\n", "95", 1.0),  # surrounding whitespace is not part of the answer
        ("-12", "-12", 1.0),
        ("0", "0", 1.0),
        ("94", "95", 0.0),
        ("12", "-12", 0.0),
        ("-12", "12", 0.0),
        ("95.", "95", 0.0),  # trailing punctuation breaks the taught format
        ("+95", "95", 0.0),
        ("095", "95", 0.0),
        ("95.0", "95", 0.0),
        ("9 5", "95", 0.0),
        ("The answer is 95", "95", 0.0),
        ("95 95", "95", 0.0),
        ("", "95", 0.0),
        ("\u0669\u0665", "95", 0.0),  # Arabic-Indic digits are digits to str.isdigit, not to us
    ],
)
def test_arithmetic_scores_only_the_exact_integer(response: str, ground_truth: str, expected: float) -> None:
    assert compute_score(response, ground_truth) == expected


def test_arithmetic_accepts_an_integer_ground_truth_and_ignores_extra_keywords() -> None:
    assert compute_score("-7", -7, extra_info={"index": 3}) == 1.0
    assert compute_score(" 42 ", " 42") == 1.0


@pytest.mark.parametrize("ground_truth", ["4.5", "abc", "", "1e3", True, 3.0, None])
def test_arithmetic_rejects_a_ground_truth_that_is_not_an_integer(ground_truth: object) -> None:
    with pytest.raises(ValueError, match="arithmetic ground_truth"):
        compute_score("4", ground_truth)  # type: ignore[arg-type]
