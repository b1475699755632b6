"""PackColumns: packs laid end to end give the columns, counts and hashes that each pack gives on its own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtool.builder.store import PARTITION_SCHEMA
from packtool.errors import PackFormatError
from packtool.format import SCHEMA, TOKEN_COLUMNS, V2_COLUMNS
from packtool.labels import cu_seqlens_from_lengths, labels_for
from packtool.shards import OutputPack, PackColumns, SegmentColumns, _table, write_shard


def random_pack(rng: np.random.Generator, v2: bool) -> OutputPack:
    lengths = rng.integers(1, 9, size=rng.integers(1, 5))
    cu = cu_seqlens_from_lengths(lengths)
    ids = rng.integers(0, 1000, size=int(cu[-1])).astype(np.int32)
    n = len(lengths)
    segments = None
    if v2:
        segments = SegmentColumns(
            groups=rng.integers(-1, 3, n),
            kinds=rng.integers(0, 4, n).astype(np.int8),
            completion_index=rng.integers(-1, 2, n).astype(np.int16),
            rewards=rng.random(n),
            advantages=rng.random(n),
            pieces=rng.integers(-1, 2, n).astype(np.int32),
            piece_offsets=rng.integers(0, 9, n).astype(np.int32),
        )
    return OutputPack(
        input_ids=ids,
        labels=labels_for(ids, rng.random(len(ids)) < 0.6, cu),
        cu_seqlens=cu,
        doc_cu_seqlens=cu,
        token_roles=rng.integers(0, 4, len(ids)).astype(np.int8),
        sample_ids=[f"s{rng.integers(1000)}" for _ in range(n)],
        sample_hashes=[f"{rng.integers(1 << 30):032x}" for _ in range(n)],
        sample_repeats=rng.integers(0, 3, n).tolist(),
        sources=[str(rng.choice(["chat", "docs"])) for _ in range(n)],
        segments=segments,
    )


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_table_of_packs_end_to_end_holds_each_packs_own_values(seed, v2):
    rng = np.random.default_rng(seed)
    packs = [random_pack(rng, v2) for _ in range(int(rng.integers(1, 12)))]
    rows = _table(PackColumns.of(packs)).to_pylist()
    assert len(rows) == len(packs)
    for row, pack in zip(rows, packs):
        for name in ("input_ids", "labels", "cu_seqlens", "doc_cu_seqlens", "token_roles"):
            assert row[name] == getattr(pack, name).tolist()
        assert row["sample_ids"] == pack.sample_ids and row["sample_hashes"] == pack.sample_hashes
        assert row["sample_repeats"] == pack.sample_repeats and row["sources"] == pack.sources
        assert row["n_tokens"] == len(pack.input_ids) and row["n_targets"] == pack.n_targets
        assert row["attn_cost"] == pack.attn_cost and row["pack_hash"] == pack.pack_hash
        for column in V2_COLUMNS if v2 else ():
            assert np.array_equal(row[column.name], getattr(pack.segments, column.field))


def test_no_packs_make_an_empty_table(tmp_path):
    info = write_shard(PackColumns.of([]), tmp_path / "s.parquet", row_group_rows=8, metadata={})
    assert (info.rows, info.tokens, info.targets) == (0, 0, 0)
    assert pq.read_table(tmp_path / "s.parquet").num_rows == 0


def test_broken_offsets_name_the_pack():
    rng = np.random.default_rng(0)
    columns = PackColumns.of([random_pack(rng, False) for _ in range(3)])
    cu = columns.cu_seqlens.copy()
    cu[columns.cu_offsets[2]] = 1  # pack 2's cu_seqlens no longer starts at 0
    with pytest.raises(PackFormatError, match="pack 2: cu_seqlens must start at 0"):
        PackColumns(**{**_fields(columns), "cu_seqlens": cu})
    with pytest.raises(ValueError, match="one entry per token"):
        PackColumns(**{**_fields(columns), "labels": columns.labels[:-1]})
    with pytest.raises(ValueError, match="per-document columns differ"):
        PackColumns(**{**_fields(columns), "sources": columns.sources[:-1]})


def test_the_token_column_table_is_the_shard_schema_the_packs_and_the_store() -> None:
    """One row of format.TOKEN_COLUMNS is a per-token column everywhere: the shard's type, a field of both pack
    records, and (when the store keeps it) the store's type, so emit gathers it without a cast."""
    for column in TOKEN_COLUMNS:
        assert SCHEMA.field(column.name).type == pa.list_(column.arrow), column.name
        assert pa.from_numpy_dtype(column.dtype) == column.arrow, column.name
        for record in (OutputPack, PackColumns):
            assert column.name in {f.name for f in dataclasses.fields(record)}, (record, column.name)
        if column.stored is not None:
            assert PARTITION_SCHEMA.field(column.stored).type == pa.large_list(column.arrow), column.name
    rng = np.random.default_rng(1)
    columns = PackColumns.of([random_pack(rng, False) for _ in range(2)])
    for column in TOKEN_COLUMNS:
        assert getattr(columns, column.name).dtype == column.dtype
        with pytest.raises(ValueError, match="input_ids, labels and token_roles must have one entry per token"):
            PackColumns(**{**_fields(columns), column.name: getattr(columns, column.name)[:-1]})


def _fields(columns: PackColumns) -> dict:
    return {name: getattr(columns, name) for name in PackColumns.__slots__}
