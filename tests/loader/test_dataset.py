import itertools
import json
import logging
import math
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from packtool.loader.balance import assign_round_robin, imbalance  # noqa: E402
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.dataset import DatasetError, PackedDataset, packed_batches, packed_steps  # noqa: E402


def hashes(rows):
    return [r.pack_hash for r in rows]


def mb_hashes(mbs):
    return [h for mb in mbs for h in mb.pack_hashes]


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


# ---- every rank the same rounds, at most W-1 packs left out ----


def _ranks(path, world, **options):
    return [PackedDataset(path, rank=r, world_size=world, **options) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "options",
    [{}, {"token_budget": 64}, {"token_budget": 96, "fixed_shape": True}, {"token_budget": 64, "num_workers": 2}],
    ids=["packs", "budget", "fixed", "budget-workers"],
)
def test_one_row_group_over_ranks_loses_at_most_w_minus_1(make_build, world, options):
    n = 21  # one shard, one row group: dealing row groups to ranks would leave all but one rank empty
    path, packs = make_build(n_packs=n, packs_per_shard=n, row_group_size=128)
    ranks = _ranks(path, world, seed=4, **options)
    if "token_budget" in options:
        per_rank = [list(packed_batches(ds)) for ds in ranks]
        assert len({len(mbs) for mbs in per_rank}) == 1  # the same number of micro-batches on every rank
        assert all(mb.n_tokens <= options["token_budget"] for mbs in per_rank for mb in mbs)
        seen = [h for mbs in per_rank for h in mb_hashes(mbs)]
    else:
        per_rank = [hashes(ds) for ds in ranks]
        assert len({len(h) for h in per_rank}) == 1
        seen = [h for hs in per_rank for h in hs]
    assert len(seen) == len(set(seen)) >= n - world + 1
    assert set(seen) <= {p.pack_hash for p in packs}
    assert ranks[0].state_dict()["left_out"] == n - len(seen) < world


def test_left_out_packs_are_logged_once_per_epoch(make_build, caplog):
    path, _ = make_build(n_packs=23, packs_per_shard=23, row_group_size=128)
    ds = PackedDataset(path, world_size=4, rank=1)
    with caplog.at_level(logging.WARNING, logger="packtool.loader"):
        list(ds)
        list(ds)
        ds.set_epoch(1)
        list(ds)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"epoch {e}: 3 of 23 packs left out so that 4 rank(s) run the same 5 rounds" for e in (0, 1)]


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


@pytest.mark.parametrize(("workers", "stop_after"), [(0, 0), (0, 3), (2, 4), (2, 9), (3, 2)])
def test_exact_resume_mid_epoch(make_build, workers, stop_after):
    path, _ = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)

    def fresh():
        ds = PackedDataset(path, seed=7, num_workers=workers, token_budget=64)
        ds.set_epoch(2)
        return ds

    reference = mb_hashes(packed_batches(fresh()))
    ds = fresh()
    before, state = [], None
    for i, mb in enumerate(packed_batches(ds)):
        before += mb.pack_hashes
        if i == stop_after:
            state = ds.state_dict()
            break
    restarted = PackedDataset(path, seed=7, num_workers=workers, token_budget=64)
    restarted.load_state_dict(json.loads(json.dumps(state)))
    assert before + mb_hashes(packed_batches(restarted)) == reference
    assert len(reference) == 50 == len(set(reference))


def _run_ranks(path, world, rounds, state=None, **options):
    """Simulate `world` ranks in lock step for `rounds` micro-batches (all when None); (hashes, states)."""
    ranks = _ranks(path, world, seed=3, **options)
    if state is not None:
        for ds in ranks:
            ds.load_state_dict(state)
    streams = [packed_batches(ds) for ds in ranks]
    seen: list[str] = []
    for mbs in itertools.islice(zip(*streams, strict=True), rounds):  # islice: no round fetched and not trained
        seen += mb_hashes(mbs)
    states = [ds.state_dict() for ds in ranks]
    return seen, states


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("budget", [32, 80])
def test_resume_under_another_world_size(make_build, old, new, budget):
    path, packs = make_build(n_packs=47, packs_per_shard=20, row_group_size=4)
    head, states = _run_ranks(path, old, rounds=3, token_budget=budget)
    positions = {s["position"] for s in states}
    assert len(positions) == 1  # the state is global: every rank saves the same one
    tail, _ = _run_ranks(path, new, rounds=None, state=json.loads(json.dumps(states[0])), token_budget=budget)
    together = head + tail
    assert len(together) == len(set(together)) >= 47 - new + 1  # nothing repeated, at most W'-1 left out
    assert set(together) <= {p.pack_hash for p in packs}


