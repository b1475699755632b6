"""`packtool trace`: what did step N train on, and when did this sample train.

Both answers are pure functions of the manifest and the loader settings that decide the order
(world size, token budget or packs per step, balance, seed, epoch). They plan every epoch through
the loader's own code (`schedule.epoch_order`, `schedule.plan_epoch`, `schedule.share_micro_batches`,
fed by `PackedDataset`'s reading of the footers and the small columns), so a trace cannot drift
from what `PackedDataset`, `packed_batches` and `packed_steps` yield.

What a step is, by mode (the loader's plan rounds, grouped as a training loop consumes them)::

    mode           micro-batch of a rank                      step
    packs          `batch_size` consecutive rounds (a         `accumulation` micro-batches
                   Trainer's per_device_train_batch_size)
    token budget   the rank's share of one round              `accumulation` micro-batches
    balanced       the rank's share of one round, cut by      one round (`packed_steps`)
                   the token budget

A step never spans two epochs: an epoch's last step may hold fewer micro-batches (as the Trainer
does with a short last accumulation window). Steps are counted from an anchor: step `first_step`
starts at (`epoch`, `position`), by default step 0 at the start of epoch 0. A saved loader state
or a checkpoint folder written by `packtool.loader.hf` is such an anchor, so a run resumed under
another world size is traced as two parts: the steps before the resume with the old settings,
the steps from it with the new ones.

    settings    world_size 2, token_budget 8, epoch 0, position 0, first_step 0
    positions   0 1 2 3 | 4 5 | 6 7           (rounds of the plan, n_tokens 5 3 4 4 6 7 2 1)
    step 1      rank 0 micro-batch 0: position 4    rank 1 micro-batch 0: position 5
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq

from packtool.checks import MAX_SEED, integer_problem
from packtool.errors import DatasetError, PacktoolError, TraceError

if TYPE_CHECKING:  # the loader (torch) is imported when a trace runs, not with the CLI
    from packtool.loader.schedule import EpochPlan, ResumeState

# The hf module's name of the loader state in a checkpoint folder; read here without importing
# transformers (hf.py imports it at module level).
CHECKPOINT_STATE = "packtool_data.json"
CHECKPOINT_TRAINER = "packtool_trainer.json"  # the run's gradient accumulation, beside the state
TRAINER_STATE = "trainer_state.json"
PACK_COLUMNS = ["pack_hash", "n_tokens", "sample_ids", "sources", "sample_hashes", "sample_repeats", "doc_cu_seqlens"]


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """The loader settings that decide the order, and how a training loop groups rounds into steps."""

    world_size: int = 1
    seed: int = 0
    shuffle: bool = True
    token_budget: int | None = None
    fixed_shape: bool = False
    balance: str | None = None
    packs_per_step: int | None = None
    alpha: float = 0.0
    isolate_documents: bool = False
    batch_size: int = 1  # packs mode: packs per micro-batch of a rank (the Trainer's per_device_train_batch_size)
    accumulation: int = 1  # micro-batches per step (gradient accumulation); 1 under balance
    epochs: int = 1  # epochs of the run, counted from epoch 0
    epoch: int = 0  # the anchor: step `first_step` starts at (epoch, position)
    position: int = 0
    first_step: int = 0
    # the loader state the anchor came from: the dataset resumes from it as a loader would, refusing the
    # same states (another build's, another seed's mid-epoch)
    state: ResumeState | None = None

    def check(self) -> None:
        problems = [
            f"{name} must be >= {low}, got {getattr(self, name)}"
            for name, low in (("world_size", 1), ("batch_size", 1), ("accumulation", 1), ("epochs", 1))
            if getattr(self, name) < low
        ]
        problems += [
            f"{name} must be >= 0, got {getattr(self, name)}"
            for name in ("epoch", "position", "first_step")
            if getattr(self, name) < 0
        ]
        if self.batch_size != 1 and (self.token_budget is not None or self.balance is not None):
            problems.append(
                "batch_size is for the packs mode (a Trainer batching packs); with a token_budget or balance the "
                "loader cuts the micro-batches"
            )
        if self.balance is not None and self.accumulation != 1:
            problems.append("under balance a step is one round of packs_per_step packs; leave accumulation at 1")
        if self.epoch >= self.epochs:
            problems.append(
                f"the anchor epoch {self.epoch} is not inside the run's {self.epochs} epoch(s); raise epochs"
            )
        if problems:
            raise TraceError("; ".join(problems))


def settings_from_state(state: Any, source: str, **settings: Any) -> TraceSettings:
    """Settings anchored at a loader state (`PackedDataset.state_dict()`): its epoch, position, seed and shuffle,
    read by the loader's own reader (`schedule.read_state`), so a state the loader refuses is refused here.

    `settings` override anything else (a resume may run under another world size; the state's is the default).
    """
    try:
        from packtool.loader.schedule import read_state
    except ImportError as err:
        raise TraceError(f"packtool trace needs the loader: {err}") from None
    try:
        read = read_state(state, source)
    except DatasetError as err:
        raise TraceError(str(err)) from None
    anchored = {
        "epoch": read.epoch,
        "position": read.position,
        "seed": read.seed,
        "shuffle": read.shuffle,
        "world_size": read.world_size,
        "state": read,
    }
    return TraceSettings(**{**anchored, **settings})


def read_state_file(path: Path) -> Any:
    """The JSON in a state file; what it holds is `schedule.read_state`'s to judge."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TraceError(
            f"{path}: cannot read a loader state ({err}); pass the JSON of PackedDataset.state_dict()"
        ) from None


