"""The epoch plan: which rank trains which pack in which round. Pure functions of a few integers.

Global order. Units are row groups; one epoch visits them in a seeded permutation and the rows
of each in a seeded permutation, so global position p names one pack::

    units (shard, row_group)      u0 u1 u2 u3                  from the Parquet footers
    seeded permutation (epoch e)  u2 u0 u3 u1                  rng([seed, e])
    rows inside a unit            shuffled with rng([seed, e, unit])
    global positions              0 1 2 ... N-1

Rounds. Every rank takes part in every round with one share (a "slot"), so every rank runs
the same number of rounds and a DDP step never waits for a rank that ran out. Three planners
cut the positions from `start` on into rounds of W slots (W = world size):

    packs        slot = one pack           round k = positions [kW, kW+W)            (Trainer batching)
    token budget slot = consecutive packs  greedy, sum of n_tokens <= budget          (one micro-batch)
    balanced     slot = a rank's LPT share of a step of P consecutive packs           (one optimizer step)

    token budget 8, W = 2, n_tokens  5 3 | 4 4 | 6 | 7 | 2 1
    slots                            [0 1] [2 3] [4] [5] [6 7]
    rounds                           r0: slot [0 1] -> rank 0, [2 3] -> rank 1    r1: [4] -> 0, [5] -> 1
    tail                             one slot [6 7] < W slots, 2 packs >= W: re-cut  r2: [6] -> 0, [7] -> 1

What is left out. The last round must have W slots. Packs: the last N mod W (at most W-1). Token
budget: a short tail of fewer than W slots is re-cut into W smaller slots when it holds at least
W packs (each a part of a slot, so still under the budget), else its fewer than W packs are left
out. Balanced: a last partial step with at least W packs is dealt like the others (LPT gives every
rank one pack before any gets two), else left out. So at most W-1 packs per epoch, ever.

The loader (`PackedDataset.plan`) and `packtool trace` both plan through `plan_epoch` and cut a
rank's share of a round into micro-batches through `share_micro_batches`, so what the trace
says a step trained is what the loader reads.

Resume. Rounds cover consecutive positions and each planner is memoryless at a round boundary,
so the plan from position q is the tail of the plan from 0 whenever q is a round boundary. The
resume state is global: the epoch and the position where the next round starts. Any world size,
budget or step size can plan the rest of the epoch from there: no pack repeated, none skipped.
`read_state` is the one reader of a saved state, for the loader and for `packtool trace` alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from packtool.checks import MAX_SEED, integer_problem, seed_problem
from packtool.errors import DatasetError
from packtool.loader.balance import assign_lpt, pack_costs


@dataclass(frozen=True, slots=True)
class EpochOrder:
    """Global position p of the epoch is row `row[p]` of unit `unit[p]`."""

    unit: np.ndarray  # int64 [N]
    row: np.ndarray  # int64 [N]


def epoch_order(unit_rows: Sequence[int], seed: int, epoch: int, shuffle: bool, window: int = 1) -> EpochOrder:
    """The epoch's global order; `window` > 1 (an interleaved build, see `window_order`) moves whole windows."""
    if window > 1 and shuffle:
        return window_order(unit_rows, seed, epoch, window)
    units = np.random.default_rng([seed, epoch]).permutation(len(unit_rows)) if shuffle else np.arange(len(unit_rows))
    rows = [
        np.random.default_rng([seed, epoch, int(u)]).permutation(unit_rows[u]) if shuffle else np.arange(unit_rows[u])
        for u in units
    ]
    unit = np.repeat(units.astype(np.int64), [unit_rows[u] for u in units])
    row = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    return EpochOrder(unit, row)