def test_resume_with_another_seed_is_refused_mid_epoch(make_build):
    path, _ = make_build()
    state = {"epoch": 0, "position": 5, "seed": 0, "shuffle": True, "build": PackedDataset(path).build}
    with pytest.raises(DatasetError, match="different seed 0 \\(now 1\\)"):
        PackedDataset(path, seed=1).load_state_dict(state)
    PackedDataset(path, seed=1).load_state_dict(state | {"position": 0})  # an epoch boundary is fine


# ---- epochs ----


def _epoch_hashes(path, epoch, **options):
    ds = PackedDataset(path, seed=7, token_budget=64, **options)
    ds.set_epoch(epoch)
    return mb_hashes(packed_batches(ds))


def test_epochs_read_each_epoch_in_its_own_order(make_build):
    path, _ = make_build(n_packs=30, packs_per_shard=20, row_group_size=3)
    ds = PackedDataset(path, seed=7, token_budget=64)
    got = mb_hashes(packed_batches(ds, epochs=3))
    assert got == _epoch_hashes(path, 0) + _epoch_hashes(path, 1) + _epoch_hashes(path, 2)
    assert ds.state_dict()["epoch"] == 2  # a state saved at the end still names the last epoch read
    assert mb_hashes(packed_batches(ds, epochs=3)) == []  # the run is over: a rerun of the call reads nothing


def test_a_second_call_reads_the_next_epoch(make_build):
    """Before: the second call found the epoch read to its end and yielded nothing, silently."""
    path, _ = make_build(n_packs=30, packs_per_shard=20, row_group_size=3)
    ds = PackedDataset(path, seed=7, token_budget=64)
    first, second = mb_hashes(packed_batches(ds)), mb_hashes(packed_batches(ds))
    assert (first, second) == (_epoch_hashes(path, 0), _epoch_hashes(path, 1))
    assert ds.epoch == 1


@pytest.mark.parametrize(("workers", "into_epoch_1"), [(0, -1), (0, 2), (2, 3)])
def test_exact_resume_across_epochs(make_build, workers, into_epoch_1):
    """The same call after load_state_dict ends where the uninterrupted run ends (epochs count from 0).

    into_epoch_1 -1 stops on the last micro-batch of epoch 0: the state names epoch 0, read to its end."""
    path, _ = make_build(n_packs=30, packs_per_shard=20, row_group_size=3)

    def fresh():
        return PackedDataset(path, seed=7, num_workers=workers, token_budget=64)

    stop_after = len(list(packed_batches(fresh()))) + into_epoch_1
    reference = mb_hashes(packed_batches(fresh(), epochs=3))
    ds, before = fresh(), []
    for i, mb in enumerate(packed_batches(ds, epochs=3)):
        before += mb.pack_hashes
        if i == stop_after:
            state = ds.state_dict()
            break
    resumed = fresh()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert before + mb_hashes(packed_batches(resumed, epochs=3)) == reference
    assert len(reference) == 90 and state["epoch"] == (0 if into_epoch_1 < 0 else 1)


def test_without_end_a_loop_counts_its_own_steps(make_build):
    path, _ = make_build(n_packs=30, packs_per_shard=20, row_group_size=3)
    ds = PackedDataset(path, seed=7, token_budget=64)
    per_epoch = len(list(packed_batches(PackedDataset(path, seed=7, token_budget=64))))
    taken = list(itertools.islice(packed_batches(ds, epochs=math.inf), 2 * per_epoch + 1))
    assert mb_hashes(taken[: 2 * per_epoch]) == _epoch_hashes(path, 0) + _epoch_hashes(path, 1)
    assert ds.state_dict()["epoch"] == 2


