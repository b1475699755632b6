"""`packtool verify`: re-derive every promise of an output from its bytes, so nobody has to trust the builder.

What the manifest states is either recomputed or sealed:

    recomputed from the shards   shard list == *.parquet files present (none missing, none unlisted);
                                 per shard: bytes, sha256, rows, tokens, targets; the `stats` block
    recomputed per pack row      cu_seqlens starts at 0, strictly increasing, ends at len(input_ids) <= capacity
                                 labels: -100 at every segment start; elsewhere -100 or the token itself
                                 n_tokens, n_targets, attn_cost, pack_hash; one per-document entry per segment
    recomputed per sample copy   a packed output holds each (id, hash, repeat, pair side or piece) once: an id
                                 made from the input row twice is one row trained twice
    recomputed from rejects      rejects.jsonl lines == rejects.count, by_reason, and per source rejected + dropped
    accounting, per source       read == kept + rejected + dropped; segments == documents of the source in the
                                 shards (overflow bucket included); distinct samples in the shards <= kept
    card                         README.md (the dataset card) has the bytes and sha256 the manifest records
    canaries                     each recorded canary's shard, row, documents, sample ids and tokens are the
                                 shards' (packtool.canaries)
    images                       a vision build's processor files, image columns, spans, positions and image
                                 bytes or files (commands.verify_images)
    sealed                       everything else (config, seed, capacity, conventions, ...): `manifest_sha256`
                                 is the sha256 of the manifest's canonical JSON without that field (packtool.seal)
    sub-outputs                  overflow/ and validation/ when the manifest names them: the same checks

Every path the manifest names is a plain file name inside the output folder. A damaged file or
manifest is a problem in the report (exit 1), never a traceback.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from packtool.commands.verify_images import (
    ImageCheck,
    ImagesChecked,
    count_problems,
    image_check,
    image_row_problems,
    schema_problems,
)
from packtool.format import (
    CONTAMINATED,
    DOCUMENT_COLUMNS,
    JSON_ERRORS,
    MANIFEST,
    TOKEN_COLUMNS,
    V2_COLUMNS,
    WHOLE,
    Manifest,
    ShardEntry,
    attn_cost,
    cu_seqlens_problem,
    manifest_problems,
    pack_hash,
    sha256_file,
)
from packtool.labels import IGNORE_INDEX
from packtool.packing_items import validate_pack_groups
from packtool.seal import SEAL, seal_manifest
from packtool.shards import READ_ERRORS, footer_problem, schema_problem
from packtool.terminal import shown

__all__ = ["Verification", "format_verification", "manifest_problems", "row_problems", "seal_manifest", "verify"]

MAX_PROBLEMS = 20  # enough to see a pattern; a corrupt shard would otherwise print a line per row
# `stats` keys copied from the manifest rather than computed from shards: the seal covers them.
COPIED_STATS = ("accounting", "mixing", "mode", "lengths")


@dataclass
class Verification:
    folder: str = ""
    checked: str = ""  # what was asked for: the folder, or one shard in it
    shards: int = 0
    packs: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    images: ImagesChecked | None = None  # a vision build's: the image files and embedded images hashed

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("... more problems not listed")

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "folder": self.folder,
            "checked": self.checked or self.folder,
            "shards": self.shards,
            "packs": self.packs,
            "problems": self.problems,
            "warnings": self.warnings,
            **({} if self.images is None else {"images": self.images.as_dict()}),
        }


@dataclass
class _Tally:
    """What the shards hold per source, for the accounting checks."""

    segments: Counter = field(default_factory=Counter)
    samples: dict[str, set[tuple[str, str]]] = field(default_factory=lambda: defaultdict(set))
    readable: bool = True  # every shard decoded and every row sound: totals can be compared
    groups: dict[int, str] = field(default_factory=dict)  # schema v2: group id -> the shard and row that hold it
    # each copy of a sample in a packed output -> the shard and row that hold it: a copy is one segment there (a
    # stream build cuts documents across rows); None for a stream build
    copies: dict[tuple[Any, ...], str] | None = field(default_factory=dict)
    twice: int = 0  # copies seen twice under an id the input gave: its record is in it twice


def verify(path: str | Path) -> Verification:
    """Check an output folder, or one shard against its folder's manifest."""
    path = Path(path)
    if path.is_dir():
        folder, lone = path, None
    elif path.is_file() and path.suffix == ".parquet":
        folder, lone = path.parent, path
    else:
        result = Verification(folder=str(path))
        result.add(f"{path}: expected an output folder or a .parquet shard")
        return result
    result = Verification(folder=str(folder), checked=str(path))
    if lone is not None and not (folder / MANIFEST).is_file():
        result.add(
            f"{path}: no {MANIFEST} beside it in {folder.resolve()}: an unfinished build (the manifest is "
            "written last) or a shard moved out of its output; a shard is checked against its output's manifest"
        )
        return result
    manifest = _checked_manifest(folder, result)
    if manifest is None:
        return result
    stream = manifest.raw.get("mode") == "stream"
    tally = _Tally(copies=None if stream else {})
    _check_output(folder, manifest, result, tally, lone=lone)
    if lone is not None:
        return result
    parts = manifest.parts
    if "overflow" in parts:
        _check_part(folder / parts["overflow"], result, tally)
    if "validation" in parts:
        # a split of its own: its documents are not the main output's segments
        _check_part(folder / parts["validation"], result, _Tally(copies=None if stream else {}))
    if tally.readable:
        _check_accounting(manifest, tally, result)
    if tally.twice:
        result.warnings.append(
            f"{tally.twice} sample copies appear twice under one id and content: the input holds those records "
            "twice (dedup: exact keeps one)"
        )
    _check_rejects(folder, manifest, result)
    _check_card(folder, manifest, result)
    _check_decontamination(manifest, result)
    if tally.readable:
        _check_canaries(folder, manifest, result)
    return result


