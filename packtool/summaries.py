"""Summary statistics of an output, computed from the shards themselves (plus the manifest's accounting).

Both sides use them: the builder writes `summarize` and `length_summary` into the manifest and checks its
interleaved order with `window_mix`; `packtool stats`, `report` and `verify` recompute the same numbers from a
finished output. Reading the shards rather than trusting build-time counters means `packtool stats` reports the
same numbers for any output, including one built elsewhere. The shards must still be those the
manifest lists (their size, shards.listed_shards) and sound where the numbers index them (offsets
checked per shard): a damaged or swapped shard is one line, and `packtool verify` says what changed.

The pass reads one shard at a time and keeps nothing per document or per pack across shards (issue 43):
lengths and per-pack counts are integers bounded by the capacity or the shard, so each is a `Histogram`
whose percentiles, means and spreads are exactly the lists' (`Tally`), and the interleave windows are
totals per window and source (`WindowTotals`). It holds one shard's columns plus O(capacity x sources +
windows x sources), whatever the number of samples.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packtool.arrow import list_parts, list_values, true_counts
from packtool.config import ITEM_FORMATS
from packtool.errors import PackFormatError, PacktoolError
from packtool.format import KIND_CODES, Interleaving, Manifest, first_broken_pack
from packtool.labels import IGNORE_INDEX
from packtool.shards import read_columns, shard_metadata

STAT_COLUMNS = ["labels", "doc_cu_seqlens", "cu_seqlens", "sources", "sample_repeats"]
KIND_COLUMNS = ["segment_kinds", "segment_groups"]  # schema v2 (pairs and groups)
IMAGE_COLUMNS = ["image_spans", "image_documents"]  # a build with images (docs/format.md "Images")

# Sixteen equal bins up to capacity: fine enough to see where a source's mass sits relative to the
# pack, coarse enough to print as one terminal line per bin. Everything longer falls in one more bin.
LENGTH_BINS = 16
# Up to this largest value a list is tallied by counting each value (np.bincount: 8 B a value up to it, 8 MB at
# most), not by sorting a copy (np.unique: ~10 B an entry, 100 MB for the manifest's 10M lengths before truncation).
DENSE_TALLY_LIMIT = 1 << 20
# Shares are float ratios: a window exactly at the tolerance must not fail on the last bit of a division.
WINDOW_SLACK = 1e-9


def length_bin_edges(capacity: int) -> list[int]:
    """Bin edges `[0, c/16, 2c/16, ..., c]` (integer division; fewer bins when capacity < 16)."""
    bins = min(LENGTH_BINS, capacity)
    return [capacity * k // bins for k in range(bins + 1)]


@dataclass(frozen=True, slots=True)
class Tally:
    """Distinct integers, ascending, and how many times each occurs: all the statistics below need of a list of
    lengths or amounts, in O(distinct values) however long the list.

        lengths [3, 4, 4, 70]  ->  values [3, 4, 70]  counts [1, 2, 1]
    """

    values: np.ndarray  # int64, strictly increasing
    counts: np.ndarray  # int64, each > 0

    @classmethod
    def of(cls, values: np.ndarray | Tally) -> Tally:
        if isinstance(values, Tally):
            return values
        values = np.asarray(values, dtype=np.int64).ravel()
        if len(values) and values.min() >= 0 and values.max() <= DENSE_TALLY_LIMIT:
            counted = Histogram()
            counted.add(values)
            return counted.tally()
        distinct, counts = np.unique(values, return_counts=True)
        return cls(distinct, counts.astype(np.int64))

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def max(self) -> int:
        return int(self.values[-1]) if len(self.values) else 0

    @property
    def min(self) -> int:
        return int(self.values[0]) if len(self.values) else 0

    def total(self, power: int = 1) -> int:
        """sum(value ** power) over every value counted (int64: a build's lengths squared sum far below 2**63)."""
        return int((self.values**power * self.counts).sum())

    def mean(self) -> float:
        """numpy's mean of the values: their exact sum over their count, rounded once (0.0 for none)."""
        n = self.n
        return self.total() / n if n else 0.0

    def cv(self) -> float:
        """The coefficient of variation, numpy's population std / mean (0 for a mean of 0), as numpy would give it
        with exact sums: sqrt(n S2 - S1^2) / S1 from integers, one rounding where it is rational. numpy's own
        float sums fall either side of a tie depending on the values' order (256 ones among 481 0/1 values:
        exactly 0.9375, read 0.93749999...)."""
        s1 = self.total()
        if not s1:
            return 0.0
        spread = self.n * self.total(2) - s1**2
        root = math.isqrt(spread)
        return root / s1 if root * root == spread else math.sqrt(spread) / s1

    def percentile(self, p: int) -> int:
        """np.percentile(values, p, method="inverted_cdf"): the value at sorted position ceil(n p / 100) - 1, that
        position computed in floating point as numpy computes it, so every boundary falls the same way.

        values [3, 4, 4, 70], p 50: position 4 * 0.5 - 1 = 1 -> 4; p 90: 2.6 -> 3 -> 70
        """
        rank = self.n * (p / 100) - 1
        below = math.floor(rank)
        position = max(below if rank == below else below + 1, 0)
        return int(self.values[np.searchsorted(np.cumsum(self.counts), position, side="right")])


class Histogram:
    """Counts of non-negative integers by value (`counts[v]`: how many v), grown to the largest value met.

    A build's lengths are bounded by its capacity (a pack's, a document's) and its per-pack counts by the shard,
    so adding shard after shard holds O(largest value), where keeping the lengths held O(documents) (~38 B a
    document for the percentiles, ~400 MB at 10M samples; issue 43).
    """

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, values: np.ndarray) -> None:
        """Count `values`, which the caller has checked are >= 0 (it can name the column that is not)."""
        found = np.bincount(np.asarray(values, dtype=np.int64))
        if len(found) > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(len(found) - len(self.counts), dtype=np.int64)])
        self.counts[: len(found)] += found

    def tally(self) -> Tally:
        values = np.flatnonzero(self.counts)
        return Tally(values.astype(np.int64), self.counts[values])


