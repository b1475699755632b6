"""Encode phase: one work item per input file or row range of one -> one token-store partition and its report.

    file --read_file--> Example | RecordError --render--> Rendered --encode_batch--> Tokenized
         --PartitionWriter--> CACHE/tokens/KEY.arrow      (samples that tokenized and passed the self-check)
    file --read_file--> PreferencePair | CompletionGroup --encode_answers--> one Tokenized per answer
         --truncate_item--> segments fit for one pack, cut jointly (or a drop: pair_too_long, group_too_long)
         --PartitionWriter--> consecutive rows with the record's ordinal, each with its SegmentRole
         --report-----------> CACHE/tokens/KEY.json       (read, rejected/dropped by reason, each reject)

A work item whose entry exists under its key, and is as it was written (TokenCache.check), is not
redone. Under `on_error: fail` an item stops at its first bad record and writes nothing; the driver
turns that into the one-line error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple, dataclass, field, replace
from functools import partial
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packtool.adapters import Parsed
from packtool.arrow import content_digest
from packtool.builder.accounting import SPECIAL_TOKEN_LITERAL, Counts
from packtool.builder.cache import (
    TokenCache,
    code_fingerprint,
    file_sha256,
    publish_file,
    seal_report,
)
from packtool.builder.store import PartitionReader, PartitionWriter, SegmentRole
from packtool.chat_templates import ChatTemplate, template_for
from packtool.config import BuildConfig, SourceConfig, TrainPolicy, canonical_json, item_fit_parts, keyed_parts
from packtool.encode import TextTokenizer, encode_batch, has_special_literal, load_tokenizer
from packtool.errors import RecordError
from packtool.format import REJECTS
from packtool.packing_items import KIND_CODES
from packtool.reading import BOM, READ_ERRORS, Span, open_text, sniff
from packtool.records import (
    CompletionGroup,
    Messages,
    PreferencePair,
    Rendered,
    Tokenized,
    answer_example,
    prompt_length,
)
from packtool.render import render_example
from packtool.sources import read_file
from packtool.truncate import ItemTruncation, truncate_item

RANGE_ROWS = 4096  # lines or rows per encode work item of a large file (see row_ranges)
ENCODE_BATCH = 512  # records rendered, then tokenized together (tokenizers batches in Rust)
# Threads that tokenize and label rendered chunks in one process, while its reading thread renders the
# next (see _outcomes). Two: each spends most of its time in the tokenizer, which releases the GIL, so
# two keep two cores busy beside the renders; a third tokenizes on a core another already holds (~6%
# more tokenizer CPU in all on 2 cores). -j 1 against three threads that each rendered too (6-8
# alternating pairs): alpaca 0.97x, Qwen3 reasoning 0.95x, glaive 0.92x wall.
ENCODE_THREADS = 2
# An item's first chunk (see _chunks). Traced on the alpaca bench set, -j 1 (three items): no thread was in
# the tokenizer for 12-16% of the encode phase with 512-record first chunks, 8-9% with these.
FIRST_CHUNK = 64
PARALLELISM = "TOKENIZERS_PARALLELISM"


@dataclass(frozen=True)
class EncodeItem:
    """One input file of one source, or a row range of a large one (see row_ranges), and where its partition goes."""

    config: BuildConfig
    source: str
    file: str
    key: str
    cache_root: str
    stop_at_bad: bool  # on_error: fail
    stop: int | None  # the source's max_samples: no file gives more (the plan keeps the source's first N)
    start: int = 0  # positions start..end of the file (JSON Lines lines, rows from 0): a row range of a large file
    end: int | None = None

    share: float = 1.0  # of the file's lines or rows: what progress counts for this item
    content: str = ""  # RowRange.content: in the key; the summary compares it with the last build's
    rows: int | None = None  # the file's lines or rows, where counted (RowRange.rows)
    offset: int | None = None  # RowRange.offset, size, unit: what `content` hashes
    size: int | None = None
    unit: str | None = None
    # The entry of this range at an earlier build, when the range was then the file's last and may since have
    # grown by appended lines or rows: encode_item reuses its rows if what they came from starts this range.
    grown_from: str | None = None

    @property
    def bytes(self) -> int:
        return round(os.path.getsize(self.file) * self.share)

    def span(self) -> Span | None:
        """What the encode may read: the bytes or rows `content` hashes (None: the whole file, keyed by its bytes)."""
        if self.unit is None or self.size is None:
            return None
        return Span(self.offset or 0, self.start, self.size)


@dataclass(frozen=True)
class RowRange:
    """Positions start..end of one input file (end None: to the end) and the sha256 of what decides its samples.

    `content` hashes the range's own rows: the bytes of its lines for plain JSON Lines, the values of its
    rows for Parquet and Arrow (arrow.content_digest), so rows appended to a file change only its last
    range and add new ones. Compressed JSON Lines are one range, hashed over the decompressed text (so
    another compression of the same lines keeps the hash, and lines appended to it extend what it
    hashed); JSON arrays are one range, keyed by the whole file's sha256."""

    start: int
    end: int | None
    content: str
    rows: int | None = None  # the file's lines or rows, where counted (None: read whole, not counted)
    # What `content` hashes: `size` bytes of the file's text (decompressed) from byte `offset` (JSON Lines), or
    # `size` rows from `start` (tables)
    offset: int | None = None
    size: int | None = None
    unit: str | None = None  # "bytes", "rows"; None: the whole file


