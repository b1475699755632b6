"""Token-store partitions: the tokenized samples of one encode work item, on disk, memory-mapped when read.

    encode --PartitionWriter.append--> PART.arrow (Arrow IPC file, record batches of BATCH_ROWS samples)
    encode --RejectsWriter.append-->   PART.rejects.arrow (each record read and not stored, with its reason)
    plan   <--column(name)--            scalar columns, read without touching any token; the rejects table
                                        batch by batch (read_rejects), never whole
    emit   <--get(row)--                numpy views of the mapped buffers: a pack pages in its own samples only

Columns, one row per sample (token columns share their offsets):

    input_ids large_list<int32>   targets large_list<uint8>   roles large_list<int8>   message_index large_list<int16>
    example_id, sample_hash, location: string    ordinal: int64 (record number in its file, rejects included)
    length, n_targets: int32    special_literal: uint8 (content spells a control token)
    message_roles: list<string>    structured: list<int32>
    kind: int8 (format.KIND_CODES)    completion: int16 (-1 unless a group's)
    reward, advantage: float64 (NaN: none)
    images: list<struct>: the sample's images in token order (records.PlacedImage's fields; data empty: none)
    straddled: int32 (target tokens that start in the prompt)    reported: uint8 (kept with an eval overlap; a
    record's first row)    what the accounting sums within max_samples, so no report lists them per record

The segments of one pair or group are consecutive rows with the same ordinal (their record's).

`message_index`, `message_roles` and `structured` are what truncation needs; emit reads only the first
three token columns, the provenance strings and the images (a text sample's empty list costs emit one
comparison of two offsets).
"""

from __future__ import annotations

import json
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import pyarrow as pa

from packtool.arrow import (
    as_numpy,
    binaries,
    lists,
    number_lists,
    numbers,
    offsets_of,
    string_lists,
    strings,
    true_counts,
)
from packtool.errors import BuildError
from packtool.format import TOKEN_COLUMNS
from packtool.records import PlacedImage, Tokenized

BATCH_ROWS = 4096  # samples per record batch: small enough to buffer, large enough to amortize headers

