"""Summary statistics of an output, computed from the shards themselves (plus the manifest's accounting).

Both sides use them: the builder writes `summarize` and `length_summary` into the manifest and checks its
interleaved order with `window_mix`; `packtool stats`, `report` and `verify` recompute the same numbers from a
finished output. Reading the shards rather than trusting build-time counters means `packtool stats` reports the
same numbers for any output, including one built elsewhere. The shards must still be those the
manifest lists (their size, shards.listed_shards) and sound where the numbers index them (offsets
checked per shard): a damaged or swapped shard is one line, and `packtool verify` says what changed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packtool.arrow import list_parts, list_values, true_counts
from packtool.config import ITEM_FORMATS
from packtool.errors import PackFormatError, PacktoolError
from packtool.format import KIND_CODES, Interleaving, Manifest, attn_cost_of_lengths, first_broken_pack
from packtool.labels import IGNORE_INDEX
from packtool.shards import read_columns, shard_metadata

STAT_COLUMNS = ["labels", "doc_cu_seqlens", "cu_seqlens", "sources", "sample_repeats"]
KIND_COLUMNS = ["segment_kinds", "segment_groups"]  # schema v2 (pairs and groups)
IMAGE_COLUMNS = ["image_spans", "image_documents"]  # a build with images (docs/format.md "Images")

# Sixteen equal bins up to capacity: fine enough to see where a source's mass sits relative to the
# pack, coarse enough to print as one terminal line per bin. Everything longer falls in one more bin.
LENGTH_BINS = 16
# Shares are float ratios: a window exactly at the tolerance must not fail on the last bit of a division.
WINDOW_SLACK = 1e-9


def length_bin_edges(capacity: int) -> list[int]:
    """Bin edges `[0, c/16, 2c/16, ..., c]` (integer division; fewer bins when capacity < 16)."""
    bins = min(LENGTH_BINS, capacity)
    return [capacity * k // bins for k in range(bins + 1)]


def length_summary(lengths: np.ndarray, capacity: int) -> dict[str, Any]:
    """Percentiles and a fixed-bin histogram of sample lengths (tokens), relative to `capacity`.

    Bins are right-closed so a sample of exactly `capacity` tokens counts as fitting; lengths above
    capacity are `over_capacity` (and also the histogram's last count). For capacity 64, lengths
    [3, 4, 64, 70]:

        edges          [0, 4, 8, ..., 60, 64]          16 bins: [0, 4], (4, 8], ..., (60, 64]
        counts         [2, 0, ..., 0, 1, 1]            17 counts: the last is (64, inf)
        over_capacity  1
        p50 = 4, p90 = p99 = max = 70                  percentiles are observed lengths (inverted CDF)

    An empty `lengths` gives count 0 and zeros throughout.
    """
    if capacity < 1:
        raise PacktoolError(f"length_summary: capacity {capacity} must be a positive number of tokens")
    values = np.asarray(lengths, dtype=np.int64).ravel()
    edges = length_bin_edges(capacity)
    # side="left": the first edge >= length closes that length's bin, so bins are (e[i-1], e[i]].
    bins = np.clip(np.searchsorted(np.asarray(edges), values, side="left") - 1, 0, len(edges) - 1)
    counts = np.bincount(bins, minlength=len(edges))
    if len(values):
        p50, p90, p99 = (int(np.percentile(values, q, method="inverted_cdf")) for q in (50, 90, 99))
    else:
        p50 = p90 = p99 = 0
    return {
        "count": len(values),
        "mean": round(float(values.mean()), 3) if len(values) else 0.0,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(values.max()) if len(values) else 0,
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
    total = amounts.sum(axis=0)
    share = total / total.sum() if total.sum() else np.zeros_like(total)
    windows = len(amounts) // window
    if not windows:
        return WindowMix(window, 0, share, np.zeros_like(share), np.zeros(len(share), np.int64))
    per_window = amounts[: windows * window].reshape(windows, window, amounts.shape[1]).sum(axis=1)
    sizes = per_window.sum(axis=1, keepdims=True)
    shares = np.divide(per_window, sizes, out=np.zeros_like(per_window), where=sizes > 0)
    gaps = np.abs(shares - share)
    return WindowMix(window, windows, share, gaps.max(axis=0), gaps.argmax(axis=0))


def summarize(shards: list[Path], manifest: Manifest | None) -> dict[str, Any]:
    capacity = _capacity(shards, manifest)
    packs = tokens = targets = 0
    segments_per_pack: list[np.ndarray] = []
    segment_lengths: list[np.ndarray] = []
    pack_lengths: list[np.ndarray] = []
    per_source: dict[str, dict[str, int]] = defaultdict(
        lambda: {"segments": 0, "tokens": 0, "targets": 0, "repeats": 0}
    )
    document_lengths: dict[str, list[np.ndarray]] = defaultdict(list)
    kinds = KindTally()
    interleave = manifest.interleave if manifest is not None else None
    documents = _Documents()  # per document: its pack, source and amounts (for the interleave windows)
    images = ImageTally()
    for shard in shards:
        table = read_columns(shard, STAT_COLUMNS, KIND_COLUMNS + IMAGE_COLUMNS)
        v2 = "segment_kinds" in table.column_names
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
        pack_lengths.append(np.diff(label_offsets))
        segments_per_pack.append(np.diff(doc_offsets) - 1)
        segment_lengths.append(_steps(cu_offsets, cu))
        # documents as [start, end) of the shard's labels laid end to end
        pack_start = np.repeat(label_offsets[:-1].astype(np.int64), np.diff(doc_offsets))
        bounds = docs.astype(np.int64) + pack_start
        inner = _inner(doc_offsets)
        doc_start, doc_end = bounds[inner - 1], bounds[inner]
        trained = labels != IGNORE_INDEX
        targets += int(np.count_nonzero(trained))
        doc_lengths, doc_targets = doc_end - doc_start, true_counts(trained, doc_start, doc_end)
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
            document_lengths[name].append(doc_lengths[mine])
        if interleave is not None:
            pack_of = first_pack + np.repeat(np.arange(table.num_rows), np.diff(doc_offsets) - 1)
            documents.add(pack_of, list(code_of), codes, doc_lengths, doc_targets)
        if "image_spans" in table.column_names:
            images.add(shard, table, np.diff(doc_offsets) - 1, list(code_of), codes)
        if v2:
            _, segment_kinds = list_parts(table.column("segment_kinds"))
            _, segment_groups = list_parts(table.column("segment_groups"))
            unknown = sorted(set(np.unique(segment_kinds).tolist()) - set(KIND_CODES.values()))
            if unknown or len(segment_kinds) != len(segment_lengths[-1]):
                raise PackFormatError(
                    f"{shard}: segment_kinds holds {len(segment_kinds)} entries for {len(segment_lengths[-1])} "
                    f"attention segments, unknown kind codes {unknown}: a damaged shard (`packtool verify` names it)"
                )
            kinds.add(segment_kinds.tolist(), segment_groups.tolist(), segment_lengths[-1], doc_targets)
    lengths = _joined(segment_lengths)
    per_pack, pack_fill = _joined(segments_per_pack), _joined(pack_lengths)
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
            "max": int(per_pack.max(initial=0)),
            # histogram[k] = packs holding k documents
            "histogram": np.bincount(per_pack, minlength=1).tolist(),
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
                "segment_lengths": length_summary(np.concatenate(document_lengths[name]), capacity)
                if capacity
                else None,
            }
            for name, entry in sorted(per_source.items())
        },
        "attention": attention_slots(lengths, pack_fill),
    }
    if interleave is not None:
        stats["interleave"] = interleave_stats(documents.amounts(packs, interleave.unit), interleave)
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


def spread(values: np.ndarray) -> dict[str, Any]:
    """How evenly an amount is spread: mean, min, percentiles, max, and the coefficient of variation (std / mean;
    0 when every value is the same)."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return {"mean": 0.0, "min": 0, "p50": 0, "p90": 0, "max": 0, "cv": 0.0}
    mean = float(values.mean())
    return {
        "mean": round(mean, 3),
        "min": int(values.min()),
        "p50": int(np.percentile(values, 50, method="inverted_cdf")),
        "p90": int(np.percentile(values, 90, method="inverted_cdf")),
        "max": int(values.max()),
        "cv": round(float(values.std()) / mean, 3) if mean else 0.0,
    }


class ImageTally:
    """Images and their tokens per pack and per source (documents as packed), from image_spans and image_documents."""

    def __init__(self) -> None:
        self.seen = False
        self.pack_images: list[np.ndarray] = []
        self.pack_tokens: list[np.ndarray] = []
        self.sources: dict[str, list[np.ndarray]] = defaultdict(list)  # per document of the source: images, tokens

    def add(self, shard: Path, table: Any, documents_per_pack: np.ndarray, names: list[str], codes: np.ndarray) -> None:
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
        lengths = (spans[1::2] - spans[0::2]).astype(np.int64)
        pack_of = np.repeat(np.arange(len(per_pack)), per_pack)
        document_base = np.concatenate([[0], np.cumsum(documents_per_pack)])
        document = document_base[pack_of] + image_documents
        if (image_documents >= documents_per_pack[pack_of]).any():
            raise PackFormatError(f"{shard}: image_documents names a document its pack does not hold: a damaged shard")
        self.pack_images.append(per_pack)
        self.pack_tokens.append(np.bincount(pack_of, weights=lengths, minlength=len(per_pack)).astype(np.int64))
        counts = np.bincount(document, minlength=len(codes))
        tokens = np.bincount(document, weights=lengths, minlength=len(codes)).astype(np.int64)
        for code, name in enumerate(names):
            mine = codes == code
            self.sources[name].append(np.stack([counts[mine], tokens[mine]]))

    def as_dict(self) -> dict[str, Any]:
        images, tokens = _joined(self.pack_images), _joined(self.pack_tokens)
        sources = {}
        for name, parts in sorted(self.sources.items()):
            per_document = np.concatenate(parts, axis=1)
            sources[name] = {
                "images": int(per_document[0].sum()),
                "image_tokens": int(per_document[1].sum()),
                "images_per_document": spread(per_document[0]),
                "image_tokens_per_document": spread(per_document[1]),
            }
        return {
            "images": int(images.sum()),
            "image_tokens": int(tokens.sum()),
            "per_pack": {"images": spread(images), "image_tokens": spread(tokens)},
            "sources": sources,
        }


class _Documents:
    """The documents of an output's packs in pack order: enough to total each pack's mix in any unit."""

    def __init__(self) -> None:
        self.pack: list[np.ndarray] = []
        self.code_of: dict[str, int] = {}  # each source met, by order of meeting
        self.source: list[np.ndarray] = []  # codes of code_of: a name per document was a Python string each
        self.tokens: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []

    def add(
        self, pack: np.ndarray, names: list[str], codes: np.ndarray, tokens: np.ndarray, targets: np.ndarray
    ) -> None:
        """One shard's documents, the source of each as `codes` into that shard's `names`."""
        ours = np.array([self.code_of.setdefault(name, len(self.code_of)) for name in names], dtype=np.int64)
        self.pack.append(pack)
        self.source.append(ours[codes])
        self.tokens.append(tokens)
        self.targets.append(targets)

    def amounts(self, packs: int, unit: str) -> tuple[list[str], np.ndarray]:
        """(source names, sorted; amounts [packs, sources] in `unit`: samples, tokens or target_tokens)."""
        names = sorted(self.code_of)
        sorted_code = np.array([names.index(name) for name in self.code_of], dtype=np.int64)
        sources = sorted_code[_joined(self.source)]
        amounts = mix_amounts(
            _joined(self.pack), sources, unit, _joined(self.tokens), _joined(self.targets), (packs, len(names))
        )
        return names, amounts


def mix_amounts(
    pack: np.ndarray, source: np.ndarray, unit: str, tokens: np.ndarray, targets: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """amounts [packs, sources]: each document's samples, tokens or target tokens (`unit`, MIX_UNITS) added to
    its pack's column of its source (the build orders packs by them, stats measures its windows by them)."""
    values = {"samples": np.ones(len(pack), np.int64), "tokens": tokens, "target_tokens": targets}[unit]
    amounts = np.zeros(shape, dtype=np.int64)
    np.add.at(amounts, (pack, source), values)
    return amounts


def interleave_stats(named: tuple[list[str], np.ndarray], interleave: Interleaving) -> dict[str, Any]:
    """The `interleave` block of stats: each source's share, its worst full window and that window's gap."""
    names, amounts = named
    mix = window_mix(amounts, interleave.window)
    worst = float(mix.deviation.max(initial=0.0))
    return {
        "window": interleave.window,
        "tolerance": interleave.tolerance,
        "unit": interleave.unit,
        "windows": mix.windows,
        "partial_window_packs": len(amounts) - mix.windows * interleave.window,
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
        self.groups: dict[str, set[int]] = {"pairs": set(), "groups": set()}

    def add(self, kinds: list[int], groups: list[int], lengths: np.ndarray, targets: np.ndarray) -> None:
        self.seen = True
        names = {code: name for name, code in KIND_CODES.items()}
        for kind, group, length, n_targets in zip(kinds, groups, lengths, targets):
            entry = self.per_kind.setdefault(names[kind], {"segments": 0, "tokens": 0, "targets": 0})
            entry["segments"] += 1
            entry["tokens"] += int(length)
            entry["targets"] += int(n_targets)
            if kind == KIND_CODES["chosen"]:
                self.groups["pairs"].add(group)
            elif kind == KIND_CODES["completion"]:
                self.groups["groups"].add(group)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pairs": len(self.groups["pairs"]),
            "groups": len(self.groups["groups"]),
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


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)


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


def attention_slots(lengths: np.ndarray, pack_lengths: np.ndarray) -> dict[str, int]:
    """Token and score slots of the same segments padded one per row, packed block-diagonally, or flat per pack.

    Segments [3, 2, 4] in one pack of 9: token slots 12 padded / 9 packed, dense score slots 48
    padded / 29 packed / 81 flat, legal causal pairs 19 (45 if the pack were wrongly one causal
    sequence).
    """
    longest = int(lengths.max()) if len(lengths) else 0
    return {
        "token_slots_padded": len(lengths) * longest,
        "token_slots_packed": int(lengths.sum()),
        "score_slots_padded": len(lengths) * longest**2,
        "score_slots_packed": attn_cost_of_lengths(lengths),
        "score_slots_flat": attn_cost_of_lengths(pack_lengths),
        "causal_pairs": int((lengths * (lengths + 1) // 2).sum()),
        "causal_pairs_flat": int((pack_lengths * (pack_lengths + 1) // 2).sum()),
    }
