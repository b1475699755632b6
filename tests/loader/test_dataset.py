import json
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import pyarrow.parquet as pq  # noqa: E402

from packtool.loader.balance import assign_round_robin, imbalance  # noqa: E402
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.dataset import (  # noqa: E402
    DatasetError,
    PackedDataset,
    _taken_per_worker,
    packed_batches,
    packed_steps,
)


def hashes(rows):
    return [r.pack_hash for r in rows]


def test_reads_every_pack_with_its_columns(make_build):
    path, packs = make_build(n_packs=23)
    ds = PackedDataset(path, shuffle=False)
    rows = list(ds)
    assert len(rows) == len(ds) == 23
    for row, pack in zip(rows, packs, strict=True):
        assert row.input_ids.tolist() == pack.input_ids.tolist()
        assert row.labels.tolist() == pack.labels.tolist()
        assert row.cu_seqlens.tolist() == pack.cu_seqlens.tolist()
        assert row.pack_hash == pack.pack_hash
        assert row.cost == row.attn_cost == pack.attn_cost


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


# ---- balance="attention": every rank plans the same global steps and reads its LPT share ----


def balanced(path, rank, **kwargs):
    options = {"seed": 5, "world_size": 2, "balance": "attention", "packs_per_step": 8, "alpha": 4.0}
    return PackedDataset(path, rank=rank, **(options | kwargs))


def test_balanced_ranks_cover_each_pack_once(make_build):
    path, packs = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)
    everything = Counter(p.pack_hash for p in packs)
    kept = [hashes(balanced(path, rank, even_ranks=False)) for rank in range(2)]
    assert Counter(kept[0] + kept[1]) == everything
    even = [balanced(path, rank) for rank in range(2)]
    seen = [hashes(ds) for ds in even]
    assert len(seen[0]) + len(seen[1]) == 48 and len(set(seen[0] + seen[1])) == 48  # 6 whole steps of 8
    assert even[0].dropped_for_evenness == even[1].dropped_for_evenness == 2
    assert [len(ds) for ds in even] == [len(s) for s in seen]
    steps = [{row.step for row in ds} for ds in even]
    assert steps[0] == steps[1] == set(range(6))  # every rank has a share of every step