def length_summary(lengths: np.ndarray | Tally, capacity: int) -> dict[str, Any]:
    """Percentiles and a fixed-bin histogram of sample lengths (tokens), relative to `capacity`.

    Bins are right-closed so a sample of exactly `capacity` tokens counts as fitting; lengths above
    capacity are `over_capacity` (and also the histogram's last count). For capacity 64, lengths
    [3, 4, 64, 70]:

        edges          [0, 4, 8, ..., 60, 64]          16 bins: [0, 4], (4, 8], ..., (60, 64]
        counts         [2, 0, ..., 0, 1, 1]            17 counts: the last is (64, inf)
        over_capacity  1
        p50 = 4, p90 = p99 = max = 70                  percentiles are observed lengths (inverted CDF)

    An empty `lengths` gives count 0 and zeros throughout. The lengths may come already tallied.
    """
    if capacity < 1:
        raise PacktoolError(f"length_summary: capacity {capacity} must be a positive number of tokens")
    tally = Tally.of(lengths)
    edges = length_bin_edges(capacity)
    # side="left": the first edge >= length closes that length's bin, so bins are (e[i-1], e[i]].
    bins = np.clip(np.searchsorted(np.asarray(edges), tally.values, side="left") - 1, 0, len(edges) - 1)
    counts = np.zeros(len(edges), dtype=np.int64)
    np.add.at(counts, bins, tally.counts)
    n = tally.n
    p50, p90, p99 = (tally.percentile(q) for q in (50, 90, 99)) if n else (0, 0, 0)
    return {
        "count": n,
        "mean": round(tally.mean(), 3),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": tally.max,
        "capacity": int(capacity),
        "over_capacity": int(counts[-1]),
        "histogram": {"edges": edges, "counts": counts.tolist()},
    }


