"""Read source files into raw records: each one a parsed JSON value, or the RecordError saying why not.

A file is read by what its bytes are (Parquet, Arrow IPC, gzip/zstd-compressed or plain JSON
Lines, a JSON array), not by its suffix. Records are numbered by N of their location `FILE:N`
(the line, 1-based, for JSON Lines; the row, 0-based, for everything else); a record over
`max_record_bytes`, or holding NaN, a NUL or a lone surrogate, becomes a RecordError here, before
any adapter (packtool.adapters) sees it.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from functools import partial
from itertools import chain, islice
from typing import Any

import pyarrow as pa

from packtool.errors import RecordError

Raw = tuple[int, Any]  # (N of the location, the parsed record or the RecordError saying why there is none)

BOM = b"\xef\xbb\xbf"
# Leading bytes of the binary formats (the reader is chosen by content, not by suffix).
_MAGIC = {
    b"PAR1": "parquet",
    b"ARROW1": "arrow_file",
    b"\xff\xff\xff\xff": "arrow_stream",  # IPC stream continuation marker: datasets' .arrow files
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
}
# Escapes that may decode to something no record may hold: a NUL or half of a surrogate pair. Only a
# record whose text holds one is walked (one fast scan for a literal backslash-u per record).
_MAYBE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
_LOW_HALF = re.compile(r"\\u[dD][c-fC-F]")
_HIGH_HALF = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_blanks(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


class _NotFinite:
    """Stands in for a NaN/Infinity literal: JSON (RFC 8259) has none, though Python's parser reads them.

    `made` counts them, so a parse that met one is known without scanning the text: compare the
    count before and after (another thread's parse can only cause an extra check, never a missed one).
    """

    __slots__ = ("literal",)
    made = 0

    def __init__(self, literal: str):
        self.literal = literal
        _NotFinite.made += 1


_DECODER = json.JSONDecoder(parse_constant=_NotFinite)


def _suspect(text: str, pos: int = 0, end: int = sys.maxsize) -> bool:
    """Whether text[pos:end] may hold a NUL or a lone surrogate escape (never misses one)."""
    if not _MAYBE.search(text, pos, end):  # the common case, one C-level scan
        return False
    for match in _MAYBE.finditer(text, pos, end):
        token, at = match.group(), match.start()
        if token == "\\u0000":
            return True
        if token[3] in "89abAB":
            if not _LOW_HALF.match(text, at + 6):  # a high half must be followed by its low half
                return True
        elif at < 6 or not _HIGH_HALF.match(text, at - 6):  # a low half must follow a high half
            return True
    return False


def embedded_json(text: str, what: str, field_name: str) -> Any:
    """JSON held in a string field (tools, arguments), checked as a record is: no NaN, NUL or lone surrogate."""
    made = _NotFinite.made
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{what}: not valid JSON ({exc.msg})", field=field_name) from None
    problem = _text_problem(value) if _NotFinite.made != made or _suspect(text) else None
    if problem:
        raise RecordError(f"{what}: {problem[1]}", field=field_name)
    return value


def sniff(path: str) -> str:
    """What a file holds, from its first bytes: parquet, arrow_file, arrow_stream, gzip, zstd, text or empty."""
    with open(path, "rb") as handle:
        head = handle.read(8)
    if not head:
        return "empty"
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), "text")


class Span:
    """What one encode may read of a file: exactly what the plan hashed, and a record of what it read.

    Text (JSON Lines; decompressed, for a compressed file): `size` bytes from byte `offset`, whose first line
    is line `line` (0-based). The reader passes on no byte past them, hashes each byte it passes on, and
    reads to their end even when its lines stop earlier, so `read` and `sha256()` cover what it gave.
    A JSON array's range (`elements`): `size` bytes from byte `offset`, where element `line` starts (the
    first range also holds the "[", the last the "]").
    Tables (Parquet, Arrow): `size` rows from row `line`; the reader keeps those rows' batches (`batches`,
    `schema`), the prefix a range carries over included, for the caller to hash as the plan did.
    `more`: the file held more past the span when the read ended (appended after the plan hashed it).
    """

    __slots__ = ("_digest", "batches", "elements", "line", "lines", "more", "offset", "read", "schema", "size")

    def __init__(self, offset: int, line: int, size: int, *, elements: bool = False):
        self.offset, self.line, self.size = offset, line, size
        self.elements = elements  # the text is elements of a JSON array, the first numbered `line` (0-based)
        self.read = 0  # bytes (text) or rows (tables) read of it
        self.lines = 0  # newlines in the text read
        self.more = False
        self.batches: list[pa.RecordBatch] = []
        self.schema: pa.Schema | None = None
        self._digest = hashlib.sha256()

    def sha256(self) -> str:
        return self._digest.hexdigest()

    def passed(self, text: memoryview) -> None:
        """Bytes of the span's text passed on to the reader."""
        self._digest.update(text)
        self.read += len(text)
        self.lines += text.tobytes().count(b"\n")

    def keep(self, batch: pa.RecordBatch, first: int) -> None:
        """The rows of a table's batch (whose first row is row `first`) that fall in the span."""
        end = self.line + self.size
        lo, hi = max(self.line - first, 0), min(end - first, batch.num_rows)
        if lo < hi:
            self.batches.append(batch.slice(lo, hi - lo))
            self.read += hi - lo
        self.more |= first + batch.num_rows > end


