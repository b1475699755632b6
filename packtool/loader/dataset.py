"""Stream packs from a build folder: every rank the same rounds, verified bytes, a global resume state.

The plan (which rank reads which pack in which round) is `schedule.py`: a pure function of
(seed, epoch, start position, world size, budget). This module does the I/O: it reads the
manifest through `contract.py`, checks each shard's sha256 the first time a process opens it,
decodes one Parquet row group at a time into numpy and hands out `LoadedPack`s whose arrays are
views into that row group. Micro-batches (`packed_batches`) skip the per-pack objects: the
packs of a chunk of rounds are gathered as views and `collate.assemble` builds all their
micro-batches with one concatenation per column (the one copy into a batch).

Modes, by the options (docs/format.md "Loader contract"):

    PackedDataset(path)                             one pack per rank per round (a Trainer batches them)
    PackedDataset(path, token_budget=B)             one micro-batch of <= B tokens per rank per round
    PackedDataset(path, token_budget=B, balance="attention", packs_per_step=P, alpha=a)
                                                    one optimizer step of P packs per round, split over
                                                    ranks by LPT on attn_cost + a * n_tokens

Workers. With a DataLoader of k workers, worker w reads rounds w, w+k, w+2k, ... of its rank and
yields one item per round (a pack, or a round's list of packs through `packed_batches`), so
the DataLoader's round-robin over workers returns them in plan order.

Resume. The state is `{epoch, position, seed, shuffle, build, world_size, left_out}`: the global
position where the next round starts, the same on every rank. It resumes under any world size,
worker count or budget (the rest of the epoch is planned again from `position`); only the seed
and shuffle, which fix the order, must match mid-epoch, and `build` (the manifest's sha256,
`seal.manifest_digest`) always: a position means nothing on another build. `schedule.read_state` reads
and checks a state, here and for `packtool trace --state`.

Epochs. `packed_batches(ds, epochs=3)` reads epochs 0, 1 and 2, each shuffled by (seed, epoch),
moving the dataset to the next epoch when one is read to its end; a dataset resumed from a state
in epoch 1 finishes epoch 1 and reads epoch 2, so the same call ends the same run.

Documents (`isolate_documents=True`). Stream builds write one attention segment per window
(`cu_seqlens` [0, len]) and keep document starts in `doc_cu_seqlens`. Isolating reads
`doc_cu_seqlens` as the segments and puts -100 on each document's first label, so no pair
crosses a document and positions restart per document (collate derives them from the segments)::

    doc_cu_seqlens [0, 3, 5]   input_ids [a0 a1 E b0 E]
    as written     cu_seqlens [0, 5]      labels [-100 a1 E b0   E]   positions 0 1 2 3 4
    isolated       cu_seqlens [0, 3, 5]   labels [-100 a1 E -100 E]   positions 0 1 2 0 1

Packed builds have `doc_cu_seqlens == cu_seqlens`, so the option changes nothing there.

Images. A vision build's packs carry their images: each pack's are read, checked by sha256,
preprocessed and checked against their planned grids where the pack is read (in the DataLoader
workers when there are some), and ride in its LoadedPack / MicroBatch (`packtool.loader.vision`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from packtool.arrow import as_numpy, list_parts
from packtool.checks import MAX_COUNT, alpha_problem, integer_problem, seed_problem
from packtool.errors import DatasetError, one_line
from packtool.format import MANIFEST, Manifest, first_broken_pack
from packtool.labels import IGNORE_INDEX
from packtool.loader.collate import SEGMENT_COLUMNS, LoadedPack, MicroBatch, PackViews, assemble, with_images
from packtool.loader.contract import check_shard, read_manifest
from packtool.loader.schedule import (
    EpochOrder,
    EpochPlan,
    PlanOptions,
    ResumeState,
    epoch_order,
    plan_epoch,
    read_state,
    share_micro_batches,
)
from packtool.loader.vision import VISION_COLUMNS, ImageSource, PackImages, VisionRows
from packtool.seal import manifest_digest
from packtool.shards import READ_ERRORS, SegmentColumns, footer_problem, schema_problem

__all__ = ["DatasetError", "PackedDataset", "packed_batches", "packed_steps"]

log = logging.getLogger("packtool.loader")
# Parquet readers kept open per process: shuffled row groups come from a few shards at a time, and
# opening one (footer and column paths) costs about as much as decoding a small row group.
OPEN_SHARDS = 4
BALANCE_MODES = (None, "attention")
_Item = TypeVar("_Item")


@dataclass(frozen=True, slots=True)
class Unit:
    """One row group: the smallest piece read at once."""

    shard: int
    row_group: int
    first_row: int  # row index of the group inside its shard
    rows: int


@dataclass(frozen=True, slots=True)
class _Decoded:
    """One unit's columns: list columns as (offsets, values), the offsets of those sliced per pack as Python
    ints (cheap to slice with)."""

    unit: int
    shard: str  # the shard's file name
    first_row: int  # row index of the group inside its shard
    ids: tuple[list[int], np.ndarray]
    labels: tuple[list[int], np.ndarray]
    cu: tuple[list[int], np.ndarray]  # doc_cu_seqlens when documents are isolated
    attn_cost: list[int]  # sum(l_i^2) of the attention segments (of the documents when isolated)
    pack_hash: list[str]
    segments: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # schema v2 columns, sliced only when asked for
    vision: VisionRows | None = None  # a vision build's image columns


@dataclass(frozen=True, slots=True)
class _Share:
    """One worker's share of this rank's rounds: its packs (unit, row) in reading order, cut into rounds.

    Round j holds packs cuts[j]:cuts[j+1] and is plan round steps[j]; a resume state may point at
    starts[j] while its packs are in training and at ends[j] once its last pack is.
    """

    units: list[int]
    rows: list[int]
    cuts: list[int]
    steps: list[int]
    starts: list[int]
    ends: list[int]


def _identity_of(file: Path) -> tuple[int, ...]:
    """A file's device, inode, size and modification time: any replacement or rewrite changes one of them."""
    try:
        stat = file.stat()
    except OSError:
        return ()
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise DatasetError(f"rank {rank} is outside world_size {world_size}")
    return rank, world_size