TABLE_KINDS = ("parquet", "arrow_file", "arrow_stream")
COMPRESSED_KINDS = ("gzip", "zstd")  # what packtool.reading decompresses


def row_ranges(file: str, max_samples: int | None, cache: TokenCache | None = None) -> list[RowRange]:
    """How one input file splits into encode work items, as positions for `read_file` and their content hash.

    A plain JSON Lines file of L lines (blank lines included) or a Parquet or Arrow file of L rows splits at
    fixed multiples of RANGE_ROWS, so that all workers share one large file and appended rows only change
    the last range or add new ones:

        lines  0 ........ R | R ........ 2R | ... | (n-1)R ........ end
               item 0         item 1                item n-1 (end: None)

    Locations and ids come from the file and the line or row, so they do not depend on the split, and the
    partitions are read back in item order, so the plan and the shards do not either. Compressed files and
    JSON arrays are read from their first byte whatever the range, and a source with max_samples counts
    records across the file: those stay one item (compressed JSON Lines hashed over their text,
    _compressed_ranges). So does a file that breaks while it is hashed (a damaged table or compressed
    stream), keyed by its bytes: its read says where. The ranges of a table or a compressed file are
    remembered in `cache`, by the file's sha256 (_remembered).
    """
    try:
        kind = sniff(file)
        if max_samples is None and kind == "text" and (ranges := _json_lines_ranges(file, kind)):
            return ranges
        if max_samples is None and kind in COMPRESSED_KINDS:
            return _remembered_ranges(file, cache, partial(_compressed_ranges, file, kind))
        if max_samples is None and kind in TABLE_KINDS:
            return _remembered_ranges(file, cache, lambda _: _table_ranges(file, kind))
    except READ_ERRORS:
        pass  # keyed by its bytes below, or unreadable; the read reports the problem, once
    try:
        return [RowRange(0, None, file_sha256(file))]
    except OSError:
        return [RowRange(0, None, "unreadable")]


def _table_ranges(file: str, kind: str) -> list[RowRange]:
    """The ranges of a Parquet or Arrow file, each hashed over the names, types and values of its own rows.

    The rows of one range are put together before they are hashed, so neither the file's row groups or
    batches nor its compression change a range's hash: a file written again with rows appended keeps the
    hash of every full range before them. One range's rows are in memory at a time. Decoding and hashing
    cost ~11 us a row (20 x quickstart chat as Parquet), so a file whose bytes are as at an earlier build
    takes that build's hashes from the cache instead (_remembered_ranges; reading its bytes: ~1 GB/s)."""
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
                digests.append(_rows_digest(schema, pending))
                pending, held = [], 0
    if held or not digests:  # rows after the last full range (or one range in all)
        digests.append(_rows_digest(schema, pending))
    return _ranges_of(digests, rows)


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


def _remembered_ranges(
    file: str, cache: TokenCache | None, ranges_of: Callable[[str], list[RowRange]]
) -> list[RowRange]:
    """`ranges_of(the file's sha256)`, or the ranges recorded in `cache` for a file of these bytes at an earlier
    build: reading the bytes (~1 GB/s) costs less than decoding a table's rows or decompressing a file."""
    whole = file_sha256(file)
    remembered = _remembered(cache, whole) if cache is not None else None
    if remembered is not None:
        return remembered
    ranges = ranges_of(whole)
    if cache is not None:
        _remember(cache, whole, ranges)
    return ranges