def _checked_manifest(folder: Path, result: Verification) -> Manifest | None:
    """The manifest when it can be trusted enough to check against (parsed, typed, sealed), else None."""
    path = folder / MANIFEST
    if not path.is_file():
        result.add(f"{path}: missing; an unfinished build (the manifest is written last) or not a packtool output")
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, *JSON_ERRORS) as error:
        result.add(f"{path}: not valid JSON ({error}); the manifest is damaged, rebuild the output")
        return None
    problems = manifest_problems(manifest)
    for problem in problems:
        result.add(f"{path}: {problem}")
    if problems:
        return None
    checked = Manifest.from_dict(manifest, folder)
    if not checked.sealed:
        result.warnings.append(
            f"{path}: no {SEAL} (built by an older packtool): edits to config, seed or capacity cannot be detected"
        )
    elif not checked.seal_matches:
        result.add(
            f"{path}: {SEAL} does not match the manifest's content: it was edited after the build "
            "(config, seed, capacity, counts or conventions may no longer describe the shards); rebuild"
        )
    return checked


def _check_output(
    folder: Path, manifest: Manifest, result: Verification, tally: _Tally, *, lone: Path | None = None
) -> None:
    """Shards of one output folder against its manifest (the main output or the overflow bucket)."""
    capacity = manifest.capacity
    listed = {entry.file.name: entry for entry in manifest.shards}
    images, problems = image_check(folder, manifest)
    for problem in problems:
        result.add(problem)
    images_checked = images is not None or manifest.vision is None  # a damaged processor/ is the one problem named
    if images is not None:
        result.images = result.images or ImagesChecked()
        result.images.checks.append(images)  # counted once its rows are read
    if lone is not None:
        entry = listed.get(lone.name)
        if entry is None:
            result.add(f"{lone.name}: not listed in {folder / MANIFEST} (a leftover from another build?)")
        else:
            _check_shard(lone, entry, capacity, result, tally, images, images_checked)
        return
    present = {p.name for p in folder.glob("*.parquet") if p.is_file()}
    for name in sorted(present - listed.keys()):
        result.add(f"{name}: present in {folder} but not listed in the manifest (an extra or leftover shard)")
    for name, entry in listed.items():
        if name not in present:
            result.add(f"{name}: listed in the manifest but missing from {folder}")
            tally.readable = False
            continue
        _check_shard(folder / name, entry, capacity, result, tally, images, images_checked)
    if images is not None and tally.readable:
        for problem in count_problems(folder, manifest, images):
            result.add(problem)
    leftovers = sorted(p.name for p in folder.glob("*.tmp*"))
    if leftovers:
        result.warnings.append(f"{folder}: temporary files from an interrupted write: {', '.join(leftovers)}")
    if not listed:
        result.add(f"{folder}: the manifest lists no shards (an empty output)")
    if tally.readable and isinstance(manifest.raw.get("stats"), dict):
        _check_stats(folder, manifest, result)