class _SpanText(io.RawIOBase):
    """A text stream cut at the end of a Span, hashing what it passes on."""

    def __init__(self, inner: Any, span: Span):
        self._inner, self._span = inner, span

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[: self._span.size - self._span.read]
        if not len(view):
            return 0
        read = self._inner.readinto(view) or 0
        self._span.passed(view[:read])
        return read

    def finish(self) -> None:
        """Read to the span's end (lines that stopped before it leave bytes unhashed), then look past it."""
        while self.readinto(bytearray(1 << 20)):
            pass
        try:
            self._span.more = bool(self._inner.read(1))
        except READ_ERRORS:  # a frame or member still being written past the span
            self._span.more = True

    def close(self) -> None:
        self._inner.close()
        super().close()


def raw_records(
    path: str,
    label: str,
    start: int,
    stop: int | None,
    limit: int,
    span: Span | None = None,
) -> Iterator[Raw]:
    def unreadable(reason: str, row: int | None = None) -> Raw:
        return (row or 0), RecordError(reason, kind="unreadable_file", file=label, row=row)

    try:
        kind = sniff(path)
    except OSError as exc:
        yield unreadable(f"cannot open: {exc.strerror or exc}")
        return
    if kind == "empty":
        yield unreadable("file is empty (0 bytes)")
        return
    readers: dict[str, Callable[[str, int, int | None, Span | None], Iterator[Raw]]] = {
        "parquet": _parquet_rows,
        "arrow_file": partial(_arrow_rows, stream=False),
        "arrow_stream": partial(_arrow_rows, stream=True),
    }
    reader = readers.get(kind)
    if reader is not None:
        rows = _sized(reader(path, start, stop, span), limit)
    else:
        rows = _text_records(path, kind, label, start, stop, limit, span)
    last = start - 1
    try:
        for n, record in rows:
            last = n
            yield n, record
    except _ReadError as exc:
        yield unreadable(str(exc), exc.row)
    except READ_ERRORS as exc:
        if last < start:
            yield unreadable(f"cannot read as {kind.replace('_', ' ')}: {_short(exc)}")
        else:
            where = f"line {last}" if reader is None else f"row {last}"
            yield unreadable(f"damaged after {where}: {_short(exc)}", last + 1)