def _memo(cache: TokenCache, whole: str) -> Path:
    name = hashlib.sha256(canonical_json(["file ranges", whole, RANGE_ROWS, code_fingerprint()]).encode()).hexdigest()
    return cache.root / "files" / name[:2] / f"{name}.json"


_RANGE_FIELDS = (int, int | None, str, int | None, int | None, int | None, str | None)  # RowRange's, in order


def _remembered(cache: TokenCache, whole: str) -> list[RowRange] | None:
    """The ranges recorded for a file of sha256 `whole` at RANGE_ROWS by this code; None when there are none,
    or the record is not as written (its seal) or not for these bytes."""
    memo = cache.read_sealed(_memo(cache, whole))
    if memo is None:
        return None
    if [memo.get("file_sha256"), memo.get("range_rows"), memo.get("code")] != [whole, RANGE_ROWS, code_fingerprint()]:
        return None
    ranges = memo.get("ranges")
    if not isinstance(ranges, list) or not ranges:
        return None
    sound = all(
        isinstance(r, list) and len(r) == len(_RANGE_FIELDS) and all(map(isinstance, r, _RANGE_FIELDS)) for r in ranges
    )
    return [RowRange(*r) for r in ranges] if sound else None


def _remember(cache: TokenCache, whole: str, ranges: list[RowRange]) -> None:
    memo = {
        "file_sha256": whole,
        "range_rows": RANGE_ROWS,
        "code": code_fingerprint(),
        "ranges": [list(astuple(r)) for r in ranges],
    }
    # unrecorded on OSError: the next build hashes the rows again; a full disk stops this one at its first entry
    with contextlib.suppress(OSError):
        cache.write_sealed(_memo(cache, whole), memo)


def _table_rows_digest(file: str, start: int, stop: int) -> str:
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
    return _rows_digest(schema, pending)


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


def _rows_digest(schema: pa.Schema, batches: list[pa.RecordBatch]) -> str:
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
    n = len(digests)
    return [
        RowRange(
            i * RANGE_ROWS,
            (i + 1) * RANGE_ROWS if i < n - 1 else None,
            d,
            lines,
            bounds[i],
            bounds[i + 1] - bounds[i],
            "bytes",
        )
        for i, d in enumerate(digests)
    ]


@dataclass(frozen=True)
class EncodeResult:
    key: str
    reused: bool
    failure: str | None = None  # the one-line message for on_error: fail
    repaired: str | None = None  # why the cache entry found was not reused (it was encoded again)
    carried: int = 0  # records taken from the entry of the range before it grew (EncodeItem.grown_from), not encoded
    # the file's last range held more when it was read than when it was hashed (appended during the build): what
    # was appended is not in this build, and is the next build's
    left: bool = False


@dataclass(frozen=True)
class Carried:
    """The first lines or rows of a range that grew, as encoded at an earlier build: that entry's report and
    partition."""

    report: dict[str, Any]
    partition: Path
    lines: int  # lines or rows of the file it covers, from the range's first

    @property
    def records(self) -> int:
        return int(self.report["read"])


def carried_prefix(item: EncodeItem, cache: TokenCache) -> tuple[Carried | None, str | None]:
    """The entry of `item.grown_from`, when it is as written and what it was encoded from starts this range:
    its bytes, up to a newline, for JSON Lines (decompressed, for a compressed file); its rows' values for
    Parquet and Arrow. None otherwise (the whole range is encoded), with the one line saying why when the
    entry is not as it was written or does not hold exactly the lines or rows its report records.

    Each line or row gives its records alone (its location is FILE:N, its outcome depends on its content
    only), so the rows of those lines are the rows a whole encode of the grown range would write first,
    and the records after them continue at the entry's record count."""
    if item.grown_from is None or item.size is None:
        return None, None
    report, damaged = cache.check(item.grown_from)  # a damaged entry is not used (the range is encoded whole)
    if report is None or report.get("content_unit") != item.unit:
        return None, damaged
    size, content = report.get("content_size"), report.get("content_sha256")
    if not isinstance(size, int) or not 0 < size < item.size or not isinstance(content, str):
        return None, None
    if any(reject.get("reason") == "unreadable_file" for reject in report["rejects"]):
        return None, None  # a read that broke part way stopped there: the lines after it were never encoded
    if item.unit == "rows":
        lines: int | None = size if _table_rows_digest(item.file, item.start, item.start + size) == content else None
    else:
        prefix = _text_prefix(item.file, item.offset or 0, size)
        # the earlier last line must have been whole: a line that had no newline may since have grown
        lines = prefix.lines if prefix is not None and prefix.whole_lines and prefix.sha256 == content else None
    if lines is None:
        return None, None
    partition = cache.partition(item.grown_from)
    first = item.start + (item.unit == "bytes")  # JSON Lines locations count lines from 1, tables rows from 0
    if (problem := _holds(report, partition, first, lines)) is not None:
        return None, f"cache entry {partition}: {problem}"
    return Carried(report, partition, lines), None


