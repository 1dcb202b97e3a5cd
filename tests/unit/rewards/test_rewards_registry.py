"""Dispatch of the built-in scorers by data_source."""

import pytest

from hybridflow.rewards import arithmetic, calculator, code, colour_square, geo3k, gsm8k, search_r1
from hybridflow.rewards import math as math_reward
from hybridflow.rewards.registry import DEFAULT_SCORERS, UnknownDataSourceError, default_compute_score


def test_the_dispatch_table_maps_each_data_source_to_its_scorer() -> None:
    assert DEFAULT_SCORERS == {
        "hybridflow/arithmetic": arithmetic.compute_score,
        "hybridflow/calculator": calculator.compute_score,
        "hybridflow/code": code.compute_score,
        "hybridflow/colour_square": colour_square.compute_score,
        "hiyouga/geometry3k": geo3k.compute_score,
        "openai/gsm8k": gsm8k.compute_score,
        "lighteval/MATH": math_reward.compute_score,
        "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
        "HuggingFaceH4/MATH-500": math_reward.compute_score,
        "math": math_reward.compute_score,
        **{source: search_r1.compute_score for source in ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa",
                                                          "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
                                                          "searchR1_musique", "searchR1_bamboogle")},
    }


@pytest.mark.parametrize(
    ("data_source", "solution_str", "ground_truth", "expected"),
    [
        ("hybridflow/arithmetic", "12", "12", 1.0),
        ("hybridflow/arithmetic", "The answer is 12", "12", 0.0),
        ("openai/gsm8k", "#### 12", "12", 1.0),
        ("openai/gsm8k", "12", "12", 0.0),
        ("hiyouga/geometry3k", "<think>...</think> \\boxed{\\dfrac{40}{3}}", "\\frac{40}{3}", 1.0),
        (
            "HuggingFaceH4/MATH-500",
            "\\boxed{0.5}",
            "\\frac{1}{2}",
            {"score": 1.0, "acc": True, "pred": "0.5"},
        ),
        ("math", "\\boxed{3}", "4", {"score": 0.0, "acc": False, "pred": "3"}),
        ("searchR1_nq", "<answer>The Eiffel tower</answer>", '{"target": ["Eiffel Tower"]}', 1.0),
    ],
)
def test_default_compute_score_dispatches(
    data_source: str, solution_str: str, ground_truth: str, expected: object
) -> None:
    assert default_compute_score(data_source, solution_str, ground_truth, extra_info={"index": 0}) == expected


def test_an_unknown_data_source_raises_a_key_error_naming_it_and_the_known_ones() -> None:
    with pytest.raises(KeyError) as info:
        default_compute_score("my/dataset", "1", "1")
    assert isinstance(info.value, UnknownDataSourceError)
    message = str(info.value)
    assert "'my/dataset'" in message
    for known in DEFAULT_SCORERS:
        assert known in message
    assert "custom_reward_function" in message
    assert not message.startswith("'")  # reads as a sentence, unlike a plain KeyError
