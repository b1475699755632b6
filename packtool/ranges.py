"""Row ranges: how one input file splits into encode work items, and the content hash of each.

The file knowledge beside packtool.reading: where a JSON Lines file's lines or a table's rows fall, what
bytes or values decide a range's samples, and whether the first bytes or rows of a range are still those
an earlier build hashed (text_prefix, table_rows_digest). Where ranges are remembered between builds is
the caller's (RangeMemo; builder.encode.CachedRanges keeps them in the token cache).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Protocol

import numpy as np
import pyarrow as pa

from packtool.arrow import content_digest
from packtool.format import sha256_file
from packtool.reading import BOM, READ_ERRORS, json_array_starts, open_text, sniff

RANGE_ROWS = 4096  # lines or rows per encode work item of a large file (see row_ranges)
UNREADABLE = "unreadable"  # the content of a file that could not be hashed: its read reports why


@dataclass(frozen=True)
class RowRange:
    """Positions start..end of one input file (end None: to the end) and the sha256 of what decides its samples.

    `content` hashes the range's own rows: the bytes of its lines for plain JSON Lines, the values of its
    rows for Parquet and Arrow (arrow.content_digest), so rows appended to a file change only its last
    range and add new ones. Compressed JSON Lines are one range, hashed over the decompressed text (so
    another compression of the same lines keeps the hash, and lines appended to it extend what it
    hashed). A plain JSON array of more than RANGE_ROWS elements splits like a table, each range hashed over
    the bytes of its elements; a compressed one, or a smaller one, is one range keyed by the whole file's
    sha256."""

    start: int
    end: int | None
    content: str
    rows: int | None = None  # the file's lines or rows, where counted (None: read whole, not counted)
    # What `content` hashes: `size` bytes of the file's text (decompressed) from byte `offset` (JSON Lines, a JSON
    # array's elements), or `size` rows from `start` (tables)
    offset: int | None = None
    size: int | None = None
    unit: str | None = None  # "bytes" (JSON Lines), "elements" (a JSON array), "rows" (tables); None: the whole file


TABLE_KINDS = ("parquet", "arrow_file", "arrow_stream")
COMPRESSED_KINDS = ("gzip", "zstd")  # what packtool.reading decompresses


def row_ranges(file: str, max_samples: int | None, memo: RangeMemo | None = None) -> list[RowRange]:
    """How one input file splits into encode work items, as positions for `read_file` and their content hash.

    A plain JSON Lines file of L lines (blank lines included) or a Parquet or Arrow file of L rows splits at
    fixed multiples of RANGE_ROWS, so that all workers share one large file and appended rows only change
    the last range or add new ones (a plain JSON array splits the same way, at the element starts found by
    parsing it once; _json_array_ranges):

        lines  0 ........ R | R ........ 2R | ... | (n-1)R ........ end
               item 0         item 1                item n-1 (end: None)

    Locations and ids come from the file and the line or row, so they do not depend on the split, and the
    partitions are read back in item order, so the plan and the shards do not either. Compressed files
    are read from their first byte whatever the range, and a source with max_samples counts
    records across the file: those stay one item (compressed JSON Lines hashed over their text,
    _compressed_ranges). So does a file that breaks while it is hashed (a damaged table or compressed
    stream), keyed by its bytes: its read says where. The ranges of a table, a JSON array or a compressed
    file are remembered in `memo`, by the file's sha256.
    """
    try:
        kind = sniff(file)
        if max_samples is None and kind == "text" and (ranges := _json_lines_ranges(file, kind)):
            return ranges
        if max_samples is None and kind == "text" and _starts_array(file):
            return _remembered_ranges(file, memo, partial(_json_array_ranges, file))
        if max_samples is None and kind in COMPRESSED_KINDS:
            return _remembered_ranges(file, memo, partial(_compressed_ranges, file, kind))
        if max_samples is None and kind in TABLE_KINDS:
            return _remembered_ranges(file, memo, lambda _: _table_ranges(file, kind))
    except READ_ERRORS:
        pass  # keyed by its bytes below, or unreadable; the read reports the problem, once
    try:
        return [RowRange(0, None, sha256_file(file))]
    except OSError:
        return [RowRange(0, None, UNREADABLE)]


def _table_ranges(file: str, kind: str) -> list[RowRange]:
    """The ranges of a Parquet or Arrow file, each hashed over the names, types and values of its own rows.

    The rows of one range are put together before they are hashed, so neither the file's row groups or
    batches nor its compression change a range's hash: a file written again with rows appended keeps the
    hash of every full range before them. One range's rows are in memory at a time. Decoding and hashing
    cost ~11 us a row (20 x quickstart chat as Parquet), so a file whose bytes are as at an earlier build
    takes that build's hashes from the memo instead (_remembered_ranges; reading its bytes: ~1 GB/s)."""
    digests: list[str] = []
    pending: list[pa.RecordBatch] = []
    held = rows = 0
    schema, batches, _ = _table_batches(file, kind)
    for batch in batches:
        rows += batch.num_rows
        while batch.num_rows:
            taken = batch.slice(0, RANGE_ROWS - held)
            pending.append(taken)
            held += taken.num_rows
            batch = batch.slice(taken.num_rows)
            if held == RANGE_ROWS:
                digests.append(rows_digest(schema, pending))
                pending, held = [], 0
    if held or not digests:  # rows after the last full range (or one range in all)
        digests.append(rows_digest(schema, pending))
    return _ranges_of(digests, rows)


