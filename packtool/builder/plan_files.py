"""The plan's types and its files: what the plan phase hands to emit, written once and read back checked.

PLAN/plan.npz        every folder's segments and pack layout, each source's length tallies, the pieces' places
PLAN/pieces.arrow    the pieces of samples split by truncation (written by the plan phase)
PLAN/rejects.jsonl   every record not trained, in input order: the bytes of OUT/rejects.jsonl (streamed, never held)
PLAN/plan.json       partitions, folders, accounting, rejects by reason, each file's sha256; written last, sealed
"""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from packtool.config import canonical_json
from packtool.format import sha256_file, write_json_atomic
from packtool.packing import PackPlan, StreamPlan
from packtool.summaries import Tally

PLAN_FILE = "plan.json"
ARRAYS_FILE = "plan.npz"
PIECES_FILE = "pieces.arrow"
REJECTS_FILE = "rejects.jsonl"
PLAN_SEAL = "plan_sha256"


@dataclass(frozen=True)
class Partition:
    """One complete encode work item as the plan sees it."""

    key: str
    path: str
    source: str
    report: dict[str, Any]


@dataclass(frozen=True)
class FolderPlan:
    """The packs of one output folder ("" for OUT itself, "overflow" for the bucket, "validation").

    Segment s is stored sample `ref[s]` (>= 0: a global row of the partitions; < 0: piece -ref-1 of
    pieces.arrow), copy number `repeat[s]`, `length[s]` tokens. Packs follow `layout` (a PackPlan, or
    a StreamPlan in stream mode).
    `group[s]` is the segment's group id (-1: a plain sample), only in a plan with pairs or groups.
    """

    name: str
    capacity: int
    ref: np.ndarray
    repeat: np.ndarray
    length: np.ndarray
    layout: PackPlan | StreamPlan
    group: np.ndarray | None = None

    @property
    def stream(self) -> bool:
        return isinstance(self.layout, StreamPlan)

    @property
    def n_packs(self) -> int:
        return len(self.layout.offsets) - 1


@dataclass(frozen=True)
class VisionPlan:
    """What emit needs to write a vision build's image columns (builder.plan.vision_plan)."""

    merge_size: int | None  # the mRoPE families': positions are stored (None: another family, no positions)
    embed: bool  # `images: embed`: each image's bytes go into the shard
    root: str  # the config's folder, which image references are relative to


@dataclass(frozen=True)
class PlanRejects:
    """PLAN/rejects.jsonl, one line per record not trained ({id, source, location, reason, detail}, in input order),
    and how many each reason lost: the file is read line by line, never held (issue 43)."""

    path: Path
    by_reason: dict[str, int]  # sorted by reason

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    def first(self, n: int) -> list[dict[str, Any]]:
        with open(self.path, encoding="utf-8") as handle:
            return [json.loads(line) for line in islice(handle, n)]


@dataclass(frozen=True)
class Plan:
    key: str
    folder: Path
    partitions: list[Partition]
    folders: list[FolderPlan]
    accounting: dict[str, dict[str, Any]]
    rejects: PlanRejects
    # source -> before/after truncation -> its lengths tallied (O(distinct lengths)), for the manifest's length summary
    lengths: dict[str, dict[str, Tally]]
    # per source with a quota: what OUT's copies hold of its unit ({"targets": n} or {"tokens": n}), as planned
    quota_reached: dict[str, dict[str, int]]
    piece_numbers: np.ndarray  # per row of pieces.arrow: which part of its sample it is (_Fitted)
    piece_offsets: np.ndarray
    schema_version: int  # of the shards this plan gives (shard_schema_version)
    vision: VisionPlan | None = None  # a build whose config names an image processor

    @property
    def bases(self) -> np.ndarray:
        """Global row of each partition's first sample."""
        rows = [p.report["samples"] for p in self.partitions]
        return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)


def write_plan(plan: Plan) -> None:
    arrays: dict[str, np.ndarray] = {}
    for f in plan.folders:
        prefix = f.name or "main"
        arrays[f"{prefix}.ref"] = f.ref
        arrays[f"{prefix}.repeat"] = f.repeat
        if f.group is not None:
            arrays[f"{prefix}.group"] = f.group
        arrays[f"{prefix}.length"] = f.length
        if isinstance(f.layout, StreamPlan):
            for name in ("samples", "starts", "ends", "offsets"):
                arrays[f"{prefix}.{name}"] = getattr(f.layout, name)
        else:
            arrays[f"{prefix}.members"] = f.layout.members
            arrays[f"{prefix}.offsets"] = f.layout.offsets
    for i, tallies in enumerate(plan.lengths.values()):
        for when, tally in tallies.items():
            arrays[f"lengths.{i}.{when}.values"] = tally.values
            arrays[f"lengths.{i}.{when}.counts"] = tally.counts
    arrays["pieces.number"] = plan.piece_numbers
    arrays["pieces.offset"] = plan.piece_offsets
    np.savez(plan.folder / ARRAYS_FILE, allow_pickle=False, **arrays)
    meta = {
        "key": plan.key,
        "partitions": [[p.key, p.path, p.source, p.report] for p in plan.partitions],
        "folders": [
            {
                "name": f.name,
                "capacity": f.capacity,
                "stream": f.stream,
                "last_partial": isinstance(f.layout, StreamPlan) and f.layout.last_partial,
            }
            for f in plan.folders
        ],
        "accounting": plan.accounting,
        "rejects": plan.rejects.by_reason,
        "sources": list(plan.lengths),
        "quota_reached": plan.quota_reached,
        "schema_version": plan.schema_version,
        **({"vision": asdict(plan.vision)} if plan.vision is not None else {}),
        # what a resumed build checks before reusing the plan (stored_plan_problem)
        "files": {name: sha256_file(plan.folder / name) for name in (ARRAYS_FILE, PIECES_FILE, REJECTS_FILE)},
    }
    meta[PLAN_SEAL] = _plan_digest(meta)
    write_json_atomic(plan.folder / PLAN_FILE, meta)  # last: the plan is complete