def test_packed_steps_over_epochs(make_build):
    path, _ = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)

    def steps(epoch=None, epochs=None):
        ds = balanced(path, 1)
        if epoch is not None:
            ds.set_epoch(epoch)
        return [mb_hashes(step) for step in packed_steps(ds, epochs=epochs)]

    assert steps(epochs=2) == steps(epoch=0) + steps(epoch=1)


def test_epochs_are_checked(make_build):
    path, _ = make_build()
    ds = PackedDataset(path, token_budget=64)
    with pytest.raises(DatasetError, match=r"epochs must be an int >= 1 or math.inf \(no end\), got 0"):
        packed_batches(ds, epochs=0)
    ds.set_epoch(3)
    with pytest.raises(DatasetError, match=r"at epoch 3 .* past epochs=2; pass epochs > 3"):
        next(packed_batches(ds, epochs=2))


EARLY_STOP = """
import sys
from packtool.loader import PackedDataset, packed_batches
ds = PackedDataset(sys.argv[1], token_budget=64, seed=0, num_workers=int(sys.argv[2]))
if sys.argv[3] == "batches":
    batches = packed_batches(ds, epochs=3)
    next(batches), next(batches)
else:
    packs = iter(ds)
    next(packs), next(packs)
print("stopped")
"""


@pytest.mark.parametrize(("workers", "kind"), [(0, "batches"), (2, "batches"), (0, "packs")])
def test_a_loop_stopped_mid_epoch_exits_cleanly(make_build, tmp_path, workers, kind):
    """Before: the suspended pass was collected at module teardown and printed
    AttributeError: 'NoneType' object has no attribute 'Empty' from the read-ahead thread's shutdown."""
    path, _ = make_build(n_packs=30, packs_per_shard=20, row_group_size=3)
    script = tmp_path / "early.py"
    script.write_text(EARLY_STOP)
    done = subprocess.run(
        [sys.executable, str(script), str(path), str(workers), kind], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "stopped\n", "")
    assert not [t for t in threading.enumerate() if t.name.startswith("packtool-read")]


# ---- verified bytes ----


def test_every_flipped_byte_is_refused_before_a_batch(make_build):
    path, _ = make_build(n_packs=30, packs_per_shard=30, row_group_size=8)
    shard = path / "shard-00000.parquet"
    original = shard.read_bytes()
    rng = np.random.default_rng(0)
    for offset in rng.choice(len(original), size=12, replace=False).tolist():
        data = bytearray(original)
        data[offset] ^= 1 << int(rng.integers(8))
        shard.write_bytes(bytes(data))
        with pytest.raises(DatasetError, match=r"shard-00000\.parquet: .*sha256 .* != manifest"):
            ds = PackedDataset(path, token_budget=64)
            next(packed_batches(ds))
    shard.write_bytes(original)
    assert len(list(PackedDataset(path))) == 30


def test_an_altered_token_is_named_by_shard_and_row(make_build):
    path, _ = make_build(n_packs=12, packs_per_shard=12, row_group_size=4)
    shard = path / "shard-00000.parquet"
    table = pq.read_table(shard)
    ids = table.column("input_ids").to_pylist()
    ids[6][1] += 1  # a valid Parquet file whose row 6 no longer matches its pack_hash

    altered = table.set_column(0, "input_ids", pa.array(ids, type=pa.list_(pa.int32())))
    pq.write_table(altered, shard, row_group_size=4, compression="zstd")
    with pytest.raises(DatasetError, match=r"shard-00000\.parquet: row 6 \(its pack_hash does not match"):
        list(PackedDataset(path))


