"""Read source files and turn each record into a canonical `Example`.

A file is read by what its bytes are (Parquet, Arrow IPC, gzip/zstd-compressed or plain JSON
Lines, a JSON array), not by its suffix. Each record has one location, `FILE:N` (N is the line,
1-based, for JSON Lines; the row, 0-based, for everything else) and, without an id field, the
default id `{source}:{FILE}:{N}`, computable from that one file alone. Adapters map one raw
record to an `Example` or raise `RecordError` naming the field. The build applies the error
policy, so a bad record is never silently lost: it fails the build or lands in rejects.jsonl.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, Union

import pyarrow as pa

from packtool.config import SourceConfig, canonical_json
from packtool.errors import RecordError
from packtool.records import ROLES, Example, Message

if TYPE_CHECKING:
    from packtool.preference import CompletionGroup, PreferencePair

# What one record becomes: a sample, or an item of several segments (format: preference | group).
Parsed = Union[Example, "PreferencePair", "CompletionGroup"]
Adapter = Callable[[dict, SourceConfig, str, str], Parsed]
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


def source_files(source: SourceConfig) -> list[str]:
    """The files of a source in reading order: its globs expanded and sorted, as the config resolved them."""
    return list(source.paths)


def file_label(source: SourceConfig, file: str) -> str:
    """FILE in locations and default ids: the path as written in the config (relative to its folder)."""
    return source.labels.get(file, file)


def read_source(source: SourceConfig) -> Iterator[Parsed | RecordError]:
    """Every record of a source (files in order) as an Example or the RecordError saying why it is not one.

    `max_samples` keeps the first N records; a bad record counts as one of them.
    """
    records = chain.from_iterable(read_file(source, file) for file in source_files(source))
    return islice(records, source.max_samples) if source.max_samples is not None else records


def read_file(
    source: SourceConfig, file: str, start: int = 0, stop: int | None = None
) -> Iterator[Parsed | RecordError]:
    """Records start..stop of one file (positions count from 0: JSON Lines lines, or rows).

    A file that cannot be read at all yields one `RecordError(kind="unreadable_file", row=None)`;
    one that breaks part way yields the records before the break, then that error with the row.
    """
    label = file_label(source, file)
    adapter = ADAPTERS[source.format]
    for n, record in _raw_records(file, label, start, stop, source.max_record_bytes):
        location = f"{label}:{n}"
        default_id = f"{source.name}:{location}"
        if isinstance(record, RecordError):
            if not record.file:  # a record-level problem found by a reader that knows only the row
                record.file, record.row = label, n
            record.sample_id = f"{source.name}:{label}" if record.row is None else default_id
            yield record
            continue
        yield _example(record, source, adapter, label, n, default_id)


def _example(
    record: Any, source: SourceConfig, adapter: Adapter, label: str, n: int, default_id: str
) -> Parsed | RecordError:
    try:
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        example_id = _example_id(record, source, default_id)
        parsed = adapter(record, source, example_id, f"{label}:{n}")
        return parsed if source.system is None else with_system(parsed, source.system)
    except RecordError as error:
        error.file, error.row = label, n
        error.sample_id = default_id
        return error
    except RecursionError:
        return RecordError("nested too deeply to read", kind="parse_error", file=label, row=n, sample_id=default_id)


def sniff(path: str) -> str:
    """What a file holds, from its first bytes: parquet, arrow_file, arrow_stream, gzip, zstd, text or empty."""
    with open(path, "rb") as handle:
        head = handle.read(8)
    if not head:
        return "empty"
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), "text")


def _raw_records(path: str, label: str, start: int, stop: int | None, limit: int) -> Iterator[Raw]:
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
    readers: dict[str, Callable[[str, int, int | None], Iterator[Raw]]] = {
        "parquet": _parquet_rows,
        "arrow_file": partial(_arrow_rows, stream=False),
        "arrow_stream": partial(_arrow_rows, stream=True),
    }
    reader = readers.get(kind)
    rows = _sized(reader(path, start, stop), limit) if reader else _text_records(path, kind, label, start, stop, limit)
    last = start - 1
    try:
        for n, record in rows:
            last = n
            yield n, record
    except _ReadError as exc:
        yield unreadable(str(exc), exc.row)
    except _READ_ERRORS as exc:
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


def _parquet_rows(path: str, start: int, stop: int | None) -> Iterator[Raw]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    row = 0
    for group in range(parquet.num_row_groups):
        meta = parquet.metadata.row_group(group)
        size = meta.num_rows
        if row + size <= start:  # whole row groups before the range are never decoded
            row += size
            continue
        if stop is not None and row >= stop:
            return
        per_row = meta.total_byte_size // max(size, 1)  # decoded bytes, on average
        rows = max(1, min(1024, _CONVERT_BYTES // max(per_row, 1)))
        for batch in parquet.iter_batches(batch_size=rows, row_groups=[group]):
            yield from _batch_rows(batch, row, start, stop)
            row += batch.num_rows


def _arrow_rows(path: str, start: int, stop: int | None, *, stream: bool) -> Iterator[Raw]:
    """Arrow IPC, file or stream format (`datasets` writes streams); memory-mapped, batch by batch."""
    with pa.memory_map(path) as source:
        if stream:
            batches: Iterator[pa.RecordBatch] = iter(pa.ipc.open_stream(source))
        else:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        row = 0
        for batch in batches:
            if stop is not None and row >= stop:
                return
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
    return None if value is None else _embedded_json(value, "JSON value", "")


def _list_cell(item: CellReader, value: list | None) -> list | None:
    if value is None:
        return None
    out = []
    for i, cell in enumerate(value):
        try:
            out.append(item(cell))
        except RecordError as error:
            error.field = f"[{i}]{error.field}"  # the path is built only for a record that fails
            raise
    return out


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


def _open_text(path: str, kind: str) -> io.BufferedIOBase:
    if kind == "gzip":
        import gzip

        return gzip.open(path, "rb")
    if kind == "zstd":
        import zstandard

        # the decompression reader has no readline; a buffer over it gives line iteration
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115 - closed with the buffer
        return io.BufferedReader(reader)
    return open(path, "rb")


def _text_records(path: str, kind: str, label: str, start: int, stop: int | None, limit: int) -> Iterator[Raw]:
    """JSON Lines (line N, 1-based) or one JSON array (row N, 0-based), plain or compressed.

    A line is read `limit` bytes at most: a longer one is passed over in blocks and becomes a
    `record_too_large` reject, so one 1 GB line never sits in memory (a JSON array is read whole).
    """
    with _open_text(path, kind) as handle:
        read_line = partial(handle.readline, limit + 1)  # limit + 1: the record and its newline
        head = [read_line()]
        if head[0].startswith(BOM):  # a UTF-8 BOM is an encoding mark, not part of the first record
            head[0] = head[0][len(BOM) :]
        while head[-1] and not head[-1].strip():
            head.append(read_line())
        first = head[-1].lstrip()
        if not first:
            return  # only blank lines: a file with no records
        if first.startswith(b"["):
            yield from _sized(_json_array(b"".join(head) + handle.read(), start, stop), limit)
            return
        if not first.startswith(b"{"):
            raise _ReadError(
                f"not JSON Lines, a JSON array, Parquet or Arrow (starts with {first[:16]!r}); "
                "expected one JSON object per line"
            )
        if first.strip() == b"{":
            raise _ReadError("a pretty-printed JSON object, not records: expected one JSON object per line")
        for index, line in islice(enumerate(chain(head, iter(read_line, b""))), start, stop):
            if len(line) > limit and not line.endswith(b"\n"):
                size = len(line) + _skip_line(handle)
                yield index + 1, _too_large(f"a line of {size:,} bytes", limit)
            elif not line.isspace():  # no copy, unlike strip(); the reads never yield b""
                yield index + 1, _parse_line(line, label, index + 1)


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


def _json_array(data: bytes, start: int, stop: int | None) -> Iterator[Raw]:
    """Rows of a JSON array.

    A clean array is parsed in one call; one whose text holds a suspect escape or literal, or that
    does not parse, is parsed an element at a time, so each row is checked on its own text span
    and the rows before a break are still read.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _ReadError(f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    if not _suspect(text):
        made = _NotFinite.made
        try:
            records = _DECODER.decode(text)
        except (json.JSONDecodeError, RecursionError):
            records = None
        if isinstance(records, list) and _NotFinite.made == made:
            yield from islice(enumerate(records), start, stop)
            return
    yield from _json_array_rows(text, start, stop)


def _json_array_rows(text: str, start: int, stop: int | None) -> Iterator[Raw]:
    pos = _skip_blanks(text, _skip_blanks(text, 0) + 1)  # past "["
    row = 0
    while not text.startswith("]", pos):
        where = None if row == 0 else row
        made = _NotFinite.made
        try:
            record, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            reason = f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            raise _ReadError(
                reason if row == 0 else f"{reason} (row {row}; the rows before it are read)", where
            ) from None
        except RecursionError:
            raise _ReadError(f"row {row} is nested too deeply to read", where) from None
        if row >= start:
            check = _NotFinite.made != made or _suspect(text, pos, end)
            yield row, _checked(record) if check else record
        row += 1
        pos = _skip_blanks(text, end)
        if text.startswith(",", pos):
            pos = _skip_blanks(text, pos + 1)
        elif not text.startswith("]", pos):
            raise _ReadError(f"not valid JSON: expected ',' or ']' after row {row - 1}", row)
        if stop is not None and row >= stop:
            return
    if text[pos + 1 :].strip():
        raise _ReadError("not valid JSON: extra data after the closing ']'", row)


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


_READ_ERRORS = _read_errors()


def record_hash(record: Any) -> str:
    """Content hash of the raw record: stable across key order and file format."""
    return hashlib.sha256(canonical_json(record).encode()).hexdigest()[:32]


def _example_id(record: dict, source: SourceConfig, default: str) -> str:
    id_field = source.fields.get("id")
    if id_field and record.get(id_field) is not None:
        return str(record[id_field])
    return default


def _get(record: dict, source: SourceConfig, key: str, kind: type | tuple[type, ...], *, required: bool) -> Any:
    column = source.fields.get(key)
    if column is None:
        return None
    value = record.get(column)
    if value is None or (value == "" and not required):
        if required:
            raise RecordError("missing", field=column)
        return None
    if not isinstance(value, kind):
        raise RecordError(f"expected {_kind(kind)}, got {type(value).__name__}", field=column)
    return value


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _tools(record: dict, source: SourceConfig) -> tuple[dict, ...] | None:
    """Tool definitions, given as a list or as a JSON string holding one (LLaMA-Factory style)."""
    value = _get(record, source, "tools", (list, str), required=False)
    if value is None:
        return None
    column = source.fields["tools"] or "tools"
    if isinstance(value, str):
        value = _embedded_json(value, "tools string", column)
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise RecordError("expected a list of tool definitions", field=column)
    # Bare function schemas (LLaMA-Factory/glaive: {"name", "description", "parameters"}) get the
    # OpenAI wrapper that chat templates index into (`tool.function`); Mistral's fails without it.
    value = [{"type": "function", "function": t} if "function" not in t and "name" in t else t for t in value]
    return tuple(value) or None


def _arguments(value: Any, field_name: str) -> Any:
    """Tool-call arguments as an object: templates serialize them with tojson themselves."""
    if isinstance(value, str):
        return _embedded_json(value, "tool-call arguments", field_name)
    return value


def _embedded_json(text: str, what: str, field_name: str) -> Any:
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


def _tool_call(call: Any, field_name: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise RecordError(f"expected a tool call object, got {type(call).__name__}", field=field_name)
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError("tool call has no function name", field=field_name)
    normalized: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments", {}), field_name)},
    }
    if call.get("id") is not None:
        normalized["id"] = str(call["id"])
    return normalized


def _content(value: Any) -> tuple[str, str | None, list[dict]]:
    """Message content as (text, reasoning, tool calls). Content parts are flattened in order."""
    if value is None:
        return "", None, []
    if isinstance(value, str):
        return value, None, []
    if not isinstance(value, list):
        raise RecordError(f"content must be a string or a list of parts, got {type(value).__name__}", field=".content")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for part in value:
        if not isinstance(part, dict):
            raise RecordError("content part is not an object", field=".content")
        kind = part.get("type", "text")
        text = part.get("text", part.get("value"))
        if kind == "text" and isinstance(text, str):
            texts.append(text)
        elif kind in ("reasoning", "thinking") and isinstance(text, str):
            reasoning.append(text)
        elif kind == "tool_call":
            calls.append(_tool_call(_arguments(text, ".content") if isinstance(text, str) else text, ".content"))
        else:
            raise RecordError(f"unsupported content part {kind!r}", field=".content")
    return "".join(texts), ("\n".join(reasoning) if reasoning else None), calls


_ROLE_SET = frozenset(ROLES)


def _message(raw: Any) -> Message:
    """One message; a RecordError's field is relative (`.role`), the caller puts the message's path in front."""
    if type(raw) is dict and len(raw) == 2:
        # Most messages are exactly {role, content: str}; they skip the checks for optional keys.
        role, content = raw.get("role"), raw.get("content")
        if type(content) is str and role in _ROLE_SET:
            return Message(role, content)
    if not isinstance(raw, dict):
        raise RecordError(f"message is not an object: {raw!r:.60}")
    role = raw.get("role")
    if role not in _ROLE_SET:
        raise RecordError(f"unknown role {role!r} (expected {', '.join(ROLES)})", field=".role")
    content, reasoning, part_calls = _content(raw.get("content"))
    calls_raw = raw.get("tool_calls") or []
    if not isinstance(calls_raw, list):
        raise RecordError("tool_calls must be a list", field=".tool_calls")
    calls = [_tool_call(c, ".tool_calls") for c in calls_raw] + part_calls
    if calls and role != "assistant":
        raise RecordError(f"only assistant messages make tool calls, not {role!r}", field=".tool_calls")
    reasoning = raw.get("reasoning_content", reasoning)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError("reasoning_content must be a string", field=".reasoning_content")
    train = raw.get("train", raw.get("weight"))
    if train is not None:
        if train not in (0, 1, True, False):
            raise RecordError(f"train/weight must be true/false or 0/1, got {train!r}", field=".train")
        train = bool(train)
    call_id, name = raw.get("tool_call_id"), raw.get("name")
    return Message(
        role=role,
        content=content,
        tool_calls=tuple(calls),
        tool_call_id=None if call_id is None else str(call_id),
        name=name if isinstance(name, str) else None,
        reasoning_content=reasoning,
        train=train,
    )


def _messages(raw_messages: list, column: str) -> tuple[Message, ...]:
    messages = _message_list(raw_messages, column)
    _check_conversation(messages, column)
    return tuple(messages)


def _message_list(raw_messages: list, column: str) -> list[Message]:
    messages = []
    for i, raw in enumerate(raw_messages):
        try:
            messages.append(_message(raw))
        except RecordError as error:
            error.field = f"{column}[{i}]{error.field}"  # the path is built only for a record that fails
            raise
    return messages


def _check_conversation(messages: list[Message], column: str) -> None:
    if not messages:
        raise RecordError("empty conversation", field=column)
    if messages[0].role == "system" and all(m.role == "system" for m in messages):
        raise RecordError("conversation has only system messages", field=column)


def from_messages(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    column = source.fields["messages"] or "messages"
    messages = _messages(_get(record, source, "messages", list, required=True), column or "messages")
    return Example(example_id, source.name, record_hash(record), messages, _tools(record, source), location=location)


def from_sharegpt(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    column = source.fields["conversations"] or "conversations"
    turns = _get(record, source, "conversations", list, required=True)
    messages: list[Message] = []
    system = _get(record, source, "system", str, required=False)
    if system:
        messages.append(Message("system", system))
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError("turn is not an object", field=where)
        speaker, value = turn.get("from"), turn.get("value")
        role = source.role_map.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise RecordError(f"unknown speaker {speaker!r} (add it to role_map)", field=f"{where}.from")
        if not isinstance(value, str):
            raise RecordError(f"expected a string, got {type(value).__name__}", field=f"{where}.value")
        if role == "function_call":
            call = _embedded_json(value, "function_call value", f"{where}.value")
            calls = call if isinstance(call, list) else [call]
            messages.append(Message("assistant", "", tool_calls=tuple(_tool_call(c, f"{where}.value") for c in calls)))
        else:
            messages.append(Message(role, value))
    _check_conversation(messages, column)
    return Example(
        example_id, source.name, record_hash(record), tuple(messages), _tools(record, source), location=location
    )


def from_alpaca(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    instruction = _get(record, source, "instruction", str, required=True)
    extra = _get(record, source, "input", str, required=False)
    output = _get(record, source, "output", str, required=True)
    system = _get(record, source, "system", str, required=False)
    history = _get(record, source, "history", list, required=False) or []
    messages = [Message("system", system)] if system else []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RecordError(
                "history entries must be [prompt, response] pairs", field=f"{source.fields['history']}[{i}]"
            )
        messages += [Message("user", pair[0]), Message("assistant", pair[1])]
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages += [Message("user", prompt), Message("assistant", output)]
    return Example(example_id, source.name, record_hash(record), tuple(messages), location=location)


def from_text(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    text = _get(record, source, "text", str, required=True)
    if not text:
        raise RecordError("empty text", field=source.fields["text"] or "text")
    return Example(example_id, source.name, record_hash(record), text=text, location=location)


def from_prompt_completion(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    """TRL's prompt-completion record: `prompt` and `completion`, both strings or both lists of messages.

    Only the completion is trained. Strings are a text document, as TRL tokenizes them: prompt text then
    completion text, no chat template, ending with EOS (as `format: text` does) which is trained with the
    completion. Messages go through the chat template; the completion's assistant messages are the targets
    (its tool results stay context), the prompt is context whatever `train.roles` says.
    """
    prompt = _get(record, source, "prompt", (str, list), required=True)
    completion = _get(record, source, "completion", (str, list), required=True)
    prompt_column, completion_column = source.fields["prompt"] or "prompt", source.fields["completion"] or "completion"
    if isinstance(prompt, str) != isinstance(completion, str):
        raise RecordError(
            f"prompt is {_kind(type(prompt))} but completion is {_kind(type(completion))}: both must be strings "
            "(plain text) or both lists of messages (a conversation)",
            field=completion_column,
        )
    if isinstance(prompt, str):
        if not completion:
            raise RecordError("empty completion: nothing to train", field=completion_column)
        return Example(
            example_id,
            source.name,
            record_hash(record),
            text=prompt + completion,
            context_chars=len(prompt),
            location=location,
        )
    context = _message_list(prompt, prompt_column)  # a prompt may be a system message alone
    answer = _message_list(completion, completion_column)
    if not any(m.role == "assistant" for m in answer):
        raise RecordError("the completion has no assistant message: nothing to train", field=completion_column)
    messages = tuple(replace(m, train=False) for m in context) + tuple(
        replace(m, train=m.role == "assistant") for m in answer
    )
    return Example(example_id, source.name, record_hash(record), messages, _tools(record, source), location=location)


def with_system(parsed: Parsed, system: str) -> Parsed:
    """The source's default system prompt put first when a conversation has no system message.

    It is context, never a target (the config wrote it, not the data), whatever `train.roles` says. Text
    documents (format: text, string prompt-completion and string pairs) have no conversation to add it to.
    """
    default = Message("system", system, train=False)
    if isinstance(parsed, Example):
        if parsed.is_text or any(m.role == "system" for m in parsed.messages):
            return parsed
        return replace(parsed, messages=(default, *parsed.messages))
    if parsed.is_text or any(m.role == "system" for m in parsed.prompt):
        return parsed
    return replace(parsed, prompt=(default, *parsed.prompt))


def _canonical_columns(record: dict, source: SourceConfig) -> dict:
    """The record with its configured columns under the names packtool.preference reads (`fields` remaps them)."""
    renamed = {key: record[column] for key, column in source.fields.items() if column and column in record}
    return {**record, **renamed}


def from_preference(record: dict, source: SourceConfig, example_id: str, location: str) -> PreferencePair:
    # imported here: packtool.preference builds on this module's message adapters
    from packtool.preference import pair_from_record

    return pair_from_record(
        _canonical_columns(record, source),
        sample_id=example_id,
        source=source.name,
        location=location,
        role_map=source.role_map or None,
    )


def from_group(record: dict, source: SourceConfig, example_id: str, location: str) -> CompletionGroup:
    from packtool.preference import group_from_record

    return group_from_record(
        _canonical_columns(record, source), sample_id=example_id, source=source.name, location=location
    )


ADAPTERS: dict[str, Adapter] = {
    "messages": from_messages,
    "sharegpt": from_sharegpt,
    "alpaca": from_alpaca,
    "text": from_text,
    "prompt_completion": from_prompt_completion,
    "preference": from_preference,
    "group": from_group,
}
