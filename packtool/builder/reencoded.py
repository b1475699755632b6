"""What an encode phase re-encoded and why, against what the cache knows of each file's last build.

    CACHE/files/ab/abcdef....json    per source and file label: its rows and (start, content) per range
                                     at the last build that used this cache; sealed like a report

The index decides nothing about the bytes a build writes (the keys do that). It lets the summary say
"chat.jsonl grew by 312 rows" instead of "8 ranges re-encoded", and it names the entry of the file's last
range, whose rows a range that grew by appended lines may start with (`last_range`; encode checks that
entry and the file's bytes before it takes any row, see builder.encode.carried_prefix). One that is
missing, unreadable or fails its seal counts as no index: the file is then reported as new to the cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packtool.builder.cache import TokenCache
from packtool.builder.encode import EncodeItem, EncodeResult
from packtool.builder.plan import Partition
from packtool.config import BuildConfig
from packtool.sources import file_label

SHOWN_FILES = 3  # files named in the summary line; the rest are counted


@dataclass(frozen=True)
class Reencoded:
    """Records (as read, per partition report) of an encode phase: all of them, those re-encoded, and why."""

    records: int = 0
    records_reencoded: int = 0
    why: tuple[str, ...] = ()  # one "LABEL: reason" per file with re-encoded ranges
    left: tuple[str, ...] = ()  # files that grew after the build hashed them: what was appended is the next build's

    def describe(self) -> str:
        """'12,000 of 12,120 records reused; re-encoded 120 (chat.jsonl grew by 120 rows)'."""
        reused = f"{self.records - self.records_reencoded:,} of {self.records:,} records reused"
        if self.records_reencoded or self.why:
            reused += f"; re-encoded {self.records_reencoded:,} ({_listed(self.why)})"
        if self.left:
            reused += f"; {_listed(self.left)} grew during the build: rows appended after the plan are the next build's"
        return reused


def _listed(files: tuple[str, ...]) -> str:
    more = len(files) - SHOWN_FILES
    return ", ".join(files[:SHOWN_FILES]) + (f", {more} more file(s)" if more > 0 else "")


def reencoded(
    config: BuildConfig,
    cache: TokenCache,
    items: Sequence[EncodeItem],
    results: Sequence[EncodeResult],
    parts: list[Partition],
) -> Reencoded:
    """Count the records and say per file why its ranges were encoded again; then record this build's ranges.

    A range that grew re-encodes only the records after those it carried over from its earlier entry."""
    records = sum(int(p.report["read"]) for p in parts)
    redone = sum(int(p.report["read"]) - r.carried for p, r in zip(parts, results) if not r.reused)
    reused = [r.reused for r in results]
    why, left = [], []
    for (source, label), file_items in _by_file(config, items).items():
        left += [label] if any(results[i].left for i, _ in file_items) else []
        flags = [reused[i] for i, _ in file_items]
        ranges = [item for _, item in file_items]
        if not all(flags):
            previous = _load(cache, source, label)
            damaged = any(results[i].repaired for i, _ in file_items)
            why.append(f"{label} {_reason(ranges, flags, previous, damaged)}")
        _store(cache, source, label, ranges)
    return Reencoded(records, redone, tuple(why), tuple(left))


def _by_file(config: BuildConfig, items: Sequence[EncodeItem]) -> dict[tuple[str, str], list[tuple[int, EncodeItem]]]:
    sources = {s.name: s for s in config.sources}
    grouped: dict[tuple[str, str], list[tuple[int, EncodeItem]]] = {}
    for i, item in enumerate(items):
        grouped.setdefault((item.source, file_label(sources[item.source], item.file)), []).append((i, item))
    return grouped


def _reason(ranges: list[EncodeItem], reused: list[bool], previous: dict[str, Any] | None, damaged: bool) -> str:
    """Why a file's ranges that were not reused were encoded: new, grown, changed rows, a cache entry
    damaged since it was written (`damaged`: the build's warning names it), or not in the cache."""
    if previous is None:
        return "is new to the cache"
    before = dict(previous["ranges"])
    last_start = max(before, key=int)
    redone = [r for r, again in zip(ranges, reused) if not again]
    rows, before_rows = ranges[0].rows, previous["rows"]
    grew = rows is not None and before_rows is not None and rows > before_rows
    changed = [r for r in redone if str(r.start) in before and before[str(r.start)] != r.content]
    if grew:  # the previous last range took appended rows: growth, not a change
        changed = [r for r in changed if str(r.start) != last_start]
    parts = [f"grew by {rows - before_rows:,} rows"] if grew and rows is not None and before_rows is not None else []
    parts += [_lines(r) for r in changed]
    if not parts:
        same = all(before.get(str(r.start)) == r.content for r in redone)
        unchanged = (
            "had a cache entry changed on disk since written" if damaged else "was not in the cache for these settings"
        )
        parts = ["changed" if not same else unchanged]
    return ", ".join(parts)


def _lines(item: EncodeItem) -> str:
    end = item.end if item.end is not None else item.rows
    return f"changed in rows {item.start + 1:,}-{end:,}" if end is not None else "changed"


def last_range(cache: TokenCache, source: str, label: str) -> tuple[int, str] | None:
    """(start, content) of the file's last range at the last build that used this cache; None if unknown."""
    previous = _load(cache, source, label)
    if previous is None or not previous["ranges"]:
        return None
    start, content = previous["ranges"][-1]
    return int(start), str(content)


def _index(cache: TokenCache, source: str, label: str) -> Path:
    name = hashlib.sha256(json.dumps([source, label]).encode()).hexdigest()
    return cache.root / "files" / name[:2] / f"{name}.json"


def _load(cache: TokenCache, source: str, label: str) -> dict[str, Any] | None:
    index = cache.read_sealed(_index(cache, source, label))
    return index if index is not None and [index.get("source"), index.get("file")] == [source, label] else None


def _store(cache: TokenCache, source: str, label: str, ranges: list[EncodeItem]) -> None:
    index = {
        "source": source,
        "file": label,
        "rows": ranges[0].rows,
        "ranges": [[str(r.start), r.content] for r in ranges],
    }
    cache.write_sealed(_index(cache, source, label), index)