_IN_SHARDS = {column.stored: column.dtype for column in TOKEN_COLUMNS if column.stored is not None}
# The token columns, one value per token, sharing their offsets, named as Tokenized's fields. Those a shard holds
# have its type (format.TOKEN_COLUMNS), so emit gathers them without a cast. Targets are uint8, not bool, so that
# reading a sample back is a zero-copy view (Arrow packs booleans into bits).
TOKEN_DTYPES: dict[str, type] = {
    "input_ids": _IN_SHARDS["input_ids"],
    "targets": np.uint8,
    "roles": _IN_SHARDS["roles"],
    "message_index": np.int16,
}
# One image of a sample: records.PlacedImage, its grid (t, h, w) as three values, `data` empty when it has none.
IMAGE_TYPE = pa.struct(
    [
        pa.field("reference", pa.string()),
        pa.field("sha256", pa.string()),
        pa.field("n_bytes", pa.int64()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("grid", pa.list_(pa.int32(), 3)),
        pa.field("start", pa.int32()),
        pa.field("end", pa.int32()),
        pa.field("data", pa.binary()),
    ]
)
# large_list: a batch of BATCH_ROWS long samples can pass 2^31 tokens.
PARTITION_SCHEMA = pa.schema(
    [
        *(pa.field(name, pa.large_list(pa.from_numpy_dtype(dtype))) for name, dtype in TOKEN_DTYPES.items()),
        pa.field("example_id", pa.string()),
        pa.field("sample_hash", pa.string()),
        pa.field("location", pa.string()),
        pa.field("ordinal", pa.int64()),
        pa.field("length", pa.int32()),
        pa.field("n_targets", pa.int32()),
        pa.field("special_literal", pa.uint8()),
        pa.field("message_roles", pa.list_(pa.string())),
        pa.field("structured", pa.list_(pa.int32())),
        pa.field("kind", pa.int8()),
        pa.field("completion", pa.int16()),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("images", pa.list_(IMAGE_TYPE)),
        pa.field("straddled", pa.int32()),
        pa.field("reported", pa.uint8()),
    ]
)


@dataclass(frozen=True, slots=True)
class SegmentRole:
    """What a stored row is within its item: a plain sample (the default), a pair's side, a group's completion."""

    kind: int = 0  # format.KIND_CODES
    completion: int = -1
    reward: float = math.nan
    advantage: float = math.nan


SINGLE = SegmentRole()


@dataclass(frozen=True, slots=True)
class StoredSample:
    """What emit needs of a sample (message structure is only needed before truncation)."""

    input_ids: np.ndarray
    targets: np.ndarray
    roles: np.ndarray
    example_id: str
    sample_hash: str
    source: str
    repeat: int = 0
    role: SegmentRole = SINGLE
    images: tuple[PlacedImage, ...] = ()

    def __len__(self) -> int:
        return len(self.input_ids)


class StoredParts(NamedTuple):
    """A StoredSample's fields that its partition holds (emit gathers these for every segment of a shard)."""

    input_ids: np.ndarray
    targets: np.ndarray
    roles: np.ndarray
    example_id: str
    sample_hash: str
    role: SegmentRole
    images: tuple[PlacedImage, ...] = ()


class PartitionWriter:
    """Append-only; `close()` finishes the file. Rows are numbered in append order from 0.

    A row is kept as it comes (one tuple per row) and each column is built at flush from all the
    rows of the batch at once (one list comprehension or one numpy concatenation per column):
    filling sixteen column lists row by row cost more than the rest of the write.
    """

    def __init__(self, path: Path, source: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.rows = 0
        self.tokens = 0
        schema = PARTITION_SCHEMA.with_metadata({"packtool.source": source})
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, schema)
        self._schema = schema
        self._pending: list[StoredRow] = []

    def append(
        self,
        sample: Tokenized,
        location: str,
        ordinal: int,
        special_literal: bool = False,
        role: SegmentRole = SINGLE,
        reported: bool = False,
    ) -> int:
        self._pending.append((sample, location, ordinal, special_literal, role, reported))
        self.rows += 1
        self.tokens += len(sample.input_ids)
        if len(self._pending) == BATCH_ROWS:
            self._flush()
        return self.rows - 1

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        samples = [row[0] for row in pending]
        roles = [row[4] for row in pending]
        offsets = offsets_of([sample.input_ids for sample in samples], np.int64)
        tokens: dict[str, np.ndarray] = {
            name: np.concatenate([getattr(sample, name) for sample in samples]).astype(dtype, copy=False)
            for name, dtype in TOKEN_DTYPES.items()
        }
        arrays = {
            **{name: lists(offsets, numbers(values)) for name, values in tokens.items()},
            "example_id": strings([sample.example_id for sample in samples]),
            "sample_hash": strings([sample.sample_hash for sample in samples]),
            "location": strings([row[1] for row in pending]),
            "ordinal": numbers([row[2] for row in pending], np.int64),
            "length": numbers(np.diff(offsets), np.int32),
            "n_targets": numbers(_n_targets(tokens["targets"], offsets)),
            "special_literal": numbers([row[3] for row in pending], np.uint8),
            "message_roles": string_lists([sample.message_roles for sample in samples]),
            "structured": number_lists([sorted(sample.structured_messages) for sample in samples], np.int32),
            "kind": numbers([role.kind for role in roles], np.int8),
            "completion": numbers([role.completion for role in roles], np.int16),
            "reward": numbers([role.reward for role in roles], np.float64),
            "advantage": numbers([role.advantage for role in roles], np.float64),
            "images": image_lists([sample.images for sample in samples]),
            "straddled": numbers([sample.straddled for sample in samples], np.int32),
            "reported": numbers([row[5] for row in pending], np.uint8),
        }
        self._writer.write_batch(pa.record_batch([arrays[name] for name in self._schema.names], schema=self._schema))
        self._pending = []

    def extend(self, partition: Path) -> None:
        """Append every row of another partition (what a grown range carries over from its earlier entry) as
        appending them one by one would. While no row is pending, a full batch is written as it was read, with
        no Python per row: an Arrow IPC batch read and written again keeps its bytes, which are the bytes this
        writer builds from the same rows (a grown compressed file carries all its earlier rows over, ~27 us a
        row one by one: 0.7 s of 20 x quickstart chat)."""
        with pa.OSFile(str(partition), "rb") as handle:
            reader = pa.ipc.open_file(handle)
            source = _source_of(reader.schema)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                if self._pending or batch.num_rows != BATCH_ROWS:
                    for row in _stored_rows(batch, source):
                        self.append(*row)
                    continue
                self._writer.write_batch(batch)
                offsets = batch.column("input_ids").offsets
                self.rows += batch.num_rows
                self.tokens += offsets[-1].as_py() - offsets[0].as_py()

    def close(self) -> None:
        if self._sink.closed:
            return
        self._flush()
        self._writer.close()
        self._sink.close()


def _n_targets(targets: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Tokenized.n_targets of every row at once: its targets but its first token's.

    targets  [0 1 1 | 1 0 1 | ]     offsets [0 3 6 6]
    sums       2       2      0     first tokens 0, 1, (none)     n_targets [2 1 0]
    """
    counts = true_counts(targets, offsets[:-1], offsets[1:])
    starts = offsets[:-1][offsets[1:] > offsets[:-1]]
    counts[offsets[1:] > offsets[:-1]] -= targets[starts]
    return counts.astype(np.int32)


def image_lists(rows: list[tuple[PlacedImage, ...]]) -> pa.Array:
    """The `images` column of these rows (IMAGE_TYPE lists)."""
    images = [image for row in rows for image in row]
    grids = np.array([image.grid for image in images], dtype=np.int32).reshape(-1)
    fields = {
        "reference": strings([image.reference for image in images]),
        "sha256": strings([image.sha256 for image in images]),
        "n_bytes": numbers([image.n_bytes for image in images], np.int64),
        "width": numbers([image.width for image in images], np.int32),
        "height": numbers([image.height for image in images], np.int32),
        "grid": pa.FixedSizeListArray.from_arrays(numbers(grids), 3),
        "start": numbers([image.start for image in images], np.int32),
        "end": numbers([image.end for image in images], np.int32),
        "data": binaries([image.data or b"" for image in images]),
    }
    values = pa.StructArray.from_arrays(list(fields.values()), fields=list(IMAGE_TYPE))
    return lists(offsets_of(rows), values)


def images_at(column: pa.ListArray, r: int) -> tuple[PlacedImage, ...]:
    """Row r's images, as the writer was given them."""
    offsets = column.offsets
    start, end = offsets[r].as_py(), offsets[r + 1].as_py()
    if start == end:
        return ()
    return tuple(
        PlacedImage(
            reference=cell["reference"],
            sha256=cell["sha256"],
            n_bytes=cell["n_bytes"],
            width=cell["width"],
            height=cell["height"],
            grid=tuple(cell["grid"]),
            start=cell["start"],
            end=cell["end"],
            data=cell["data"] or None,
        )
        for cell in column.values.slice(start, end - start).to_pylist()
    )


StoredRow = tuple[Tokenized, str, int, bool, SegmentRole, bool]  # PartitionWriter.append's arguments


def _source_of(schema: pa.Schema) -> str:
    return (schema.metadata or {}).get(b"packtool.source", b"").decode()


def _stored_rows(batch: pa.RecordBatch, source: str) -> Iterator[StoredRow]:
    """Every row of a partition's batch as the arguments that wrote it, so that appending them writes the same
    rows. Columns become Python lists once per batch (one conversion per column, not per cell)."""
    offsets = as_numpy(batch.column("input_ids").offsets)
    tokens = {name: as_numpy(batch.column(name).values) for name in TOKEN_DTYPES}
    cells = {name: batch.column(name).to_pylist() for name in _ROW_COLUMNS}
    images = batch.column("images")
    for r in range(batch.num_rows):
        start, end = offsets[r], offsets[r + 1]
        sample = Tokenized(
            example_id=cells["example_id"][r],
            source=source,
            sample_hash=cells["sample_hash"][r],
            input_ids=tokens["input_ids"][start:end],
            targets=tokens["targets"][start:end].view(bool),
            roles=tokens["roles"][start:end],
            message_index=tokens["message_index"][start:end],
            message_roles=tuple(cells["message_roles"][r]),
            structured_messages=frozenset(cells["structured"][r]),
            straddled=cells["straddled"][r],
            images=images_at(images, r),
        )
        role = SegmentRole(cells["kind"][r], cells["completion"][r], cells["reward"][r], cells["advantage"][r])
        literal, reported = bool(cells["special_literal"][r]), bool(cells["reported"][r])
        yield sample, cells["location"][r], cells["ordinal"][r], literal, role, reported


_ROW_COLUMNS = (
    *("example_id", "sample_hash", "location", "ordinal", "special_literal", "message_roles", "structured"),
    *("kind", "completion", "reward", "advantage", "straddled", "reported"),
)


class PartitionReader:
    """Random access to one partition's samples by row, reading from a memory map.

    A page of the map read once stays mapped (counted in the process's RssFile) until the map goes or
    `drop_pages()` unmaps what was read: emit keeps its readers open across the shards it writes, and
    without dropping them after each shard held ~1 KB a sample of the whole build at its end (issue 43).
    """

    def __init__(self, path: Path):
        self.path = path
        # Python's mmap, not pyarrow's: only it can madvise. Arrow reads from it without a copy.
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        reader = pa.ipc.open_file(pa.py_buffer(self._map))
        self.source = _source_of(reader.schema)
        self._batches = [_Batch(reader.get_batch(i)) for i in range(reader.num_record_batches)]
        self.rows = sum(b.rows for b in self._batches)

    def column(self, name: str) -> np.ndarray:
        """One scalar column of every row (length, n_targets, ordinal) as a numpy array."""
        parts = [as_numpy(b.batch.column(name)) for b in self._batches]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def batch_column(self, name: str) -> list:
        """One string column of every row as Python values (a cache entry's images, its locations)."""
        return [value for b in self._batches for value in b.batch.column(name).to_pylist()]

    def hash_numbers(self) -> np.ndarray:
        """Every row's sample_hash as the number its first 16 hex digits spell (the validation split's key)."""
        parts = [hex_prefixes(b.batch.column("sample_hash"), self.path) for b in self._batches]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)

    def get(self, row: int, repeat: int = 0) -> StoredSample:
        parts = self.parts(row)
        return StoredSample(*parts[:5], source=self.source, repeat=repeat, role=parts.role, images=parts.images)

    def parts(self, row: int) -> StoredParts:
        """What emit gathers of one row: its token columns as views of the map, its ids and its role."""
        batch = self._batches[row // BATCH_ROWS]
        r = row % BATCH_ROWS
        start, end = batch.offsets[r], batch.offsets[r + 1]
        return StoredParts(
            batch.input_ids[start:end],
            batch.targets[start:end].view(bool),
            batch.roles[start:end],
            batch.example_id(r),
            batch.sample_hash(r),
            SINGLE if batch.kind[r] == 0 else batch.role(r),
            batch.images(r),
        )

    def tokenized(self, row: int) -> Tokenized:
        """The whole sample as encode produced it (truncation needs its message structure)."""
        batch = self._batches[row // BATCH_ROWS]
        r = row % BATCH_ROWS
        start, end = batch.offsets[r], batch.offsets[r + 1]
        columns = batch.batch
        return Tokenized(
            example_id=columns.column("example_id")[r].as_py(),
            source=self.source,
            sample_hash=columns.column("sample_hash")[r].as_py(),
            input_ids=batch.input_ids[start:end],
            targets=batch.targets[start:end].view(bool),
            roles=batch.roles[start:end],
            message_index=as_numpy(columns.column("message_index").values)[start:end],
            message_roles=tuple(columns.column("message_roles")[r].as_py()),
            structured_messages=frozenset(columns.column("structured")[r].as_py()),
            images=batch.images(r),
        )

    def location(self, row: int) -> str:
        return self._batches[row // BATCH_ROWS].batch.column("location")[row % BATCH_ROWS].as_py()

    def example_id(self, row: int) -> str:
        return self._batches[row // BATCH_ROWS].example_id(row % BATCH_ROWS)

    def drop_pages(self) -> None:
        """Unmap every page read so far; they stay in the page cache, and a later read maps them again."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Let go of the map. It is unmapped once the last view of it goes (a view handed out may outlive the
        reader, and an mmap refuses to close under one): its pages are dropped now."""
        self._batches = []
        self.drop_pages()


class _Batch:
    """Numpy views of one mapped record batch (the token columns share their offsets)."""

    def __init__(self, batch: pa.RecordBatch):
        self.batch = batch
        self.rows = batch.num_rows
        self.offsets = as_numpy(batch.column(0).offsets)
        self.input_ids = as_numpy(batch.column(0).values)
        self.targets = as_numpy(batch.column(1).values)
        self.roles = as_numpy(batch.column(2).values)
        self.kind = as_numpy(batch.column("kind"))
        images = batch.column("images")
        # Python ints, not numpy scalars: emit asks every row whether it has images (0.3 us a row less)
        self.image_offsets = memoryview(images.buffers()[1]).cast("B").cast("i")[images.offset :]

    # Emit asks for these row by row. Each row is decoded from the mapped column when asked, never held: a
    # per-batch list (one conversion per batch) kept every id and hash of the build as a Python string in every
    # process that wrote a shard, ~230 bytes a sample (issue 43).
    @cached_property
    def _ids(self) -> _Strings:
        return _Strings(self.batch.column("example_id"))

    @cached_property
    def _hashes(self) -> _Strings:
        return _Strings(self.batch.column("sample_hash"))

    def example_id(self, r: int) -> str:
        return self._ids[r]

    def sample_hash(self, r: int) -> str:
        return self._hashes[r]

    def images(self, r: int) -> tuple[PlacedImage, ...]:
        if self.image_offsets[r] == self.image_offsets[r + 1]:
            return ()
        return images_at(self.batch.column("images"), r)

    def role(self, r: int) -> SegmentRole:
        columns = self.batch
        return SegmentRole(
            kind=int(self.kind[r]),
            completion=columns.column("completion")[r].as_py(),
            reward=columns.column("reward")[r].as_py(),
            advantage=columns.column("advantage")[r].as_py(),
        )


class _Strings:
    """Row r of a string column without a Python object per row: offsets and bytes are views of the map."""

    def __init__(self, column: pa.Array):
        _, offsets, data = column.buffers()
        # a memoryview's items are Python ints: indexing it is faster than a numpy scalar (~350 ns a row in all)
        self.offsets = memoryview(offsets).cast("B").cast("i")[column.offset : column.offset + len(column) + 1]
        self.data = memoryview(data) if data is not None else memoryview(b"")

    def __getitem__(self, r: int) -> str:
        return str(self.data[self.offsets[r] : self.offsets[r + 1]], "utf-8")


_HEX_DIGITS = 16  # of a sample_hash: the 64 bits the validation split hashes (int(h[:16], 16))
_NIBBLES = np.full(256, 255, dtype=np.uint8)  # an ASCII byte's value as a hex digit; 255: not one
_NIBBLES[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_NIBBLES[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_NIBBLES[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def hex_prefixes(column: pa.Array, path: Path) -> np.ndarray:
    """The number the first 16 hex digits of each string spell, as `int(h[:16], 16)` reads it, decoded from the
    string buffer with numpy: a Python string per row cost ~110 bytes a sample while the split was chosen.

        "3fa0..." "00ff..."  ->  bytes (n, 16) -> digits (n, 16) -> pairs (n, 8) -> big-endian uint64 (n,)
    """
    n = len(column)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    _, offset_buffer, data = column.buffers()
    offsets = np.frombuffer(offset_buffer, np.int32, count=column.offset + n + 1)[column.offset :]
    if data is None or (np.diff(offsets) < _HEX_DIGITS).any():
        raise BuildError(f"{path}: a sample_hash shorter than {_HEX_DIGITS} hex digits; clear the cache entry")
    digits = _NIBBLES[np.frombuffer(data, np.uint8)[offsets[:-1, None] + np.arange(_HEX_DIGITS)]]
    if (digits > 15).any():
        raise BuildError(f"{path}: a sample_hash that is not hexadecimal; clear the cache entry")
    pairs = (digits[:, 0::2] << 4) | digits[:, 1::2]
    return pairs.view(">u8").reshape(n).astype(np.uint64)


# One work item's records read and not stored, beside its partition (KEY.rejects.arrow), in record order: what
# rejects.jsonl says of each. `message`: bad input's error, which on_error: fail stops at (null: valid input not
# trained); `eval`: the overlap with an eval set as JSON text (null: none). Written as the encode goes, so no
# process holds a dict per reject (~0.5 KB each: 1 GB at 10M samples and 20% rejects, issue 43).
REJECTS_SCHEMA = pa.schema(
    [
        pa.field("ordinal", pa.int64()),
        pa.field("id", pa.string()),
        pa.field("location", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("detail", pa.string()),
        pa.field("message", pa.string()),
        pa.field("eval", pa.string()),
    ]
)


@dataclass(frozen=True, slots=True)
class Reject:
    """One record read and not stored: bad input (with its `message`) or valid input not trained."""

    ordinal: int  # its record number in the work item, as a stored row's
    id: str
    location: str
    reason: str
    detail: str
    message: str | None = None
    eval: str | None = None  # JSON text

    def entry(self, source: str) -> dict[str, object]:
        """Its line of rejects.jsonl (the ordinal and the message stay in the store)."""
        entry: dict[str, object] = {
            "id": self.id,
            "source": source,
            "location": self.location,
            "reason": self.reason,
            "detail": self.detail,
        }
        if self.eval is not None:
            entry["eval"] = json.loads(self.eval)
        return entry


def rejects_path(partition: Path) -> Path:
    """The rejects table of a partition: KEY.arrow -> KEY.rejects.arrow."""
    return partition.with_name(f"{partition.stem}.rejects.arrow")


class RejectsWriter:
    """Append-only, in record order; `close()` finishes the file (a table without rows when nothing was lost)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.rows = 0
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, REJECTS_SCHEMA)
        self._pending: list[Reject] = []

    def append(self, reject: Reject) -> None:
        self._pending.append(reject)
        self.rows += 1
        if len(self._pending) == BATCH_ROWS:
            self._flush()

    def extend(self, path: Path) -> None:
        """Append every reject of another table (a grown range's earlier entry), as appending each would."""
        for reject in read_rejects(path):
            self.append(reject)

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        arrays = [
            numbers([r.ordinal for r in pending], np.int64),
            *(strings([getattr(r, name) for r in pending]) for name in ("id", "location", "reason", "detail")),
            _optional_strings([r.message for r in pending]),
            _optional_strings([r.eval for r in pending]),
        ]
        self._writer.write_batch(pa.record_batch(arrays, schema=REJECTS_SCHEMA))
        self._pending = []

    def close(self) -> None:
        if self._sink.closed:
            return
        self._flush()
        self._writer.close()
        self._sink.close()


def read_rejects(path: Path, before: int | None = None) -> Iterator[Reject]:
    """The rejects of a table in record order (those of records before `before` alone, when given). Each batch
    becomes Python values when reached and goes once it is read: a build's rejects are never held whole."""
    with pa.OSFile(str(path), "rb") as handle:
        reader = pa.ipc.open_file(handle)
        for i in range(reader.num_record_batches):
            columns = reader.get_batch(i).to_pydict()
            for values in zip(*(columns[name] for name in REJECTS_SCHEMA.names)):
                reject = Reject(*values)
                if before is not None and reject.ordinal >= before:
                    return
                yield reject


def reject_ordinals(path: Path) -> np.ndarray:
    """The record number of every reject of a table."""
    with pa.OSFile(str(path), "rb") as handle:
        reader = pa.ipc.open_file(handle)
        parts = [np.array(as_numpy(reader.get_batch(i).column("ordinal"))) for i in range(reader.num_record_batches)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _optional_strings(values: list[str | None]) -> pa.Array:
    """A string array whose None values are nulls (no validity buffer when there are none, as `strings`)."""
    present = np.array([value is not None for value in values], dtype=bool)
    if present.all():
        return strings(cast(list[str], values))
    data = strings([value or "" for value in values])
    validity = pa.py_buffer(np.packbits(present, bitorder="little"))
    _, offsets, chars = data.buffers()
    return pa.Array.from_buffers(pa.string(), len(values), [validity, offsets, chars], null_count=int((~present).sum()))