@dataclass(frozen=True, slots=True)
class WindowMix:
    """How far the windows of `window` consecutive packs stray from the mix, per source (columns of `amounts`)."""

    window: int
    windows: int  # full windows; the last packs % window packs are a partial window, not measured
    share: np.ndarray  # float [sources]: each source's share of the whole order
    deviation: np.ndarray  # float [sources]: the largest |window share - share| over the full windows
    worst: np.ndarray  # int [sources]: the window where it is (window w = packs [w*window, (w+1)*window))


def window_mix(amounts: np.ndarray, window: int) -> WindowMix:
    """Each full window's share of every source against the source's share of the whole order.

    amounts [packs, sources] in the mix's unit (samples, tokens or target tokens), packs in order; a
    pack holding segments of several sources adds to several columns. Window 2:

        amounts  [[4, 0], [0, 4], [6, 2], [2, 0], [3, 3]]   shares of the whole: 15/24, 9/24
        windows  [4, 4] -> 0.50   [8, 2] -> 0.80            pack 4 is a partial window (not measured)
        deviation [0.175, 0.175] (0.80 - 0.625 in window 1), worst [1, 1]
    """
    amounts = np.asarray(amounts, dtype=np.float64).reshape(len(amounts), -1)
    windows = len(amounts) // window
    per_window = amounts[: windows * window].reshape(windows, window, amounts.shape[1]).sum(axis=1)
    return mix_of_windows(per_window, amounts.sum(axis=0), window)


def mix_of_windows(per_window: np.ndarray, total: np.ndarray, window: int) -> WindowMix:
    """`window_mix` from each full window's amounts [windows, sources] and the whole order's [sources] (the
    partial window's included): what a pass over the shards keeps instead of every pack's amounts."""
    per_window, total = np.asarray(per_window, dtype=np.float64), np.asarray(total, dtype=np.float64)
    share = total / total.sum() if total.sum() else np.zeros_like(total)
    if not len(per_window):
        return WindowMix(window, 0, share, np.zeros_like(share), np.zeros(len(share), np.int64))
    sizes = per_window.sum(axis=1, keepdims=True)
    shares = np.divide(per_window, sizes, out=np.zeros_like(per_window), where=sizes > 0)
    gaps = np.abs(shares - share)
    return WindowMix(window, len(per_window), share, gaps.max(axis=0), gaps.argmax(axis=0))