class _ReadError(Exception):
    """The file (from `row` on, when given) is not something packtool reads; the message says what it found."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        self.row = row


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


# Rows become Python objects this many bytes of Arrow data at a time: 1024 rows of 4 MiB at once
# would be 4 GiB in Arrow and again in Python before the first row's size is checked.
_CONVERT_BYTES = 64 << 20


def _parquet_rows(path: str, start: int, stop: int | None, span: Span | None = None) -> Iterator[Raw]:
    """Rows start..stop; a `span` gets the rows of its own that the file holds (Span.keep), read from the
    same open file, so what is hashed is what was read."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    first = start
    if span is not None:
        span.schema, first = parquet.schema_arrow, min(start, span.line)
    row = 0
    for group in range(parquet.num_row_groups):
        meta = parquet.metadata.row_group(group)
        size = meta.num_rows
        if row + size <= first:  # whole row groups before the range are never decoded
            row += size
            continue
        if stop is not None and row >= stop:
            if span is not None:
                span.more = parquet.metadata.num_rows > stop
            return
        per_row = meta.total_byte_size // max(size, 1)  # decoded bytes, on average
        rows = max(1, min(1024, _CONVERT_BYTES // max(per_row, 1)))
        for batch in parquet.iter_batches(batch_size=rows, row_groups=[group]):
            if span is not None:
                span.keep(batch, row)
            yield from _batch_rows(batch, row, start, stop)
            row += batch.num_rows


def _arrow_rows(path: str, start: int, stop: int | None, span: Span | None = None, *, stream: bool) -> Iterator[Raw]:
    """Arrow IPC, file or stream format (`datasets` writes streams); memory-mapped, batch by batch."""
    with pa.memory_map(path) as source:
        if stream:
            opened = pa.ipc.open_stream(source)
            batches: Iterator[pa.RecordBatch] = iter(opened)
        else:
            opened = pa.ipc.open_file(source)
            batches = (opened.get_batch(i) for i in range(opened.num_record_batches))
        if span is not None:
            span.schema = opened.schema
        row = 0
        for batch in batches:
            if stop is not None and row >= stop:
                if span is not None:
                    span.more |= batch.num_rows > 0
                return
            if span is not None:
                span.keep(batch, row)
            if row + batch.num_rows > start:
                yield from _batch_rows(batch, row, start, stop)
            row += batch.num_rows


def _batch_rows(batch: pa.RecordBatch, first: int, start: int, stop: int | None) -> Iterator[Raw]:
    lo = max(start - first, 0)
    hi = batch.num_rows if stop is None else min(stop - first, batch.num_rows)
    if lo >= hi:
        return
    part = batch.slice(lo, hi - lo)
    check = any(_may_hold_nul(column) for column in part.columns)
    readers = {f.name: read for f in part.schema if (read := _cell_reader(f)) is not None}
    step = max(1, part.num_rows * _CONVERT_BYTES // max(part.nbytes, 1))
    for offset in range(0, part.num_rows, step):
        for row, record in enumerate(part.slice(offset, step).to_pylist(), start=first + lo + offset):
            if readers:
                record = _as_json_record(record, readers)
            yield row, _checked(record) if check and not isinstance(record, RecordError) else record


# datasets >= 4 stores its `Json` feature (values no Arrow type fits: messages whose keys differ,
# tool `parameters`) as the canonical `arrow.json` extension: JSON text, one value per cell.
_JSON_EXTENSION = "arrow.json"
_EXTENSION_KEY = b"ARROW:extension:name"  # how a pyarrow that does not know the extension still names it
CellReader = Callable[[Any], Any]


def _is_json(field: pa.Field) -> bool:
    kind = field.type
    if isinstance(kind, pa.BaseExtensionType):
        return kind.extension_name == _JSON_EXTENSION
    return (field.metadata or {}).get(_EXTENSION_KEY) == _JSON_EXTENSION.encode()


def _cell_reader(field: pa.Field) -> CellReader | None:
    """How a cell of `field` becomes the JSON value it was written from; None when to_pylist gives it already.

    `arrow.json` text is parsed, and a struct's null fields are absent: an Arrow struct has a slot for every
    key any row had, and a row without the key holds null there, which a chat template would print (a tool's
    parameters with `"default": null`). Built once per column, so a cell costs only what it needs.
    """
    kind = field.type
    if _is_json(field):
        return _json_cell
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        item = _cell_reader(kind.value_field)
        return None if item is None else partial(_list_cell, item)
    if pa.types.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        readers = {f.name: read for f in fields if (read := _cell_reader(f)) is not None}
        return partial(_struct_cell, readers)
    return None


def _json_cell(value: str | None) -> Any:
    return None if value is None else embedded_json(value, "JSON value", "")


def each_indexed(values: list, read: Callable[[Any], Any], where: str = "") -> list:
    """`read` of every value; a RecordError gets `where[i]` put before its field (`messages[3].role`)."""
    out = []
    for i, value in enumerate(values):
        try:
            out.append(read(value))
        except RecordError as error:
            error.field = f"{where}[{i}]{error.field}"  # the path is built only for a record that fails
            raise
    return out


def _list_cell(item: CellReader, value: list | None) -> list | None:
    return None if value is None else each_indexed(value, item)


def _struct_cell(readers: dict[str, CellReader], value: dict | None) -> dict | None:
    if value is None or (not readers and None not in value.values()):
        return value  # the common case: a message struct with every field set
    out = {}
    for name, cell in value.items():
        if cell is None:
            continue
        read = readers.get(name)
        try:
            out[name] = cell if read is None else read(cell)
        except RecordError as error:
            error.field = f".{name}{error.field}"
            raise
    return out


def _as_json_record(record: dict, readers: dict[str, CellReader]) -> dict | RecordError:
    for name, read in readers.items():
        try:
            record[name] = read(record[name])
        except RecordError as error:
            error.field = f"{name}{error.field}"
            return error
    return record


def _may_hold_nul(array: pa.Array) -> bool:
    """Whether any string in the array (nested lists and structs included) holds a NUL; vectorized."""
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return bool(pc.any(pc.match_substring(array, "\x00")).as_py())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _may_hold_nul(array.values)  # all values, sliced away or not: a superset is safe
    if pa.types.is_struct(kind):
        return any(_may_hold_nul(array.field(i)) for i in range(kind.num_fields))
    if pa.types.is_dictionary(kind):
        return _may_hold_nul(array.dictionary)
    return False


def open_text(path: str, kind: str, span: Span | None = None) -> io.BufferedIOBase:
    """The file's text as bytes: decompressed when `kind` (sniff) is gzip or zstd; multi-member gzip and
    multi-frame zstd (files concatenated with `cat`) read whole. With a `span`: its bytes only, hashed."""
    if kind == "gzip":
        import gzip

        if span is None:
            return gzip.open(path, "rb")
        text: Any = gzip.open(path, "rb")  # noqa: SIM115 - closed with the span's reader
    elif kind == "zstd":
        text = _ZstdText(path)  # no readline of its own: the buffer below gives line iteration
    else:
        text = io.FileIO(path)
        if span is not None:
            text.seek(span.offset)  # a range of a plain file; a compressed file is one range, from its first byte
    # 1 MiB reads: the reading thread gives up the GIL at every read and waits to take it back from the
    # encode threads; with 8 KiB reads that wait was ~0.25 s of a 12k-record build's reading thread
    return io.BufferedReader(text if span is None else _SpanText(text, span), buffer_size=1 << 20)


class _ZstdText(io.RawIOBase):
    """The text of a zstd file, frame after frame. python-zstandard's stream reader ends quietly where a file
    cut short ends inside a frame (the lines before the cut would be all the file seemed to hold); at its
    end the frames are walked by their headers, and one that the file does not hold whole raises ZstdError,
    so the read reports the file as damaged after its last line, as it does a gzip file cut short."""

    def __init__(self, path: str):
        import zstandard

        self._path = path
        self._reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115 - closed with this reader
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        read = 0 if self._ended else self._reader.readinto(buffer)
        if read == 0 and not self._ended:
            import zstandard

            if not _whole_frames(self._path):
                raise zstandard.ZstdError("the file ends inside a zstd frame (cut short?)")
            self._ended = True
        return read

    def close(self) -> None:
        self._reader.close()
        super().close()


_SKIPPABLE = range(0x184D2A50, 0x184D2A60)  # magic numbers of skippable frames: their size follows


def _whole_frames(path: str) -> bool:
    """Whether a zstd file ends where a frame ends (RFC 8878), reading only frame and block headers."""
    import zstandard

    with open(path, "rb") as handle:
        size, at = os.fstat(handle.fileno()).st_size, 0
        while at < size:
            handle.seek(at)
            head = handle.read(18)  # the magic number and the longest frame header
            if int.from_bytes(head[:4], "little") in _SKIPPABLE:
                at += 8 + int.from_bytes(head[4:8], "little")
                continue
            try:
                checksum = zstandard.get_frame_parameters(head).has_checksum
                at += zstandard.frame_header_size(head)
            except zstandard.ZstdError:
                return False
            last = False
            while not last:
                handle.seek(at)
                header = handle.read(3)  # Last_Block (1 bit), Block_Type (2), Block_Size (21), little-endian
                if len(header) < 3:
                    return False
                block = int.from_bytes(header, "little")
                last, kind, length = bool(block & 1), (block >> 1) & 3, block >> 3
                at += 3 + (1 if kind == 1 else length)  # an RLE block holds one byte, repeated
            at += 4 * checksum
    return at == size


def _text_records(
    path: str, kind: str, label: str, start: int, stop: int | None, limit: int, span: Span | None = None
) -> Iterator[Raw]:
    """JSON Lines (line N, 1-based) or one JSON array (row N, 0-based), plain or compressed.

    A line is read `limit` bytes at most: a longer one is passed over in blocks and becomes a
    `record_too_large` reject, so one 1 GB line never sits in memory. A JSON array is read a block at a
    time too (_json_array): memory holds the row being parsed, not the file.
    A `span` (a range of JSON Lines or of a JSON array's elements) bounds the read to the bytes the plan
    hashed; one that starts past byte 0 starts at its line or element, so the lines before it are not read
    (reading them cost every range after the first a pass over all the lines before it). Its caller checks
    that they are the bytes it hashed.
    """
    with open_text(path, kind, span) as handle:
        if span is not None and span.elements and span.line:  # a JSON array's range after its first
            yield from _sized(_json_array(b"", handle, start, stop, row=span.line), limit)
            handle.raw.finish()  # type: ignore[attr-defined]
            return
        read_line = partial(handle.readline, limit + 1)  # limit + 1: the record and its newline
        lines: Iterator[bytes] = iter(read_line, b"")
        at = 0 if span is None else span.line  # the index of the next line
        if not at:
            head = [read_line()]
            if head[0].startswith(BOM):  # a UTF-8 BOM is an encoding mark, not part of the first record
                head[0] = head[0][len(BOM) :]
            while head[-1] and not head[-1].strip():
                head.append(read_line())
            first = head[-1].lstrip()
            if not first:
                return  # only blank lines: a file with no records
            if first.startswith(b"["):
                if span is None:  # a range's text was checked whole by the plan's scan, and its read is hashed
                    _check_array_text(path, kind)
                yield from _sized(_json_array(b"".join(head), handle, start, stop), limit)
                if span is not None:
                    handle.raw.finish()  # type: ignore[attr-defined]
                return
            if not first.startswith(b"{"):
                raise _ReadError(
                    f"not JSON Lines, a JSON array, Parquet or Arrow (starts with {first[:16]!r}); "
                    "expected one JSON object per line"
                )
            if first.strip() == b"{":
                raise _ReadError("a pretty-printed JSON object, not records: expected one JSON object per line")
            lines = chain(head, lines)
        for index, line in islice(enumerate(lines, start=at), None if stop is None else max(0, stop - at)):
            if len(line) > limit and not line.endswith(b"\n"):
                # passed over whole before `start` too: a line is counted once however long, so the
                # lines of a range that starts past it (RANGE_ROWS, a carried prefix) keep their numbers
                size = len(line) + _skip_line(handle)
                if index >= start:
                    yield index + 1, _too_large(f"a line of {size:,} bytes", limit)
            elif index >= start and not line.isspace():  # no copy, unlike strip(); the reads never yield b""
                yield index + 1, _parse_line(line, label, index + 1)
        if span is not None:
            handle.raw.finish()  # type: ignore[attr-defined]


def _skip_line(handle: io.BufferedIOBase) -> int:
    """Read past the rest of the current line in blocks; the bytes passed over (its newline excluded)."""
    skipped = 0
    while block := handle.readline(1 << 20):
        if block.endswith(b"\n"):
            return skipped + len(block) - 1
        skipped += len(block)
    return skipped


def _too_large(what: str, limit: int) -> RecordError:
    return RecordError(
        f"{what} is over max_record_bytes ({limit:,}): tokenizing takes ~150x a record's size in memory; "
        "raise max_record_bytes to read it, or cut the record into smaller ones",
        kind="record_too_large",
    )


def _sized(rows: Iterator[Raw], limit: int) -> Iterator[Raw]:
    """Rows of a Parquet or Arrow file or a JSON array, a row over `limit` bytes of text becoming a reject."""
    for n, record in rows:
        size = 0 if isinstance(record, RecordError) else _text_bytes(record, limit)
        yield (n, _too_large("the text of this row", limit)) if size > limit else (n, record)


def _text_bytes(value: Any, limit: int) -> int:
    """The UTF-8 bytes of the strings in a record (keys included), counted until they pass `limit`.
    A loop, not recursion: a row may nest as deep as the JSON parser allowed."""
    total, pending = 0, [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, bytes):
            total += len(item)
        elif isinstance(item, dict):
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, list):
            pending += item
    return total


ARRAY_BLOCK = 1 << 22  # bytes of a JSON array read at a time; a row longer than that reads on to its end


def _check_array_text(path: str, kind: str) -> None:
    """Read a JSON array's whole text once before its rows are parsed, so that a byte that is not UTF-8,
    or a compressed file cut short, leaves the file unread (as when the array was read whole) rather than
    its rows before the fault trained. A block at a time: the text is not kept."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    fed = 0
    with open_text(path, kind) as handle:
        data = handle.read(len(BOM)).removeprefix(BOM)  # a BOM is not text (_text_records drops it too)
        while True:
            ended = not (more := handle.read(ARRAY_BLOCK))
            buffered = len(decoder.getstate()[0])
            try:
                decoder.decode(data, final=ended)
            except UnicodeDecodeError as exc:
                offset = fed - buffered + exc.start
                raise _ReadError(f"not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {offset})") from None
            if ended:
                return
            fed += len(data)
            data = more


_NUMBER_GOES_ON = ("", *"0123456789.eE+-")  # what may follow a number's text inside a longer number


class _ArrayText:
    """The text of a JSON array, read `block` bytes at a time: `text` holds it from `pos` (the row being
    read) to as far as has been read. `lines` and `column` place text[0] in the file, for messages."""

    def __init__(self, first: bytes, handle: io.BufferedIOBase, block: int, *, count_bytes: bool = False):
        self._handle, self._block = handle, block
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = self._decoded(first)
        self.pos = 0
        self.lines = self.column = 0
        self.ended = False
        self._count_bytes = count_bytes
        self._bytes_before = 0  # the UTF-8 bytes of the text dropped before `text` (kept when count_bytes)

    def byte_offset(self) -> int:
        """Where `pos` is, in bytes of the text from its start (count_bytes only)."""
        return self._bytes_before + len(self.text[: self.pos].encode("utf-8"))

    def _decoded(self, data: bytes) -> str:
        try:
            return self._decoder.decode(data, final=not data)
        except UnicodeDecodeError:  # the file changed since _check_array_text read it whole
            raise _ReadError("not valid UTF-8: the file changed while it was read") from None

    def more(self) -> bool:
        """Drop the text before `pos` and read another block (at least as much as is held, so a long row
        is parsed a bounded number of times); False at the end of the file."""
        if self.ended:
            return False
        last_newline = self.text.rfind("\n", 0, self.pos)
        self.column = self.pos - last_newline - 1 if last_newline >= 0 else self.column + self.pos
        self.lines += self.text.count("\n", 0, self.pos)
        if self._count_bytes:
            self._bytes_before = self.byte_offset()
        data = self._handle.read(max(self._block, len(self.text) - self.pos))
        self.text = self.text[self.pos :] + self._decoded(data)
        self.pos = 0
        self.ended = not data
        return not self.ended

    def skip_blanks(self) -> None:
        while (pos := _skip_blanks(self.text, self.pos)) == len(self.text) and not self.ended:
            self.pos = pos
            self.more()
        self.pos = pos

    def at(self, char: str) -> bool:
        return self.text.startswith(char, self.pos)

    def value(self) -> tuple[Any, int]:
        """The JSON value at `pos` and where it ends in `text`, reading on until it is whole."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
            except json.JSONDecodeError:
                if self.ended:
                    raise
            else:
                # a number may go on in the next block: "1." of "1.5e-3" parses as 1
                cut = type(value) in (int, float) and self.text[end : end + 1] in _NUMBER_GOES_ON
                if not cut or self.ended:
                    return value, end
            self.more()  # then parsed again: the error or the end found so far are in the text before it

    def where(self, exc: json.JSONDecodeError) -> str:
        """`line L column C` of a parse error, in the file."""
        return f"line {self.lines + exc.lineno} column {exc.colno + (self.column if exc.lineno == 1 else 0)}"

    def rest_is_blank(self) -> bool:
        """Whether nothing but whitespace follows the character at `pos`, to the end of the file."""
        rest = self.text[self.pos + 1 :]
        while not rest.strip():
            if self.ended:
                return True
            data = self._handle.read(self._block)
            rest, self.ended = self._decoded(data), not data
        return False


def _json_array(
    first: bytes, handle: io.BufferedIOBase, start: int, stop: int | None, *, row: int = 0
) -> Iterator[Raw]:
    """Rows of a JSON array whose text begins with `first` (its "[" included) and goes on in `handle`; from
    row `row` on, the text starts at that element (a range of the array, read to row `stop`).

    One row at a time, each checked on its own text span (_suspect), so the rows before a break are still
    read; ARRAY_BLOCK bytes are read at a time, and a row is parsed again only when a read ended inside it."""
    text = _ArrayText(first, handle, ARRAY_BLOCK)
    for n, record, end, made in _array_elements(text, row, stop):
        if n >= start:
            check = _NotFinite.made != made or _suspect(text.text, text.pos, end)
            yield n, _checked(record) if check else record


def _array_elements(text: _ArrayText, row: int, stop: int | None) -> Iterator[tuple[int, Any, int, int]]:
    """(row, value, where it ends in text.text, _NotFinite.made before it was parsed) of each element of the
    array in `text`, from row `row` (0: the text starts with the "[", else at that element) to row `stop` or
    the "]"; text.pos is the element's start while it is given out. A fault raises _ReadError, saying where."""
    text.skip_blanks()
    if not row:
        if not text.at("["):
            raise _ReadError("not a JSON array")
        text.pos += 1
        text.skip_blanks()
    while not text.at("]"):
        where = None if row == 0 else row
        made = _NotFinite.made
        try:
            value, end = text.value()
        except json.JSONDecodeError as exc:
            reason = f"not valid JSON: {exc.msg.removesuffix(' at')} at {text.where(exc)}"  # "starting at at"
            raise _ReadError(
                reason if row == 0 else f"{reason} (row {row}; the rows before it are read)", where
            ) from None
        except RecursionError:
            raise _ReadError(f"row {row} is nested too deeply to read", where) from None
        yield row, value, end, made
        row += 1
        text.pos = end
        text.skip_blanks()
        if text.at(","):
            text.pos += 1
            text.skip_blanks()
        elif not text.at("]"):
            raise _ReadError(f"not valid JSON: expected ',' or ']' after row {row - 1}", row)
        if stop is not None and row >= stop:
            return
    if not text.rest_is_blank():
        raise _ReadError("not valid JSON: extra data after the closing ']'", row)


def json_array_starts(path: str, every: int) -> tuple[list[int], int] | None:
    """The byte offsets in a plain file's JSON array at which elements every, 2 * every, ... start, and the
    number of its elements; None for a file that is not one sound JSON array to its last byte (not UTF-8,
    broken, extra data after it, a row nested too deeply), which is read whole and says why. Parsed a
    block at a time, as _json_array reads it: its elements' values may still be rejects of their own."""
    with open_text(path, "text") as handle:
        head = handle.read(len(BOM))
        first = head.removeprefix(BOM)
        before = len(head) - len(first)  # the BOM: bytes that are not text
        starts, rows = [], 0
        try:
            text = _ArrayText(first, handle, ARRAY_BLOCK, count_bytes=True)
            for row, _, _, _ in _array_elements(text, 0, None):
                if row and not row % every:
                    starts.append(before + text.byte_offset())
                rows = row + 1
        except _ReadError:
            return None
        return starts, rows


def _parse_line(line: bytes, label: str, n: int) -> Any:
    """One JSON Lines record, or the RecordError saying why the line is not one."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"not valid UTF-8: byte 0x{line[exc.start]:02x} at column {exc.start + 1}"
        return RecordError(reason, kind="parse_error", file=label, row=n)
    made = _NotFinite.made
    try:
        if text[:1].isspace():
            record = _DECODER.decode(text)  # decode() skips leading blanks
        else:
            # raw_decode saves decode()'s whitespace scans; only the line end may follow the value
            record, end = _DECODER.raw_decode(text)
            if end < len(text) and not text[end:].isspace():
                raise json.JSONDecodeError("Extra data", text, end)
    except json.JSONDecodeError as exc:
        return RecordError(f"not valid JSON: {exc.msg} (column {exc.colno})", kind="parse_error", file=label, row=n)
    except ValueError as exc:  # an integer of more digits than Python converts (4300): this record's problem
        return RecordError(f"not readable JSON: {_short(exc)}", kind="parse_error", file=label, row=n)
    except RecursionError:
        return RecordError("nested too deeply to read (JSON depth over ~1000)", kind="parse_error", file=label, row=n)
    return _checked(record) if _NotFinite.made != made or _suspect(text) else record


def _checked(record: Any) -> Any:
    """The record, or the RecordError for the first value in it that no tokenizer should see."""
    problem = _text_problem(record)
    if problem is None:
        return record
    field, reason, kind = problem
    return RecordError(reason, kind=kind, field=field)


def _text_problem(value: Any, path: str = "") -> tuple[str, str, str] | None:
    """(field, reason, kind) for the first value that is not text or JSON: a NUL, a lone surrogate, NaN."""
    if isinstance(value, str):
        if "\x00" in value:
            return path, "contains a NUL character (U+0000), a sign of binary or corrupted text", "bad_record"
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                reason = f"contains a lone surrogate (U+{ord(value[exc.start]):04X}), which is not text"
                return path, reason, "bad_record"
        return None
    if isinstance(value, _NotFinite):
        return path, f"{value.literal} is not valid JSON (write null or a string)", "parse_error"
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            problem = _text_problem(key, where) or _text_problem(item, where)
            if problem:
                return problem
    elif isinstance(value, list):
        for i, item in enumerate(value):
            problem = _text_problem(item, f"{path}[{i}]")
            if problem:
                return problem
    return None


def _read_errors() -> tuple[type[BaseException], ...]:
    """What the readers raise on bytes they cannot decode (damaged, truncated, not the format)."""
    import zlib

    import zstandard

    return (OSError, EOFError, ValueError, pa.ArrowException, zlib.error, zstandard.ZstdError)


READ_ERRORS = _read_errors()