def test_manifest_paths_stay_inside_the_build(make_build, tmp_path):
    path, _ = make_build(n_packs=8)
    manifest = json.loads((path / "manifest.json").read_text())
    for bad in ("../outside.parquet", "/etc/passwd", "sub/shard.parquet"):
        manifest["shards"][0]["file"] = bad
        (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(DatasetError, match="is not a file name inside the output folder"):
            PackedDataset(path)
    manifest["shards"][0]["file"] = "shard-00000.parquet"
    (path / "manifest.json").write_text(json.dumps(manifest))
    outside = tmp_path / "outside.parquet"
    (path / "shard-00000.parquet").rename(outside)
    (path / "shard-00000.parquet").symlink_to(outside)  # a plain name, but a link out of the build
    with pytest.raises(DatasetError, match=r"a link to .*outside\.parquet, outside the build folder"):
        PackedDataset(path)


def test_missing_manifest_is_an_unfinished_build(tmp_path):
    with pytest.raises(DatasetError, match=r"no manifest\.json"):
        PackedDataset(tmp_path)


# ---- the token budget is a hard cap ----


def test_budget_below_capacity_is_refused_with_the_fix(make_build):
    path, _ = make_build(n_packs=8, capacity=32)
    with pytest.raises(DatasetError, match=r"token_budget 16 < capacity 32.*set token_budget >= 32"):
        PackedDataset(path, token_budget=16)
    with pytest.raises(DatasetError, match=r"need PackedDataset\(token_budget=N\)"):
        next(packed_batches(PackedDataset(path)))


def test_fixed_shape_batches(make_build):
    path, _ = make_build(n_packs=11, capacity=32)
    ds = PackedDataset(path, token_budget=64, fixed_shape=True)
    mbs = list(packed_batches(ds))
    assert {mb.n_tokens for mb in mbs} == {64}
    assert sum(mb.n_packs for mb in mbs) == 11 and ds.state_dict()["position"] == 11
    assert sum(mb.n_padding for mb in mbs) == 64 * len(mbs) - sum(mb.n_tokens - mb.n_padding for mb in mbs)


# ---- balance="attention": every rank plans the same global steps and reads its LPT share ----


def balanced(path, rank, **kwargs):
    options = {
        "seed": 5,
        "world_size": 2,
        "balance": "attention",
        "packs_per_step": 8,
        "alpha": 4.0,
        "token_budget": 48,
    }
    return PackedDataset(path, rank=rank, **(options | kwargs))


def test_balanced_ranks_cover_each_pack_once(make_build):
    path, packs = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)
    ranks = [balanced(path, rank) for rank in range(2)]
    seen = [hashes(ds) for ds in ranks]
    assert Counter(seen[0] + seen[1]) == Counter(p.pack_hash for p in packs)  # last step of 2 packs >= W: dealt
    steps = [{row.step for row in ds} for ds in ranks]
    assert steps[0] == steps[1] == set(range(7))  # every rank has a share of every step
    assert [len(list(packed_steps(ds))) for ds in ranks] == [7, 7]


def test_balanced_steps_beat_round_robin(make_build):
    path, _ = make_build(n_packs=64, capacity=64, packs_per_shard=32, row_group_size=8, seed=1)
    alpha, n, world = 4.0, 8, 2
    _, plan = balanced(path, 0, alpha=alpha, token_budget=64).plan()
    cost = np.zeros(64)
    loads = np.zeros((plan.rounds, world))
    for rank in range(world):
        rows = list(balanced(path, rank, alpha=alpha, token_budget=64))
        for p, row in zip(plan.positions(rank).tolist(), rows, strict=True):
            cost[p] = row.cost + alpha * len(row)  # what the rank actually read
            loads[row.step, rank] += cost[p]
    lpt = [step.max() / step.mean() for step in loads]
    rr = [imbalance(cost[s * n : (s + 1) * n], assign_round_robin(n, world)) for s in range(plan.rounds)]
    print(f"per-step imbalance max/mean: round robin {np.mean(rr):.3f} -> LPT {np.mean(lpt):.3f}")
    # LPT is within 4/3 of the optimum, not better than round robin on every step, so the claim
    # is on the worst and the mean step.
    assert max(lpt) <= max(rr) and np.mean(lpt) < np.mean(rr)