def settings_from_checkpoint(folder: Path, **settings: Any) -> TraceSettings:
    """Settings anchored at a checkpoint folder of `packtool.loader.hf`: its loader state and global step.

    The Trainer's per-device batch size (`train_batch_size` in trainer_state.json) is the default
    batch_size, and its gradient accumulation (packtool_trainer.json; a checkpoint written before it
    has none, so the caller's) the default accumulation.
    """
    state_file = folder / CHECKPOINT_STATE
    if not state_file.is_file():
        raise TraceError(f"{folder}: no {CHECKPOINT_STATE}; it is not a checkpoint written by a packtool trainer")
    anchored: dict[str, Any] = {}
    trainer_file = folder / TRAINER_STATE
    if trainer_file.is_file():
        trainer = read_state_file(trainer_file)
        if not isinstance(trainer, dict):
            raise TraceError(f"{trainer_file}: a Trainer's state is a JSON object, got {type(trainer).__name__}")
        # the anchor step: "5", 5.0 or a missing one was passed over, and the trace counted from step 0
        step = trainer.get("global_step")
        problem = integer_problem(step, 0, MAX_SEED, "the Trainer's step count") if step is not None else "missing"
        if problem:
            raise TraceError(f"{trainer_file}: global_step: {problem}; it anchors the trace's steps")
        anchored["first_step"] = trainer["global_step"]
        if "train_batch_size" in trainer:
            problem = integer_problem(trainer["train_batch_size"], 1, MAX_SEED, "packs per micro-batch")
            if problem:
                raise TraceError(f"{trainer_file}: train_batch_size: {problem}")
            anchored["batch_size"] = trainer["train_batch_size"]
    steps_file = folder / CHECKPOINT_TRAINER
    if steps_file.is_file():
        steps = read_state_file(steps_file)
        accumulation = steps.get("gradient_accumulation_steps") if isinstance(steps, dict) else None
        if type(accumulation) is not int or accumulation < 1:
            raise TraceError(
                f'{steps_file}: expected {{"gradient_accumulation_steps": N >= 1}}, got {json.dumps(steps)[:80]}'
            )
        anchored["accumulation"] = accumulation
    return settings_from_state(read_state_file(state_file), str(state_file), **{**anchored, **settings})


@dataclass(frozen=True, slots=True)
class SampleSeen:
    sample_id: str
    source: str
    sample_hash: str
    tokens: int  # tokens of this document (a piece of a split sample counts its own)
    targets: int  # target tokens of this document as trained (labels != -100)
    repeat: int  # 0: the first copy; 1, 2, ...: copies made by source mixing
    location: str | None = None  # file:line, when the source files were read (`locate`)


@dataclass(frozen=True, slots=True)
class PackSeen:
    position: int  # global position in its epoch
    shard: str
    row: int
    pack_hash: str
    n_tokens: int
    samples: tuple[SampleSeen, ...]


