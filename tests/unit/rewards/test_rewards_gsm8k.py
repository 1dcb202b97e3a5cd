"""GSM8K scoring with verl's semantics: '#### <number>' in the last 300 characters."""

import pytest

from hybridflow.rewards.gsm8k import compute_score, extract_solution


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips in May. 48+24 = 72.\n#### 72", "72"),
        ("#### 1,234", "1234"),  # thousands separators removed
        ("#### -5", "-5"),
        ("#### 3.5", "3.5"),
        ("#### 10 then more text #### 12", "12"),  # the last marker wins
        ("The answer is 72", None),  # no marker: strict finds nothing
        ("####72", None),  # the marker needs its space
        ("#### $18", None),  # as in verl, a currency sign after the marker is not a number
    ],
)
def test_gsm8k_strict_extraction(response: str, expected: str | None) -> None:
    assert extract_solution(response, "strict") == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("The answer is 72.", "72"),  # the sentence's final "." is not a number
        ("3 apples and 4 pears, so 1,200 in total", "1200"),
        ("#### 72", "72"),
        ("Costs -3 dollars", "-3"),
        ("no digits at all.", None),
    ],
)
def test_gsm8k_flexible_extraction_takes_the_last_number(response: str, expected: str | None) -> None:
    assert extract_solution(response, "flexible") == expected


def test_gsm8k_only_the_last_300_characters_are_searched() -> None:
    answer_then_chatter = "#### 72\n" + "x" * 300
    assert extract_solution(answer_then_chatter) is None
    assert extract_solution("x" * 5000 + "#### 72") == "72"


def test_gsm8k_scores_right_wrong_and_missing_answers() -> None:
    assert compute_score("so she has 18 left.\n#### 18", "18") == 1.0
    assert compute_score("#### 1,234", "1,234") == 1.0  # both sides normalised
    assert compute_score("#### 17", "18") == 0.0
    assert compute_score("18", "18") == 0.0  # right number, wrong format: strict says no
    assert compute_score("#### 18.0", "18") == 0.0  # string comparison, as in verl
    assert compute_score("18", "18", method="flexible") == 1.0


def test_gsm8k_format_score_rewards_a_wrong_answer_in_the_right_format_only() -> None:
    assert compute_score("#### 17", "18", format_score=0.1) == 0.1
    assert compute_score("I think 17", "18", format_score=0.1) == 0.0
    assert compute_score("#### 18", "18", format_score=0.1, score=2.0) == 2.0


def test_gsm8k_rejects_an_unknown_method() -> None:
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_solution("#### 1", "loose")  # type: ignore[arg-type]