@pytest.mark.parametrize(("workers", "stop_after"), [(0, 1), (2, 2), (3, 0)])
def test_balanced_exact_resume(make_build, workers, stop_after):
    path, _ = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)

    def steps(ds):
        return [mb_hashes(step) for step in packed_steps(ds)]

    full = balanced(path, 1, num_workers=workers)
    full.set_epoch(1)
    reference = steps(full)
    assert len(reference) == 7

    ds = balanced(path, 1, num_workers=workers)
    ds.set_epoch(1)
    before = []
    for i, step in enumerate(packed_steps(ds)):
        before.append(mb_hashes(step))
        if i == stop_after:
            state = ds.state_dict()
            break
    assert state["position"] == 8 * (stop_after + 1)
    resumed = balanced(path, 1, num_workers=workers)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert before + steps(resumed) == reference


def test_balanced_micro_batches_stay_inside_one_step(make_build):
    path, _ = make_build(n_packs=40)
    mbs = list(packed_batches(balanced(path, 0, packs_per_step=6, token_budget=1000)))
    assert len({mb.step for mb in mbs}) == len(mbs) == 7  # one micro-batch per step: the budget is large


def test_options_are_checked_together(make_build):
    path, _ = make_build(n_packs=8)
    with pytest.raises(DatasetError, match=r"balance 'tokens' is not one of .*; packs_per_step 2 < world_size 4.*>= 4"):
        PackedDataset(path, world_size=4, balance="tokens", packs_per_step=2)
    with pytest.raises(DatasetError, match="packs_per_step needs balance='attention'"):
        PackedDataset(path, packs_per_step=8)
    with pytest.raises(DatasetError, match="packed_steps needs PackedDataset"):
        next(packed_steps(PackedDataset(path, token_budget=64)))


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
    ds = balanced(path, 0, isolate_documents=True, alpha=0.0, shuffle=False, packs_per_step=16, token_budget=64)
    want = {p.pack_hash: int((np.diff(p.doc_cu_seqlens).astype(np.int64) ** 2).sum()) for p in packs}
    assert all(row.cost == want[row.pack_hash] for row in ds)


def test_a_pack_breaking_the_contract_is_refused_with_its_row(make_build):
    broken = []

    def label_across_a_boundary(packs):
        target = next(i for i, p in enumerate(packs) if i > 4 and len(p.cu_seqlens) > 2)
        packs[target].labels[packs[target].cu_seqlens[1]] = 5  # a target across a segment boundary
        broken.append(target)

    path, _ = make_build(n_packs=10, packs_per_shard=10, row_group_size=4, seed=2, alter=label_across_a_boundary)
    with pytest.raises(DatasetError, match=rf"shard-00000\.parquet: row {broken[0]}: breaks the pack contract"):
        list(PackedDataset(path, shuffle=False))


def test_first_broken_pack_rules():
    from packtool.format import first_broken_pack

    def run(packs, check_labels=True):
        def lists(name):
            arrays = [np.asarray(p[name]) for p in packs]
            return np.concatenate([[0], np.cumsum([len(a) for a in arrays])]), np.concatenate(arrays)

        ids, labels, cu = lists("input_ids"), lists("labels"), lists("cu_seqlens")
        return first_broken_pack(ids[0], labels[0], cu[0], cu[1], labels[1] if check_labels else None)

    good = {"input_ids": [1, 2, 3], "labels": [-100, 2, -100], "cu_seqlens": [0, 2, 3]}
    assert run([good, good]) == -1
    assert run([good, good | {"cu_seqlens": [0, 2, 4]}]) == 1
    assert run([good, good | {"cu_seqlens": [1, 3]}]) == 1
    assert run([good | {"cu_seqlens": [0, 2, 2, 3]}, good]) == 0
    assert run([good, good, good | {"labels": [-100, 2]}]) == 2
    assert run([good, good | {"labels": [-100, 2, 3]}]) == 1
    assert run([good, good | {"labels": [-100, 2, 3]}], check_labels=False) == -1


# ---- a resume state belongs to its build; a build replaced under the reader is named ----


def test_a_resume_state_is_refused_by_another_build(make_build, tmp_path):
    import shutil

    path, _ = make_build(n_packs=30, seed=1, name="a")
    other, _ = make_build(n_packs=30, seed=2, name="b")
    ds = PackedDataset(path, token_budget=64)
    next(packed_batches(ds))
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["build"] == ds.build and state["position"] > 0
    with pytest.raises(DatasetError, match=r"saved on build .*, .*/b is build .*another build's packs"):
        PackedDataset(other, token_budget=64).load_state_dict(state)
    with pytest.raises(DatasetError, match="another build's packs"):  # at an epoch boundary too
        PackedDataset(other).load_state_dict(state | {"position": 0})
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # the same build elsewhere: the same manifest, the same packs
    PackedDataset(copy, token_budget=64).load_state_dict(state)