@dataclass(frozen=True, slots=True)
class MicroBatchSeen:
    rank: int
    micro_batch: int
    packs: tuple[PackSeen, ...]


@dataclass(frozen=True, slots=True)
class StepTrace:
    step: int
    epoch: int
    micro_batches: tuple[MicroBatchSeen, ...]
    settings: TraceSettings

    def mix(self) -> dict[str, dict[str, int]]:
        """Tokens and targets of each source in this step (the ranks listed), by source name."""
        out: dict[str, dict[str, int]] = {}
        for sample in (s for mb in self.micro_batches for p in mb.packs for s in p.samples):
            entry = out.setdefault(sample.source, {"tokens": 0, "targets": 0})
            entry["tokens"] += sample.tokens
            entry["targets"] += sample.targets
        return dict(sorted(out.items()))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mix": self.mix()}


@dataclass(frozen=True, slots=True)
class Occurrence:
    """One time a pack is trained."""

    epoch: int
    step: int
    rank: int
    micro_batch: int
    position: int
    shard: str
    row: int
    pack_hash: str


@dataclass
class KeyTrace:
    key: str
    kind: str  # sample_id | pack_hash
    packs: int  # packs of the build that hold it
    settings: TraceSettings
    occurrences: list[Occurrence] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Epoch:
    """One epoch's steps: step and micro-batch of every position from `start` (-1: left out)."""

    epoch: int
    start: int
    first_step: int
    steps: int
    flat: np.ndarray  # pack index (unit-order flat numbering) of positions start..N-1
    rank: np.ndarray
    step: np.ndarray  # global step
    micro_batch: np.ndarray


