"""packtool.summaries: the numbers of an output's summary, pure and against a plain recount of the shards."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtool.errors import PacktoolError
from packtool.format import read_manifest
from packtool.labels import IGNORE_INDEX
from packtool.summaries import attention_slots, length_bin_edges, length_summary, summarize


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
