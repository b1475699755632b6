"""Collation: pack rows -> one flattened, padding-free micro-batch.

Worked example (docs/format.md): samples A=[a0,a1,E], B=[b0,E], C=[c0,c1,c2,E] in one pack,
every token a target. `collate([pack])` gives::

    t              0     1   2   3     4   5     6   7   8
    input_ids    [[a0,   a1, E,  b0,   E,  c0,   c1, c2, E]]     [1, T] int64
    labels       [[-100, a1, E,  -100, E,  -100, c1, c2, E]]     [1, T] int64
    position_ids [[0,    1,  2,  0,    1,  0,    1,  2,  3]]     [1, T] int64
    cu_seqlens     [0, 3, 5, 9]                                  [S+1] int32
    max_seqlen     4            longest segment, not T
    n_targets      6            labels != -100 (the model shifts: logits[t] predicts labels[t+1])

Several packs are concatenated on the token axis; their segments keep their own offsets, so
two packs [A B C] and [D E] give cu_seqlens [0, 3, 5, 9, 9+lD, 9+lD+lE] and one row of T tokens.
Attention is causal inside each segment and never crosses one (block-diagonal causal)::

          a0 a1 E  b0 E  c0 c1 c2 E
    a0  [ 1  .  .  .  .  .  .  .  . ]
    a1  [ 1  1  .  .  .  .  .  .  . ]
    E   [ 1  1  1  .  .  .  .  .  . ]
    b0  [ .  .  .  1  .  .  .  .  . ]
    E   [ .  .  .  1  1  .  .  .  . ]
    c0  [ .  .  .  .  .  1  .  .  . ]
    ...

Fixed shape (CUDA graphs, torch.compile): each pack is padded to `capacity` with one padding
segment (token `pad_id`, labels -100, positions 0..p-1) that attends only to itself, so real
tokens never see it and it never adds a target::

    pack [A B C] at capacity 12:  cu_seqlens [0, 3, 5, 9, 12]   labels[9:12] = -100
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from packtool.errors import PackFormatError
from packtool.format import INT32_MAX, V2_COLUMNS, attn_cost
from packtool.labels import IGNORE_INDEX
from packtool.loader.contract import validate_cu_seqlens
from packtool.loader.vision import PackImages, place_images
from packtool.shards import SegmentColumns

__all__ = [
    "LoadedPack",
    "MicroBatch",
    "PackFormatError",
    "PackViews",
    "assemble",
    "collate",
    "validate_cu_seqlens",
]


@dataclass(frozen=True, slots=True)
class LoadedPack:
    """One pack read back from a shard: the columns the loader needs, where it came from, its place in the plan.

    `step` is the plan round it belongs to; `resume_after` is the global position a resume state
    may point at once this pack is trained (the round's end when `closes_step`, else its start).
    """

    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L]
    cu_seqlens: np.ndarray  # int32 [S+1]
    pack_hash: str = ""
    attn_cost: int = -1  # sum(l_i^2); -1 when unknown (computed on demand)
    shard: str = ""
    row: int = -1
    step: int = -1  # the plan round (one micro-batch or one optimizer step of every rank); -1 outside a plan
    resume_after: int = -1
    closes_step: bool = False  # the last pack of this rank's share of its round
    checked: bool = False  # the reader already checked the contract (offsets, -100 at segment starts)
    segments: SegmentColumns | None = None  # schema v2 (pairs and groups): per attention segment
    images: PackImages | None = None  # a vision build's: the pack's images preprocessed, its mRoPE positions

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def cost(self) -> int:
        """The quadratic attention cost sum(l_i^2)."""
        if self.attn_cost >= 0:
            return self.attn_cost
        return attn_cost(self.cu_seqlens)


def as_loaded_pack(item: LoadedPack | Mapping[str, Any]) -> LoadedPack:
    """Accept a LoadedPack or any mapping with input_ids/labels/cu_seqlens (lists or arrays)."""
    if isinstance(item, LoadedPack):
        return item
    try:
        return LoadedPack(
            input_ids=np.asarray(item["input_ids"], dtype=np.int64),
            labels=np.asarray(item["labels"], dtype=np.int64),
            cu_seqlens=np.asarray(item["cu_seqlens"], dtype=np.int64),
            pack_hash=str(item.get("pack_hash", "")),
            attn_cost=int(item.get("attn_cost", -1)),
        )
    except KeyError as err:
        raise PackFormatError(f"pack lacks column {err}; need input_ids, labels, cu_seqlens") from None


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One flattened micro-batch (batch dimension 1, no padding unless fixed shape was asked).

    `n_packs` is how many shard rows it holds (padding rows count 0); `resume_after` the global
    epoch position a resume state may point at once it is trained (-1 outside a plan).
    """

    input_ids: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    cu_seqlens: torch.Tensor  # int32 [S+1]
    max_seqlen: int
    n_targets: int
    n_packs: int
    pack_hashes: tuple[str, ...] = ()  # provenance: shard rows -> sample ids via the manifest
    step: int = -1  # the plan round of its packs (never mixed), -1 outside a plan
    resume_after: int = -1
    n_segments: int = 0  # real attention segments (samples); padding segments not counted
    n_padding: int = 0  # padding token slots (fixed shape only)
    attn_cost: int = 0  # sum(l_i^2) over real segments
    # Schema v2 (None for v1 packs): the per-segment columns, read through the properties below
    # (segment_groups, ...), built for the whole chunk on first use: most training loops never ask.
    segments: SegmentSlice | None = None
    # A vision build's (packtool.loader.vision): the images of its packs in token order, preprocessed, and the
    # mRoPE positions [3, 1, T] (temporal, height, width) each document has alone; None in a text build.
    pixel_values: torch.Tensor | None = None  # float32 [patches, C * t * p * p]
    image_grid_thw: torch.Tensor | None = None  # int64 [n_images, 3]
    mrope_position_ids: torch.Tensor | None = None

    # [S] each, aligned with cu_seqlens (padding segments: group -1, kind single, NaN). A micro-batch
    # is made of whole packs and a pack holds whole groups, so no pair or group is ever split.
    @property
    def segment_groups(self) -> torch.Tensor | None:
        """int64: the pair's or group's id, -1 for a plain sample."""
        return self._segment_column("segment_groups")

    @property
    def segment_kinds(self) -> torch.Tensor | None:
        """int8: packing_items.KIND_CODES."""
        return self._segment_column("segment_kinds")

    @property
    def completion_index(self) -> torch.Tensor | None:
        """int16: -1 unless a group's completion."""
        return self._segment_column("completion_index")

    @property
    def segment_rewards(self) -> torch.Tensor | None:
        """float64, NaN where none."""
        return self._segment_column("segment_rewards")

    @property
    def segment_advantages(self) -> torch.Tensor | None:
        """float64, NaN where none."""
        return self._segment_column("segment_advantages")

    @property
    def segment_pieces(self) -> torch.Tensor | None:
        """int32: which piece of a split sample (-1: the sample whole)."""
        return self._segment_column("segment_pieces")

    @property
    def segment_piece_offsets(self) -> torch.Tensor | None:
        """int32: the piece's first token's offset in its sample."""
        return self._segment_column("segment_piece_offsets")

    def _segment_column(self, column: str) -> torch.Tensor | None:
        return None if self.segments is None else self.segments.table.column(column)[self.segments.index]

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def flash_kwargs(self) -> dict[str, Any]:
        """`cu_seq_lens_q/k`, `max_length_q/k`: what HF flash-attention backends read (eager/SDPA ignore them)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def as_dict(self) -> dict[str, Any]:
        """The tensors and counts plus the flash names, e.g. for a Hugging Face batch."""
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": self.position_ids,
            "cu_seqlens": self.cu_seqlens,
            "max_seqlen": self.max_seqlen,
            "n_targets": self.n_targets,
            "n_packs": self.n_packs,
            **self.flash_kwargs(),
            **self.vision_inputs(),
        }

    def vision_inputs(self) -> dict[str, torch.Tensor]:
        """pixel_values and image_grid_thw when the micro-batch holds images (what a vision model's forward reads)."""
        if self.pixel_values is None or self.image_grid_thw is None or not len(self.image_grid_thw):
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        def move_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else move(t)

        return replace(
            self,
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            pixel_values=move_optional(self.pixel_values),
            image_grid_thw=move_optional(self.image_grid_thw),
            mrope_position_ids=move_optional(self.mrope_position_ids),
        )


def collate(
    rows: Sequence[LoadedPack | Mapping[str, Any]],
    *,
    capacity: int | None = None,
    pad_id: int = 0,
    n_padding_rows: int = 0,
) -> MicroBatch:
    """Concatenate packs into one `[1, T]` micro-batch with explicit varlen metadata.

    `capacity` pads every pack to that length with one padding segment (fixed shape);
    `n_padding_rows` appends rows made only of padding (so the last micro-batch of an epoch keeps
    the same T). Raises PackFormatError when a pack breaks the contract: bad cu_seqlens,
    labels/input_ids of different lengths, or a label that is not -100 at a segment start (a
    target across a boundary). Packs read by PackedDataset had the contract checked once per
    row group (`checked`); others are checked here, vectorised over the whole micro-batch.
    """
    packs = [as_loaded_pack(r) for r in rows]
    if not packs and not n_padding_rows:
        raise PackFormatError("collate got no rows")
    if n_padding_rows and capacity is None:
        raise PackFormatError("n_padding_rows needs a capacity")
    if not all(p.checked for p in packs):
        _check_packs(packs)
    views = PackViews(
        input_ids=[p.input_ids for p in packs],
        labels=[p.labels for p in packs],
        cu_seqlens=[np.asarray(p.cu_seqlens) for p in packs],
        pack_hash=[p.pack_hash for p in packs],
        attn_cost=[p.cost for p in packs],
        step=[p.step for p in packs],
        resume_after=[p.resume_after for p in packs],
        segments=_pack_segments(packs) if any(p.segments is not None for p in packs) else None,
    )
    mbs = assemble(views, [0, len(packs)], capacity=capacity, pad_id=pad_id, padding_rows=[n_padding_rows])
    if any(p.images is not None for p in packs):
        mbs = with_images(mbs, [0, len(packs)], [p.images for p in packs], views.input_ids, capacity)
    return mbs[0]


def with_images(
    mbs: Sequence[MicroBatch],
    cuts: Sequence[int],
    images: Sequence[PackImages | None],
    input_ids: Sequence[np.ndarray],
    capacity: int | None,
) -> list[MicroBatch]:
    """The micro-batches of `assemble(views, cuts, capacity=...)` with their packs' images and mRoPE positions."""
    out = []
    for mb, (lo, hi) in zip(mbs, itertools.pairwise(cuts), strict=True):
        lengths = [len(ids) for ids in input_ids[lo:hi]]
        slots = [k * capacity for k in range(hi - lo)] if capacity else _starts(np.asarray(lengths))[:-1].tolist()
        pixels, grids, mrope = place_images(images[lo:hi], lengths, slots, mb.position_ids[0])
        out.append(replace(mb, pixel_values=pixels, image_grid_thw=grids, mrope_position_ids=mrope))
    return out


def _check_packs(packs: Sequence[LoadedPack]) -> None:
    """The pack contract for packs that did not come through PackedDataset's row-group check."""
    lens = np.fromiter((len(p.input_ids) for p in packs), np.int64, len(packs))
    for pack, n in zip(packs, lens.tolist(), strict=True):
        if len(pack.labels) != n:
            raise PackFormatError(f"pack {pack.pack_hash!r}: {len(pack.labels)} labels for {n} input_ids")
    cus = [np.asarray(p.cu_seqlens) for p in packs]
    cu_lens = np.fromiter(map(len, cus), np.int64, len(cus))
    flat = np.concatenate(cus).astype(np.int64) if packs else np.zeros(0, np.int64)
    last = np.cumsum(cu_lens) - 1
    first = last - cu_lens + 1
    broken = (cu_lens < 2) | (flat[np.maximum(first, 0)] != 0) | (flat[last] != lens)
    if broken.any():
        bad = packs[int(np.argmax(broken))]
        shown = np.asarray(bad.cu_seqlens).tolist()[:8]
        raise PackFormatError(f"pack {bad.pack_hash!r}: cu_seqlens {shown} must run from 0 to {len(bad)}")
    for pack, cu in zip(packs, cus, strict=True):
        validate_cu_seqlens(cu, len(pack))
        if (np.asarray(pack.labels)[cu[:-1]] != IGNORE_INDEX).any():
            raise PackFormatError(
                f"pack {pack.pack_hash!r}: a segment starts with a label other than -100, "
                "so one sample would learn to predict the next; rebuild the shards"
            )


# Schema v2 per-segment columns (format.V2_COLUMNS): shard column (also the MicroBatch field) -> SegmentColumns
# field, the value of segments collate adds (padding: a plain sample), and its dtype.
SEGMENT_COLUMNS: dict[str, tuple[str, float, type]] = {c.name: (c.field, c.fill, c.dtype) for c in V2_COLUMNS}


def _pack_segments(packs: Sequence[LoadedPack]) -> Callable[[str], list[np.ndarray]]:
    """Each pack's values of one column; a pack without them counts as plain samples."""

    def column_of(column: str) -> list[np.ndarray]:
        field, fill, dtype = SEGMENT_COLUMNS[column]
        return [
            np.full(len(p.cu_seqlens) - 1, fill, dtype) if p.segments is None else getattr(p.segments, field)
            for p in packs
        ]

    return column_of


@dataclass(frozen=True, slots=True)
class PackViews:
    """Packs as parallel lists, one entry per pack (views into decoded row groups; nothing copied yet)."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    cu_seqlens: list[np.ndarray]
    pack_hash: list[str]
    attn_cost: list[int]  # sum(l_i^2) of each pack's segments
    step: list[int]
    resume_after: list[int]
    segments: Callable[[str], list[np.ndarray]] | None = None  # schema v2: SEGMENT_COLUMNS name -> per pack values


def assemble(
    views: PackViews,
    cuts: Sequence[int],
    *,
    capacity: int | None = None,
    pad_id: int = 0,
    padding_rows: Sequence[int] | None = None,
    isolate_starts: bool = False,
) -> list[MicroBatch]:
    """Micro-batch m of packs [cuts[m], cuts[m+1]): several micro-batches from one pass over the columns.

    Per-call numpy overhead, not bytes, was the loader's cost (about 25 small calls per micro-batch),
    so every column is concatenated once for all micro-batches and each micro-batch's tensors are
    views of those buffers::

        packs      [A B C] [D E] | [F G]          cuts [0, 2, 3]: micro-batches {p0, p1} and {p2}
        tokens     a a a b b c c c c d d e | f g g    one buffer per column; ends of every segment:
        ends       3 5 9 11 12 | 13 15              micro-batch 1 starts at token 12 (its cu_seqlens
        cu_seqlens [0 3 5 9 11 12]  [0 1 3]          are the ends in its range, minus 12)

    Fixed shape (`capacity`): pack i fills a slot of `capacity` tokens and, when shorter, one
    padding segment closes its slot; micro-batch m ends with `padding_rows[m]` slots of padding.
    `isolate_starts` sets the label of every segment start to -100 (documents as segments).
    """
    n, n_mb = len(views.input_ids), len(cuts) - 1
    cut = np.asarray(cuts, dtype=np.int64)
    lens = np.fromiter(map(len, views.input_ids), np.int64, n)
    cu_lens = np.fromiter(map(len, views.cu_seqlens), np.int64, n)
    mb_of_pack = np.repeat(np.arange(n_mb), np.diff(cut))
    rows = np.zeros(n_mb, np.int64) if padding_rows is None else np.asarray(padding_rows, dtype=np.int64)
    if capacity is None:
        slots = lens
    else:
        if (lens > capacity).any():
            bad = int(np.argmax(lens > capacity))
            raise PackFormatError(
                f"pack {views.pack_hash[bad] or bad} has {int(lens[bad])} tokens > capacity {capacity}"
            )
        slots = np.full(n, capacity, np.int64)
    real = _starts(lens)  # where each pack's tokens sit among all real tokens
    slot_sums = _starts(slots)
    mb_slots = slot_sums[cut[1:]] - slot_sums[cut[:-1]]
    mb_cut = _starts(mb_slots + rows * (capacity or 0))  # token where each micro-batch starts
    slot_at = mb_cut[mb_of_pack] + slot_sums[:-1] - slot_sums[cut[:-1]][mb_of_pack]
    total = int(mb_cut[-1])
    tokens = np.diff(mb_cut)
    if n_mb and int(tokens.min()) < 1:
        raise PackFormatError(
            f"micro-batch {int(np.argmin(tokens))} would hold no token; every micro-batch needs a pack"
        )
    if int(tokens.max(initial=0)) > INT32_MAX:
        raise PackFormatError(
            f"a micro-batch over {INT32_MAX} tokens does not fit int32 offsets; lower the token budget"
        )

    input_ids = _concat(views.input_ids, np.int64)
    labels = _concat(views.labels, np.int64)
    if capacity is not None:
        where = np.repeat(slot_at - real[:-1], lens) + np.arange(int(real[-1]))
        input_ids, labels = _scatter(input_ids, where, total, pad_id), _scatter(labels, where, total, IGNORE_INDEX)

    # Segment offsets of every pack in buffer coordinates; a pack's leading 0 is the previous end.
    offsets = _concat(views.cu_seqlens, np.int64) + np.repeat(slot_at, cu_lens)
    firsts = _starts(cu_lens)
    is_first = np.zeros(len(offsets), bool)
    is_first[firsts[:-1]] = True
    is_last = np.zeros(len(offsets), bool)
    is_last[firsts[1:] - 1] = True
    real_ends = offsets[~is_first]
    ends, is_real = real_ends, np.ones(len(real_ends), bool)
    if capacity is not None:
        # The padding after a pack is its own segment: nothing real attends to it and it holds no target.
        short = lens < capacity
        row_ends = np.repeat(mb_cut[:-1] + mb_slots, rows) + capacity * (np.arange(int(rows.sum())) + 1)
        row_ends -= np.repeat(capacity * _starts(rows)[:-1], rows)
        all_ends = np.concatenate([real_ends, slot_at[short] + capacity, row_ends])
        order = np.argsort(all_ends, kind="stable")
        ends, is_real = all_ends[order], order < len(real_ends)
    if isolate_starts:
        labels[offsets[~is_last]] = IGNORE_INDEX  # no document learns to predict the next one's first token
    bounds = np.concatenate([[0], ends])
    seg_lens = np.diff(bounds)
    position_ids = np.arange(total, dtype=np.int64)
    position_ids -= np.repeat(bounds[:-1], seg_lens)

    # Micro-batch m holds segments [seg_cut[m], seg_cut[m+1]); its cu_seqlens repeat the shared boundary.
    seg_cut = np.searchsorted(bounds, mb_cut)
    seg_counts = np.diff(seg_cut)
    spans = _starts(seg_counts + 1)
    pick = np.repeat(seg_cut[:-1] - spans[:-1], seg_counts + 1) + np.arange(int(spans[-1]))
    cu_seqlens = (bounds[pick] - np.repeat(mb_cut[:-1], seg_counts + 1)).astype(np.int32)
    max_seqlen = np.maximum.reduceat(seg_lens, seg_cut[:-1]).tolist() if n_mb else []

    def per_mb(values: np.ndarray | Sequence[int]) -> list[int]:
        summed = _starts(np.asarray(values, dtype=np.int64))
        return (summed[cut[1:]] - summed[cut[:-1]]).tolist()

    n_real_tokens, n_segments, costs = per_mb(lens), per_mb(cu_lens - 1), per_mb(views.attn_cost)
    is_target = labels != IGNORE_INDEX
    segment_table = None if views.segments is None else SegmentTable(views.segments, is_real, seg_counts)
    token_cut, cu_cut = mb_cut.tolist(), spans.tolist()
    out = []
    # numpy views wrapped one by one: half the cost of torch's split + unsqueeze per micro-batch
    for m, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        a, b = token_cut[m], token_cut[m + 1]
        steps = set(views.step[lo:hi])
        out.append(
            MicroBatch(
                input_ids=torch.from_numpy(input_ids[a:b].reshape(1, -1)),
                labels=torch.from_numpy(labels[a:b].reshape(1, -1)),
                position_ids=torch.from_numpy(position_ids[a:b].reshape(1, -1)),
                cu_seqlens=torch.from_numpy(cu_seqlens[cu_cut[m] : cu_cut[m + 1]]),
                max_seqlen=max_seqlen[m],
                n_targets=int(np.count_nonzero(is_target[a:b])),
                n_packs=hi - lo,
                pack_hashes=tuple(views.pack_hash[lo:hi]),
                step=steps.pop() if len(steps) == 1 else -1,
                resume_after=views.resume_after[hi - 1] if hi > lo else -1,
                n_segments=n_segments[m],
                n_padding=b - a - n_real_tokens[m],
                attn_cost=costs[m],
                segments=None if segment_table is None else SegmentSlice(segment_table, m),
            )
        )
    return out


def _starts(counts: np.ndarray) -> np.ndarray:
    """[3, 2, 4] -> [0, 3, 5, 9]: where each run starts, and the total."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _concat(arrays: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays, dtype=dtype) if arrays else np.zeros(0, dtype)


def _scatter(values: np.ndarray, where: np.ndarray, total: int, fill: int) -> np.ndarray:
    out = np.full(total, fill, dtype=values.dtype)
    out[where] = values
    return out


class SegmentTable:
    """The schema v2 columns of micro-batches assembled together, each built for all of them on first use.

    Padding segments (fixed shape) sit among the real ones (`is_real`) and get the plain-sample
    values; micro-batch m holds `seg_counts[m]` segments.
    """

    def __init__(
        self, per_pack: Callable[[str], list[np.ndarray]], is_real: np.ndarray, seg_counts: np.ndarray
    ) -> None:
        self._per_pack, self._is_real, self._seg_counts = per_pack, is_real, seg_counts
        self._columns: dict[str, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def built(cls, columns: dict[str, tuple[torch.Tensor, ...]]) -> SegmentTable:
        table = cls(lambda name: [], np.zeros(0, bool), np.zeros(0, np.int64))
        table._columns = columns
        return table

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process (from DataLoader workers): the built columns, not the row groups they come from.
        return SegmentTable.built, ({name: self.column(name) for name in SEGMENT_COLUMNS},)

    def column(self, name: str) -> tuple[torch.Tensor, ...]:
        """One tensor per micro-batch."""
        if name not in self._columns:
            _, fill, dtype = SEGMENT_COLUMNS[name]
            values: np.ndarray = np.full(len(self._is_real), fill, dtype=dtype)
            values[self._is_real] = _concat(self._per_pack(name), dtype)
            self._columns[name] = torch.from_numpy(values).split(self._seg_counts.tolist())
        return self._columns[name]


@dataclass(frozen=True, slots=True)
class SegmentSlice:
    """Micro-batch `index` of a SegmentTable."""

    table: SegmentTable
    index: int
