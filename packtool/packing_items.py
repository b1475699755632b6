"""Planning items made of several segments that must share one pack (preference pairs, completion groups).

An item is a run of consecutive segments: item i holds segments `item_offsets[i]:item_offsets[i + 1]`
(a plain sample is an item of one segment). The planner places each item as one unit of its
total length with `packing.plan_packs`, then expands the item plan to segment order, so the
segments of an item stay contiguous, in order, in one pack. Worked example, capacity 10:

    segments       0:4  1:3 | 2:5 | 3:2  4:2  5:2        (lengths; | separates items)
    item_offsets   [0, 2, 3, 6]          item lengths [7, 5, 6]

    bfd on items   pack 0 = item 0 (7)     room 3
                   pack 1 = item 2 (6)     room 4      item 1 (5) fits neither -> pack 2
                   items.members    [0, 2, 1]     items.offsets    [0, 1, 2, 3]   (before the shuffle)
                   segments.members [0, 1, 3, 4, 5, 2]   segments.offsets [0, 2, 5, 6]

`max_segments` counts segments, not items: the planner allows `max_segments // s` items per
pack, s being the largest item, which is exact when every item has the same size (a pure DPO
build: s = 2) and safe otherwise.

`KIND_CODES` are the per-segment kinds of shard schema v2 (docs/pairs.md); the loader pairs
chosen and rejected segments of one group by them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from packtool.format import KIND_CODES
from packtool.packing import PackPlan, plan_groups, plan_packs


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """The same packs twice: as item indices and as segment indices (what the emitter writes)."""

    items: PackPlan
    segments: PackPlan


def item_lengths(segment_lengths: np.ndarray | Iterable[int], item_offsets: np.ndarray | Iterable[int]) -> np.ndarray:
    """Total tokens of each item: [4, 3, 5, 2, 2, 2] with offsets [0, 2, 3, 6] -> [7, 5, 6]."""
    lengths = _array(segment_lengths)
    offsets = _checked_offsets(item_offsets, lengths.size)
    if offsets.size == 1:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(lengths.astype(np.int64), offsets[:-1])


def plan_items(
    segment_lengths: np.ndarray | Iterable[int],
    item_offsets: np.ndarray | Iterable[int],
    capacity: int,
    strategy: str = "bfd",
    *,
    seed: int = 0,
    max_segments: int | None = None,
    shuffle: bool = True,
    groups: np.ndarray | Iterable[str] | None = None,
) -> ItemPlan:
    """Pack items whole: `plan_packs` over item lengths, expanded to segments (see the module docstring).

    `groups` (one label per item, e.g. its source for `group_by: source`) plans each group apart
    with `plan_groups`, so no pack mixes groups. An item longer than `capacity` must be truncated
    or dropped first (truncate.truncate_item); the planner raises ValueError naming it otherwise.
    """
    lengths = _array(segment_lengths)
    offsets = _checked_offsets(item_offsets, lengths.size)
    sizes = np.diff(offsets)
    per_pack = None
    if max_segments is not None and sizes.size:
        largest = int(sizes.max())
        if largest > max_segments:
            i = int(np.argmax(sizes))
            raise ValueError(f"item {i} has {largest} segments > max_segments {max_segments}; raise max_segments")
        per_pack = max_segments // largest
    totals = item_lengths(lengths, offsets)
    if groups is None:
        items = plan_packs(totals, capacity, strategy, seed=seed, max_segments=per_pack, shuffle=shuffle)
    else:
        items = plan_groups(totals, groups, capacity, strategy, seed=seed, max_segments=per_pack, shuffle=shuffle)
    return ItemPlan(items=items, segments=_expanded(items, offsets))


def validate_item_plan(
    plan: ItemPlan,
    segment_lengths: np.ndarray | Iterable[int],
    item_offsets: np.ndarray | Iterable[int],
    capacity: int,
    max_segments: int | None = None,
) -> None:
    """Raise ValueError unless every segment is in one pack exactly once, packs respect both limits,
    and each item's segments sit together, in order, in the pack of that item."""
    lengths = _array(segment_lengths)
    offsets = _checked_offsets(item_offsets, lengths.size)
    plan.segments.validate(lengths, capacity, max_segments)
    plan.items.validate(item_lengths(lengths, offsets), capacity)
    where = np.empty(lengths.size, dtype=np.int64)
    where[plan.segments.members] = np.arange(lengths.size)
    item_of = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    same = item_of[1:] == item_of[:-1]
    broken = same & (where[1:] != where[:-1] + 1)
    if broken.any():
        raise ValueError(f"item {item_of[int(np.argmax(broken))]}: its segments are not contiguous and in order")
    segment_pack = np.repeat(np.arange(plan.segments.n_packs), plan.segments.segments())[where[offsets[:-1]]]
    item_pack = np.empty(offsets.size - 1, dtype=np.int64)
    item_pack[plan.items.members] = np.repeat(np.arange(plan.items.n_packs), plan.items.segments())
    if np.any(segment_pack != item_pack):
        raise ValueError(f"item {int(np.argmax(segment_pack != item_pack))}: its segments are not in the item's pack")


