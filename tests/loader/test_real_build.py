"""The loader on a real `packtool build` of the shipped quickstart: coverage, validation, exact resume."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from packtool.loader import PackedDataset, packed_batches  # noqa: E402
from packtool.loader.balance import assign_lpt, assign_round_robin, imbalance, pack_costs  # noqa: E402
from packtool.loader.contract import validate_cu_seqlens  # noqa: E402


@pytest.mark.parametrize("world", [2, 4])
def test_default_dataset_under_ranks_loses_at_most_w_minus_1(quickstart_build, world):
    ranks = [PackedDataset(quickstart_build, rank=r, world_size=world, seed=3) for r in range(world)]
    per_rank = [[row.pack_hash for row in ds] for ds in ranks]
    seen = [h for hashes in per_rank for h in hashes]
    total = ranks[0].total_packs
    assert len({len(h) for h in per_rank}) == 1
    assert len(seen) == len(set(seen)) >= total - world + 1
    assert ranks[0].state_dict()["left_out"] == total - len(seen)


def test_budgeted_batches_on_two_ranks_are_valid(quickstart_build):
    seen = []
    counts = []
    for rank in range(2):
        dataset = PackedDataset(quickstart_build, rank=rank, world_size=2, seed=3, token_budget=4096)
        mbs = list(packed_batches(dataset))
        counts.append(len(mbs))
        for batch in mbs:
            validate_cu_seqlens(batch.cu_seqlens, batch.input_ids.shape[1], batch.max_seqlen)
            assert batch.n_tokens <= 4096
            assert int((batch.labels != -100).sum()) == batch.n_targets
            assert (batch.position_ids[0, batch.cu_seqlens[:-1].long()] == 0).all()
            seen.extend(batch.pack_hashes)
    assert counts[0] == counts[1]
    assert len(seen) == len(set(seen)) >= PackedDataset(quickstart_build).total_packs - 1


def test_resume_mid_epoch_on_a_real_build(quickstart_build):
    def order(dataset, stop=None):
        hashes = []
        for i, batch in enumerate(packed_batches(dataset)):
            hashes.extend(batch.pack_hashes)
            if stop is not None and i + 1 == stop:
                break
        return hashes, dataset.state_dict()

    options = {"seed": 1, "num_workers": 2, "token_budget": 2048}
    full, _ = order(PackedDataset(quickstart_build, **options))
    head, state = order(PackedDataset(quickstart_build, **options), stop=37)
    resumed = PackedDataset(quickstart_build, **options)
    resumed.load_state_dict(state)
    tail, _ = order(resumed)
    assert head + tail == full


def test_rank_balancing_by_attention_cost_on_a_real_build(quickstart_build):
    import pyarrow.parquet as pq

    manifest = PackedDataset(quickstart_build).manifest
    table = pq.read_table(manifest.shards[0].file, columns=["attn_cost", "n_tokens"])
    costs = pack_costs(table["attn_cost"].to_numpy(), table["n_tokens"].to_numpy(), alpha=1024.0)
    step = costs[:64]  # one global step of 64 packs over 8 ranks
    before = imbalance(step, assign_round_robin(len(step), 8))
    after = imbalance(step, assign_lpt(step, 8))
    print(f"attention-cost imbalance (max/mean) over 8 ranks: round-robin {before:.3f} -> LPT {after:.3f}")
    assert after <= before and after < 1.1


def test_balanced_dataset_on_a_real_build(quickstart_build):
    options = {"world_size": 2, "seed": 2, "balance": "attention", "packs_per_step": 16, "alpha": 1024.0}
    ranks = [PackedDataset(quickstart_build, rank=r, token_budget=4096, **options) for r in range(2)]
    seen = [row.pack_hash for ds in ranks for row in ds]
    total = ranks[0].total_packs
    assert len(seen) == len(set(seen)) >= total - 1