def _holds(report: dict[str, Any], partition: Path, first: int, lines: int) -> str | None:
    """Why an entry does not hold exactly the records of `lines` lines or rows from the one numbered `first`; None
    when it does: its report was written for that many, each record it read is stored or rejected (a pair's or
    group's rows share their record's ordinal), and each one it stores comes from one of those lines or rows."""
    if report.get("content_lines") != lines:
        return f"it was encoded from {report.get('content_lines')} lines or rows, not the {lines} it hashed"
    if not isinstance(report.get("read"), int):
        return f"its report's count of records read is {report.get('read')!r}, not a number"
    reader = PartitionReader(partition)
    try:
        ordinals = {*reader.column("ordinal").tolist(), *(r.get("ordinal") for r in report["rejects"])}
        numbers = [location.rpartition(":")[2] for location in reader.batch_column("location")]
    finally:
        reader.close()
    if ordinals != set(range(report["read"])):
        return f"it stores or rejects {len(ordinals)} records, not the {report['read']} its report says it read"
    if not all(n.isdigit() and first <= int(n) < first + lines for n in numbers):
        return f"it holds records from outside the {lines} lines or rows it was written for"
    return None


@dataclass(frozen=True)
class TextPrefix:
    """What carried_prefix checks of the first bytes of a range's text against its earlier entry."""

    sha256: str
    lines: int  # newlines in it
    whole_lines: bool  # it ends with a newline


def _text_prefix(file: str, offset: int, size: int) -> TextPrefix | None:
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


@dataclass(frozen=True)
class Stages:
    """Render and encode, with the tokenizer and template loaded once per process."""

    config: BuildConfig
    tokenizer: TextTokenizer
    template: ChatTemplate | None

    @classmethod
    def load(cls, config: BuildConfig) -> Stages:
        tokenizer = load_tokenizer(config.tokenizer)
        return cls(config, tokenizer, template_for(config, tokenizer.config))

    def fit_item(self, item: PreferencePair | CompletionGroup, source: SourceConfig) -> Outcome:
        """A pair or group: its answers encoded with one shared prompt, cut jointly to fit one pack."""
        try:
            segments = encode_answers(
                item,
                self.template,
                self.tokenizer,
                source.train,
                special_tokens=source.special_tokens,
                add_bos=self.config.encoding.add_bos,
                add_eos=self.config.encoding.add_eos,
            )
        except RecordError as error:
            error.sample_id = item.id
            return Outcome(item.location, item.id, error)
        too_long = "pair_too_long" if isinstance(item, PreferencePair) else "group_too_long"
        fitted = truncate_item(segments, self.config.capacity, self.config.truncation.items, too_long=too_long)
        return Outcome(item.location, item.id, fitted, roles=item_roles(item))

    def render(self, chunk: list[Parsed | RecordError], source: SourceConfig) -> Prepared:
        """Render each input in order; an input that cannot be rendered gets its Outcome (the RecordError
        saying why) at once, a rendered one waits for `encode`."""
        prepared = Prepared(source.special_tokens)
        for item in chunk:
            if isinstance(item, RecordError):
                prepared.outcomes.append(Outcome("", item.sample_id, item))  # the error names its own file and row
                continue
            if isinstance(item, PreferencePair | CompletionGroup):
                prepared.outcomes.append(self.fit_item(item, source))
                continue
            try:
                rendered = render_example(
                    item,
                    self.template,
                    self.tokenizer.config,
                    source.train,
                    add_bos=self.config.encoding.add_bos,
                    add_eos=self.config.encoding.add_eos,
                )
            except RecordError as error:
                error.sample_id = item.id
                prepared.outcomes.append(Outcome(item.location, item.id, error))
                continue
            prepared.outcomes.append(None)
            prepared.rendered.append(rendered)
            prepared.literals.append(has_special_literal(rendered, self.tokenizer))
        return prepared

    def encode(self, prepared: Prepared) -> list[Outcome]:
        """The Outcome of each input of a rendered chunk in order: its Tokenized sample or the RecordError
        saying why not, and whether its content spells a special token."""
        add_bos, add_eos = bool(self.config.encoding.add_bos), bool(self.config.encoding.add_eos)
        batch = [(rendered, prepared.special_tokens) for rendered in prepared.rendered]
        results = encode_batch(batch, self.tokenizer, add_bos=add_bos, add_eos=add_eos, literals=prepared.literals)
        encoded = (
            Outcome(rendered.example.location, rendered.example.id, result, literal)
            for rendered, literal, result in zip(prepared.rendered, prepared.literals, results, strict=True)
        )
        return [outcome if outcome is not None else next(encoded) for outcome in prepared.outcomes]


