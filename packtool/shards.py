"""Parquet shards and the manifest: the on-disk contract of docs/format.md.

Shards are written to `NAME.tmp` and renamed when closed; the manifest is written last, so a
folder without one is an unfinished build. Every shard's rows, tokens, targets, bytes and
sha256 are recorded, and the same facts sit in each file's key-value metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packtool import SCHEMA_VERSION
from packtool.errors import PacktoolError
from packtool.labels import IGNORE_INDEX

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"

SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("labels", pa.list_(pa.int32())),
        pa.field("cu_seqlens", pa.list_(pa.int32())),
        pa.field("doc_cu_seqlens", pa.list_(pa.int32())),
        pa.field("token_roles", pa.list_(pa.int8())),
        pa.field("sample_ids", pa.list_(pa.string())),
        pa.field("sample_hashes", pa.list_(pa.string())),
        pa.field("sample_repeats", pa.list_(pa.int32())),
        pa.field("sources", pa.list_(pa.string())),
        pa.field("n_tokens", pa.int32()),
        pa.field("n_targets", pa.int32()),
        pa.field("attn_cost", pa.int64()),
        pa.field("pack_hash", pa.string()),
    ],
    metadata={"packtool.schema_version": str(SCHEMA_VERSION)},
)


def conventions(stream: bool) -> dict[str, Any]:
    """How to read labels, positions and attention in an output (the manifest's `conventions`)."""
    return {
        "labels": "hf_unshifted",  # the model shifts: logits at t predict labels[t + 1]
        "ignore_index": IGNORE_INDEX,
        "positions": "continuous" if stream else "restart_per_segment",
        "attention": "causal_across_documents" if stream else "block_diagonal_causal",
    }


@dataclass(frozen=True, slots=True)
class PackRow:
    """One pack, ready to write. See docs/format.md for each column."""

    input_ids: np.ndarray
    labels: np.ndarray
    cu_seqlens: np.ndarray
    doc_cu_seqlens: np.ndarray
    token_roles: np.ndarray
    sample_ids: list[str]
    sample_hashes: list[str]
    sample_repeats: list[int]
    sources: list[str]

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.labels) != n or len(self.token_roles) != n:
            raise ValueError("input_ids, labels and token_roles must have one entry per token")
        for name in ("cu_seqlens", "doc_cu_seqlens"):
            cu = getattr(self, name)
            if cu[0] != 0 or cu[-1] != n or (np.diff(cu) <= 0).any():
                raise ValueError(f"{name} {cu.tolist()} must start at 0, increase strictly and end at {n}")
        if not len(self.sample_ids) == len(self.sample_hashes) == len(self.sources) == len(self.sample_repeats):
            raise ValueError("per-document columns differ in length")

    @property
    def n_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def attn_cost(self) -> int:
        lengths = np.diff(self.cu_seqlens.astype(np.int64))
        return int((lengths**2).sum())

    @property
    def pack_hash(self) -> str:
        return pack_hash(self.input_ids, self.labels, self.cu_seqlens)


def pack_hash(input_ids: np.ndarray, labels: np.ndarray, cu_seqlens: np.ndarray) -> str:
    """sha256 (first 16 bytes, hex) over the three arrays as little-endian int32."""
    digest = hashlib.sha256()
    for array in (input_ids, labels, cu_seqlens):
        digest.update(np.ascontiguousarray(array, dtype="<i4").tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:32]


