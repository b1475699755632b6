"""The on-disk contract of docs/format.md, in one place: what the builder writes and every reader checks.

    shard schema (SCHEMA, SCHEMA_VERSION)      one Parquet row per pack
    TOKEN_COLUMNS                              the per-token columns: name, arrow type, numpy dtype, store column
    SCHEMA_V2, SEGMENTS_SCHEMA_VERSION         the same plus per-segment columns (groups, pieces): builds with pairs,
                                               groups or split truncation
    pack_hash(input_ids, labels, cu_seqlens)   sha256 over the three arrays as little-endian int32
    attn_cost(cu_seqlens)                      sum of squared segment lengths (quadratic attention cost)
    check_cu_seqlens(cu, n)                    0, strictly increasing, ends at n: what varlen kernels need
    V2_COLUMNS                                 the per-segment columns: name, arrow type, numpy dtype, fill
    ROLE_CODES, KIND_CODES                     what token_roles and segment_kinds hold
    ManifestFields, MANIFEST_FIELDS            manifest.json's fields declared once: written by the builder,
                                               checked by every reader (manifest_problems)
    Manifest                                   manifest.json as a type: from/to JSON, its problems, the seal
    read_manifest / write_manifest             manifest.json, sealed and written last; schema version checked on read

The builder, verify, stats, inspect and the loader all import these; none recomputes them its own way.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import pyarrow as pa

from packtool.errors import PackFormatError
from packtool.labels import IGNORE_INDEX
from packtool.seal import SEAL, manifest_digest, seal_manifest

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
CONTAMINATED = "contaminated"  # the reject reason of a sample overlapping an eval set (decontamination:)
CARD = "README.md"  # the dataset card: what the Hugging Face Hub and `datasets.load_dataset(OUT)` read first
SCHEMA_VERSION = 1  # of the shards and the manifest: what a build without pairs, groups or pieces writes
# A build with a preference or group source, or with `split` truncation, writes version 2 (builder.plan
# shard_schema_version); every other build writes the v1 bytes.
SEGMENTS_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION, SEGMENTS_SCHEMA_VERSION)
INT32_MAX = int(np.iinfo(np.int32).max)  # varlen kernels take int32 offsets: a row's tokens must fit
# What json.loads raises on a damaged or hostile file: RecursionError for nesting deeper than Python's stack.
JSON_ERRORS = (UnicodeDecodeError, json.JSONDecodeError, RecursionError)


@dataclass(frozen=True, slots=True)
class TokenColumn:
    """One per-token column: a list per pack, one value per token (aligned with input_ids)."""

    name: str  # the shard column, also the field of shards.OutputPack and shards.PackColumns
    arrow: pa.DataType  # the list's value type in the shard
    dtype: type  # the numpy dtype readers and writers use
    stored: str | None  # the token store's column (builder.store) it is gathered from; None: derived (labels)


# docs/format.md "Shard schema"; the token store keeps a stored column in the shard's type, so emit gathers it as is.
TOKEN_COLUMNS = (
    TokenColumn("input_ids", pa.int32(), np.int32, "input_ids"),
    TokenColumn("labels", pa.int32(), np.int32, None),  # from the store's targets (packtool.labels)
    TokenColumn("token_roles", pa.int8(), np.int8, "roles"),
)
_TOKEN_FIELDS = {column.name: pa.field(column.name, pa.list_(column.arrow)) for column in TOKEN_COLUMNS}
DOCUMENT_COLUMNS = ("sample_ids", "sample_hashes", "sample_repeats", "sources")  # one entry per document

SCHEMA = pa.schema(
    [
        _TOKEN_FIELDS["input_ids"],
        _TOKEN_FIELDS["labels"],
        pa.field("cu_seqlens", pa.list_(pa.int32())),
        pa.field("doc_cu_seqlens", pa.list_(pa.int32())),
        _TOKEN_FIELDS["token_roles"],
        pa.field("sample_ids", pa.list_(pa.string())),
        pa.field("sample_hashes", pa.list_(pa.string())),
        pa.field("sample_repeats", pa.list_(pa.int32())),
        pa.field("sources", pa.list_(pa.string())),
        pa.field("n_tokens", pa.int32()),
        pa.field("n_targets", pa.int32()),
        pa.field("attn_cost", pa.int64()),
        pa.field("pack_hash", pa.string()),
    ],
    metadata={"packtool.schema_version": str(SCHEMA_VERSION)},
)

# token_roles: who wrote each token ("template": text the chat template wrote itself, headers and
# separators, which belongs to no message); segment_kinds: what each segment is (a plain sample, a pair's
# side, a group's completion, its index within the group stored beside it). The manifest records both
# tables (role_codes, kind_codes) so a reader needs no packtool.
ROLE_CODES = {"template": 0, "system": 1, "user": 2, "assistant": 3, "tool": 4, "text": 5, "padding": 6}
KIND_CODES = {"single": 0, "chosen": 1, "rejected": 2, "completion": 3}


@dataclass(frozen=True, slots=True)
class SegmentColumn:
    """One schema-v2 column: a list per pack, one value per attention segment (aligned with cu_seqlens)."""

    name: str  # the shard column, also the MicroBatch field
    field: str  # the attribute of shards.SegmentColumns (and the loader's) that holds it
    arrow: pa.DataType  # the list's value type in the shard
    dtype: type  # the numpy dtype readers and writers use
    fill: float  # the value of a segment that has none: a plain sample, or the padding collate adds


WHOLE = -1  # segment_pieces of a segment that is its sample whole (nothing was cut from it)
# docs/format.md "Pairs and groups" and "Pieces"; floats are NaN where none. Version 2 is never a stream
# build, so its segments are its documents.
V2_COLUMNS = (
    SegmentColumn("segment_groups", "groups", pa.int64(), np.int64, -1),
    SegmentColumn("segment_kinds", "kinds", pa.int8(), np.int8, KIND_CODES["single"]),
    SegmentColumn("completion_index", "completion_index", pa.int16(), np.int16, -1),
    SegmentColumn("segment_rewards", "rewards", pa.float64(), np.float64, np.nan),
    SegmentColumn("segment_advantages", "advantages", pa.float64(), np.float64, np.nan),
    SegmentColumn("segment_pieces", "pieces", pa.int32(), np.int32, WHOLE),
    SegmentColumn("segment_piece_offsets", "piece_offsets", pa.int32(), np.int32, 0),
)
SEGMENT_FIELDS = [pa.field(column.name, pa.list_(column.arrow)) for column in V2_COLUMNS]
SCHEMA_V2 = pa.schema(list(SCHEMA) + SEGMENT_FIELDS, metadata={"packtool.schema_version": str(SEGMENTS_SCHEMA_VERSION)})

# docs/format.md "Images": the columns of a build whose config names an image processor, after the others. Per
# pack, one entry per image in token order (grids 3 and spans 2 values an image); mrope_positions (the mRoPE
# families only) holds the temporal, the height and the width position of every token, one row after another.
IMAGE_FIELDS = [
    pa.field("image_refs", pa.list_(pa.string())),
    pa.field("image_sha256", pa.list_(pa.string())),
    pa.field("image_sizes", pa.list_(pa.int64())),
    pa.field("image_grids", pa.list_(pa.int32())),
    pa.field("image_spans", pa.list_(pa.int32())),
    pa.field("image_documents", pa.list_(pa.int32())),
    pa.field("image_data", pa.list_(pa.binary())),
]
MROPE_FIELD = pa.field("mrope_positions", pa.list_(pa.int32()))
IMAGE_STORAGE = ("reference", "embed")  # config `images:`: shards name each image file, or hold its bytes too
PROCESSOR_FOLDER = "processor"  # OUT/processor/: the image processor's files (manifest vision.processor.files)


def vision_schema(schema: pa.Schema, mrope: bool) -> pa.Schema:
    """A shard schema (SCHEMA, SCHEMA_V2) with the image columns, and the mRoPE positions before them."""
    return pa.schema(list(schema) + [MROPE_FIELD] * mrope + IMAGE_FIELDS, metadata=schema.metadata)


def conventions(stream: bool) -> dict[str, Any]:
    """How to read labels, positions and attention in an output (the manifest's `conventions`)."""
    return {
        "labels": "hf_unshifted",  # the model shifts: logits at t predict labels[t + 1]
        "ignore_index": IGNORE_INDEX,
        "positions": "continuous" if stream else "restart_per_segment",
        "attention": "causal_across_documents" if stream else "block_diagonal_causal",
    }


def pack_hash(input_ids: np.ndarray, labels: np.ndarray, cu_seqlens: np.ndarray) -> str:
    """sha256 (first 16 bytes, hex) over the three arrays as little-endian int32, each followed by b"|"."""
    digest = hashlib.sha256()
    for array in (input_ids, labels, cu_seqlens):
        digest.update(np.ascontiguousarray(array, dtype="<i4").tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:32]


def attn_cost(cu_seqlens: np.ndarray) -> int:
    """Quadratic attention cost of one pack: sum of l_i^2 over its attention segments.

    cu_seqlens [0, 3, 5, 9] -> segments 3, 2, 4 -> 9 + 4 + 16 = 29
    """
    return attn_cost_of_lengths(np.diff(np.asarray(cu_seqlens, dtype=np.int64)))


def attn_cost_of_lengths(lengths: np.ndarray) -> int:
    """sum(l_i^2) over segment lengths (the same cost, from lengths instead of offsets)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int((lengths**2).sum())


def cu_seqlens_problem(cu_seqlens: np.ndarray, n_tokens: int) -> str | None:
    """Why these offsets are not valid varlen attention boundaries for n_tokens tokens (None when they are).

    Rules: 1-D with at least 2 offsets, starts at 0, strictly increasing (no empty segment), ends
    at n_tokens, and n_tokens fits int32 (varlen kernels take int32 offsets).
    """
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or len(cu) < 2:
        return f"must be 1-D with at least 2 offsets, got shape {cu.shape}"
    if int(cu[0]) != 0:
        return f"must start at 0, starts at {int(cu[0])}"
    steps = np.diff(cu.astype(np.int64))
    if (steps <= 0).any():
        bad = int(np.argmax(steps <= 0))
        return f"must be strictly increasing; offsets {int(cu[bad])} -> {int(cu[bad + 1])} at segment {bad}"
    if int(cu[-1]) != n_tokens:
        return f"ends at {int(cu[-1])} but the row has {n_tokens} tokens"
    if n_tokens > INT32_MAX:
        return f"{n_tokens} tokens do not fit int32 offsets (max {INT32_MAX}); lower the token budget"
    return None


def check_cu_seqlens(cu_seqlens: np.ndarray, n_tokens: int, name: str = "cu_seqlens") -> None:
    """Raise PackFormatError unless cu_seqlens are valid boundaries for n_tokens tokens."""
    problem = cu_seqlens_problem(cu_seqlens, n_tokens)
    if problem is not None:
        raise PackFormatError(f"{name} {problem}")


def first_broken_pack(
    ids_offsets: np.ndarray,
    label_offsets: np.ndarray,
    cu_offsets: np.ndarray,
    cu_values: np.ndarray,
    labels: np.ndarray | None,
) -> int:
    """The first row of a row group whose pack breaks the contract, or -1; one vectorised pass for all rows.

    Arrow list columns as (offsets, values). Rules per pack: as many labels as input_ids;
    cu_seqlens starts at 0, increases strictly and ends at the pack's length; and, when `labels`
    (the flat label values) is given, -100 at every segment start.
    """
    lens = np.diff(ids_offsets)
    cu_lens = np.diff(cu_offsets)
    bad = (np.diff(label_offsets) != lens) | (cu_lens < 2)
    if bad.any():
        return int(np.argmax(bad))
    cu = cu_values.astype(np.int64)
    firsts, lasts = cu_offsets[:-1], cu_offsets[1:] - 1
    bad |= (cu[firsts] != 0) | (cu[lasts] != lens)
    falls = np.diff(cu) <= 0
    falls[lasts[:-1]] = False  # the step from one pack's last offset to the next pack's 0
    if falls.any():  # rows looked up only for the offending steps: a clean row group pays one comparison
        bad[np.searchsorted(cu_offsets, np.flatnonzero(falls), side="right") - 1] = True
    if labels is not None:
        inner = np.ones(len(cu), bool)
        inner[lasts] = False
        wrong = labels[(cu + np.repeat(label_offsets[:-1], cu_lens))[inner]] != IGNORE_INDEX
        if wrong.any():
            bad[np.repeat(np.arange(len(lens)), cu_lens)[inner][wrong]] = True
    return int(np.argmax(bad)) if bad.any() else -1


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The file's sha256, read a MiB at a time: a shard, an eval set or a data file is never held whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def json_text(value: Any) -> str:
    """The text packtool writes a JSON file as (manifest.json, plan files): sorted keys, indented, UTF-8."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON to a temporary name and rename it: readers see the old file or the new one, never half."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json_text(value), encoding="utf-8")
    os.replace(temporary, path)


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard as a manifest lists it: `file` is its path in the folder the manifest was read from."""

    file: Path
    rows: int
    tokens: int
    targets: int
    bytes: int
    sha256: str


# The units a mix is stated in, and so the unit of an interleaved window's shares.
MIX_UNITS = ("samples", "tokens", "target_tokens")


@dataclass(frozen=True, slots=True)
class Interleaving:
    """`mixing.interleave` of a build: packs ordered so every window of `window` consecutive packs holds each
    source's share of the whole build, in `unit`, within `tolerance` (absolute: 0.05 lets a 0.25 share be
    0.20 to 0.30). Full windows only: the last packs % window packs are a partial window, trained last."""

    window: int
    tolerance: float
    unit: str  # MIX_UNITS

    def as_dict(self) -> dict[str, Any]:
        return {"window": self.window, "tolerance": self.tolerance, "unit": self.unit}


@dataclass(frozen=True, slots=True)
class Manifest:
    """manifest.json of one output folder, checked (`problems`) before anything reads a field.

    `raw` is the JSON object as read, so the fields no reader needs typed stay as written and the seal
    (`manifest_sha256`, over every field) still covers them; the fields readers rely on have accessors.
    """

    folder: Path
    raw: dict[str, Any]
    shards: tuple[ShardEntry, ...]

    @classmethod
    def from_dict(cls, raw: Any, folder: Path) -> Manifest:
        """The manifest of `folder` from its parsed JSON; one PackFormatError naming the file when a field a
        reader relies on is missing or of the wrong type, or the schema version is not one this packtool reads."""
        path = folder / MANIFEST
        if not isinstance(raw, dict):
            raise PackFormatError(f"{path}: expected a JSON object, got {type(raw).__name__}; rebuild the output")
        problems = manifest_problems(raw)
        if problems:
            if problems[0].startswith("schema_version"):
                raise PackFormatError(f"{path}: {problems[0]}")
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PackFormatError(
                f"{path}: {problems[0]}{more}; the manifest is damaged or was edited: rebuild the output "
                "(`packtool verify` lists every problem)"
            )
        entries = tuple(
            ShardEntry(folder / e["file"], e["rows"], e["tokens"], e["targets"], e["bytes"], e["sha256"])
            for e in raw["shards"]
        )
        return cls(folder, raw, entries)

    @classmethod
    def from_json(cls, text: str, folder: Path) -> Manifest:
        try:
            raw = json.loads(text)
        except JSON_ERRORS as exc:
            raise PackFormatError(f"{folder / MANIFEST}: not valid JSON ({exc}); rebuild the output") from None
        return cls.from_dict(raw, folder)

    def to_json(self) -> str:
        """The text of manifest.json: what `write_manifest` wrote for these fields, byte for byte."""
        return json_text(self.raw)

    def problems(self) -> list[str]:
        return manifest_problems(self.raw)

    @property
    def schema_version(self) -> int:
        return int(self.raw["schema_version"])

    @property
    def capacity(self) -> int:
        return int(self.raw["capacity"])

    @property
    def stream(self) -> bool:
        return self.raw.get("mode", "packed") == "stream"

    @property
    def interleave(self) -> Interleaving | None:
        """The build's interleaving (None: packs in any order hold no promise about windows)."""
        raw = self.raw.get("mixing", {}).get("interleave")
        return None if raw is None else Interleaving(int(raw["window"]), float(raw["tolerance"]), str(raw["unit"]))

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad id, 0 when it has none (the loader pads with it; labels mask it anyway)."""
        pad = self.raw.get("tokenizer", {}).get("pad_token_id")
        return 0 if pad is None else int(pad)

    @property
    def vocab_size(self) -> int | None:
        return self.raw.get("tokenizer", {}).get("vocab_size")

    @property
    def tokenizer_file(self) -> str | None:
        """The tokenizer the build used, relative to `folder` (None in a manifest that does not record it)."""
        return self.raw.get("tokenizer", {}).get("file")

    @property
    def config_folders(self) -> list[Path]:
        """Where the build's config was, as recorded (empty in an older manifest): relative to `folder` first, so
        an output moved together with its config finds it there, then the absolute path at build time."""
        recorded = self.raw.get("config_folder")
        if recorded is None:
            return []
        return [Path(os.path.normpath(self.folder.resolve() / recorded["relative"])), Path(recorded["path"])]

    @property
    def parts(self) -> dict[str, str]:
        """The sub-outputs this one names (overflow bucket, validation split): key -> folder name inside it."""
        return {key: self.raw[key]["folder"] for key in ("overflow", "validation") if self.raw.get(key)}

    def entry(self, name: str) -> dict[str, Any] | None:
        """The `shards` entry of the shard file `name` (None when not listed)."""
        return next((e for e in self.raw["shards"] if e["file"] == name), None)

    @property
    def vision(self) -> dict[str, Any] | None:
        """The build's images (a config with a processor): processor, image_token_id, storage, root, counts."""
        return self.raw.get("vision")

    @property
    def sealed(self) -> bool:
        """Whether it carries a seal (an older packtool wrote none)."""
        return SEAL in self.raw

    @property
    def seal_matches(self) -> bool:
        """Whether the seal still covers every field: false once anyone edited the file after the build."""
        return self.raw.get(SEAL) == manifest_digest(self.raw)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest goes last, sealed (packtool.seal): its presence means every file it lists is complete."""
    sealed = seal_manifest(manifest)
    write_json_atomic(folder / MANIFEST, sealed)
    return sealed


def read_manifest(folder: Path) -> Manifest:
    """The manifest of an output folder: valid JSON, a schema version this packtool reads, and every field a
    reader relies on of the right type (`manifest_problems`), else one PackFormatError naming the file."""
    path = folder / MANIFEST
    if not path.is_file():
        raise PackFormatError(f"{folder}: no {MANIFEST}; not a packtool output folder, or the build did not finish")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PackFormatError(f"{path}: not valid JSON ({exc}); rebuild the output") from None
    return Manifest.from_json(text, folder)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts_problems(where: str, value: Any) -> list[str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in value.items()):
        return [f"{where} must map reasons to counts, got {value!r:.80}"]
    return []


def _object_problems(where: str, value: Any, keys: tuple[str, ...]) -> list[str]:
    """`value` must be an object with a count under each of `keys`."""
    if not isinstance(value, dict):
        return [f"{where} must be an object, got {value!r:.80}"]
    return [f"{where}.{k} must be a count, got {value.get(k)!r:.80}" for k in keys if not _is_count(value.get(k))]


SUMMARY_COUNTS = ("count", "p50", "p90", "p99", "max", "capacity", "over_capacity")


def _summary_problems(where: str, summary: Any) -> list[str]:
    """A `length_summary`: counts, a mean, and a histogram with one count per edge (the last: above capacity)."""
    problems = _object_problems(where, summary, SUMMARY_COUNTS)
    if problems:
        return problems
    histogram = summary.get("histogram")
    edges = histogram.get("edges") if isinstance(histogram, dict) else None
    counts = histogram.get("counts") if isinstance(histogram, dict) else None
    if not isinstance(summary.get("mean"), int | float) or isinstance(summary.get("mean"), bool):
        problems.append(f"{where}.mean must be a number, got {summary.get('mean')!r:.80}")
    if (
        not isinstance(edges, list)
        or not isinstance(counts, list)
        or len(edges) < 2
        or len(edges) != len(counts)
        or not all(_is_count(v) for v in edges + counts)
    ):
        problems.append(
            f"{where}.histogram must be {{edges, counts}}: as many counts as edges (>= 2), got {histogram!r:.80}"
        )
    return problems


# One check per top-level manifest field: the problems of its value, each naming the field as a reader would.


def _unsupported_version(version: Any) -> bool:
    return type(version) is not int or version not in SUPPORTED_SCHEMA_VERSIONS  # not True, which equals 1


def _schema_version_problems(version: Any) -> list[str]:
    if not _unsupported_version(version):
        return []
    return [
        f"schema_version {version!r:.40}; this packtool reads {list(SUPPORTED_SCHEMA_VERSIONS)} "
        "(rebuild with this version, or install the packtool that wrote it)"
    ]


def _capacity_problems(capacity: Any) -> list[str]:
    if _is_count(capacity) and capacity > 0:
        return []
    return [f"'capacity' must be a positive integer, got {capacity!r:.80}"]


def _not_a_list(value: Any) -> bool:
    return not isinstance(value, list)


def _shards_problems(shards: Any) -> list[str]:
    if not isinstance(shards, list):
        return [f"'shards' must be a list, got {shards!r:.80}"]
    # one pass (a long, possibly hostile, list); only names can repeat: other values are refused below
    listed = Counter(e["file"] for e in shards if isinstance(e, dict) and isinstance(e.get("file"), str))
    problems = [f"shards lists {name!r} more than once" for name in sorted(n for n, t in listed.items() if t > 1)]
    for i, entry in enumerate(shards):
        problems += _shard_entry_problems(f"shards[{i}]", entry)
    return problems


def _shard_entry_problems(where: str, entry: Any) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where} must be an object, got {entry!r:.80}"]
    problems = []
    if not is_plain_name(entry.get("file")):
        problems.append(
            f"{where}.file {entry.get('file')!r:.80} is not a file name inside the output folder "
            "(paths are confined to the folder)"
        )
    problems += _object_problems(where, entry, ("rows", "tokens", "targets", "bytes"))
    if not isinstance(entry.get("sha256"), str):
        problems.append(f"{where}.sha256 must be a string, got {entry.get('sha256')!r:.80}")
    return problems


def _accounting_problems(accounting: Any) -> list[str]:
    if not isinstance(accounting, dict):
        return [f"'accounting' must be an object, got {accounting!r:.80}"]
    return [p for name, entry in accounting.items() for p in _source_accounting_problems(f"accounting.{name}", entry)]


def _source_accounting_problems(where: str, entry: Any) -> list[str]:
    problems = _object_problems(where, entry, ("read", "kept", "overflow", "segments"))
    if not isinstance(entry, dict):
        return problems
    for key in ("rejected", "dropped"):
        problems += _counts_problems(f"{where}.{key}", entry.get(key))
    truncated = entry.get("truncated", {})
    if not isinstance(truncated, dict):
        problems.append(f"{where}.truncated must be an object, got {truncated!r:.80}")
    else:
        for strategy, cut in truncated.items():
            problems += _object_problems(f"{where}.truncated.{strategy}", cut, ("samples", "tokens", "targets"))
    if not _is_count(entry.get("special_token_literals", 0)):
        problems.append(f"{where}.special_token_literals must be a count")
    return problems


def _rejects_problems(rejects: Any) -> list[str]:
    if rejects is None:
        return []
    if not isinstance(rejects, dict) or not is_plain_name(rejects.get("file")) or not _is_count(rejects.get("count")):
        return [f"'rejects' must be {{file: a name inside the folder, count, by_reason}}, got {rejects!r:.80}"]
    return _counts_problems("rejects.by_reason", rejects.get("by_reason"))


def _an_object(key: str) -> Callable[[Any], list[str]]:
    def problems(value: Any) -> list[str]:
        return [] if isinstance(value, dict) else [f"'{key}' must be an object, got {value!r:.80}"]

    return problems


def _config_folder_problems(folder: Any) -> list[str]:
    """`config_folder`: null (an older packtool wrote none), or {path: absolute at build time, relative: to the
    manifest's folder as published}."""
    if folder is None or (
        isinstance(folder, dict)
        and isinstance(folder.get("path"), str)
        and Path(folder["path"]).is_absolute()
        and isinstance(folder.get("relative"), str)
        and not Path(folder["relative"]).is_absolute()
    ):
        return []
    return [f"'config_folder' must be {{path: absolute, relative: to this folder}}, got {folder!r:.80}"]


def _tokenizer_problems(tokenizer: Any) -> list[str]:
    if not isinstance(tokenizer, dict):
        return _an_object("tokenizer")(tokenizer)
    problems = [
        f"tokenizer.{key} must be a count or null, got {tokenizer[key]!r:.80}"
        for key in ("pad_token_id", "vocab_size")
        if tokenizer.get(key) is not None and not _is_count(tokenizer[key])
    ]
    if tokenizer.get("file") is not None and not isinstance(tokenizer["file"], str):
        problems.append(f"tokenizer.file must be a path or null, got {tokenizer['file']!r:.80}")
    return problems


def _mixing_problems(mixing: Any) -> list[str]:
    if not isinstance(mixing, dict):
        return _an_object("mixing")(mixing)
    interleave = mixing.get("interleave")
    if interleave is None or (
        isinstance(interleave, dict)
        and _is_count(interleave.get("window"))
        and interleave["window"] > 0
        and isinstance(interleave.get("tolerance"), (int, float))
        and not isinstance(interleave.get("tolerance"), bool)
        and interleave.get("unit") in MIX_UNITS
    ):
        return []
    return [
        f"mixing.interleave must be {{window: a positive count, tolerance: a number, unit: one of "
        f"{', '.join(MIX_UNITS)}}}, got {interleave!r:.80}"
    ]


def _template_problems(template: Any) -> list[str]:
    """`template`: null, or {name, sha256, file, named, tools, injects}; file, named and tools are absent in
    manifests written before packtool recorded which of a model's template files it used."""
    if template is None:
        return []
    if not isinstance(template, dict):
        return [f"'template' must be an object or null, got {template!r:.80}"]
    problems = []
    for where, entry in (("template", template), ("template.tools", template.get("tools", {}))):
        if not isinstance(entry, dict):
            problems.append(f"{where} must be an object {{name, sha256, file, named}}, got {entry!r:.80}")
            continue
        for key in ("file", "named"):
            if entry.get(key) is not None and not isinstance(entry[key], str):
                problems.append(f"{where}.{key} must be a string or null, got {entry[key]!r:.80}")
    return problems


def _mode_problems(mode: Any) -> list[str]:
    return [] if mode in ("packed", "stream") else [f"'mode' must be 'packed' or 'stream', got {mode!r:.80}"]


def _a_part(key: str) -> Callable[[Any], list[str]]:
    """A sub-output (overflow bucket, validation split): {folder, ...}, its folder a plain name inside OUT."""

    def problems(part: Any) -> list[str]:
        if part is None:
            return []
        if not isinstance(part, dict):
            return [f"'{key}' must be an object {{folder, ...}}, got {part!r:.80}"]
        if not is_plain_name(part.get("folder")):
            return [f"{key}.folder {part.get('folder')!r:.80} is not a folder name inside the output"]
        return []

    return problems


def _decontamination_problems(record: Any) -> list[str]:
    """`decontamination`: null, or {against: [{file, sha256, records, strings}], ngram, min_line_words, action,
    prompt_action, fields, index, contaminated, reported, sources: {name: {contaminated, reported}}}."""
    if record is None:
        return []
    if not isinstance(record, dict):
        return [f"'decontamination' must be an object or null, got {record!r:.80}"]
    against = record.get("against")
    problems = []
    if not isinstance(against, list) or not all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and _is_sha256(e.get("sha256")) for e in against
    ):
        problems.append(f"decontamination.against must be [{{file, sha256, records, strings}}], got {against!r:.80}")
    problems += _object_problems("decontamination", record, ("ngram", "min_line_words", "contaminated", "reported"))
    sources = record.get("sources")
    if not isinstance(sources, dict):
        return [*problems, f"decontamination.sources must be an object, got {sources!r:.80}"]
    for name, entry in sources.items():
        problems += _object_problems(f"decontamination.sources.{name}", entry, ("contaminated", "reported"))
    return problems


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _lengths_problems(lengths: Any) -> list[str]:
    if lengths is None:
        return []
    if not isinstance(lengths, dict):
        return [f"'lengths' must be an object, got {lengths!r:.80}"]
    problems = []
    for name, entry in lengths.items():
        if not isinstance(entry, dict):
            problems.append(f"lengths.{name} must be {{before, after}}, got {entry!r:.80}")
            continue
        for when in ("before", "after"):
            problems += _summary_problems(f"lengths.{name}.{when}", entry.get(when))
    return problems