def summarize(shards: list[Path], manifest: Manifest | None) -> dict[str, Any]:
    capacity = _capacity(shards, manifest)
    packs = tokens = targets = 0
    segments_per_pack, segment_lengths, pack_lengths = Histogram(), Histogram(), Histogram()
    per_source: dict[str, dict[str, int]] = defaultdict(
        lambda: {"segments": 0, "tokens": 0, "targets": 0, "repeats": 0}
    )
    document_lengths: dict[str, Histogram] = defaultdict(Histogram)
    kinds = KindTally()
    interleave = manifest.interleave if manifest is not None else None
    windows = None if interleave is None else WindowTotals(interleave)
    images = ImageTally()
    for shard in shards:
        table = read_columns(shard, STAT_COLUMNS, KIND_COLUMNS + IMAGE_COLUMNS)
        label_offsets, labels = list_parts(table.column("labels"))
        doc_offsets, docs = list_parts(table.column("doc_cu_seqlens"))
        cu_offsets, cu = list_parts(table.column("cu_seqlens"))
        for name, offsets, values in (("doc_cu_seqlens", doc_offsets, docs), ("cu_seqlens", cu_offsets, cu)):
            # Every index below is taken from these offsets: a damaged shard is a line, not an IndexError.
            broken = first_broken_pack(label_offsets, label_offsets, offsets, values, None)
            if broken >= 0:
                raise PackFormatError(
                    f"{shard} row {broken}: {name} is not 0, increasing, ..., the pack's length: a damaged shard "
                    "(`packtool verify` names every broken row)"
                )
        first_pack = packs
        packs += table.num_rows
        tokens += len(labels)
        lengths = np.diff(label_offsets)
        documents_per_pack = np.diff(doc_offsets) - 1
        attention_lengths = _steps(cu_offsets, cu)
        pack_lengths.add(lengths)
        segments_per_pack.add(documents_per_pack)
        segment_lengths.add(attention_lengths)
        # documents as [start, end) of the shard's labels laid end to end
        pack_start = np.repeat(label_offsets[:-1].astype(np.int64), np.diff(doc_offsets))
        bounds = docs.astype(np.int64) + pack_start
        inner = _inner(doc_offsets)
        doc_start, doc_end = bounds[inner - 1], bounds[inner]
        trained = labels != IGNORE_INDEX
        targets += int(np.count_nonzero(trained))
        doc_lengths, doc_targets = doc_end - doc_start, true_counts(trained, doc_start, doc_end)
        # a Python string per document of this shard only (the shard is what the pass holds at once)
        sources = [name for chunk in table.column("sources").chunks for name in list_values(chunk).to_pylist()]
        repeated = list_parts(table.column("sample_repeats"))[1] > 0
        if not len(sources) == len(repeated) == len(doc_lengths):
            raise PacktoolError(
                f"{shard}: {len(doc_lengths)} documents but {len(sources)} sources and {len(repeated)} "
                "sample_repeats; `packtool verify` names the pack"
            )
        code_of = {name: code for code, name in enumerate(dict.fromkeys(sources))}
        codes = np.fromiter((code_of[name] for name in sources), dtype=np.int64, count=len(sources))
        for name, code in code_of.items():
            mine = codes == code
            entry = per_source[name]
            entry["segments"] += int(mine.sum())
            entry["tokens"] += int(doc_lengths[mine].sum())
            entry["targets"] += int(doc_targets[mine].sum())
            entry["repeats"] += int(repeated[mine].sum())
            document_lengths[name].add(doc_lengths[mine])
        if windows is not None:
            pack_of = first_pack + np.repeat(np.arange(table.num_rows), documents_per_pack)
            windows.add(pack_of, list(code_of), codes, doc_lengths, doc_targets)
        if "image_spans" in table.column_names:
            images.add(shard, table, lengths, documents_per_pack, list(code_of), codes)
        if "segment_kinds" in table.column_names:  # schema v2
            _, segment_kinds = list_parts(table.column("segment_kinds"))
            _, segment_groups = list_parts(table.column("segment_groups"))
            unknown = sorted(set(np.unique(segment_kinds).tolist()) - set(KIND_CODES.values()))
            # v2 is packed only (docs/format.md): each document is one attention segment
            if unknown or not len(segment_kinds) == len(segment_groups) == len(attention_lengths) == len(doc_targets):
                raise PackFormatError(
                    f"{shard}: segment_kinds holds {len(segment_kinds)} entries for {len(attention_lengths)} "
                    f"attention segments, unknown kind codes {unknown}: a damaged shard (`packtool verify` names it)"
                )
            kinds.add(segment_kinds, segment_groups, attention_lengths, doc_targets)
    per_pack, pack_fill = segments_per_pack.tally(), pack_lengths.tally()
    total_segments = sum(e["segments"] for e in per_source.values())
    slots = packs * capacity
    stats: dict[str, Any] = {
        "capacity": capacity,
        "packs": packs,
        "segments": total_segments,
        "tokens": tokens,
        "targets": targets,
        "target_ratio": _ratio(targets, tokens),
        "token_efficiency": _ratio(tokens, slots),
        "padding_share_if_padded_to_capacity": _ratio(slots - tokens, slots),
        "segments_per_pack": {
            "mean": _ratio(total_segments, packs),
            "max": per_pack.max,
            # histogram[k] = packs holding k documents
            "histogram": segments_per_pack.counts.tolist() or [0],
        },
        # How full packs are: pack lengths against capacity (one bin per 1/16 of the pack)
        "pack_fill": length_summary(pack_fill, capacity) if capacity else None,
        "sources": {
            name: {
                **entry,
                "segment_share": _ratio(entry["segments"], total_segments),
                "token_share": _ratio(entry["tokens"], tokens),
                "target_share": _ratio(entry["targets"], targets),
                "target_ratio": _ratio(entry["targets"], entry["tokens"]),
                # documents as packed: after truncation, split pieces counted one by one
                "segment_lengths": length_summary(document_lengths[name].tally(), capacity) if capacity else None,
            }
            for name, entry in sorted(per_source.items())
        },
        "attention": attention_slots(segment_lengths.tally(), pack_fill),
    }
    if windows is not None:
        stats["interleave"] = windows.stats(packs)
    if kinds.seen:  # schema v2 only: a v1 output's stats keep their keys
        stats["kinds"] = kinds.as_dict()
    if images.seen:  # a build with images only: every other output's stats keep their keys
        stats["images"] = images.as_dict()
    if manifest is not None:
        recorded = manifest.raw
        stats["accounting"] = recorded.get("accounting", {})
        stats["mixing"] = recorded.get("mixing", {})
        stats["mode"] = recorded.get("mode", "packed")
        # Recorded by the build (before truncation cannot be recomputed from shards); absent in older outputs.
        stats["lengths"] = recorded.get("lengths")
        sources = recorded.get("config", {}).get("sources", [])
        items = [source["name"] for source in sources if source.get("format") in ITEM_FORMATS]
        if items:
            stats["item_sources"] = items
    return stats


