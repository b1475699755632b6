"""Planning multi-segment items: an item's segments stay together, in order, in one pack."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtool.packing import PackPlan
from packtool.packing_items import ItemPlan, item_lengths, plan_items, validate_item_plan

CAPACITY = 64


def test_docstring_example():
    plan = plan_items([4, 3, 5, 2, 2, 2], [0, 2, 3, 6], 10, shuffle=False)
    assert plan.items.members.tolist() == [0, 2, 1] and plan.items.offsets.tolist() == [0, 1, 2, 3]
    assert plan.segments.members.tolist() == [0, 1, 3, 4, 5, 2]
    assert plan.segments.offsets.tolist() == [0, 2, 5, 6]
    assert item_lengths([4, 3, 5, 2, 2, 2], [0, 2, 3, 6]).tolist() == [7, 5, 6]


@st.composite
def items(draw):
    """Items of 1 (SFT), 2 (pairs) or up to 6 (groups) segments whose total fits CAPACITY."""
    sizes = draw(st.lists(st.sampled_from([1, 2, 2, 2, 3, 6]), min_size=0, max_size=40))
    lengths: list[int] = []
    for size in sizes:
        budget = CAPACITY // size
        lengths += draw(st.lists(st.integers(1, budget), min_size=size, max_size=size))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return np.asarray(lengths, dtype=np.int64), offsets


@given(
    items(),
    st.sampled_from(["bfd", "ffd", "histogram", "sequential", "pad"]),
    st.sampled_from([None, 6, 7, 12]),
    st.booleans(),
)
def test_members_contiguous_every_segment_once_packs_within_limits(data, strategy, max_segments, grouped):
    lengths, offsets = data
    labels = np.arange(offsets.size - 1) % 3 if grouped else None  # e.g. three sources under group_by
    plan = plan_items(lengths, offsets, CAPACITY, strategy, seed=3, max_segments=max_segments, groups=labels)
    validate_item_plan(plan, lengths, offsets, CAPACITY, max_segments)  # the contract, checked as a whole
    # and its parts, spelled out independently of validate_item_plan:
    assert sorted(plan.segments.members.tolist()) == list(range(lengths.size))
    assert np.all(plan.segments.pack_lengths(lengths) <= CAPACITY)
    if max_segments is not None:
        assert np.all(plan.segments.segments() <= max_segments)
    for p in range(plan.segments.n_packs):
        members = plan.segments.pack(p).tolist()
        for i in plan.items.pack(p).tolist():
            run = list(range(offsets[i], offsets[i + 1]))
            at = members.index(run[0])
            assert members[at : at + len(run)] == run
        if grouped:
            assert len(set(labels[plan.items.pack(p)].tolist())) == 1


def test_groups_never_share_a_pack():
    lengths = np.array([5, 7, 3, 3, 9, 2, 4, 4, 6, 1])
    offsets = np.array([0, 2, 4, 5, 7, 10])
    labels = np.array(["dpo", "sft", "dpo", "sft", "dpo"])  # per item
    plan = plan_items(lengths, offsets, 32, groups=labels)
    validate_item_plan(plan, lengths, offsets, 32)
    assert sorted(sorted(labels[plan.items.pack(p)].tolist()) for p in range(plan.items.n_packs)) == [
        ["dpo", "dpo", "dpo"],
        ["sft", "sft"],
    ]


def test_seed_only_reorders_packs():
    lengths = np.array([5, 7, 3, 3, 9, 2, 4, 4, 6, 1])
    offsets = np.array([0, 2, 4, 5, 7, 10])
    a = plan_items(lengths, offsets, 16, seed=0)
    b = plan_items(lengths, offsets, 16, seed=1)
    as_sets = lambda plan: sorted(tuple(plan.segments.pack(p).tolist()) for p in range(plan.segments.n_packs))  # noqa: E731
    assert as_sets(a) == as_sets(b)


def test_validate_catches_a_split_item():
    lengths, offsets = np.array([3, 3, 2]), np.array([0, 2, 3])
    torn = ItemPlan(
        items=PackPlan(members=np.array([0, 1]), offsets=np.array([0, 1, 2])),
        segments=PackPlan(members=np.array([0, 2, 1]), offsets=np.array([0, 1, 3])),
    )
    with pytest.raises(ValueError, match="item 0: its segments are not contiguous"):
        validate_item_plan(torn, lengths, offsets, 8)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="item 0 has 3 segments > max_segments 2"):
        plan_items([1, 1, 1], [0, 3], 8, max_segments=2)
    with pytest.raises(ValueError, match="tokens > capacity"):
        plan_items([5, 5], [0, 2], 8)
    with pytest.raises(ValueError, match="item_offsets must run from 0 to 2"):
        plan_items([5, 5], [0, 1], 8)