def test_a_state_without_its_build_resumes_only_at_an_epoch_boundary(make_build):
    path, _ = make_build(n_packs=30)
    old = {"epoch": 2, "position": 5, "seed": 0, "shuffle": True}  # as states were saved before they named a build
    ds = PackedDataset(path)
    with pytest.raises(DatasetError, match=r"names no build .* set state\['build'\] = '[0-9a-f]{64}'"):
        ds.load_state_dict(old)
    ds.load_state_dict(old | {"position": 0})
    assert (ds.epoch, ds.position) == (2, 0)
    ds.load_state_dict(old | {"build": ds.build})  # the fix the message names
    assert ds.position == 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epoch": -1}, r"epoch: must be between 0 and .*got -1"),  # once failed later, inside numpy
        ({"position": "7"}, r"position: expected an integer, got str '7'"),
        ({"position": True}, r"position: expected an integer, got bool True"),
        ({"position": 3.7}, r"position: expected an integer, got float 3.7"),  # once read as 3
        ({"shuffle": "no"}, r"shuffle: expected true/false, got str 'no'"),  # once read as true
    ],
)
def test_load_state_dict_refuses_a_state_of_the_wrong_types(make_build, change, message):
    path, _ = make_build(n_packs=30)
    ds = PackedDataset(path)
    with pytest.raises(DatasetError, match=message):
        ds.load_state_dict(ds.state_dict() | change)
    assert (ds.epoch, ds.position) == (0, 0)  # nothing taken from a refused state


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seed": -1}, r"seed: must be between 0 and 9,223,372,036,854,775,807 .*got -1"),
        ({"seed": 2**64}, r"seed: must be between 0 and"),
        ({"seed": 1.5}, r"seed: expected an integer, got float 1.5"),
        ({"alpha": math.nan}, r"alpha: must be between 0.0 and 1,048,576.0 .*got nan"),
        ({"alpha": math.inf}, r"alpha: must be between 0.0 and"),
        ({"alpha": -0.5}, r"alpha: must be between 0.0 and"),
        ({"shuffle": "no"}, r"shuffle: expected True/False, got 'no'"),
        # counts and flags: a float or a string was compared (TypeError) or taken as it came
        ({"token_budget": 4096.5}, r"token_budget: expected an integer, got float 4096.5"),
        ({"token_budget": "4096"}, r"token_budget: expected an integer, got str '4096'"),
        ({"num_workers": True}, r"num_workers: expected an integer, got bool True"),
        ({"num_workers": -1}, r"num_workers: must be between 0 and"),
        ({"balance": "attention", "packs_per_step": 3.0}, r"packs_per_step: expected an integer, got float"),
        ({"fixed_shape": "yes", "token_budget": 64}, r"fixed_shape: expected True/False, got 'yes'"),
        ({"verify": 0}, r"verify: expected True/False, got 0"),
    ],
)
def test_seed_alpha_and_shuffle_are_checked_when_the_dataset_is_made(make_build, options, message):
    path, _ = make_build(n_packs=30)
    with pytest.raises(DatasetError, match=message):
        PackedDataset(path, **options)


def test_set_epoch_refuses_a_negative_epoch(make_build):
    path, _ = make_build(n_packs=30)
    ds = PackedDataset(path)
    with pytest.raises(DatasetError, match=r"set_epoch: epoch: must be between 0 and .*got -1"):
        ds.set_epoch(-1)
    ds.set_epoch(np.int64(2))
    assert (ds.epoch, ds.position) == (2, 0)


def _replace(out, new):
    """Publish `new` at `out` as a rebuild does: the old folder moves away, the new one takes its name."""
    out.rename(out.with_name(out.name + "-old"))
    new.rename(out)