def _check_shard(
    path: Path,
    entry: ShardEntry,
    capacity: int,
    result: Verification,
    tally: _Tally,
    images: ImageCheck | None,
    images_checked: bool,
) -> None:
    result.shards += 1
    if not path.resolve().is_relative_to(path.parent.resolve()):
        result.add(f"{path.name}: a link to {path.resolve()}, outside {path.parent}; shards are files in the output")
        tally.readable = False
        return
    if path.stat().st_size != entry.bytes:
        result.add(f"{path.name}: {path.stat().st_size} bytes, the manifest says {entry.bytes} (truncated or changed)")
    elif sha256_file(path) != entry.sha256:
        result.add(f"{path.name}: sha256 differs from the manifest (the file changed after the build)")
    rows = tokens = targets = 0
    try:
        for number, row in enumerate(_rows(path)):
            result.packs += 1
            problems = row_problems(row, capacity)
            if number == 0 and images_checked:
                for problem in schema_problems(list(row), images):
                    result.add(f"{path.name}: {problem}")
            for problem in problems:
                result.add(f"{path.name} row {number}: {problem}")
            rows += 1
            if problems:
                tally.readable = False  # counts over broken rows would only repeat the row's problem
                continue
            if images is not None and "image_refs" in row:
                problems = image_row_problems(row, images)
                for problem in problems:
                    result.add(f"{path.name} row {number}: {problem}")
                tally.readable = tally.readable and not problems
            tokens += len(row["input_ids"])
            targets += row["n_targets"]
            for source, sample_id, sample_hash in zip(row["sources"], row["sample_ids"], row["sample_hashes"]):
                tally.segments[source] += 1
                tally.samples[source].add((sample_id, sample_hash))
            if tally.copies is not None:
                where = f"{path.name} row {number}"
                for problem in _note_copies(row, where, tally.copies, tally):
                    result.add(f"{where}: {problem}")
            for group in set(row.get("segment_groups", [])) - {-1}:
                if group in tally.groups:
                    result.add(
                        f"{path.name} row {number}: group {group} also in {tally.groups[group]} (split or reused)"
                    )
                tally.groups[group] = f"{path.name} row {number}"
    except _Unreadable as error:
        result.add(f"{path.name}: {error}")
        tally.readable = False
        return
    for key, value in (("rows", rows), ("tokens", tokens), ("targets", targets)):
        if getattr(entry, key) != value:
            result.add(f"{path.name}: the manifest says {key} {getattr(entry, key)}, the shard holds {value}")


# What tells two segments of one sample apart in a packed output, beside its repeat number: a pair's sides, a
# group's completions, a split sample's pieces (schema v2)
_PART_COLUMNS = ("segment_kinds", "completion_index", "segment_pieces", "segment_piece_offsets")


def _note_copies(row: dict[str, Any], where: str, copies: dict[tuple[Any, ...], str], tally: _Tally) -> list[str]:
    """Each copy of a sample at most once. Twice under an id packtool made from the input row's location
    (SOURCE:FILE:N) is one row encoded twice, which no build does on purpose (a token cache filled while its
    input grew, by a packtool that read past what it hashed): a problem. Twice under an id the input gave is
    its record twice in the input: counted, for one warning."""
    parts = [row[name] for name in _PART_COLUMNS if name in row]
    problems = []
    for copy in zip(row["sources"], row["sample_ids"], row["sample_hashes"], row["sample_repeats"], *parts):
        first = copies.get(copy)
        if first is None:
            copies[copy] = where
            continue
        source, sample_id, repeat = copy[0], copy[1], copy[3]
        if sample_id.startswith(f"{source}:") and sample_id.rpartition(":")[2].isdigit():
            problems.append(
                f"sample {sample_id!r} (copy {repeat}) is also in {first}: one input row trained twice (a token "
                "cache filled while its input grew); rebuild with --no-cache"
            )
        else:
            tally.twice += 1
    return problems


