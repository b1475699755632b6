"""Plan phase: from the store's length columns to every pack of the build, in numpy arrays.

    partitions --length, n_targets columns--> one row per stored sample (global index g)
        fits capacity and trains something   -> kept as is                 ref = g
        longer than capacity                 -> truncate(): pieces, or a drop with its reason
                                                 (pieces go to PLAN/pieces.arrow, ref = -(k + 1))
        no target                            -> dropped.no_targets
    kept segments --mixing (repeat_plan)--> (ref, repeat) --plan_packs / plan_groups / plan_stream--> packs
    packs --mixing.interleave (interleave_order, checked by summaries.window_mix)--> the same packs in windows of K
    each partition's rejects table (within max_samples) + the plan's drops (arrays) --merged in input order-->
        PLAN/rejects.jsonl, a line at a time, counted by reason (no dict per reject is ever held)

Pairs and groups (format: preference | group) arrive fitted to one pack by encode, as consecutive
rows of one record; the plan keeps them whole: an item is a record's rows (a plain sample is an
item of one segment), mixing copies whole items, and `plan_items` places each item as one unit.
A plan with at least one such item gives every segment its group id (`FolderPlan.group`).

Only samples longer than capacity are read token by token (truncation needs their message
structure); everything else is arrays of lengths and indices. Counting is `accounting.Counts`, the
copies of each source `mixing`. The plan is written to its folder (`plan_files`: plan.npz, pieces.arrow,
rejects.jsonl, plan.json last) under a key that hashes the partitions and every plan
setting, so a resumed build reuses it and emit work items in other processes read it.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import shutil
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packtool.arrow import as_numpy
from packtool.builder.accounting import Counts
from packtool.builder.cache import code_fingerprint
from packtool.builder.mixing import (
    REALIZED,
    interleave_order,
    quota_plan,
    repeat_plan,
    source_multipliers,
    source_quotas,
    source_seed,
    splitmix64,
)
from packtool.builder.plan_files import (
    PIECES_FILE,
    PLAN_FILE,
    REJECTS_FILE,
    FolderPlan,
    Partition,
    Plan,
    PlanRejects,
    VisionPlan,
    load_plan,
    write_plan,
)
from packtool.builder.store import PartitionReader, PartitionWriter, read_rejects, rejects_path
from packtool.config import ITEM_FORMATS, BuildConfig, canonical_json, config_folder, keyed_parts, section_data
from packtool.errors import BuildError
from packtool.format import SCHEMA_VERSION, SEGMENTS_SCHEMA_VERSION, Interleaving
from packtool.packing import PackPlan, StreamPlan, plan_groups, plan_packs, plan_stream, reordered
from packtool.packing_items import KIND_CODES, plan_items, segment_columns
from packtool.summaries import WINDOW_SLACK, Tally, mix_amounts, window_mix
from packtool.truncate import truncate
from packtool.vision.processors import QwenVLProcessor, load_processor


def plan_settings(config: BuildConfig) -> dict[str, Any]:
    """Every part that changes the plan or the shard bytes but not the encoded samples, whole (config.KEYED_BY):
    a setting added to one of these sections is keyed with it."""
    return {**keyed_parts(config, "plan"), "sources": [section_data(s.plan) for s in config.sources]}


def shard_schema_version(config: BuildConfig) -> int:
    """Version 2 (per-segment columns) when a source has pairs or groups, or a long text may be split into pieces.

    Decided by the config alone, so the version of a build does not depend on its data: every other
    build writes the version 1 bytes.
    """
    items = any(s.format in ITEM_FORMATS for s in config.sources)
    strategies = {s.plan.truncation or config.truncation.strategy for s in config.sources}
    splits = "split" in strategies or ("turns" in strategies and config.truncation.fallback == "split")
    return SEGMENTS_SCHEMA_VERSION if items or (splits and config.packing.strategy != "stream") else SCHEMA_VERSION


def vision_plan(config: BuildConfig) -> VisionPlan | None:
    """A build whose config names an image processor writes image columns (decided by the config, as the schema
    version is); a stream build holds text sources alone, so never images."""
    if config.processor is None or config.packing.strategy == "stream":
        return None
    processor = load_processor(Path(config.processor))
    merge_size = processor.merge_size if isinstance(processor, QwenVLProcessor) else None
    return VisionPlan(merge_size=merge_size, embed=config.images == "embed", root=str(config_folder(config)))


def plan_inputs(config: BuildConfig, partitions: list[Partition]) -> list[str]:
    """What the plan key holds of each partition: its encode key; in a build with an image processor its bytes'
    sha256 too, as no encode key holds an image's content (an image changed since it was encoded has its entry
    encoded again under the same key, and OUT is up to date only while the plan key says so)."""
    if config.processor is None:
        return [p.key for p in partitions]
    return [f"{p.key}:{p.report['partition_sha256']}" for p in partitions]


def plan_key(config: BuildConfig, partition_keys: list[str]) -> str:
    facts = {"partitions": partition_keys, "settings": plan_settings(config), "code": code_fingerprint()}
    return hashlib.sha256(canonical_json(facts).encode()).hexdigest()


def make_plan(config: BuildConfig, partitions: list[Partition], folder: Path, key: str) -> Plan:
    """Compute the plan and write it to `folder` (plan.json last); an existing complete plan is read back."""
    if (folder / PLAN_FILE).is_file():
        return load_plan(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = [s.name for s in config.sources]
    counts = {name: Counts() for name in names}
    fitted, before = _fit_partitions(config, partitions, folder, counts)
    if config.packing.balance_vision and config.processor is not None:
        rows = [_file_patches(Path(p.path)) for p in partitions]
        fitted = replace(fitted, patches=np.concatenate([*rows, _file_patches(folder / PIECES_FILE)]))

    reached: dict[str, dict[str, int]] = {}
    folders = [_main_folder(config, fitted, counts, reached)]
    if config.overflow.mode == "bucket":
        folders.append(_overflow_folder(config, fitted, counts))
    if fitted.held_out.any():
        folders.append(_validation_folder(config, fitted))
    rejects = _write_rejects(folder / REJECTS_FILE, partitions, _budgets(config, partitions), fitted.drops)
    lengths_by_source = {
        name: {"before": before[name], "after": Tally.of(fitted.length[(fitted.source == i) & ~fitted.bucket])}
        for i, name in enumerate(names)
    }
    plan = Plan(
        key=key,
        folder=folder,
        partitions=partitions,
        folders=folders,
        accounting={name: c.as_dict() for name, c in counts.items()},
        rejects=rejects,
        lengths=lengths_by_source,
        quota_reached=reached,
        piece_numbers=fitted.piece_numbers,
        piece_offsets=fitted.piece_offsets,
        schema_version=shard_schema_version(config),
        vision=vision_plan(config),
    )
    write_plan(plan)
    return plan


def _fit_partitions(
    config: BuildConfig, partitions: list[Partition], folder: Path, counts: dict[str, Counts]
) -> tuple[_Fitted, dict[str, Tally]]:
    """The fit of every stored row, and each source's lengths before it, tallied (its samples within max_samples). The
    stored rows' columns (~30 B a sample) go when it returns: the folders are planned without them (issue 43)."""
    names = [s.name for s in config.sources]
    budgets = _budgets(config, partitions)
    readers = [PartitionReader(Path(p.path)) for p in partitions]
    try:
        rows = [r.rows for r in readers]
        columns = _stored_columns(readers, ("length", "n_targets", "ordinal", "special_literal", "kind", "completion"))
        lengths = columns["length"].astype(np.int64)
        n_targets = columns["n_targets"].astype(np.int64)
        source = np.repeat(np.array([names.index(p.source) for p in partitions], dtype=np.int16), rows)
        bases = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        ordinals = columns["ordinal"]
        within = ordinals < np.repeat(np.asarray(budgets, dtype=np.int64), rows)
        literals = columns["special_literal"].astype(bool) & within
        kinds = columns["kind"].astype(np.int8)
        completion = columns["completion"]
        del columns
        # a rejected side, or a completion after the first, continues the item its previous row opened
        starts = ~((kinds == KIND_CODES["rejected"]) | ((kinds == KIND_CODES["completion"]) & (completion > 0)))
        for p, (partition, reader) in enumerate(zip(partitions, readers)):
            mine = within[bases[p] : bases[p + 1]]
            stored = Counts(
                special_token_literals=int(literals[bases[p] : bases[p + 1]].sum()),
                straddling_targets=int(reader.column("straddled")[mine].sum()),
                contamination_reported=int(reader.column("reported")[mine].sum()),
            )
            reader.drop_pages()
            lost = partial(_lost, rejects_path(Path(partition.path)))
            counts[partition.source] += Counts.from_report(partition.report, budgets[p], stored, lost)
        stored_rows = _Stored(readers, bases, lengths, n_targets, source, ordinals, within, starts, kinds)
        fitted = _fit(config, stored_rows, folder / PIECES_FILE, counts)
        if config.validation.share is not None or config.validation.samples is not None:
            row_hash = np.concatenate([np.zeros(0, np.uint64), *map(_hash_numbers, readers)])
            fitted = _hold_out(config, fitted, row_hash)
        before = {name: Tally.of(lengths[(source == i) & within]) for i, name in enumerate(names)}
    finally:
        for reader in readers:
            reader.close()
    return fitted, before


