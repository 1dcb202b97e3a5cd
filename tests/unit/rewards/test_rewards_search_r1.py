"""search-R1 QA reward (verl's search_r1_like_qa_em): exact match of the last <answer> with any golden
answer after QA normalisation."""

import json

import pytest

from hybridflow.rewards.search_r1 import compute_score, extract_answer, golden_answers, normalize_answer

# verl's row: reward_model.ground_truth = {"target": golden answers}, which the dataset passes as JSON text.
TRUTH = json.dumps({"target": ["Eiffel Tower", "la tour Eiffel"]})


def test_normalize_answer_is_the_qa_normalisation():
    assert normalize_answer("  The Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An   apple, a day") == "apple day"


def test_the_last_complete_answer_counts():
    assert extract_answer("<answer>Paris</answer> no, <answer> Lyon </answer>") == "Lyon"
    assert extract_answer("<answer>Paris") is None
    assert extract_answer("no tags") is None


@pytest.mark.parametrize(("truth", "expected"), [
    (TRUTH, ["Eiffel Tower", "la tour Eiffel"]),
    ({"target": ["a", "b"]}, ["a", "b"]),
    (json.dumps(["x", "y"]), ["x", "y"]),
    ("Paris", ["Paris"]),
    ("1969", ["1969"]),
    (json.dumps({"target": "solo"}), ["solo"]),
])
def test_golden_answers_read_verls_ground_truth(truth, expected):
    assert golden_answers(truth) == expected


def test_a_mapping_without_target_is_refused():
    with pytest.raises(ValueError, match="has no 'target'"):
        golden_answers(json.dumps({"answers": ["x"]}))


@pytest.mark.parametrize(("response", "expected"), [
    ("<think>search</think><answer>the eiffel tower</answer>", 1.0),
    ("<answer>La Tour Eiffel.</answer>", 1.0),  # any golden answer
    ("<answer>Louvre</answer>", 0.0),
    ("Eiffel Tower", 0.0),  # no answer tags
    ("<answer>x</answer>" * 11 + "<answer>Eiffel Tower</answer>", 0.25),  # sprayed tags: a quarter
])
def test_compute_score(response, expected):
    assert compute_score(response, TRUTH) == expected
