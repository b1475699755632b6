"""Parquet shards and the manifest: the on-disk contract of docs/format.md.

Shards are written to a temporary name and renamed when closed; the manifest is written last
(packtool.format owns the schema, the manifest and pack_hash), so a folder without one is an
unfinished build. Every shard's rows, tokens, targets, bytes and
sha256 are recorded, and the same facts sit in each file's key-value metadata.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packtool.arrow import binaries, int32_offsets, list_values, lists, numbers, offsets_of, strings, true_counts
from packtool.errors import PackFormatError, PacktoolError, one_line
from packtool.format import (
    IGNORE_INDEX,
    MANIFEST,
    REJECTS,
    SCHEMA,
    SCHEMA_V2,
    TOKEN_COLUMNS,
    V2_COLUMNS,
    Manifest,
    ShardEntry,
    attn_cost,
    check_cu_seqlens,
    conventions,
    cu_seqlens_problem,
    first_broken_pack,
    pack_hash,
    read_manifest,
    sha256_file,
    vision_schema,
    write_json_atomic,
)

# Readers written before packtool.format existed import these names from here.
__all__ = [
    "MANIFEST",
    "REJECTS",
    "SCHEMA",
    "OutputPack",
    "PackColumns",
    "ShardInfo",
    "conventions",
    "locate",
    "pack_hash",
    "read_manifest",
    "read_row",
    "sha256_file",
    "shard_metadata",
    "write_json_atomic",
    "write_shard",
    "write_shards",
]


_TOKEN_NAMES = ", ".join(c.name for c in TOKEN_COLUMNS[:-1]) + f" and {TOKEN_COLUMNS[-1].name}"


@dataclass(frozen=True, slots=True)
class SegmentColumns:
    """Schema v2 per-segment values: group id (-1: plain sample), kind code, completion index, reward, advantage,
    piece number (WHOLE: the sample uncut) and the piece's first token's offset in its sample."""

    groups: np.ndarray
    kinds: np.ndarray
    completion_index: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray
    pieces: np.ndarray
    piece_offsets: np.ndarray


@dataclass(frozen=True, slots=True)
class ImageColumns:
    """A vision build's image columns (format.IMAGE_FIELDS): pack i's images are `offsets[i]:offsets[i + 1]`, in
    token order, each with its span [start, end) in the pack row and the document (segment) of the pack holding it.
    `mrope` (mRoPE families): each pack's temporal, height and width rows of positions, packs end to end."""

    offsets: np.ndarray  # int64 [packs + 1]
    refs: list[str]
    sha256: list[str]
    sizes: np.ndarray  # int64 [images]
    grids: np.ndarray  # int32 [images, 3]
    spans: np.ndarray  # int32 [images, 2]
    documents: np.ndarray  # int32 [images]
    data: list[bytes]  # empty: the image is read from its file
    mrope: np.ndarray | None  # int32 [3 * tokens]


@dataclass(frozen=True, slots=True)
class OutputPack:
    """One pack, ready to write. See docs/format.md for each column (format.TOKEN_COLUMNS: the per-token ones)."""

    input_ids: np.ndarray
    labels: np.ndarray
    cu_seqlens: np.ndarray
    doc_cu_seqlens: np.ndarray
    token_roles: np.ndarray
    sample_ids: list[str]
    sample_hashes: list[str]
    sample_repeats: list[int]
    sources: list[str]
    segments: SegmentColumns | None = None  # schema v2 only (builder.plan.shard_schema_version)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if any(len(getattr(self, column.name)) != n for column in TOKEN_COLUMNS):
            raise ValueError(f"{_TOKEN_NAMES} must have one entry per token")
        check_cu_seqlens(self.cu_seqlens, n)
        check_cu_seqlens(self.doc_cu_seqlens, n, "doc_cu_seqlens")
        if not len(self.sample_ids) == len(self.sample_hashes) == len(self.sources) == len(self.sample_repeats):
            raise ValueError("per-document columns differ in length")
        if self.segments is not None and len(self.segments.groups) != len(self.cu_seqlens) - 1:
            raise ValueError("per-segment columns need one entry per attention segment")

    @property
    def n_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def attn_cost(self) -> int:
        return attn_cost(self.cu_seqlens)

    @property
    def pack_hash(self) -> str:
        return pack_hash(self.input_ids, self.labels, self.cu_seqlens)


