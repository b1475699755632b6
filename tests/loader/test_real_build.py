"""The loader on a real `packtool build` of the shipped quickstart: coverage, validation, exact resume."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from support import QUICKSTART  # noqa: E402

from packtool.cli import main  # noqa: E402
from packtool.loader import (  # noqa: E402  # noqa: E402
    PackedDataset,
    assign_lpt,
    assign_round_robin,
    imbalance,
    pack_costs,
    packed_batches,
    validate_cu_seqlens,
)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out


def test_two_ranks_cover_every_pack_once_and_batches_are_valid(build):
    seen = []
    for rank in range(2):
        dataset = PackedDataset(build, rank=rank, world_size=2, seed=3, verify_checksums=True, even_ranks=False)
        for batch in packed_batches(dataset, token_budget=4096):
            validate_cu_seqlens(batch.cu_seqlens, batch.input_ids.shape[1], batch.max_seqlen)
            assert batch.input_ids.shape[1] <= 4096 or batch.n_packs == 1
            assert int((batch.labels != -100).sum()) == batch.n_targets
            assert (batch.position_ids[0, batch.cu_seqlens[:-1].long()] == 0).all()
            seen.extend(batch.pack_hashes)
    total = sum(s["rows"] for s in PackedDataset(build).manifest["shards"])
    assert len(seen) == total and len(set(seen)) == total


def test_resume_mid_epoch_on_a_real_build(build):
    def order(dataset, stop=None):
        hashes = []
        for i, batch in enumerate(packed_batches(dataset, token_budget=2048)):
            hashes.extend(batch.pack_hashes)
            if stop is not None and i + 1 == stop:
                return hashes, dataset.state_dict()
        return hashes, dataset.state_dict()

    full, _ = order(PackedDataset(build, seed=1, num_workers=2))
    head, state = order(PackedDataset(build, seed=1, num_workers=2), stop=37)
    resumed = PackedDataset(build, seed=1, num_workers=2)
    resumed.load_state_dict(state)
    tail, _ = order(resumed)
    assert head + tail == full


def test_rank_balancing_by_attention_cost_on_a_real_build(build, capsys):
    import pyarrow.parquet as pq

    manifest = PackedDataset(build).manifest
    table = pq.read_table(build / manifest["shards"][0]["file"], columns=["attn_cost", "n_tokens"])
    costs = pack_costs(table["attn_cost"].to_numpy(), table["n_tokens"].to_numpy(), alpha=1024.0)
    step = costs[:64]  # one global step of 64 packs over 8 ranks
    before = imbalance(step, assign_round_robin(len(step), 8))
    after = imbalance(step, assign_lpt(step, 8))
    print(f"attention-cost imbalance (max/mean) over 8 ranks: round-robin {before:.3f} -> LPT {after:.3f}")
    assert after <= before and after < 1.1


def test_balanced_dataset_on_a_real_build(build):
    options = {"world_size": 2, "seed": 2, "balance": "attention", "packs_per_step": 16, "alpha": 1024.0}
    ranks = [PackedDataset(build, rank=r, even_ranks=False, **options) for r in range(2)]
    seen = [h for ds in ranks for h in (row.pack_hash for row in ds)]
    total = sum(s["rows"] for s in ranks[0].manifest["shards"])
    assert len(seen) == total == len(set(seen))
    plan, n = ranks[0].balanced_plan(), 16
    lpt, rr = [], []
    for lo in range(0, len(plan.cost) // n * n, n):
        step = plan.cost[lo : lo + n]
        lpt.append(imbalance(step, assign_lpt(step, 2)))
        rr.append(imbalance(step, assign_round_robin(n, 2)))
    print(
        f"per-step imbalance over 2 ranks, mean: round-robin {sum(rr) / len(rr):.3f} -> LPT {sum(lpt) / len(lpt):.3f}"
    )
    assert max(lpt) <= max(rr) and sum(lpt) < sum(rr)