def spread(values: np.ndarray | Tally) -> dict[str, Any]:
    """How evenly an amount is spread: mean, min, percentiles, max, and the coefficient of variation (std / mean;
    0 when every value is the same). The values may come already tallied."""
    tally = Tally.of(values)
    if not tally.n:
        return {"mean": 0.0, "min": 0, "p50": 0, "p90": 0, "max": 0, "cv": 0.0}
    return {
        "mean": round(tally.mean(), 3),
        "min": tally.min,
        "p50": tally.percentile(50),
        "p90": tally.percentile(90),
        "max": tally.max,
        "cv": round(tally.cv(), 3),
    }


class ImageTally:
    """Images and their tokens per pack and per source (documents as packed), from image_spans and image_documents,
    as histograms: a pack's or a document's images and image tokens are bounded by its tokens."""

    def __init__(self) -> None:
        self.seen = False
        self.pack_images = Histogram()
        self.pack_tokens = Histogram()
        self.sources: dict[str, tuple[Histogram, Histogram]] = {}  # per document of the source: images, tokens

    def add(
        self,
        shard: Path,
        table: Any,
        pack_lengths: np.ndarray,
        documents_per_pack: np.ndarray,
        names: list[str],
        codes: np.ndarray,
    ) -> None:
        """One shard's images; `codes[d]` is document d's source, `names[code]` its name."""
        self.seen = True
        span_offsets, spans = list_parts(table.column("image_spans"))
        image_offsets, image_documents = list_parts(table.column("image_documents"))
        if not np.array_equal(span_offsets, 2 * image_offsets) or (image_documents < 0).any():
            raise PackFormatError(
                f"{shard}: image_spans and image_documents disagree on the images of a pack: a damaged shard "
                "(`packtool verify` names it)"
            )
        per_pack = np.diff(image_offsets)
        starts, ends = spans[0::2].astype(np.int64), spans[1::2].astype(np.int64)
        pack_of = np.repeat(np.arange(len(per_pack)), per_pack)
        if (starts < 0).any() or (ends < starts).any() or (ends > pack_lengths[pack_of]).any():
            raise PackFormatError(f"{shard}: an image span is not inside its pack: a damaged shard")
        lengths = ends - starts
        document_base = np.concatenate([[0], np.cumsum(documents_per_pack)])
        document = document_base[pack_of] + image_documents
        if (image_documents >= documents_per_pack[pack_of]).any():
            raise PackFormatError(f"{shard}: image_documents names a document its pack does not hold: a damaged shard")
        self.pack_images.add(per_pack)
        self.pack_tokens.add(np.bincount(pack_of, weights=lengths, minlength=len(per_pack)).astype(np.int64))
        counts = np.bincount(document, minlength=len(codes))
        tokens = np.bincount(document, weights=lengths, minlength=len(codes)).astype(np.int64)
        for code, name in enumerate(names):
            mine = codes == code
            images, image_tokens = self.sources.setdefault(name, (Histogram(), Histogram()))
            images.add(counts[mine])
            image_tokens.add(tokens[mine])

    def as_dict(self) -> dict[str, Any]:
        images, tokens = self.pack_images.tally(), self.pack_tokens.tally()
        sources = {}
        for name, (per_document, tokens_per_document) in sorted(self.sources.items()):
            counted, weighed = per_document.tally(), tokens_per_document.tally()
            sources[name] = {
                "images": counted.total(),
                "image_tokens": weighed.total(),
                "images_per_document": spread(counted),
                "image_tokens_per_document": spread(weighed),
            }
        return {
            "images": images.total(),
            "image_tokens": tokens.total(),
            "per_pack": {"images": spread(images), "image_tokens": spread(tokens)},
            "sources": sources,
        }