@dataclass(frozen=True, slots=True)
class PackColumns:
    """Packs laid end to end, as a shard's list columns hold them (docs/format.md has each column).

    Pack i is tokens `token_offsets[i]:token_offsets[i + 1]` of input_ids, labels and token_roles;
    its cu_seqlens (from 0) are `cu_seqlens[cu_offsets[i]:cu_offsets[i + 1]]`, its doc_cu_seqlens
    likewise; its documents are `document_offsets[i]:document_offsets[i + 1]` of the per-document
    columns, and `segments` (schema v2) holds one entry per attention segment, in order:

        two packs of 3 + 2 and 4 tokens   token_offsets [0 5 9]   cu_seqlens [0 3 5 | 0 4]   cu_offsets [0 3 5]
    """

    token_offsets: np.ndarray
    input_ids: np.ndarray
    labels: np.ndarray
    token_roles: np.ndarray
    cu_offsets: np.ndarray
    cu_seqlens: np.ndarray
    doc_cu_offsets: np.ndarray
    doc_cu_seqlens: np.ndarray
    document_offsets: np.ndarray
    sample_ids: list[str]
    sample_hashes: list[str]
    sample_repeats: np.ndarray
    sources: list[str]
    segments: SegmentColumns | None = None  # schema v2 only (builder.plan.shard_schema_version)
    images: ImageColumns | None = None  # a build whose config names an image processor

    def __post_init__(self) -> None:
        tokens = int(self.token_offsets[-1])
        if any(len(getattr(self, column.name)) != tokens for column in TOKEN_COLUMNS):
            raise ValueError(f"{_TOKEN_NAMES} must have one entry per token")
        for name, offsets, values in (
            ("cu_seqlens", self.cu_offsets, self.cu_seqlens),
            ("doc_cu_seqlens", self.doc_cu_offsets, self.doc_cu_seqlens),
        ):
            broken = first_broken_pack(self.token_offsets, self.token_offsets, offsets, values, None)
            if broken >= 0:
                start, end = offsets[broken], offsets[broken + 1]
                problem = cu_seqlens_problem(values[start:end], int(np.diff(self.token_offsets)[broken]))
                raise PackFormatError(f"pack {broken}: {name} {problem or 'misplaced'}")
        documents = np.diff(self.document_offsets)
        if not len(self.sample_ids) == len(self.sample_hashes) == len(self.sources) == len(self.sample_repeats):
            raise ValueError("per-document columns differ in length")
        if len(self.sample_ids) != self.document_offsets[-1] or (documents != np.diff(self.doc_cu_offsets) - 1).any():
            raise ValueError("each pack needs one document per doc_cu_seqlens segment")
        if self.segments is not None and len(self.segments.groups) != self.cu_offsets[-1] - self.packs:
            raise ValueError("per-segment columns need one entry per attention segment")

    @property
    def packs(self) -> int:
        return len(self.token_offsets) - 1

    @classmethod
    def of(cls, packs: list[OutputPack]) -> PackColumns:
        """The packs laid end to end."""

        segments = None
        if packs and packs[0].segments is not None:
            segments = SegmentColumns(
                **{
                    column.field: concatenated([getattr(p.segments, column.field) for p in packs], column.dtype)
                    for column in V2_COLUMNS
                }
            )
        return cls(
            token_offsets=offsets_of([p.input_ids for p in packs], np.int64),
            **{
                column.name: concatenated([getattr(p, column.name) for p in packs], column.dtype)
                for column in TOKEN_COLUMNS
            },
            cu_offsets=offsets_of([p.cu_seqlens for p in packs], np.int64),
            cu_seqlens=concatenated([p.cu_seqlens for p in packs], np.int32),
            doc_cu_offsets=offsets_of([p.doc_cu_seqlens for p in packs], np.int64),
            doc_cu_seqlens=concatenated([p.doc_cu_seqlens for p in packs], np.int32),
            document_offsets=offsets_of([p.sample_ids for p in packs], np.int64),
            sample_ids=[name for p in packs for name in p.sample_ids],
            sample_hashes=[digest for p in packs for digest in p.sample_hashes],
            sample_repeats=concatenated([np.asarray(p.sample_repeats) for p in packs], np.int32),
            sources=[source for p in packs for source in p.sources],
            segments=segments,
            images=None,  # packs one by one are a stream build's or a test's, never a vision build's
        )

    def n_targets(self) -> np.ndarray:
        """Each pack's labels that are not -100."""
        return true_counts(self.labels != IGNORE_INDEX, self.token_offsets[:-1], self.token_offsets[1:])

    def attn_cost(self) -> np.ndarray:
        """Each pack's sum of squared attention segment lengths (format.attn_cost)."""
        steps: np.ndarray = np.diff(self.cu_seqlens.astype(np.int64))
        steps[self.cu_offsets[1:-1] - 1] = 0  # from one pack's last offset to the next pack's 0: no segment
        running = np.zeros(len(self.cu_seqlens), dtype=np.int64)
        np.cumsum(steps * steps, out=running[1:])
        return running[self.cu_offsets[1:] - 1] - running[self.cu_offsets[:-1]]

    def pack_hashes(self) -> list[str]:
        tokens, cu = self.token_offsets.tolist(), self.cu_offsets.tolist()
        return [
            pack_hash(self.input_ids[a:b], self.labels[a:b], self.cu_seqlens[c:d])
            for a, b, c, d in zip(tokens, tokens[1:], cu, cu[1:])
        ]


