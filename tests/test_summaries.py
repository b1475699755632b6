"""packtool.summaries: the numbers of an output's summary, pure and against a plain recount of the shards."""

from __future__ import annotations

import decimal
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtool.errors import PackFormatError, PacktoolError
from packtool.format import Interleaving, read_manifest
from packtool.labels import IGNORE_INDEX
from packtool.summaries import (
    DENSE_TALLY_LIMIT,
    Histogram,
    ImageTally,
    Tally,
    WindowTotals,
    attention_slots,
    interleave_stats,
    length_bin_edges,
    length_summary,
    spread,
    summarize,
    window_mix,
)


# The references: the statistics as numpy computes them from every length kept (what summarize did before it
# kept histograms, issue 43). The histograms' numbers must be these, bit for bit.
def length_summary_of_lengths(values: np.ndarray, capacity: int) -> dict:
    edges = length_bin_edges(capacity)
    bins = np.clip(np.searchsorted(np.asarray(edges), values, side="left") - 1, 0, len(edges) - 1)
    counts = np.bincount(bins, minlength=len(edges))
    p50, p90, p99 = (
        (int(np.percentile(values, q, method="inverted_cdf")) for q in (50, 90, 99)) if len(values) else (0, 0, 0)
    )
    return {
        "count": len(values),
        "mean": round(float(values.mean()), 3) if len(values) else 0.0,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(values.max()) if len(values) else 0,
        "capacity": int(capacity),
        "over_capacity": int(counts[-1]),
        "histogram": {"edges": edges, "counts": counts.tolist()},
    }


def spread_of_values(values: np.ndarray) -> dict:
    """numpy's spread, but for cv: numpy's float sums fall either side of a rounding tie depending on the values'
    order (256 ones among 481 0/1 values, cv exactly 0.9375, read 0.937); here cv is the float nearest its exact
    value, rounded as before."""
    if not len(values):
        return {"mean": 0.0, "min": 0, "p50": 0, "p90": 0, "max": 0, "cv": 0.0}
    mean = float(values.mean())
    return {
        "mean": round(mean, 3),
        "min": int(values.min()),
        "p50": int(np.percentile(values, 50, method="inverted_cdf")),
        "p90": int(np.percentile(values, 90, method="inverted_cdf")),
        "max": int(values.max()),
        "cv": round(exact_cv(values), 3) if mean else 0.0,
    }


def exact_cv(values: np.ndarray) -> float:
    """std / mean = sqrt(n S2 - S1^2) / S1, to the float nearest it (60 digits, then one rounding)."""
    n, s1, s2 = len(values), int(values.sum()), sum(int(v) ** 2 for v in values)
    with decimal.localcontext(decimal.Context(prec=60)):
        return float(decimal.Decimal(n * s2 - s1 * s1).sqrt() / decimal.Decimal(s1))


