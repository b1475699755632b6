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

Balanced ranks (`balance="attention", packs_per_step=N, alpha=a`). Dealing row groups balances
tokens, not work: a pack of one 4096-token document costs 16x the attention of sixteen 256-token
samples. In this mode every rank plans the same global order (the units and rows above, with
no rank split), cuts it into steps of N packs and keeps its share of each step from
`assign_lpt(attn_cost + a * n_tokens, world_size)`. 2 ranks, N = 4::

    epoch order     p5 p2 p7 p0 | p3 p6 p1 p4 | ...       costs  9 7 6 5 | 4 8 1 3
    step 0 (LPT)    r0: p5 p0 (9+5 = 14)    r1: p2 p7 (7+6 = 13)
    step 1 (LPT)    r0: p6 (8)              r1: p3 p1 p4 (4+1+3 = 8)
    rank 0 reads    p5 p0 p6 ...            (PackRow.step 0 0 1 ...)

Planning reads only the `attn_cost` and `n_tokens` columns (once per dataset); token columns are
read only for the row groups that hold one of this rank's packs, one row group at a time. Ranks
get different numbers of packs but the same steps, so consume them with `packed_steps` (one list
of micro-batches per step, never a micro-batch across two steps). even_ranks leaves out the last,
partial step (`dropped_for_evenness` packs of the whole epoch); without it, the partial step is
dealt too and a rank may get none of it, so keep even_ranks on under DDP. Workers: worker w of k
reads the rank's packs w, w+k, w+2k, ..., so the DataLoader's round-robin gives them back in plan
order and resume works as above; the price is that workers whose packs share a row group each
decode it. The resume state adds `{balance, packs_per_step, alpha}`; changing them mid-epoch is
refused like a different world size.

Documents (`isolate_documents=True`). Stream builds write one attention segment per window
(`cu_seqlens` [0, len]) and keep document starts in `doc_cu_seqlens`. Isolating reads
`doc_cu_seqlens` as the segments and puts -100 on each document's first label, so no pair
crosses a document and positions restart per document (collate derives them from the segments)::

    doc_cu_seqlens [0, 3, 5]   input_ids [a0 a1 E b0 E]
    as written     cu_seqlens [0, 5]      labels [-100 a1 E b0   E]   positions 0 1 2 3 4
    isolated       cu_seqlens [0, 3, 5]   labels [-100 a1 E -100 E]   positions 0 1 2 0 1

Packed builds have `doc_cu_seqlens == cu_seqlens`, so the option changes nothing there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from packtool.errors import DatasetError, PackFormatError
from packtool.format import attn_cost, read_manifest, sha256_file
from packtool.labels import IGNORE_INDEX
from packtool.loader.balance import assign_lpt, pack_costs
from packtool.loader.collate import MicroBatch, PackRow, batch_by_tokens
from packtool.shards import SegmentColumns

COLUMNS = ["input_ids", "labels", "cu_seqlens", "attn_cost", "pack_hash"]
# schema v2 (pairs and groups): column -> SegmentColumns field
SEGMENT_COLUMNS = {
    "segment_groups": "groups",
    "segment_kinds": "kinds",
    "completion_index": "completion_index",
    "segment_rewards": "rewards",
    "segment_advantages": "advantages",
}
STATE_KEYS = ("epoch", "consumed", "seed", "world_size", "num_workers")
BALANCE_MODES = (None, "attention")


@dataclass(frozen=True, slots=True)
class Unit:
    """One row group: the smallest piece read at once."""

    shard: int
    row_group: int
    first_row: int  # row index of the group inside its shard
    rows: int


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


