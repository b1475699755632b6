"""`packtool find`: trace a sample between its source record and the packs it was trained in.

    KEY                          resolves to
    qs-chat-00007                 a sample id: every document with that id
    6626a4ac99                    a pack_hash (a prefix of 4+ hex digits): every document of that pack
    shard-00000.parquet:12        a pack by shard and row: every document of that pack
    quickstart/chat.jsonl:8       a source location (FILE:LINE for JSON Lines, FILE:ROW otherwise, as in
                                  rejects.jsonl): the record there, then its documents by id and content hash

For each document found: shard, row, document index, token range, pack_hash, repeat (0: the first
copy, 1, 2, ...: copies made by source mixing) and, for a piece of a cut sample (schema v2), its
piece number and where it starts in the sample (`piece 2 from token 4096`). For each sample: where
it came from (file:line) and whether the record there still hashes to the `sample_hash` stored in
the shard, i.e. whether the file changed since the build. A sample that was not trained is found
in rejects.jsonl with its reason.

Source files are found through the config recorded in the manifest. Its relative paths are
relative to the config's folder, which is taken from `--config`, or else from the manifest's
`config_folder` (relative to OUT first, then the absolute path at build time: the first where every
relative source and eval-set path is), or else, for an older output, inferred: from where the manifest says
the tokenizer was (the config names it relative to the same folder), or else as the first of the working
folder and the folders above OUT where every relative source and eval-set path is (a hub dataset id may be
missing there): find reads no eval set (`decontamination.against`), but parsing the config expands them. A
wrong folder cannot pass unseen: each record read is checked against the sample hash the shard holds.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import operator
import os
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from packtool.errors import HubError, PackFormatError, PacktoolError, RecordError
from packtool.format import JSON_ERRORS, KIND_CODES, MANIFEST, REJECTS, WHOLE, Manifest, read_manifest
from packtool.hub import is_repo_id, snapshot
from packtool.shards import listed_shard, read_columns
from packtool.terminal import shown

INDEX_COLUMNS = ["sample_ids", "sample_hashes", "sample_repeats", "sources", "doc_cu_seqlens", "n_tokens", "pack_hash"]
ITEM_COLUMNS = ["segment_groups", "segment_kinds", "completion_index", "segment_pieces", "segment_piece_offsets"]
MIN_HASH_PREFIX = 4  # shorter hex strings match too many packs to be a useful key
_HEX = re.compile(r"[0-9a-f]+")
_NUMBERED = re.compile(r"^(?P<file>.+):(?P<number>\d+)$")


@dataclass(frozen=True, slots=True)
class Placement:
    """One document of one pack."""

    shard: str  # relative to the output folder: shard-00000.parquet, overflow/shard-00000.parquet
    row: int
    document: int
    start: int
    end: int
    pack_hash: str
    sample_id: str
    sample_hash: str
    source: str
    repeat: int
    piece: str = ""  # "piece 2 from token 4096 of the sample (3 pieces in this output)"; "" for a whole sample
    item: str = ""  # schema v2: "chosen of group 174", "completion 2 of group 9"; "" for a plain sample
    piece_number: int | None = None  # schema v2: segment_pieces (-1: the sample whole); None for v1 shards
    piece_offset: int | None = None  # schema v2: segment_piece_offsets
    duplicate: str = ""  # "the same record also in source b (a duplicate, not a piece)"; "" when in one source


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a sample's record is in the source files now, and whether it is still the record that was trained."""

    sample_id: str
    source: str
    location: str | None
    status: str  # matches | changed | moved | not_found | unreadable | unknown
    detail: str


@dataclass
class Trace:
    key: str
    kind: str  # sample_id | pack_hash | shard_row | location
    placements: list[Placement] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "placements": [asdict(p) for p in self.placements],
            "origins": [asdict(o) for o in self.origins],
            "rejects": self.rejects,
        }