def concatenated(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    """The arrays end to end as `dtype` (no copy beyond the concatenation); an empty one for none."""
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _lists_at(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    """A shard's list column: row i holds values[offsets[i]:offsets[i + 1]]."""
    return lists(int32_offsets(offsets), values)


def _table(packs: PackColumns) -> pa.Table:
    tokens, cu, documents = packs.token_offsets, packs.cu_offsets, packs.document_offsets
    columns = {
        **{c.name: _lists_at(tokens, numbers(getattr(packs, c.name), c.dtype)) for c in TOKEN_COLUMNS},
        "cu_seqlens": _lists_at(cu, numbers(packs.cu_seqlens, np.int32)),
        "doc_cu_seqlens": _lists_at(packs.doc_cu_offsets, numbers(packs.doc_cu_seqlens, np.int32)),
        "sample_ids": _lists_at(documents, strings(packs.sample_ids)),
        "sample_hashes": _lists_at(documents, strings(packs.sample_hashes)),
        "sample_repeats": _lists_at(documents, numbers(packs.sample_repeats, np.int32)),
        "sources": _lists_at(documents, strings(packs.sources)),
        "n_tokens": numbers(np.diff(tokens), np.int32),
        "n_targets": numbers(packs.n_targets(), np.int32),
        "attn_cost": numbers(packs.attn_cost(), np.int64),
        "pack_hash": strings(packs.pack_hashes()),
    }
    schema = SCHEMA
    if packs.segments is not None:
        schema = SCHEMA_V2
        segments = cu - np.arange(len(cu))  # a pack's attention segments: its offsets but one
        for column in V2_COLUMNS:
            values = numbers(getattr(packs.segments, column.field), column.dtype)
            columns[column.name] = _lists_at(segments, values)
    if packs.images is not None:
        columns |= _image_columns(packs.images, tokens)
        schema = vision_schema(schema, mrope=packs.images.mrope is not None)
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def _image_columns(images: ImageColumns, token_offsets: np.ndarray) -> dict[str, pa.Array]:
    at = images.offsets
    columns = {
        "image_refs": _lists_at(at, strings(images.refs)),
        "image_sha256": _lists_at(at, strings(images.sha256)),
        "image_sizes": _lists_at(at, numbers(images.sizes, np.int64)),
        "image_grids": _lists_at(3 * at, numbers(images.grids.reshape(-1), np.int32)),
        "image_spans": _lists_at(2 * at, numbers(images.spans.reshape(-1), np.int32)),
        "image_documents": _lists_at(at, numbers(images.documents, np.int32)),
        "image_data": _lists_at(at, binaries(images.data)),
    }
    if images.mrope is not None:
        columns["mrope_positions"] = _lists_at(3 * token_offsets, numbers(images.mrope, np.int32))
    return columns


@dataclass(frozen=True, slots=True)
class ShardInfo:
    file: str
    rows: int
    tokens: int
    targets: int
    bytes: int
    sha256: str


def write_shards(
    packs: Iterable[OutputPack], folder: Path, *, rows_per_shard: int, row_group_rows: int, metadata: dict[str, str]
) -> list[ShardInfo]:
    """Write packs into numbered shards in one process (the build writes each shard as its own work item)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[ShardInfo] = []
    buffer: list[OutputPack] = []
    for pack in packs:
        buffer.append(pack)
        if len(buffer) == rows_per_shard:
            path = folder / f"shard-{len(shards):05d}.parquet"
            shards.append(write_shard(PackColumns.of(buffer), path, row_group_rows=row_group_rows, metadata=metadata))
            buffer = []
    if buffer:
        path = folder / f"shard-{len(shards):05d}.parquet"
        shards.append(write_shard(PackColumns.of(buffer), path, row_group_rows=row_group_rows, metadata=metadata))
    return shards


# image_data and mrope_positions: image bytes repeat only as often as an image does, positions as ids do
_PLAIN_COLUMNS = ("input_ids", "labels", "mrope_positions", "image_data")


def write_shard(packs: PackColumns, path: Path, *, row_group_rows: int, metadata: dict[str, str]) -> ShardInfo:
    """Write one shard under a temporary name and rename it: a shard on disk is always complete."""
    table = _table(packs)
    table = table.replace_schema_metadata(
        {**(table.schema.metadata or {}), **{k.encode(): v.encode() for k, v in metadata.items()}}
    )
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    # Fixed writer options: the same packs give the same bytes (no created_by drift within a pyarrow version).
    # Token ids and labels are not dictionary-encoded: a vocabulary of 10^5 ids gains nothing from a
    # dictionary, and without one the quickstart's shards are 13% smaller and read 11% faster.
    pq.write_table(
        table,
        temporary,
        row_group_size=row_group_rows,
        compression="zstd",
        use_dictionary=[name for name in table.column_names if name not in _PLAIN_COLUMNS],
        write_statistics=False,
    )
    os.replace(temporary, path)
    return ShardInfo(
        file=path.name,
        rows=packs.packs,
        tokens=int(packs.token_offsets[-1]),
        targets=int(packs.n_targets().sum()),
        bytes=path.stat().st_size,
        sha256=sha256_file(path),
    )


# What a damaged Parquet file raises while being opened or decoded (corrupt pages, bad thrift, short reads).
READ_ERRORS = (pa.ArrowException, OSError, ValueError, EOFError, IndexError, KeyError)


def listed_shards(manifest: Manifest) -> list[Path]:
    """The shard files a manifest (checked by format.read_manifest) lists, each checked by `listed_shard`."""
    return [listed_shard(manifest.folder, entry) for entry in manifest.shards]


def listed_shard(folder: Path, entry: ShardEntry) -> Path:
    """One listed shard: a regular file inside `folder` of the size the manifest records, so a truncated, missing
    or swapped shard is one line before anything is read.

    Sizes only (a stat): the sha256 of every byte is `packtool verify`'s and the loader's check.
    """
    path = entry.file
    if not path.is_file():
        raise PackFormatError(f"{path}: listed in {folder / MANIFEST} but missing (or not a regular file)")
    if not path.resolve().is_relative_to(folder.resolve()):
        raise PackFormatError(
            f"{path}: a link to {path.resolve()}, outside the output folder {folder.resolve()}; "
            "shards are files inside it"
        )
    size = path.stat().st_size
    if size != entry.bytes:
        raise PackFormatError(
            f"{path}: {size} bytes, {MANIFEST} says {entry.bytes}: truncated or replaced since the build "
            "(or a build replaced the output while it was read); rebuild it, `packtool verify` checks it"
        )
    return path


def locate(path: str | Path) -> tuple[Path, Manifest | None, list[Path]]:
    """An output folder or one shard -> (folder, manifest or None, shard files)."""
    path = Path(path)
    if path.is_dir():
        listed = read_manifest(path)
        return path, listed, listed_shards(listed)
    if path.is_file() and path.suffix == ".parquet":
        manifest = read_manifest(path.parent) if (path.parent / MANIFEST).is_file() else None
        listed_as = [e for e in manifest.shards if e.file.name == path.name] if manifest else []
        entry = listed_as[0] if listed_as else None
        return path.parent, manifest, [path if entry is None else listed_shard(path.parent, entry)]
    raise PacktoolError(f"{path}: expected an output folder or a .parquet shard")


def schema_problem(schema: pa.Schema) -> str | None:
    """Why a Parquet schema is not the shard schema of docs/format.md (v1 or v2, with images or not), or None when
    it is."""
    actual = pa.schema(list(schema))  # without metadata
    expected = SCHEMA_V2 if "segment_groups" in actual.names else SCHEMA
    if "image_refs" in actual.names:
        expected = vision_schema(expected, mrope="mrope_positions" in actual.names)
    for field in expected:
        if field.name not in actual.names:
            return f"no column {field.name!r}: not a shard of this packtool's schema (docs/format.md); rebuild it"
        if not actual.field(field.name).equals(field):
            return f"column {field.name!r} is {actual.field(field.name).type}, the shard schema has {field.type}"
    extra = [name for name in actual.names if name not in expected.names]
    if extra or actual.names != expected.names:
        return f"columns {extra or actual.names} are not the shard schema's (docs/format.md): not a packtool shard"
    return None


def footer_problem(meta: pq.FileMetaData) -> str | None:
    """Why a Parquet footer contradicts itself (its row count against its row groups'), or None.

    A footer claiming a billion rows over row groups of 200 would send a reader looking for rows
    that are not there."""
    held = sum(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    if held != meta.num_rows:
        return f"its footer claims {meta.num_rows} rows, its row groups hold {held}: a damaged file"
    return None


def open_shard(path: Path) -> pq.ParquetFile:
    """A shard's Parquet reader, its columns checked against the shard schema; a damaged or foreign file is one line."""
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except READ_ERRORS as error:
        raise PackFormatError(
            f"{path}: cannot be read as Parquet ({type(error).__name__}: {one_line(error)}): a damaged or foreign "
            "file; rebuild the output (`packtool verify` checks it)"
        ) from None
    problem = schema_problem(schema) or footer_problem(parquet.metadata)
    if problem is not None:
        raise PackFormatError(f"{path}: {problem}")
    return parquet


def read_group(path: Path, parquet: pq.ParquetFile, group: int | None, columns: list[str] | None = None) -> pa.Table:
    """Row group `group` of an open shard (None: the whole file), its decode errors and null values one line
    naming the file and group."""
    try:
        table = parquet.read(columns=columns) if group is None else parquet.read_row_group(group, columns=columns)
    except READ_ERRORS as error:
        raise PackFormatError(
            f"{path}: row group {group or 0} cannot be decoded ({type(error).__name__}: {one_line(error)}): the file "
            "is damaged, or was replaced while being read; rebuild it (`packtool verify` checks it)"
        ) from None
    for name, column in zip(table.column_names, table.columns):
        listed = pa.types.is_list(column.type)
        if column.null_count or (listed and any(list_values(chunk).null_count for chunk in column.chunks)):
            raise PackFormatError(f"{path}: null values in {name} (packtool never writes nulls): a damaged file")
    return table


def shard_metadata(path: Path) -> dict[str, str]:
    raw = open_shard(path).schema_arrow.metadata or {}
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}


def read_columns(path: Path, columns: list[str], segment_columns: list[str] | None = None) -> pa.Table:
    """Whole columns of a shard, plus `segment_columns` where the shard has them (schema 2).

    Through ParquetFile: `pq.read_table` goes through pyarrow.dataset, which imports pandas when it is
    installed (packtool.arrow)."""
    parquet = open_shard(path)
    present = set(parquet.schema_arrow.names)
    wanted = columns + [name for name in segment_columns or [] if name in present]
    return read_group(path, parquet, None, wanted)


def read_row(path: Path, index: int) -> dict[str, Any]:
    parquet = open_shard(path)
    total = parquet.metadata.num_rows
    if not 0 <= index < total:
        raise PacktoolError(f"{path}: row {index} out of range (the shard has {total} rows)")
    start = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if index < start + rows:
            return read_group(path, parquet, group).slice(index - start, 1).to_pylist()[0]
        start += rows
    raise AssertionError("unreachable: open_shard checked the footer's rows against its row groups")
