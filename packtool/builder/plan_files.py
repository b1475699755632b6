"""The plan's types and its files: what the plan phase hands to emit, written once and read back checked.

PLAN/plan.npz        every folder's segments and pack layout, the length summaries, the pieces' places
PLAN/pieces.arrow    the pieces of samples split by truncation (written by the plan phase)
PLAN/rejects.jsonl   every record not trained, in input order: the bytes of OUT/rejects.jsonl (streamed, never held)
PLAN/plan.json       partitions, folders, accounting, rejects by reason, each file's sha256; written last, sealed
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from packtool.config import canonical_json
from packtool.format import sha256_file, write_json_atomic
from packtool.packing import PackPlan, StreamPlan

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
    lengths: dict[str, dict[str, np.ndarray]]  # source -> before/after truncation, for the manifest's length summary
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
    for i, when in enumerate(plan.lengths.values()):
        arrays[f"lengths.{i}.before"] = when["before"]
        arrays[f"lengths.{i}.after"] = when["after"]
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
    meta = json.loads((folder / PLAN_FILE).read_text(encoding="utf-8"))
    arrays = np.load(folder / ARRAYS_FILE)
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
        group = arrays[f"{prefix}.group"] if f"{prefix}.group" in arrays.files else None
        folders.append(
            FolderPlan(
                f["name"],
                f["capacity"],
                arrays[f"{prefix}.ref"],
                arrays[f"{prefix}.repeat"],
                arrays[f"{prefix}.length"],
                layout,
                group,
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
            name: {"before": arrays[f"lengths.{i}.before"], "after": arrays[f"lengths.{i}.after"]}
            for i, name in enumerate(meta["sources"])
        },
        quota_reached=meta["quota_reached"],
        piece_numbers=arrays["pieces.number"],
        piece_offsets=arrays["pieces.offset"],
        schema_version=meta["schema_version"],
        vision=VisionPlan(**meta["vision"]) if "vision" in meta else None,
    )
