"""A build folder written per docs/format.md from synthetic packs (the real `packtool build` is separate)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("cu_seqlens", pa.list_(pa.int32())),
        ("doc_cu_seqlens", pa.list_(pa.int32())),
        ("token_roles", pa.list_(pa.int8())),
        ("sample_ids", pa.list_(pa.string())),
        ("sample_hashes", pa.list_(pa.string())),
        ("sample_repeats", pa.list_(pa.int32())),
        ("sources", pa.list_(pa.string())),
        ("n_tokens", pa.int32()),
        ("n_targets", pa.int32()),
        ("attn_cost", pa.int64()),
        ("pack_hash", pa.string()),
    ],
    metadata={"packtool_schema_version": "1"},
)


def synthetic_packs(n_packs: int, capacity: int, seed: int = 0, vocab: int = 100) -> list[dict]:
    """Packs of 1-4 samples; labels -100 at each segment start and on ~20% of other tokens."""
    rng = np.random.default_rng(seed)
    packs = []
    for p in range(n_packs):
        lengths = []
        room = capacity
        for _ in range(int(rng.integers(1, 5))):
            if room < 2:
                break
            n = int(rng.integers(2, min(room, capacity // 2) + 1))
            lengths.append(n)
            room -= n
        ids = rng.integers(1, vocab, size=sum(lengths)).astype(np.int32)
        labels = ids.copy()
        labels[rng.random(len(ids)) < 0.2] = -100
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        labels[cu[:-1]] = -100
        packs.append(
            {
                "input_ids": ids,
                "labels": labels,
                "cu_seqlens": cu,
                "sample_ids": [f"synthetic:{p}-{i}" for i in range(len(lengths))],
            }
        )
    return packs


def pack_row(pack: dict) -> dict:
    ids, labels, cu = (np.asarray(pack[k], dtype="<i4") for k in ("input_ids", "labels", "cu_seqlens"))
    digest = hashlib.sha256(ids.tobytes() + labels.tobytes() + cu.tobytes()).hexdigest()[:32]
    n_seg = len(cu) - 1
    return {
        "input_ids": ids.tolist(),
        "labels": labels.tolist(),
        "cu_seqlens": cu.tolist(),
        "doc_cu_seqlens": cu.tolist(),
        "token_roles": [5] * len(ids),
        "sample_ids": pack["sample_ids"],
        "sample_hashes": ["0" * 32] * n_seg,
        "sample_repeats": [0] * n_seg,
        "sources": ["synthetic"] * n_seg,
        "n_tokens": len(ids),
        "n_targets": int((labels != -100).sum()),
        "attn_cost": int((np.diff(cu).astype(np.int64) ** 2).sum()),
        "pack_hash": digest,
    }


def write_build(out: Path, packs: list[dict], *, capacity: int, packs_per_shard: int, row_group_size: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, len(packs), packs_per_shard)):
        rows = [pack_row(p) for p in packs[start : start + packs_per_shard]]
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        name = f"shard-{s:05d}.parquet"
        pq.write_table(table, out / name, row_group_size=row_group_size)
        data = (out / name).read_bytes()
        shards.append(
            {
                "file": name,
                "rows": len(rows),
                "tokens": sum(r["n_tokens"] for r in rows),
                "targets": sum(r["n_targets"] for r in rows),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    (out / "rejects.jsonl").write_text("")
    manifest = {
        "packtool_version": "0.1.0",
        "schema_version": 1,
        "mode": "packed",
        "capacity": capacity,
        "seed": 0,
        "config": {},
        "config_hash": "",
        "tokenizer": {"pad_token_id": 0},
        "conventions": {
            "labels": "hf_unshifted",
            "ignore_index": -100,
            "positions": "restart_per_segment",
            "attention": "block_diagonal_causal",
        },
        "shards": shards,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


@pytest.fixture
def make_build(tmp_path):
    """make_build(n_packs=40, capacity=32, packs_per_shard=15, row_group_size=4) -> (path, packs)."""

    def make(n_packs=40, capacity=32, packs_per_shard=15, row_group_size=4, seed=0, name="build"):
        packs = synthetic_packs(n_packs, capacity, seed=seed)
        return write_build(
            tmp_path / name, packs, capacity=capacity, packs_per_shard=packs_per_shard, row_group_size=row_group_size
        ), packs

    return make


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors: intra-op threads only add contention (a 6 ms step took 0.1-1 s with 2 threads on a busy box)."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