def _stored_columns(readers: list[PartitionReader], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Scalar columns of every stored row, in partition order, each partition's mapped pages dropped once its
    columns are copied out: kept mapped to the end of the plan, the store's pages that held them stayed resident
    (~80 B a sample of RssFile at 10M samples, most of the driver's VmHWM then)."""
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for reader in readers:
        for name in names:
            parts[name].append(reader.column(name))  # a copy: column() concatenates the batches' views
        reader.drop_pages()
    return {name: _concat(arrays) for name, arrays in parts.items()}


def _hash_numbers(reader: PartitionReader) -> np.ndarray:
    numbers = reader.hash_numbers()
    reader.drop_pages()
    return numbers


def _lost(rejects: Path, budget: int) -> Iterator[tuple[str, bool]]:
    """(reason, bad input) of each reject of a table before record `budget` (Counts.from_report)."""
    return ((r.reason, r.message is not None) for r in read_rejects(rejects, before=budget))


@dataclass(frozen=True)
class _Stored:
    """Every row the partitions store, in partition order: the columns the fit reads, one entry per row.

    Global row g is row g - bases[p] of readers[p], p the partition whose rows hold it (`locate`)."""

    readers: list[PartitionReader]
    bases: np.ndarray  # each partition's first global row, then the row count
    lengths: np.ndarray
    n_targets: np.ndarray
    source: np.ndarray  # the row's source, as an index into config.sources
    ordinals: np.ndarray  # the row's record, counted within its partition
    within: np.ndarray  # bool: the record is within its source's max_samples
    starts: np.ndarray  # bool: the row opens an item (a rejected side or a later completion does not)
    kinds: np.ndarray  # int8 KIND_CODES

    def locate(self, g: int) -> tuple[int, int]:
        """The partition holding global row `g`, and the row within it."""
        p = int(np.searchsorted(self.bases, g, side="right") - 1)
        return p, g - int(self.bases[p])


@dataclass(frozen=True)
class _Fitted:
    """Every kept segment before mixing, in input order (pieces of a split sample in place)."""

    ref: np.ndarray
    length: np.ndarray
    targets: np.ndarray  # target tokens of each segment (labels != -100 once packed)
    source: np.ndarray
    bucket: np.ndarray  # bool: routed to the overflow bucket
    start: np.ndarray  # bool: the segment opens an item (every plain sample and piece does)
    kind: np.ndarray  # int8 KIND_CODES of each segment
    drops: _Drops
    row: np.ndarray  # the global row of each segment's sample
    held_out: np.ndarray  # bool: in the validation split
    piece_numbers: np.ndarray  # piece k of pieces.arrow is part piece_numbers[k] of its sample ...
    piece_offsets: np.ndarray  # ... starting at token piece_offsets[k] of it (Truncation.numbers/offsets)
    # When packing balances vision work: the patches of every stored row, then of every piece (`segment_patches`).
    patches: np.ndarray | None = None

    def segment_patches(self, ref: np.ndarray) -> np.ndarray | None:
        """Vision patches (t * h * w summed over the images) of the segments `ref` names: a stored row's
        (ref >= 0) or a piece's (ref -(k + 1)); None when packing fills by tokens alone."""
        if self.patches is None:
            return None
        return self.patches[np.where(ref >= 0, ref, self.patches.size - len(self.piece_numbers) - ref - 1)]


def _file_patches(path: Path) -> np.ndarray:
    """Patches of every row of one store file, read from its grids alone (never the image bytes)."""
    with pa.memory_map(str(path)) as source:
        chunks = pa.ipc.open_file(source).read_all().column("images").chunks
        per_row = [np.zeros(0, np.int64)]
        for images in chunks:
            placed = images.flatten()  # StructArray.flatten, unlike .field, honours a slice's offset
            grids = as_numpy(placed.flatten()[placed.type.get_field_index("grid")].flatten()).reshape(-1, 3)
            row = np.repeat(np.arange(len(images)), np.diff(as_numpy(images.offsets)))
            per_row.append(np.bincount(row, weights=grids.astype(np.int64).prod(axis=1), minlength=len(images)))
    return np.concatenate(per_row).astype(np.int64)


def _fit(config: BuildConfig, stored: _Stored, pieces_path: Path, counts: dict[str, Counts]) -> _Fitted:
    """Truncation decisions: vectorized for samples that fit, one by one for the few that do not."""
    names = [s.name for s in config.sources]
    capacity = config.capacity
    lengths = stored.lengths
    bucket = (lengths > capacity) if config.overflow.mode == "bucket" else np.zeros(len(lengths), dtype=bool)
    limit = np.where(bucket, config.overflow.capacity or capacity, capacity)
    strategies = np.array([s.plan.truncation or config.truncation.strategy for s in config.sources], dtype=object)
    # stream mode cuts windows itself; nothing is removed
    cut = (lengths > limit) & (config.packing.strategy != "stream")
    trains = (stored.n_targets > 0) & stored.within
    drops = _DropLog()
    untrained = np.flatnonzero(stored.within & ~trains)
    drops.add(untrained, "no_targets", "no token of this sample is a target (check the train policy and template)")
    first, end, kept = _duplicates(config, stored, trains)
    trains[_segments_of(first, end - first)] = False  # a pair or group goes whole
    drops.add(first, "duplicate", None, kept)
    whole = trains & ~cut

    # per piece: global row, piece number, ref, length, offset, targets; six int64 each, not a tuple of ints
    piece_rows = array("q")
    writer = PartitionWriter(pieces_path, "")
    try:
        for row in np.flatnonzero(cut & trains):
            g = int(row)
            p, within_partition = stored.locate(g)
            sample = stored.readers[p].tokenized(within_partition)
            cap = int(limit[g])
            result = truncate(
                sample,
                cap,
                str(strategies[stored.source[g]]),
                fallback=config.truncation.fallback,
                seed=config.seed,
            )
            entry = counts[names[stored.source[g]]]
            if result.removed_tokens or result.strategy == "split":
                entry.note_truncation(result.strategy, result.removed_tokens, result.removed_targets)
            if result.drop_reason is not None:
                # A strategy that could not cut this sample says why (split on a conversation); drop itself
                # and a cut that left no target get the short line.
                detail = {
                    "too_long": f"{len(sample)} tokens > capacity {cap} (truncation: drop)"
                    if result.strategy == "drop"
                    else result.detail,
                    "no_targets": f"no target left after '{result.strategy}' truncation to {cap} tokens",
                }.get(result.drop_reason, result.detail)
                drops.add(np.array([g]), result.drop_reason, detail)
                continue
            for number, offset, piece in zip(result.numbers, result.offsets, result.samples):
                k = writer.append(piece, "", g)  # a piece's ordinal is its sample's global row
                piece_rows.extend((g, number, -(k + 1), len(piece), offset, piece.n_targets))
    finally:
        writer.close()

    kept_rows = np.flatnonzero(whole)
    pieces = np.frombuffer(piece_rows, dtype=np.int64).reshape(-1, 6)
    order_row = np.concatenate([kept_rows, pieces[:, 0]])
    order_piece = np.concatenate([np.zeros(len(kept_rows), dtype=np.int64), pieces[:, 1]])
    order = np.lexsort((order_piece, order_row))
    ref = np.concatenate([kept_rows, pieces[:, 2]])[order]
    seg_length = np.concatenate([lengths[kept_rows], pieces[:, 3]])[order]
    seg_targets = np.concatenate([stored.n_targets[kept_rows], pieces[:, 5]])[order]
    row_of = order_row[order]
    is_piece = np.concatenate([np.zeros(len(kept_rows), dtype=bool), np.ones(len(pieces), dtype=bool)])[order]
    start = stored.starts[row_of] | is_piece

    kept_samples = np.unique(row_of)
    kept_samples = kept_samples[stored.starts[kept_samples]]  # a pair or group is kept once, not once per segment
    logged = drops.done(stored)
    for i, name in enumerate(names):
        mine = kept_samples[stored.source[kept_samples] == i]
        counts[name].kept += len(mine)
        counts[name].overflow += int(bucket[mine].sum())
        for reason, n in zip(*np.unique(logged.reason[stored.source[logged.row] == i], return_counts=True)):
            counts[name].dropped[logged.reasons[reason]] += int(n)
    no = np.zeros(len(ref), dtype=bool)
    return _Fitted(
        ref=ref,
        length=seg_length,
        targets=seg_targets,
        source=stored.source[row_of],
        bucket=bucket[row_of],
        start=start,
        kind=stored.kinds[row_of],
        drops=logged,
        row=row_of,
        held_out=no,
        piece_numbers=pieces[:, 1].astype(np.int32),  # piece_rows are in append order: row k is piece k
        piece_offsets=pieces[:, 4].astype(np.int32),
    )


def _duplicates(config: BuildConfig, stored: _Stored, trains: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First row, end row and first row of the kept copy of every item that repeats an earlier one under `dedup:
    exact`, as three arrays (a tuple per copy held millions of them in a mixture with many copies).

    Two items are the same when their segments hold the same tokens, targets and roles (a group's rewards
    included): what the model would be trained on, whatever the id, the columns or the format of the records.
    Rows are in source order (sources as configured, then files, then records), so the first copy is kept:

        source a: x, y, x    source b: y      per-source (a):  a:2 duplicate of a:0
                                              dedup: exact:    a:2 of a:0, b:0 of a:1
    """
    scoped = np.array([config.dedup is not None or s.plan.dedup is not None for s in config.sources])
    items = np.flatnonzero(stored.starts)
    ends = np.append(items[1:], len(stored.starts))
    compared = trains[items] & scoped[stored.source[items]]
    items, ends = items[compared], ends[compared]
    if not len(items):
        return items, ends, items
    # Each item's key, in an array rather than a dict of digests (~150 B an item, held while comparing): its
    # source where copies count within a source, then its 16-byte digest; the first of equal keys is kept.
    keys = np.zeros((len(items), 3), np.uint64)
    if config.dedup is None:
        keys[:, 0] = stored.source[items]
    for k in range(len(items)):
        digest = hashlib.blake2b(digest_size=16)
        for g in range(int(items[k]), int(ends[k])):
            p, row = stored.locate(g)
            sample = stored.readers[p].get(row)
            digest.update(repr((len(sample.input_ids), sample.role)).encode())
            digest.update(sample.input_ids.tobytes())
            digest.update(sample.targets.tobytes())
        keys[k, 1:] = np.frombuffer(digest.digest(), np.uint64)
    _, firsts, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    kept = firsts[inverse.reshape(-1)]
    copies = np.flatnonzero(kept != np.arange(len(items)))
    return items[copies], ends[copies], items[kept[copies]]


def _int64s(values: array) -> np.ndarray:
    """A flat array of int64 (array "q") as a numpy array of its own."""
    return np.frombuffer(values, dtype=np.int64).copy() if len(values) else np.zeros(0, np.int64)


def _main_folder(
    config: BuildConfig, fitted: _Fitted, counts: dict[str, Counts], reached: dict[str, dict[str, int]]
) -> FolderPlan:
    """Source weights realized by seeded up- or down-sampling; copies keep their id and get a repeat number."""
    segments, repeat, item_sizes = _mixed(config, fitted, counts, reached)
    seg_ref, seg_len, seg_src = fitted.ref[segments], fitted.length[segments], fitted.source[segments]
    seg_kind = fitted.kind[segments]
    if config.packing.strategy == "stream":
        layout: PackPlan | StreamPlan = plan_stream(seg_len, config.capacity)
    elif (seg_kind == KIND_CODES["single"]).all():
        patches = fitted.segment_patches(seg_ref)
        layout = _layout(config, seg_len, seg_src, config.capacity, patches)  # no pair or group: exactly the v1 plan
        if config.mixing.interleave is not None:
            layout = _interleaved(config, config.mixing.interleave, layout, seg_len, fitted.targets[segments], seg_src)
    else:
        return _item_folder(config, seg_ref, repeat, seg_len, seg_src, seg_kind, item_sizes)
    return FolderPlan("", config.capacity, seg_ref, repeat, seg_len, layout)


def _mixed(
    config: BuildConfig, fitted: _Fitted, counts: dict[str, Counts], reached: dict[str, dict[str, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The main folder's segments after mixing, as indices into `fitted` (whole items, sources in order, an item
    once per copy), each one's repeat number, and each chosen item's segment count. `reached` gets what each
    quota's copies hold of its unit, named as the shards' per-source stats name it (a dry run judges quotas by it).

    Indices alone leave, so each column is gathered once: gathered per source and then joined, every column
    was held twice while the packs were planned, ~60 B a sample (issue 43)."""
    names = [s.name for s in config.sources]
    main = np.flatnonzero(~fitted.bucket & ~fitted.held_out)
    length, source = fitted.length[main], fitted.source[main]
    offsets = np.append(np.flatnonzero(fitted.start[main]), len(main))  # item i: segments offsets[i]..offsets[i+1]
    item_source = source[offsets[:-1]]
    quotas = source_quotas(config)
    present = [i for i in range(len(names)) if (source == i).any() and names[i] not in quotas]
    multipliers = source_multipliers(
        {names[i]: int((source == i).sum()) for i in present},
        {names[i]: int(length[source == i].sum()) for i in present},
        {s.name: s.plan.weight for s in config.sources},
        config.mixing.by,
    )
    chosen, repeats, sizes = [np.zeros(0, np.int64)], [np.zeros(0, np.int32)], [np.zeros(0, np.int64)]
    for i, name in enumerate(names):
        mine = np.flatnonzero(item_source == i)
        if name in quotas:
            per_segment = length if quotas[name].unit == "tokens" else fitted.targets[main]
            item_amounts = np.add.reduceat(per_segment, offsets[:-1])[mine] if len(mine) else np.zeros(0, np.int64)
            amount, seed = quotas[name].amount, source_seed(config.seed, name)
            positions, repeat = quota_plan(item_amounts, amount, seed=seed, source=name)
            reached[name] = {REALIZED[quotas[name].unit]: int(item_amounts[positions].sum())}
        else:
            multiplier, seed = multipliers.get(name, 1.0), source_seed(config.seed, name)
            positions, repeat = repeat_plan(len(mine), multiplier, seed=seed, source=name)
        chosen_items = mine[positions]  # whole items: a copy of a pair copies both sides
        size = offsets[chosen_items + 1] - offsets[chosen_items]
        segments = _segments_of(offsets[chosen_items], size)
        chosen.append(main[segments])
        repeats.append(np.repeat(repeat, size))
        sizes.append(size)
        counts[name].segments += len(segments)
    return np.concatenate(chosen), np.concatenate(repeats), np.concatenate(sizes)


def _interleaved(
    config: BuildConfig,
    interleave: Interleaving,
    layout: PackPlan,
    tokens: np.ndarray,
    targets: np.ndarray,
    source: np.ndarray,
) -> PackPlan:
    """The packs in `interleave_order`, after packing (so packing keeps its efficiency): a pack holding several
    sources counts each segment for its own source. A build whose windows cannot hold the mix within the
    tolerance fails here, before a shard is written, naming the source and the window."""
    names = [s.name for s in config.sources]
    pack = np.repeat(np.arange(layout.n_packs), layout.segments())
    members = layout.members
    amounts = mix_amounts(
        pack, source[members], interleave.unit, tokens[members], targets[members], (layout.n_packs, len(names))
    )
    order = interleave_order(amounts, interleave.window)
    mix = window_mix(amounts[order], interleave.window)
    where = f"{config.config_file}: mixing.interleave"
    if mix.windows == 0:
        raise BuildError(
            f"{where}: window {interleave.window} > the build's {layout.n_packs} packs, so no whole window holds "
            "the mix; lower mixing.interleave.window"
        )
    s = int(np.argmax(mix.deviation))
    if mix.deviation[s] > interleave.tolerance + WINDOW_SLACK:
        w = int(mix.worst[s])
        raise BuildError(
            f"{where}: source {names[s]!r} is {mix.deviation[s]:.4f} off its share {mix.share[s]:.4f} of "
            f"{interleave.unit} in window {w} (packs {w * interleave.window}..{(w + 1) * interleave.window - 1}) "
            f"> tolerance {interleave.tolerance}; raise mixing.interleave.window (more packs per window even out "
            "large packs and small sources) or the tolerance"
        )
    return reordered(layout, order)


def _hold_out(config: BuildConfig, fitted: _Fitted, row_hash: np.ndarray) -> _Fitted:
    """The validation split, chosen by content: a seeded hash of each sample's record hash decides, so
    records with identical content always land on the same side (no copy straddles the split).

    share s: a sample is held out when its hash, read as a number in [0, 1), is below s.
    samples n: whole groups of identical records in hash order until at least n samples are held out.
    `row_hash`: each stored row's sample_hash as a number (PartitionReader.hash_numbers).
    """
    score = splitmix64(row_hash, config.seed)
    eligible = ~fitted.bucket
    sample_score = score[fitted.row]
    if config.validation.share is not None:
        held = sample_score < np.uint64(min(int(config.validation.share * 2.0**64), 2**64 - 1))
    else:
        groups, sizes = np.unique(row_hash[np.unique(fitted.row[eligible])], return_counts=True)
        order = np.argsort(splitmix64(groups, config.seed), kind="stable")
        needed = int(np.searchsorted(np.cumsum(sizes[order]), config.validation.samples or 0)) + 1
        held = np.isin(row_hash[fitted.row], groups[order[:needed]])
    return replace(fitted, held_out=held & eligible)


def _validation_folder(config: BuildConfig, fitted: _Fitted) -> FolderPlan:
    held = fitted.held_out
    length, source, kind = fitted.length[held], fitted.source[held], fitted.kind[held]
    repeat = np.zeros(int(held.sum()), np.int32)
    if config.packing.strategy != "stream" and (kind != KIND_CODES["single"]).any():
        # a pair's sides share its record hash, so they are held out together: plan them as whole items
        sizes = np.diff(np.append(np.flatnonzero(fitted.start[held]), int(held.sum())))
        items = _item_folder(config, fitted.ref[held], repeat, length, source, kind, sizes)
        return replace(items, name="validation")
    layout = (
        plan_stream(length, config.capacity)
        if config.packing.strategy == "stream"
        else _layout(config, length, source, config.capacity, fitted.segment_patches(fitted.ref[held]))
    )
    return FolderPlan("validation", config.capacity, fitted.ref[held], repeat, length, layout)


def _segments_of(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Segment indices of items given their first segment and size: starts [0, 5], sizes [2, 1] -> [0, 1, 5]."""
    ends = np.cumsum(sizes)
    return np.repeat(starts - (ends - sizes), sizes) + np.arange(int(ends[-1]) if len(ends) else 0)


def _item_folder(
    config: BuildConfig,
    ref: np.ndarray,
    repeat: np.ndarray,
    length: np.ndarray,
    source: np.ndarray,
    kind: np.ndarray,
    item_sizes: np.ndarray,
) -> FolderPlan:
    """Items placed whole (plan_items), each pair or group with its group id: its index in planning order."""
    item_offsets = np.concatenate([[0], np.cumsum(item_sizes)]).astype(np.int64)
    first_kind = kind[item_offsets[:-1]]
    types = np.select(
        [first_kind == KIND_CODES["chosen"], first_kind == KIND_CODES["completion"]], ["pair", "group"], "single"
    )
    group, _, _ = segment_columns(item_offsets, types)
    groups = None
    if config.packing.group_by == "source":
        labels = np.array([s.plan.group or s.name for s in config.sources], dtype=object)
        groups = labels[source[item_offsets[:-1]]]
    largest = int(item_sizes.max())
    max_segments = config.packing.max_segments
    if max_segments is not None and largest > max_segments:
        raise BuildError(
            f"{config.config_file}: packing.max_segments {max_segments} < {largest}, the segments of one "
            "group (a group is never split across packs); raise packing.max_segments or drop that group"
        )
    plan = plan_items(
        length,
        item_offsets,
        config.capacity,
        config.packing.strategy,
        seed=config.seed,
        max_segments=config.packing.max_segments,
        shuffle=config.packing.shuffle,
        groups=groups,
    )
    return FolderPlan("", config.capacity, ref, repeat, length, plan.segments, group)


def _overflow_folder(config: BuildConfig, fitted: _Fitted, counts: dict[str, Counts]) -> FolderPlan:
    names = [s.name for s in config.sources]
    spilled = fitted.bucket
    for i, name in enumerate(names):
        counts[name].segments += int((fitted.source[spilled] == i).sum())
    capacity = config.overflow.capacity or config.capacity
    ref, length = fitted.ref[spilled], fitted.length[spilled]
    layout = _layout(config, length, fitted.source[spilled], capacity, fitted.segment_patches(ref))
    return FolderPlan("overflow", capacity, ref, np.zeros(len(ref), dtype=np.int32), length, layout)


def _layout(
    config: BuildConfig, lengths: np.ndarray, source: np.ndarray, capacity: int, patches: np.ndarray | None = None
) -> PackPlan:
    """Global plan; with group_by: source, one plan per group so no pack mixes groups; with `patches`, each
    pack's vision patches near their mean (packing.plan_vision)."""
    seed, max_segments, shuffle = config.seed, config.packing.max_segments, config.packing.shuffle
    strategy = config.packing.strategy
    if config.packing.group_by != "source":
        return plan_packs(
            lengths, capacity, strategy, seed=seed, max_segments=max_segments, shuffle=shuffle, patches=patches
        )
    groups = np.array([s.plan.group or s.name for s in config.sources], dtype=object)[source]
    return plan_groups(
        lengths, groups, capacity, strategy, seed=seed, max_segments=max_segments, shuffle=shuffle, patches=patches
    )


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


def _budgets(config: BuildConfig, partitions: list[Partition]) -> list[int]:
    """How many leading records of each file count: all, or what is left of its source's max_samples."""
    left = {s.name: s.max_samples for s in config.sources}
    budgets = []
    for partition in partitions:
        read = partition.report["read"]
        remaining = left[partition.source]
        budget = read if remaining is None else min(read, remaining)
        if remaining is not None:
            left[partition.source] = remaining - budget
        budgets.append(budget)
    return budgets


@dataclass(frozen=True)
class _Drops:
    """The plan's own drops, one entry per dropped sample as arrays, in the order rejects.jsonl lists them
    (partition, record, then the order they were decided in). Details are held once per distinct text; a
    duplicate's (-1) names its kept copy, read from the store as its line is written."""

    row: np.ndarray  # the global row of the sample (of an item's first row)
    partition: np.ndarray
    ordinal: np.ndarray
    reason: np.ndarray  # index into reasons
    detail: np.ndarray  # index into details; -1: a duplicate's
    kept: np.ndarray  # the global row of the copy kept (a duplicate's), -1 otherwise
    reasons: list[str]
    details: list[str]
    bases: np.ndarray  # each partition's first global row, then the row count (_Stored.bases)


class _DropLog:
    """The plan's drops as they are decided, four int64 columns in flat arrays: never a dict per dropped sample,
    which held ~0.5 KB each (dedup can drop millions, issue 43)."""

    def __init__(self) -> None:
        self._rows, self._reasons, self._details, self._kept = array("q"), array("q"), array("q"), array("q")
        self._reason_index: dict[str, int] = {}
        self._detail_index: dict[str, int] = {}

    def add(self, rows: np.ndarray, reason: str, detail: str | None, kept: np.ndarray | None = None) -> None:
        """Drop `rows` for `reason` with one `detail` (None: a duplicate's, with its `kept` rows)."""
        n = len(rows)
        code = self._reason_index.setdefault(reason, len(self._reason_index))
        text = -1 if detail is None else self._detail_index.setdefault(detail, len(self._detail_index))
        self._rows.frombytes(np.asarray(rows, np.int64).tobytes())
        self._reasons.frombytes(np.full(n, code, np.int64).tobytes())
        self._details.frombytes(np.full(n, text, np.int64).tobytes())
        self._kept.frombytes((np.full(n, -1, np.int64) if kept is None else np.asarray(kept, np.int64)).tobytes())

    def done(self, stored: _Stored) -> _Drops:
        row, reason, detail, kept = map(_int64s, (self._rows, self._reasons, self._details, self._kept))
        partition = np.searchsorted(stored.bases, row, side="right") - 1
        ordinal = stored.ordinals[row]
        order = np.lexsort((np.arange(len(row)), ordinal, partition))  # stable: decided first, listed first
        return _Drops(
            row[order],
            partition[order],
            ordinal[order],
            reason[order],
            detail[order],
            kept[order],
            list(self._reason_index),
            list(self._detail_index),
            stored.bases,
        )


def _write_rejects(path: Path, partitions: list[Partition], budgets: list[int], drops: _Drops) -> PlanRejects:
    """Encode rejects and plan drops merged in input order (source, file, record number) into PLAN/rejects.jsonl,
    a line at a time: each partition's rejects table within its budget beside the plan's drops of its rows (an
    encode reject first where both name one record), counted by reason as they are written."""
    by_reason: Counter[str] = Counter()
    bases = drops.bases
    readers: dict[int, PartitionReader] = {}

    def reader(g: int) -> tuple[PartitionReader, int]:
        p = int(np.searchsorted(bases, g, side="right") - 1)
        if p not in readers:
            readers[p] = PartitionReader(Path(partitions[p].path))
        return readers[p], g - int(bases[p])

    def dropped(d: int, source: str) -> dict[str, Any]:
        held, row = reader(int(drops.row[d]))
        entry = {"id": held.example_id(row), "source": source, "location": held.location(row)}
        if drops.detail[d] >= 0:
            return {**entry, "reason": drops.reasons[drops.reason[d]], "detail": drops.details[drops.detail[d]]}
        kept, kept_row = reader(int(drops.kept[d]))
        kept_id = kept.example_id(kept_row)
        detail = f"same tokens and targets as {kept_id!r} ({kept.location(kept_row)}), which is kept"
        return {**entry, "reason": "duplicate", "detail": detail, "duplicate_of": kept_id}

    spans = np.searchsorted(drops.partition, np.arange(len(partitions) + 1))
    try:
        with open(path, "w", encoding="utf-8") as handle:
            for p, partition in enumerate(partitions):
                # a work item that lost no record has an empty table: not opened (thousands of them at scale)
                lost = sum(partition.report["rejected"].values()) + sum(partition.report["dropped"].values())
                table = rejects_path(Path(partition.path))
                rejects = read_rejects(table, before=budgets[p]) if lost else iter(())
                encoded = ((r.ordinal, r.entry(partition.source)) for r in rejects)
                planned = ((int(drops.ordinal[d]), dropped(d, partition.source)) for d in range(spans[p], spans[p + 1]))
                # merge is stable: where both name one record, the encode reject (the first iterable) comes first
                for _, entry in heapq.merge(encoded, planned, key=itemgetter(0)):
                    by_reason[entry["reason"]] += 1
                    handle.write(_line(entry))
                _close(readers)  # their pages go: a kept copy's partition is opened again when named
    finally:
        _close(readers)
    return PlanRejects(path, dict(sorted(by_reason.items())))


def _close(readers: dict[int, PartitionReader]) -> None:
    for reader in readers.values():
        reader.close()
    readers.clear()


def _line(entry: dict[str, Any]) -> str:
    """One line of rejects.jsonl."""
    return json.dumps(entry, ensure_ascii=False, sort_keys=True) + "\n"