def find(output: str | Path, key: str, *, config: str | Path | None = None) -> Trace:
    """Resolve KEY (see the module docstring) in an output folder; raises when nothing matches."""
    folder = Path(output)
    if not folder.is_dir():
        raise PacktoolError(f"{folder}: expected an output folder (the one holding {MANIFEST})")
    manifest = read_manifest(folder)
    placements = list(_documents(folder, manifest))
    rejects = _rejects(folder, manifest)
    sources = SourceFiles(folder, manifest, config)

    numbered = _NUMBERED.match(key)
    shards = {p.shard for p in placements}
    if numbered and numbered["file"].endswith(".parquet") and _shard_name(numbered["file"], shards) is not None:
        shard, row = _shard_name(numbered["file"], shards), int(numbered["number"])
        trace = Trace(key, "shard_row", [p for p in placements if p.shard == shard and p.row == row])
        if not trace.placements:
            raise PacktoolError(f"{folder}: no pack at {shard} row {row}")
    elif any(p.sample_id == key for p in placements) or any(r.get("id") == key for r in rejects):
        trace = Trace(key, "sample_id", [p for p in placements if p.sample_id == key])
        trace.rejects = [r for r in rejects if r.get("id") == key]
    elif _HEX.fullmatch(key) and len(key) >= MIN_HASH_PREFIX and any(p.pack_hash.startswith(key) for p in placements):
        trace = Trace(key, "pack_hash", [p for p in placements if p.pack_hash.startswith(key)])
    elif numbered and Path(numbered["file"]).name.startswith("shard-") and not Path(numbered["file"]).is_file():
        listed = ", ".join(sorted(shards)[:3]) + (", ..." if len(shards) > 3 else "")
        raise PacktoolError(f"{folder}: no shard {numbered['file']} in this output (its shards: {listed})")
    elif numbered:
        trace = _by_location(folder, key, numbered["file"], int(numbered["number"]), placements, rejects, sources)
    else:
        raise PacktoolError(
            f"{folder}: {key!r} is no sample id, pack_hash prefix, SHARD.parquet:ROW or FILE:LINE of this output; "
            "sample ids are listed by `packtool inspect OUT --json`"
        )
    trace.placements = _with_pieces(trace.placements, placements)
    if not trace.origins:
        samples = {(p.sample_id, p.source, p.sample_hash) for p in trace.placements}
        trace.origins = [sources.origin(*sample) for sample in sorted(samples)]
    return trace


def _shard_name(file: str, shards: set[str]) -> str | None:
    """The shard a `SHARD.parquet` key names: as written relative to OUT (`overflow/shard-00000.parquet`),
    or by its bare name for the main output. A path that is no shard of this output is a source location."""
    if file in shards:
        return file
    name = Path(file).name
    if name in shards and not Path(file).is_file():
        return name
    return None


def _parts(folder: Path, manifest: Manifest) -> list[tuple[str, Manifest]]:
    """(prefix, manifest) of the main output and of the sub-outputs it names (overflow bucket, validation split)."""
    parts = [("", manifest)]
    for name in manifest.parts.values():
        if (folder / name / MANIFEST).is_file():
            parts.append((f"{name}/", read_manifest(folder / name)))
    return parts


def _documents(folder: Path, manifest: Manifest) -> list[Placement]:
    """Every document of every pack, read from the small per-document columns only (no tokens)."""
    out = []
    for prefix, part in _parts(folder, manifest):
        out += _part_documents(folder, prefix, part)
    return out


def _part_documents(folder: Path, prefix: str, manifest: Manifest) -> list[Placement]:
    out = []
    for entry in manifest.shards:
        shard = prefix + entry.file.name
        table = read_columns(listed_shard(folder / prefix, entry), INDEX_COLUMNS, ITEM_COLUMNS)
        v2 = "segment_kinds" in table.column_names
        for row, pack in enumerate(table.to_pylist()):
            docs = pack["doc_cu_seqlens"]
            if problem := _index_problem(pack, v2):
                raise PackFormatError(f"{folder / shard} row {row}: {problem}: a damaged shard (`packtool verify`)")
            columns = zip(pack["sample_ids"], pack["sample_hashes"], pack["sample_repeats"], pack["sources"])
            for d, (sample_id, sample_hash, repeat, source) in enumerate(columns):
                where = (shard, row, d, docs[d], docs[d + 1], pack["pack_hash"])
                if v2:
                    item, number, offset = _item(pack, d), pack["segment_pieces"][d], pack["segment_piece_offsets"][d]
                    out.append(Placement(*where, sample_id, sample_hash, source, repeat, "", item, number, offset))
                else:
                    out.append(Placement(*where, sample_id, sample_hash, source, repeat))
    return out


