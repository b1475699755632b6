"""Planning multi-segment items: an item's segments stay together, in order, in one pack."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtool.packing import PackPlan
from packtool.packing_items import (
    ItemPlan,
    item_lengths,
    plan_items,
    segment_columns,
    validate_item_plan,
    validate_pack_groups,
)

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


# -- v2 segment columns ---------------------------------------------------------------------------


def test_segment_columns_docstring_example():
    groups, kinds, completion = segment_columns([0, 1, 3, 6], ["single", "pair", "group"])
    assert groups.tolist() == [-1, 1, 1, 2, 2, 2]
    assert kinds.tolist() == [0, 1, 2, 3, 3, 3]
    assert completion.tolist() == [-1, -1, -1, 0, 1, 2]
    with pytest.raises(ValueError, match="item 0 is a pair of 3 segments"):
        segment_columns([0, 3], ["pair"])
    with pytest.raises(ValueError, match="unknown item type 'triple'"):
        segment_columns([0, 3], ["triple"])


def synthetic_items(sizes: list[int], types: list[str], seed: int = 0):
    """Segments as (input_ids, labels): items share a prompt; prompt tokens are -100, answers are targets."""
    rng = np.random.default_rng(seed)
    segments = []
    for size in sizes:
        prompt = rng.integers(10, 99, size=int(rng.integers(1, 6)))
        for _ in range(size):
            answer = rng.integers(10, 99, size=int(rng.integers(1, 6)))
            labels = np.concatenate([np.full(prompt.size, -100), answer])
            segments.append((np.concatenate([prompt, answer]), labels))
    return segments


def pack_columns(segments, members, columns):
    ids = np.concatenate([segments[j][0] for j in members])
    labels = np.concatenate([segments[j][1] for j in members])
    cu = np.concatenate([[0], np.cumsum([len(segments[j][0]) for j in members])])
    return ids, labels, cu, *(c[members] for c in columns)


@given(st.lists(st.sampled_from(["single", "pair", "group"]), min_size=1, max_size=30), st.integers(0, 99))
def test_planned_packs_carry_valid_group_columns(types, seed):
    rng = np.random.default_rng(seed)
    sizes = [{"single": 1, "pair": 2}.get(t, int(rng.integers(1, 5))) for t in types]
    segments = synthetic_items(sizes, types, seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    lengths = np.array([len(s[0]) for s in segments])
    plan = plan_items(lengths, offsets, 48, seed=seed)
    columns = segment_columns(offsets, types)
    for p in range(plan.segments.n_packs):
        validate_pack_groups(*pack_columns(segments, plan.segments.pack(p), columns))


def test_validate_pack_groups_catches_each_violation():
    segments = synthetic_items([2, 3], ["pair", "group"], seed=1)
    columns = segment_columns([0, 2, 5], ["pair", "group"])
    good = pack_columns(segments, np.arange(5), columns)
    validate_pack_groups(*good)
    ids, labels, cu, groups, kinds, completion = good
    with pytest.raises(ValueError, match="group 0: segments \\[0, 2\\] are not contiguous"):
        validate_pack_groups(*pack_columns(segments, np.array([0, 2, 1, 3, 4]), columns))
    with pytest.raises(ValueError, match="group 0: kinds \\[2, 1\\]"):
        validate_pack_groups(ids, labels, cu, groups, kinds[[1, 0, 2, 3, 4]], completion)
    with pytest.raises(ValueError, match="group 1: kinds"):
        validate_pack_groups(ids, labels, cu, groups, kinds, completion[[0, 1, 3, 2, 4]])
    other_prompt = ids.copy()
    other_prompt[cu[1]] += 1  # the rejected segment's first prompt token
    with pytest.raises(ValueError, match="group 0: its segments do not share the same prompt"):
        validate_pack_groups(other_prompt, labels, cu, groups, kinds, completion)
    no_target = labels.copy()
    no_target[cu[4] : cu[5]] = -100
    with pytest.raises(ValueError, match="group 1: segment 4 has no target"):
        validate_pack_groups(ids, no_target, cu, groups, kinds, completion)
    with pytest.raises(ValueError, match="outside any group must have kind single"):
        validate_pack_groups(ids, labels, cu, np.array([-1, -1, 1, 1, 1]), kinds, completion)