class _Unreadable(Exception):
    """A shard that Parquet cannot decode or whose columns are not the shard schema (reported, not raised)."""


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except READ_ERRORS as error:
        raise _Unreadable(f"cannot be read as Parquet ({type(error).__name__}: {error})") from None
    problem = schema_problem(schema) or footer_problem(parquet.metadata)
    if problem is not None:
        raise _Unreadable(problem)
    for group in range(parquet.num_row_groups):
        try:
            rows = parquet.read_row_group(group).to_pylist()
        except READ_ERRORS as error:
            raise _Unreadable(
                f"row group {group} cannot be decoded ({type(error).__name__}: {error}); the file is damaged"
            ) from None
        yield from rows


def row_problems(row: dict[str, Any], capacity: int | None) -> list[str]:
    """Every broken promise of one pack row (empty when the row is sound)."""
    nulls = [name for name, value in row.items() if value is None or (isinstance(value, list) and None in value)]
    if nulls:
        return [f"null values in {', '.join(nulls)} (a damaged file: packtool never writes nulls)"]
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    labels = np.asarray(row["labels"], dtype=np.int64)
    cu = np.asarray(row["cu_seqlens"], dtype=np.int64)
    docs = np.asarray(row["doc_cu_seqlens"], dtype=np.int64)
    problems = []
    for name, offsets in (("cu_seqlens", cu), ("doc_cu_seqlens", docs)):
        if (problem := cu_seqlens_problem(offsets, len(ids))) is not None:
            problems.append(f"{name} {problem}")
    if problems:
        return problems
    if capacity is not None and len(ids) > capacity:
        problems.append(f"{len(ids)} tokens > capacity {capacity}")
    if any(len(row[column.name]) != len(ids) for column in TOKEN_COLUMNS):
        lengths = " and ".join(f"{len(row[column.name])} {column.name}" for column in TOKEN_COLUMNS[1:])
        return [*problems, f"{lengths} for {len(ids)} tokens"]
    if (labels[cu[:-1]] != IGNORE_INDEX).any():
        problems.append("a segment start carries a label (the previous segment would predict it)")
    targets = labels != IGNORE_INDEX
    if (labels[targets] != ids[targets]).any():
        problems.append("a label differs from its token (labels are unshifted: the model shifts)")
    documents = len(docs) - 1
    for column in DOCUMENT_COLUMNS:
        if len(row[column]) != documents:
            problems.append(f"{column} has {len(row[column])} entries for {documents} documents")
    expected = {
        "n_tokens": len(ids),
        "n_targets": int(targets.sum()),
        "attn_cost": attn_cost(cu),
        "pack_hash": pack_hash(ids, labels, cu),
    }
    problems += [f"{key} is {row[key]!r}, recomputed {value!r}" for key, value in expected.items() if row[key] != value]
    if "segment_groups" in row:
        problems += _group_problems(row, ids, labels, cu)
    return problems


def _group_problems(row: dict[str, Any], ids: np.ndarray, labels: np.ndarray, cu: np.ndarray) -> list[str]:
    """Schema v2: one entry per segment in each per-segment column, whole, well-formed pairs and groups, and
    piece numbers and offsets that name a part of a sample (an uncut one at offset 0)."""
    segments = len(cu) - 1
    columns = [column.name for column in V2_COLUMNS]
    wrong = [f"{c} has {len(row[c])} entries for {segments} segments" for c in columns if len(row[c]) != segments]
    if wrong:
        return wrong
    problems = []
    try:
        validate_pack_groups(ids, labels, cu, row["segment_groups"], row["segment_kinds"], row["completion_index"])
    except ValueError as error:
        problems.append(str(error))
    pieces, offsets = np.asarray(row["segment_pieces"]), np.asarray(row["segment_piece_offsets"])
    if (pieces < WHOLE).any() or (offsets < 0).any() or (offsets[pieces == WHOLE] != 0).any():
        problems.append(
            f"segment_pieces {pieces.tolist()} with offsets {offsets.tolist()}: a piece number is -1 (the sample "
            "whole, at offset 0) or >= 0, and an offset is >= 0"
        )
    return problems