@pytest.mark.parametrize("verify", [True, False])
def test_a_build_replaced_before_reading_is_named(make_build, verify):
    path, _ = make_build(n_packs=30, seed=1, name="out")
    ds = PackedDataset(path, verify=verify)
    new, _ = make_build(n_packs=30, seed=2, name="new")
    _replace(path, new)
    with pytest.raises(DatasetError, match=r"shard-0000\d\.parquet: changed since this dataset opened the build \("):
        list(ds)


@pytest.mark.parametrize("verify", [True, False])
def test_a_build_replaced_while_reading_is_named(make_build, verify):
    path, _ = make_build(n_packs=40, seed=1, name="out", packs_per_shard=10, row_group_size=5)
    new, _ = make_build(n_packs=40, seed=2, name="new", packs_per_shard=10, row_group_size=5)
    ds = PackedDataset(path, verify=verify, shuffle=False)
    batches = iter(ds)
    next(batches)  # shard 0 is open
    _replace(path, new)
    with pytest.raises(DatasetError, match=r"shard-0000[1-3]\.parquet: changed since .*manifest\.json changed too"):
        list(batches)
    rewritten, _ = make_build(n_packs=40, seed=3, name="rewritten", packs_per_shard=10, row_group_size=5)
    ds = PackedDataset(rewritten, verify=verify, shuffle=False)
    (rewritten / "shard-00002.parquet").write_bytes((path / "shard-00002.parquet").read_bytes())  # one file only
    with pytest.raises(DatasetError, match=r"shard-00002\.parquet: changed since this dataset opened the build;"):
        list(ds)


# ---- damaged builds: one DatasetError naming the file, never a Parquet or Python error ----


def _cut_points(shard):
    meta = pq.ParquetFile(shard).metadata
    starts = [meta.row_group(g).column(0).data_page_offset for g in range(meta.num_row_groups)]
    size = shard.stat().st_size
    return sorted({*starts, size - 8, size - 1, 0, 1, size // 2})


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_shard_at_every_row_group_boundary(make_build, verify):
    path, _ = make_build(n_packs=30, packs_per_shard=30, row_group_size=8)
    shard = path / "shard-00000.parquet"
    original = shard.read_bytes()
    for cut in _cut_points(shard):
        shard.write_bytes(original[:cut])
        with pytest.raises(DatasetError, match=r"shard-00000\.parquet: "):
            list(packed_batches(PackedDataset(path, verify=verify, token_budget=64)))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize(
    "change",
    [
        lambda t: pa.table({"a": list(range(t.num_rows))}),
        lambda t: t.drop_columns(["labels"]),
        lambda t: t.set_column(1, "labels", t.column("labels").cast(pa.list_(pa.int64()))),
    ],
    ids=["foreign", "no-labels", "int64-labels"],
)
def test_a_foreign_shard_is_named(make_build, verify, change):
    path, _ = make_build(n_packs=12, packs_per_shard=12, row_group_size=4)
    shard = path / "shard-00000.parquet"
    pq.write_table(change(pq.read_table(shard)), shard, row_group_size=4)
    with pytest.raises(DatasetError, match=r"shard-00000\.parquet: "):
        list(packed_batches(PackedDataset(path, verify=verify, token_budget=64)))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(capacity="32"),
        lambda m: m.update(shards="x"),
        lambda m: m["shards"][0].update(rows=None),
        lambda m: m["shards"][0].update(sha256=5),
        lambda m: m.update(tokenizer=[]),
        lambda m: m["tokenizer"].update(pad_token_id="0"),
        lambda m: m.update(schema_version=True),
    ],
)
def test_a_mistyped_manifest_is_named(make_build, change):
    path, _ = make_build(n_packs=8)
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"manifest\.json: "):
        PackedDataset(path)


def test_a_footer_claiming_more_rows_than_its_row_groups(make_build):
    from support import claim_rows

    path, _ = make_build(n_packs=12, packs_per_shard=12, row_group_size=4)
    claim_rows(path / "shard-00000.parquet", 10**9)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["shards"][0]["rows"] = 10**9  # the manifest agrees with the footer: only the row groups tell
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"shard-00000\.parquet: its footer claims 1000000000 rows"):
        PackedDataset(path, verify=False)