def _ints(table: pa.Table, name: str) -> np.ndarray:
    """A fixed-width column as int64 numpy."""
    return as_numpy(table.column(name).combine_chunks()).astype(np.int64)


def _row_costs(table: pa.Table, isolate_documents: bool) -> np.ndarray:
    """sum(l_i^2) per pack of a row group, as int64, from its small columns.

    With isolated documents the attention segments are the documents, so the cost comes from
    `doc_cu_seqlens` (a few offsets per pack) instead of the `attn_cost` column.
    """
    if not isolate_documents:
        return _ints(table, "attn_cost")
    offsets, values = list_parts(table.column("doc_cu_seqlens"))
    steps: np.ndarray = np.diff(values.astype(np.int64))
    steps[offsets[1:-1] - 1] = 0  # the step from one pack's last offset to the next pack's 0
    summed = np.concatenate([[0], np.cumsum(steps * steps)])
    return summed[offsets[1:] - 1] - summed[offsets[:-1]]


class PackedDataset(IterableDataset):
    """Packs of one build folder (manifest.json + shards), as `LoadedPack`s in this rank's plan order.

    Args:
        path: the build output folder.
        token_budget: tokens per micro-batch, a hard cap (must be >= the build's capacity: packs are
            never split); None plans one pack per rank per round (for a Trainer's own batching).
        fixed_shape: pad every pack to the capacity and every micro-batch to token_budget // capacity packs.
        seed, shuffle: the epoch order is a pure function of (seed, epoch); a seed is 0 to 2**63 - 1
            and shuffle a bool (packtool.checks, as `trace` and a saved state are held).
        rank, world_size: default from torch.distributed when initialised, else 0 / 1.
        num_workers: the DataLoader's num_workers (0 = read in this process).
        verify: check each shard's sha256 against the manifest the first time this process opens it.
        balance, packs_per_step, alpha: "attention" plans rounds of `packs_per_step` packs (one
            optimizer step over all ranks) dealt by LPT on attn_cost + alpha * n_tokens (alpha 0 to 2**20).
        isolate_documents: use `doc_cu_seqlens` as the attention segments and set the label of
            each document's first token to -100 (stream builds: no pair across documents).
        image_root: a vision build's images are read from here instead of the folder the manifest
            records (its `vision.root`); images stored in the shards are read from the shards.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        token_budget: int | None = None,
        fixed_shape: bool = False,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        verify: bool = True,
        balance: str | None = None,
        packs_per_step: int | None = None,
        alpha: float = 0.0,
        isolate_documents: bool = False,
        image_root: str | Path | None = None,
    ) -> None:
        super().__init__()
        self.manifest: Manifest = read_manifest(path)
        self.path = Path(path)
        self.token_budget, self.fixed_shape = token_budget, fixed_shape
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size = _resolve_ranks(rank, world_size)
        self.num_workers = num_workers
        self.verify = verify
        self.balance, self.packs_per_step, self.alpha = balance, packs_per_step, alpha
        self.isolate_documents = isolate_documents
        self.image_root = image_root
        self._check_options()
        self.seed, self.alpha = int(seed), float(alpha)  # numpy's numbers as Python's, once checked
        self._verified: set[int] = set()  # shards whose sha256 this process has checked
        # Per shard: its parsed footer, whether it has the schema v2 segment columns and its vision columns.
        # Parsed once (as much work as decoding a small row group); with verify, first after the sha256 check.
        self._footers: dict[int, tuple[pq.FileMetaData, bool, tuple[str, ...]]] = {}
        self._files: dict[int, pq.ParquetFile] = {}  # open readers, least recently used first
        self._files_pid = os.getpid()
        # What each file was when the dataset opened the build: a rebuild that replaces OUT under a running
        # loader is named (`_check_unchanged`), not read as another build's bytes under this one's footers.
        self._identities = {-1: _identity_of(self.manifest.folder / MANIFEST)}
        self.units = self._read_footers()
        # A vision build's images, read and preprocessed with each pack (in the workers that read it).
        self.images = None if self.manifest.vision is None else ImageSource(self.manifest, image_root)
        self.build = manifest_digest(self.manifest.raw)  # names the build in the resume state
        self._small: tuple[np.ndarray, np.ndarray] | None = None  # n_tokens, cost per pack, for planning
        self._plan: tuple[tuple[int, int], EpochOrder, EpochPlan] | None = None
        self._logged_epoch = -1
        self.epoch = 0
        self.position = 0

    @property
    def capacity(self) -> int:
        return self.manifest.capacity

    @property
    def pad_id(self) -> int:
        return self.manifest.pad_id

    @property
    def window(self) -> int:
        """Packs the epoch order keeps together: an interleaved build's window (mixing.interleave), else 1."""
        interleave = self.manifest.interleave
        return 1 if interleave is None else interleave.window

    @property
    def total_packs(self) -> int:
        return sum(u.rows for u in self.units)

    def _check_options(self) -> None:
        """All problems at once, each with the fix; types first, since "7" or 3.7 cannot be compared."""
        typed = [f"{name}: {problem}" for name, problem in self._type_problems() if problem is not None]
        if typed:
            raise DatasetError("; ".join(typed))
        problems = []
        if self.token_budget is not None and self.token_budget < self.capacity:
            problems.append(
                f"token_budget {self.token_budget} < capacity {self.capacity}: packs are never split, so a micro-batch "
                f"could not stay under the budget; set token_budget >= {self.capacity}"
            )
        if self.image_root is not None and self.manifest.vision is None:
            problems.append(f"image_root {str(self.image_root)!r}: {self.path} holds no images (no image processor)")
        if self.fixed_shape and self.token_budget is None:
            problems.append(f"fixed_shape needs token_budget (a multiple of the capacity {self.capacity})")
        if self.balance not in BALANCE_MODES:
            problems.append(f"balance {self.balance!r} is not one of {BALANCE_MODES}")
        if self.balance is not None and self.packs_per_step is None:
            problems.append("balance='attention' needs packs_per_step (packs per optimizer step over all ranks)")
        if self.balance is None and self.packs_per_step is not None:
            problems.append("packs_per_step needs balance='attention'")
        if self.packs_per_step is not None and self.packs_per_step < self.world_size:
            problems.append(
                f"packs_per_step {self.packs_per_step} < world_size {self.world_size}: every rank needs a pack of "
                f"every step; set packs_per_step >= {self.world_size}"
            )
        problems += [f"{name}: {problem}" for name, problem in self._number_problems() if problem is not None]
        if problems:
            raise DatasetError("; ".join(problems))

    def _type_problems(self) -> list[tuple[str, str | None]]:
        """Counts are integers (not bools, not 3.7, not "7"), flags are bools."""
        optional = {"token_budget": self.token_budget, "packs_per_step": self.packs_per_step}  # None: not used
        counts = [("num_workers", self.num_workers, 0), *((k, v, 1) for k, v in optional.items() if v is not None)]
        problems = [(name, integer_problem(value, low, MAX_COUNT, f"{name} counts")) for name, value, low in counts]
        flags = {"fixed_shape": self.fixed_shape, "verify": self.verify, "isolate_documents": self.isolate_documents}
        problems += [
            (name, f"expected True/False, got {value!r}")
            for name, value in flags.items()
            if not isinstance(value, bool)
        ]
        return problems

    def _number_problems(self) -> list[tuple[str, str | None]]:
        shuffled = None if isinstance(self.shuffle, bool) else f"expected True/False, got {self.shuffle!r}"
        return [("seed", seed_problem(self.seed)), ("shuffle", shuffled), ("alpha", alpha_problem(self.alpha))]

    # ---- files ----

    def _open(self, shard: int) -> pq.ParquetFile:
        """The shard's Parquet reader, its sha256 checked first (once per process) when verify is on.

        The last OPEN_SHARDS readers stay open; a forked DataLoader worker opens its own.
        """
        if self._files_pid != os.getpid():
            self._files, self._files_pid = {}, os.getpid()
        parquet = self._files.pop(shard, None)
        if parquet is None:
            entry = self.manifest.shards[shard]
            self._check_unchanged(shard)
            if self.verify and shard not in self._verified:
                check_shard(entry)
                self._verified.add(shard)
            known = self._footers.get(shard)
            parquet = pq.ParquetFile(entry.file, metadata=None if known is None else known[0])
            if known is None:
                self._remember_footer(shard, parquet.metadata)
            if len(self._files) >= OPEN_SHARDS:
                del self._files[next(iter(self._files))]  # the least recently used
        self._files[shard] = parquet
        return parquet

    def __getstate__(self) -> dict[str, Any]:
        """Open readers do not travel to another process (spawned DataLoader workers open their own)."""
        return {**self.__dict__, "_files": {}, "_files_pid": -1}

    def _remember_footer(self, shard: int, meta: pq.FileMetaData) -> None:
        names = meta.schema.to_arrow_schema().names
        self._footers[shard] = (meta, "segment_groups" in names, tuple(c for c in VISION_COLUMNS if c in names))

    def _check_unchanged(self, shard: int) -> None:
        """Raise DatasetError when the shard's file is not the one the dataset opened (replaced, rewritten)."""
        file = self.manifest.shards[shard].file
        if _identity_of(file) == self._identities[shard]:
            return
        rebuilt = _identity_of(self.manifest.folder / MANIFEST) != self._identities[-1]
        raise DatasetError(
            f"{file}: changed since this dataset opened the build"
            + (f" ({MANIFEST} changed too: the output was rebuilt or replaced)" if rebuilt else "")
            + "; its footers and checksum no longer describe it: create the dataset again (a resume state "
            "saved on the old build is refused by the new one)"
        )

    def _read_group(self, shard: int, group: int, columns: list[str]) -> pa.Table:
        """One row group of a shard; a file changed or damaged under the reader is one DatasetError naming it."""
        parquet = self._open(shard)
        try:
            return parquet.read_row_group(group, columns=columns)
        except READ_ERRORS as err:
            self._check_unchanged(shard)
            raise DatasetError(
                f"{self.manifest.shards[shard].file}: row group {group} cannot be decoded ({one_line(err)}); "
                "rebuild or restore it"
            ) from None

    def _read_footers(self) -> list[Unit]:
        units: list[Unit] = []
        for i, entry in enumerate(self.manifest.shards):
            if not entry.file.is_file():
                raise DatasetError(f"{entry.file}: listed in the manifest but missing")
            self._identities[i] = _identity_of(entry.file)
            try:
                meta = pq.read_metadata(entry.file)  # footers only; the bytes are checked on first read
            except (OSError, ValueError) as err:
                if self.verify:
                    check_shard(entry)  # an altered shard: say so by its checksum, and where
                raise DatasetError(
                    f"{entry.file}: unreadable Parquet footer ({one_line(err)}); rebuild or restore it"
                ) from None
            if meta.num_rows != entry.rows:
                raise DatasetError(f"{entry.file}: {meta.num_rows} rows, manifest says {entry.rows}")
            problem = self._schema_problem(meta.schema.to_arrow_schema()) or footer_problem(meta)
            if problem is not None:  # checked here too: with verify=False no checksum stands for the columns
                raise DatasetError(f"{entry.file}: {problem}")
            if not self.verify:
                self._remember_footer(i, meta)
            first = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if rows:
                    units.append(Unit(i, g, first, rows))
                first += rows
        return units

    def _schema_problem(self, schema: pa.Schema) -> str | None:
        """The shard schema's problem; image columns must come with the manifest's vision object, and it with them."""
        vision = "image_refs" in schema.names
        if vision != (self.manifest.vision is not None):
            has = "has image columns and the manifest no" if vision else "has no image columns and the manifest a"
            return f"the shard {has} vision object: not one build; rebuild it"
        return schema_problem(schema)

    def _per_pack(self) -> tuple[np.ndarray, np.ndarray]:
        """(n_tokens, sum(l_i^2)) of every pack, flat in unit order, from the small columns (read once).

        Pack `row` of unit `u` sits at flat index `unit_start[u] + row`.
        """
        if self._small is None:
            columns = ["n_tokens", "doc_cu_seqlens" if self.isolate_documents else "attn_cost"]
            tokens, costs = [], []
            for unit in self.units:
                table = self._read_group(unit.shard, unit.row_group, columns)
                tokens.append(_ints(table, "n_tokens"))
                costs.append(_row_costs(table, self.isolate_documents))
            empty = np.zeros(0, np.int64)
            self._small = (np.concatenate(tokens) if tokens else empty, np.concatenate(costs) if costs else empty)
        return self._small

    # ---- the plan ----

    def plan(self) -> tuple[EpochOrder, EpochPlan]:
        """The current epoch's order and its plan from `position` (cached; logs what it leaves out, once per epoch)."""
        key = (self.epoch, self.position)
        if self._plan is None or self._plan[0] != key:
            if self._plan is not None and self._plan[0][0] == self.epoch:
                order = self._plan[1]  # same epoch, later position: the order stands, only the rest is re-planned
            else:
                order = epoch_order([u.rows for u in self.units], self.seed, self.epoch, self.shuffle, self.window)
            plan = plan_epoch([u.rows for u in self.units], order, self.position, self.plan_options, self._per_pack)
            self._plan = (key, order, plan)
            if plan.dropped and self._logged_epoch != self.epoch and get_worker_info() is None:
                self._logged_epoch = self.epoch
                log.warning(
                    "epoch %d: %d of %d packs left out so that %d rank(s) run the same %d rounds",
                    self.epoch,
                    plan.dropped,
                    plan.total,
                    self.world_size,
                    plan.rounds,
                )
        return self._plan[1], self._plan[2]

    @property
    def plan_options(self) -> PlanOptions:
        """The options that decide the rounds (what `packtool trace` plans with too)."""
        return PlanOptions(
            self.world_size,
            self.capacity,
            self.token_budget,
            self.fixed_shape,
            self.balance,
            self.packs_per_step,
            self.alpha,
        )

    def __len__(self) -> int:
        """Packs this rank yields in the rest of the current epoch."""
        return len(self.plan()[1].positions(self.rank))

    @property
    def left_out(self) -> int:
        """Packs of the rest of the epoch no rank reads, so that every rank runs the same rounds (< world_size)."""
        return self.plan()[1].dropped

    # ---- resume state ----

    def set_epoch(self, epoch: int) -> None:
        start = {"epoch": epoch, "position": 0, "seed": self.seed, "shuffle": self.shuffle, "build": self.build}
        self.resume(read_state(start, "set_epoch"))  # the epoch checked as a saved state's is

    def advance(self, position: int) -> None:
        """Record that every rank trained up to this global position (a MicroBatch's `resume_after`)."""
        if position >= 0:
            self.position = int(position)

    def state_dict(self) -> dict[str, Any]:
        """Global: the same on every rank; resumes under another world size, worker count or budget."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "build": self.build,  # a position counts this build's packs: another build refuses it
            "world_size": self.world_size,  # for the record; a resume may use another
            "left_out": self.left_out,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.resume(read_state(state))

    def resume(self, state: ResumeState) -> None:
        """Go on from a state `schedule.read_state` read; `packtool trace --state` holds its anchor to this too."""
        self._check_build(state.build, state.position)
        changed = [
            f"{k} {getattr(state, k)!r} (now {getattr(self, k)!r})"
            for k in ("seed", "shuffle")
            if getattr(state, k) != getattr(self, k)
        ]
        if changed and state.position:
            raise DatasetError(
                "cannot resume mid-epoch with a different " + ", ".join(changed) + " (they fix the pack order); "
                "resume at an epoch boundary or keep them"
            )
        if state.position > self.total_packs:
            raise DatasetError(f"resume position {state.position} is outside the epoch's {self.total_packs} packs")
        self.epoch, self.position = state.epoch, state.position

    def _check_build(self, build: Any, position: int) -> None:
        """A state's position counts the packs of the build it was saved on: on another, resuming would skip or
        repeat packs without a sign. A state saved before states named their build is taken at an epoch
        boundary only, where there is nothing to skip."""
        if build is None and position:
            raise DatasetError(
                f"resume state at position {position} names no build (saved by an older packtool), so it cannot "
                f"be checked against {self.path}; on another build it would skip or repeat packs. If it was saved "
                f"on this build, set state['build'] = {self.build!r} and load it again"
            )
        if build is not None and build != self.build:
            raise DatasetError(
                f"resume state was saved on build {str(build)[:16]!r}..., {self.path} is build {self.build[:16]}...: "
                "its position counts another build's packs (resuming would skip or repeat some); resume on the "
                "build it came from, or start this one at an epoch with set_epoch"
            )

    # ---- reading ----

    def _share(self, worker: int, n_workers: int) -> _Share:
        """This rank's share of every n_workers-th round (from `worker`)."""
        order, plan = self.plan()
        mine = plan.positions(self.rank)
        rounds = plan.round[mine - plan.start]
        new_round = np.ones(len(mine), bool)
        new_round[1:] = rounds[1:] != rounds[:-1]
        keep = (np.cumsum(new_round) - 1) % n_workers == worker
        mine, rounds, firsts = mine[keep], rounds[keep], np.flatnonzero(new_round[keep])
        steps = rounds[firsts]
        return _Share(
            order.unit[mine].tolist(),
            order.row[mine].tolist(),
            [*firsts.tolist(), len(mine)],
            steps.tolist(),
            plan.bounds[steps].tolist(),
            plan.bounds[steps + 1].tolist(),
        )

    def _rounds(self, worker: int, n_workers: int) -> Iterator[list[LoadedPack]]:
        """This rank's share of every n_workers-th round (from `worker`), as lists of packs."""
        share = self._share(worker, n_workers)
        units, rows = share.units, share.rows
        with _RowGroups(self._read, self._decode, units) as groups:
            for j, (lo, hi) in enumerate(itertools.pairwise(share.cuts)):
                step, start, end = share.steps[j], share.starts[j], share.ends[j]
                yield [
                    self._pack(groups.get(units[i]), rows[i], step, end if i == hi - 1 else start, i == hi - 1)
                    for i in range(lo, hi)
                ]

    def __iter__(self) -> Iterator[LoadedPack]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if max(1, self.num_workers) != n_workers:
            raise DatasetError(
                f"PackedDataset(num_workers={self.num_workers}) iterated by {n_workers} worker(s); "
                "pass the DataLoader's num_workers to PackedDataset (workers split the plan's rounds)"
            )
        if n_workers > 1 and (self.token_budget is not None or self.balance is not None):
            raise DatasetError(
                "with token_budget or balance a round holds several packs: read them with packed_batches / "
                "packed_steps (they hand whole rounds to the workers), not with a DataLoader over the dataset"
            )
        for packs in self._rounds(worker, n_workers):
            yield from packs

    def _read(self, unit_index: int) -> pa.Table:
        """One row group's columns as Arrow (the shard's sha256 checked first): no Python per value, little GIL."""
        unit = self.units[unit_index]
        # Isolated documents: their segments are the documents, so their cost comes from doc_cu_seqlens.
        cu_name, cost = ("doc_cu_seqlens", []) if self.isolate_documents else ("cu_seqlens", ["attn_cost"])
        self._open(unit.shard)  # its footer is known from here on
        _, v2, vision = self._footers[unit.shard]
        extra = list(SEGMENT_COLUMNS) if v2 else []
        columns = ["input_ids", "labels", cu_name, *cost, "pack_hash", *extra, *vision]
        return self._read_group(unit.shard, unit.row_group, columns)

    def _decode(self, unit_index: int, table: pa.Table) -> _Decoded:
        """A row group's columns as numpy, its pack contract checked."""
        unit = self.units[unit_index]
        cu_name = "doc_cu_seqlens" if self.isolate_documents else "cu_seqlens"
        v2 = "segment_groups" in table.column_names
        extra = list(SEGMENT_COLUMNS) if v2 else []
        ids, labels, cu = (list_parts(table.column(name)) for name in ("input_ids", "labels", cu_name))
        # Checked once for the whole row group, so collate need not check each micro-batch again.
        # Isolated documents get their -100 at document starts when read, so that rule is not asked of them.
        bad = first_broken_pack(ids[0], labels[0], cu[0], cu[1], None if self.isolate_documents else labels[1])
        if bad >= 0:
            raise DatasetError(
                f"{self.manifest.shards[unit.shard].file}: row {unit.first_row + bad}: breaks the pack contract "
                f"({cu_name} not from 0 to the pack length, or a label other than -100 at a segment start); "
                "rebuild the shards"
            )

        def sliceable(column: tuple[np.ndarray, np.ndarray]) -> tuple[list[int], np.ndarray]:
            return column[0].tolist(), column[1]

        return _Decoded(
            unit_index,
            self.manifest.shards[unit.shard].file.name,
            unit.first_row,
            sliceable(ids),
            sliceable(labels),
            sliceable(cu),
            _row_costs(table, self.isolate_documents).tolist(),
            table.column("pack_hash").to_pylist(),
            {name: list_parts(table.column(name)) for name in extra} if v2 else None,
            VisionRows.of(table) if "image_refs" in table.column_names else None,
        )

    def _images(self, cols: _Decoded, i: int) -> PackImages | None:
        """Row i's images read, checked and preprocessed (None in a text build)."""
        if cols.vision is None or self.images is None:
            return None
        return self.images.load(cols.vision, i, f"{cols.shard} row {cols.first_row + i}")

    def _pack(self, cols: _Decoded, i: int, step: int, resume: int, closes: bool) -> LoadedPack:
        """Row i of a decoded unit as a LoadedPack (views into the unit's arrays)."""
        (io, ids), (lo, labels), (co, cu) = cols.ids, cols.labels, cols.cu
        pack_labels = labels[lo[i] : lo[i + 1]]
        pack_cu = cu[co[i] : co[i + 1]]
        if self.isolate_documents:
            pack_labels = pack_labels.copy()
            pack_labels[pack_cu[:-1]] = IGNORE_INDEX  # no document learns to predict the next one's first token
        segments = None
        if cols.segments is not None:
            values = {SEGMENT_COLUMNS[k][0]: v[o[i] : o[i + 1]].copy() for k, (o, v) in cols.segments.items()}
            segments = SegmentColumns(**values)
        return LoadedPack(
            ids[io[i] : io[i + 1]],
            pack_labels,
            pack_cu,
            cols.pack_hash[i],
            cols.attn_cost[i],
            cols.shard,
            cols.first_row + i,
            step,
            resume,
            closes,
            True,
            segments,
            self._images(cols, i),
        )

    def _round_batches(self, worker: int, n_workers: int) -> Iterator[list[MicroBatch]]:
        """Each of this worker's rounds as its list of micro-batches, assembled a chunk of rounds at a time.

        A round's share is cut greedily into micro-batches of at most token_budget tokens (a pack
        counts `capacity` in fixed shape); `assemble` then builds every micro-batch of about
        CHUNK_TOKENS tokens of rounds from one concatenation per column, straight from the decoded
        row groups (no per-pack objects).
        """
        options = self.plan_options
        fixed = self.capacity if self.fixed_shape else None
        per_batch = (self.token_budget or 0) // self.capacity
        chunk = _Chunk()
        share = self._share(worker, n_workers)
        units, rows = share.units, share.rows
        with _RowGroups(self._read, self._decode, units) as row_groups:
            for j, (lo, hi) in enumerate(itertools.pairwise(share.cuts)):
                sizes = [chunk.add(row_groups.get(units[i]), rows[i], self._images) for i in range(lo, hi)]
                groups = share_micro_batches(sizes, options)
                last = groups[-1][-1]
                chunk.close_round(
                    [len(g) for g in groups],
                    [share.ends[j] if g[-1] == last else share.starts[j] for g in groups],
                    share.steps[j],
                    [per_batch - len(g) for g in groups] if fixed else None,
                )
                if chunk.tokens >= CHUNK_TOKENS:
                    yield from chunk.flush(fixed, self.pad_id, self.isolate_documents)
                    chunk = _Chunk()
        if chunk.rounds:
            yield from chunk.flush(fixed, self.pad_id, self.isolate_documents)


