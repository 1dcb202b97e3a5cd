"""verl's validation metrics against numbers worked out independently: the same seeded draws,
reduced with plain Python loops (max, min, a Counter vote) instead of the vectorised code."""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np
import pytest

from hybridflow.tracking.validation import bootstrap_indices, compute_val_core_metrics, k_ladder


def draws(n: int, k: int) -> list[list[int]]:
    """verl's bootstrap: np.random.seed(42), then 1000 rows of k positions drawn with replacement."""
    np.random.seed(42)
    return np.random.choice(n, size=(1000, k), replace=True).tolist()


def mean_std(per_draw: list[float]) -> tuple[float, float]:
    return statistics.fmean(per_draw), statistics.pstdev(per_draw)


def vote(values: list[float], preds: list[str], row: list[int]) -> float:
    counts = Counter(preds[i] for i in row)  # Counter keeps first-drawn order among equal counts
    winner = max(counts, key=counts.__getitem__)
    return values[next(i for i in row if preds[i] == winner)]


def test_k_ladder_is_powers_of_two_below_n_then_n():
    assert [k_ladder(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [[], [2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8], [2, 4, 8, 9]]


def test_bootstrap_indices_are_verls_global_seed_draws_without_touching_the_global_rng():
    np.random.seed(7)
    before = np.random.get_state()[1].copy()
    assert bootstrap_indices(5, 3).tolist() == draws(5, 3)
    np.random.seed(7)
    bootstrap_indices(5, 3)
    assert (np.random.get_state()[1] == before).all()


def test_best_worst_mean_std_match_a_hand_bootstrap_and_are_averaged_over_prompts():
    rewards = [0.0, 1.0, 1.0, 0.5, 0.5, 0.5]  # prompt 0: three samples; prompt 1: three equal ones
    got = compute_val_core_metrics(["src"] * 6, [0, 0, 0, 1, 1, 1], {"reward": rewards})

    p0 = rewards[:3]
    assert got["val-core/src/reward/mean@3"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert got["val-aux/src/reward/std@3"] == pytest.approx((statistics.pstdev(p0) + 0.0) / 2)
    for k in (2, 3):
        best = mean_std([max(p0[i] for i in row) for row in draws(3, k)])
        worst = mean_std([min(p0[i] for i in row) for row in draws(3, k)])
        # prompt 1's samples all score 0.5: every draw's best and worst is 0.5, std 0.
        # verl's split: mean/best/maj (std included) of the core variable at the largest N are core
        section = "val-core" if k == 3 else "val-aux"
        assert got[f"{section}/src/reward/best@{k}/mean"] == pytest.approx((best[0] + 0.5) / 2)
        assert got[f"{section}/src/reward/best@{k}/std"] == pytest.approx(best[1] / 2)
        assert got[f"val-aux/src/reward/worst@{k}/mean"] == pytest.approx((worst[0] + 0.5) / 2)
        assert got[f"val-aux/src/reward/worst@{k}/std"] == pytest.approx(worst[1] / 2)
    # the bootstrap is not a no-op: best@2 of {0, 1, 1} is 1 unless both draws hit the 0 (p = 1/9)
    assert 0.85 < got["val-aux/src/reward/best@2/mean"] * 2 - 0.5 < 0.95
    assert not any("maj@" in key for key in got)  # no answers given


def test_maj_at_k_votes_on_the_answers_with_verls_tie_rule():
    values = [1.0, 0.0, 0.0, 1.0]
    preds = ["7", "3", "3", "7"]  # two answers, two samples each: ties are common in the draws
    got = compute_val_core_metrics(["s"] * 4, [0] * 4, {"acc": values}, preds)
    for k in (2, 4):
        expected = mean_std([vote(values, preds, row) for row in draws(4, k)])
        section = "val-core" if k == 4 else "val-aux"
        assert got[f"{section}/s/acc/maj@{k}/mean"] == pytest.approx(expected[0])
        assert got[f"{section}/s/acc/maj@{k}/std"] == pytest.approx(expected[1])


def test_maj_is_the_majority_answers_value_when_one_answer_dominates():
    # Answer "a" (value 1) three times, "b" (value 0) once: a draw of 2 picks "b" only when
    # "b" is drawn first and the second draw ties it with "a", or both draws are "b".
    values, preds = [1.0, 1.0, 1.0, 0.0], ["a", "a", "a", "b"]
    got = compute_val_core_metrics(["s"] * 4, [0] * 4, {"acc": values}, preds)
    rows = draws(4, 2)
    b_first = sum(1 for row in rows if preds[row[0]] == "b")
    assert got["val-aux/s/acc/maj@2/mean"] == pytest.approx(1 - b_first / 1000)


def test_core_variable_is_acc_when_the_reward_returned_one_else_reward():
    with_acc = compute_val_core_metrics(["s", "s"], [0, 0], {"reward": [1.0, -1.0], "acc": [1.0, 0.0]})
    assert with_acc["val-core/s/acc/mean@2"] == 0.5
    assert with_acc["val-aux/s/reward/mean@2"] == 0.0
    assert "val-core/s/reward/mean@2" not in with_acc
    plain = compute_val_core_metrics(["s", "s"], [0, 0], {"reward": [1.0, 0.0]})
    assert plain["val-core/s/reward/mean@2"] == 0.5


def test_one_sample_per_prompt_gives_mean_at_1_only_per_data_source():
    got = compute_val_core_metrics(["a", "a", "b"], [0, 1, 2], {"reward": [1.0, 0.0, 0.25]})
    assert got == {"val-core/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 0.25}


def test_maj_needs_an_answer_for_every_sample_of_the_prompt():
    got = compute_val_core_metrics(["s"] * 4, [0, 0, 1, 1], {"reward": [1.0, 0.0, 1.0, 0.0]},
                                   ["1", None, "1", "2"])
    # only prompt 1 votes, so maj@2 is its value alone
    expected = mean_std([vote([1.0, 0.0], ["1", "2"], row) for row in draws(2, 2)])
    assert got["val-core/s/reward/maj@2/mean"] == pytest.approx(expected[0])


def test_misaligned_inputs_and_mixed_sources_are_rejected():
    with pytest.raises(ValueError, match="one entry per sample"):
        compute_val_core_metrics(["s"], [0, 0], {"reward": [1.0, 0.0]})
    with pytest.raises(ValueError, match="data sources"):
        compute_val_core_metrics(["a", "b"], [0, 0], {"reward": [1.0, 0.0]})
