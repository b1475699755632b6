"""packing.plan_vision: packs whose vision patches sit near their mean (issue 40 item 6), held to its one-sample-at-
a-time reference and to plan_packs' invariants: every document placed once, capacity and max_segments kept,
deterministic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.packing import _vision_reference, plan_groups, plan_packs, plan_vision


@st.composite
def vision_workloads(draw):
    """(lengths, patches, capacity, max_segments): about half the documents carry images."""
    capacity = draw(st.integers(4, 80))
    n = draw(st.integers(0, 60))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=n, max_size=n))
    patches = draw(st.lists(st.one_of(st.just(0), st.integers(1, 400)), min_size=n, max_size=n))
    max_segments = draw(st.one_of(st.none(), st.integers(1, 6)))
    return np.array(lengths, dtype=np.int64), np.array(patches, dtype=np.int64), capacity, max_segments


@given(workload=vision_workloads())
@settings(max_examples=150, deadline=None)
def test_every_document_once_within_capacity_and_as_the_reference_places_it(workload):
    lengths, patches, capacity, max_segments = workload
    plan = plan_vision(lengths, patches, capacity, max_segments)
    plan.validate(lengths, capacity, max_segments)
    reference = _vision_reference(lengths, patches, capacity, max_segments)
    reference.validate(lengths, capacity, max_segments)
    # The pictures go by one rule in both; text documents tie between packs of the same room and segments,
    # which the histogram and the reference break differently: the packs' patches agree exactly, their
    # tokens as a multiset.
    assert plan.n_packs == reference.n_packs
    assert plan.pack_lengths(patches).tolist() == reference.pack_lengths(patches).tolist()
    assert sorted(plan.pack_lengths(lengths).tolist()) == sorted(reference.pack_lengths(lengths).tolist())
    again = plan_vision(lengths, patches, capacity, max_segments)
    assert again.members.tolist() == plan.members.tolist() and again.offsets.tolist() == plan.offsets.tolist()


@given(workload=vision_workloads(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_plan_packs_with_patches_balances_then_shuffles_whole_packs(workload, seed):
    lengths, patches, capacity, max_segments = workload
    balanced = plan_vision(lengths, patches, capacity, max_segments)
    for strategy in ("bfd", "ffd", "histogram"):
        plan = plan_packs(lengths, capacity, strategy, seed=seed, max_segments=max_segments, patches=patches)
        plan.validate(lengths, capacity, max_segments)
        assert sorted(map(tuple, (plan.pack(p) for p in range(plan.n_packs)))) == sorted(
            map(tuple, (balanced.pack(p) for p in range(balanced.n_packs)))
        )
    # sequential keeps its order and pad its one document a row: patches change nothing there
    for strategy in ("sequential", "pad"):
        plain = plan_packs(lengths, capacity, strategy, max_segments=max_segments)
        plan = plan_packs(lengths, capacity, strategy, max_segments=max_segments, patches=patches)
        assert plan.members.tolist() == plain.members.tolist() and plan.offsets.tolist() == plain.offsets.tolist()


def test_group_by_balances_each_group_apart():
    lengths, patches = np.array([4, 4, 4, 4, 3, 3]), np.array([8, 8, 0, 0, 5, 0])
    groups = np.array(["a", "a", "a", "a", "b", "b"])
    plan = plan_groups(lengths, groups, 8, shuffle=False, patches=patches)
    assert [plan.pack(p).tolist() for p in range(plan.n_packs)] == [[0, 2], [1, 3], [4, 5]]


def test_the_docstring_example():
    plan = plan_vision(np.array([4, 4, 4, 4]), np.array([8, 8, 0, 0]), 8)
    assert [plan.pack(p).tolist() for p in range(plan.n_packs)] == [[0, 2], [1, 3]]
    bfd = plan_packs([4, 4, 4, 4], 8, shuffle=False)
    assert sorted(bfd.pack_lengths(np.array([8, 8, 0, 0])).tolist()) == [0, 16]


def mixed_build(seed: int, capacity: int, image_counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Documents of 50-1,500 text tokens with a count of images drawn from `image_counts`, 64-1,024 tokens
    each (4 patches a token: Qwen-VL's merge size 2)."""
    rng = np.random.default_rng(seed)
    n = 20_000
    images = rng.choice(image_counts, n)
    per_image = rng.integers(64, 1024, (n, max(image_counts)))
    image_tokens = (per_image * (np.arange(max(image_counts))[None, :] < images[:, None])).sum(axis=1)
    lengths = np.minimum(rng.integers(50, 1500, n) + image_tokens, capacity)
    return lengths, image_tokens * 4


@pytest.mark.parametrize(
    ("image_counts", "capacity", "cv_at_most", "extra_packs_at_most"),
    [
        ([0, 0, 1, 1, 2, 4, 8], 8192, 0.07, 0.003),  # text and image documents mixed
        ([0, 1, 1, 1, 2], 8192, 0.04, 0.001),
        ([0, 0, 0, 0, 1], 8192, 0.02, 0.0),  # a few pictures among much text
        ([0, 0, 1, 1, 2, 4, 8], 32768, 0.01, 0.0),
        ([1, 1, 2, 3], 8192, 0.12, 0.025),  # every document has a picture: the least room to balance in
    ],
)
def test_the_spread_of_patches_falls_at_the_stated_cost_in_packs(
    image_counts, capacity, cv_at_most, extra_packs_at_most
):
    """The numbers docs/config.md states for packing.balance_vision (20,000 documents each)."""
    lengths, patches = mixed_build(0, capacity, image_counts)
    by_tokens = plan_packs(lengths, capacity, shuffle=False)
    balanced = plan_packs(lengths, capacity, shuffle=False, patches=patches)
    balanced.validate(lengths, capacity)
    before, after = by_tokens.pack_lengths(patches), balanced.pack_lengths(patches)
    assert after.std() / after.mean() <= cv_at_most < before.std() / before.mean()
    assert balanced.n_packs <= by_tokens.n_packs * (1 + extra_packs_at_most)


def test_patches_must_match_the_documents():
    with pytest.raises(ValueError, match="2 patch counts for 3 samples"):
        plan_vision(np.array([1, 2, 3]), np.array([0, 1]), 4)
    with pytest.raises(ValueError, match="negative patches"):
        plan_vision(np.array([1, 2]), np.array([0, -1]), 4)
