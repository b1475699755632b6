"""The pure math of a pack, on the worked example of docs/format.md and as properties."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from packtool.labels import (
    IGNORE_INDEX,
    cu_seqlens_from_lengths,
    labels_for,
    position_ids,
    target_pairs,
)

A0, A1, B0, C0, C1, C2, E = 10, 11, 20, 30, 31, 32, 2


def test_worked_example():
    ids = np.array([A0, A1, E, B0, E, C0, C1, C2, E])
    cu = cu_seqlens_from_lengths([3, 2, 4])
    labels = labels_for(ids, np.ones(9, dtype=bool), cu)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == np.int32
    assert labels.tolist() == [-100, A1, E, -100, E, -100, C1, C2, E]
    assert position_ids(cu).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert int(np.diff(cu).max()) == 4
    # six (context -> next) pairs: a0->a1, a1->E, b0->E, c0->c1, c1->c2, c2->E
    assert target_pairs(labels) == 6
    # no pair predicts the next sample's first token, and every EOS stays a target
    assert labels[3] == IGNORE_INDEX and labels[5] == IGNORE_INDEX
    assert (labels[[2, 4, 8]] == E).all()


def test_prompt_tokens_are_context_not_targets():
    ids = np.array([1, 2, 3, 4, 5])
    targets = np.array([False, False, True, True, True])
    labels = labels_for(ids, targets, cu_seqlens_from_lengths([5]))
    assert labels.tolist() == [-100, -100, 3, 4, 5]


def test_bad_lengths_raise():
    import pytest

    with pytest.raises(ValueError, match="positive"):
        cu_seqlens_from_lengths([3, 0])
    with pytest.raises(ValueError, match="cu_seqlens ends at 4"):
        labels_for(np.arange(5), np.ones(5, bool), np.array([0, 4]))


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=12)


@given(lengths_st, st.data())
def test_label_properties(lengths, data):
    total = sum(lengths)
    ids = np.arange(1000, 1000 + total)
    targets = np.array(data.draw(st.lists(st.booleans(), min_size=total, max_size=total)))
    cu = cu_seqlens_from_lengths(lengths)
    labels = labels_for(ids, targets, cu)
    # cu_seqlens: starts at 0, strictly increasing, ends at the length
    assert cu[0] == 0 and (np.diff(cu) > 0).all() and cu[-1] == total
    # no label across a boundary: every segment start is ignored
    assert (labels[cu[:-1]] == IGNORE_INDEX).all()
    # a label is either the token itself (a target) or ignored
    kept = labels != IGNORE_INDEX
    assert (labels[kept] == ids[kept]).all()
    assert (targets | ~kept).all()
    # the number of target pairs is the targets minus those at segment starts
    assert target_pairs(labels) == int(targets.sum() - targets[cu[:-1]].sum())
    positions = position_ids(cu)
    assert (positions[cu[:-1]] == 0).all()
    assert positions.max() == max(lengths) - 1