def _index_problem(pack: dict[str, Any], v2: bool) -> str | None:
    """Why one row's per-document columns cannot be read together (None when they can)."""
    documents = len(pack["sample_ids"])
    counts = [len(pack[name]) for name in ("sample_hashes", "sample_repeats", "sources")]
    docs = pack["doc_cu_seqlens"]
    if len(docs) != documents + 1 or any(count != documents for count in counts):
        return f"doc_cu_seqlens has {len(docs)} offsets for {documents} sample_ids ({counts})"
    if docs[0] != 0 or any(a >= b for a, b in itertools.pairwise(docs)) or docs[-1] != pack["n_tokens"]:
        return f"doc_cu_seqlens {docs[:8]} is not 0, increasing, ..., n_tokens {pack['n_tokens']}"
    if v2 and (
        any(len(pack[name]) != documents for name in ITEM_COLUMNS)
        or not set(pack["segment_kinds"]) <= set(KIND_CODES.values())
    ):
        return f"segment columns not one known entry per document ({documents})"
    return None


def _item(pack: dict[str, Any], d: int) -> str:
    """A pair's or group's document: its kind and group (a pair's two sides share one sample id)."""
    group = pack["segment_groups"][d]
    if group < 0:
        return ""
    kind = {code: name for name, code in KIND_CODES.items()}[pack["segment_kinds"][d]]
    index = pack["completion_index"][d]
    return f"{kind} {index} of group {group}" if index >= 0 else f"{kind} of group {group}"


def _with_pieces(found: list[Placement], everything: list[Placement]) -> list[Placement]:
    """Name pieces: a sample's pieces share its source, id, hash and repeat (schema v2 numbers them, v1
    shards leave them unnumbered). The same id and hash in another source is a duplicate record (two
    sources reading the same rows), not a piece, and is named as such."""
    pieces: dict[tuple[str, str, str, int], list[Placement]] = defaultdict(list)
    sources: dict[tuple[str, str], set[str]] = defaultdict(set)
    for p in everything:
        pieces[(p.source, p.sample_id, p.sample_hash, p.repeat)].append(p)
        sources[(p.sample_id, p.sample_hash)].add(p.source)
    out = []
    for p in found:
        siblings = len(pieces[(p.source, p.sample_id, p.sample_hash, p.repeat)])
        piece = p.piece
        if p.piece_number is not None and p.piece_number != WHOLE:
            trained = f"{siblings} piece{'s' if siblings > 1 else ''} of it in this output"
            piece = f"piece {p.piece_number} from token {p.piece_offset} ({trained})"
        elif p.piece_number is None and siblings > 1 and not p.item:
            piece = f"one of {siblings} pieces (split)"
        others = sorted(sources[(p.sample_id, p.sample_hash)] - {p.source})
        duplicate = f"the same record also in source {', '.join(others)} (a duplicate, not a piece)" if others else ""
        out.append(replace(p, piece=piece, duplicate=duplicate))
    return out


def _rejects(folder: Path, manifest: Manifest) -> list[dict[str, Any]]:
    path = folder / (manifest.raw.get("rejects") or {}).get("file", REJECTS)
    if not path.is_file():
        return []
    rejects = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise PackFormatError(f"{path}: cannot be read ({error}); rebuild the output") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except JSON_ERRORS as error:
            record = error
        if not isinstance(record, dict):
            raise PackFormatError(f"{path}:{number}: not a reject record (a JSON object); rebuild the output")
        rejects.append(record)
    return rejects


def _by_location(
    folder: Path,
    key: str,
    file: str,
    number: int,
    placements: list[Placement],
    rejects: list[dict[str, Any]],
    sources: SourceFiles,
) -> Trace:
    found = sources.record_at(file, number)
    if found is None:
        raise PacktoolError(
            f"{folder}: {key!r} names no record of this output's sources ({sources.describe()}); "
            "FILE is a source file as the config names it, LINE 1-based for JSON Lines, ROW 0-based otherwise"
        )
    source, record = found
    trace = Trace(key, "location")
    trace.rejects = [r for r in rejects if _same_location(sources, r, file, number)]
    if isinstance(record, RecordError):
        trace.origins = [Origin(record.sample_id, source, key, "unreadable", record.describe())]
        return trace
    trace.placements = [
        p for p in placements if p.source == source and (p.sample_id, p.sample_hash) == (record.id, record.sample_hash)
    ]
    rejected = sorted({str(r.get("id")) for r in trace.rejects})
    if trace.placements:
        status, detail = "matches", "the record at this location now is the one in the output"
    elif record.id in rejected:
        # rejects.jsonl keeps no content hash: the id is all a rejected record can be held to
        status = "matches"
        detail = "the record at this location now has the id the build rejected here (so it is in no shard)"
    elif rejected:
        status = "changed"
        detail = (
            f"the build rejected id {', '.join(map(repr, rejected))} here, the record at this location now has id "
            f"{record.id!r}: the file changed since the build"
        )
    else:
        status = "not_found"
        detail = (
            f"no document of this output holds id {record.id!r} with this record's content hash "
            f"{record.sample_hash[:12]}: the file changed since the build"
        )
    trace.origins = [Origin(record.id, source, record.location, status, detail)]
    return trace


