"""Emit lays a shard's packs end to end at once; each pack is what its samples give packed alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from packtool.builder.emit import _packed, _Segments
from packtool.builder.store import SINGLE
from packtool.format import SCHEMA_VERSION, WHOLE
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths, labels_for
from packtool.packing import PackPlan


class FakeGather:
    """The segments of a folder of `samples`, as _Gather.segments gives them."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]]):
        self.samples = samples
        self.plan = SimpleNamespace(schema_version=SCHEMA_VERSION, vision=None)

    def segments(self, ks: np.ndarray) -> _Segments:
        picked = [self.samples[k] for k in ks.tolist()]
        return _Segments(
            lengths=np.array([len(ids) for ids, _ in picked], dtype=np.int64),
            input_ids=np.concatenate([ids for ids, _ in picked]),
            targets=np.concatenate([targets for _, targets in picked]),
            roles=np.zeros(sum(len(ids) for ids, _ in picked), dtype=np.int8),
            example_ids=[f"s{k}" for k in ks.tolist()],
            sample_hashes=[f"h{k}" for k in ks.tolist()],
            sources=["chat"] * len(ks),
            repeats=np.zeros(len(ks), dtype=np.int32),
            segment_roles=[SINGLE] * len(ks),
            groups=np.full(len(ks), -1),
            parts=np.tile(np.array([WHOLE, 0], dtype=np.int32), (len(ks), 1)),
            images=[()] * len(ks),
        )


@pytest.mark.parametrize("seed", range(5))
def test_each_pack_of_a_shard_equals_its_samples_packed_alone(seed):
    rng = np.random.default_rng(seed)
    samples = [(rng.integers(0, 500, n).astype(np.int32), rng.random(n) < 0.5) for n in rng.integers(1, 20, size=40)]
    members = rng.permutation(len(samples))
    cuts = np.sort(rng.choice(np.arange(1, len(samples)), size=9, replace=False))
    layout = PackPlan(members=members, offsets=np.array([0, *cuts.tolist(), len(samples)]))
    first, end = 2, 8  # a shard of packs 2..7
    columns = _packed(FakeGather(samples), layout, first, end)
    assert columns.packs == end - first
    for i, p in enumerate(range(first, end)):
        mine = [samples[k] for k in members[layout.offsets[p] : layout.offsets[p + 1]].tolist()]
        ids = np.concatenate([s for s, _ in mine])
        cu = cu_seqlens_from_lengths([len(s) for s, _ in mine])
        a, b = columns.token_offsets[i], columns.token_offsets[i + 1]
        assert np.array_equal(columns.input_ids[a:b], ids)
        labels = columns.labels[a:b]
        assert np.array_equal(labels, labels_for(ids, np.concatenate([t for _, t in mine]), cu))
        assert (labels[cu[:-1]] == IGNORE_INDEX).all()  # every segment start
        c, d = columns.cu_offsets[i], columns.cu_offsets[i + 1]
        assert np.array_equal(columns.cu_seqlens[c:d], cu) and columns.cu_seqlens.dtype == np.int32
        assert np.array_equal(columns.doc_cu_seqlens[c:d], cu)
        docs = columns.sample_ids[columns.document_offsets[i] : columns.document_offsets[i + 1]]
        assert docs == [f"s{k}" for k in members[layout.offsets[p] : layout.offsets[p + 1]].tolist()]
