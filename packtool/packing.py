"""Pack planning: which samples share a row, decided from their lengths alone.

Pure functions over an int array of sample lengths; no tokens, no I/O. The pack stage gathers
the tokens afterwards. Worked example, lengths [3, 2, 4], capacity 5 (9 tokens):

    samples          0 = [a a a]   1 = [b b]   2 = [c c c c]

    bfd, longest first, each into the open pack with the least room that still fits:
        sample 2 (4)  no open pack      -> new pack 0, room 1
        sample 0 (3)  pack 0 room 1     -> new pack 1, room 2
        sample 1 (2)  pack 1 room 2     -> pack 1,     room 0

        pack 0 = [c c c c .]       PackPlan.members = [2, 0, 1]     (before shuffle=True
        pack 1 = [a a a b b]       PackPlan.offsets = [0, 1, 3]      reorders the packs)

    lower_bound = ceil(9 / 5) = 2 packs;  efficiency = 9 / (2 * 5) = 0.90
    pad (one sample per pack) = 3 packs;  efficiency = 9 / (3 * 5) = 0.60

    plan_stream at capacity 4 cuts the concatenation a a a b b c c c c into windows of 4:
        window 0 = [a a a b]   pieces (sample, start, end) = (0, 0, 3) (1, 0, 1)
        window 1 = [b c c c]   pieces                      = (1, 1, 2) (2, 0, 3)
        window 2 = [c]         pieces                      = (2, 3, 4)   last_partial = True

Strategies live in `PACKERS`. All of them plan globally over the whole array and are
deterministic; the seed only permutes the order of the finished packs.
`plan_vision` (`plan_packs` given each sample's vision patches) is bfd that places the samples
with images by their patches first, so each pack's vision work sits near the mean.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ORDER_PRESERVING",
    "PACKERS",
    "PackPlan",
    "StreamPlan",
    "efficiency",
    "lower_bound",
    "plan_packs",
    "plan_stream",
    "plan_vision",
]


@dataclass(frozen=True, slots=True)
class PackPlan:
    """Packs in CSR form: pack p holds samples `members[offsets[p]:offsets[p + 1]]`, in row order.

    lengths [3, 2, 4], capacity 5 -> members [2, 0, 1], offsets [0, 1, 3]:
    pack 0 = sample 2, pack 1 = samples 0 then 1.
    """

    members: np.ndarray  # int64 [n_samples], sample indices grouped by pack
    offsets: np.ndarray  # int64 [n_packs + 1]

    def __post_init__(self) -> None:
        if self.members.ndim != 1 or self.offsets.ndim != 1 or self.offsets.size == 0:
            raise ValueError("PackPlan needs 1-D members and a non-empty 1-D offsets array")
        if self.offsets[0] != 0 or self.offsets[-1] != self.members.size:
            raise ValueError(
                f"offsets must run from 0 to {self.members.size}, got {self.offsets[0]}..{self.offsets[-1]}"
            )
        if np.any(np.diff(self.offsets) <= 0):
            raise ValueError("offsets must be strictly increasing: a pack cannot be empty")

    @property
    def n_packs(self) -> int:
        return self.offsets.size - 1

    def pack(self, p: int) -> np.ndarray:
        """Sample indices of pack p, in row order."""
        return self.members[self.offsets[p] : self.offsets[p + 1]]

    def segments(self) -> np.ndarray:
        """Samples per pack."""
        return np.diff(self.offsets)

    def pack_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """Tokens per pack."""
        if self.n_packs == 0:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(np.asarray(lengths, dtype=np.int64)[self.members], self.offsets[:-1])

    def validate(self, lengths: np.ndarray, capacity: int, max_segments: int | None = None) -> None:
        """Raise ValueError unless every sample sits in exactly one pack and no pack is over a limit."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n = lengths.size
        if self.members.size and (self.members.min() < 0 or self.members.max() >= n):
            raise ValueError(f"plan refers to samples outside 0..{n - 1}")
        seen = np.bincount(self.members, minlength=n)
        if np.any(seen != 1):
            i = int(np.flatnonzero(seen != 1)[0])
            raise ValueError(f"sample {i} appears in {seen[i]} packs; every sample must be in exactly one")
        loads = self.pack_lengths(lengths)
        if np.any(loads > capacity):
            p = int(np.flatnonzero(loads > capacity)[0])
            raise ValueError(f"pack {p}: {loads[p]} tokens > capacity {capacity}")
        if max_segments is not None:
            segments = self.segments()
            if np.any(segments > max_segments):
                p = int(np.flatnonzero(segments > max_segments)[0])
                raise ValueError(f"pack {p}: {segments[p]} samples > max_segments {max_segments}")


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """Windows of exactly `capacity` tokens cut from the documents concatenated in order.

    Piece j is tokens `[starts[j], ends[j])` of sample `samples[j]`; window w holds pieces
    `offsets[w]:offsets[w + 1]`. Only the last window may be shorter (`last_partial`).
    """

    samples: np.ndarray  # int64 [n_pieces]
    starts: np.ndarray  # int64 [n_pieces], token offset inside the sample
    ends: np.ndarray  # int64 [n_pieces], exclusive
    offsets: np.ndarray  # int64 [n_windows + 1]
    last_partial: bool

    @property
    def n_windows(self) -> int:
        return self.offsets.size - 1

    def window_lengths(self) -> np.ndarray:
        if self.n_windows == 0:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.ends - self.starts, self.offsets[:-1])

    def validate(self, lengths: np.ndarray, capacity: int) -> None:
        """Raise ValueError unless the pieces cover every token once, in order, in full windows."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            if self.samples.size:
                raise ValueError("stream of no samples has pieces")
            return
        if np.any(self.ends <= self.starts):
            raise ValueError("every piece must hold at least one token")
        # Walking the pieces in order must step through each sample from token 0 to its end.
        same = self.samples[1:] == self.samples[:-1]
        contiguous = np.where(same, self.starts[1:] == self.ends[:-1], self.starts[1:] == 0)
        finished = same | (self.ends[:-1] == lengths[self.samples[:-1]])
        next_sample = same | (self.samples[1:] == self.samples[:-1] + 1)
        if not (contiguous.all() and finished.all() and next_sample.all()):
            j = int(np.flatnonzero(~(contiguous & finished & next_sample))[0])
            raise ValueError(f"pieces {j} and {j + 1} do not continue the stream")
        if self.samples[0] != 0 or self.starts[0] != 0:
            raise ValueError("stream must start at token 0 of sample 0")
        if self.samples[-1] != lengths.size - 1 or self.ends[-1] != lengths[-1]:
            raise ValueError("stream must end at the last token of the last sample")
        sizes = self.window_lengths()
        if np.any(sizes[:-1] != capacity) or sizes[-1] > capacity:
            raise ValueError(f"every window but the last must hold exactly {capacity} tokens")
        if self.last_partial != bool(sizes[-1] < capacity):
            raise ValueError("last_partial does not match the last window")


Packer = Callable[[np.ndarray, int, int | None], PackPlan]


def plan_packs(
    lengths: np.ndarray | Iterable[int],
    capacity: int,
    strategy: str = "bfd",
    *,
    seed: int = 0,
    max_segments: int | None = None,
    shuffle: bool = True,
    patches: np.ndarray | None = None,
) -> PackPlan:
    """Assign every sample to one pack of at most `capacity` tokens and `max_segments` samples.

    `shuffle` permutes the finished packs with `seed` so that the long-first order of the
    decreasing strategies does not put all the full packs at the start of an epoch; the
    contents of each pack do not depend on the seed. `sequential` never shuffles: its order
    is the point. `patches` (the vision patches of each sample) plans with `plan_vision`
    instead, evening them out across the packs; `sequential` and `pad` keep their own rule.
    """
    lengths = _checked(lengths, capacity)
    if max_segments is not None and max_segments < 1:
        raise ValueError(f"max_segments must be at least 1, got {max_segments}")
    if strategy not in PACKERS:
        raise ValueError(f"unknown packing strategy {strategy!r}; choose one of {', '.join(PACKERS)}")
    if patches is not None and strategy in BALANCEABLE:
        plan = plan_vision(lengths, patches, capacity, max_segments)
    else:
        plan = PACKERS[strategy](lengths, capacity, max_segments)
    return _shuffled(plan, seed) if shuffle and strategy not in ORDER_PRESERVING else plan


def plan_groups(
    lengths: np.ndarray | Iterable[int],
    groups: np.ndarray | Iterable[str],
    capacity: int,
    strategy: str = "bfd",
    *,
    seed: int = 0,
    max_segments: int | None = None,
    shuffle: bool = True,
    patches: np.ndarray | None = None,
) -> PackPlan:
    """`plan_packs` per group, so that no pack mixes groups; then one seeded shuffle over all packs.

    lengths [5, 3, 4, 2], groups [a, b, a, b], capacity 9 -> packs {0, 2} and {1, 3}
    """
    lengths = np.asarray(lengths)
    groups = np.asarray(groups)
    members = [np.zeros(0, dtype=np.int64)]
    sizes = [np.zeros(0, dtype=np.int64)]
    for group in np.unique(groups):
        index = np.flatnonzero(groups == group)
        mine = None if patches is None else patches[index]
        plan = plan_packs(lengths[index], capacity, strategy, max_segments=max_segments, shuffle=False, patches=mine)
        members.append(index[plan.members])
        sizes.append(plan.segments())
    offsets = np.zeros(sum(len(s) for s in sizes) + 1, dtype=np.int64)
    np.cumsum(np.concatenate(sizes), out=offsets[1:])
    combined = PackPlan(members=np.concatenate(members), offsets=offsets)
    return _shuffled(combined, seed) if shuffle and strategy not in ORDER_PRESERVING else combined


def plan_vision(
    lengths: np.ndarray,
    patches: np.ndarray,
    capacity: int,
    max_segments: int | None = None,
) -> PackPlan:
    """Packs whose vision patches sit near their mean, at about the token efficiency of `bfd`.

    A pack's tokens are what packing fills; the vision tower's work is its patches (t * h * w of each
    image), which token-filled packs spread several-fold. Here the documents with images go first, most
    patches first, each to the pack with the fewest patches so far that still has the tokens and a segment
    for it (longest processing time first over `bfd`'s pack count: a new pack only when none has room);
    then the documents without images fill the room left by best fit, longest first, as `bfd` does.

        lengths [4, 4, 4, 4], patches [8, 8, 0, 0], capacity 8: bfd's 2 packs
        images   sample 0 (8) -> pack 0 (0 patches)     sample 1 (8) -> pack 1 (0 patches)
        text     sample 2 -> pack 0, sample 3 -> pack 1          packs {0, 2} {1, 3}: 8 and 8 patches
        (bfd alone: {0, 1} {2, 3}, 16 and 0)

    Deterministic: equal patches are taken by sample index, equal packs by pack index.
    `_vision_reference` is the same rule one sample at a time.
    """
    lengths = _checked(lengths, capacity)
    patches = _checked_patches(patches, lengths)
    if lengths.size == 0:
        return _best_fit_decreasing(lengths, capacity, max_segments)
    target = _best_fit_decreasing(lengths, capacity, max_segments).n_packs
    pictured = np.flatnonzero(patches > 0)
    pictured = pictured[np.lexsort((pictured, -patches[pictured]))]
    most = pictured.size + target
    load = np.zeros(most, dtype=np.int64)
    held = np.zeros(most, dtype=np.int64)
    limit = max_segments if max_segments is not None else lengths.size + 1
    packs = _LightestByRoom(capacity, most)
    for p in range(target):
        packs.push(capacity, 0, p)
    n_packs = target
    pack_of = np.empty(pictured.size, dtype=np.int64)
    for k, (sample, length) in enumerate(zip(pictured.tolist(), lengths[pictured].tolist())):
        found = packs.lightest(length)
        if found is None:
            chosen, work = n_packs, 0
            n_packs += 1
        else:
            work, chosen = found
            packs.pop(capacity - int(load[chosen]))
        pack_of[k] = chosen
        load[chosen] += length
        held[chosen] += 1
        if load[chosen] < capacity and held[chosen] < limit:
            packs.push(capacity - int(load[chosen]), work + int(patches[sample]), chosen)
    plain = np.flatnonzero(patches == 0)
    order, plain_pack, n_packs = _best_fit_into(lengths[plain], capacity, max_segments, load[:n_packs], held[:n_packs])
    return _grouped(np.concatenate([pictured, plain[order]]), np.concatenate([pack_of, plain_pack]), n_packs)


class _LightestByRoom:
    """Open packs by the room they have left, for "the pack with the fewest patches that has room for this".

    Each room value keeps a heap of its packs keyed patches * n + pack (fewest patches, then lowest index);
    a segment tree over the room values holds the least key of each range, so the lightest pack with at
    least `length` free is one query of O(log capacity), whatever the number of packs.
    """

    def __init__(self, capacity: int, n: int) -> None:
        self.n = n  # more than any pack index: the key's low part
        self.leaves = 1 << (capacity + 1).bit_length()
        self.none = float("inf")
        self.tree: list[float] = [self.none] * (2 * self.leaves)
        self.heaps: dict[int, list[int]] = {}
        self.capacity = capacity

    def push(self, room: int, patches: int, pack: int) -> None:
        heap = self.heaps.setdefault(room, [])
        heapq.heappush(heap, patches * self.n + pack)
        self._update(room)

    def pop(self, room: int) -> None:
        """Drop the lightest pack of `room` (the one `lightest` gave)."""
        heapq.heappop(self.heaps[room])
        self._update(room)

    def lightest(self, length: int) -> tuple[int, int] | None:
        """(patches, pack) of the lightest pack with at least `length` free, or None."""
        best = self.none
        low, high = length + self.leaves, self.capacity + self.leaves + 1
        while low < high:
            if low & 1:
                best = min(best, self.tree[low])
                low += 1
            if high & 1:
                high -= 1
                best = min(best, self.tree[high])
            low >>= 1
            high >>= 1
        if best == self.none:
            return None
        patches, pack = divmod(int(best), self.n)
        return patches, pack

    def _update(self, room: int) -> None:
        heap = self.heaps[room]
        i = room + self.leaves
        self.tree[i] = heap[0] if heap else self.none
        i >>= 1
        while i:
            self.tree[i] = min(self.tree[2 * i], self.tree[2 * i + 1])
            i >>= 1


def _vision_reference(lengths: np.ndarray, patches: np.ndarray, capacity: int, max_segments: int | None) -> PackPlan:
    """`plan_vision` one sample at a time over plain lists: the rule the fast path is held to."""
    lengths = np.asarray(lengths, dtype=np.int64)
    patches = np.asarray(patches, dtype=np.int64)
    target = _best_fit_decreasing(lengths, capacity, max_segments).n_packs
    limit = max_segments if max_segments is not None else lengths.size + 1
    load, work = [0] * target, [0] * target
    members: list[list[int]] = [[] for _ in range(target)]

    def place(sample: int, preference: Callable[[int], tuple[int, ...]]) -> None:
        fitting = [p for p in range(len(load)) if load[p] + lengths[sample] <= capacity and len(members[p]) < limit]
        chosen = min(fitting, key=preference) if fitting else len(load)
        if chosen == len(load):
            load.append(0)
            work.append(0)
            members.append([])
        load[chosen] += int(lengths[sample])
        work[chosen] += int(patches[sample])
        members[chosen].append(sample)

    for sample in sorted(np.flatnonzero(patches > 0).tolist(), key=lambda i: (-patches[i], i)):
        place(sample, lambda p: (work[p], p))  # the lightest pack
    for sample in sorted(np.flatnonzero(patches == 0).tolist(), key=lambda i: (-lengths[i], i)):
        place(sample, lambda p: (capacity - load[p], len(members[p]), p))  # the best fit
    offsets = np.zeros(len(members) + 1, dtype=np.int64)
    np.cumsum([len(m) for m in members], out=offsets[1:])
    return PackPlan(members=np.asarray([s for m in members for s in m], dtype=np.int64), offsets=offsets)


def _checked_patches(patches: np.ndarray | Iterable[int], lengths: np.ndarray) -> np.ndarray:
    array = np.asarray(patches if isinstance(patches, np.ndarray) else list(patches), dtype=np.int64)
    if array.shape != lengths.shape:
        raise ValueError(f"{array.size} patch counts for {lengths.size} samples")
    if array.size and array.min() < 0:
        raise ValueError(f"sample {int(np.argmin(array))}: negative patches {int(array.min())}")
    return array


def plan_stream(lengths: np.ndarray | Iterable[int], capacity: int) -> StreamPlan:
    """Concatenate the samples in order and cut windows of exactly `capacity` tokens."""
    lengths = _checked(lengths, capacity, allow_long=True)
    doc_ends = np.cumsum(lengths)
    doc_starts = doc_ends - lengths
    total = int(doc_ends[-1]) if lengths.size else 0
    # A document is cut once for every window boundary strictly inside it.
    pieces = 1 + (doc_ends - 1) // capacity - doc_starts // capacity
    samples = np.repeat(np.arange(lengths.size, dtype=np.int64), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(samples.size, dtype=np.int64) - np.repeat(first, pieces)
    starts = np.where(k == 0, doc_starts[samples], (doc_starts[samples] // capacity + k) * capacity)
    ends = np.append(starts[1:], total)
    n_windows = -(-total // capacity)
    offsets = np.searchsorted(starts // capacity, np.arange(n_windows + 1), side="left").astype(np.int64)
    return StreamPlan(
        samples=samples,
        starts=starts - doc_starts[samples],
        ends=ends - doc_starts[samples],
        offsets=offsets,
        last_partial=total % capacity != 0,
    )


def lower_bound(lengths: np.ndarray | Iterable[int], capacity: int) -> int:
    """ceil(sum(lengths) / capacity): no plan can use fewer packs."""
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return -(-total // capacity)


def efficiency(lengths: np.ndarray | Iterable[int], plan: PackPlan, capacity: int) -> float:
    """Share of the plan's token slots that hold a token (1.0 = no padding)."""
    if plan.n_packs == 0:
        return 1.0
    return int(np.asarray(lengths, dtype=np.int64).sum()) / (plan.n_packs * capacity)


def _checked(lengths: np.ndarray | Iterable[int], capacity: int, *, allow_long: bool = False) -> np.ndarray:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
    array = np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths))
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D integer array, got shape {array.shape} of {array.dtype}")
    array = array.astype(np.int64, copy=False)
    # An empty sample would make two equal cu_seqlens entries, which varlen kernels reject.
    short = np.flatnonzero(array < 1)
    if short.size:
        i = int(short[0])
        raise ValueError(f"sample {i}: length {array[i]}; every sample needs at least one token (drop it first)")
    if not allow_long:
        long = np.flatnonzero(array > capacity)
        if long.size:
            i = int(long[0])
            more = f" ({long.size - 1} more)" if long.size > 1 else ""
            raise ValueError(
                f"sample {i}: {array[i]} tokens > capacity {capacity}{more}; truncate before planning or raise capacity"
            )
    return array


