"""Stream packs from a build folder, split across ranks and workers, resumable from a few integers.

Units of work are row groups. One epoch::

    units (shard, row_group)      u0 u1 u2 u3 u4 u5 u6 u7       from the Parquet footers
    seeded permutation (epoch e)  u5 u2 u7 u0 u3 u6 u1 u4       rng([seed, e])
    rank r = position % world     r0: u5 u7 u3 u1   r1: u2 u0 u6 u4
    worker w of rank r0 (2)       w0: u5 u3         w1: u7 u1
    rows inside a unit            shuffled with rng([seed, e, unit])

Only one row group per worker is in memory at a time (`ParquetFile.read_row_group`), never a
whole file. Mixing happens at row-group granularity plus within the row group: the builder
already shuffled packs globally, so this is enough to vary the order between epochs.

Exact resume. A `DataLoader` over an `IterableDataset` hands the consumer items round-robin
from its workers (worker 0, 1, ..., k-1, 0, ...), skipping a worker once it is exhausted. Every
worker's stream length is known from the footers, so the consumer-side count `consumed` of packs
already trained determines exactly how many packs each worker had delivered (`_taken_per_worker`).
After a restart each worker skips that many (whole row groups are skipped unread), and worker 0
takes over the stream whose turn it was (streams are rotated, keeping their cyclic order), so the
consumer sees the same sequence as without the restart: no pack is repeated, lost or reordered.
The state is `{epoch, consumed, seed, world_size, num_workers}`; mid-epoch it is only valid with
the same world size and worker count, which `load_state_dict` / `__iter__` check.

The consumer counts: `packed_batches` calls `mark_consumed(mb.n_packs)` as it yields each
micro-batch, so a `state_dict()` taken after a training step resumes right after the packs that
step used. Packs still buffered by the batcher or prefetched by workers are not counted and are
read again after a restart.

Ranks: with `even_ranks=True` (default) every rank stops after the same number of packs (the
smallest rank's), so DDP ranks run the same number of packs per epoch; `dropped_for_evenness`
says how many packs that leaves out of the epoch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from packtool.errors import PacktoolError
from packtool.loader.collate import MicroBatch, PackRow, batch_by_tokens

SUPPORTED_SCHEMA_VERSIONS = (1,)
COLUMNS = ["input_ids", "labels", "cu_seqlens", "attn_cost", "pack_hash"]
STATE_KEYS = ("epoch", "consumed", "seed", "world_size", "num_workers")


class DatasetError(PacktoolError):
    """The build folder cannot be read as promised by its manifest."""


@dataclass(frozen=True, slots=True)
class Unit:
    """One row group: the smallest piece read at once."""

    shard: int
    row_group: int
    first_row: int  # row index of the group inside its shard
    rows: int


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _taken_per_worker(lengths: list[int], n: int) -> list[int]:
    """How many items each stream has delivered after `n` items of round-robin, exhausted ones skipped.

    lengths [3, 1, 2], n 5 -> order w0 w1 w2 w0 w2 -> [2, 1, 2].
    """
    total = sum(lengths)
    if n > total:
        raise DatasetError(f"resume state says {n} packs consumed but this rank's epoch has only {total}")
    taken = [0] * len(lengths)
    rounds = 0
    for level in sorted(set(lengths)):
        active = [w for w, length in enumerate(lengths) if length > rounds]
        if not active or n == 0:
            break
        full = min(level - rounds, n // len(active))
        rounds += full
        n -= full * len(active)
        if rounds < level:  # a partial round: the first n active workers give one more item
            for w in active[:n]:
                taken[w] += 1
            n = 0
            break
    return [min(length, rounds) + extra for length, extra in zip(lengths, taken, strict=True)]


def _next_stream(lengths: list[int], taken: list[int]) -> int:
    """The stream that gives the next item: the lowest index among the unfinished ones that are a round behind."""
    open_ = [w for w in range(len(lengths)) if taken[w] < lengths[w]]
    if not open_:
        return 0
    behind = min(taken[w] for w in open_)
    return next(w for w in open_ if taken[w] == behind)


def _resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise DatasetError(f"rank {rank} is outside world_size {world_size}")
    return rank, world_size


class PackedDataset(IterableDataset):
    """Packs of one build folder (manifest.json + shards), as `PackRow`s.

    Args:
        path: the build output folder.
        seed, shuffle: the epoch order is a pure function of (seed, epoch).
        rank, world_size: default from torch.distributed when initialised, else 0 / 1.
        num_workers: the DataLoader's num_workers (0 = iterate in this process); the resume state
            depends on it, so it is fixed here.
        verify_checksums: hash every shard against the manifest's sha256 before reading.
        even_ranks: cut every rank to the same number of packs per epoch.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        verify_checksums: bool = False,
        even_ranks: bool = True,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.exists():
            raise DatasetError(
                f"{self.path}: no manifest.json; the build did not finish (or this is not a build folder)"
            )
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        version = self.manifest.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise DatasetError(
                f"{manifest_path}: schema_version {version!r}; this loader reads {SUPPORTED_SCHEMA_VERSIONS}"
            )
        self.seed, self.shuffle, self.even_ranks = seed, shuffle, even_ranks
        self.rank, self.world_size = _resolve_ranks(rank, world_size)
        if num_workers < 0:
            raise DatasetError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = num_workers
        self.shard_files: list[Path] = [self.path / s["file"] for s in self.manifest["shards"]]
        if verify_checksums:
            self.verify_checksums()
        self.units = self._read_footers()
        self.epoch = 0
        self.consumed = 0

    @property
    def capacity(self) -> int | None:
        return self.manifest.get("capacity")

    @property
    def pad_id(self) -> int:
        pad = (self.manifest.get("tokenizer") or {}).get("pad_token_id")
        return 0 if pad is None else int(pad)

    def verify_checksums(self) -> None:
        for entry, file in zip(self.manifest["shards"], self.shard_files, strict=True):
            got = sha256_file(file)
            if got != entry["sha256"]:
                raise DatasetError(
                    f"{file}: sha256 {got} != manifest {entry['sha256']}; the shard is corrupted or was replaced"
                )

    def _read_footers(self) -> list[Unit]:
        units: list[Unit] = []
        for i, (entry, file) in enumerate(zip(self.manifest["shards"], self.shard_files, strict=True)):
            if not file.exists():
                raise DatasetError(f"{file}: listed in the manifest but missing")
            meta = pq.ParquetFile(file).metadata
            if meta.num_rows != entry["rows"]:
                raise DatasetError(f"{file}: {meta.num_rows} rows, manifest says {entry['rows']}")
            first = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if rows:
                    units.append(Unit(i, g, first, rows))
                first += rows
        return units

    # ---- the epoch plan: pure functions of (seed, epoch, rank, world_size, num_workers) ----

    def _unit_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.units)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.units)).tolist()

    def _rank_units(self, epoch: int, rank: int) -> list[int]:
        return self._unit_order(epoch)[rank :: self.world_size]

    def _worker_units(self, epoch: int) -> list[list[int]]:
        mine = self._rank_units(epoch, self.rank)
        k = max(1, self.num_workers)
        return [mine[w::k] for w in range(k)]

    def packs_per_rank(self, epoch: int | None = None) -> list[int]:
        e = self.epoch if epoch is None else epoch
        return [sum(self.units[u].rows for u in self._rank_units(e, r)) for r in range(self.world_size)]

    def __len__(self) -> int:
        """Packs this rank yields in the current epoch (after the even-ranks cut)."""
        per_rank = self.packs_per_rank()
        return min(per_rank) if self.even_ranks else per_rank[self.rank]

    @property
    def dropped_for_evenness(self) -> int:
        return self.packs_per_rank()[self.rank] - len(self)

    # ---- resume state ----

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = int(epoch), 0

    def mark_consumed(self, n_packs: int) -> None:
        """Called by the consumer for every pack it trained on (packed_batches does it)."""
        self.consumed += int(n_packs)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise DatasetError(f"resume state lacks {missing}; expected keys {list(STATE_KEYS)}")
        mismatched = [
            f"{k} {state[k]} (now {getattr(self, k)})"
            for k in ("seed", "world_size", "num_workers")
            if int(state[k]) != getattr(self, k)
        ]
        if mismatched and int(state["consumed"]):
            raise DatasetError(
                "cannot resume mid-epoch with a different " + ", ".join(mismatched) + "; resume at an epoch boundary"
            )
        self.set_epoch(int(state["epoch"]))  # the epoch's length depends on its permutation
        if int(state["consumed"]) > len(self):
            raise DatasetError(f"resume state consumed {state['consumed']} > {len(self)} packs in epoch {self.epoch}")
        self.consumed = int(state["consumed"])

    # ---- reading ----

    def __iter__(self) -> Iterator[PackRow]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if max(1, self.num_workers) != n_workers:
            raise DatasetError(
                f"PackedDataset(num_workers={self.num_workers}) iterated by {n_workers} worker(s); "
                "pass the DataLoader's num_workers to PackedDataset (the resume state depends on it)"
            )
        plan = self._worker_units(self.epoch)
        lengths = [sum(self.units[u].rows for u in units) for units in plan]
        taken = _taken_per_worker(lengths, self.consumed)
        # The DataLoader always asks worker 0 first; rotate so that it serves the stream whose
        # turn it was when the state was saved (the cyclic order, and so the pack order, is kept).
        stream = (_next_stream(lengths, taken) + worker) % n_workers
        stop = _taken_per_worker(lengths, len(self))[stream]
        yield from self._read(plan[stream], taken[stream], stop)

    def _read(self, unit_ids: list[int], start: int, stop: int) -> Iterator[PackRow]:
        position = 0  # packs of this worker's stream before the current unit
        open_shard: tuple[int, pq.ParquetFile] | None = None
        for u in unit_ids:
            unit = self.units[u]
            lo, hi = max(start - position, 0), min(stop - position, unit.rows)
            position += unit.rows
            if lo >= hi:
                if position >= stop:
                    return
                continue  # resume skips whole row groups without reading them
            if open_shard is None or open_shard[0] != unit.shard:
                open_shard = (unit.shard, pq.ParquetFile(self.shard_files[unit.shard]))
            table = open_shard[1].read_row_group(unit.row_group, columns=COLUMNS)
            order = np.arange(unit.rows)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch, u]).permutation(unit.rows)
            lists = {}
            for name in ("input_ids", "labels", "cu_seqlens"):
                col = table.column(name).combine_chunks()
                lists[name] = (col.offsets.to_numpy(), col.values.to_numpy())
            attn_cost = table.column("attn_cost").to_numpy()
            pack_hash = table.column("pack_hash").to_pylist()
            file = self.shard_files[unit.shard].name
            del table
            for i in order[lo:hi]:
                i = int(i)
                ids, labels, cu = (values[offs[i] : offs[i + 1]].copy() for offs, values in lists.values())
                yield PackRow(ids, labels, cu, pack_hash[i], int(attn_cost[i]), file, unit.first_row + i)
            if position >= stop:
                return


def _identity(item: Any) -> Any:
    return item


def packed_batches(
    dataset: PackedDataset,
    *,
    token_budget: int,
    fixed_shape: bool = False,
) -> Iterator[MicroBatch]:
    """Collated micro-batches of at most `token_budget` tokens for the dataset's current epoch.

    Runs a DataLoader with `dataset.num_workers` workers (batch_size=None: workers yield packs,
    batching happens here so a micro-batch may mix workers) and counts consumed packs on the
    dataset, so `dataset.state_dict()` after any yielded micro-batch resumes exactly after it.
    fixed_shape pads every pack to the manifest capacity (see collate.batch_by_tokens).
    """
    loader: Any
    if dataset.num_workers:
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=dataset.num_workers,
            collate_fn=_identity,
            persistent_workers=False,  # workers must see the resume state set before each epoch
        )
    else:
        loader = dataset
    for mb in batch_by_tokens(
        iter(loader), token_budget, fixed_shape=fixed_shape, capacity=dataset.capacity, pad_id=dataset.pad_id
    ):
        dataset.mark_consumed(mb.n_packs)
        yield mb