def _table(rows: list[PackRow]) -> pa.Table:
    def lists(name: str, dtype: Any) -> pa.Array:
        arrays = [getattr(r, name) for r in rows]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))

    columns = {
        "input_ids": lists("input_ids", np.int32),
        "labels": lists("labels", np.int32),
        "cu_seqlens": lists("cu_seqlens", np.int32),
        "doc_cu_seqlens": lists("doc_cu_seqlens", np.int32),
        "token_roles": lists("token_roles", np.int8),
        "sample_ids": pa.array([r.sample_ids for r in rows], pa.list_(pa.string())),
        "sample_hashes": pa.array([r.sample_hashes for r in rows], pa.list_(pa.string())),
        "sample_repeats": pa.array([r.sample_repeats for r in rows], pa.list_(pa.int32())),
        "sources": pa.array([r.sources for r in rows], pa.list_(pa.string())),
        "n_tokens": pa.array([len(r.input_ids) for r in rows], pa.int32()),
        "n_targets": pa.array([r.n_targets for r in rows], pa.int32()),
        "attn_cost": pa.array([r.attn_cost for r in rows], pa.int64()),
        "pack_hash": pa.array([r.pack_hash for r in rows], pa.string()),
    }
    return pa.table(columns, schema=SCHEMA)


@dataclass(frozen=True, slots=True)
class ShardInfo:
    file: str
    rows: int
    tokens: int
    targets: int
    bytes: int
    sha256: str


def write_shards(
    rows: Iterable[PackRow], folder: Path, *, rows_per_shard: int, row_group_rows: int, metadata: dict[str, str]
) -> list[ShardInfo]:
    """Write packs into numbered shards; each shard is complete on disk before the next starts."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[ShardInfo] = []
    buffer: list[PackRow] = []
    for row in rows:
        buffer.append(row)
        if len(buffer) == rows_per_shard:
            shards.append(_write_one(buffer, folder / f"shard-{len(shards):05d}.parquet", row_group_rows, metadata))
            buffer = []
    if buffer:
        shards.append(_write_one(buffer, folder / f"shard-{len(shards):05d}.parquet", row_group_rows, metadata))
    return shards


def _write_one(rows: list[PackRow], path: Path, row_group_rows: int, metadata: dict[str, str]) -> ShardInfo:
    table = _table(rows)
    table = table.replace_schema_metadata(
        {**(table.schema.metadata or {}), **{k.encode(): v.encode() for k, v in metadata.items()}}
    )
    temporary = path.with_name(path.name + ".tmp")
    # Fixed writer options: the same packs give the same bytes (no created_by drift within a pyarrow version).
    pq.write_table(
        table, temporary, row_group_size=row_group_rows, compression="zstd", use_dictionary=True, write_statistics=False
    )
    os.replace(temporary, path)
    return ShardInfo(
        file=path.name,
        rows=len(rows),
        tokens=int(sum(len(r.input_ids) for r in rows)),
        targets=int(sum(r.n_targets for r in rows)),
        bytes=path.stat().st_size,
        sha256=sha256_file(path),
    )


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: Path, value: Any) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise PacktoolError(f"{folder}: no {MANIFEST}; not a packtool output folder, or the build did not finish")
    return json.loads(path.read_text(encoding="utf-8"))


def locate(path: str | Path) -> tuple[Path, dict[str, Any] | None, list[Path]]:
    """An output folder or one shard -> (folder, manifest or None, shard files)."""
    path = Path(path)
    if path.is_dir():
        manifest = read_manifest(path)
        return path, manifest, [path / s["file"] for s in manifest["shards"]]
    if path.is_file() and path.suffix == ".parquet":
        manifest_path = path.parent / MANIFEST
        manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else None
        return path.parent, manifest, [path]
    raise PacktoolError(f"{path}: expected an output folder or a .parquet shard")


def shard_metadata(path: Path) -> dict[str, str]:
    raw = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in raw.items()}


def iter_rows(path: Path, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Rows of a shard as Python objects, one row group at a time."""
    parquet = pq.ParquetFile(path)
    for group in range(parquet.num_row_groups):
        yield from parquet.read_row_group(group, columns=columns).to_pylist()


def read_row(path: Path, index: int) -> dict[str, Any]:
    parquet = pq.ParquetFile(path)
    total = parquet.metadata.num_rows
    if not 0 <= index < total:
        raise PacktoolError(f"{path}: row {index} out of range (the shard has {total} rows)")
    start = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if index < start + rows:
            return parquet.read_row_group(group).slice(index - start, 1).to_pylist()[0]
        start += rows
    raise AssertionError("unreachable: index checked against num_rows")
