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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from packtool.errors import PackFormatError
from packtool.format import attn_cost, check_cu_seqlens
from packtool.labels import IGNORE_INDEX, position_ids
from packtool.shards import SegmentColumns


@dataclass(frozen=True, slots=True)
class PackRow:
    """One pack as read from a shard: the columns the loader needs plus where it came from."""

    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L]
    cu_seqlens: np.ndarray  # int32 [S+1]
    pack_hash: str = ""
    attn_cost: int = -1  # sum(l_i^2); -1 when unknown (computed on demand)
    shard: str = ""
    row: int = -1
    step: int = -1  # the global step of a balanced epoch plan (PackedDataset(balance=...)); -1 outside one
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


def as_pack_row(item: PackRow | Mapping[str, Any]) -> PackRow:
    """Accept a PackRow or any mapping with input_ids/labels/cu_seqlens (lists or arrays)."""
    if isinstance(item, PackRow):
        return item
    try:
        return PackRow(
            input_ids=np.asarray(item["input_ids"], dtype=np.int64),
            labels=np.asarray(item["labels"], dtype=np.int64),
            cu_seqlens=np.asarray(item["cu_seqlens"], dtype=np.int64),
            pack_hash=str(item.get("pack_hash", "")),
            attn_cost=int(item.get("attn_cost", -1)),
        )
    except KeyError as err:
        raise PackFormatError(f"pack row lacks column {err}; need input_ids, labels, cu_seqlens") from None


def validate_cu_seqlens(
    cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor, total: int, max_seqlen: int | None = None
):
    """Raise PackFormatError unless `cu_seqlens` describes `total` tokens exactly.

    Rules: starts at 0, strictly increasing (no empty segment), ends at `total`, fits int32,
    and `max_seqlen` (when given) equals the longest segment.
    """
    cu = cu_seqlens.detach().cpu().numpy() if isinstance(cu_seqlens, torch.Tensor) else np.asarray(cu_seqlens)
    check_cu_seqlens(cu, total)
    steps = np.diff(cu.astype(np.int64))
    if max_seqlen is not None and int(max_seqlen) != int(steps.max()):
        raise PackFormatError(f"max_seqlen {max_seqlen} != longest segment {int(steps.max())}")


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One flattened micro-batch (batch dimension 1, no padding unless fixed shape was asked).

    `n_packs` is how many shard rows it consumed (for exact resume); padding rows count 0.
    """

    input_ids: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    cu_seqlens: torch.Tensor  # int32 [S+1]
    max_seqlen: int
    n_targets: int
    n_packs: int
    pack_hashes: tuple[str, ...] = ()  # provenance: shard rows -> sample ids via the manifest
    step: int = -1  # the balanced-plan step of its packs (never mixed), -1 outside a balanced plan
    # Schema v2, [S] each, aligned with cu_seqlens (padding segments: group -1, kind single, NaN); None for v1 packs.
    # A micro-batch is made of whole packs and a pack holds whole groups, so no pair or group is ever split.
    segment_groups: torch.Tensor | None = None  # int64: the pair's or group's id, -1 for a plain sample
    segment_kinds: torch.Tensor | None = None  # int8: packing_items.KIND_CODES
    completion_index: torch.Tensor | None = None  # int16: -1 unless a group's completion
    segment_rewards: torch.Tensor | None = None  # float64, NaN where none
    segment_advantages: torch.Tensor | None = None  # float64, NaN where none

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    # Names Hugging Face models accept for padding-free flash attention (FlashAttentionKwargs).
    @property
    def cu_seq_lens_q(self) -> torch.Tensor:
        return self.cu_seqlens

    @property
    def cu_seq_lens_k(self) -> torch.Tensor:
        return self.cu_seqlens

    @property
    def max_length_q(self) -> int:
        return self.max_seqlen

    @property
    def max_length_k(self) -> int:
        return self.max_seqlen

    def flash_kwargs(self) -> dict[str, Any]:
        """`cu_seq_lens_q/k`, `max_length_q/k`: only flash-attention backends read these (eager/SDPA ignore them)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def as_dict(self) -> dict[str, Any]:
        """Every field plus the flash names, e.g. for a Hugging Face Trainer batch."""
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

        return MicroBatch(
            move(self.input_ids),
            move(self.labels),
            move(self.position_ids),
            move(self.cu_seqlens),
            self.max_seqlen,
            self.n_targets,
            self.n_packs,
            self.pack_hashes,
            self.step,
        )