@dataclass
class Prepared:
    """A chunk rendered: an Outcome per input already decided (None: rendered, waits for its encoding), and
    the rendered samples in order with has_special_literal of each (searched once, for every policy)."""

    special_tokens: str  # the source's policy for special-token literals
    outcomes: list[Outcome | None] = field(default_factory=list)
    rendered: list[Rendered] = field(default_factory=list)
    literals: list[bool] = field(default_factory=list)


def item_roles(item: PreferencePair | CompletionGroup) -> tuple[SegmentRole, ...]:
    """The stored role of each answer's segment: chosen, rejected; or completion i with its floats."""
    if isinstance(item, PreferencePair):
        return (SegmentRole(KIND_CODES["chosen"]), SegmentRole(KIND_CODES["rejected"]))
    nan = (float("nan"),) * len(item.completions)
    return tuple(
        SegmentRole(KIND_CODES["completion"], i, reward, advantage)
        for i, (reward, advantage) in enumerate(zip(item.rewards or nan, item.advantages or nan))
    )


# -- pairs and groups ----------------------------------------------------------------------------
# Every answer of an item is rendered after the same prompt, so its segments share the prompt tokens:
#
#     pair "p7":   prompt = [system, user "2+2?"]   chosen = [assistant "4"]   rejected = [assistant "5"]
#
#     segment 0 (chosen)     P P P P P P h  4* E*        P: prompt tokens, h: the assistant header,
#     segment 1 (rejected)   P P P P P P h  5* E*        *: targets (the answer and its end marker)


def encode_answers(
    item: PreferencePair | CompletionGroup,
    template: ChatTemplate | None,
    tokenizer: TextTokenizer,
    policy: TrainPolicy = TrainPolicy(),
    *,
    special_tokens: str = "escape",
    add_bos: bool | None = None,
    add_eos: bool | None = None,
) -> tuple[Tokenized, ...]:
    """One Tokenized per answer (chosen, rejected; or each completion), all with the same prompt tokens.

    Each answer is rendered as prompt + answer by `render_example` and tokenized by
    `encode_batch`; the targets are the answer's assistant content and, when
    `policy.end_of_turn`, its end marker. Raises RecordError when a render fails or when the
    renders do not agree on the prompt tokens (a template whose prompt text depends on the
    answer would break the shared prompt cut).

    Plain-string items without a template are text continuations: `prompt + answer` as a
    document whose targets start at the answer.
    """
    if template is None and not item.is_text:
        raise RecordError("no chat template is configured for a chat preference record", kind="template_error")
    try:
        rendered = [
            _render_answer(item, answer, template, tokenizer, policy, add_bos, add_eos) for answer in item.answers
        ]
    except RecordError as error:
        error.sample_id = error.sample_id or item.id
        raise
    encoded = encode_batch(
        [(r, special_tokens) for r in rendered],
        tokenizer,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
    )
    segments = []
    for result in encoded:
        if isinstance(result, RecordError):
            raise result
        segments.append(result)
    _check_shared_prompt(segments, item.id)
    return tuple(segments)