def _starts_array(file: str) -> bool:
    with open(file, "rb") as handle:
        return handle.read(1 << 16).removeprefix(BOM).lstrip().startswith(b"[")


def _json_array_ranges(file: str, whole: str) -> list[RowRange]:
    """The ranges of a plain file's JSON array, each the bytes of RANGE_ROWS elements (the first range from byte 0,
    the last to the file's end) hashed as they are in the file, so that workers share one large array. Finding
    where its elements start parses the array once (reading.json_array_starts; ~90 MB/s); `memo` keeps the
    ranges by the file's sha256. An array of RANGE_ROWS elements or fewer, or one that is not sound to its end,
    is one range keyed by its bytes (`whole`), whose read says what is wrong with it."""
    found = json_array_starts(file, RANGE_ROWS)
    if found is None or not found[0]:
        return [RowRange(0, None, whole)]
    starts, rows = found
    bounds = [0, *starts, os.path.getsize(file)]
    prefixes = [text_prefix(file, offset, end - offset) for offset, end in itertools.pairwise(bounds)]
    if any(prefix is None for prefix in prefixes):  # cut short since it was parsed: its read says what it is now
        return [RowRange(0, None, whole)]
    return _byte_ranges([prefix.sha256 for prefix in prefixes if prefix is not None], bounds, rows, "elements")


def _compressed_ranges(file: str, kind: str, whole: str) -> list[RowRange]:
    """A gzip or zstd file of sha256 `whole`: JSON Lines are one range hashed over their decompressed text
    (_json_lines_ranges), anything else (a JSON array) one range keyed by the file's bytes."""
    return _json_lines_ranges(file, kind) or [RowRange(0, None, whole)]


def _ranges_of(digests: list[str], rows: int) -> list[RowRange]:
    n = len(digests)
    return [
        RowRange(i * RANGE_ROWS, end, d, rows, None, (end or rows) - i * RANGE_ROWS, "rows")
        for i, (end, d) in enumerate(zip([(i + 1) * RANGE_ROWS for i in range(n - 1)] + [None], digests))
    ]


class RangeMemo(Protocol):
    """Where the ranges of a file are kept between builds, by the file's sha256 and the RANGE_ROWS they were
    cut at (builder.encode.CachedRanges)."""

    def recall(self, whole: str, range_rows: int) -> list[RowRange] | None: ...

    def remember(self, whole: str, range_rows: int, ranges: list[RowRange]) -> None: ...


def _remembered_ranges(file: str, memo: RangeMemo | None, ranges_of: Callable[[str], list[RowRange]]) -> list[RowRange]:
    """`ranges_of(the file's sha256)`, or the ranges `memo` recorded for a file of these bytes at an earlier
    build: reading the bytes (~1 GB/s) costs less than decoding a table's rows or decompressing a file."""
    whole = sha256_file(file)
    remembered = memo.recall(whole, RANGE_ROWS) if memo is not None else None
    if remembered is not None:
        return remembered
    ranges = ranges_of(whole)
    if memo is not None:
        memo.remember(whole, RANGE_ROWS, ranges)
    return ranges


def table_rows_digest(file: str, start: int, stop: int) -> str:
    """The content hash of rows start..stop of a Parquet or Arrow file, as _table_ranges gives a range's."""
    schema, batches, row = _table_batches(file, sniff(file), start)
    pending = []
    for batch in batches:
        if row >= stop:
            break
        if row + batch.num_rows > start:
            lo = max(start - row, 0)
            pending.append(batch.slice(lo, min(stop - row, batch.num_rows) - lo))
        row += batch.num_rows
    return rows_digest(schema, pending)


