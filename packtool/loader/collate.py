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

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from packtool.errors import PackFormatError
from packtool.format import WHOLE, attn_cost
from packtool.labels import IGNORE_INDEX, position_ids
from packtool.loader.contract import validate_cu_seqlens
from packtool.shards import SegmentColumns

__all__ = ["LoadedPack", "MicroBatch", "PackFormatError", "batch_by_tokens", "collate", "validate_cu_seqlens"]


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
    # Schema v2, [S] each, aligned with cu_seqlens (padding segments: group -1, kind single, NaN); None for v1 packs.
    # A micro-batch is made of whole packs and a pack holds whole groups, so no pair or group is ever split.
    segment_groups: torch.Tensor | None = None  # int64: the pair's or group's id, -1 for a plain sample
    segment_kinds: torch.Tensor | None = None  # int8: packing_items.KIND_CODES
    completion_index: torch.Tensor | None = None  # int16: -1 unless a group's completion
    segment_rewards: torch.Tensor | None = None  # float64, NaN where none
    segment_advantages: torch.Tensor | None = None  # float64, NaN where none
    segment_pieces: torch.Tensor | None = None  # int32: which piece of a split sample (-1: the sample whole)
    segment_piece_offsets: torch.Tensor | None = None  # int32: the piece's first token's offset in its sample

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
        }

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
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
    target across a boundary). One concatenation per column and one vectorised check for the
    whole micro-batch: per-pack numpy calls were most of the loader's time.
    """
    packs = [as_loaded_pack(r) for r in rows]
    if not packs and not n_padding_rows:
        raise PackFormatError("collate got no rows")
    if n_padding_rows and capacity is None:
        raise PackFormatError("n_padding_rows needs a capacity")
    # Packs read by PackedDataset had the contract checked once per row group (`checked`); others here.
    trusted = all(p.checked for p in packs)
    lens = np.fromiter((len(p.input_ids) for p in packs), np.int64, len(packs))
    for pack, n in zip([] if trusted else packs, lens.tolist(), strict=False):
        if len(pack.labels) != n:
            raise PackFormatError(f"pack {pack.pack_hash!r}: {len(pack.labels)} labels for {n} input_ids")
    # Every pack's cu_seqlens at once: one concatenation instead of numpy calls per pack.
    cus = [np.asarray(p.cu_seqlens) for p in packs]
    cu_lens = np.fromiter(map(len, cus), np.int64, len(cus))
    flat = np.concatenate(cus).astype(np.int64) if packs else np.zeros(0, np.int64)
    last = np.cumsum(cu_lens) - 1
    first = last - cu_lens + 1
    broken = (cu_lens < 2) | (flat[np.maximum(first, 0)] != 0) | (flat[last] != lens) if not trusted else lens < 0
    if broken.any():
        bad = packs[int(np.argmax(broken))]
        shown = np.asarray(bad.cu_seqlens).tolist()[:8]
        raise PackFormatError(f"pack {bad.pack_hash!r}: cu_seqlens {shown} must run from 0 to {len(bad)}")
    pad = np.zeros_like(lens) if capacity is None else capacity - lens
    if (pad < 0).any():
        bad = packs[int(np.argmax(pad < 0))]
        raise PackFormatError(f"pack {bad.pack_hash or bad.row} has {len(bad)} tokens > capacity {capacity}")
    row_start = np.concatenate([[0], np.cumsum(lens + pad)])  # where each pack's slot starts in the row
    shifted = flat + np.repeat(row_start[:-1], cu_lens)
    is_first = np.zeros(len(flat), bool)
    is_first[first] = True
    # The padding after a pack is its own segment: nothing real attends to it and it holds no target.
    padding_ends = (row_start[1:][pad > 0]).tolist()
    padding_ends += [int(row_start[-1]) + (i + 1) * (capacity or 0) for i in range(n_padding_rows)]
    cu_seqlens = np.sort(np.concatenate([[0], shifted[~is_first], padding_ends]).astype(np.int64))
    if capacity is None:
        input_ids = np.concatenate([p.input_ids for p in packs]).astype(np.int64, copy=False)
        labels = np.concatenate([p.labels for p in packs]).astype(np.int64, copy=False)
    else:
        total = int(row_start[-1]) + n_padding_rows * capacity
        input_ids = np.full(total, pad_id, dtype=np.int64)
        labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        for pack, lo, n in zip(packs, row_start[:-1].tolist(), lens.tolist(), strict=True):
            input_ids[lo : lo + n] = pack.input_ids
            labels[lo : lo + n] = pack.labels
    if not trusted:
        validate_cu_seqlens(cu_seqlens, len(input_ids))
        is_last = np.zeros(len(flat), bool)
        is_last[last] = True
        real_starts = shifted[~is_last]
        if (labels[real_starts] != IGNORE_INDEX).any():
            where = int(real_starts[np.argmax(labels[real_starts] != IGNORE_INDEX)])
            owner = packs[int(np.searchsorted(row_start, where, side="right")) - 1]
            raise PackFormatError(
                f"pack {owner.pack_hash!r}: a segment starts with a label other than -100, "
                "so one sample would learn to predict the next; rebuild the shards"
            )
    steps = {p.step for p in packs}
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids).unsqueeze(0),
        labels=torch.from_numpy(labels).unsqueeze(0),
        position_ids=torch.from_numpy(position_ids(cu_seqlens)).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
        max_seqlen=int(np.diff(cu_seqlens).max()),
        n_targets=int((labels != IGNORE_INDEX).sum()),
        n_packs=len(packs),
        pack_hashes=tuple(p.pack_hash for p in packs),
        step=steps.pop() if len(steps) == 1 else -1,
        resume_after=packs[-1].resume_after if packs else -1,
        n_segments=len(flat) - len(packs),
        n_padding=len(input_ids) - int(lens.sum()),
        attn_cost=sum(p.cost for p in packs),
        **(_segment_tensors(packs, cu_seqlens, row_start) if any(p.segments is not None for p in packs) else {}),
    )


# Schema v2 per-segment columns: shard column (also the MicroBatch field) -> SegmentColumns field,
# the value of segments collate adds (padding: a plain sample), and its dtype.
SEGMENT_COLUMNS: dict[str, tuple[str, float, type]] = {
    "segment_groups": ("groups", -1, np.int64),
    "segment_kinds": ("kinds", 0, np.int8),
    "completion_index": ("completion_index", -1, np.int16),
    "segment_rewards": ("rewards", np.nan, np.float64),
    "segment_advantages": ("advantages", np.nan, np.float64),
    "segment_pieces": ("pieces", WHOLE, np.int32),
    "segment_piece_offsets": ("piece_offsets", 0, np.int32),
}


def _segment_tensors(
    packs: Sequence[LoadedPack], cu_seqlens: np.ndarray, row_start: np.ndarray
) -> dict[str, torch.Tensor]:
    """The packs' per-segment columns in micro-batch order; segments collate added (padding) stay plain."""
    out: dict[str, np.ndarray] = {
        column: np.full(len(cu_seqlens) - 1, fill, dtype=dtype) for column, (_, fill, dtype) in SEGMENT_COLUMNS.items()
    }
    # a pack's first segment starts where its slot starts; its segments follow in order
    firsts = np.searchsorted(cu_seqlens, row_start[:-1])
    for pack, at in zip(packs, firsts.tolist(), strict=True):
        if pack.segments is not None:
            n = len(pack.cu_seqlens) - 1
            for column, (field, _, _) in SEGMENT_COLUMNS.items():
                out[column][at : at + n] = getattr(pack.segments, field)
    return {column: torch.from_numpy(values) for column, values in out.items()}


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group consecutive packs into micro-batches of at most `token_budget` tokens (a hard cap).

    Order is kept (the stream is already shuffled). lengths [5, 4, 3, 6], budget 8 -> [[0], [1, 2], [3]].
    A pack longer than the budget raises: it cannot be split.
    """
    if token_budget <= 0:
        raise PackFormatError(f"token_budget must be positive, got {token_budget}")
    plan: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise PackFormatError(f"pack {i} has {n} tokens > token_budget {token_budget}; raise the budget")
        if current and used + n > token_budget:
            plan.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        plan.append(current)
    return plan


def batch_by_tokens(
    rows: Iterable[LoadedPack],
    token_budget: int,
    *,
    fixed_shape: bool = False,
    capacity: int | None = None,
    pad_id: int = 0,
) -> Iterator[MicroBatch]:
    """Stream micro-batches of at most `token_budget` tokens (one pending micro-batch in memory).

    The budget is a hard cap: a pack longer than it raises. fixed_shape: every micro-batch holds
    `token_budget // capacity` pack slots, each padded to `capacity`, and a micro-batch closed
    early is filled with padding rows, so T == that many * capacity always. A micro-batch never
    mixes two plan rounds (`LoadedPack.step`) and closes where a rank's share of a round ends
    (`closes_step`), so it can carry the round's resume position.
    """
    if token_budget <= 0:
        raise PackFormatError(f"token_budget must be positive, got {token_budget}")
    per_batch = 0
    if fixed_shape:
        if capacity is None:
            raise PackFormatError("fixed_shape needs the shards' capacity (manifest 'capacity')")
        per_batch = token_budget // capacity
        if per_batch < 1:
            raise PackFormatError(f"token_budget {token_budget} < capacity {capacity}; raise the budget")

    def close(pending: list[LoadedPack]) -> MicroBatch:
        if fixed_shape:
            return collate(pending, capacity=capacity, pad_id=pad_id, n_padding_rows=per_batch - len(pending))
        return collate(pending)

    current: list[LoadedPack] = []
    used = 0
    for row in rows:
        n = capacity if fixed_shape and capacity is not None else len(row)
        if len(row) > token_budget:
            raise PackFormatError(
                f"pack {row.pack_hash or row.row} has {len(row)} tokens > token_budget {token_budget}"
            )
        if current and (used + n > token_budget or row.step != current[-1].step):
            yield close(current)
            current, used = [], 0
        current.append(row)
        used += n
        if row.closes_step:
            yield close(current)
            current, used = [], 0
    if current:
        yield close(current)
