"""The loader's vectorised reading equals a plain reference built pack by pack from `pyarrow.Table.to_pylist`.

`PackedDataset` assembles micro-batches for many rounds at once from decoded row groups
(`collate.assemble`); these tests rebuild every pack and every micro-batch the slow, obvious
way from the plan (`ds.plan()`: which rank reads which pack in which round) and compare all
fields, dtypes included, over shuffles, seeds, ranks, budgets, fixed shape, balance, isolated
documents, schema v2 segment columns and a mid-epoch resume.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from packtool.labels import IGNORE_INDEX  # noqa: E402
from packtool.loader.collate import SEGMENT_COLUMNS, collate  # noqa: E402
from packtool.loader.dataset import PackedDataset, packed_batches  # noqa: E402
from packtool.shards import SegmentColumns  # noqa: E402


def with_segments(packs):
    """Schema v2: random per-segment values on every pack (the loader reads the columns it finds)."""
    rng = np.random.default_rng(7)
    out = []
    for i, pack in enumerate(packs):
        n = len(pack.cu_seqlens) - 1
        segments = SegmentColumns(
            groups=np.where(rng.random(n) < 0.5, i, -1).astype(np.int64),
            kinds=rng.integers(0, 3, n).astype(np.int8),
            completion_index=rng.integers(-1, 4, n).astype(np.int16),
            rewards=np.where(rng.random(n) < 0.5, rng.random(n), np.nan),
            advantages=rng.random(n),
            pieces=rng.integers(-1, 3, n).astype(np.int32),
            piece_offsets=rng.integers(0, 5000, n).astype(np.int32),
        )
        out.append(replace(pack, segments=segments))
    return out


def add_segments(packs):
    packs[:] = with_segments(packs)


def read_rows(path):
    """Every pack of a build by (shard file name, row), as Python lists."""
    rows = {}
    for shard in sorted(path.glob("shard-*.parquet")):
        for row, values in enumerate(pq.read_table(shard).to_pylist()):
            rows[(shard.name, row)] = values
    return rows


def reference_packs(ds, rows):
    """This rank's packs in plan order: (pack columns, round, resume position, closes its round's share)."""
    order, plan = ds.plan()
    mine = plan.positions(ds.rank).tolist()
    out = []
    for k, group in itertools.groupby(mine, key=lambda p: int(plan.round[p - plan.start])):
        group = list(group)
        for j, p in enumerate(group):
            unit = ds.units[int(order.unit[p])]
            name = ds.manifest.shards[unit.shard].file.name
            values = dict(
                rows[(name, unit.first_row + int(order.row[p]))], shard=name, row=unit.first_row + int(order.row[p])
            )
            closes = j == len(group) - 1
            resume = int(plan.bounds[k + 1]) if closes else int(plan.bounds[k])
            out.append((values, k, resume, closes))
    return out


def segments_of(values, ds):
    cu = values["doc_cu_seqlens" if ds.isolate_documents else "cu_seqlens"]
    labels = list(values["labels"])
    if ds.isolate_documents:
        for start in cu[:-1]:
            labels[start] = IGNORE_INDEX
    return cu, labels


def reference_batches(ds, rows):
    """Micro-batches built one token at a time: greedy per round under the budget, fixed shape padded by hand."""
    packs = reference_packs(ds, rows)
    cap = ds.capacity if ds.fixed_shape else None
    per_batch = ds.token_budget // ds.capacity
    batches, current, used = [], [], 0
    for pack in packs:
        size = cap or len(pack[0]["input_ids"])
        if current and used + size > ds.token_budget:
            batches.append(current)
            current, used = [], 0
        current.append(pack)
        used += size
        if pack[3]:  # the round's share ends here
            batches.append(current)
            current, used = [], 0
    return [reference_batch(batch, ds, cap, per_batch - len(batch) if cap else 0) for batch in batches]


def reference_batch(batch, ds, cap, padding_rows):
    ids, labels, positions, cu, kept, seg = [], [], [], [0], [], {c: [] for c in SEGMENT_COLUMNS}
    cost = n_segments = 0

    def segment(token_ids, token_labels, segment_values):
        ids.extend(token_ids)
        labels.extend(token_labels)
        positions.extend(range(len(token_ids)))
        cu.append(cu[-1] + len(token_ids))
        for column, value in segment_values.items():
            seg[column].append(value)

    padding = {column: fill for column, (_, fill, _) in SEGMENT_COLUMNS.items()}
    for values, _, _, _ in batch:
        bounds, pack_labels = segments_of(values, ds)
        for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            segment(
                values["input_ids"][lo:hi], pack_labels[lo:hi], {c: values.get(c, [None] * len(bounds))[s] for c in seg}
            )
            cost += (hi - lo) ** 2
            n_segments += 1
        if cap and len(values["input_ids"]) < cap:
            pad = cap - len(values["input_ids"])
            segment([ds.pad_id] * pad, [IGNORE_INDEX] * pad, padding)
        kept.append(values["pack_hash"])
    for _ in range(padding_rows):
        segment([ds.pad_id] * cap, [IGNORE_INDEX] * cap, padding)
    last = batch[-1]
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": cu,
        "max_seqlen": max(b - a for a, b in itertools.pairwise(cu)),
        "n_targets": sum(label != IGNORE_INDEX for label in labels),
        "n_packs": len(batch),
        "pack_hashes": tuple(kept),
        "step": last[1],
        "resume_after": last[2],
        "n_segments": n_segments,
        "n_padding": len(ids) - sum(len(v["input_ids"]) for v, _, _, _ in batch),
        "attn_cost": cost,
        "segments": seg if "segment_groups" in last[0] else None,
    }


def assert_batch(mb, want):
    for name in ("input_ids", "labels", "position_ids"):
        tensor = getattr(mb, name)
        assert tensor.dtype == torch.int64 and tensor.shape == (1, len(want[name])), name
        assert tensor[0].tolist() == want[name], name
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == want["cu_seqlens"]
    for name in ("max_seqlen", "n_targets", "n_packs", "pack_hashes", "step", "resume_after"):
        assert getattr(mb, name) == want[name], name
    assert (mb.n_segments, mb.n_padding, mb.attn_cost) == (want["n_segments"], want["n_padding"], want["attn_cost"])
    if want["segments"] is None:
        assert mb.segment_groups is None
        return
    for column, (_, _, dtype) in SEGMENT_COLUMNS.items():
        got = getattr(mb, column)
        assert got.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype, column
        np.testing.assert_array_equal(got.numpy(), np.array(want["segments"][column], dtype=dtype), err_msg=column)


BUDGET_SETTINGS = [
    {"token_budget": 64},
    {"token_budget": 100, "shuffle": False},
    {"token_budget": 96, "fixed_shape": True},
    {"token_budget": 64, "balance": "attention", "packs_per_step": 5},
    {"token_budget": 64, "seed": 3},
]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("options", BUDGET_SETTINGS, ids=["budget", "ordered", "fixed", "balanced", "seed"])
def test_micro_batches_equal_the_reference(make_build, world, options):
    path, _ = make_build(n_packs=47, packs_per_shard=20, row_group_size=6)
    rows = read_rows(path)
    for rank, epoch in itertools.product(range(world), [0, 1]):
        ds = PackedDataset(path, rank=rank, world_size=world, **options)
        ds.set_epoch(epoch)
        want = reference_batches(ds, rows)
        got = list(packed_batches(ds))
        assert len(got) == len(want) > 0
        for mb, expected in zip(got, want, strict=True):
            assert_batch(mb, expected)


@pytest.mark.parametrize("options", [{"token_budget": 64}, {"token_budget": 64, "fixed_shape": True}], ids=str)
def test_schema_v2_segments_and_a_resume_equal_the_reference(make_build, options):
    path, _ = make_build(n_packs=31, packs_per_shard=12, row_group_size=5, alter=add_segments)
    rows = read_rows(path)
    whole = PackedDataset(path, world_size=2, **options)
    resume_at = int(whole.plan()[1].bounds[3])  # a round boundary, as a MicroBatch's resume_after
    for rank in range(2):
        ds = PackedDataset(path, rank=rank, world_size=2, **options)
        ds.advance(resume_at)
        want = reference_batches(ds, rows)
        got = list(packed_batches(ds))
        assert len(got) == len(want) > 0 and want[0]["segments"] is not None
        for mb, expected in zip(got, want, strict=True):
            assert_batch(mb, expected)


def test_isolated_documents_equal_the_reference(make_build):
    path, _ = make_build(n_packs=33, packs_per_shard=16, row_group_size=4, mode="stream")
    rows = read_rows(path)
    for world, rank in [(1, 0), (2, 1)]:
        ds = PackedDataset(path, token_budget=64, isolate_documents=True, rank=rank, world_size=world, seed=1)
        want = reference_batches(ds, rows)
        got = list(packed_batches(ds))
        assert any(mb.n_segments > mb.n_packs for mb in got)  # documents, not windows, are the segments
        for mb, expected in zip(got, want, strict=True):
            assert_batch(mb, expected)


@pytest.mark.parametrize("options", [{}, {"isolate_documents": True}, {"shuffle": False}], ids=str)
def test_packs_equal_the_reference(make_build, options):
    path, _ = make_build(n_packs=29, packs_per_shard=11, row_group_size=4)
    rows = read_rows(path)
    for rank in range(2):
        ds = PackedDataset(path, rank=rank, world_size=2, **options)
        want = reference_packs(ds, rows)
        got = list(ds)
        assert len(got) == len(want) > 0
        for pack, (values, step, resume, closes) in zip(got, want, strict=True):
            cu, labels = segments_of(values, ds)
            assert pack.input_ids.tolist() == values["input_ids"] and pack.labels.tolist() == labels
            assert pack.cu_seqlens.tolist() == cu and pack.pack_hash == values["pack_hash"]
            assert pack.cost == sum((b - a) ** 2 for a, b in itertools.pairwise(cu))
            assert (pack.shard, pack.row, pack.step, pack.resume_after, pack.closes_step) == (
                values["shard"],
                values["row"],
                step,
                resume,
                closes,
            )


def test_collate_of_several_packs_equals_assembling_them_one_at_a_time(make_build):
    """collate (one micro-batch) and the dataset's many-at-once assembly agree on the same packs."""
    path, _ = make_build(n_packs=20, packs_per_shard=20, row_group_size=20)
    packs = list(PackedDataset(path, shuffle=False))
    for capacity in (None, 32):
        mb = collate(packs[:5], capacity=capacity, n_padding_rows=1 if capacity else 0)
        parts = [collate([p], capacity=capacity) for p in packs[:5]]
        joined = torch.cat([p.input_ids for p in parts], dim=1)
        assert torch.equal(mb.input_ids[:, : joined.shape[1]], joined)
        assert mb.n_targets == sum(p.n_targets for p in parts) and mb.attn_cost == sum(p.attn_cost for p in parts)