def _check_stats(folder: Path, manifest: Manifest, result: Verification) -> None:
    from packtool.summaries import summarize

    recomputed = summarize([entry.file for entry in manifest.shards], manifest)
    stored = manifest.raw["stats"]
    for key in sorted(recomputed.keys() - set(COPIED_STATS)):
        if stored.get(key) != recomputed[key]:
            result.add(
                f"{folder / MANIFEST}: stats.{key} is {json.dumps(stored.get(key))[:80]}, "
                f"recomputed from the shards {json.dumps(recomputed[key])[:80]}"
            )


def _check_part(bucket: Path, result: Verification, tally: _Tally) -> None:
    """A sub-output the manifest names (the overflow bucket, a validation split): its own manifest and shards;
    its folder is a plain name inside the output (format.manifest_problems)."""
    manifest = _checked_manifest(bucket, result)
    if manifest is not None:
        _check_output(bucket, manifest, result, tally)


def _check_accounting(manifest: Manifest, tally: _Tally, result: Verification) -> None:
    for name, a in manifest.raw.get("accounting", {}).items():
        where = f"accounting of source {name!r}"
        accounted = a["kept"] + sum(a["rejected"].values()) + sum(a["dropped"].values())
        if a["read"] != accounted:
            result.add(f"{where}: read {a['read']} != kept + rejected + dropped {accounted}")
        if a["segments"] != tally.segments[name]:
            result.add(f"{where}: segments {a['segments']}, the shards hold {tally.segments[name]} documents of it")
        distinct = len(tally.samples[name])
        if distinct > a["kept"]:
            result.add(f"{where}: kept {a['kept']}, but the shards hold {distinct} distinct samples of it")
        if a["overflow"] > a["kept"]:
            result.add(f"{where}: overflow {a['overflow']} > kept {a['kept']}")
    for name in sorted(tally.segments.keys() - manifest.raw.get("accounting", {}).keys()):
        result.add(f"source {name!r}: {tally.segments[name]} documents in the shards but no accounting entry")


def _check_rejects(folder: Path, manifest: Manifest, result: Verification) -> None:
    summary = manifest.raw.get("rejects")
    if summary is None:
        return
    path = folder / summary["file"]
    if not path.is_file():
        result.add(f"{path}: listed in the manifest but missing")
        return
    by_reason: Counter = Counter()
    by_source: Counter = Counter()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        result.add(f"{path}: cannot be read ({error})")
        return
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            by_reason[record["reason"]] += 1
            by_source[record["source"]] += 1
        except (*JSON_ERRORS, TypeError, KeyError) as error:
            result.add(f"{path}:{number}: not a reject record ({type(error).__name__}: {error})")
            return
    if len(lines) != summary["count"]:
        result.add(f"{path}: {len(lines)} records, the manifest says rejects.count {summary['count']}")
    if dict(by_reason) != summary["by_reason"]:
        result.add(f"{path}: reasons {dict(sorted(by_reason.items()))}, the manifest says {summary['by_reason']}")
    for name, a in manifest.raw.get("accounting", {}).items():
        not_trained = sum(a["rejected"].values()) + sum(a["dropped"].values())
        if by_source[name] != not_trained:
            result.add(
                f"accounting of source {name!r}: rejected + dropped {not_trained}, "
                f"{path.name} holds {by_source[name]} records of it"
            )


def _check_decontamination(manifest: Manifest, result: Verification) -> None:
    """The decontamination record agrees with the accounting: per source, its contaminated samples are the ones
    dropped as `contaminated` (each also in rejects.jsonl, which _check_rejects counts by reason) and its reported
    ones those the accounting kept with an overlap; the totals are the sums."""
    record = manifest.raw.get("decontamination")
    if record is None:
        return
    accounting = manifest.raw.get("accounting", {})
    if set(record["sources"]) != set(accounting):
        result.add(f"decontamination.sources names {sorted(record['sources'])}, the accounting {sorted(accounting)}")
    for name, counts in record["sources"].items():
        a = accounting.get(name, {})
        expected = {
            "contaminated": a.get("dropped", {}).get(CONTAMINATED, 0),
            "reported": a.get("contamination_reported", 0),
        }
        for key, value in expected.items():
            if counts[key] != value:
                result.add(f"decontamination.sources.{name}.{key} is {counts[key]}, the accounting says {value}")
    for key in ("contaminated", "reported"):
        total = sum(counts[key] for counts in record["sources"].values())
        if record[key] != total:
            result.add(f"decontamination.{key} is {record[key]}, its sources add up to {total}")