def attention_slots_of_lengths(lengths: np.ndarray, pack_lengths: np.ndarray) -> dict:
    longest = int(lengths.max()) if len(lengths) else 0
    return {
        "token_slots_padded": len(lengths) * longest,
        "token_slots_packed": int(lengths.sum()),
        "score_slots_padded": len(lengths) * longest**2,
        "score_slots_packed": int((lengths**2).sum()),
        "score_slots_flat": int((pack_lengths**2).sum()),
        "causal_pairs": int((lengths * (lengths + 1) // 2).sum()),
        "causal_pairs_flat": int((pack_lengths * (pack_lengths + 1) // 2).sum()),
    }


IMAGE_SCHEMA = pa.schema([("image_spans", pa.list_(pa.int32())), ("image_documents", pa.list_(pa.int32()))])
lengths_lists = st.lists(st.integers(1, 600), max_size=120)


@given(st.lists(lengths_lists, max_size=4), st.integers(1, 700))
def test_histograms_give_the_statistics_of_the_lengths_they_counted(shards, capacity):
    """Lengths counted shard by shard into a Histogram: the same summary, spread and slots as every length kept."""
    counted = Histogram()
    for shard in shards:
        counted.add(np.array(shard, dtype=np.int64))
    lengths = np.array([n for shard in shards for n in shard], dtype=np.int64)
    tally = counted.tally()
    assert tally.n == len(lengths) and counted.counts.sum() == len(lengths)
    assert length_summary(tally, capacity) == length_summary_of_lengths(lengths, capacity)
    assert length_summary(lengths, capacity) == length_summary_of_lengths(lengths, capacity)
    assert spread(tally) == spread_of_values(lengths)
    packs = lengths[::3] * 2
    assert attention_slots(tally, Tally.of(packs)) == attention_slots_of_lengths(lengths, packs)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=300))
def test_percentiles_and_spread_fall_as_numpys_at_every_count(values):
    """inverted_cdf's position is taken in floating point (n * 0.9 - 1 may land just above an integer):
    the tally's must land the same for every count; cv is numpy's to its last rounding."""
    array = np.array(values, dtype=np.int64)
    tally = Tally.of(array)
    for p in (1, 10, 33, 50, 90, 99, 100):
        assert tally.percentile(p) == int(np.percentile(array, p, method="inverted_cdf")), p
    assert spread(tally) == spread_of_values(array)
    assert abs(spread(tally)["cv"] - round(float(array.std()) / max(float(array.mean()), 1e-300), 3)) <= 0.001


def test_lengths_past_the_dense_limit_are_tallied_sorted():
    lengths = np.array([3, DENSE_TALLY_LIMIT + 5, 3, 70, DENSE_TALLY_LIMIT * 4], dtype=np.int64)
    assert Tally.of(lengths).values.tolist() == [3, 70, DENSE_TALLY_LIMIT + 5, DENSE_TALLY_LIMIT * 4]
    assert length_summary(lengths, 64) == length_summary_of_lengths(lengths, 64)
    assert spread(lengths) == spread_of_values(lengths)


def test_image_spans_outside_their_pack_are_a_damaged_shard(tmp_path):
    """Image tokens are counted by value: a span that is negative or runs past its pack is one line, never a
    histogram the size of the bad number."""
    good = {"image_spans": [[1, 3], []], "image_documents": [[0], []]}
    for spans in ([[3, 1], []], [[-2, 3], []], [[1, 2**30], []]):
        table = pa.table({**good, "image_spans": spans}, schema=IMAGE_SCHEMA)
        with pytest.raises(PackFormatError, match="an image span is not inside its pack"):
            ImageTally().add(tmp_path / "s.parquet", table, np.array([8, 4]), np.array([1, 1]), ["a"], np.zeros(2))
    tally = ImageTally()
    tally.add(
        tmp_path / "s.parquet",
        pa.table(good, schema=IMAGE_SCHEMA),
        np.array([8, 4]),
        np.array([1, 1]),
        ["a"],
        np.zeros(2),
    )
    assert tally.as_dict()["image_tokens"] == 2 and tally.as_dict()["sources"]["a"]["images_per_document"]["max"] == 1


def test_cv_is_numpys_with_exact_sums():
    ones = np.array([0] * 225 + [1] * 256)  # cv exactly 0.9375: numpy's float sums read 0.93749999...
    assert round(float(ones.std()) / float(ones.mean()), 3) == 0.937
    assert spread(Tally.of(ones))["cv"] == round(exact_cv(ones), 3) == 0.938
    assert spread(np.array([79, 81]))["cv"] == 0.013  # 1 / 80: the float above 0.0125, as numpy's


@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50), st.integers(0, 50)), min_size=1, max_size=6),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 5),
    st.integers(1, 7),
    st.sampled_from(["samples", "tokens", "target_tokens"]),
)
def test_window_totals_measure_the_mix_as_the_amounts_of_every_pack(packs, window, per_shard, unit):
    """Documents (source, tokens, targets) of packs in order, added shard by shard (`per_shard` packs each): the
    same interleave block as window_mix over the [packs, sources] amounts."""
    names = ["s0", "s1", "s2", "s3"]
    interleave = Interleaving(window, 0.1, unit)
    totals = WindowTotals(interleave)
    for first in range(0, len(packs), per_shard):
        shard = packs[first : first + per_shard]
        pack = np.array([first + p for p, documents in enumerate(shard) for _ in documents], dtype=np.int64)
        source, tokens, targets = (np.array([d[i] for documents in shard for d in documents]) for i in range(3))
        met = list(dict.fromkeys(names[s] for s in source))  # the shard's own codes, by order of meeting
        codes = np.array([met.index(names[s]) for s in source], dtype=np.int64)
        totals.add(pack, met, codes, tokens, np.minimum(targets, tokens))
    seen = sorted({names[d[0]] for documents in packs for d in documents})
    amounts = np.zeros((len(packs), len(seen)), dtype=np.int64)
    for p, documents in enumerate(packs):
        for s, n, t in documents:
            amounts[p, seen.index(names[s])] += {"samples": 1, "tokens": n, "target_tokens": min(t, n)}[unit]
    assert totals.stats(len(packs)) == interleave_stats(seen, window_mix(amounts, window), len(packs), interleave)