def _render_answer(
    item: PreferencePair | CompletionGroup,
    answer: Messages,
    template: ChatTemplate | None,
    tokenizer: TextTokenizer,
    policy: TrainPolicy,
    add_bos: bool | None,
    add_eos: bool | None,
) -> Rendered:
    example = answer_example(item, answer, chat=template is not None)
    rendered = render_example(example, template, tokenizer.config, policy, add_bos=add_bos, add_eos=add_eos)
    if template is not None:
        return rendered
    prompt = item.prompt[0].content
    # render_text trains every character; a continuation trains the answer (and EOS as its end marker).
    (content_start, content_end) = rendered.content_ranges[0]
    end = len(rendered.text) if policy.end_of_turn else content_end
    return replace(rendered, target_ranges=((content_start + len(prompt), end, -1),))


def _check_shared_prompt(segments: Sequence[Tokenized], item_id: str) -> None:
    first = segments[0]
    n = prompt_length(first)
    for k, other in enumerate(segments[1:], start=1):
        if prompt_length(other) != n or not np.array_equal(first.input_ids[:n], other.input_ids[:n]):
            raise RecordError(
                f"answer {k} tokenizes the prompt differently from answer 0 (the template or the tokenizer "
                "merges prompt and answer), so the answers cannot share one prompt cut",
                kind="prompt_mismatch",
                sample_id=item_id,
            )
        if other.n_targets == 0:
            raise RecordError(f"answer {k} has no target token", kind="no_targets", sample_id=item_id)
    if first.n_targets == 0:
        raise RecordError("answer 0 has no target token", kind="no_targets", sample_id=item_id)


@dataclass(frozen=True, slots=True)
class Outcome:
    location: str
    example_id: str
    result: Tokenized | ItemTruncation | RecordError | None
    special_literal: bool = False
    roles: tuple[SegmentRole, ...] = ()  # per segment of an ItemTruncation


@dataclass
class Report:
    """What happened to each record of one file (its counts are added up per source into the manifest's accounting)."""

    source: str
    file: str
    samples: int = 0
    tokens: int = 0
    counts: Counts = field(default_factory=Counts)
    rejects: list[dict[str, Any]] = field(default_factory=list)  # {id, location, reason, detail, ordinal}

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "file": self.file,
            "samples": self.samples,
            "tokens": self.tokens,
            **self.counts.as_report(),
            "rejects": self.rejects,
        }


# One Stages per distinct (tokenizer, template, settings) in this process: a worker serves many items.
_STAGES: dict[str, Stages] = {}


def stages_for(config: BuildConfig) -> Stages:
    # Every config part a Stages reads is in the key, whole: a later build in this process (a notebook, a Ray
    # worker) with another capacity must not fit its pairs to the first build's.
    key = canonical_json(
        [keyed_parts(config, "content", "encode"), item_fit_parts(config), [s.format for s in config.sources]]
    )
    if key not in _STAGES:
        _STAGES[key] = Stages.load(config)
    return _STAGES[key]