def window_order(unit_rows: Sequence[int], seed: int, epoch: int, window: int) -> EpochOrder:
    """An interleaved build's epoch: the build's windows of `window` consecutive packs stay whole, so every
    window the build measured (its share of each source) is one window of global positions [jK, (j+1)K).

    The build makes every row group hold whole windows (window divides row_group_rows and rows_per_shard),
    all but the last, which may end with the build's partial window. So: row groups in a seeded order with
    that last one kept last; inside a row group, its windows in a seeded order and each window's packs in a
    seeded order (a window's mix does not depend on the order of its packs). K = 2:

        units (rows)        u0 (4: windows a b)   u1 (4: c d)   u2 (3: e + 1 partial)
        seeded units        u1 u0 | u2 last
        windows, packs      d1 d0 c0 c1 | a1 a0 b0 b1 | e0 e1 p0
    """
    partial = [u for u, rows in enumerate(unit_rows) if rows % window]
    if partial and partial != [len(unit_rows) - 1]:
        raise DatasetError(
            f"the manifest says windows of {window} packs, but row group {partial[0]} holds {unit_rows[partial[0]]} "
            "packs (not whole windows): the shards do not match the manifest; rebuild the output"
        )
    shuffled = np.random.default_rng([seed, epoch]).permutation(len(unit_rows))
    units = np.array([u for u in shuffled if u not in partial] + partial, dtype=np.int64)
    rows = []
    for u in units.tolist():
        rng = np.random.default_rng([seed, epoch, u])
        full = unit_rows[u] // window
        starts = rng.permutation(full) * window
        inside = rng.permuted(np.tile(np.arange(window), (full, 1)), axis=1)
        tail = full * window + rng.permutation(unit_rows[u] - full * window)
        rows.append(np.concatenate([(starts[:, None] + inside).ravel(), tail]))
    unit = np.repeat(units, [unit_rows[u] for u in units])
    row = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    return EpochOrder(unit, row)


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """Rounds of the epoch from global position `start` to `total`.

    Position start + i belongs to rank `rank[i]` in round `round[i]` (rank -1: left out). Round k
    covers global positions [bounds[k], bounds[k + 1]); positions from bounds[-1] on are left out.
    """

    start: int
    total: int
    world_size: int
    rank: np.ndarray  # int32 [total - start]
    round: np.ndarray  # int64 [total - start]
    bounds: np.ndarray  # int64 [rounds + 1], global positions

    @property
    def rounds(self) -> int:
        return len(self.bounds) - 1

    @property
    def dropped(self) -> int:
        return self.total - int(self.bounds[-1])

    def positions(self, rank: int) -> np.ndarray:
        """Global positions of this rank's packs, ascending (so round by round)."""
        return self.start + np.flatnonzero(self.rank == rank)

    def packs_per_rank(self) -> list[int]:
        return np.bincount(self.rank[self.rank >= 0], minlength=self.world_size).tolist()