def test_length_summary_worked_example():
    summary = length_summary(np.array([3, 4, 64, 70]), 64)
    assert summary["count"] == 4
    assert summary["mean"] == 35.25
    assert (summary["p50"], summary["p90"], summary["p99"], summary["max"]) == (4, 70, 70, 70)
    assert summary["over_capacity"] == 1
    assert summary["histogram"]["edges"] == list(range(0, 65, 4))
    assert summary["histogram"]["counts"] == [2] + [0] * 14 + [1, 1]


def test_length_summary_of_nothing_and_tiny_capacity():
    empty = length_summary(np.zeros(0, dtype=np.int64), 8)
    assert empty["count"] == 0 and empty["max"] == 0 and sum(empty["histogram"]["counts"]) == 0
    assert length_bin_edges(3) == [0, 1, 2, 3]
    with pytest.raises(PacktoolError, match="capacity 0 must be a positive"):
        length_summary(np.array([1]), 0)


@given(st.lists(st.integers(0, 5000), max_size=200), st.integers(1, 3000))
def test_length_summary_counts_every_length_once(lengths, capacity):
    summary = length_summary(np.array(lengths, dtype=np.int64), capacity)
    counts, edges = summary["histogram"]["counts"], summary["histogram"]["edges"]
    assert sum(counts) == summary["count"] == len(lengths)
    assert summary["over_capacity"] == counts[-1] == sum(n > capacity for n in lengths)
    assert len(counts) == len(edges) and edges[-1] == capacity
    for i in range(1, len(edges)):  # each bin holds exactly the lengths in (edges[i-1], edges[i]] (bin 0 takes 0)
        assert counts[i - 1] == sum(edges[i - 1] < n <= edges[i] or (i == 1 and n == 0) for n in lengths)
    if lengths:
        assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"] == max(lengths)
        assert summary["p50"] in lengths


def test_attention_slots_on_3_2_4():
    one_pack = attention_slots(np.array([3, 2, 4]), np.array([9]))
    assert (one_pack["token_slots_padded"], one_pack["token_slots_packed"]) == (12, 9)
    assert (one_pack["score_slots_padded"], one_pack["score_slots_packed"], one_pack["score_slots_flat"]) == (
        48,
        29,
        81,
    )
    assert (one_pack["causal_pairs"], one_pack["causal_pairs_flat"]) == (19, 45)
    two_packs = attention_slots(np.array([3, 2, 4]), np.array([5, 4]))  # [3, 2] and [4]
    assert (two_packs["score_slots_flat"], two_packs["causal_pairs_flat"]) == (41, 25)
    assert two_packs["score_slots_packed"] == one_pack["score_slots_packed"]


def test_summarize_equals_a_pack_by_pack_recount(quickstart_build):
    """The vectorized summary against the plainest reading of the shards: one pack, one document at a time."""
    manifest = read_manifest(quickstart_build)
    shards = [entry.file for entry in manifest.shards]
    packs = tokens = targets = 0
    per_source: dict[str, list[int]] = {}
    segments_per_pack, segment_lengths, pack_lengths, document_lengths = [], [], [], {}
    for shard in shards:
        for pack in pq.ParquetFile(shard).read().to_pylist():
            packs += 1
            tokens += len(pack["labels"])
            pack_lengths.append(len(pack["labels"]))
            targets += sum(label != IGNORE_INDEX for label in pack["labels"])
            docs, attention = pack["doc_cu_seqlens"], pack["cu_seqlens"]
            segments_per_pack.append(len(docs) - 1)
            segment_lengths += [b - a for a, b in pairwise(attention)]
            for d, source in enumerate(pack["sources"]):
                labels = pack["labels"][docs[d] : docs[d + 1]]
                entry = per_source.setdefault(source, [0, 0, 0, 0])
                entry[0] += 1
                entry[1] += len(labels)
                entry[2] += sum(label != IGNORE_INDEX for label in labels)
                entry[3] += pack["sample_repeats"][d] > 0
                document_lengths.setdefault(source, []).append(len(labels))
    assert len(per_source) == 3 and len(shards) > 1

    stats = summarize(shards, manifest)
    assert (stats["packs"], stats["tokens"], stats["targets"]) == (packs, tokens, targets)
    assert stats["segments_per_pack"]["histogram"] == np.bincount(segments_per_pack).tolist()
    assert stats["attention"] == attention_slots(np.array(segment_lengths), np.array(pack_lengths))
    assert stats["pack_fill"] == length_summary(np.array(pack_lengths), manifest.capacity)
    for source, (segments, source_tokens, source_targets, repeats) in per_source.items():
        entry = stats["sources"][source]
        assert (entry["segments"], entry["tokens"], entry["targets"], entry["repeats"]) == (
            segments,
            source_tokens,
            source_targets,
            repeats,
        )
        assert entry["segment_lengths"] == length_summary(np.array(document_lengths[source]), manifest.capacity)