def _same_location(sources: SourceFiles, reject: dict[str, Any], file: str, number: int) -> bool:
    match = _NUMBERED.match(str(reject.get("location") or ""))
    return match is not None and int(match["number"]) == number and sources.same_file(match["file"], file)


class SourceFiles:
    """The output's sources, read again from the files as they are now (never written)."""

    def __init__(self, folder: Path, manifest: Manifest, config: str | Path | None):
        self.folder = folder
        self.manifest = manifest
        self.config_path = config
        self._config: Any = None
        self._problem = ""

    @property
    def config(self) -> Any:
        if self._config is None and not self._problem:
            try:
                self._config = self._load()
            except PacktoolError as error:
                self._problem = str(error)
        return self._config

    def _load(self) -> Any:
        from packtool.config import load_config, parse_config

        if self.config_path is not None:
            return load_config(Path(self.config_path), output=str(self.folder))
        raw = dict(self.manifest.raw.get("config") or {})
        base = self._inferred_base
        if base is None:
            relative = anchored_paths(raw)
            if relative:
                recorded = "the config folder the manifest records, " if self.manifest.config_folders else ""
                raise PacktoolError(
                    f"cannot tell which folder the build's config was in, where its relative paths "
                    f"({', '.join(map(repr, relative))}) start: they are not all in {recorded}the working folder "
                    f"or a folder above the output{self._missing_from_recorded_folder(relative)}; pass --config CONFIG"
                )
            base = self.folder  # every path find reads is absolute: any folder reads them alike
        tokenizer = (self.manifest.raw.get("tokenizer") or {}).get("file")
        if _relative(raw.get("tokenizer")) and isinstance(tokenizer, str):
            raw["tokenizer"] = str(self.folder.resolve() / tokenizer)  # where the build read it, whatever the base
        raw["output"] = str(self.folder)
        return parse_config(raw, base_dir=base, config_file=str(base / "<config from the manifest>"))

    def _missing_from_recorded_folder(self, relative: list[str]) -> str:
        """The relative paths that no recorded config folder holds now, naming those folders: a file deleted or
        moved since the build reads as no folder holding them all."""
        folders = list(dict.fromkeys(folder for folder in self.manifest.config_folders if folder.is_dir()))
        missing = [path for path in relative if folder_holding([path], folders) is None] if folders else []
        if not missing:
            return ""
        where = " or ".join(map(str, folders))
        return f" ({', '.join(map(repr, missing))}: no such file in {where} now; moved or deleted?)"

    def describe(self) -> str:
        if self.config is None:
            return self._problem
        return ", ".join(f"{s.name}: {', '.join(s.paths)}" for s in self.config.sources)

    def _source(self, name: str) -> Any:
        return next((s for s in self.config.sources if s.name == name), None) if self.config is not None else None

    def same_file(self, a: str, b: str) -> bool:
        return _resolved(a, self._base()) == _resolved(b, self._base()) or _resolved(a, self._base()) == _resolved(
            b, Path.cwd()
        )

    def _base(self) -> Path:
        if self.config_path is not None:
            return Path(self.config_path).resolve().parent
        return self._inferred_base or Path.cwd()

    @functools.cached_property
    def _inferred_base(self) -> Path | None:
        """The config's folder as the manifest records it, or tells it (the tokenizer), else where its sources are."""
        patterns = anchored_paths(self.manifest.raw.get("config") or {})
        recorded = [folder for folder in self.manifest.config_folders if folder.is_dir()]
        held = (folder_holding(patterns, recorded) if patterns else recorded[0]) if recorded else None
        if held is not None:
            return held
        told = config_folder_from_tokenizer(self.manifest.raw, self.folder)
        if told is not None:
            return told
        return folder_holding(patterns, [Path.cwd(), *self.folder.resolve().parents]) if patterns else None

    def record_at(self, file: str, number: int) -> tuple[str, Any] | None:
        """(source name, Example or the RecordError it is now) of the record at FILE:NUMBER, read from the file."""
        from packtool.sources import read_source

        if self.config is None:
            raise PacktoolError(f"{self.folder}: {self._problem}")
        for source in self.config.sources:
            if not any(self.same_file(path, file) for path in source.paths):
                continue
            for record in read_source(source, images=self.config.processor is not None):
                where = record.location if not isinstance(record, RecordError) else f"{record.file}:{record.row}"
                match = _NUMBERED.match(where or "")
                if match and int(match["number"]) == number and self.same_file(match["file"], file):
                    return source.name, record
        return None

    def origin(self, sample_id: str, source_name: str, sample_hash: str) -> Origin:
        """Find the record of a trained sample in its source now: by id first, then by content hash."""
        sample = (sample_id, source_name, sample_hash)
        return self.origins({sample})[sample]

    def origins(self, samples: set[tuple[str, str, str]]) -> dict[tuple[str, str, str], Origin]:
        """`origin` of many (sample_id, source, sample_hash) at once: each source read once."""
        from packtool.sources import read_source

        images = self.config is not None and self.config.processor is not None  # records read as the build read them
        wanted: dict[str, set[tuple[str, str, str]]] = defaultdict(set)
        for sample in samples:
            wanted[sample[1]].add(sample)
        out: dict[tuple[str, str, str], Origin] = {}
        for source_name, group in wanted.items():
            source = self._source(source_name)
            if source is None:
                reason = self._problem or f"source {source_name!r} is not in the config"
                out.update({s: Origin(s[0], source_name, None, "unknown", reason) for s in group})
                continue
            ids = {s[0] for s in group}
            hashes = {s[2] for s in group}
            by_id: dict[str, tuple[str | None, str]] = {}  # the first record with the id: location, content hash
            by_hash: dict[str, str | None] = {}  # the first record with the content
            for example in read_source(source, images=images):
                if isinstance(example, RecordError):
                    continue
                if example.id in ids and example.id not in by_id:
                    by_id[example.id] = (example.location, example.sample_hash)
                if example.sample_hash in hashes and example.sample_hash not in by_hash:
                    by_hash[example.sample_hash] = example.location
            for sample_id, _, sample_hash in group:
                out[(sample_id, source_name, sample_hash)] = _origin(
                    sample_id, source_name, sample_hash, by_id, by_hash
                )
        return out