def _pad_row(row: PackRow, capacity: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(row)
    if n > capacity:
        raise PackFormatError(f"pack {row.pack_hash or row.row} has {n} tokens > capacity {capacity}; raise capacity")
    ids, labels, cu = (np.asarray(row.input_ids), np.asarray(row.labels), np.asarray(row.cu_seqlens, np.int64))
    if n == capacity:
        return ids, labels, cu
    pad = capacity - n
    return (
        np.concatenate([ids, np.full(pad, pad_id, dtype=ids.dtype)]),
        np.concatenate([labels, np.full(pad, IGNORE_INDEX, dtype=labels.dtype)]),
        np.concatenate([cu, [capacity]]),  # the padding is its own segment: nothing real attends to it
    )


def collate(
    rows: Sequence[PackRow | Mapping[str, Any]],
    *,
    capacity: int | None = None,
    pad_id: int = 0,
    n_padding_rows: int = 0,
) -> MicroBatch:
    """Concatenate pack rows into one `[1, T]` micro-batch with explicit varlen metadata.

    `capacity` pads every row to that length (fixed shape); `n_padding_rows` appends rows made
    only of padding (so the last micro-batch of an epoch keeps the same T). Raises
    PackFormatError when a row breaks the contract: bad cu_seqlens, labels/input_ids of different
    lengths, or a label that is not -100 at a segment start (a target across a boundary).
    """
    packs = [as_pack_row(r) for r in rows]
    if not packs and not n_padding_rows:
        raise PackFormatError("collate got no rows")
    ids_parts: list[np.ndarray] = []
    label_parts: list[np.ndarray] = []
    cu_parts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    segments_per_row: list[int] = []
    offset = 0
    for pack in packs:
        if len(pack.labels) != len(pack.input_ids):
            raise PackFormatError(f"pack {pack.pack_hash!r}: {len(pack.labels)} labels for {len(pack)} input_ids")
        validate_cu_seqlens(pack.cu_seqlens, len(pack))
        starts = np.asarray(pack.cu_seqlens[:-1], dtype=np.int64)
        if (np.asarray(pack.labels)[starts] != IGNORE_INDEX).any():
            raise PackFormatError(
                f"pack {pack.pack_hash!r}: a segment starts with a label other than -100, "
                "so one sample would learn to predict the next; rebuild the shards"
            )
        if capacity is None:
            ids, labels, cu = pack.input_ids, pack.labels, np.asarray(pack.cu_seqlens, dtype=np.int64)
        else:
            ids, labels, cu = _pad_row(pack, capacity, pad_id)
        ids_parts.append(np.asarray(ids, dtype=np.int64))
        label_parts.append(np.asarray(labels, dtype=np.int64))
        cu_parts.append(cu[1:] + offset)
        segments_per_row.append(len(cu) - 1)
        offset += len(ids)
    if n_padding_rows:
        if capacity is None:
            raise PackFormatError("n_padding_rows needs a capacity")
        for _ in range(n_padding_rows):
            ids_parts.append(np.full(capacity, pad_id, dtype=np.int64))
            label_parts.append(np.full(capacity, IGNORE_INDEX, dtype=np.int64))
            cu_parts.append(np.asarray([offset + capacity]))
            offset += capacity
    input_ids = np.concatenate(ids_parts)
    labels = np.concatenate(label_parts)
    cu_seqlens = np.concatenate(cu_parts)
    validate_cu_seqlens(cu_seqlens, len(input_ids))
    max_seqlen = int(np.diff(cu_seqlens).max())
    steps = {p.step for p in packs}
    segments = (
        _segment_tensors(packs, segments_per_row, len(cu_seqlens) - 1)
        if any(p.segments is not None for p in packs)
        else {}
    )
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids).unsqueeze(0),
        labels=torch.from_numpy(labels).unsqueeze(0),
        position_ids=torch.from_numpy(position_ids(cu_seqlens)).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
        max_seqlen=max_seqlen,
        n_targets=int((labels != IGNORE_INDEX).sum()),
        n_packs=len(packs),
        pack_hashes=tuple(p.pack_hash for p in packs),
        step=steps.pop() if len(steps) == 1 else -1,
        **segments,
    )


