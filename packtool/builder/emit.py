"""Emit phase: one work item per output shard, gathering its packs from the token store.

    plan (packs as segment indices) --segment--> ref --> partition row or truncated piece
        --> PackColumns (a shard's packs end to end) --> STAGING/out/[overflow/]shard-NNNNN.parquet
        --> STAGING/done/[overflow-]shard-NNNNN.json   (its ShardInfo; written last: the shard is finished)

A shard whose done file exists is not rewritten: the staging folder belongs to one plan key, so an
existing shard was written from the same plan. It is reused only while its bytes still hash to the
sha256 its done file recorded; a shard changed on disk since (or an unreadable done file) is written
again and reported, never published.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import packtool
from packtool.arrow import int32_offsets
from packtool.builder.plan_files import PIECES_FILE, FolderPlan, Plan, VisionPlan, map_plan
from packtool.builder.store import PartitionReader, SegmentRole, StoredParts
from packtool.errors import BuildError
from packtool.format import SCHEMA_VERSION, WHOLE, sha256_file, write_json_atomic
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths
from packtool.packing import PackPlan, StreamPlan
from packtool.records import ROLE_CODES, PlacedImage
from packtool.shards import ImageColumns, OutputPack, PackColumns, SegmentColumns, ShardInfo, concatenated, write_shard
from packtool.vision.positions import document_positions


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


# The plan and partitions opened by this process, reused across the shards it writes for one build (one plan).
_PLANS: dict[str, Plan] = {}
_READERS: dict[str, PartitionReader] = {}


def _reader(path: str) -> PartitionReader:
    if path not in _READERS:
        _READERS[path] = PartitionReader(Path(path))
    return _READERS[path]


def share(plan: Plan) -> None:
    """Let shards written in this process (the serial executor's) gather from the plan the driver holds,
    instead of a second copy read from plan.npz (~45 B a sample more at `-j 1`, issue 43)."""
    release()
    _PLANS[str(plan.folder)] = plan


def release() -> None:
    """Close what this process mapped: the driver calls it before publishing, so files can be removed, and a worker
    before an item of another plan (a Ray worker or a process pool outlives a build: the plans and store files of
    builds before, maybe deleted since, stayed mapped)."""
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
        release()
        _PLANS[item.plan_folder] = map_plan(Path(item.plan_folder))
    plan = _PLANS[item.plan_folder]
    folder = next(f for f in plan.folders if f.name == item.folder)
    gather = _Gather(plan, folder)
    if isinstance(folder.layout, StreamPlan):
        packs = PackColumns.of([_stream_pack(gather, folder.layout, w) for w in range(item.first_pack, item.end_pack)])
    else:
        packs = _packed(gather, folder.layout, item.first_pack, item.end_pack)
    metadata = {
        "packtool.version": packtool.__version__,
        "packtool.capacity": str(folder.capacity),
        "packtool.mode": "stream" if folder.stream else "packed",
    }
    for reader in _READERS.values():  # what the shard read beside its samples (a footer, the pieces' ordinals)
        reader.drop_pages()
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

    @property
    def piece_rows(self) -> np.ndarray:
        """Each piece's ordinal: its sample's global row."""
        if self._piece_rows is None:
            self._piece_rows = self.pieces.column("ordinal")
        return self._piece_rows

    def _located(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per segment of `ks`: whether it is a piece, the partition naming its source (a piece's: its sample's),
        and its row in its reader (pieces.arrow's for a piece)."""
        refs = self.folder.ref[ks].astype(np.int64)
        cut = refs < 0
        owners = refs.copy()
        if cut.any():
            owners[cut] = self.piece_rows[-refs[cut] - 1]
        partitions = np.searchsorted(self.bases, owners, side="right") - 1
        return cut, partitions, np.where(cut, -refs - 1, refs - self.bases[partitions])

    def _read(self, piece: bool, p: int, row: int) -> tuple[PartitionReader, StoredParts, str]:
        if piece:
            return self.pieces, self.pieces.parts(row), self.plan.partitions[p].source
        reader = _reader(self.plan.partitions[p].path)
        return reader, reader.parts(row), reader.source

    def stored(self, ks: np.ndarray) -> Iterator[tuple[StoredParts, str]]:
        """Per segment of `ks`, in order: its stored sample's parts (views of the map) and its source."""
        for piece, p, row in zip(*(column.tolist() for column in self._located(ks))):
            yield self._read(piece, p, row)[1:]

    def copied(self, ks: np.ndarray) -> list[tuple[StoredParts, str]]:
        """Per segment of `ks`, in order: its parts, tokens copied out of the map, and its source. Read reader by
        reader, each one's pages dropped once its rows are copied: a packed shard draws its samples from across the
        whole store, and the kernel maps page cache in large folios (one byte read per MB of a file mapped all of
        it), so reading in pack order kept the whole store mapped (RssFile ~1 KB a sample at -j 1, issue 43)."""
        located = self._located(ks)
        order = np.lexsort((located[2], np.where(located[0], -1, located[1]))).tolist()
        cut, partitions, rows = (column.tolist() for column in located)
        found: list[tuple[StoredParts, str]] = []
        reading = None
        for i in order:
            reader, parts, source = self._read(cut[i], partitions[i], rows[i])
            if reader is not reading and reading is not None:
                reading.drop_pages()
            reading = reader
            ids, targets, roles = parts.input_ids.copy(), parts.targets.copy(), parts.roles.copy()
            found.append((StoredParts(ids, targets, roles, parts.example_id, parts.sample_hash, *parts[5:]), source))
        if reading is not None:
            reading.drop_pages()
        in_order = found.copy()
        for at, i in enumerate(order):
            in_order[i] = found[at]
        return in_order

    def segments(self, ks: np.ndarray) -> _Segments:
        """Segments `ks` in order, their tokens laid end to end."""
        input_ids, targets, roles, example_ids, sample_hashes, segment_roles, sources = [], [], [], [], [], [], []
        images = []
        for stored, source in self.copied(ks):
            input_ids.append(stored.input_ids)
            targets.append(stored.targets)
            roles.append(stored.roles)
            example_ids.append(stored.example_id)
            sample_hashes.append(stored.sample_hash)
            segment_roles.append(stored.role)
            sources.append(source)
            images.append(stored.images)
        lengths = np.fromiter(map(len, input_ids), dtype=np.int64, count=len(input_ids))
        if (lengths <= 0).any():
            raise ValueError(f"segment lengths must be positive, got {lengths.tolist()}")
        refs = self.folder.ref[ks].astype(np.int64)
        cut = refs < 0
        parts = np.zeros((len(ks), 2), dtype=np.int32)
        parts[:, 0] = WHOLE
        parts[cut, 0], parts[cut, 1] = self.plan.piece_numbers[-refs[cut] - 1], self.plan.piece_offsets[-refs[cut] - 1]
        return _Segments(
            lengths=lengths,
            input_ids=concatenated(input_ids, np.int32),
            targets=concatenated(targets, bool),
            roles=concatenated(roles, np.int8),
            example_ids=example_ids,
            sample_hashes=sample_hashes,
            sources=sources,
            repeats=np.asarray(self.folder.repeat[ks], dtype=np.int32),
            segment_roles=segment_roles,
            groups=np.full(len(ks), -1, np.int64) if self.folder.group is None else self.folder.group[ks],
            parts=parts,
            images=images,
        )


@dataclass(frozen=True, slots=True)
class _Segments:
    """Segments in order: per segment its length, sample and role; their tokens laid end to end."""

    lengths: np.ndarray
    input_ids: np.ndarray
    targets: np.ndarray
    roles: np.ndarray
    example_ids: list[str]
    sample_hashes: list[str]
    sources: list[str]
    repeats: np.ndarray
    segment_roles: list[SegmentRole]
    groups: np.ndarray
    parts: np.ndarray  # [segments, 2]: piece number (WHOLE: uncut), token offset in its sample
    images: list[tuple[PlacedImage, ...]]  # each segment's, spans in the segment


def _packed(gather: _Gather, layout: PackPlan, first: int, end: int) -> PackColumns:
    """Packs first..end of a packed folder: each segment is one document and one attention segment.

    segments of 3, 2 | 4 tokens   starts [0 3 5 9]   packs' documents [0 2 3]
    cu_seqlens [0 3 5 | 0 4]      labels -100 at tokens 0, 3, 5 (every segment start)
    """
    lo = int(layout.offsets[first])
    documents = layout.offsets[first : end + 1].astype(np.int64) - lo
    segments = gather.segments(layout.members[lo : int(layout.offsets[end])])
    starts = np.zeros(len(segments.lengths) + 1, dtype=np.int64)
    np.cumsum(segments.lengths, out=starts[1:])
    token_offsets = starts[documents]
    # pack i's cu_seqlens: starts[documents[i]..documents[i + 1]] less its first token
    counts = np.diff(documents) + 1
    cu_offsets = documents + np.arange(len(documents))
    picked = np.arange(int(cu_offsets[-1])) - np.repeat(cu_offsets[:-1] - documents[:-1], counts)
    cu = starts[picked] - np.repeat(token_offsets[:-1], counts)
    labels = np.where(segments.targets, segments.input_ids, IGNORE_INDEX).astype(np.int32)
    labels[starts[:-1]] = IGNORE_INDEX  # no sample's last token predicts the next sample's first
    v2 = gather.plan.schema_version != SCHEMA_VERSION
    return PackColumns(
        token_offsets=token_offsets,
        input_ids=segments.input_ids,
        labels=labels,
        token_roles=segments.roles,
        cu_offsets=cu_offsets,
        cu_seqlens=int32_offsets(cu),
        doc_cu_offsets=cu_offsets,
        doc_cu_seqlens=int32_offsets(cu),
        document_offsets=documents,
        sample_ids=segments.example_ids,
        sample_hashes=segments.sample_hashes,
        sample_repeats=segments.repeats,
        sources=segments.sources,
        segments=_segment_columns(segments) if v2 else None,
        images=None if gather.plan.vision is None else _image_columns(segments, starts, documents, gather.plan.vision),
    )


def _image_columns(segments: _Segments, starts: np.ndarray, documents: np.ndarray, vision: VisionPlan) -> ImageColumns:
    """The packs' images in token order, their spans moved from their segment into the pack row, and (mRoPE) every
    token's positions: each segment's own, from 0, as the model computes them for the document alone.

    packs' documents [0 2 3], segments of 3 and 4 | 5 tokens, an image at 1..3 of segment 1:
    its span in pack 0 is [3 + 1, 3 + 3) = [4, 6), its document 1; image_offsets [0 1 1]
    """
    pack_of = np.repeat(np.arange(len(documents) - 1), np.diff(documents))
    placed = [(s, image) for s, images in enumerate(segments.images) for image in images]
    pack_start = starts[documents[pack_of]]
    per_pack = np.bincount(np.array([pack_of[s] for s, _ in placed], dtype=np.int64), minlength=len(documents) - 1)
    offsets = np.zeros(len(documents), dtype=np.int64)
    np.cumsum(per_pack, out=offsets[1:])
    moved = [int(starts[s] - pack_start[s]) for s, _ in placed]
    return ImageColumns(
        offsets=offsets,
        refs=[image.reference for _, image in placed],
        sha256=[image.sha256 for _, image in placed],
        sizes=np.array([image.n_bytes for _, image in placed], dtype=np.int64),
        grids=np.array([image.grid for _, image in placed], dtype=np.int32).reshape(-1, 3),
        spans=np.array(
            [(image.start + at, image.end + at) for (_, image), at in zip(placed, moved)], dtype=np.int32
        ).reshape(-1, 2),
        documents=np.array([s - documents[pack_of[s]] for s, _ in placed], dtype=np.int32),
        data=[_image_bytes(image, vision) for _, image in placed],
        mrope=None if vision.merge_size is None else _mrope(segments, documents, vision.merge_size),
    )


def _image_bytes(image: PlacedImage, vision: VisionPlan) -> bytes:
    """What image_data holds: the bytes a record carried itself, the file's under `images: embed` (read now, and
    refused unless they are the bytes that were encoded), else nothing."""
    if image.data is not None or not vision.embed:
        return image.data or b""
    path = Path(vision.root) / image.reference
    try:
        data = path.read_bytes()
    except OSError as error:
        raise BuildError(f"images: embed: cannot read {path} ({error.strerror or error})") from None
    if len(data) != image.n_bytes or hashlib.sha256(data).hexdigest() != image.sha256:
        raise BuildError(
            f"images: embed: {path} changed since it was encoded (sha256 {image.sha256[:12]}..., "
            f"{image.n_bytes} bytes then); rerun the build to encode it again"
        )
    return data


def _mrope(segments: _Segments, documents: np.ndarray, merge_size: int) -> np.ndarray:
    """Each pack's mRoPE positions, its temporal row, then its height row, then its width row (int32)."""
    rows = [
        document_positions(n, [(i.start, i.end) for i in images], [i.grid for i in images], merge_size)
        for n, images in zip(segments.lengths.tolist(), segments.images)
    ]
    packs = [
        np.concatenate(rows[a:b], axis=1).reshape(-1) if b > a else np.zeros(0, np.int64)
        for a, b in zip(documents[:-1].tolist(), documents[1:].tolist())
    ]
    return concatenated(packs, np.int32)


def _segment_columns(segments: _Segments) -> SegmentColumns:
    roles = segments.segment_roles
    return SegmentColumns(
        groups=np.asarray(segments.groups, dtype=np.int64),
        kinds=np.array([r.kind for r in roles], dtype=np.int8),
        completion_index=np.array([r.completion for r in roles], dtype=np.int16),
        rewards=np.array([r.reward for r in roles], dtype=np.float64),
        advantages=np.array([r.advantage for r in roles], dtype=np.float64),
        pieces=segments.parts[:, 0],
        piece_offsets=segments.parts[:, 1],
    )


def _stream_pack(gather: _Gather, plan: StreamPlan, window: int) -> OutputPack:
    """Continuous pretraining window: one attention segment; documents see each other."""
    a, b = plan.offsets[window], plan.offsets[window + 1]
    ks = plan.samples[a:b]
    pieces = [
        (parts, source, st, en)
        for (parts, source), st, en in zip(gather.stored(ks), plan.starts[a:b].tolist(), plan.ends[a:b].tolist())
    ]
    ids = np.concatenate([parts.input_ids[st:en] for parts, _, st, en in pieces])
    labels = ids.astype(np.int32).copy()
    labels[0] = IGNORE_INDEX  # a window's first token has no context inside the window
    return OutputPack(
        input_ids=ids,
        labels=labels,
        cu_seqlens=np.array([0, len(ids)], dtype=np.int32),
        doc_cu_seqlens=cu_seqlens_from_lengths([en - st for _, _, st, en in pieces]),
        token_roles=np.full(len(ids), ROLE_CODES["text"], dtype=np.int8),
        sample_ids=[parts.example_id for parts, _, _, _ in pieces],
        sample_hashes=[parts.sample_hash for parts, _, _, _ in pieces],
        sample_repeats=gather.folder.repeat[ks].tolist(),
        sources=[source for _, source, _, _ in pieces],
    )