def _origin(
    sample_id: str,
    source_name: str,
    sample_hash: str,
    by_id: dict[str, tuple[str | None, str]],
    by_hash: dict[str, str | None],
) -> Origin:
    if sample_id in by_id:
        location, now = by_id[sample_id]
        if now == sample_hash:
            return Origin(sample_id, source_name, location, "matches", "record hash matches the shard")
        return Origin(
            sample_id,
            source_name,
            location,
            "changed",
            f"the record now hashes to {now[:12]}, the shard holds {sample_hash[:12]}: "
            "the file changed since the build",
        )
    if sample_hash in by_hash:
        return Origin(
            sample_id, source_name, by_hash[sample_hash], "moved", "no record has this id now; one has its content"
        )
    return Origin(sample_id, source_name, None, "not_found", "no record in the source files has this id or content")


def sample_origins(
    output: str | Path,
    manifest: Manifest,
    samples: set[tuple[str, str, str]],
    *,
    config: str | Path | None = None,
) -> dict[tuple[str, str, str], Origin]:
    """Where each (sample_id, source, sample_hash) of an output is in its source files now (see `origin`)."""
    return SourceFiles(Path(output), manifest, config).origins(samples)


def config_folder_from_tokenizer(manifest: dict[str, Any], folder: Path | None = None) -> Path | None:
    """The folder the build's config was in, for a manifest that does not record it (`config_folder`), inferred
    from the tokenizer: the manifest records the tokenizer file relative to its own `folder` (absolute before)
    and the config the relative path that led there, e.g.

        OUT /home/me/out/qs, config tokenizer: quickstart/tokenizer
        manifest tokenizer.file: ../../configs/quickstart/tokenizer/tokenizer.json  ->  /home/me/configs
    """
    named = (manifest.get("config") or {}).get("tokenizer")
    file = (manifest.get("tokenizer") or {}).get("file")
    if not isinstance(named, str) or not isinstance(file, str) or ".." in Path(named).parts:
        return None
    relative = Path(named)
    if relative.is_absolute():
        return None
    resolved = Path(os.path.normpath((folder or Path.cwd()).resolve() / file))
    for candidate in (resolved, resolved.parent):
        if candidate.parts[-len(relative.parts) :] == relative.parts:
            return Path(*candidate.parts[: -len(relative.parts)])
    return None