def _row_costs(table: pa.Table, isolate_documents: bool) -> np.ndarray:
    """Cost inputs of a row group's packs from its small columns: sum(l_i^2) per pack, as int64.

    With isolated documents the attention segments are the documents, so the cost comes from
    `doc_cu_seqlens` (a few offsets per pack) instead of the `attn_cost` column.
    """
    if not isolate_documents:
        return table.column("attn_cost").to_numpy().astype(np.int64)
    col = table.column("doc_cu_seqlens").combine_chunks()
    offsets, values = col.offsets.to_numpy(), col.values.to_numpy().astype(np.int64)
    steps = np.diff(values)
    steps[offsets[1:-1] - 1] = 0  # the step from one pack's last offset to the next pack's 0
    summed = np.concatenate([[0], np.cumsum(steps**2)])
    return summed[offsets[1:] - 1] - summed[offsets[:-1]]


@dataclass(frozen=True, slots=True)
class BalancedPlan:
    """One epoch of `balance="attention"`: the global pack order and each rank's share of it.

    Position p of the epoch is row `row[p]` of unit `unit[p]`, in step `p // packs_per_step`;
    `per_rank[r]` lists the positions rank r reads, ascending (step by step).
    """

    unit: np.ndarray  # int64 [packs in the epoch]
    row: np.ndarray  # int64, row inside the unit
    cost: np.ndarray  # float64, attn_cost + alpha * n_tokens
    per_rank: list[np.ndarray]


@dataclass(frozen=True, slots=True)
class _Decoded:
    """One unit's columns; list columns as (offsets, values)."""

    unit: int
    ids: tuple[np.ndarray, np.ndarray]
    labels: tuple[np.ndarray, np.ndarray]
    cu: tuple[np.ndarray, np.ndarray]  # doc_cu_seqlens when documents are isolated
    attn_cost: np.ndarray
    pack_hash: list[str]
    segments: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # schema v2 columns, as (offsets, values)