def _plan_digest(meta: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in meta.items() if k != PLAN_SEAL}).encode()).hexdigest()


def stored_plan_problem(folder: Path, key: str, partitions: list[Partition]) -> str | None:
    """Why a plan found in `folder` must not be reused (changed since written, or another plan's); None if it may be.

    A missing plan is no problem (it is computed)."""
    path = folder / PLAN_FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        intact = isinstance(meta, dict) and meta.get(PLAN_SEAL) == _plan_digest(meta) and meta.get("key") == key
        intact = intact and meta["partitions"] == [[p.key, p.path, p.source, p.report] for p in partitions]
        intact = intact and all(sha256_file(folder / name) == sha for name, sha in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        intact = False
    return None if intact else f"staged plan {folder}: changed since it was written"


def load_plan(folder: Path) -> Plan:
    """The plan in `folder`, its arrays read into memory (the caller has checked it: stored_plan_problem)."""
    with np.load(folder / ARRAYS_FILE) as arrays:
        return _plan_of(folder, {name: arrays[name] for name in arrays.files})


def map_plan(folder: Path) -> Plan:
    """The plan in `folder`, its arrays read-only maps of plan.npz: an emit worker writes a few shards, and holds
    the pages of their packs alone, where loading held every folder's arrays (~65 B a sample a worker, issue 43).
    Only for a plan this build wrote or checked (stored_plan_problem): the map is not hashed again."""
    return _plan_of(folder, mapped_npz(folder / ARRAYS_FILE))


_NPY_HEADERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def mapped_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an uncompressed .npz (np.savez's) as a read-only np.memmap of its bytes in the zip.

    A stored member lies whole after its local header (30 bytes, its name, its extra field: the zip64 sizes
    np.savez writes), and is a .npy file: its own header (dtype, shape, order), then the array's bytes."""
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
        for member in archive.infolist():
            if member.compress_type != zipfile.ZIP_STORED or not member.filename.endswith(".npy"):
                raise ValueError(f"{path}: {member.filename} is not an uncompressed .npy (as np.savez writes)")
            handle.seek(member.header_offset)
            local = handle.read(30)
            name_length, extra_length = struct.unpack("<HH", local[26:30])
            handle.seek(member.header_offset + 30 + name_length + extra_length)
            version = npy_format.read_magic(handle)
            if version not in _NPY_HEADERS:
                raise ValueError(f"{path}: member {member.filename} is .npy version {version}, not one np.savez writes")
            shape, fortran, dtype = _NPY_HEADERS[version](handle)
            name = member.filename.removesuffix(".npy")
            if 0 in shape:  # mmap cannot map no bytes
                arrays[name] = np.empty(shape, dtype=dtype)
                arrays[name].flags.writeable = False
            else:
                at = handle.tell()
                arrays[name] = np.memmap(path, dtype, "r", at, shape, order="F" if fortran else "C")
    return arrays


def _plan_of(folder: Path, arrays: Mapping[str, np.ndarray]) -> Plan:
    meta = json.loads((folder / PLAN_FILE).read_text(encoding="utf-8"))
    folders = []
    for f in meta["folders"]:
        prefix = f["name"] or "main"
        layout: PackPlan | StreamPlan
        if f["stream"]:
            layout = StreamPlan(
                samples=arrays[f"{prefix}.samples"],
                starts=arrays[f"{prefix}.starts"],
                ends=arrays[f"{prefix}.ends"],
                offsets=arrays[f"{prefix}.offsets"],
                last_partial=f["last_partial"],
            )
        else:
            layout = PackPlan(members=arrays[f"{prefix}.members"], offsets=arrays[f"{prefix}.offsets"])
        folders.append(
            FolderPlan(
                f["name"],
                f["capacity"],
                arrays[f"{prefix}.ref"],
                arrays[f"{prefix}.repeat"],
                arrays[f"{prefix}.length"],
                layout,
                arrays.get(f"{prefix}.group"),
            )
        )
    return Plan(
        key=meta["key"],
        folder=folder,
        partitions=[Partition(*p) for p in meta["partitions"]],
        folders=folders,
        accounting=meta["accounting"],
        rejects=PlanRejects(folder / REJECTS_FILE, meta["rejects"]),
        lengths={
            name: {
                when: Tally(arrays[f"lengths.{i}.{when}.values"], arrays[f"lengths.{i}.{when}.counts"])
                for when in ("before", "after")
            }
            for i, name in enumerate(meta["sources"])
        },
        quota_reached=meta["quota_reached"],
        piece_numbers=arrays["pieces.number"],
        piece_offsets=arrays["pieces.offset"],
        schema_version=meta["schema_version"],
        vision=VisionPlan(**meta["vision"]) if "vision" in meta else None,
    )