class _Run:
    """The build as the loader reads it, and the run's epochs under the settings."""

    def __init__(self, output: Path, settings: TraceSettings) -> None:
        settings.check()
        try:
            from packtool.loader.dataset import PackedDataset
        except ImportError as err:  # the trace runs the loader's planning code
            raise TraceError(f"packtool trace needs the loader: {err}") from None

        try:
            self.dataset = PackedDataset(
                output,
                token_budget=settings.token_budget,
                fixed_shape=settings.fixed_shape,
                seed=settings.seed,
                shuffle=settings.shuffle,
                rank=0,
                world_size=settings.world_size,
                balance=settings.balance,
                packs_per_step=settings.packs_per_step,
                alpha=settings.alpha,
                isolate_documents=settings.isolate_documents,
            )
            if settings.state is not None:
                self.dataset.resume(settings.state)
        except DatasetError as err:
            raise TraceError(str(err)) from None
        if settings.position > self.dataset.total_packs:
            raise TraceError(
                f"anchor position {settings.position} is outside the epoch's {self.dataset.total_packs} packs "
                f"of {output}"
            )
        self.output = output
        self.settings = settings
        self.unit_rows = [u.rows for u in self.dataset.units]
        self.unit_start = np.concatenate([[0], np.cumsum(self.unit_rows, dtype=np.int64)]).astype(np.int64)

    def epochs(self) -> Iterator[_Epoch]:
        from packtool.loader.schedule import epoch_order, plan_epoch, positions_to_flat

        s, ds = self.settings, self.dataset
        options = ds.plan_options
        first_step = s.first_step
        for epoch in range(s.epoch, s.epochs):
            start = s.position if epoch == s.epoch else 0
            order = epoch_order(self.unit_rows, s.seed, epoch, s.shuffle, ds.window)
            try:
                plan = plan_epoch(self.unit_rows, order, start, options, ds._per_pack)
            except PacktoolError as err:
                raise TraceError(str(err)) from None
            flat = positions_to_flat(self.unit_rows, order, start)
            step, micro_batch = self._steps(plan, flat)
            steps = int(step.max()) + 1 if plan.rounds else 0
            yield _Epoch(
                epoch,
                start,
                first_step,
                steps,
                flat,
                plan.rank,
                np.where(step >= 0, step + first_step, -1),
                micro_batch,
            )
            first_step += steps

    def _steps(self, plan: EpochPlan, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step within the epoch and micro-batch of each position of the plan (-1: left out)."""
        from packtool.loader.schedule import share_micro_batches

        s = self.settings
        kept = plan.rank >= 0
        rounds = plan.round
        micro_batch = np.full(len(rounds), -1, np.int64)
        if s.balance is not None:
            step = rounds.copy()
            if s.token_budget is None:
                micro_batch[kept] = 0  # the rank's share is read pack by pack
                return step, micro_batch
            n_tokens = self.dataset._per_pack()[0][flat]
            options = self.dataset.plan_options
            # Each rank's share of each round, in reading order (ascending positions): sort by (round, rank).
            kept_at = np.flatnonzero(kept)
            share_key = rounds[kept_at] * plan.world_size + plan.rank[kept_at]
            by_share = kept_at[np.argsort(share_key, kind="stable")]
            cuts = np.flatnonzero(np.diff(np.sort(share_key))) + 1
            for share in np.split(by_share, cuts) if len(by_share) else []:
                for m, group in enumerate(share_micro_batches(n_tokens[share].tolist(), options)):
                    micro_batch[share[group]] = m
            return step, micro_batch
        per_round = 1 if s.token_budget is not None else s.batch_size  # rounds per micro-batch of a rank
        in_epoch = np.where(kept, rounds // per_round, -1)  # the rank's micro-batch number in this epoch
        step = np.where(kept, in_epoch // s.accumulation, -1)
        micro_batch = np.where(kept, in_epoch % s.accumulation, -1)
        return step, micro_batch

    def where(self, flat: int) -> tuple[int, int, int]:
        """(unit, shard index, row in the shard) of a pack by its flat index."""
        unit = int(np.searchsorted(self.unit_start, flat, side="right")) - 1
        u = self.dataset.units[unit]
        return unit, u.shard, u.first_row + flat - int(self.unit_start[unit])

    def shard_name(self, shard: int) -> str:
        return self.dataset.manifest.shards[shard].file.relative_to(self.dataset.manifest.folder.resolve()).as_posix()


def from_the_start(settings: TraceSettings) -> list[str]:
    """The trace flags that plan a run like this one from step 0 (no anchor): its settings, spelled out."""
    flags = [f"--world-size {settings.world_size}", f"--seed {settings.seed}"]
    flags += [] if settings.shuffle else ["--no-shuffle"]
    flags += [f"--token-budget {settings.token_budget}"] if settings.token_budget is not None else []
    flags += ["--fixed-shape"] if settings.fixed_shape else []
    if settings.balance is not None:
        flags += [f"--balance {settings.balance}", f"--packs-per-step {settings.packs_per_step}"]
        flags += [f"--alpha {settings.alpha}"] if settings.alpha else []
    flags += ["--isolate-documents"] if settings.isolate_documents else []
    flags += (
        [f"--batch-size {settings.batch_size}"] if settings.token_budget is None and settings.balance is None else []
    )
    flags += [f"--accumulation {settings.accumulation}", f"--epochs {settings.epochs}"]
    return flags


def trace_step(
    output: str | Path,
    step: int,
    settings: TraceSettings,
    *,
    rank: int | None = None,
    locate: bool = False,
    config: str | Path | None = None,
) -> StepTrace:
    """Every pack and sample of step `step`, per rank and micro-batch (only `rank` when given)."""
    run = _Run(Path(output), settings)
    if rank is not None and not 0 <= rank < settings.world_size:
        raise TraceError(f"rank {rank} is outside world_size {settings.world_size}")
    if step < settings.first_step:
        raise TraceError(
            f"step {step} is before the anchor step {settings.first_step} (epoch {settings.epoch}, position "
            f"{settings.position}; trace steps count from 0: the Trainer's global_step {settings.first_step} "
            f"ends with trace step {settings.first_step - 1}); a run that never resumed is traced from its start: "
            f"packtool trace {output} --step {step} {' '.join(from_the_start(settings))}; a resumed one with the "
            "settings and anchor of that part of the run"
        )
    total = settings.first_step
    for epoch in run.epochs():
        total = epoch.first_step + epoch.steps
        if step < total:
            hits = np.flatnonzero(epoch.step == step)
            if rank is not None:
                hits = hits[epoch.rank[hits] == rank]
            return StepTrace(step, epoch.epoch, _micro_batches(run, epoch, hits, locate, config), settings)
    raise TraceError(
        f"step {step} is past the end of the run: {settings.epochs} epoch(s) hold steps {settings.first_step} to "
        f"{total - 1} under these settings; raise --epochs or check the settings"
    )


def _micro_batches(
    run: _Run, epoch: _Epoch, hits: np.ndarray, locate: bool, config: str | Path | None
) -> tuple[MicroBatchSeen, ...]:
    grouped: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in hits.tolist():  # ascending positions: each rank reads its share in this order
        grouped[(int(epoch.rank[i]), int(epoch.micro_batch[i]))].append(i)
    packs = _read_packs(run, [int(epoch.flat[i]) for i in hits.tolist()])
    if locate:
        packs = _with_locations(run.output, packs, config)
    return tuple(
        MicroBatchSeen(r, m, tuple(replace(packs[int(epoch.flat[i])], position=epoch.start + i) for i in positions))
        for (r, m), positions in sorted(grouped.items())
    )


def _read_packs(run: _Run, flats: list[int]) -> dict[int, PackSeen]:
    """The small columns (and labels, for the target counts) of these packs, one row group read at a time."""
    by_unit: dict[int, list[int]] = defaultdict(list)
    for flat in sorted(set(flats)):
        by_unit[run.where(flat)[0]].append(flat)
    isolate = run.settings.isolate_documents
    out: dict[int, PackSeen] = {}
    for unit_index, members in by_unit.items():
        unit = run.dataset.units[unit_index]
        table = pq.ParquetFile(run.dataset.manifest.shards[unit.shard].file).read_row_group(
            unit.row_group, columns=[*PACK_COLUMNS, "labels"]
        )
        shard = run.shard_name(unit.shard)
        for flat in members:
            i = flat - int(run.unit_start[unit_index])
            row = {name: table.column(name)[i].as_py() for name in table.column_names}
            labels = np.asarray(row["labels"])
            docs = row["doc_cu_seqlens"]
            samples = []
            for d, (sample_id, source, repeat) in enumerate(
                zip(row["sample_ids"], row["sources"], row["sample_repeats"], strict=True)
            ):
                piece = labels[docs[d] : docs[d + 1]]
                # Isolated documents lose their first label when read (the loader sets it to -100).
                targets = int((piece != -100).sum()) - int(isolate and len(piece) > 0 and piece[0] != -100)
                samples.append(SampleSeen(sample_id, source, row["sample_hashes"][d], len(piece), targets, int(repeat)))
            out[flat] = PackSeen(-1, shard, unit.first_row + i, row["pack_hash"], int(row["n_tokens"]), tuple(samples))
    return out


def _with_locations(output: Path, packs: dict[int, PackSeen], config: str | Path | None) -> dict[int, PackSeen]:
    """file:line of every sample, from the source files as they are now (each read once)."""
    from packtool.commands.find import sample_origins
    from packtool.format import read_manifest

    wanted = {(smp.sample_id, smp.source, smp.sample_hash) for pack in packs.values() for smp in pack.samples}
    origins = sample_origins(output, read_manifest(output), wanted, config=config)
    return {
        p: replace(
            pack,
            samples=tuple(
                replace(smp, location=origins[(smp.sample_id, smp.source, smp.sample_hash)].location)
                for smp in pack.samples
            ),
        )
        for p, pack in packs.items()
    }


def trace_key(output: str | Path, key: str, settings: TraceSettings, *, kind: str = "sample_id") -> KeyTrace:
    """Every (epoch, step, rank, micro-batch) that trains a sample id, or a pack (kind "pack_hash": a pack_hash
    or a prefix of 4+ hex digits)."""
    from packtool.commands.find import MIN_HASH_PREFIX

    run = _Run(Path(output), settings)
    ids, hashes = [], []
    for unit in run.dataset.units:
        table = pq.ParquetFile(run.dataset.manifest.shards[unit.shard].file).read_row_group(
            unit.row_group, columns=["sample_ids", "pack_hash"]
        )
        ids += table.column("sample_ids").to_pylist()
        hashes += table.column("pack_hash").to_pylist()
    if kind == "sample_id":
        holds = np.array([key in packed for packed in ids], dtype=bool)
        if not holds.any():
            raise TraceError(
                f"{output}: no pack holds sample id {key!r}; `packtool find {output} {key}` says whether it was "
                "rejected, and `packtool inspect OUT --json` lists the ids"
            )
    elif kind == "pack_hash":
        holds = np.array([h.startswith(key.lower()) for h in hashes], dtype=bool)
        if len(key) < MIN_HASH_PREFIX or not holds.any():
            raise TraceError(
                f"{output}: {key!r} is no pack_hash (or a prefix of {MIN_HASH_PREFIX}+ hex digits) of this build"
            )
    else:
        raise TraceError(f"unknown key kind {kind!r}: sample_id or pack_hash")
    trace = KeyTrace(key, kind, int(holds.sum()), settings)
    for epoch in run.epochs():
        for i in np.flatnonzero(holds[epoch.flat] & (epoch.step >= 0)).tolist():
            flat = int(epoch.flat[i])
            _, shard, row = run.where(flat)
            trace.occurrences.append(
                Occurrence(
                    epoch.epoch,
                    int(epoch.step[i]),
                    int(epoch.rank[i]),
                    int(epoch.micro_batch[i]),
                    epoch.start + i,
                    run.shard_name(shard),
                    row,
                    hashes[flat],
                )
            )
    trace.occurrences.sort(key=lambda o: (o.step, o.rank, o.micro_batch, o.position))
    return trace


def settings_line(s: TraceSettings) -> str:
    chosen = [
        f"{f.name} {getattr(s, f.name)}"
        for f in fields(s)
        if f.name != "state"  # its epoch and position are the anchor's; --json holds it whole
        and (getattr(s, f.name) != f.default or f.name in ("world_size", "seed", "epochs"))
    ]
    return ", ".join(chosen)


def format_step(trace: StepTrace) -> str:
    # the Trainer counts an update after it (global_step, the logged step); a trace step counts from 0
    counted = f"counted from 0, the Trainer's global_step {trace.step + 1} after it"
    lines = [f"step {trace.step} ({counted}; epoch {trace.epoch}) under {settings_line(trace.settings)}"]
    for mb in trace.micro_batches:
        tokens = sum(p.n_tokens for p in mb.packs)
        targets = sum(s.targets for p in mb.packs for s in p.samples)
        lines.append(
            f"  rank {mb.rank} micro-batch {mb.micro_batch}: {len(mb.packs)} pack(s), {tokens} tokens, "
            f"{targets} targets"
        )
        for p in mb.packs:
            lines.append(f"    {p.shard}:{p.row} pack_hash {p.pack_hash} (position {p.position}, {p.n_tokens} tokens)")
            for smp in p.samples:
                where = f" at {smp.location}" if smp.location else ""
                copy = f", repeat {smp.repeat}" if smp.repeat else ""
                lines.append(f"      {smp.sample_id} (source {smp.source}{where}{copy}): {smp.targets} targets")
    if not trace.micro_batches:
        lines.append("  nothing on the rank asked for")
    mix = trace.mix()
    tokens, targets = (max(1, sum(m[unit] for m in mix.values())) for unit in ("tokens", "targets"))
    shares = ", ".join(
        f"{name} {m['tokens'] / tokens:.1%} of tokens, {m['targets'] / targets:.1%} of targets"
        for name, m in mix.items()
    )
    lines.append(f"  mix: {shares or 'nothing'}")
    return "\n".join(lines)


def format_key(trace: KeyTrace) -> str:
    kind = trace.kind.replace("_", " ")
    lines = [
        f"{trace.key} ({kind}, in {trace.packs} pack(s)): trained {len(trace.occurrences)} time(s) under "
        f"{settings_line(trace.settings)}"
    ]
    for o in trace.occurrences:
        lines.append(
            f"  epoch {o.epoch} step {o.step} rank {o.rank} micro-batch {o.micro_batch}: {o.shard}:{o.row} "
            f"pack_hash {o.pack_hash} (position {o.position})"
        )
    if not trace.occurrences:
        lines.append("  never: its packs are left out of every planned round (at most world_size - 1 per epoch)")
    return "\n".join(lines)