def _check_card(folder: Path, manifest: Manifest, result: Verification) -> None:
    """The dataset card as the build wrote it (a manifest without `card` is an older packtool's: nothing to check)."""
    card = manifest.raw.get("card")
    if card is None:
        return
    path = folder / card["file"]
    if path.is_symlink() or not path.is_file():
        result.add(f"{path}: listed in the manifest as the dataset card but missing (or not a regular file)")
        return
    if path.stat().st_size != card["bytes"] or sha256_file(path) != card["sha256"]:
        result.add(
            f"{path}: {path.stat().st_size} bytes whose sha256 differs from the card the build wrote ({card['bytes']} "
            "bytes): it was edited after the build; put lasting words in the config's `card:` section and rebuild"
        )


def _check_canaries(folder: Path, manifest: Manifest, result: Verification) -> None:
    """Each canary the manifest records names a pack and documents the shards hold, with their sample ids and
    token count (a manifest without `canaries` is an older packtool's: nothing to check)."""
    record = manifest.raw.get("canaries")
    if record is None:
        return
    listed = {entry.file.name: entry.file for entry in manifest.shards}
    read: dict[str, tuple[list[list[int]], list[list[str]]]] = {}
    for number, entry in enumerate(record["set"]):
        problem = _canary_problem(entry, listed, read)
        if problem is not None:
            result.add(f"{folder / MANIFEST}: canaries.set[{number}] ({entry['kind']}): {problem}")


def _canary_problem(
    entry: dict[str, Any], listed: dict[str, Path], read: dict[str, tuple[list[list[int]], list[list[str]]]]
) -> str | None:
    """Why one recorded canary is not what the shards hold; `read`: each shard's offsets and ids, read once."""
    from packtool.canaries import KINDS, OPTIONAL_KINDS
    from packtool.shards import read_columns

    if entry["kind"] not in (*KINDS, *OPTIONAL_KINDS):
        return f"kind {entry['kind']!r} is not a canary kind ({', '.join((*KINDS, *OPTIONAL_KINDS))})"
    shard = entry["shard"]
    if shard not in listed:
        return f"shard {shard!r} is not one the manifest lists"
    if shard not in read:
        table = read_columns(listed[shard], ["doc_cu_seqlens", "sample_ids"])
        read[shard] = (table.column("doc_cu_seqlens").to_pylist(), table.column("sample_ids").to_pylist())
    offsets, ids = read[shard]
    row = entry["row"]
    if row >= len(offsets):
        return f"row {row}, but {shard} holds {len(offsets)} rows"
    cu = offsets[row]
    documents = entry["documents"] if entry["documents"] is not None else range(len(cu) - 1)
    if any(d >= len(cu) - 1 for d in documents):
        return f"documents {list(documents)}, but {shard} row {row} holds {len(cu) - 1}"
    held = [ids[row][d] for d in documents]
    if entry["sample_ids"] != held:
        return f"sample ids {entry['sample_ids']!r:.120}, but {shard} row {row} holds {held!r:.120} there"
    tokens = sum(cu[d + 1] - cu[d] for d in documents)
    if entry["tokens"] != tokens:
        return f"tokens {entry['tokens']}, but those documents hold {tokens}"
    return None


def format_verification(result: Verification) -> str:
    """The report as text, one line per problem: file names and values in it pass through `shown`."""
    head = f"{shown(result.checked or result.folder)}: {result.shards} shard(s), {result.packs} pack(s) checked"
    warnings = [f"  warning: {shown(w)}" for w in result.warnings]
    if result.ok:
        images = "" if result.images is None else f"; {result.images.describe()}"
        return "\n".join(
            [
                f"{head}: OK (manifest seal, shard list, checksums, offsets, labels at segment starts, counts, "
                f"pack hashes, stats, accounting, rejects, card{images})",
                *warnings,
            ]
        )
    return "\n".join(
        [f"{head}: {len(result.problems)} problem(s)", *(f"  - {shown(p)}" for p in result.problems), *warnings]
    )
