"""Generation dumps: verl's fields, the reward's extras, and the size bound."""

from __future__ import annotations

import json

from hybridflow.tracking.generations import (
    DUMP_MAX_LOGPROBS, clip_text, clip_tokens, clip_value, rollout_rows, validation_rows, version_runs, write_jsonl,
)
from hybridflow.tracking.validation import reward_variables


def test_validation_rows_carry_verls_fields_and_the_rewards_extras(tmp_path):
    rows = validation_rows(
        step=3, inputs=["1+1=", "2+2="], outputs=["2", "5"], ground_truths=["2", "4"], scores=[1.0, 0.0],
        reward_infos=[{"acc": 1.0, "pred": "2"}, {"acc": 0.0, "pred": "5", "score": 9.0}],
        data_sources=["arith", "arith"], max_samples=10, max_chars=100,
    )
    path = write_jsonl(tmp_path / "val", 3, rows)
    assert path.name == "3.jsonl"
    read = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert read[0] == {"input": "1+1=", "output": "2", "gts": "2", "score": 1.0, "step": 3, "data_source": "arith",
                       "acc": 1.0, "pred": "2"}
    assert read[1]["score"] == 0.0  # an extra named like a row field never overwrites it


def test_rollout_rows_are_bounded_in_rows_text_and_logprobs(tmp_path):
    n, long_text = 5, "x" * 50
    rows = rollout_rows(
        step=1, prompts=[long_text] * n, responses=["ok"] * n, ground_truths=[{"tests": ["t"] * 40}] * n,
        scores=[1.0] * n, advantages=[0.5] * n, logprobs=[[-0.123456] * (DUMP_MAX_LOGPROBS + 7)] * n,
        token_texts=[["ab"] * (DUMP_MAX_LOGPROBS + 7)] * n, token_versions=[[2] * (DUMP_MAX_LOGPROBS + 7)] * n,
        reward_infos=[{"pred": "y" * 30}] * n, group_ids=[0, 0, 1, 1, 2], max_samples=3, max_chars=20,
    )
    assert len(rows) == 3
    row = rows[0]
    assert row["prompt"] == "x" * 20 + "…[+30 chars]"
    assert row["response"] == "ok" and row["advantage"] == 0.5 and row["group_id"] == 0 and row["step"] == 1
    assert row["response_tokens"] == DUMP_MAX_LOGPROBS + 7
    assert row["logprobs"] == [-0.1235] * DUMP_MAX_LOGPROBS
    assert row["gts"].startswith('{"tests": ["t", ') and row["gts"].endswith("chars]")  # a long object as clipped JSON
    assert row["pred"] == "y" * 20 + "…[+10 chars]"
    assert row["tokens"] == ["ab"] * 10  # whole tokens, 20 characters in all
    assert row["version_runs"] == [[2, DUMP_MAX_LOGPROBS]]  # the logprobs' tokens, one version
    line = json.dumps(row, ensure_ascii=False)
    # the documented bound: 4 x max_chars + logprobs (+ the JSON quotes and commas of the tokens)
    assert len(line) < 4 * 20 + 100 + 10 * DUMP_MAX_LOGPROBS + 3 * len(row["tokens"])


def test_token_texts_are_dropped_whole_and_stay_aligned_with_the_logprobs():
    assert clip_tokens(["a", "bcd", "ef"], 4) == ["a", "bcd"]  # "ef" would make 6 characters
    assert clip_tokens(["abcdef"], 4) == []  # never a cut token that would misalign its colour
    assert clip_tokens(["x"] * (DUMP_MAX_LOGPROBS + 3), 10_000) == ["x"] * DUMP_MAX_LOGPROBS


def test_version_runs_say_which_policy_version_made_which_tokens():
    assert version_runs([3, 3, 4, 4, 4]) == [[3, 2], [4, 3]]  # a weight update reached it after 2 tokens
    assert version_runs([5, -1, -1, 5]) == [[5, 1], [-1, 2], [5, 1]]  # a tool's tokens in between
    assert version_runs([]) == [] and version_runs(None) is None  # None: the engine records none
    assert version_runs([1] * 3 + [2] * DUMP_MAX_LOGPROBS) == [[1, 3], [2, DUMP_MAX_LOGPROBS - 3]]


def test_clip_keeps_short_values_as_they_are():
    assert clip_text("abc", 3) == "abc"
    assert clip_value({"a": 1}, 100) == {"a": 1}
    assert clip_value(None, 1) is None and clip_value(2.5, 1) == 2.5


def test_reward_variables_are_the_score_and_every_number_a_reward_returned():
    variables, preds = reward_variables([1.0, 0.0, 0.0], [{"acc": 1.0, "pred": "4"}, {}, {"acc": 0.0, "len": 3.0}])
    # the failed sample (no extras) counts 0 like its score; "pred" is the answer, not a variable
    assert variables == {"reward": [1.0, 0.0, 0.0], "acc": [1.0, 0.0, 0.0], "len": [0.0, 0.0, 3.0]}
    assert preds == ["4", None, None]