def _segment_tensors(packs: Sequence[PackRow], segments_per_row: list[int], n_segments: int) -> dict[str, torch.Tensor]:
    """The packs' per-segment columns in micro-batch order; segments collate added (padding) are plain."""
    fill = {"groups": -1, "kinds": 0, "completion_index": -1, "rewards": np.nan, "advantages": np.nan}
    dtypes = {"groups": np.int64, "kinds": np.int8, "completion_index": np.int16, "rewards": np.float64}
    dtypes["advantages"] = np.float64
    out = {name: np.full(n_segments, value, dtype=dtypes[name]) for name, value in fill.items()}
    at = 0
    for pack, row_segments in zip(packs, segments_per_row):
        n = len(pack.cu_seqlens) - 1  # a padded row has one more segment (its padding), which keeps the fill
        if pack.segments is not None:
            for name in fill:
                out[name][at : at + n] = getattr(pack.segments, name)
        at += row_segments
    return {
        "segment_groups": torch.from_numpy(out["groups"]),
        "segment_kinds": torch.from_numpy(out["kinds"]),
        "completion_index": torch.from_numpy(out["completion_index"]),
        "segment_rewards": torch.from_numpy(out["rewards"]),
        "segment_advantages": torch.from_numpy(out["advantages"]),
    }


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group consecutive packs into micro-batches of at most `token_budget` tokens.

    Order is kept (the stream is already shuffled); a pack longer than the budget is its own
    micro-batch. lengths [5, 4, 3, 6, 9], budget 8 -> [[0], [1, 2], [3], [4]].
    """
    if token_budget <= 0:
        raise PackFormatError(f"token_budget must be positive, got {token_budget}")
    plan: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > token_budget:
            plan.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        plan.append(current)
    return plan


def batch_by_tokens(
    rows: Iterable[PackRow],
    token_budget: int,
    *,
    fixed_shape: bool = False,
    capacity: int | None = None,
    pad_id: int = 0,
) -> Iterator[MicroBatch]:
    """Stream micro-batches of at most `token_budget` tokens (one pending micro-batch in memory).

    fixed_shape: every micro-batch holds exactly `token_budget // capacity` rows, each padded to
    `capacity`, and the last one is filled with padding rows, so T == that many * capacity always.
    A micro-batch never mixes packs of two balanced-plan steps (`PackRow.step`): it is closed,
    and with fixed_shape padded, where the step changes.
    """
    if fixed_shape:
        if capacity is None:
            raise PackFormatError("fixed_shape needs the shards' capacity (manifest 'capacity')")
        per_batch = token_budget // capacity
        if per_batch < 1:
            raise PackFormatError(f"token_budget {token_budget} < capacity {capacity}; raise the budget")
        pending: list[PackRow] = []
        for row in rows:
            if pending and row.step != pending[-1].step:
                yield collate(pending, capacity=capacity, pad_id=pad_id, n_padding_rows=per_batch - len(pending))
                pending = []
            pending.append(row)
            if len(pending) == per_batch:
                yield collate(pending, capacity=capacity, pad_id=pad_id)
                pending = []
        if pending:
            yield collate(pending, capacity=capacity, pad_id=pad_id, n_padding_rows=per_batch - len(pending))
        return
    if token_budget <= 0:
        raise PackFormatError(f"token_budget must be positive, got {token_budget}")
    current: list[PackRow] = []
    used = 0
    for row in rows:
        if current and (used + len(row) > token_budget or row.step != current[-1].step):
            yield collate(current)
            current, used = [], 0
        current.append(row)
        used += len(row)
    if current:
        yield collate(current)
