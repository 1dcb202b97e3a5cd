"""Online DPO's pairs from scored samples (``select_preference_pairs``) and their layout over ranks
(``pair_rows_by_rank``), with hand-worked expected rows."""

import pytest
import torch

from hybridflow.algorithms.preference import PairLayout, PreferencePairs, pair_rows_by_rank, select_preference_pairs


def pairs_of(scores, groups, **kwargs) -> PreferencePairs:
    return select_preference_pairs(torch.tensor(scores, dtype=torch.float32), torch.tensor(groups), **kwargs)


def as_lists(p: PreferencePairs) -> list[tuple[int, int]]:
    return list(zip(p.chosen.tolist(), p.rejected.tolist(), strict=True))


def test_best_worst_pairs_each_groups_highest_with_its_lowest_and_counts_groups_without_spread():
    # group 0: rows 0-3, best row 2 (0.9), worst row 1 (0.0); group 1: all equal, no pair;
    # group 2: rows 8-11 with a tie for best (rows 8 and 10) and for worst (9 and 11): the first of each.
    scores = [0.5, 0.0, 0.9, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    p = pairs_of(scores, groups)
    assert as_lists(p) == [(2, 1), (8, 9)]
    assert (p.groups, p.groups_without_pair, p.count) == (3, 1, 2)


def test_all_pairs_take_every_two_rows_whose_scores_differ_by_more_than_the_margin():
    scores = [0.0, 1.0, 0.5, 1.0]
    p = pairs_of(scores, [7, 7, 7, 7], selection="all")
    # (0,1) (0,2) (0,3) (1,2) (2,3); (1,3) tie: none. Chosen is the higher score.
    assert as_lists(p) == [(1, 0), (2, 0), (3, 0), (1, 2), (3, 2)]
    p = pairs_of(scores, [7, 7, 7, 7], selection="all", margin=0.5)  # strictly more than 0.5
    assert as_lists(p) == [(1, 0), (3, 0)]
    assert p.groups_without_pair == 0


def test_margin_is_strict_and_a_group_at_the_margin_gives_no_pair():
    p = pairs_of([1.0, 0.5, 0.2, 0.0], [0, 0, 1, 1], margin=0.5)
    assert as_lists(p) == []
    assert (p.groups, p.groups_without_pair) == (2, 2)
    assert p.chosen.dtype == torch.long and p.chosen.shape == (0,)


def test_groups_are_read_by_id_not_by_position():
    # Interleaved groups (a balanced batch): pairs still stay within a group.
    p = pairs_of([0.0, 1.0, 1.0, 0.0], [0, 1, 0, 1])
    assert as_lists(p) == [(2, 0), (1, 3)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(selection="best"), "selection='best'"),
    (dict(margin=-0.1), "margin=-0.1"),
])
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pairs_of([0.0, 1.0], [0, 0], **kwargs)


def test_rank_layout_gives_each_rank_its_pairs_chosen_rows_first_and_pads_a_short_share():
    p = PreferencePairs(torch.tensor([0, 4, 8]), torch.tensor([1, 5, 9]), groups=3, groups_without_pair=0)
    assert pair_rows_by_rank(p, 1) == PairLayout([0, 4, 8, 1, 5, 9], [0, 1, 2, 3, 4, 5])
    # Two ranks: two pairs each, the second rank's short share filled with a copy of its last pair at
    # PADDING_POSITION (-1), which the loss weighs 0: every pair is trained.
    assert pair_rows_by_rank(p, 2) == PairLayout([0, 4, 1, 5, 8, 8, 9, 9], [0, 1, 2, 3, 0, -1, 2, -1])
    # More ranks than pairs: a rank without a pair of its own trains a copy of the first, weighing nothing.
    assert pair_rows_by_rank(p, 4) == PairLayout([0, 1, 4, 5, 8, 9, 0, 1], [0, 1, 0, 1, 0, 1, -1, -1])
    assert pair_rows_by_rank(PreferencePairs(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long),
                                             groups=2, groups_without_pair=2), 2) == PairLayout([], [])
    with pytest.raises(ValueError, match="ranks=0"):
        pair_rows_by_rank(p, 0)