def _longest_first(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, list[int], list[int]]:
    """Sample order (longest first, ties by index) and the distinct lengths with their counts."""
    key = capacity - lengths
    # numpy sorts 16-bit keys with a radix sort, ~5x faster than its comparison sort at 1M.
    if capacity < 2**16:
        key = key.astype(np.uint16)
    order = np.argsort(key, kind="stable")
    counts = np.bincount(lengths, minlength=capacity + 1)
    values = np.flatnonzero(counts)[::-1]
    return order, values.tolist(), counts[values].tolist()


def _grouped(order: np.ndarray, pack_of: np.ndarray, n_packs: int) -> PackPlan:
    """PackPlan from the pack of each sample in `order`; a pack keeps the order its samples arrived in."""
    by_pack = np.argsort(pack_of, kind="stable")
    offsets = np.zeros(n_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(pack_of, minlength=n_packs), out=offsets[1:])
    return PackPlan(members=order[by_pack].astype(np.int64, copy=False), offsets=offsets)


def _shuffled(plan: PackPlan, seed: int) -> PackPlan:
    return reordered(plan, np.random.default_rng(seed).permutation(plan.n_packs))


def reordered(plan: PackPlan, perm: np.ndarray) -> PackPlan:
    """The same packs, pack perm[i] moved to position i."""
    sizes = plan.segments()[perm]
    offsets = np.zeros(plan.n_packs + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    shift = np.repeat(plan.offsets[:-1][perm] - offsets[:-1], sizes)
    return PackPlan(members=plan.members[np.arange(plan.members.size) + shift], offsets=offsets)


class _OpenPacks:
    """Open packs bucketed by (free tokens, samples held); packs in one bucket are interchangeable.

    The histogram packers move whole buckets at a time instead of single samples, so their
    cost grows with the number of distinct lengths (<= capacity), not with N. Segment counts
    are only kept when max_segments is set; otherwise every pack sits under segment key 0.
    """

    def __init__(self, capacity: int, max_segments: int | None, shortest: int) -> None:
        self.capacity = capacity
        self.max_segments = max_segments
        # A pack with less room than the shortest sample can never grow again: drop it.
        self.shortest = shortest
        self.buckets: list[dict[int, list[int]]] = [{} for _ in range(capacity + 1)]
        self.count = np.zeros(capacity + 1, dtype=np.int64)
        self.n_packs = 0

    def fits(self, free: int, segments: int, length: int) -> int:
        """How many samples of `length` a pack in this bucket can still take."""
        q = free // length
        return q if self.max_segments is None else min(q, self.max_segments - segments)

    def put(self, free: int, segments: int, packs: list[int]) -> None:
        if free < self.shortest or (self.max_segments is not None and segments >= self.max_segments):
            return
        key = segments if self.max_segments is not None else 0
        self.buckets[free].setdefault(key, []).extend(packs)
        self.count[free] += len(packs)

    def take(self, free: int, segments: int, n: int) -> list[int]:
        bucket = self.buckets[free][segments]
        packs = bucket[-n:]
        del bucket[-n:]
        if not bucket:
            del self.buckets[free][segments]
        self.count[free] -= n
        return packs

    def open_new(self, length: int, n: int, out: np.ndarray, pos: int) -> None:
        """Open packs for n samples of `length`; each new pack takes as many as fit."""
        per_pack = self.capacity // length
        if self.max_segments is not None:
            per_pack = min(per_pack, self.max_segments)
        full, rest = divmod(n, per_pack)
        first = self.n_packs
        out[pos : pos + full * per_pack] = np.repeat(np.arange(first, first + full), per_pack)
        self.put(self.capacity - per_pack * length, per_pack, list(range(first, first + full)))
        self.n_packs += full
        if rest:
            out[pos + full * per_pack : pos + n] = self.n_packs
            self.put(self.capacity - rest * length, rest, [self.n_packs])
            self.n_packs += 1


def _best_fit_decreasing(lengths: np.ndarray, capacity: int, max_segments: int | None) -> PackPlan:
    """Exact best-fit decreasing, run on the length histogram (`_best_fit_into` with no pack open)."""
    none = np.zeros(0, dtype=np.int64)
    return _grouped(*_best_fit_into(lengths, capacity, max_segments, none, none))


def _best_fit_into(
    lengths: np.ndarray, capacity: int, max_segments: int | None, load: np.ndarray, held: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """(sample order, pack of each sample in that order, packs in all) of best-fit decreasing into packs
    0..len(load)-1, already holding `load` tokens in `held` samples, and new packs after them.

    Scanning free space upward from `length`, the first bucket is the best fit for the next
    sample, and a pack stays the best fit until it has less than `length` left (or no segment
    left), so each pack in the bucket takes q samples in a row. Packs leaving a bucket land
    below `length` (or are full), so the upward scan never meets them again.
    """
    order, values, counts = _longest_first(lengths, capacity)
    pack_of = np.empty(lengths.size, dtype=np.int64)
    packs = _OpenPacks(capacity, max_segments, values[-1] if values else 0)
    packs.n_packs = load.size
    room = capacity - load
    by_state = np.lexsort((held, room))
    edges = np.flatnonzero(np.diff(room[by_state]) | np.diff(held[by_state])) + 1
    for same in np.split(by_state, edges) if by_state.size else []:
        packs.put(int(room[same[0]]), int(held[same[0]]), same.tolist())
    pos = 0
    for length, left in zip(values, counts, strict=True):
        for free in (np.flatnonzero(packs.count[length:]) + length).tolist():
            # Among equally full packs, the one with the fewest samples keeps the most options.
            for segments in sorted(packs.buckets[free]):
                q = packs.fits(free, segments, length)
                size = len(packs.buckets[free][segments])
                whole = min(size, left // q)
                if whole:
                    taken = packs.take(free, segments, whole)
                    pack_of[pos : pos + whole * q] = np.repeat(taken, q)
                    pos += whole * q
                    left -= whole * q
                    packs.put(free - q * length, segments + q, taken)
                if left and whole < size:
                    # Fewer than q samples left: one pack takes them all.
                    (last,) = packs.take(free, segments, 1)
                    pack_of[pos : pos + left] = last
                    packs.put(free - left * length, segments + left, [last])
                    pos += left
                    left = 0
                if not left:
                    break
            if not left:
                break
        if left:
            packs.open_new(length, left, pack_of, pos)
            pos += left
    return order, pack_of, packs.n_packs


def _worst_fit_decreasing(lengths: np.ndarray, capacity: int, max_segments: int | None) -> PackPlan:
    """Shortest-pack-first histogram packing (Krell et al. 2021): each sample, longest first,
    goes to the open pack with the most room.

    One sample per pack per visit; the visited packs drop to `free - length` and are visited
    again when that is still the most room. Unlike the paper, a new pack keeps taking the
    same length while it is the emptiest pack, which is what worst-fit means and avoids a
    pack per sample when many short samples arrive at once.
    """
    order, values, counts = _longest_first(lengths, capacity)
    pack_of = np.empty(lengths.size, dtype=np.int64)
    packs = _OpenPacks(capacity, max_segments, values[-1] if values else 0)
    pos = 0
    for length, left in zip(values, counts, strict=True):
        heap = [-f for f in (np.flatnonzero(packs.count[length:]) + length).tolist()]
        heapq.heapify(heap)
        while left and heap:
            free = -heapq.heappop(heap)
            lower = free - length
            for segments in sorted(packs.buckets[free]):
                was_empty = packs.count[lower] == 0
                taken = packs.take(free, segments, min(len(packs.buckets[free][segments]), left))
                pack_of[pos : pos + len(taken)] = taken
                pos += len(taken)
                left -= len(taken)
                packs.put(lower, segments + 1, taken)
                if lower >= length and was_empty and packs.count[lower]:
                    heapq.heappush(heap, -lower)
                if not left:
                    break
        if left:
            packs.open_new(length, left, pack_of, pos)
            pos += left
    return _grouped(order, pack_of, packs.n_packs)


def _first_fit_decreasing(lengths: np.ndarray, capacity: int, max_segments: int | None) -> PackPlan:
    """Exact first-fit decreasing: per distinct length, the open packs in opening order each
    take as many samples as fit, until the group is placed (one numpy pass per length)."""
    order, values, counts = _longest_first(lengths, capacity)
    pack_of = np.empty(lengths.size, dtype=np.int64)
    free = np.empty(lengths.size, dtype=np.int64)
    segments = np.zeros(lengths.size, dtype=np.int64)
    n_packs = 0
    pos = 0
    for length, left in zip(values, counts, strict=True):
        candidates = np.flatnonzero(free[:n_packs] >= length)
        if max_segments is not None:
            candidates = candidates[segments[candidates] < max_segments]
        room = free[candidates] // length
        if max_segments is not None:
            room = np.minimum(room, max_segments - segments[candidates])
        reach = np.cumsum(room)
        used = int(np.searchsorted(reach, left))
        if used < candidates.size:
            candidates = candidates[: used + 1]
            room = room[: used + 1]
            room[-1] -= reach[used] - left
        placed = int(room.sum())
        pack_of[pos : pos + placed] = np.repeat(candidates, room)
        free[candidates] -= room * length
        segments[candidates] += room
        pos += placed
        left -= placed
        if left:
            per_pack = capacity // length if max_segments is None else min(capacity // length, max_segments)
            n_new = -(-left // per_pack)
            takes = np.full(n_new, per_pack, dtype=np.int64)
            takes[-1] = left - per_pack * (n_new - 1)
            new = np.arange(n_packs, n_packs + n_new)
            pack_of[pos : pos + left] = np.repeat(new, takes)
            free[new] = capacity - takes * length
            segments[new] = takes
            n_packs += n_new
            pos += left
    return _grouped(order, pack_of, n_packs)


def _next_fit(lengths: np.ndarray, capacity: int, max_segments: int | None) -> PackPlan:
    """Samples in their given order; a new pack starts when the next one does not fit."""
    ends = np.cumsum(lengths)
    bounds = [0]
    start = 0
    # One binary search per pack, not one Python step per sample.
    while start < lengths.size:
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + capacity, side="right"))
        if max_segments is not None:
            stop = min(stop, start + max_segments)
        bounds.append(stop)
        start = stop
    return PackPlan(members=np.arange(lengths.size, dtype=np.int64), offsets=np.asarray(bounds, dtype=np.int64))


def _one_per_pack(lengths: np.ndarray, capacity: int, max_segments: int | None) -> PackPlan:
    """The padded baseline: every sample alone in its row."""
    return PackPlan(
        members=np.arange(lengths.size, dtype=np.int64), offsets=np.arange(lengths.size + 1, dtype=np.int64)
    )


PACKERS: dict[str, Packer] = {
    "bfd": _best_fit_decreasing,
    "ffd": _first_fit_decreasing,
    "histogram": _worst_fit_decreasing,
    "sequential": _next_fit,
    "pad": _one_per_pack,
}
# Strategies whose pack order carries meaning (a curriculum), so plan_packs never shuffles it.
ORDER_PRESERVING = frozenset({"sequential"})
# Strategies that fill packs by tokens, which plan_vision replaces when vision work is balanced.
BALANCEABLE = frozenset({"bfd", "ffd", "histogram"})