class WindowTotals:
    """Each interleave window's amount of every source, summed shard by shard (window w = packs [w * window,
    (w + 1) * window), the last one maybe partial): O(windows x sources), where every document's pack, source
    and amounts were O(documents)."""

    def __init__(self, interleave: Interleaving) -> None:
        self.interleave = interleave
        self.code_of: dict[str, int] = {}  # each source met, by order of meeting
        self.sums = np.zeros((0, 0), dtype=np.int64)  # [windows so far, with room to grow; sources met]

    def add(
        self, pack: np.ndarray, names: list[str], codes: np.ndarray, tokens: np.ndarray, targets: np.ndarray
    ) -> None:
        """One shard's documents: the pack of each in the whole order, its source as `codes` into the shard's
        `names`, its tokens and targets."""
        if not len(pack):
            return
        ours = np.array([self.code_of.setdefault(name, len(self.code_of)) for name in names], dtype=np.int64)
        window = pack // self.interleave.window
        first, last = int(window[0]), int(window[-1])  # packs come in order
        # rows grow by doubling: a build's shards add a few windows each
        rows = len(self.sums) if last < len(self.sums) else max(last + 1, 2 * len(self.sums))
        if rows > len(self.sums) or len(self.code_of) > self.sums.shape[1]:
            grown = np.zeros((rows, len(self.code_of)), dtype=np.int64)
            grown[: self.sums.shape[0], : self.sums.shape[1]] = self.sums
            self.sums = grown
        shape = (last + 1 - first, len(self.code_of))
        self.sums[first : last + 1] += mix_amounts(
            window - first, ours[codes], self.interleave.unit, tokens, targets, shape
        )

    def stats(self, packs: int) -> dict[str, Any]:
        """The `interleave` block of stats for an order of `packs` packs."""
        names = sorted(self.code_of)
        full = packs // self.interleave.window
        sums = np.zeros((max(full, len(self.sums)), len(names)), dtype=np.int64)
        sums[: len(self.sums)] = self.sums[:, [self.code_of[name] for name in names]]
        return interleave_stats(
            names, mix_of_windows(sums[:full], sums.sum(axis=0), self.interleave.window), packs, self.interleave
        )