def _canaries_problems(record: Any) -> list[str]:
    """`canaries`: null (an older packtool recorded none), or {set: [{kind, shard, row, documents, sample_ids,
    tokens}], missing: {kind: why}} (packtool.canaries); documents null: the whole pack."""
    if record is None:
        return []
    if not isinstance(record, dict) or not isinstance(record.get("set"), list):
        return [f"'canaries' must be {{set: [...], missing: {{kind: why}}}}, got {record!r:.80}"]
    missing = record.get("missing")
    problems = []
    if not isinstance(missing, dict) or not all(isinstance(v, str) for v in missing.values()):
        problems.append(f"canaries.missing must map kinds to reasons, got {missing!r:.80}")
    for number, entry in enumerate(record["set"]):
        if not _is_canary(entry):
            problems.append(
                f"canaries.set[{number}] must be {{kind, shard: a shard's file name, row, documents: [index] or "
                f"null, sample_ids: [id], tokens}}, got {entry!r:.80}"
            )
    return problems


def _is_canary(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    documents, ids = entry.get("documents"), entry.get("sample_ids")
    return (
        isinstance(entry.get("kind"), str)
        and is_plain_name(entry.get("shard"))
        and _is_count(entry.get("row"))
        and _is_count(entry.get("tokens"))
        and (documents is None or (isinstance(documents, list) and all(_is_count(d) for d in documents)))
        and isinstance(ids, list)
        and all(isinstance(i, str) for i in ids)
    )


def _vision_problems(vision: Any) -> list[str]:
    """`vision`: null (a build without a processor), or {processor: {family, class, files: {name: sha256}},
    image_token_id (null: no image was kept), images: reference | embed, root, n_images, n_image_tokens}."""
    if vision is None:
        return []
    if not isinstance(vision, dict):
        return [f"'vision' must be an object, got {vision!r:.80}"]
    problems = []
    processor = vision.get("processor")
    files = processor.get("files") if isinstance(processor, dict) else None
    if (
        not isinstance(processor, dict)
        or not isinstance(processor.get("family"), str)
        or not isinstance(processor.get("class"), str)
        or not isinstance(files, dict)
        or not all(is_plain_name(name) and _is_sha256(digest) for name, digest in files.items())
    ):
        problems.append(f"vision.processor must be {{family, class, files: {{name: sha256}}}}, got {processor!r:.80}")
    token = vision.get("image_token_id")
    if token is not None and not _is_count(token):
        problems.append(f"vision.image_token_id must be a token id or null, got {token!r:.80}")
    if vision.get("images") not in IMAGE_STORAGE:
        problems.append(f"vision.images must be one of {', '.join(IMAGE_STORAGE)}, got {vision.get('images')!r:.80}")
    if not isinstance(vision.get("root"), str):
        problems.append(f"vision.root must be a folder, got {vision.get('root')!r:.80}")
    counts = [k for k in VISION_COUNTS if not _is_count(vision.get(k))]
    return problems + [f"vision.{k} must be a count, got {vision.get(k)!r:.80}" for k in counts]


VISION_COUNTS = ("n_images", "n_image_tokens")


def _card_problems(card: Any) -> list[str]:
    """`card`: null (an older packtool wrote none), or {file, bytes, sha256} of the dataset card in the folder."""
    if card is None:
        return []
    if (
        not isinstance(card, dict)
        or not is_plain_name(card.get("file"))
        or not _is_count(card.get("bytes"))
        or not isinstance(card.get("sha256"), str)
    ):
        return [f"'card' must be {{file: a name inside the folder, bytes, sha256}}, got {card!r:.80}"]
    return []


def _seal_problems(seal: Any) -> list[str]:
    return [] if isinstance(seal, str) else [f"'{SEAL}' must be a string, got {seal!r:.80}"]


def _no_problems(value: Any) -> list[str]:
    """A field no reader relies on: the seal covers it."""
    return []


def _never(value: Any) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class FieldRule:
    """How readers check one top-level manifest field (ManifestFields declares one per field)."""

    check: Callable[[Any], list[str]]  # the problems of its value (none: every reader can use it)
    absent: Any  # the value a manifest without the field is read as: older packtools wrote fewer fields
    ends: Callable[[Any], bool]  # true for a value that leaves the other fields not worth checking


def _rule(
    check: Callable[[Any], list[str]] = _no_problems, *, absent: Any = None, ends: Callable[[Any], bool] = _never
) -> dict[str, FieldRule]:
    """A ManifestFields field's metadata: how readers check it."""
    return {"rule": FieldRule(check, absent, ends)}


@dataclass(frozen=True, kw_only=True)
class ManifestFields:
    """manifest.json's fields, declared once: the builder writes them (`as_dict`) and every reader checks them
    (`manifest_problems` walks MANIFEST_FIELDS, in this order: the first problem is the one an error names).

    An optional field (default None) is left out while None, so a build without the feature writes the same
    bytes as before it existed. docs/format.md lists every field (tests/test_format_doc.py holds it to this).
    """

    schema_version: int = field(metadata=_rule(_schema_version_problems, ends=_unsupported_version))
    capacity: int = field(metadata=_rule(_capacity_problems))
    shards: list[dict[str, Any]] = field(metadata=_rule(_shards_problems, ends=_not_a_list))
    accounting: dict[str, dict[str, Any]] = field(metadata=_rule(_accounting_problems, absent={}))
    rejects: dict[str, Any] = field(metadata=_rule(_rejects_problems))
    # taken from the shards once the rest is written (builder.manifest), so the builder fills it in last
    stats: dict[str, Any] | None = field(default=None, metadata=_rule(_an_object("stats"), absent={}))
    config: dict[str, Any] = field(metadata=_rule(_an_object("config"), absent={}))
    # where `config`'s relative paths start (find reads the sources again); absent in older builds
    config_folder: dict[str, Any] | None = field(default=None, metadata=_rule(_config_folder_problems))
    tokenizer: dict[str, Any] = field(metadata=_rule(_tokenizer_problems, absent={}))
    mixing: dict[str, Any] = field(metadata=_rule(_mixing_problems, absent={}))
    conventions: dict[str, Any] = field(metadata=_rule(_an_object("conventions"), absent={}))
    truncation: dict[str, Any] = field(metadata=_rule(_an_object("truncation"), absent={}))
    packing: dict[str, Any] = field(metadata=_rule(_an_object("packing"), absent={}))
    template: dict[str, Any] | None = field(metadata=_rule(_template_problems))  # null: every source is plain text
    mode: str = field(metadata=_rule(_mode_problems, absent="packed"))
    overflow: dict[str, Any] | None = field(default=None, metadata=_rule(_a_part("overflow")))
    validation: dict[str, Any] | None = field(default=None, metadata=_rule(_a_part("validation")))
    # only with decontamination: (packtool.decontamination): the eval files' sha256, the settings and the counts
    decontamination: dict[str, Any] | None = field(default=None, metadata=_rule(_decontamination_problems))
    lengths: dict[str, dict[str, Any]] = field(metadata=_rule(_lengths_problems))
    # the main folder's canary set (packtool.canaries), chosen from the staged shards; absent in sub-outputs and
    # in older builds, whose canaries `packtool canary` selects again
    canaries: dict[str, Any] | None = field(default=None, metadata=_rule(_canaries_problems))
    # a build whose config names an image processor (docs/format.md "Images"); absent in every other build
    vision: dict[str, Any] | None = field(default=None, metadata=_rule(_vision_problems))
    # the main folder's dataset card (builder.card), written from every other field: so it is added last, before
    # the seal; absent in sub-outputs and in older builds
    card: dict[str, Any] | None = field(default=None, metadata=_rule(_card_problems))
    # written by write_manifest, never by the builder; absent: unsealed (an older packtool, Manifest.sealed)
    manifest_sha256: str | None = field(default=None, metadata=_rule(_seal_problems, absent=""))
    packtool_version: str = field(metadata=_rule())
    seed: int = field(metadata=_rule())
    config_hash: str = field(metadata=_rule())
    plan_hash: str = field(metadata=_rule())
    role_codes: dict[str, int] = field(metadata=_rule())
    kind_codes: dict[str, int] | None = field(default=None, metadata=_rule())  # v2 only: v1 keeps the v1 bytes

    def as_dict(self) -> dict[str, Any]:
        """The JSON object write_manifest writes: every field, but an optional one that is None."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not (f.default is None and getattr(self, f.name) is None)
        }


MANIFEST_FIELDS = tuple((f.name, f.metadata["rule"]) for f in fields(ManifestFields))


def manifest_problems(manifest: Any) -> list[str]:
    """Type problems of the manifest fields the readers rely on (empty when every reader can use it).

    verify, stats, inspect, find, report and the loader all read the manifest through this check
    (read_manifest), so a damaged or hand-edited manifest is one line naming the field, never a
    traceback in whichever reader touches the field first. An unknown schema version ends the check (another
    version may have other fields: it is the one problem worth naming), as does a `shards` that is no list.
    """
    if not isinstance(manifest, dict):
        return [f"must be a JSON object, got {type(manifest).__name__}"]
    problems: list[str] = []
    for name, rule in MANIFEST_FIELDS:
        value = manifest.get(name, rule.absent)
        problems += rule.check(value)
        if rule.ends(value):
            break
    return problems


def is_plain_name(name: Any) -> TypeGuard[str]:
    """A bare file name: no folder part, no `..`, not absolute, so it can only name a file in the output folder."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(ch in name for ch in "/\\\x00")
        and not Path(name).is_absolute()
    )
