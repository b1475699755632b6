"""Encode phase: one work item per input file or row range of one -> one token-store partition and its report.

    file --read_file--> Example | RecordError --render--> Rendered --encode_batch--> Tokenized
         --PartitionWriter--> CACHE/tokens/KEY.arrow      (samples that tokenized and passed the self-check)
    file --read_file--> PreferencePair | CompletionGroup --encode_answers--> one Tokenized per answer
         --truncate_item--> segments fit for one pack, cut jointly (or a drop: pair_too_long, group_too_long)
         --PartitionWriter--> consecutive rows with the record's ordinal, each with its SegmentRole
    a record not stored --RejectsWriter--> CACHE/tokens/KEY.rejects.arrow   (its reason, detail, error message)
         --report-----------> CACHE/tokens/KEY.json       (read, rejected/dropped by reason: counts only)

The steps live by job: a file's row ranges and their hashes in packtool.ranges, render and encode on
threads in builder.stages, a pair's or group's answers in builder.answers; this module stores what they
give, under the item's key.

A work item whose entry exists under its key, and is as it was written (TokenCache.check), is not
redone. Under `on_error: fail` an item stops at its first bad record and writes nothing; the driver
turns that into the one-line error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from dataclasses import astuple, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import pyarrow as pa

from packtool.builder.accounting import DROP_KINDS, Counts
from packtool.builder.cache import TokenCache, code_fingerprint, publish_file, seal_report
from packtool.builder.stages import Outcome, outcomes, stages_for
from packtool.builder.store import (
    PartitionReader,
    PartitionWriter,
    Reject,
    RejectsWriter,
    read_rejects,
    reject_ordinals,
)
from packtool.config import BuildConfig, canonical_json, config_folder
from packtool.errors import RecordError
from packtool.format import REJECTS, sha256_file
from packtool.ranges import UNREADABLE, RowRange, rows_digest, table_rows_digest, text_prefix
from packtool.reading import READ_ERRORS, Span, sniff
from packtool.records import Tokenized
from packtool.sources import read_file
from packtool.truncate import ItemTruncation


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
        return Span(self.offset or 0, self.start, self.size, elements=self.unit == "elements")


@dataclass(frozen=True)
class CachedRanges:
    """The ranges of tables and compressed files, kept in the token cache by the file's sha256 (ranges.RangeMemo):
    a file whose bytes are as at an earlier build is not decoded or decompressed again to split it."""

    cache: TokenCache

    def _path(self, whole: str, range_rows: int) -> Path:
        name = hashlib.sha256(canonical_json(["file ranges", whole, range_rows, code_fingerprint()]).encode())
        digest = name.hexdigest()
        return self.cache.root / "files" / digest[:2] / f"{digest}.json"

    def recall(self, whole: str, range_rows: int) -> list[RowRange] | None:
        """The ranges recorded for a file of sha256 `whole` at `range_rows` by this code; None when there are
        none, or the record is not as written (its seal) or not for these bytes."""
        memo = self.cache.read_sealed(self._path(whole, range_rows))
        if memo is None:
            return None
        if [memo.get("file_sha256"), memo.get("range_rows"), memo.get("code")] != [
            whole,
            range_rows,
            code_fingerprint(),
        ]:
            return None
        ranges = memo.get("ranges")
        if not isinstance(ranges, list) or not ranges:
            return None
        sound = all(
            isinstance(r, list) and len(r) == len(_RANGE_FIELDS) and all(map(isinstance, r, _RANGE_FIELDS))
            for r in ranges
        )
        return [RowRange(*r) for r in ranges] if sound else None

    def remember(self, whole: str, range_rows: int, ranges: list[RowRange]) -> None:
        memo = {
            "file_sha256": whole,
            "range_rows": range_rows,
            "code": code_fingerprint(),
            "ranges": [list(astuple(r)) for r in ranges],
        }
        # unrecorded on OSError: the next build hashes the rows again; a full disk stops this one at its first entry
        with contextlib.suppress(OSError):
            self.cache.write_sealed(self._path(whole, range_rows), memo)


_RANGE_FIELDS = (int, int | None, str, int | None, int | None, int | None, str | None)  # RowRange's, in order


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
    # samples each render route produced in this run (render.Accelerators.routes); none for a reused entry
    routes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Carried:
    """The first lines or rows of a range that grew, as encoded at an earlier build: that entry's report,
    partition and rejects table."""

    report: dict[str, Any]
    partition: Path
    rejects: Path
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
    if item.grown_from is None or item.size is None or item.unit not in ("bytes", "rows"):
        return None, None  # a JSON array's rows are not appended: its file is written again, to its "]"
    report, damaged = cache.check(item.grown_from)  # a damaged entry is not used (the range is encoded whole)
    if report is None or report.get("content_unit") != item.unit:
        return None, damaged
    size, content = report.get("content_size"), report.get("content_sha256")
    if not isinstance(size, int) or not 0 < size < item.size or not isinstance(content, str):
        return None, None
    if report["rejected"].get("unreadable_file"):
        return None, None  # a read that broke part way stopped there: the lines after it were never encoded
    if item.unit == "rows":
        lines: int | None = size if table_rows_digest(item.file, item.start, item.start + size) == content else None
    else:
        prefix = text_prefix(item.file, item.offset or 0, size)
        # the earlier last line must have been whole: a line that had no newline may since have grown
        lines = prefix.lines if prefix is not None and prefix.whole_lines and prefix.sha256 == content else None
    if lines is None:
        return None, None
    partition = cache.partition(item.grown_from)
    if item.config.processor and (stale := stale_image(partition, item)) is not None:
        return None, stale
    first = item.start + (item.unit == "bytes")  # JSON Lines locations count lines from 1, tables rows from 0
    rejects = cache.rejects(item.grown_from)
    if (problem := _holds(report, partition, rejects, first, lines)) is not None:
        return None, f"cache entry {partition}: {problem}"
    return Carried(report, partition, rejects, lines), None


def stale_image(partition: Path, item: EncodeItem) -> str | None:
    """Why an entry's images are not the files they reference now (one missing, or not the bytes encoded: an
    image's grid and sha256 were computed from them, and no key holds an image file's content); None when every
    one still hashes as recorded. Each file is hashed once, however many samples show it."""
    reader = PartitionReader(partition)
    try:
        recorded = {
            (image["reference"], image["sha256"]) for images in reader.batch_column("images") for image in images
        }
    finally:
        reader.close()
    root = config_folder(item.config)
    for reference, sha256 in sorted(recorded):
        if not reference:  # bytes the record carried: stored with the entry, sealed with it
            continue
        try:
            found = sha256_file(root / reference)
        except OSError:
            return f"cache entry {partition}: its image {reference} cannot be read now"
        if found != sha256:
            return f"cache entry {partition}: its image {reference} changed since it was encoded"
    return None


def _holds(report: dict[str, Any], partition: Path, rejects: Path, first: int, lines: int) -> str | None:
    """Why an entry does not hold exactly the records of `lines` lines or rows from the one numbered `first`; None
    when it does: its report was written for that many, each record it read is stored or rejected (a pair's or
    group's rows share their record's ordinal), and each one it stores comes from one of those lines or rows."""
    if report.get("content_lines") != lines:
        return f"it was encoded from {report.get('content_lines')} lines or rows, not the {lines} it hashed"
    if not isinstance(report.get("read"), int):
        return f"its report's count of records read is {report.get('read')!r}, not a number"
    reader = PartitionReader(partition)
    try:
        ordinals = {*reader.column("ordinal").tolist(), *reject_ordinals(rejects).tolist()}
        numbers = [location.rpartition(":")[2] for location in reader.batch_column("location")]
    finally:
        reader.close()
    if ordinals != set(range(report["read"])):
        return f"it stores or rejects {len(ordinals)} records, not the {report['read']} its report says it read"
    if not all(n.isdigit() and first <= int(n) < first + lines for n in numbers):
        return f"it holds records from outside the {lines} lines or rows it was written for"
    return None


@dataclass
class Report:
    """What happened to each record of one file, counted (added up per source into the manifest's accounting);
    each record not stored is a row of the item's rejects table."""

    source: str
    file: str
    samples: int = 0
    tokens: int = 0
    counts: Counts = field(default_factory=Counts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "file": self.file,
            "samples": self.samples,
            "tokens": self.tokens,
            **self.counts.as_report(),
        }


def encode_item(item: EncodeItem) -> EncodeResult:
    """Run one encode work item (in any process); reuse its cache entry when complete and as it was written."""
    cache = TokenCache(Path(item.cache_root))
    cached, damaged = cache.check(item.key)  # a damaged entry is replaced below, as a new one is written
    if cached is not None and item.config.processor and (stale := stale_image(cache.partition(item.key), item)):
        cached, damaged = None, stale  # its images are not the files now: encoded again
    if cached is not None:
        failure = _stop_message(cached, cache.rejects(item.key), item)
        return EncodeResult(item.key, reused=True, failure=failure, left=_grown_since(item))
    carried, refused = carried_prefix(item, cache)
    damaged = damaged or refused
    if carried is not None and (failure := _stop_message(carried.report, carried.rejects, item)) is not None:
        return EncodeResult(item.key, reused=False, failure=failure)
    source = next(s for s in item.config.sources if s.name == item.source)
    stages = stages_for(item.config)
    final, final_rejects = cache.partition(item.key), cache.rejects(item.key)
    temporary, temporary_rejects = cache.temporary(final), cache.temporary(final_rejects)
    report = Report(source.name, item.file)
    routes_before = Counter(stages.accelerators.routes)
    try:
        writer = PartitionWriter(temporary, source.name)
        lost = RejectsWriter(temporary_rejects)
        try:
            if carried is not None:
                writer.extend(carried.partition)
                lost.extend(carried.rejects)
                totals = Counts(
                    special_token_literals=carried.report["special_token_literals"],
                    straddling_targets=carried.report["straddling_targets"],
                    contamination_reported=carried.report.get("contamination_reported", 0),
                )
                report.counts = Counts.from_report(carried.report, carried.records, totals, _nothing_lost)
            first = carried.records if carried is not None else 0
            skip = carried.lines if carried is not None else 0
            span = item.span()
            # a table's last range ends where its hashed rows end (a text span stops the read at its last byte)
            table_end = item.end is None and item.unit == "rows" and item.size is not None
            end = item.start + item.size if table_end and item.size is not None else item.end
            images = item.config.processor is not None
            records = islice(read_file(source, item.file, item.start + skip, end, span, images=images), item.stop)
            for ordinal, outcome in enumerate(outcomes(stages, source, records), start=first):
                failure = _record(outcome, ordinal, report, writer, lost, item.stop_at_bad)
                if failure is not None:  # a file rewritten under the build reads as bad records: name the change
                    return EncodeResult(item.key, reused=False, failure=_changed_since_hashed(item) or failure)
        finally:
            writer.close()
            lost.close()
        changed = _changed_while_read(item, span) if span is not None else _file_changed(item)
        if changed is not None:  # nothing is written under a key it does not fit
            return EncodeResult(item.key, reused=False, failure=changed)
        report.samples, report.tokens = writer.rows, writer.tokens
        # what a later build checks before it reuses this entry's rows for the range grown (carried_prefix): the
        # lines or rows the entry was encoded from, exactly (the read stopped at the end of what was hashed)
        content = {}
        if span is not None:
            content = {
                "content_sha256": item.content,
                "content_size": item.size,
                "content_unit": item.unit,
                "content_lines": span.lines if item.unit == "bytes" else _rows_of(item),
            }
        sealed = seal_report({**report.as_dict(), **content}, item.key, temporary, temporary_rejects)
        publish_file(temporary, final)
        publish_file(temporary_rejects, final_rejects)
    finally:
        temporary.unlink(missing_ok=True)  # a full disk or a failure leaves no temporary behind
        temporary_rejects.unlink(missing_ok=True)
    report_path = cache.report(item.key)
    report_temporary = cache.temporary(report_path)
    try:
        report_temporary.write_text(json.dumps(sealed, ensure_ascii=False, sort_keys=True), encoding="utf-8")
        publish_file(report_temporary, report_path)  # last: the entry is complete
    finally:
        report_temporary.unlink(missing_ok=True)
    left = span is not None and item.end is None and span.more
    routes = dict(stages.accelerators.routes - routes_before)
    carried_records = carried.records if carried else 0
    return EncodeResult(item.key, False, repaired=damaged, carried=carried_records, left=left, routes=routes)


def _changed_while_read(item: EncodeItem, span: Span) -> str | None:
    """Why the bytes or rows the encode read are not those the plan hashed into the item's key; None when they
    are. The read stops at the end of what was hashed, so rows appended since are never in it; only a change
    to the hashed bytes themselves (a file rewritten or cut while the build ran) is left to find here."""
    if item.unit == "rows":
        schema = span.schema if span.schema is not None else pa.schema([])
        same = span.read == item.size and rows_digest(schema, span.batches) == item.content
    else:
        same = span.read == item.size and span.sha256() == item.content
    if same:
        return None
    rows = span.lines if item.unit == "bytes" else _rows_of(item)
    end = item.end if item.end is not None else None if rows is None else item.start + rows
    return _changed_message(item, end)


def _rows_of(item: EncodeItem) -> int | None:
    """The rows of a table's range, or the elements of a JSON array's, that its content hashes."""
    if item.unit == "rows":
        return item.size
    return None if item.rows is None else (item.end if item.end is not None else item.rows) - item.start


def _changed_message(item: EncodeItem, end: int | None) -> str:
    what = "lines" if item.unit == "bytes" else "rows"
    where = f"{item.start + 1:,}-{end:,}" if end is not None else f"{item.start + 1:,} on"
    return (
        f"{item.file}: {what} {where} changed while the build read them (they are not what "
        "it hashed when it planned); nothing was published: run the build again once the file is written"
    )


def _file_changed(item: EncodeItem) -> str | None:
    """Why a range keyed by its whole file's bytes (a JSON array, a source with max_samples: no span bounds
    their read) is not what the plan hashed; None when the file's sha256 is still the key's. Hashed again
    after the read: a row appended or changed while the build ran would be trained under the earlier key."""
    if item.unit is not None:
        return None
    try:
        now = sha256_file(item.file)
    except OSError:  # unreadable now: as at the plan, the read's reject says why; since, a change
        now = UNREADABLE
    if now == item.content:
        return None
    return (
        f"{item.file}: its bytes changed while the build read it (they are not those it hashed when it planned); "
        "nothing was published: run the build again once the file is written"
    )


def _changed_since_hashed(item: EncodeItem) -> str | None:
    """Whether the range's bytes or rows on disk are no longer those its key hashed, read again once a bad record
    stops the encode early (the read's own check runs at the range's end): a file replaced under the build reads
    as lines cut at the old offsets, and the change, not those lines, is what stops it."""
    if item.unit is None or item.size is None:
        return _file_changed(item)
    try:
        if item.unit == "rows":
            same = table_rows_digest(item.file, item.start, item.start + item.size) == item.content
        else:
            prefix = text_prefix(item.file, item.offset or 0, item.size)
            same = prefix is not None and prefix.sha256 == item.content
    except READ_ERRORS:
        same = False
    return None if same else _changed_message(item, item.end)


def _grown_since(item: EncodeItem) -> bool:
    """Whether the plain JSON Lines file whose last range `item` is holds bytes past what was hashed (appended
    since). Tables and compressed files are written whole: their growth is seen by the read (Span.more)."""
    if item.end is not None or item.unit != "bytes" or item.size is None:
        return False
    try:
        return sniff(item.file) == "text" and os.path.getsize(item.file) > (item.offset or 0) + item.size
    except OSError:
        return False


def _stop_message(report: dict[str, Any], rejects: Path, item: EncodeItem) -> str | None:
    """The message of the first bad record in an entry written under on_error: skip, when the item runs under
    on_error: fail (that record stops the build); None otherwise. Only bad input carries a message."""
    if not item.stop_at_bad or not sum(report["rejected"].values()):
        return None
    return next((r.message for r in read_rejects(rejects) if r.message is not None), None)


def _nothing_lost(budget: int) -> list[tuple[str, bool]]:
    """Counts.from_report's rejects of an item counted whole (never asked for: the budget cuts nothing)."""
    return []


def _record(
    outcome: Outcome, ordinal: int, report: Report, writer: PartitionWriter, lost: RejectsWriter, stop_at_bad: bool
) -> str | None:
    """Store one outcome or count it under its reason; the fail message when bad input must stop the build."""
    result = outcome.result
    kept = isinstance(result, Tokenized) or (isinstance(result, ItemTruncation) and result.drop_reason is None)
    reported = kept and outcome.finding is not None  # kept: its overlap is reported (action: report)
    report.counts.contamination_reported += reported
    if isinstance(result, Tokenized):
        report.counts.note_record(literal=outcome.special_literal, straddling=result.straddled)
        writer.append(result, outcome.location, ordinal, outcome.special_literal, reported=reported)
        return None
    if isinstance(result, ItemTruncation):
        _record_item(result, outcome, ordinal, report, writer, lost, reported)
        return None
    if not isinstance(result, RecordError):
        raise RuntimeError(f"{outcome.location}: rendered but not encoded")
    if result.kind in DROP_KINDS:
        # valid input that this source's policy chose not to train: dropped, never a failure
        report.counts.note_record(result.kind)
        finding = outcome.finding
        overlap = json.dumps(finding.as_dict(), ensure_ascii=False, sort_keys=True) if finding else None
        lost.append(Reject(ordinal, outcome.example_id, outcome.location, result.kind, result.reason, eval=overlap))
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
    lost.append(Reject(ordinal, result.sample_id, where, result.kind, detail, message=message))
    return None


def _record_item(
    fitted: ItemTruncation,
    outcome: Outcome,
    ordinal: int,
    report: Report,
    writer: PartitionWriter,
    lost: RejectsWriter,
    reported: bool,
) -> None:
    """A pair or group: its segments as consecutive rows of one ordinal, or its drop (valid input that cannot fit).
    A reported overlap is the record's: its first row alone carries it, so that the rows count it once."""
    if fitted.drop_reason is not None:
        report.counts.note_record(fitted.drop_reason)
        lost.append(Reject(ordinal, outcome.example_id, outcome.location, fitted.drop_reason, fitted.detail))
        return
    report.counts.note_record(straddling=sum(segment.straddled for segment in fitted.segments))
    if fitted.removed_prompt_tokens:
        # a pair's or group's answers stay whole: only prompt tokens, never targets, are cut
        report.counts.note_truncation(fitted.strategy, fitted.removed_prompt_tokens * len(fitted.segments), 0)
    for n, (segment, role) in enumerate(zip(fitted.segments, outcome.roles)):
        writer.append(segment, outcome.location, ordinal, role=role, reported=reported and n == 0)
