import json
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
import pyarrow.parquet as pq  # noqa: E402

from packtool.loader.dataset import DatasetError, PackedDataset, _taken_per_worker, packed_batches  # noqa: E402


def hashes(rows):
    return [r.pack_hash for r in rows]


def test_reads_every_pack_with_its_columns(make_build):
    path, packs = make_build(n_packs=23)
    ds = PackedDataset(path, shuffle=False)
    rows = list(ds)
    assert len(rows) == len(ds) == 23
    for row, pack in zip(rows, packs, strict=True):
        assert row.input_ids.tolist() == pack["input_ids"].tolist()
        assert row.labels.tolist() == pack["labels"].tolist()
        assert row.cu_seqlens.tolist() == pack["cu_seqlens"].tolist()
        assert row.cost == row.attn_cost


def test_reads_one_row_group_at_a_time(make_build, monkeypatch):
    path, _ = make_build(n_packs=60, packs_per_shard=60, row_group_size=5)
    calls = []
    original = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        table = original(self, i, *args, **kwargs)
        calls.append(table.num_rows)
        return table

    def forbidden(*args, **kwargs):
        raise AssertionError("whole-file read")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    monkeypatch.setattr(pq.ParquetFile, "read", forbidden)
    monkeypatch.setattr(pq, "read_table", forbidden)
    it = iter(PackedDataset(path))
    next(it)
    assert calls == [5]  # one pack asked for -> one row group read, not the file
    rest = list(it)
    assert len(rest) == 59 and len(calls) == 12 and max(calls) == 5


def test_ranks_and_workers_cover_each_pack_once(make_build):
    path, _packs = make_build(n_packs=40, packs_per_shard=15, row_group_size=4)
    seen = []
    for rank in range(2):
        ds = PackedDataset(path, seed=3, rank=rank, world_size=2, num_workers=2, even_ranks=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda x: x)
        seen += hashes(loader)
    assert Counter(seen) == Counter(hashes(PackedDataset(path, shuffle=False)))
    assert len(seen) == 40


def test_even_ranks_cut_to_the_smallest_rank(make_build):
    path, _ = make_build(n_packs=40, packs_per_shard=15, row_group_size=4)  # row groups 4,4,4,3 x2 + 4,4,2
    per_rank = PackedDataset(path, rank=0, world_size=2).packs_per_rank()
    for rank in range(2):
        ds = PackedDataset(path, rank=rank, world_size=2)
        assert len(list(ds)) == min(per_rank) == len(ds)
        assert ds.dropped_for_evenness == per_rank[rank] - min(per_rank)


def test_epochs_shuffle_differently_and_deterministically(make_build):
    path, _ = make_build()
    ds = PackedDataset(path, seed=1)
    e0 = hashes(ds)
    ds.set_epoch(1)
    e1 = hashes(ds)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    again = PackedDataset(path, seed=1)
    again.set_epoch(1)
    assert hashes(again) == e1


@pytest.mark.parametrize(
    ("lengths", "n", "want"), [([3, 1, 2], 5, [2, 1, 2]), ([2, 2], 3, [2, 1]), ([0, 4], 3, [0, 3])]
)
def test_taken_per_worker(lengths, n, want):
    assert _taken_per_worker(lengths, n) == want


@pytest.mark.parametrize(("workers", "stop_after"), [(2, 0), (2, 4), (2, 9), (3, 2), (0, 3)])
def test_exact_resume_mid_epoch(make_build, workers, stop_after):
    path, _ = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)
    full = PackedDataset(path, seed=7, num_workers=workers)
    full.set_epoch(2)
    reference = [h for mb in packed_batches(full, token_budget=64) for h in _mb_hashes(mb)]

    ds = PackedDataset(path, seed=7, num_workers=workers)
    ds.set_epoch(2)
    before, state = [], None
    for i, mb in enumerate(packed_batches(ds, token_budget=64)):
        before += _mb_hashes(mb)
        if i == stop_after:
            state = ds.state_dict()
            break
    assert state["consumed"] == len(before)
    restarted = PackedDataset(path, seed=7, num_workers=workers)
    restarted.load_state_dict(json.loads(json.dumps(state)))
    after = [h for mb in packed_batches(restarted, token_budget=64) for h in _mb_hashes(mb)]
    assert before + after == reference
    assert len(reference) == 50 == len(set(reference))


def _mb_hashes(mb):
    return list(mb.pack_hashes)


def test_resume_with_other_worker_count_is_refused(make_build):
    path, _ = make_build()
    state = {"epoch": 0, "consumed": 5, "seed": 0, "world_size": 1, "num_workers": 2}
    with pytest.raises(DatasetError, match="num_workers 2 \\(now 0\\)"):
        PackedDataset(path).load_state_dict(state)


def test_checksum_catches_corruption(make_build):
    path, _ = make_build()
    PackedDataset(path, verify_checksums=True)
    shard = path / "shard-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"shard-00001\.parquet: sha256 .* != manifest"):
        PackedDataset(path, verify_checksums=True)


def test_missing_manifest_is_an_unfinished_build(tmp_path):
    with pytest.raises(DatasetError, match=r"no manifest\.json"):
        PackedDataset(tmp_path)


def test_fixed_shape_batches(make_build):
    path, _ = make_build(n_packs=11, capacity=32)
    ds = PackedDataset(path)
    mbs = list(packed_batches(ds, token_budget=64, fixed_shape=True))
    assert {mb.n_tokens for mb in mbs} == {64}
    assert sum(mb.n_packs for mb in mbs) == 11 == ds.state_dict()["consumed"]