def _table_batches(file: str, kind: str, start: int = 0) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int]:
    """The file's schema, its batches from one that holds row `start` on, and the first row of that batch.
    Parquet row groups wholly before `start` are never decoded."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(file)
        sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
        first = row = 0
        while first < len(sizes) - 1 and row + sizes[first] <= start:
            row, first = row + sizes[first], first + 1
        groups = list(range(first, len(sizes)))
        return parquet.schema_arrow, parquet.iter_batches(batch_size=RANGE_ROWS, row_groups=groups), row
    source = pa.memory_map(file)
    if kind == "arrow_stream":
        stream = pa.ipc.open_stream(source)
        return stream.schema, iter(stream), 0
    reader = pa.ipc.open_file(source)
    return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches)), 0


def rows_digest(schema: pa.Schema, batches: list[pa.RecordBatch]) -> str:
    digest = hashlib.sha256()
    table = pa.Table.from_batches(batches) if batches else schema.empty_table()
    for column_field, column in zip(table.schema, table.columns):
        content_digest(column.combine_chunks(), digest, column_field)
    return digest.hexdigest()


def _json_lines_ranges(file: str, kind: str) -> list[RowRange]:
    """The ranges of a JSON Lines file, each hashed over its own lines; [] for anything else (a JSON array
    is parsed whole). A plain file closes a range every RANGE_ROWS lines; a compressed one (kind gzip or
    zstd) is one range over its decompressed text, since reading one from the middle would decompress it
    from its first byte. One pass over the text, as the reader gets it: newlines are found per block with
    numpy. Raises READ_ERRORS when the text cannot be read to its end (the read then reports where)."""
    split = kind == "text"
    with open_text(file, kind) as handle:
        head = handle.read(1 << 16)
        first = head.removeprefix(BOM).lstrip()
        if not first.startswith(b"{") or first.split(b"\n", 1)[0].strip() == b"{":
            return []
        digests, digest, lines, last = [], hashlib.sha256(), 0, b""
        bounds, read = [0], 0  # offsets in the text at which the ranges start, then the text's size
        for block in chain([head], iter(partial(handle.read, 1 << 20), b"")):
            newlines = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
            # the line counts at which a range closes inside this block, as offsets just past their newline
            closing = range(-(-(lines + 1) // RANGE_ROWS) * RANGE_ROWS, lines + len(newlines) + 1, RANGE_ROWS)
            cut = 0
            for count in closing if split else ():
                past = int(newlines[count - lines - 1]) + 1
                digest.update(block[cut:past])
                digests.append(digest.hexdigest())
                bounds.append(read + past)
                digest, cut = hashlib.sha256(), past
            digest.update(block[cut:])
            lines, last, read = lines + len(newlines), block[-1:], read + len(block)
    lines += last not in (b"\n", b"")
    if lines > len(digests) * RANGE_ROWS or not digests:  # lines after the last closed range (or one range in all)
        digests.append(digest.hexdigest())
        bounds.append(read)
    return _byte_ranges(digests, bounds, lines, "bytes")


def _byte_ranges(digests: list[str], bounds: list[int], rows: int, unit: str) -> list[RowRange]:
    """Range i: rows i * RANGE_ROWS on (the last to the end), bytes bounds[i]..bounds[i + 1] of the text, hashed
    to digests[i]."""
    n = len(digests)
    return [
        RowRange(
            i * RANGE_ROWS,
            (i + 1) * RANGE_ROWS if i < n - 1 else None,
            digest,
            rows,
            bounds[i],
            bounds[i + 1] - bounds[i],
            unit,
        )
        for i, digest in enumerate(digests)
    ]


@dataclass(frozen=True)
class TextPrefix:
    """What carried_prefix checks of the first bytes of a range's text against its earlier entry."""

    sha256: str
    lines: int  # newlines in it
    whole_lines: bool  # it ends with a newline


def text_prefix(file: str, offset: int, size: int) -> TextPrefix | None:
    """`size` bytes of the file's text from byte `offset` (decompressed, for a compressed file; read in blocks,
    as a compressed file's prefix is all of its earlier text); None when the text ends before them or breaks
    (the read reports where)."""
    digest, lines, last, left = hashlib.sha256(), 0, b"", size
    try:
        with open_text(file, sniff(file)) as handle:
            if offset:  # a range of a plain file; a compressed file is one range, from its first byte
                handle.seek(offset)
            while left and (block := handle.read(min(left, 1 << 20))):
                digest.update(block)
                lines, last, left = lines + block.count(b"\n"), block[-1:], left - len(block)
    except READ_ERRORS:
        return None
    return TextPrefix(digest.hexdigest(), lines, last == b"\n") if not left else None
