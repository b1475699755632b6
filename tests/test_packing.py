"""The pack planner: invariants as properties, the histogram packers against per-sample references, stream mode
in a build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import QUICKSTART, shard_rows

from packtool.builder import build
from packtool.config import load_config
from packtool.labels import IGNORE_INDEX
from packtool.packing import (
    ORDER_PRESERVING,
    PACKERS,
    PackPlan,
    StreamPlan,
    efficiency,
    lower_bound,
    plan_groups,
    plan_packs,
    plan_stream,
)

STRATEGIES = sorted(PACKERS)


@st.composite
def workloads(draw, max_n: int = 60):
    """(lengths, capacity, max_segments) with every sample fitting its capacity."""
    capacity = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, capacity), max_size=max_n))
    max_segments = draw(st.none() | st.integers(1, 6))
    return np.asarray(lengths, dtype=np.int64), capacity, max_segments


def packs_of(plan: PackPlan) -> list[tuple[int, ...]]:
    return [tuple(plan.pack(p).tolist()) for p in range(plan.n_packs)]


# Per-sample references: the textbook loops, one decision per sample, longest first with ties
# by index. `choose` picks among the open packs that fit, each given as (free, segments, index).


def reference(lengths, capacity, max_segments, choose) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    free: list[int] = []
    for i in order:
        fits = [
            (free[p], len(packs[p]), p)
            for p in range(len(packs))
            if free[p] >= lengths[i] and (max_segments is None or len(packs[p]) < max_segments)
        ]
        if fits:
            p = choose(fits)[2]
        else:
            p = len(packs)
            packs.append([])
            free.append(capacity)
        packs[p].append(i)
        free[p] -= lengths[i]
    return packs


def best_fit(fits):
    return min(fits, key=lambda f: (f[0], f[1], f[2]))


def first_fit(fits):
    return min(fits, key=lambda f: f[2])


def worst_fit(fits):
    return min(fits, key=lambda f: (-f[0], f[1], f[2]))


# --- hand-worked examples -------------------------------------------------------------


def test_module_docstring_example_bfd():
    plan = plan_packs([3, 2, 4], 5, shuffle=False)
    assert plan.members.tolist() == [2, 0, 1]
    assert plan.offsets.tolist() == [0, 1, 3]
    assert plan.pack_lengths(np.array([3, 2, 4])).tolist() == [4, 5]
    assert lower_bound([3, 2, 4], 5) == 2
    assert efficiency([3, 2, 4], plan, 5) == pytest.approx(0.9)


def test_module_docstring_example_pad_and_sequential():
    pad = plan_packs([3, 2, 4], 5, "pad", shuffle=False)
    assert packs_of(pad) == [(0,), (1,), (2,)]
    assert efficiency([3, 2, 4], pad, 5) == pytest.approx(0.6)
    assert packs_of(plan_packs([3, 2, 4], 5, "sequential")) == [(0, 1), (2,)]


def test_module_docstring_example_stream():
    plan = plan_stream([3, 2, 4], 4)
    pieces = list(zip(plan.samples.tolist(), plan.starts.tolist(), plan.ends.tolist(), strict=True))
    assert pieces == [(0, 0, 3), (1, 0, 1), (1, 1, 2), (2, 0, 3), (2, 3, 4)]
    assert plan.offsets.tolist() == [0, 2, 4, 5]
    assert plan.window_lengths().tolist() == [4, 4, 1]
    assert plan.last_partial


def test_stream_exact_multiple_has_no_partial_window():
    plan = plan_stream([2, 2, 4], 4)
    assert plan.window_lengths().tolist() == [4, 4]
    assert not plan.last_partial


def test_stream_cuts_a_document_longer_than_capacity():
    plan = plan_stream([10], 4)
    assert plan.starts.tolist() == [0, 4, 8]
    assert plan.ends.tolist() == [4, 8, 10]


def test_max_segments_splits_packs_that_would_fit():
    plan = plan_packs([1, 1, 1, 1, 1], 5, max_segments=2, shuffle=False)
    assert plan.segments().tolist() == [2, 2, 1]


def test_best_fit_fills_the_tightest_pack_worst_fit_the_roomiest():
    lengths = [7, 6, 3, 2, 2]
    # bfd:  7 -> p0 (room 3)   6 -> p1 (4)   3 -> p0 (0)   2 -> p1 (2)   2 -> p1 (0)
    assert packs_of(plan_packs(lengths, 10, "bfd", shuffle=False)) == [(0, 2), (1, 3, 4)]
    # worst fit: 3 -> p1 (room 4 > 3, left 1)   2 -> p0 (1)   the last 2 fits nowhere: p2
    assert packs_of(plan_packs(lengths, 10, "histogram", shuffle=False)) == [(0, 3), (1, 2), (4,)]


def test_ffd_takes_the_earliest_pack_that_fits():
    # Both packs have room 1 after the two 9s; first fit picks pack 0.
    assert packs_of(plan_packs([9, 9, 1], 10, "ffd", shuffle=False)) == [(0, 2), (1,)]


def test_empty_input():
    for strategy in STRATEGIES:
        plan = plan_packs([], 8, strategy)
        assert plan.n_packs == 0
        plan.validate([], 8)
    assert plan_stream([], 8).n_windows == 0
    assert lower_bound([], 8) == 0


# --- errors -------------------------------------------------------------------------------


def test_sample_over_capacity_names_index_length_and_capacity():
    with pytest.raises(ValueError, match=r"sample 1: 9 tokens > capacity 8 \(1 more\); truncate"):
        plan_packs([3, 9, 2, 12], 8)


def test_empty_sample_is_rejected():
    with pytest.raises(ValueError, match=r"sample 2: length 0; every sample needs at least one token"):
        plan_packs([3, 1, 0], 8)


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown packing strategy 'bestfit'; choose one of bfd, ffd"):
        plan_packs([1], 8, "bestfit")


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_limits(bad):
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        plan_packs([1], bad)
    with pytest.raises(ValueError, match="max_segments must be at least 1"):
        plan_packs([1], 8, max_segments=bad)


def test_float_lengths_are_rejected():
    with pytest.raises(ValueError, match="1-D integer array"):
        plan_packs(np.array([1.5, 2.0]), 8)


def test_validate_catches_broken_plans():
    lengths = np.array([3, 2, 4])
    twice = PackPlan(members=np.array([0, 0, 2]), offsets=np.array([0, 2, 3]))
    with pytest.raises(ValueError, match="sample 0 appears in 2 packs"):
        twice.validate(lengths, 5)
    over = PackPlan(members=np.array([0, 2, 1]), offsets=np.array([0, 2, 3]))
    with pytest.raises(ValueError, match="pack 0: 7 tokens > capacity 5"):
        over.validate(lengths, 5)
    crowded = PackPlan(members=np.array([0, 1, 2]), offsets=np.array([0, 2, 3]))
    with pytest.raises(ValueError, match="pack 0: 2 samples > max_segments 1"):
        crowded.validate(lengths, 9, max_segments=1)
    with pytest.raises(ValueError, match="strictly increasing"):
        PackPlan(members=np.array([0, 1]), offsets=np.array([0, 0, 2]))


def test_stream_validate_catches_a_gap():
    lengths = np.array([3, 2])
    gap = StreamPlan(
        samples=np.array([0, 1]),
        starts=np.array([0, 1]),
        ends=np.array([3, 2]),
        offsets=np.array([0, 2]),
        last_partial=True,
    )
    with pytest.raises(ValueError, match="pieces 0 and 1 do not continue the stream"):
        gap.validate(lengths, 8)


# --- properties for every strategy ----------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(workload=workloads(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_every_sample_once_within_limits(strategy, workload, seed):
    lengths, capacity, max_segments = workload
    plan = plan_packs(lengths, capacity, strategy, seed=seed, max_segments=max_segments)
    plan.validate(lengths, capacity, max_segments)
    assert plan.members.dtype == np.int64 and plan.offsets.dtype == np.int64
    assert plan.n_packs >= lower_bound(lengths, capacity)


@pytest.mark.parametrize("strategy", STRATEGIES)
@given(workload=workloads(), seeds=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
@settings(max_examples=40, deadline=None)
def test_same_seed_same_plan_other_seed_only_reorders(strategy, workload, seeds):
    lengths, capacity, max_segments = workload
    first = plan_packs(lengths, capacity, strategy, seed=seeds[0], max_segments=max_segments)
    again = plan_packs(lengths, capacity, strategy, seed=seeds[0], max_segments=max_segments)
    other = plan_packs(lengths, capacity, strategy, seed=seeds[1], max_segments=max_segments)
    assert np.array_equal(first.members, again.members) and np.array_equal(first.offsets, again.offsets)
    assert sorted(packs_of(first)) == sorted(packs_of(other))
    unshuffled = plan_packs(lengths, capacity, strategy, max_segments=max_segments, shuffle=False)
    assert sorted(packs_of(first)) == sorted(packs_of(unshuffled))


@given(workload=workloads())
@settings(max_examples=80, deadline=None)
def test_bfd_matches_reference_pack_count(workload):
    lengths, capacity, max_segments = workload
    plan = plan_packs(lengths, capacity, "bfd", max_segments=max_segments)
    assert plan.n_packs == len(reference(lengths.tolist(), capacity, max_segments, best_fit))


@given(workload=workloads())
@settings(max_examples=80, deadline=None)
def test_ffd_matches_reference_packs_exactly(workload):
    lengths, capacity, max_segments = workload
    plan = plan_packs(lengths, capacity, "ffd", max_segments=max_segments, shuffle=False)
    expected = reference(lengths.tolist(), capacity, max_segments, first_fit)
    assert packs_of(plan) == [tuple(p) for p in expected]


@given(workload=workloads())
@settings(max_examples=80, deadline=None)
def test_histogram_matches_reference_worst_fit_pack_count(workload):
    lengths, capacity, max_segments = workload
    plan = plan_packs(lengths, capacity, "histogram", max_segments=max_segments)
    assert plan.n_packs == len(reference(lengths.tolist(), capacity, max_segments, worst_fit))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_segments", [None, 4])
def test_bfd_matches_reference_on_skewed_lengths(seed, max_segments):
    # Many duplicate lengths exercise the bucket moves that tiny hypothesis inputs rarely reach.
    rng = np.random.default_rng(seed)
    capacity = 128
    lengths = np.clip(rng.lognormal(np.log(20), 1.0, 400).astype(np.int64) + 1, 1, capacity)
    plan = plan_packs(lengths, capacity, max_segments=max_segments)
    plan.validate(lengths, capacity, max_segments)
    assert plan.n_packs == len(reference(lengths.tolist(), capacity, max_segments, best_fit))


@given(workload=workloads(), seed=st.integers(0, 100))
@settings(max_examples=60, deadline=None)
def test_sequential_is_order_preserving_next_fit(workload, seed):
    lengths, capacity, max_segments = workload
    plan = plan_packs(lengths, capacity, "sequential", seed=seed, max_segments=max_segments)
    assert "sequential" in ORDER_PRESERVING
    assert plan.members.tolist() == list(range(lengths.size))
    loads = plan.pack_lengths(lengths)
    # A pack closes only when the next sample would overflow it or it has no segment left.
    for p in range(plan.n_packs - 1):
        next_len = lengths[plan.offsets[p + 1]]
        full = max_segments is not None and plan.segments()[p] == max_segments
        assert full or loads[p] + next_len > capacity


@given(
    lengths=st.lists(st.integers(1, 200), max_size=40),
    capacity=st.integers(1, 64),
)
@settings(max_examples=150, deadline=None)
def test_stream_covers_every_token_once_in_full_windows(lengths, capacity):
    plan = plan_stream(lengths, capacity)
    plan.validate(lengths, capacity)
    # Rebuild the token stream from the pieces: it must be the documents, concatenated.
    tokens = [(s, t) for s, a, b in zip(plan.samples, plan.starts, plan.ends, strict=True) for t in range(a, b)]
    assert tokens == [(s, t) for s, n in enumerate(lengths) for t in range(n)]
    sizes = plan.window_lengths()
    assert all(size == capacity for size in sizes[:-1])
    assert plan.n_windows == lower_bound(lengths, capacity)
    assert plan.last_partial == (sum(lengths) % capacity != 0)


def test_decreasing_packers_reach_the_bound_on_sft_like_lengths():
    rng = np.random.default_rng(0)
    capacity = 2048
    lengths = np.clip(rng.lognormal(np.log(350), 1.0, 50_000).astype(np.int64) + 1, 1, capacity)
    bound = lower_bound(lengths, capacity)
    for strategy in ("bfd", "ffd", "histogram"):
        plan = plan_packs(lengths, capacity, strategy)
        plan.validate(lengths, capacity)
        assert plan.n_packs <= bound * 1.0005, strategy


def test_plan_groups_worked_example_and_no_mixed_packs():
    plan = plan_groups([5, 3, 4, 2], ["a", "b", "a", "b"], 9, shuffle=False)
    assert sorted(sorted(plan.pack(p).tolist()) for p in range(plan.n_packs)) == [[0, 2], [1, 3]]
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, 300)
    groups = rng.choice(["x", "y", "z"], 300)
    shuffled = plan_groups(lengths, groups, 100, seed=7)
    shuffled.validate(lengths, 100)
    assert all(len(set(groups[shuffled.pack(p)].tolist())) == 1 for p in range(shuffled.n_packs))


def test_plan_groups_keeps_sequential_order_inside_each_group():
    plan = plan_groups([3, 3, 3, 3], ["a", "b", "a", "b"], 6, "sequential", seed=3)
    assert [plan.pack(p).tolist() for p in range(plan.n_packs)] == [[0, 2], [1, 3]]


def test_stream_mode_covers_every_token_once_and_says_so(tmp_path, write_config, write_jsonl):
    docs = [{"id": f"d{i}", "text": ("word " * (30 + 17 * i)).strip()} for i in range(12)]
    write_jsonl(docs, "docs.jsonl")
    config = load_config(
        write_config(
            {
                "sources": [{"name": "docs", "path": "docs.jsonl", "format": "text", "fields": {"id": "id"}}],
                "tokenizer": str(QUICKSTART / "tokenizer"),
                "capacity": 128,
                "output": "out",
                "packing": "stream",
            }
        )
    )
    manifest = build(config).manifest
    assert manifest["mode"] == "stream"
    assert manifest["conventions"]["attention"] == "causal_across_documents"
    rows = shard_rows(Path(config.run.output))
    assert all(r["n_tokens"] == 128 for r in rows[:-1])
    assert all(r["cu_seqlens"] == [0, r["n_tokens"]] for r in rows)
    pieces = {}
    for r in rows:
        for sid, a, b in zip(r["sample_ids"], r["doc_cu_seqlens"], r["doc_cu_seqlens"][1:]):
            pieces.setdefault(sid, []).extend(r["input_ids"][a:b])
    assert sorted(pieces) == sorted(d["id"] for d in docs)
    tokens = sum(len(v) for v in pieces.values())
    assert tokens == manifest["stats"]["tokens"]
    assert all(r["labels"][0] == IGNORE_INDEX for r in rows)
