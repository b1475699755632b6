"""The build: the only module that knows the order of the stages.

    read -> render -> encode -> truncate -> spill -> mix -> plan -> emit -> manifest

Samples are spilled to a memory-mapped Arrow file as they are encoded (store.py); mixing and
planning work on lengths and indices only, and emit reads back just the samples of each pack.

Stages never call each other; this module drains one into the next, applies the error policy,
and counts every sample that does not reach a pack under a reason, so that for each source

    read == rejected + dropped + kept        and        packed segments == kept x copies (+ split pieces)
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import packtool
from packtool.config import BuildConfig, SourceConfig
from packtool.encode import TextTokenizer, encode_batch, has_special_literal, load_tokenizer
from packtool.errors import PacktoolError, RecordError
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths, labels_for
from packtool.packing import PackPlan, StreamPlan, plan_groups, plan_packs, plan_stream
from packtool.records import ROLE_CODES, Drop, Example, Rendered, Tokenized
from packtool.render import ChatTemplate, render_example, template_for
from packtool.shards import MANIFEST, REJECTS, PackRow, ShardInfo, conventions, write_json_atomic, write_shards
from packtool.sources import read_source
from packtool.stats import summarize
from packtool.store import SampleReader, SampleStore, StoredSample
from packtool.truncate import truncate

ENCODE_BATCH = 512
WORK_DIR = ".packtool-work"  # spilled samples during a build; removed when it ends


@dataclass
class SourceCounts:
    """What happened to each record of one source (the manifest's `accounting`)."""

    read: int = 0
    kept: int = 0
    overflow: int = 0
    rejected: Counter = field(default_factory=Counter)  # bad input, by reason
    dropped: Counter = field(default_factory=Counter)  # valid input not trained (too_long, no_targets), by reason
    truncated: dict[str, dict[str, int]] = field(default_factory=dict)  # strategy -> samples/tokens/targets removed
    special_token_literals: int = 0
    segments: int = 0  # what reached a pack: mixing copies, split pieces and the bucket included

    def note_truncation(self, strategy: str, tokens: int, targets: int) -> None:
        entry = self.truncated.setdefault(strategy, {"samples": 0, "tokens": 0, "targets": 0})
        entry["samples"] += 1
        entry["tokens"] += tokens
        entry["targets"] += targets

    def as_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "kept": self.kept,
            "overflow": self.overflow,
            "rejected": dict(sorted(self.rejected.items())),
            "dropped": dict(sorted(self.dropped.items())),
            "truncated": {k: self.truncated[k] for k in sorted(self.truncated)},
            "special_token_literals": self.special_token_literals,
            "segments": self.segments,
        }


class _Rejects:
    """Collects rejected and dropped samples; applies on_error=fail to bad input."""

    def __init__(self, on_error: str):
        self.on_error = on_error
        self.entries: list[Drop] = []

    def bad_input(self, error: RecordError, source: str, counts: SourceCounts, location: str = "") -> None:
        if not error.file and location:
            error.file = location
        if self.on_error == "fail":
            raise PacktoolError(f"{error.describe()} [{error.kind}] (on_error: skip sends such records to {REJECTS})")
        counts.rejected[error.kind] += 1
        where = error.file if error.row is None else f"{error.file}:{error.row}"
        detail = f"field '{error.field}': {error.reason}" if error.field else error.reason
        self.entries.append(Drop(error.sample_id, source, error.kind, detail, where))

    def drop(self, drop: Drop, counts: SourceCounts) -> None:
        counts.dropped[drop.reason] += 1
        self.entries.append(drop)