def test_balanced_steps_beat_round_robin(make_build):
    path, _ = make_build(n_packs=64, capacity=64, packs_per_shard=32, row_group_size=8, seed=1)
    alpha, n, world = 4.0, 8, 2
    plan = balanced(path, 0, alpha=alpha).balanced_plan()
    loads = np.zeros((len(plan.cost) // n, world))
    for rank in range(world):
        for row in balanced(path, rank, alpha=alpha):
            loads[row.step, rank] += row.cost + alpha * len(row)  # what the rank actually read
    lpt, rr = [], []
    for s in range(len(loads)):
        step_costs = plan.cost[s * n : (s + 1) * n]
        assert loads[s].sum() == pytest.approx(step_costs.sum())
        lpt.append(loads[s].max() / loads[s].mean())
        rr.append(imbalance(step_costs, assign_round_robin(n, world)))
    print(f"per-step imbalance max/mean: round robin {np.mean(rr):.3f} -> LPT {np.mean(lpt):.3f}")
    # LPT is within 4/3 of the optimum, not better than round robin on every step (here 7 of 8
    # steps improve, one goes 1.033 -> 1.043), so the claim is on the worst and the mean step.
    assert max(lpt) <= max(rr) and np.mean(lpt) < np.mean(rr)
    assert sum(a <= b for a, b in zip(lpt, rr, strict=True)) >= len(lpt) - 1


def test_balanced_plan_reads_small_columns_then_only_own_row_groups(make_build, monkeypatch):
    path, _ = make_build(n_packs=48, packs_per_shard=48, row_group_size=4)
    reads = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, *args, columns=None, **kwargs):
        reads.append((i, tuple(columns)))
        return original(self, i, *args, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    ds = balanced(path, 1, packs_per_step=16, shuffle=False)
    rows = list(ds)
    planning = [r for r in reads if "input_ids" not in r[1]]
    assert {cols for _, cols in planning} == {("attn_cost", "n_tokens")} and len(planning) == 12
    token_groups = [g for g, cols in reads if "input_ids" in cols]
    assert sorted(token_groups) == sorted({row.row // 4 for row in rows})  # each of its groups, once


@pytest.mark.parametrize(("workers", "stop_after"), [(0, 1), (2, 2), (3, 0)])
def test_balanced_exact_resume(make_build, workers, stop_after):
    path, _ = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)

    def steps(ds):
        return [[h for mb in step for h in mb.pack_hashes] for step in packed_steps(ds, token_budget=48)]

    full = balanced(path, 1, num_workers=workers)
    full.set_epoch(1)
    reference = steps(full)
    assert len(reference) == 6 and full.state_dict()["consumed"] == len(full)

    ds = balanced(path, 1, num_workers=workers)
    ds.set_epoch(1)
    before = []
    for i, step in enumerate(packed_steps(ds, token_budget=48)):
        before.append([h for mb in step for h in mb.pack_hashes])
        if i == stop_after:
            state = ds.state_dict()
            break
    assert state["consumed"] == sum(map(len, before)) and state["packs_per_step"] == 8
    resumed = balanced(path, 1, num_workers=workers)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert before + steps(resumed) == reference

    other = balanced(path, 1, num_workers=workers, packs_per_step=10)
    with pytest.raises(DatasetError, match=r"packs_per_step 8 \(now 10\)"):
        other.load_state_dict(state)


def test_balanced_micro_batches_stay_inside_one_step(make_build):
    path, _ = make_build(n_packs=40)
    mbs = list(packed_batches(balanced(path, 0, packs_per_step=6), token_budget=1000))
    assert len({mb.step for mb in mbs}) == len(mbs) == 40 // 6  # one micro-batch per step: the budget is large


def test_balanced_options_are_checked_together(make_build):
    path, _ = make_build(n_packs=8)
    with pytest.raises(DatasetError, match=r"balance 'tokens' is not one of .*; .*packs_per_step >= world_size 4"):
        PackedDataset(path, world_size=4, balance="tokens", packs_per_step=2)
    with pytest.raises(DatasetError, match="packs_per_step needs balance='attention'"):
        PackedDataset(path, packs_per_step=8)
    with pytest.raises(DatasetError, match="packed_steps needs PackedDataset"):
        next(packed_steps(PackedDataset(path), token_budget=64))


# ---- isolate_documents: stream builds keep document boundaries in doc_cu_seqlens ----


def test_stream_build_as_written_and_with_isolated_documents(make_build):
    path, packs = make_build(n_packs=12, mode="stream")
    as_written = list(PackedDataset(path, shuffle=False))
    isolated = list(PackedDataset(path, shuffle=False, isolate_documents=True))
    assert any(len(p.doc_cu_seqlens) > 2 for p in packs)
    for plain, iso, pack in zip(as_written, isolated, packs, strict=True):
        assert plain.cu_seqlens.tolist() == [0, len(pack.input_ids)]
        assert plain.labels.tolist() == pack.labels.tolist()
        starts = pack.doc_cu_seqlens[:-1]
        assert iso.cu_seqlens.tolist() == pack.doc_cu_seqlens.tolist()
        assert (iso.labels[starts] == -100).all()
        inside = np.setdiff1d(np.arange(len(pack.input_ids)), starts)
        assert iso.labels[inside].tolist() == pack.labels[inside].tolist()
        assert iso.cost == int((np.diff(pack.doc_cu_seqlens).astype(np.int64) ** 2).sum())
        assert iso.n_targets == pack.n_targets - (len(starts) - 1)  # one pair lost per document boundary
        mb = collate([iso])  # the contract holds: -100 at every segment start
        assert mb.position_ids[0, torch.as_tensor(starts).long()].tolist() == [0] * len(starts)


def test_isolated_documents_plan_with_document_costs(make_build):
    path, packs = make_build(n_packs=16, mode="stream")
    plan = balanced(path, 0, isolate_documents=True, alpha=0.0, shuffle=False).balanced_plan()
    want = [float((np.diff(p.doc_cu_seqlens).astype(np.int64) ** 2).sum()) for p in packs]
    assert plan.cost.tolist() == want