def encode_item(item: EncodeItem) -> EncodeResult:
    """Run one encode work item (in any process); reuse its cache entry when complete and as it was written."""
    cache = TokenCache(Path(item.cache_root))
    cached, damaged = cache.check(item.key)  # a damaged entry is replaced below, as a new one is written
    if cached is not None:
        return EncodeResult(item.key, reused=True, failure=_stop_message(cached, item), left=_grown_since(item))
    carried, refused = carried_prefix(item, cache)
    damaged = damaged or refused
    if carried is not None and (failure := _stop_message(carried.report, item)) is not None:
        return EncodeResult(item.key, reused=False, failure=failure)
    source = next(s for s in item.config.sources if s.name == item.source)
    stages = stages_for(item.config)
    final = cache.partition(item.key)
    temporary = cache.temporary(final)
    report = Report(source.name, item.file)
    try:
        writer = PartitionWriter(temporary, source.name)
        try:
            if carried is not None:
                writer.extend(carried.partition)
                report.counts = Counts.from_report(carried.report, carried.records, 0)
                report.rejects = list(carried.report["rejects"])
            first = carried.records if carried is not None else 0
            skip = carried.lines if carried is not None else 0
            span = item.span()
            for ordinal, outcome in enumerate(_outcomes(item, stages, source, skip, span), start=first):
                failure = _record(outcome, ordinal, report, writer, item.stop_at_bad)
                if failure is not None:
                    return EncodeResult(item.key, reused=False, failure=failure)
        finally:
            writer.close()
        if span is not None and (changed := _changed_while_read(item, span)) is not None:
            return EncodeResult(
                item.key, reused=False, failure=changed
            )  # nothing is written under a key it does not fit
        report.samples, report.tokens = writer.rows, writer.tokens
        # what a later build checks before it reuses this entry's rows for the range grown (carried_prefix): the
        # lines or rows the entry was encoded from, exactly (the read stopped at the end of what was hashed)
        content = {}
        if span is not None:
            content = {
                "content_sha256": item.content,
                "content_size": item.size,
                "content_unit": item.unit,
                "content_lines": span.lines if item.unit == "bytes" else item.size,
            }
        sealed = seal_report({**report.as_dict(), **content}, item.key, temporary)
        publish_file(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)  # a full disk or a failure leaves no temporary behind
    report_path = cache.report(item.key)
    report_temporary = cache.temporary(report_path)
    try:
        report_temporary.write_text(json.dumps(sealed, ensure_ascii=False, sort_keys=True), encoding="utf-8")
        publish_file(report_temporary, report_path)  # last: the entry is complete
    finally:
        report_temporary.unlink(missing_ok=True)
    left = span is not None and item.end is None and span.more
    return EncodeResult(item.key, False, repaired=damaged, carried=carried.records if carried else 0, left=left)


def _changed_while_read(item: EncodeItem, span: Span) -> str | None:
    """Why the bytes or rows the encode read are not those the plan hashed into the item's key; None when they
    are. The read stops at the end of what was hashed, so rows appended since are never in it; only a change
    to the hashed bytes themselves (a file rewritten or cut while the build ran) is left to find here."""
    if item.unit == "rows":
        schema = span.schema if span.schema is not None else pa.schema([])
        same = span.read == item.size and _rows_digest(schema, span.batches) == item.content
    else:
        same = span.read == item.size and span.sha256() == item.content
    if same:
        return None
    end = item.end if item.end is not None else item.start + (span.lines if item.unit == "bytes" else span.size)
    what = "lines" if item.unit == "bytes" else "rows"
    return (
        f"{item.file}: {what} {item.start + 1:,}-{end:,} changed while the build read them (they are not what "
        "it hashed when it planned); nothing was published: run the build again once the file is written"
    )


def _grown_since(item: EncodeItem) -> bool:
    """Whether the plain JSON Lines file whose last range `item` is holds bytes past what was hashed (appended
    since). Tables and compressed files are written whole: their growth is seen by the read (Span.more)."""
    if item.end is not None or item.unit != "bytes" or item.size is None:
        return False
    try:
        return sniff(item.file) == "text" and os.path.getsize(item.file) > (item.offset or 0) + item.size
    except OSError:
        return False


def _stop_message(report: dict[str, Any], item: EncodeItem) -> str | None:
    """The message of the first bad record in an entry written under on_error: skip, when the item runs under
    on_error: fail (that record stops the build); None otherwise. Only bad input carries a message."""
    bad = (r["message"] for r in report["rejects"] if "message" in r)
    return next(bad, None) if item.stop_at_bad else None


def _outcomes(
    item: EncodeItem, stages: Stages, source: SourceConfig, skip: int = 0, span: Span | None = None
) -> Iterator[Outcome]:
    """The outcomes of the item's records in order: this thread reads and renders each chunk, ENCODE_THREADS
    threads tokenize and label the chunks rendered before it.

        this thread:  read+render k | read+render k+1 | store k | read+render k+2 | store k+1 ...
        thread 1:                   | tokenize k (Rust, no GIL), label k (GIL) | tokenize k+2 ...
        thread 2:                                     | tokenize k+1, label k+1 | ...

    The tokenizer releases the GIL, so one core tokenizes while the other renders. Renders no longer
    compete with each other for the GIL: three threads that each rendered, tokenized and labelled their
    own chunk took 1.03-1.09x this wall time (alternating pairs; glaive tool records, whose renders
    are long, gained most). Chunks are yielded in input order, so the partition's bytes do not depend
    on timing.
    """
    # a table's last range ends where its hashed rows end (a text span stops the read at its last byte)
    end = item.start + item.size if item.end is None and item.unit == "rows" and item.size is not None else item.end
    records = islice(read_file(source, item.file, item.start + skip, end, span), item.stop)
    chunks = _chunks(records, ENCODE_BATCH)
    with _tokenizer_threads_off(), ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="packtool-encode") as pool:
        pending: deque[Future[list[Outcome]]] = deque()
        for chunk in chunks:
            pending.append(pool.submit(stages.encode, stages.render(chunk, source)))
            # store what is done before rendering on, so the partition and memory keep pace
            while len(pending) > ENCODE_THREADS or (pending and pending[0].done()):
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