class _RowGroups:
    """The decoded row groups of one pass, in the order its rounds visit them (each unit's packs are one run).

    Once the packs of one row group are in use, the next row group is read and decoded on a thread
    (the sha256 check and pyarrow's decode run without the GIL, the contract check is a few
    vectorised passes), so reading overlaps batching on a second core (measured here: decoding
    here rather than on the caller's thread makes the caller's own work per token a quarter
    smaller for micro-batches, a third for packs). One read at a time (a ParquetFile is not safe
    for concurrent reads), the next asked for only after the previous was taken; the thread starts
    at the second pack of a row group, so a caller that stops after one pack has read one row
    group. A failed read or a broken pack raises here when its row group is reached, as a direct
    read would.
    """

    def __init__(
        self, read: Callable[[int], pa.Table], decode: Callable[[int, pa.Table], _Decoded], visits: list[int]
    ) -> None:
        self._order = [u for j, u in enumerate(visits) if j == 0 or u != visits[j - 1]]
        self._read, self._decode = read, decode
        self._at = -1
        self._current: _Decoded | None = None
        self._ahead: Future[_Decoded] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def get(self, unit: int) -> _Decoded:
        current = self._current
        if current is not None and current.unit == unit:
            if self._ahead is None and self._at + 1 < len(self._order):
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="packtool-read")
                self._ahead = self._pool.submit(self._load, self._order[self._at + 1])
            return current
        ahead, self._ahead = self._ahead, None
        self._at += 1
        unit = self._order[self._at]
        self._current = current = ahead.result() if ahead is not None else self._load(unit)
        return current

    def _load(self, unit: int) -> _Decoded:
        return self._decode(unit, self._read(unit))

    def close(self) -> None:
        """Stop the read-ahead thread (idempotent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> _RowGroups:
        _OPEN_ROW_GROUPS.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _OPEN_ROW_GROUPS.discard(self)
        self.close()


# Passes still open when the interpreter exits: a loop that stopped mid-epoch leaves its suspended
# generator to be collected during module teardown, where the executor's shutdown finds its `queue`
# module already gone (AttributeError: 'NoneType' object has no attribute 'Empty'). Closed here
# first, while every module is intact.
_OPEN_ROW_GROUPS: weakref.WeakSet[_RowGroups] = weakref.WeakSet()


@atexit.register
def _close_open_row_groups() -> None:
    for groups in list(_OPEN_ROW_GROUPS):
        groups.close()


# Rounds are assembled together until they hold this many tokens: enough to spread the per-call
# numpy and torch overhead over many micro-batches, small enough that the buffers their tensors
# view stay a few MB.
CHUNK_TOKENS = 1 << 16


class _Chunk:
    """Packs of consecutive rounds, as views, waiting to be assembled into micro-batches."""

    def __init__(self) -> None:
        self.views = PackViews([], [], [], [], [], [], [], None)
        self.cuts = [0]
        self.padding_rows: list[int] = []
        self.rounds: list[int] = []  # micro-batches per round
        self.tokens = 0
        # Schema v2: each pack's decoded columns and row, sliced only if a segment column is asked for.
        self.segment_rows: list[tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]] = []
        self.images: list[PackImages | None] = []  # a vision build's, per pack

    def add(self, cols: _Decoded, i: int, images: Callable[[_Decoded, int], PackImages | None]) -> int:
        """Append row i of a decoded unit (and its images, loaded by `images`); its token count."""
        (io, ids), (lo, labels), (co, cu) = cols.ids, cols.labels, cols.cu
        v = self.views
        v.input_ids.append(ids[io[i] : io[i + 1]])
        v.labels.append(labels[lo[i] : lo[i + 1]])
        v.cu_seqlens.append(cu[co[i] : co[i + 1]])
        v.pack_hash.append(cols.pack_hash[i])
        v.attn_cost.append(cols.attn_cost[i])
        if cols.segments is not None:
            if v.segments is None:
                self.views = v = replace(v, segments=self._segment_values)
            self.segment_rows.append((cols.segments, i))
        self.images.append(images(cols, i))
        n = io[i + 1] - io[i]
        self.tokens += n
        return n

    def _segment_values(self, column: str) -> list[np.ndarray]:
        out = []
        for segments, i in self.segment_rows:
            offsets, values = segments[column]
            out.append(values[offsets[i] : offsets[i + 1]])
        return out

    def close_round(self, sizes: list[int], resume: list[int], step: int, padding_rows: list[int] | None) -> None:
        """The round's packs so far form micro-batches of `sizes` packs; `resume` and padding rows per micro-batch."""
        for n, after in zip(sizes, resume, strict=True):
            self.cuts.append(self.cuts[-1] + n)
            self.views.step.extend([step] * n)
            self.views.resume_after.extend([-1] * (n - 1) + [after])
        self.padding_rows.extend(padding_rows or [0] * len(sizes))
        self.rounds.append(len(sizes))

    def flush(self, capacity: int | None, pad_id: int, isolate: bool) -> Iterator[list[MicroBatch]]:
        mbs = assemble(
            self.views,
            self.cuts,
            capacity=capacity,
            pad_id=pad_id,
            padding_rows=self.padding_rows,
            isolate_starts=isolate,
        )
        if any(images is not None for images in self.images):
            mbs = with_images(mbs, self.cuts, self.images, self.views.input_ids, capacity)
        at = 0
        for n in self.rounds:
            yield mbs[at : at + n]
            at += n