class PackedDataset(IterableDataset):
    """Packs of one build folder (manifest.json + shards), as `PackRow`s.

    Args:
        path: the build output folder.
        seed, shuffle: the epoch order is a pure function of (seed, epoch).
        rank, world_size: default from torch.distributed when initialised, else 0 / 1.
        num_workers: the DataLoader's num_workers (0 = iterate in this process); the resume state
            depends on it, so it is fixed here.
        verify_checksums: hash every shard against the manifest's sha256 before reading.
        even_ranks: cut every rank to the same number of packs per epoch (balanced: the same
            number of steps, by leaving out the last, partial step).
        balance: None (row groups dealt to ranks) or "attention" (every global step of
            `packs_per_step` packs split across ranks by LPT on attn_cost + alpha * n_tokens).
        packs_per_step: packs per optimizer step over all ranks; only with balance, >= world_size.
        alpha: weight of the linear term of a pack's cost, in units of one attention score slot.
        isolate_documents: use `doc_cu_seqlens` as the attention segments and set the label of
            each document's first token to -100 (stream builds: no pair across documents).
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
        balance: str | None = None,
        packs_per_step: int | None = None,
        alpha: float = 0.0,
        isolate_documents: bool = False,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        try:
            self.manifest: dict[str, Any] = read_manifest(self.path)
        except PackFormatError as error:
            raise DatasetError(str(error)) from None
        self.seed, self.shuffle, self.even_ranks = seed, shuffle, even_ranks
        self.rank, self.world_size = _resolve_ranks(rank, world_size)
        self.num_workers = num_workers
        self.balance, self.packs_per_step, self.alpha = balance, packs_per_step, float(alpha)
        self.isolate_documents = isolate_documents
        self._check_options()
        self.shard_files: list[Path] = [self.path / s["file"] for s in self.manifest["shards"]]
        if verify_checksums:
            self.verify_checksums()
        self.units = self._read_footers()
        self._unit_costs: list[np.ndarray] | None = None  # balanced mode: read once, on first use
        self._plan: tuple[int, BalancedPlan] | None = None  # the last epoch planned
        self.epoch = 0
        self.consumed = 0

    def _check_options(self) -> None:
        """All problems at once, each with the fix."""
        problems = []
        if self.num_workers < 0:
            problems.append(f"num_workers must be >= 0, got {self.num_workers}")
        if self.balance not in BALANCE_MODES:
            problems.append(f"balance {self.balance!r} is not one of {BALANCE_MODES}")
        if self.balance is None and self.packs_per_step is not None:
            problems.append("packs_per_step needs balance='attention'")
        if self.balance is not None and (self.packs_per_step is None or self.packs_per_step < self.world_size):
            problems.append(
                f"balance={self.balance!r} needs packs_per_step >= world_size {self.world_size} "
                f"(got {self.packs_per_step}): the global packs of one optimizer step"
            )
        if self.alpha < 0:
            problems.append(f"alpha must be >= 0, got {self.alpha}")
        if problems:
            raise DatasetError("; ".join(problems))

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

    # ---- the epoch plan: pure functions of (seed, epoch, rank, world_size, num_workers, balance options) ----

    def _unit_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.units)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.units)).tolist()

    def _row_order(self, epoch: int, u: int) -> np.ndarray:
        rows = self.units[u].rows
        if not self.shuffle:
            return np.arange(rows)
        return np.random.default_rng([self.seed, epoch, u]).permutation(rows)

    def _rank_units(self, epoch: int, rank: int) -> list[int]:
        return self._unit_order(epoch)[rank :: self.world_size]

    def _worker_units(self, epoch: int) -> list[list[int]]:
        mine = self._rank_units(epoch, self.rank)
        k = max(1, self.num_workers)
        return [mine[w::k] for w in range(k)]

    def _costs(self) -> list[np.ndarray]:
        """attn_cost + alpha * n_tokens of every pack, per unit, from the small columns only."""
        if self._unit_costs is None:
            columns = ["doc_cu_seqlens" if self.isolate_documents else "attn_cost", "n_tokens"]
            costs: list[np.ndarray] = []
            files: dict[int, pq.ParquetFile] = {}
            for unit in self.units:
                if unit.shard not in files:
                    files = {unit.shard: pq.ParquetFile(self.shard_files[unit.shard])}
                table = files[unit.shard].read_row_group(unit.row_group, columns=columns)
                n_tokens = table.column("n_tokens").to_numpy()
                costs.append(pack_costs(_row_costs(table, self.isolate_documents), n_tokens, self.alpha))
            self._unit_costs = costs
        return self._unit_costs

    def balanced_plan(self, epoch: int | None = None) -> BalancedPlan:
        """The epoch's global order cut into steps, each step's packs dealt to ranks by `assign_lpt`.

        Every rank computes the same plan (it depends on seed, epoch, world_size, packs_per_step
        and alpha only) and keeps its own share. With even_ranks the last, partial step is left
        out; without, its packs are dealt too (a rank may then get none of them).
        """
        if self.balance is None or self.packs_per_step is None:
            raise DatasetError("balanced_plan needs PackedDataset(balance='attention', packs_per_step=N)")
        e = self.epoch if epoch is None else int(epoch)
        if self._plan is not None and self._plan[0] == e:
            return self._plan[1]
        order = self._unit_order(e)
        rows = [self._row_order(e, u) for u in order]
        unit = np.concatenate([np.full(len(r), u, dtype=np.int64) for u, r in zip(order, rows, strict=True)])
        costs = self._costs()
        cost = np.concatenate([costs[u][r] for u, r in zip(order, rows, strict=True)])
        n = self.packs_per_step
        end = len(cost) // n * n if self.even_ranks else len(cost)
        shares: list[list[np.ndarray]] = [[] for _ in range(self.world_size)]
        for lo in range(0, end, n):
            for r, picked in enumerate(assign_lpt(cost[lo : min(lo + n, end)].tolist(), self.world_size)):
                shares[r].append(lo + np.asarray(picked, dtype=np.int64))
        plan = BalancedPlan(
            unit=unit,
            row=np.concatenate(rows).astype(np.int64),
            cost=cost,
            per_rank=[np.concatenate(s) if s else np.zeros(0, np.int64) for s in shares],
        )
        self._plan = (e, plan)
        return plan

    def packs_per_rank(self, epoch: int | None = None) -> list[int]:
        e = self.epoch if epoch is None else epoch
        if self.balance is not None:
            return [len(share) for share in self.balanced_plan(e).per_rank]
        return [sum(self.units[u].rows for u in self._rank_units(e, r)) for r in range(self.world_size)]

    def __len__(self) -> int:
        """Packs this rank yields in the current epoch (after the even-ranks cut)."""
        per_rank = self.packs_per_rank()
        if self.balance is not None:
            return per_rank[self.rank]  # ranks differ in packs, not in steps
        return min(per_rank) if self.even_ranks else per_rank[self.rank]

    @property
    def dropped_for_evenness(self) -> int:
        """Packs of the epoch this rank does not read because of even_ranks (balanced: of all ranks)."""
        if self.balance is not None:
            return sum(u.rows for u in self.units) - sum(self.packs_per_rank())
        return self.packs_per_rank()[self.rank] - len(self)

    # ---- resume state ----

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = int(epoch), 0

    def mark_consumed(self, n_packs: int) -> None:
        """Called by the consumer for every pack it trained on (packed_batches does it)."""
        self.consumed += int(n_packs)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
        }
        if self.balance is not None:  # absent otherwise, so states of unbalanced runs keep their shape
            state.update(balance=self.balance, packs_per_step=self.packs_per_step, alpha=self.alpha)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise DatasetError(f"resume state lacks {missing}; expected keys {list(STATE_KEYS)}")
        saved = {**dict.fromkeys(("balance", "packs_per_step"), None), "alpha": 0.0, **state}
        now = self.state_dict() | {"balance": self.balance, "packs_per_step": self.packs_per_step, "alpha": self.alpha}
        plan_keys = ("seed", "world_size", "num_workers", "balance", "packs_per_step", "alpha")
        mismatched = [f"{k} {saved[k]} (now {now[k]})" for k in plan_keys if saved[k] != now[k]]
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
        if self.balance is not None:
            # Worker w takes every k-th pack of the rank's share, so the DataLoader's round-robin
            # hands them back in plan order and the resume arithmetic below is unchanged.
            plan = self.balanced_plan(self.epoch)
            mine = plan.per_rank[self.rank]
            positions = [mine[w::n_workers] for w in range(n_workers)]
            lengths = [len(p) for p in positions]
        else:
            units = self._worker_units(self.epoch)
            lengths = [sum(self.units[u].rows for u in stream) for stream in units]
        taken = _taken_per_worker(lengths, self.consumed)
        # The DataLoader always asks worker 0 first; rotate so that it serves the stream whose
        # turn it was when the state was saved (the cyclic order, and so the pack order, is kept).
        stream = (_next_stream(lengths, taken) + worker) % n_workers
        stop = _taken_per_worker(lengths, len(self))[stream]
        if self.balance is not None:
            yield from self._read_positions(plan, positions[stream][taken[stream] : stop])
        else:
            yield from self._read(units[stream], taken[stream], stop)

    def _decode(self, files: dict[int, pq.ParquetFile], u: int) -> _Decoded:
        """The columns of one unit as numpy: one row group in memory. `files` keeps the last shard open."""
        unit = self.units[u]
        if unit.shard not in files:
            files.clear()
            files[unit.shard] = pq.ParquetFile(self.shard_files[unit.shard])
        cu_name = "doc_cu_seqlens" if self.isolate_documents else "cu_seqlens"
        v2 = "segment_groups" in files[unit.shard].schema_arrow.names
        extra = list(SEGMENT_COLUMNS) if v2 else []
        table = files[unit.shard].read_row_group(unit.row_group, columns=[*COLUMNS[:2], cu_name, *COLUMNS[3:], *extra])

        def lists(name: str) -> tuple[np.ndarray, np.ndarray]:
            col = table.column(name).combine_chunks()
            return col.offsets.to_numpy(), col.values.to_numpy()

        return _Decoded(
            u,
            lists("input_ids"),
            lists("labels"),
            lists(cu_name),
            table.column("attn_cost").to_numpy(),
            table.column("pack_hash").to_pylist(),
            {name: lists(name) for name in extra} if v2 else None,
        )

    def _pack(self, cols: _Decoded, i: int, step: int = -1) -> PackRow:
        ids, labels, cu = (values[offs[i] : offs[i + 1]].copy() for offs, values in (cols.ids, cols.labels, cols.cu))
        cost = int(cols.attn_cost[i])
        if self.isolate_documents:
            labels[cu[:-1]] = IGNORE_INDEX  # no document learns to predict the next one's first token
            cost = attn_cost(cu)
        unit = self.units[cols.unit]
        shard = self.shard_files[unit.shard].name
        segments = None
        if cols.segments is not None:
            values = {SEGMENT_COLUMNS[k]: v[o[i] : o[i + 1]].copy() for k, (o, v) in cols.segments.items()}
            segments = SegmentColumns(**values)
        return PackRow(ids, labels, cu, cols.pack_hash[i], cost, shard, unit.first_row + i, step, segments)

    def _read(self, unit_ids: list[int], start: int, stop: int) -> Iterator[PackRow]:
        position = 0  # packs of this worker's stream before the current unit
        files: dict[int, pq.ParquetFile] = {}
        for u in unit_ids:
            unit = self.units[u]
            lo, hi = max(start - position, 0), min(stop - position, unit.rows)
            position += unit.rows
            if lo >= hi:
                if position >= stop:
                    return
                continue  # resume skips whole row groups without reading them
            cols = self._decode(files, u)
            for i in self._row_order(self.epoch, u)[lo:hi]:
                yield self._pack(cols, int(i))
            if position >= stop:
                return

    def _read_positions(self, plan: BalancedPlan, positions: np.ndarray) -> Iterator[PackRow]:
        """Packs at these epoch positions (ascending, so each unit is decoded once per worker)."""
        files: dict[int, pq.ParquetFile] = {}
        cols: _Decoded | None = None
        for p in positions.tolist():
            if cols is None or cols.unit != plan.unit[p]:
                cols = self._decode(files, int(plan.unit[p]))
            yield self._pack(cols, int(plan.row[p]), step=p // self.packs_per_step)


def _identity(item: Any) -> Any:
    return item


def _micro_batches(dataset: PackedDataset, token_budget: int, fixed_shape: bool) -> Iterator[MicroBatch]:
    """Micro-batches of the current epoch, not yet counted as consumed."""
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
    yield from batch_by_tokens(
        iter(loader), token_budget, fixed_shape=fixed_shape, capacity=dataset.capacity, pad_id=dataset.pad_id
    )


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
    fixed_shape pads every pack to the manifest capacity (see collate.batch_by_tokens). In
    balanced mode a micro-batch never spans two steps (`MicroBatch.step`).
    """
    for mb in _micro_batches(dataset, token_budget, fixed_shape):
        dataset.mark_consumed(mb.n_packs)
        yield mb


def packed_steps(
    dataset: PackedDataset,
    *,
    token_budget: int,
    fixed_shape: bool = False,
) -> Iterator[list[MicroBatch]]:
    """The micro-batches of each optimizer step of a balanced plan, one list per step.

    Every rank yields the same number of steps (ranks differ in how many micro-batches a step
    holds, so normalise with `window_norm(step)`). The step's packs are counted as consumed when
    the list is yielded: `dataset.state_dict()` after training on it resumes at the next step.
    """
    if dataset.balance is None:
        raise DatasetError(
            "packed_steps needs PackedDataset(balance='attention', packs_per_step=N); "
            "without a plan use packed_batches and group micro-batches yourself"
        )
    step: list[MicroBatch] = []
    for mb in _micro_batches(dataset, token_budget, fixed_shape):
        if step and mb.step != step[-1].step:
            dataset.mark_consumed(sum(m.n_packs for m in step))
            yield step
            step = []
        step.append(mb)
    if step:
        dataset.mark_consumed(sum(m.n_packs for m in step))
        yield step