def _plan(start: int, total: int, world: int, slot_of: np.ndarray, n_slots: int) -> EpochPlan:
    """Slots (numbered along the positions, -1 = left out) -> ranks and rounds: slot s is rank s % W of round s // W."""
    kept = slot_of >= 0
    rank = np.where(kept, slot_of % world, -1).astype(np.int32)
    round_ = np.where(kept, slot_of // world, -1).astype(np.int64)
    n_rounds = n_slots // world
    firsts = np.searchsorted(round_[kept], np.arange(n_rounds + 1)) if n_rounds else np.zeros(1, np.int64)
    bounds = start + firsts.astype(np.int64)
    return EpochPlan(start, total, world, rank, round_, bounds)


def plan_packs(start: int, total: int, world: int) -> EpochPlan:
    """One pack per rank per round: rank r takes positions start + r, start + r + W, ..."""
    n = total - start
    keep = n // world * world
    slot_of = np.where(np.arange(n) < keep, np.arange(n), -1)
    return _plan(start, total, world, slot_of, keep)


def slot_ends(lengths: Sequence[int] | np.ndarray, budget: int) -> list[int]:
    """The loader's one token-budget cut: consecutive packs, greedily, into slots of at most `budget`
    tokens (exclusive ends). A pack longer than the budget cannot be split, so it is refused.

    lengths [5, 3, 4, 4, 6], budget 8 -> [2, 4, 5].
    """
    if budget <= 0:
        raise DatasetError(f"token_budget must be positive, got {budget}")
    ends: list[int] = []
    used = 0
    for i, n in enumerate(np.asarray(lengths).tolist()):
        if n > budget:
            raise DatasetError(f"pack {i} has {n} tokens > token_budget {budget}; raise the budget to the capacity")
        if used and used + n > budget:
            ends.append(i)
            used = 0
        used += n
    if len(lengths):
        ends.append(len(lengths))
    return ends


def _recut_tail(lo: int, ends: list[int], world: int) -> list[int]:
    """A tail of fewer than `world` slots holding >= world packs, cut into exactly `world` slots.

    Halving the slot with the most packs keeps every slot consecutive and under the budget.
    """
    starts = [lo, *ends[:-1]]
    slots = list(zip(starts, ends, strict=True))
    while len(slots) < world:
        i = max(range(len(slots)), key=lambda j: (slots[j][1] - slots[j][0], -j))
        a, b = slots[i]
        mid = (a + b) // 2
        slots[i : i + 1] = [(a, mid), (mid, b)]
    return [b for _, b in slots]


def plan_token_budget(start: int, lengths: np.ndarray, world: int, budget: int) -> EpochPlan:
    """Slots of at most `budget` tokens (n_tokens of positions start..N-1), W per round."""
    n = len(lengths)
    ends = slot_ends(lengths, budget)
    full = len(ends) // world * world
    tail_lo = ends[full - 1] if full else 0
    tail = ends[full:]
    # A tail of fewer than W packs after the last full round is left out.
    ends = ends[:full] + (_recut_tail(tail_lo, tail, world) if tail and n - tail_lo >= world else [])
    slot_of = np.full(n, -1, np.int64)
    lo = 0
    for s, hi in enumerate(ends):
        slot_of[lo:hi] = s
        lo = hi
    return _plan(start, start + n, world, slot_of, len(ends))


def plan_balanced(start: int, costs: np.ndarray, world: int, packs_per_step: int) -> EpochPlan:
    """Steps of `packs_per_step` consecutive packs, each dealt to ranks by LPT on `costs`; a rank's share is a slot."""
    n = len(costs)
    slot_of = np.full(n, -1, np.int64)
    steps = 0
    for lo in range(0, n, packs_per_step):
        hi = min(lo + packs_per_step, n)
        if hi - lo < world:  # a rank would get nothing: the (< W) packs are left out
            break
        for r, picked in enumerate(assign_lpt(costs[lo:hi].tolist(), world)):
            slot_of[lo + np.asarray(picked, dtype=np.int64)] = steps * world + r
        steps += 1
    return _plan(start, start + n, world, slot_of, steps * world)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The loader options that decide the rounds (PackedDataset's arguments of the same names)."""

    world_size: int
    capacity: int
    token_budget: int | None = None
    fixed_shape: bool = False
    balance: str | None = None
    packs_per_step: int | None = None
    alpha: float = 0.0


def positions_to_flat(unit_rows: Sequence[int], order: EpochOrder, start: int) -> np.ndarray:
    """Index, in unit-order flat numbering (unit 0's rows, then unit 1's, ...), of positions start..N-1."""
    unit_start = np.concatenate([[0], np.cumsum(unit_rows, dtype=np.int64)])[:-1].astype(np.int64)
    return unit_start[order.unit[start:]] + order.row[start:]


def plan_epoch(
    unit_rows: Sequence[int],
    order: EpochOrder,
    start: int,
    options: PlanOptions,
    per_pack: Callable[[], tuple[np.ndarray, np.ndarray]],
) -> EpochPlan:
    """The rounds of an epoch from position `start`, by the planner the options pick.

    `per_pack()` gives (n_tokens, attention cost) of every pack in unit-order flat numbering; it
    is called only by the planners that weigh packs (token budget, balance), so the plain modes
    read no column.
    """
    n = len(order.unit)
    world = options.world_size
    if options.balance is not None and options.packs_per_step is not None:
        tokens, costs = per_pack()
        flat = positions_to_flat(unit_rows, order, start)
        return plan_balanced(start, pack_costs(costs[flat], tokens[flat], options.alpha), world, options.packs_per_step)
    if options.token_budget is not None and options.fixed_shape:
        per_batch = options.token_budget // options.capacity
        return plan_token_budget(
            start, np.ones(n - start, dtype=np.int64), world, per_batch
        )  # slots of per_batch packs
    if options.token_budget is not None:
        lengths = per_pack()[0][positions_to_flat(unit_rows, order, start)]
        return plan_token_budget(start, lengths, world, options.token_budget)
    return plan_packs(start, n, world)


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group consecutive packs into micro-batches of at most `token_budget` tokens (`slot_ends`' cut).

    Order is kept (the stream is already shuffled). lengths [5, 4, 3, 6], budget 8 -> [[0], [1, 2], [3]].
    """
    ends = slot_ends(lengths, token_budget)
    return [list(range(start, end)) for start, end in zip([0, *ends[:-1]], ends)]


def share_micro_batches(lengths: Sequence[int], options: PlanOptions) -> list[list[int]]:
    """A rank's share of one round (its packs' token counts, in reading order) cut into micro-batches.

    Needs a token budget; a pack counts `capacity` tokens in fixed shape (it is padded to it).
    """
    if options.token_budget is None:
        raise DatasetError("micro-batches need a token_budget")
    sizes = [options.capacity] * len(lengths) if options.fixed_shape else list(lengths)
    return plan_micro_batches(sizes, options.token_budget)


@dataclass(frozen=True, slots=True)
class ResumeState:
    """`PackedDataset.state_dict()` read and checked: where the next round starts (epoch, global position),
    what fixed the order (seed, shuffle) and whose packs the position counts (build, the manifest's sha256)."""

    epoch: int
    position: int
    seed: int
    shuffle: bool = True
    build: str | None = None  # None: saved before states named their build (resumed at an epoch boundary only)
    world_size: int = 1  # the ranks it was saved under, for the record: a resume may use another
    left_out: int = 0  # for the record


STATE_KEYS = ("epoch", "position", "seed")  # what a state must hold; the rest have defaults


def read_state(state: Any, where: str = "resume state") -> ResumeState:
    """The one reader of a loader state, for `load_state_dict` and `packtool trace --state` alike: every
    problem at once. Strict types, since JSON and hand edits blur them: "no" is not false, 3.7 is not a
    position, true is not the integer 1; a key no state holds is named rather than dropped."""
    if not isinstance(state, Mapping):
        raise DatasetError(
            f"{where}: a loader state is a mapping (PackedDataset.state_dict()), got {type(state).__name__}"
        )
    known = [f.name for f in fields(ResumeState)]
    problems = []
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        problems.append(f"lacks {missing}; a state holds at least {list(STATE_KEYS)}")
    unknown = sorted(repr(k) for k in state if k not in known)
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)}; a state holds {', '.join(known)}")
    checks = {
        "epoch": lambda v: integer_problem(v, 0, MAX_SEED, "epochs count from 0"),
        "position": lambda v: integer_problem(v, 0, MAX_SEED, "a global position in the epoch's packs"),
        "seed": seed_problem,
        "world_size": lambda v: integer_problem(v, 1, MAX_SEED, "ranks"),
        "left_out": lambda v: integer_problem(v, 0, MAX_SEED, "packs"),
        "shuffle": lambda v: None if isinstance(v, bool) else f"expected true/false, got {type(v).__name__} {v!r}",
        "build": lambda v: None if isinstance(v, str | None) else f"expected a sha256, got {type(v).__name__} {v!r}",
    }
    problems += [f"{k}: {problem}" for k, check in checks.items() if k in state and (problem := check(state[k]))]
    if problems:
        raise DatasetError(f"{where}: " + "; ".join(problems))
    return ResumeState(
        int(state["epoch"]),
        int(state["position"]),
        int(state["seed"]),
        state.get("shuffle", True),
        state.get("build"),
        int(state.get("world_size", 1)),
        int(state.get("left_out", 0)),
    )