def build(config: BuildConfig, *, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the whole build and return the manifest (also written to OUTPUT/manifest.json, last)."""
    output = Path(config.output)
    output.mkdir(parents=True, exist_ok=True)
    for stale in (output / MANIFEST, output / "overflow" / MANIFEST):
        stale.unlink(missing_ok=True)
    stages = _Stages.load(config)
    tokenizer, template = stages.tokenizer, stages.template

    rejects = _Rejects(config.on_error)
    counts: dict[str, SourceCounts] = {s.name: SourceCounts() for s in config.sources}
    work = output / WORK_DIR
    store = SampleStore(work / "samples.arrow")
    kept: list[int] = []
    overflow: list[int] = []
    with _pool(config) as pool:
        for source in config.sources:
            for sample, location in _tokenized(stages, pool, source, rejects, counts[source.name], progress):
                routed = _fit(sample, location, source, config, rejects, counts[source.name])
                if routed is None:
                    continue
                bucket, pieces = routed
                (overflow if bucket else kept).extend(store.append(piece) for piece in pieces)
    reader = store.close()
    try:
        main = _mixed(reader, np.asarray(kept, dtype=np.int64), config)
        spilled = _Segments(reader, np.asarray(overflow, dtype=np.int64), np.zeros(len(overflow), dtype=np.int32))
        for source in main.sources + spilled.sources:
            counts[source].segments += 1
        extra: dict[str, Any] = {}
        if config.overflow == "bucket":
            capacity = config.overflow_capacity or config.capacity
            bucket = _emit(spilled, output / "overflow", capacity, config, tokenizer, template, counts, [], {})
            extra["overflow"] = {
                "folder": "overflow",
                "capacity": capacity,
                "packs": bucket["stats"]["packs"],
                "segments": len(overflow),
            }
        # The main manifest goes last: its presence means every shard, the bucket included, is complete.
        return _emit(main, output, config.capacity, config, tokenizer, template, counts, rejects.entries, extra)
    finally:
        reader.close()
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class _Segments:
    """What one output packs: stored samples by index, each with its repeat number (source mixing)."""

    reader: SampleReader
    index: np.ndarray  # int64 into the store
    repeat: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        return self.reader.lengths[self.index]

    @property
    def sources(self) -> list[str]:
        return [self.reader.sources[i] for i in self.index]

    def get(self, k: int) -> StoredSample:
        return self.reader.get(int(self.index[k]), int(self.repeat[k]))


@dataclass(frozen=True)
class _Stages:
    """Render and encode, with what they need loaded once per process (the build's, or a worker's)."""

    config: BuildConfig
    tokenizer: TextTokenizer
    template: ChatTemplate | None

    @classmethod
    def load(cls, config: BuildConfig) -> _Stages:
        tokenizer = load_tokenizer(config.tokenizer)
        return cls(config, tokenizer, template_for(config, tokenizer.config))

    def prepare(self, chunk: list[Example | RecordError], source_name: str) -> list[_Outcome]:
        """Each input in order: its Tokenized sample or the RecordError saying why not, and whether
        its content spells a special token."""
        source = next(s for s in self.config.sources if s.name == source_name)
        outcomes: list[_Outcome] = []
        pending: list[tuple[Rendered, str]] = []
        waiting: list[int] = []
        for item in chunk:
            if isinstance(item, RecordError):
                outcomes.append(_Outcome("", item.sample_id, item))
                continue
            try:
                rendered = self.render(item, source)
            except RecordError as error:
                error.sample_id = item.id
                outcomes.append(_Outcome(item.location, item.id, error))
                continue
            # counted for every policy; `reject` counts when encode rejects the sample
            literal = source.special_tokens != "reject" and has_special_literal(rendered, self.tokenizer)
            outcomes.append(_Outcome(item.location, item.id, None, literal))
            pending.append((rendered, source.special_tokens))
            waiting.append(len(outcomes) - 1)
        results = (
            encode_batch(pending, self.tokenizer, add_bos=bool(self.config.add_bos), add_eos=bool(self.config.add_eos))
            if pending
            else []
        )
        for index, result in zip(waiting, results):
            outcomes[index] = replace(outcomes[index], result=result)
        return outcomes

    def render(self, example: Example, source: SourceConfig) -> Rendered:
        return render_example(
            example,
            self.template,
            self.tokenizer.config,
            source.train,
            add_bos=self.config.add_bos,
            add_eos=self.config.add_eos,
        )


@dataclass(frozen=True, slots=True)
class _Outcome:
    location: str
    example_id: str
    result: Tokenized | RecordError | None
    special_literal: bool = False


_WORKER: _Stages | None = None


def _start_worker(config: BuildConfig) -> None:
    global _WORKER
    # Each worker is one of N processes already: a tokenizer thread pool per worker would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = _Stages.load(config)


def _prepare_in_worker(chunk: list[Example | RecordError], source_name: str) -> list[_Outcome]:
    if _WORKER is None:
        raise RuntimeError("worker used before _start_worker ran")
    return _WORKER.prepare(chunk, source_name)


def _chunks(items: Iterator[Example | RecordError], size: int) -> Iterator[list[Example | RecordError]]:
    chunk: list[Example | RecordError] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _prepared(stages: _Stages, pool: Executor | None, source: SourceConfig) -> Iterator[list[_Outcome]]:
    """Chunks of outcomes in input order, whether prepared here or by a pool of worker processes."""
    chunks = _chunks(read_source(source), ENCODE_BATCH)
    if pool is None:
        # One chunk renders (Python, holds the GIL) while the one before it tokenizes (Rust, releases
        # the GIL): two threads overlap the two halves of the work on a single process.
        with ThreadPoolExecutor(2) as threads:
            yield from _in_order(threads, stages.prepare, chunks, source.name, depth=2)
        return
    yield from _in_order(pool, _prepare_in_worker, chunks, source.name, depth=2 * stages.config.workers)


def _in_order(executor: Executor, fn: Callable, chunks: Iterator, source_name: str, *, depth: int) -> Iterator:
    """Results of fn over chunks, in input order, with at most `depth` chunks in flight (bounded memory)."""
    in_flight: deque[Future] = deque()
    for chunk in chunks:
        in_flight.append(executor.submit(fn, chunk, source_name))
        if len(in_flight) >= depth:
            yield in_flight.popleft().result()
    while in_flight:
        yield in_flight.popleft().result()


@contextmanager
def _pool(config: BuildConfig) -> Iterator[Executor | None]:
    """Worker processes for render + encode when config.workers > 1.

    Spawned, not forked: tokenizers' thread pool does not survive a fork."""
    if config.workers <= 1:
        yield None
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(config.workers, mp_context=context, initializer=_start_worker, initargs=(config,)) as pool:
        yield pool


def _tokenized(
    stages: _Stages,
    pool: Executor | None,
    source: SourceConfig,
    rejects: _Rejects,
    counts: SourceCounts,
    progress: Callable[[int], None] | None,
) -> Iterator[tuple[Tokenized, str]]:
    """Samples of one source that rendered and encoded; everything else is counted and rejected in order."""
    for outcomes in _prepared(stages, pool, source):
        for outcome in outcomes:
            counts.read += 1
            counts.special_token_literals += outcome.special_literal
            result = outcome.result
            if isinstance(result, Tokenized):
                yield result, outcome.location
            elif isinstance(result, RecordError) and result.kind == "special_token_literal":
                counts.special_token_literals += 1
                drop = Drop(outcome.example_id, source.name, result.kind, result.reason, outcome.location)
                rejects.drop(drop, counts)
            elif isinstance(result, RecordError):
                result.sample_id = result.sample_id or outcome.example_id
                rejects.bad_input(result, source.name, counts, outcome.location)
        if progress:
            progress(len(outcomes))


def _fit(
    sample: Tokenized, location: str, source: SourceConfig, config: BuildConfig, rejects: _Rejects, counts: SourceCounts
) -> tuple[bool, list[Tokenized]] | None:
    """Truncate (or route to the overflow bucket) one sample; None when it is dropped."""
    capacity = config.capacity
    bucket = config.overflow == "bucket" and len(sample) > capacity
    if bucket:
        capacity = config.overflow_capacity or capacity
    strategy = source.truncation or config.truncation
    if config.packing == "stream":
        strategy = "none"  # stream mode cuts windows itself; nothing is removed
    if strategy != "none" and len(sample) > capacity:
        result = truncate(sample, capacity, strategy, fallback=config.truncation_fallback, seed=config.seed)
        if result.removed_tokens or result.strategy == "split":
            counts.note_truncation(result.strategy, result.removed_tokens, result.removed_targets)
        if result.drop_reason is not None or not result.samples:
            reason = result.drop_reason or "no_targets"
            detail = (
                f"{len(sample)} tokens > capacity {capacity} (truncation: drop)"
                if reason == "too_long"
                else f"no target left after '{result.strategy}' truncation to {capacity} tokens"
            )
            rejects.drop(Drop(sample.example_id, source.name, reason, detail, location), counts)
            return None
        pieces = list(result.samples)
    else:
        pieces = [sample]
    pieces = [p for p in pieces if p.n_targets > 0]
    if not pieces:
        rejects.drop(
            Drop(
                sample.example_id,
                source.name,
                "no_targets",
                "no token of this sample is a target (check the train policy and template)",
                location,
            ),
            counts,
        )
        return None
    counts.kept += 1
    counts.overflow += bucket
    return bucket, pieces


def _mixed(reader: SampleReader, kept: np.ndarray, config: BuildConfig) -> _Segments:
    """Realize source weights by seeded up- or down-sampling; copies keep their id and get a repeat index."""
    by_source: dict[str, list[int]] = defaultdict(list)
    for index in kept.tolist():
        by_source[reader.sources[index]].append(index)
    multipliers = source_multipliers(
        {name: len(items) for name, items in by_source.items()},
        {name: int(reader.lengths[items].sum()) for name, items in by_source.items()},
        {s.name: s.weight for s in config.sources},
        config.mix_by,
    )
    indices: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    repeats: list[np.ndarray] = [np.zeros(0, dtype=np.int32)]
    for name in (s.name for s in config.sources):
        items = np.asarray(by_source.get(name, []), dtype=np.int64)
        positions, repeat = repeat_plan(len(items), multipliers.get(name, 1.0), seed=_seed(config.seed, name))
        indices.append(items[positions])
        repeats.append(repeat)
    return _Segments(reader, np.concatenate(indices), np.concatenate(repeats))


def source_multipliers(
    samples: dict[str, int], tokens: dict[str, int], weights: dict[str, float], mode: str
) -> dict[str, float]:
    """How many copies of each source's samples to take.

    multiplier: the weight itself (2.0 doubles a source). samples/tokens: weights are target
    shares of samples/tokens; multipliers m_i = share_i * total / own_i keep the total unchanged.
    """
    present = [name for name in samples if samples[name] > 0]
    if mode == "multiplier":
        return {name: weights[name] for name in present}
    amount = samples if mode == "samples" else tokens
    total = sum(amount[n] for n in present)
    weight_sum = sum(weights[n] for n in present)
    return {n: (weights[n] / weight_sum) * total / amount[n] for n in present}


def repeat_plan(n: int, multiplier: float, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, repeat numbers) of the copies of n samples: floor(m) full passes, then
    round(frac(m) * n) samples chosen by a seeded permutation.

    n=4, m=1.5 -> positions [0 1 2 3 | 1 3], repeats [0 0 0 0 | 1 1]   (which two: the seed decides)
    """
    whole = int(np.floor(multiplier))
    extra = round((multiplier - whole) * n)
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:extra]) if extra else np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.tile(np.arange(n), whole), chosen]).astype(np.int64)
    repeats = np.concatenate([np.repeat(np.arange(whole), n), np.full(len(chosen), whole)]).astype(np.int32)
    return positions, repeats


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def _emit(
    segments: _Segments,
    folder: Path,
    capacity: int,
    config: BuildConfig,
    tokenizer: TextTokenizer,
    template: ChatTemplate | None,
    counts: dict[str, SourceCounts],
    entries: list[Drop],
    extra: dict[str, Any],
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("shard-*.parquet"):
        old.unlink()
    lengths = segments.lengths
    stream = config.packing == "stream"
    if stream:
        rows: Iterator[PackRow] = _stream_rows(segments, plan_stream(lengths, capacity))
    else:
        plan = _plan(segments.sources, lengths, capacity, config)
        rows = (_pack_row([segments.get(k) for k in plan.members[a:b]]) for a, b in zip(plan.offsets, plan.offsets[1:]))
    metadata = {
        "packtool.version": packtool.__version__,
        "packtool.capacity": str(capacity),
        "packtool.mode": "stream" if stream else "packed",
    }
    shards = write_shards(
        rows, folder, rows_per_shard=config.rows_per_shard, row_group_rows=config.row_group_rows, metadata=metadata
    )
    _write_rejects(folder / REJECTS, entries)
    manifest = {**_manifest(config, capacity, tokenizer, template, shards, counts, entries, stream), **extra}
    manifest["stats"] = summarize([folder / s.file for s in shards], manifest)
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def _plan(sources: list[str], lengths: np.ndarray, capacity: int, config: BuildConfig) -> PackPlan:
    """Global plan; with group_by: source, one plan per group so no pack mixes groups."""
    options = {"seed": config.seed, "max_segments": config.max_segments, "shuffle": config.shuffle_packs}
    if config.group_by != "source":
        return plan_packs(lengths, capacity, config.packing, **options)
    group_of = {s.name: s.group or s.name for s in config.sources}
    return plan_groups(lengths, [group_of[source] for source in sources], capacity, config.packing, **options)


def _pack_row(members: list[StoredSample]) -> PackRow:
    ids = np.concatenate([m.input_ids for m in members])
    targets = np.concatenate([m.targets for m in members])
    cu = cu_seqlens_from_lengths([len(m) for m in members])
    return PackRow(
        input_ids=ids,
        labels=labels_for(ids, targets, cu),
        cu_seqlens=cu,
        doc_cu_seqlens=cu,
        token_roles=np.concatenate([m.roles for m in members]),
        sample_ids=[m.example_id for m in members],
        sample_hashes=[m.sample_hash for m in members],
        sample_repeats=[m.repeat for m in members],
        sources=[m.source for m in members],
    )


def _stream_rows(segments: _Segments, plan: StreamPlan) -> Iterator[PackRow]:
    """Continuous pretraining windows: one attention segment per window; documents see each other."""
    for a, b in zip(plan.offsets, plan.offsets[1:]):
        pieces = [
            (segments.get(k), int(st), int(en))
            for k, st, en in zip(plan.samples[a:b], plan.starts[a:b], plan.ends[a:b])
        ]
        ids = np.concatenate([s.input_ids[st:en] for s, st, en in pieces])
        labels = ids.astype(np.int32).copy()
        labels[0] = IGNORE_INDEX  # a window's first token has no context inside the window
        yield PackRow(
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


def _write_rejects(path: Path, entries: list[Drop]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        for drop in entries:
            record = {
                "id": drop.example_id,
                "source": drop.source,
                "location": drop.location,
                "reason": drop.reason,
                "detail": drop.detail,
            }
            handle.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
    temporary.replace(path)


def _manifest(
    config: BuildConfig,
    capacity: int,
    tokenizer: TextTokenizer,
    template: ChatTemplate | None,
    shards: list[ShardInfo],
    counts: dict[str, SourceCounts],
    entries: list[Drop],
    stream: bool,
) -> dict[str, Any]:
    by_reason = Counter(d.reason for d in entries)
    return {
        "packtool_version": packtool.__version__,
        "schema_version": packtool.SCHEMA_VERSION,
        "mode": "stream" if stream else "packed",
        "capacity": capacity,
        "seed": config.seed,
        "config": config.raw,
        "config_hash": config.config_hash,
        "tokenizer": {
            "file": tokenizer.path,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id,
        },
        "template": None if template is None else {"name": template.name, "sha256": template.sha256},
        "truncation": {"strategy": config.truncation, "fallback": config.truncation_fallback},
        "packing": {
            "strategy": config.packing,
            "group_by": config.group_by,
            "max_segments": config.max_segments,
            "shuffle": config.shuffle_packs,
        },
        "mixing": {
            "by": config.mix_by,
            "weights": {s.name: s.weight for s in config.sources},
            "loss_normalization": "token-level: sum of target losses / targets in the update window",
        },
        "conventions": conventions(stream),
        "role_codes": ROLE_CODES,
        "shards": [asdict(s) for s in shards],
        "accounting": {name: c.as_dict() for name, c in counts.items()},
        "rejects": {"file": REJECTS, "count": len(entries), "by_reason": dict(sorted(by_reason.items()))},
    }