def _expanded(items: PackPlan, offsets: np.ndarray) -> PackPlan:
    """Item packs -> segment packs: each item replaced by its segment indices, in order."""
    counts = np.diff(offsets)[items.members]
    total = int(counts.sum())
    # Segment t of the expansion is item_start + (t - first position of that item in the expansion).
    first = np.cumsum(counts) - counts
    members = np.repeat(offsets[:-1][items.members] - first, counts) + np.arange(total, dtype=np.int64)
    seg_offsets = np.zeros(items.n_packs + 1, dtype=np.int64)
    if items.n_packs:
        np.cumsum(np.add.reduceat(counts, items.offsets[:-1]), out=seg_offsets[1:])
    return PackPlan(members=members.astype(np.int64), offsets=seg_offsets)


def _checked_offsets(item_offsets: np.ndarray | Iterable[int], n_segments: int) -> np.ndarray:
    offsets = _array(item_offsets).astype(np.int64)
    if offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0 or offsets[-1] != n_segments:
        raise ValueError(f"item_offsets must run from 0 to {n_segments} (the number of segments)")
    if np.any(np.diff(offsets) <= 0):
        raise ValueError("item_offsets must be strictly increasing: an item has at least one segment")
    return offsets


def _array(values: np.ndarray | Iterable[int] | Iterable[str]) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else np.asarray(list(values))


# -- per-segment columns of shard schema v2 ----------------------------------------------------------


def segment_columns(
    item_offsets: np.ndarray | Iterable[int], item_types: np.ndarray | Iterable[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group id, kind, completion index) of every segment, in segment index order.

    `item_types[i]` is "single", "pair" or "group"; the group id of item i is i (-1 for a single),
    so ids are unique across the build when the offsets cover the whole build. Index the arrays
    with `plan.segments.members` to get them in pack order.

        offsets [0, 1, 3, 6], types [single, pair, group]
        -> groups [-1, 1, 1, 2, 2, 2], kinds [0, 1, 2, 3, 3, 3], completion_index [-1, -1, -1, 0, 1, 2]
    """
    types = _array(item_types)
    offsets = _checked_offsets(item_offsets, int(_array(item_offsets)[-1]))
    sizes = np.diff(offsets)
    if types.shape != sizes.shape:
        raise ValueError(f"{types.size} item types for {sizes.size} items")
    unknown = sorted(set(types.tolist()) - {"single", "pair", "group"})
    if unknown:
        raise ValueError(f"unknown item type {unknown[0]!r}; expected single, pair or group")
    wrong = ((types == "single") & (sizes != 1)) | ((types == "pair") & (sizes != 2))
    if wrong.any():
        i = int(np.argmax(wrong))
        raise ValueError(f"item {i} is a {types[i]} of {sizes[i]} segments")
    item_of = np.repeat(np.arange(sizes.size), sizes)
    rank = np.arange(item_of.size) - offsets[:-1][item_of]  # position of the segment inside its item
    is_pair, is_group = types[item_of] == "pair", types[item_of] == "group"
    kinds = np.select(
        [is_pair & (rank == 0), is_pair, is_group],
        [KIND_CODES["chosen"], KIND_CODES["rejected"], KIND_CODES["completion"]],
        KIND_CODES["single"],
    ).astype(np.int8)
    groups = np.where(is_pair | is_group, item_of, -1).astype(np.int64)
    completion = np.where(is_group, rank, -1).astype(np.int16)
    return groups, kinds, completion


def validate_pack_groups(
    input_ids: np.ndarray,
    labels: np.ndarray,
    cu_seqlens: np.ndarray,
    groups: np.ndarray,
    kinds: np.ndarray,
    completion_index: np.ndarray,
) -> None:
    """Raise ValueError unless one pack's v2 columns describe whole, well-formed groups (what verify checks).

    Per segment: a target (a label other than -100); per group: its segments contiguous, one
    kind (a pair: exactly chosen then rejected; a group: completions 0..k-1 in order), and the
    same tokens before the first target in every segment (the shared prompt).
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    groups, kinds, completion = (np.asarray(x) for x in (groups, kinds, completion_index))
    n = cu.size - 1
    if not groups.size == kinds.size == completion.size == n:
        raise ValueError(f"{n} segments but {groups.size} group ids, {kinds.size} kinds, {completion.size} indices")
    labels = np.asarray(labels)
    for g in np.unique(groups[groups >= 0]):
        members = np.flatnonzero(groups == g)
        if np.any(np.diff(members) != 1):
            raise ValueError(f"group {g}: segments {members.tolist()} are not contiguous")
        kind = kinds[members].tolist()
        pair = [KIND_CODES["chosen"], KIND_CODES["rejected"]]
        completions = [KIND_CODES["completion"]] * members.size
        if kind != pair and (kind != completions or completion[members].tolist() != list(range(members.size))):
            raise ValueError(
                f"group {g}: kinds {kind} / indices {completion[members].tolist()} are not a pair or a group"
            )
        prompts = []
        for s in members:
            targets = np.flatnonzero(labels[cu[s] : cu[s + 1]] != -100)
            if targets.size == 0:
                raise ValueError(f"group {g}: segment {s} has no target")
            prompts.append(np.asarray(input_ids)[cu[s] : cu[s] + targets[0]].tolist())
        if any(p != prompts[0] for p in prompts):
            raise ValueError(f"group {g}: its segments do not share the same prompt tokens")
    singles = groups < 0
    if np.any(kinds[singles] != KIND_CODES["single"]):
        raise ValueError("a segment outside any group must have kind single")