@contextlib.contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """One tokenizer thread per call while the encode threads run: they already overlap tokenizing
    with rendering, and tokenizers' own pool on top of them only oversubscribes the cores (chat
    bench, -j 1, median of 5: 5.5 s instead of 6.0 s). Worker processes set this for good; in the
    caller's process (-j 1) it is set for the item only, and never over the caller's own choice."""
    if PARALLELISM in os.environ:
        yield
        return
    os.environ[PARALLELISM] = "false"
    try:
        yield
    finally:
        os.environ.pop(PARALLELISM, None)


def _chunks(records: Iterator[Parsed | RecordError], size: int) -> Iterator[list[Parsed | RecordError]]:
    """Chunks of FIRST_CHUNK records, then twice as many each time up to `size`: the tokenizer starts on
    an item's records after 64 are read and rendered, not 512, while one core would wait."""
    n = min(FIRST_CHUNK, size)
    while chunk := list(islice(records, n)):
        yield chunk
        n = min(2 * n, size)


def _record(outcome: Outcome, ordinal: int, report: Report, writer: PartitionWriter, stop_at_bad: bool) -> str | None:
    """Store one outcome or count it under its reason; the fail message when bad input must stop the build."""
    result = outcome.result
    if isinstance(result, Tokenized):
        report.counts.note_record(literal=outcome.special_literal, straddling=(ordinal, result.straddled))
        writer.append(result, outcome.location, ordinal, outcome.special_literal)
        return None
    if isinstance(result, ItemTruncation):
        _record_item(result, outcome, ordinal, report, writer)
        return None
    if not isinstance(result, RecordError):
        raise RuntimeError(f"{outcome.location}: rendered but not encoded")
    if result.kind == SPECIAL_TOKEN_LITERAL:
        # valid input that this source's policy chose not to train: dropped, never a failure
        report.counts.note_record(result.kind)
        report.rejects.append(_reject(outcome.example_id, outcome.location, result.kind, result.reason, ordinal))
        return None
    result.sample_id = result.sample_id or outcome.example_id
    if not result.file and outcome.location:
        result.file = outcome.location
    message = f"{result.describe()} [{result.kind}] (on_error: skip sends such records to {REJECTS})"
    if stop_at_bad:
        return message
    report.counts.note_record(result.kind, bad_input=True, literal=outcome.special_literal)
    where = result.file if result.row is None else f"{result.file}:{result.row}"
    detail = f"field '{result.field}': {result.reason}" if result.field else result.reason
    report.rejects.append({**_reject(result.sample_id, where, result.kind, detail, ordinal), "message": message})
    return None


def _record_item(
    fitted: ItemTruncation, outcome: Outcome, ordinal: int, report: Report, writer: PartitionWriter
) -> None:
    """A pair or group: its segments as consecutive rows of one ordinal, or its drop (valid input that cannot fit)."""
    if fitted.drop_reason is not None:
        report.counts.note_record(fitted.drop_reason)
        report.rejects.append(_reject(outcome.example_id, outcome.location, fitted.drop_reason, fitted.detail, ordinal))
        return
    report.counts.note_record(straddling=(ordinal, sum(segment.straddled for segment in fitted.segments)))
    if fitted.removed_prompt_tokens:
        # a pair's or group's answers stay whole: only prompt tokens, never targets, are cut
        report.counts.note_truncation(fitted.strategy, fitted.removed_prompt_tokens * len(fitted.segments), 0)
    for segment, role in zip(fitted.segments, outcome.roles):
        writer.append(segment, outcome.location, ordinal, role=role)


def _reject(example_id: str, location: str, reason: str, detail: str, ordinal: int) -> dict[str, Any]:
    return {"id": example_id, "location": location, "reason": reason, "detail": detail, "ordinal": ordinal}