def mix_amounts(
    pack: np.ndarray, source: np.ndarray, unit: str, tokens: np.ndarray, targets: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """amounts [packs, sources]: each document's samples, tokens or target tokens (`unit`, MIX_UNITS) added to
    its pack's column of its source (the build orders packs by them, stats measures its windows by them)."""
    values = {"samples": np.ones(len(pack), np.int64), "tokens": tokens, "target_tokens": targets}[unit]
    amounts = np.zeros(shape, dtype=np.int64)
    np.add.at(amounts, (pack, source), values)
    return amounts


def interleave_stats(names: list[str], mix: WindowMix, packs: int, interleave: Interleaving) -> dict[str, Any]:
    """The `interleave` block of stats: each source's share, its worst full window and that window's gap."""
    worst = float(mix.deviation.max(initial=0.0))
    return {
        "window": interleave.window,
        "tolerance": interleave.tolerance,
        "unit": interleave.unit,
        "windows": mix.windows,
        "partial_window_packs": packs - mix.windows * interleave.window,
        "worst_deviation": round(worst, 6),
        "within_tolerance": worst <= interleave.tolerance + WINDOW_SLACK,
        "sources": {
            name: {
                "share": round(float(mix.share[i]), 6),
                "worst_deviation": round(float(mix.deviation[i]), 6),
                "worst_window": int(mix.worst[i]),
            }
            for i, name in enumerate(names)
        },
    }


class KindTally:
    """Segments, tokens and targets per segment kind, and the pairs and groups they form (schema v2)."""

    def __init__(self) -> None:
        self.seen = False
        self.per_kind: dict[str, dict[str, int]] = {}
        self.pairs = 0
        self.groups = 0

    def add(self, kinds: np.ndarray, groups: np.ndarray, lengths: np.ndarray, targets: np.ndarray) -> None:
        """One shard's segments. A pair or a group lies whole in one pack (docs/format.md; `verify` checks it), so
        its id is counted once in its shard: no id is kept for the whole build (a set held one per pair)."""
        self.seen = True
        names = {code: name for name, code in KIND_CODES.items()}
        for code in np.unique(kinds).tolist():
            mine = kinds == code
            entry = self.per_kind.setdefault(names[code], {"segments": 0, "tokens": 0, "targets": 0})
            entry["segments"] += int(mine.sum())
            entry["tokens"] += int(lengths[mine].sum())
            entry["targets"] += int(targets[mine].sum())
        self.pairs += len(np.unique(groups[kinds == KIND_CODES["chosen"]]))
        self.groups += len(np.unique(groups[kinds == KIND_CODES["completion"]]))

    def as_dict(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "groups": self.groups,
            "per_kind": {k: self.per_kind[k] for k in sorted(self.per_kind)},
        }


def _inner(offsets: np.ndarray) -> np.ndarray:
    """Indices of the boundaries that close a step inside a row: every entry but each row's first."""
    inner = np.ones(int(offsets[-1]) if len(offsets) else 0, dtype=bool)
    inner[offsets[:-1][np.diff(offsets) > 0]] = False
    return np.flatnonzero(inner)


def _steps(offsets: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Lengths between consecutive boundaries of each row (cu_seqlens lists -> segment lengths).

    offsets [0 3 5]  boundaries [0 2 5 | 0 4]  ->  [2 3 | 4]
    """
    inner = _inner(offsets)
    return boundaries[inner].astype(np.int64) - boundaries[inner - 1]


def _capacity(shards: list[Path], manifest: Manifest | None) -> int:
    if manifest is not None:
        return manifest.capacity
    if shards:
        recorded = shard_metadata(shards[0]).get("packtool.capacity", "0")
        if not recorded.isdigit():
            raise PackFormatError(f"{shards[0]}: packtool.capacity {recorded!r:.40} in its metadata is not a number")
        return int(recorded)
    return 0


def _ratio(a: float, b: float) -> float:
    return round(a / b, 6) if b else 0.0


def attention_slots(lengths: np.ndarray | Tally, pack_lengths: np.ndarray | Tally) -> dict[str, int]:
    """Token and score slots of the same segments padded one per row, packed block-diagonally, or flat per pack.

    Segments [3, 2, 4] in one pack of 9: token slots 12 padded / 9 packed, dense score slots 48
    padded / 29 packed / 81 flat, legal causal pairs 19 (45 if the pack were wrongly one causal
    sequence). The lengths may come already tallied.
    """
    segments, packs = Tally.of(lengths), Tally.of(pack_lengths)
    return {
        "token_slots_padded": segments.n * segments.max,
        "token_slots_packed": segments.total(),
        "score_slots_padded": segments.n * segments.max**2,
        "score_slots_packed": segments.total(2),
        "score_slots_flat": packs.total(2),
        # l (l + 1) / 2 pairs a segment of l tokens
        "causal_pairs": (segments.total(2) + segments.total()) // 2,
        "causal_pairs_flat": (packs.total(2) + packs.total()) // 2,
    }
