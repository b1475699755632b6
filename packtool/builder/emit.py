"""Emit phase: one work item per output shard, gathering its packs from the token store.

    plan (packs as segment indices) --segment--> ref --> partition row or truncated piece
        --> OutputPack (labels_for, cu_seqlens) --> STAGING/out/[overflow/]shard-NNNNN.parquet
        --> STAGING/done/[overflow-]shard-NNNNN.json   (its ShardInfo; written last: the shard is finished)

A shard whose done file exists is not rewritten: the staging folder belongs to one plan key, so an
existing shard was written from the same plan. It is reused only while its bytes still hash to the
sha256 its done file recorded; a shard changed on disk since (or an unreadable done file) is written
again and reported, never published.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

import packtool
from packtool.builder.plan_files import PIECES_FILE, FolderPlan, Plan, load_plan
from packtool.builder.store import PartitionReader, StoredSample
from packtool.format import WHOLE, sha256_file, write_json_atomic
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths, labels_for
from packtool.packing import StreamPlan
from packtool.records import ROLE_CODES
from packtool.shards import OutputPack, SegmentColumns, ShardInfo, write_shard


@dataclass(frozen=True)
class EmitItem:
    plan_folder: str
    folder: str  # "" or "overflow"
    shard: int
    first_pack: int
    end_pack: int
    out: str  # the staged output folder
    done: str  # where the shard's ShardInfo goes when it is finished
    row_group_rows: int

    @property
    def file(self) -> str:
        return f"shard-{self.shard:05d}.parquet"

    @property
    def done_file(self) -> Path:
        return Path(self.done) / f"{self.folder + '-' if self.folder else ''}{self.shard:05d}.json"


@dataclass(frozen=True)
class EmitResult:
    info: ShardInfo
    reused: bool
    repaired: str | None = None  # why a staged shard was not reused (it was written again)


def emit_items(plan: Plan, out: Path, done: Path, rows_per_shard: int, row_group_rows: int) -> list[EmitItem]:
    items = []
    for f in plan.folders:
        for shard, first in enumerate(range(0, f.n_packs, rows_per_shard)):
            end = min(first + rows_per_shard, f.n_packs)
            items.append(EmitItem(str(plan.folder), f.name, shard, first, end, str(out), str(done), row_group_rows))
    return items


# Plans and partitions opened by this process, reused across the shards it writes.
_PLANS: dict[str, Plan] = {}
_READERS: dict[str, PartitionReader] = {}


def _reader(path: str) -> PartitionReader:
    if path not in _READERS:
        _READERS[path] = PartitionReader(Path(path))
    return _READERS[path]


def release() -> None:
    """Close what this process mapped (the driver calls it before publishing, so files can be removed)."""
    for reader in _READERS.values():
        reader.close()
    _READERS.clear()
    _PLANS.clear()


def emit_item(item: EmitItem) -> EmitResult:
    done = item.done_file
    target = Path(item.out) / item.folder / item.file
    staged, damaged = _staged(done, target)
    if staged is not None:
        return EmitResult(staged, reused=True)
    if item.plan_folder not in _PLANS:
        _PLANS[item.plan_folder] = load_plan(Path(item.plan_folder))
    plan = _PLANS[item.plan_folder]
    folder = next(f for f in plan.folders if f.name == item.folder)
    gather = _Gather(plan, folder)
    if isinstance(folder.layout, StreamPlan):
        packs = [_stream_pack(gather, folder.layout, w) for w in range(item.first_pack, item.end_pack)]
    else:
        layout = folder.layout
        packs = []
        for p in range(item.first_pack, item.end_pack):
            members = layout.members[layout.offsets[p] : layout.offsets[p + 1]]
            samples = [gather.get(int(k)) for k in members]
            v2 = plan.schema_version != packtool.SCHEMA_VERSION
            packs.append(_pack(samples, _segment_columns(gather, members, samples) if v2 else None))
    metadata = {
        "packtool.version": packtool.__version__,
        "packtool.capacity": str(folder.capacity),
        "packtool.mode": "stream" if folder.stream else "packed",
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    info = write_shard(packs, target, row_group_rows=item.row_group_rows, metadata=metadata)
    done.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(done, asdict(info))
    return EmitResult(info, reused=False, repaired=damaged)


def _staged(done: Path, target: Path) -> tuple[ShardInfo | None, str | None]:
    """(info, None) for a finished shard as it was written; (None, why) for one that is not; (None, None): none."""
    if not done.exists():
        return None, None
    try:
        info = ShardInfo(**json.loads(done.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        done.unlink(missing_ok=True)
        return None, f"staged shard {target}: its done file {done} is unreadable"
    if not target.is_file() or target.stat().st_size != info.bytes or sha256_file(target) != info.sha256:
        done.unlink(missing_ok=True)
        return None, f"staged shard {target}: its bytes changed since it was written"
    return info, None


class _Gather:
    """Segment k of one folder -> its stored sample (from a partition, or a truncated piece)."""

    def __init__(self, plan: Plan, folder: FolderPlan):
        self.plan = plan
        self.folder = folder
        self.bases = plan.bases
        self.pieces = _reader(str(plan.folder / PIECES_FILE))
        self._piece_rows: np.ndarray | None = None

    def get(self, k: int) -> StoredSample:
        ref, repeat = int(self.folder.ref[k]), int(self.folder.repeat[k])
        if ref >= 0:
            p = int(np.searchsorted(self.bases, ref, side="right") - 1)
            return _reader(self.plan.partitions[p].path).get(ref - int(self.bases[p]), repeat)
        row = -ref - 1
        if self._piece_rows is None:
            self._piece_rows = self.pieces.column("ordinal")  # a piece's ordinal: its sample's global row
        g = int(self._piece_rows[row])
        source = self.plan.partitions[int(np.searchsorted(self.bases, g, side="right") - 1)].source
        return replace(self.pieces.get(row, repeat), source=source)

    def part(self, k: int) -> tuple[int, int]:
        """(piece number, token offset in its sample) of segment k: (WHOLE, 0) for an uncut sample."""
        ref = int(self.folder.ref[k])
        if ref >= 0:
            return WHOLE, 0
        return int(self.plan.piece_numbers[-ref - 1]), int(self.plan.piece_offsets[-ref - 1])


def _pack(members: list[StoredSample], segments: SegmentColumns | None) -> OutputPack:
    """One pack; `segments` are its schema v2 per-segment columns (None in a v1 build)."""
    ids = np.concatenate([m.input_ids for m in members])
    targets = np.concatenate([m.targets for m in members])
    cu = cu_seqlens_from_lengths([len(m) for m in members])
    return OutputPack(
        input_ids=ids,
        labels=labels_for(ids, targets, cu),
        cu_seqlens=cu,
        doc_cu_seqlens=cu,
        token_roles=np.concatenate([m.roles for m in members]),
        sample_ids=[m.example_id for m in members],
        sample_hashes=[m.sample_hash for m in members],
        sample_repeats=[m.repeat for m in members],
        sources=[m.source for m in members],
        segments=segments,
    )


def _segment_columns(gather: _Gather, segments: np.ndarray, members: list[StoredSample]) -> SegmentColumns:
    groups = np.full(len(segments), -1) if gather.folder.group is None else gather.folder.group[segments]
    parts = np.array([gather.part(int(k)) for k in segments], dtype=np.int32).reshape(-1, 2)
    return SegmentColumns(
        groups=np.asarray(groups, dtype=np.int64),
        kinds=np.array([m.role.kind for m in members], dtype=np.int8),
        completion_index=np.array([m.role.completion for m in members], dtype=np.int16),
        rewards=np.array([m.role.reward for m in members], dtype=np.float64),
        advantages=np.array([m.role.advantage for m in members], dtype=np.float64),
        pieces=parts[:, 0],
        piece_offsets=parts[:, 1],
    )


def _stream_pack(gather: _Gather, plan: StreamPlan, window: int) -> OutputPack:
    """Continuous pretraining window: one attention segment; documents see each other."""
    a, b = plan.offsets[window], plan.offsets[window + 1]
    pieces = [
        (gather.get(int(k)), int(st), int(en)) for k, st, en in zip(plan.samples[a:b], plan.starts[a:b], plan.ends[a:b])
    ]
    ids = np.concatenate([s.input_ids[st:en] for s, st, en in pieces])
    labels = ids.astype(np.int32).copy()
    labels[0] = IGNORE_INDEX  # a window's first token has no context inside the window
    return OutputPack(
        input_ids=ids,
        labels=labels,
        cu_seqlens=np.array([0, len(ids)], dtype=np.int32),
        doc_cu_seqlens=cu_seqlens_from_lengths([en - st for _, st, en in pieces]),
        token_roles=np.full(len(ids), ROLE_CODES["text"], dtype=np.int8),
        sample_ids=[s.example_id for s, _, _ in pieces],
        sample_hashes=[s.sample_hash for s, _, _ in pieces],
        sample_repeats=[s.repeat for s, _, _ in pieces],
        sources=[s.source for s, _, _ in pieces],
    )