def anchored_paths(raw_config: dict[str, Any]) -> list[str]:
    """The config's relative paths that only its folder anchors: its sources' patterns, its eval sets
    (`decontamination.against`: parsing the config expands them) and a template file (the tokenizer is where
    the manifest says it was read)."""
    sources = raw_config.get("sources")
    patterns = []
    for source in sources if isinstance(sources, list) else ():
        patterns += _strings(source.get("path") if isinstance(source, dict) else None)
    decontamination = raw_config.get("decontamination")
    patterns += _strings(decontamination.get("against") if isinstance(decontamination, dict) else None)
    template = raw_config.get("template")
    if isinstance(template, str) and template.endswith(".jinja"):
        patterns.append(template)
    return [path for path in patterns if _relative(path)]


def _strings(value: Any) -> list[str]:
    """A path setting's patterns as a config may write them: one string or a list of them."""
    if isinstance(value, str):
        return [value]
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _relative(path: Any) -> bool:
    return isinstance(path, str) and bool(path) and not Path(path).is_absolute()


def folder_holding(patterns: list[str], candidates: list[Path]) -> Path | None:
    """The first candidate folder in which each of the config's relative `patterns` matches a file or
    is a dataset of the local hub cache (`ORG/NAME`, read from there wherever the config was), at least
    one matching a file; a config whose relative paths are all such datasets reads alike anywhere."""
    cached = [_in_hub_cache(pattern) for pattern in patterns]
    for candidate in candidates:
        # `**` as one level, the first match enough: a recursive pattern at / would walk the whole disk
        here = [next(glob.iglob(str(candidate / pattern)), None) is not None for pattern in patterns]
        if any(here) and all(map(operator.or_, here, cached)):
            return candidate
    return candidates[0] if all(cached) else None


def _in_hub_cache(pattern: str) -> bool:
    if not is_repo_id(pattern):
        return False
    try:
        snapshot(pattern, "datasets")
    except HubError:
        return False
    return True


def _resolved(path: str, base: Path) -> Path:
    candidate = Path(path)
    return (candidate if candidate.is_absolute() else base / candidate).resolve()


def format_trace(trace: Trace) -> str:
    """The trace as text; every value read from the output or the sources passes through `shown`."""
    lines = [f"{shown(trace.key)} ({trace.kind.replace('_', ' ')}): {len(trace.placements)} document(s) in the shards"]
    for p in trace.placements:
        extra = "".join(f", {part}" for part in (p.piece, p.item, p.duplicate) if part)
        lines.append(
            f"  {shown(p.shard)} row {p.row} document {p.document}: tokens [{p.start}, {p.end}), "
            f"pack_hash {shown(p.pack_hash)}, sample {shown(p.sample_id)} (source {shown(p.source)}, "
            f"hash {shown(p.sample_hash[:12])}, repeat {p.repeat}{extra})"
        )
    for r in trace.rejects:
        lines.append(
            f"  not trained: {shown(r.get('id'))} at {shown(r.get('location'))}: {shown(r.get('reason'))} "
            f"({shown(r.get('detail'))})"
        )
    unread: dict[str, int] = {}  # one line per reason the sources could not be read, not one per document
    for o in trace.origins:
        if o.status == "unknown":
            unread[o.detail] = unread.get(o.detail, 0) + 1
            continue
        lines.append(
            f"  from {shown(o.location or '?')} (source {shown(o.source)}, sample {shown(o.sample_id)}): "
            f"{o.status}: {shown(o.detail)}"
        )
    lines += [f"  sources of {n} sample(s) not read: {shown(detail)}" for detail, n in unread.items()]
    return "\n".join(lines)