class _RoundBatches(IterableDataset):
    """Each round of a dataset as its list of micro-batches: workers read and collate whole rounds."""

    def __init__(self, dataset: PackedDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        yield from self.dataset._round_batches(worker, n_workers)


def _identity(item: Any) -> Any:
    return item


def _epoch_micro_batches(dataset: PackedDataset) -> Iterator[MicroBatch]:
    """The micro-batches of the rest of the dataset's current epoch."""
    if dataset.token_budget is None:
        raise DatasetError(
            "packed_batches / packed_steps need PackedDataset(token_budget=N) (a hard cap on tokens per micro-batch)"
        )
    dataset.plan()  # plan (and log what is left out) here, not in each worker
    rounds: Any = _RoundBatches(dataset)
    if dataset.num_workers:
        rounds = DataLoader(
            rounds,
            batch_size=None,
            num_workers=dataset.num_workers,
            collate_fn=_identity,
            persistent_workers=False,  # workers must see the position set before each pass
        )
    for round_ in rounds:
        yield from round_


def _check_epochs(epochs: float | None) -> None:
    if epochs is not None and not (epochs == math.inf or (isinstance(epochs, int) and epochs >= 1)):
        raise DatasetError(f"epochs must be an int >= 1 or math.inf (no end), got {epochs!r}")


def _over_epochs(
    dataset: PackedDataset, epochs: float | None, one_epoch: Callable[[PackedDataset], Iterator[_Item]]
) -> Iterator[_Item]:
    """`one_epoch` for the rest of the current epoch, then for each next one until epoch `epochs`.

    An epoch with no round left (read to its end) moves the dataset to the next one (`set_epoch`)
    before reading, so a state saved at an epoch's end still names that epoch, and the next call
    reads the next epoch instead of an empty rest of this one. `epochs` counts from 0: a resumed
    run ends where the same run without the interruption ends.
    """
    if epochs is not None and epochs < dataset.epoch:
        raise DatasetError(
            f"the dataset is at epoch {dataset.epoch} (set_epoch or its resume state), past epochs={epochs}; "
            f"pass epochs > {dataset.epoch} (epochs count from 0, not from the resume point)"
        )

    def read_to_end() -> bool:
        return dataset.plan()[1].rounds == 0

    last = epochs if epochs is not None else dataset.epoch + (2 if read_to_end() else 1)  # stop before it
    while True:
        if read_to_end():
            if dataset.position == 0 and last == math.inf:
                raise DatasetError(
                    f"epoch {dataset.epoch} has no round ({dataset.total_packs} packs, world_size "
                    f"{dataset.world_size}): epochs=math.inf would never yield; build more packs or use fewer ranks"
                )
            if dataset.epoch + 1 >= last:
                return
            dataset.set_epoch(dataset.epoch + 1)
        elif dataset.epoch >= last:
            return
        yield from one_epoch(dataset)


def _epoch_batches(dataset: PackedDataset) -> Iterator[MicroBatch]:
    for mb in _epoch_micro_batches(dataset):
        dataset.advance(mb.resume_after)
        yield mb


def packed_batches(dataset: PackedDataset, epochs: float | None = None) -> Iterator[MicroBatch]:
    """Collated micro-batches of at most `dataset.token_budget` tokens, epoch after epoch.

        packed_batches(ds)                   the rest of the current epoch; then ds is at the next epoch
        packed_batches(ds, epochs=3)         through epoch 2 (epochs 0, 1, 2 from a fresh dataset; a
                                             dataset resumed in epoch 1 finishes it, then reads epoch 2)
        packed_batches(ds, epochs=math.inf)  without end (count optimizer steps yourself)

    Each epoch is shuffled by (seed, epoch); `set_epoch` is called at each epoch's end. Every rank
    yields the same number (one per round; with balance, a step's share may take several). The
    dataset's position advances when each micro-batch is handed out, so `dataset.state_dict()`
    taken after training on it resumes right after it (with balance, at the start of its step until
    the step's last micro-batch). Rounds prefetched by workers are not counted: a restart reads them
    again. The tensors of micro-batches assembled together (about CHUNK_TOKENS tokens of rounds) are
    views into shared buffers; `.to(device)` copies. A loop may stop early: the read-ahead thread and
    workers stop when the iterator is closed or collected, or at interpreter exit.
    """
    _check_epochs(epochs)
    return _over_epochs(dataset, epochs, _epoch_batches)


def _epoch_steps(dataset: PackedDataset) -> Iterator[list[MicroBatch]]:
    step: list[MicroBatch] = []
    for mb in _epoch_micro_batches(dataset):
        if step and mb.step != step[-1].step:
            dataset.advance(step[-1].resume_after)
            yield step
            step = []
        step.append(mb)
    if step:
        dataset.advance(step[-1].resume_after)
        yield step


def packed_steps(dataset: PackedDataset, epochs: float | None = None) -> Iterator[list[MicroBatch]]:
    """The micro-batches of each optimizer step of a balanced plan, one list per step; `epochs` as in
    `packed_batches` (a step never spans two epochs).

    Every rank yields the same number of steps (ranks differ in how many micro-batches a step
    holds, so normalise with `window_norm(step)`). `dataset.state_dict()` taken after training
    on a step resumes at the next step.
    """
    if dataset.balance is None:
        raise DatasetError(
            "packed_steps needs PackedDataset(balance='attention', packs_per_step=N); "
            "without a plan use packed_batches and group micro-batches yourself"
        )
    _check_epochs(epochs)
    return _over_epochs(dataset, epochs, _epoch_steps)
