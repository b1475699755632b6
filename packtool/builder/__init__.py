"""The build: the only module that knows the order of the phases.

    encode   one work item per input file or row range -> a token-store partition + report (cached, builder.encode;
             its ranges: packtool.ranges; render and tokenize: builder.stages)
    plan     length columns -> truncation, mixing, global packing, in numpy        (builder.plan)
    emit     one work item per output shard, gathered from the store             (builder.emit)
    publish  rejects and the manifest (builder.manifest); the staged build replaces OUT whole (builder.publish)

Work items run on an executor (serial, local processes or Ray; builder.executors) and know nothing
of it. Every finished item stays on disk (the cache, the staging folder), so a rerun after a crash
redoes only what did not finish, and the bytes do not depend on the executor or on a resume.
For each source the accounting adds up:

    read == rejected + dropped + kept        and        packed segments == kept x copies (+ split pieces)
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa

from packtool.builder.cache import CACHE_KIND, TokenCache, cache_root, encode_key, source_settings
from packtool.builder.emit import emit_item, emit_items, release, share
from packtool.builder.encode import CachedRanges, EncodeItem, encode_item
from packtool.builder.executors import make_executor
from packtool.builder.manifest import copy_rejects, write_outputs
from packtool.builder.mixing import quota_misses, source_quotas, unsampled_sources
from packtool.builder.owned import check_apart, claim, locked, unlinked
from packtool.builder.plan import make_plan, plan_inputs, plan_key
from packtool.builder.plan_files import Partition, Plan, stored_plan_problem
from packtool.builder.progress import Progress
from packtool.builder.publish import Staging, holds_build
from packtool.builder.reencoded import Reencoded, last_range, reencoded
from packtool.builder.stages import Stages, stages_for
from packtool.config import BuildConfig, canonical_json
from packtool.errors import BuildError, PacktoolError
from packtool.format import REJECTS, sha256_file
from packtool.packing import PackPlan
from packtool.ranges import row_ranges
from packtool.shards import ShardInfo
from packtool.sources import file_label, source_files
from packtool.vision.processors import PROCESSOR_FILES

# Tests stop a build at a chosen point to prove resume: PACKTOOL_TEST_KILL=encode:2 sends SIGKILL to
# this process once two encode items have finished (emit:N likewise; plan:1 once the plan is written,
# publish:1 once the new build is in OUT); encode:2:TERM sends SIGTERM, :INT SIGINT.
KILL_HOOK = "PACKTOOL_TEST_KILL"
# glibc's; absent on other C libraries (musl, macOS), where freed memory is not trimmed
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None


@dataclass(frozen=True)
class Built:
    """What a build wrote, how much of it an earlier, interrupted or cached run had done, and where it ran.

    `repaired` says which cache entries and staged shards failed their hash check and were redone.
    `nodes` holds, per phase (encode, emit), the work items each node ran: Ray node ids on Ray,
    "local" otherwise. It is not in the manifest, whose bytes do not depend on the executor."""

    manifest: dict[str, Any]
    output: Path
    encode_items: int
    encode_reused: int
    shards: int
    shards_reused: int
    nodes: dict[str, dict[str, int]] = field(default_factory=dict)
    # cache entries and staged shards found changed since they were written (each redone, never used), one line each
    repaired: tuple[str, ...] = ()
    # the encode phase's records, those re-encoded, and why (per file)
    records: Reencoded = field(default_factory=Reencoded)
    shards_repaired: int = 0  # staged shards among `repaired` (the rest are cache entries and the staged plan)
    quota_misses: tuple[str, ...] = ()  # one line per quota the shards fall short of (on_quota_miss: warn)
    up_to_date: bool = False  # OUT held this very build (plan, config, version, every shard's hash): kept as it was
    # samples each render route produced in this run (render.Accelerators.routes), summed over its encode items; a
    # reused cache entry renders nothing. A fact of the run, not of the shards: which route a conversation takes
    # depends on what its process rendered before, so it is not in the manifest (whose bytes it would change)
    render_routes: dict[str, int] = field(default_factory=dict)
    unsampled: tuple[str, ...] = ()  # one line per source that kept records and trains none (a weight that drew none)


def build(
    config: BuildConfig, *, progress: Progress | None = None, use_cache: bool = True, dry_run: bool = False
) -> Built:
    """Run every phase and publish the result to config.run.output; the previous output stays until then.

    use_cache=False reuses and resumes nothing (its token store lives in the staging folder and goes with it).
    dry_run=True encodes and plans, then returns a preview (`Built.manifest`, see `preview`) and writes no shard.
    """
    progress = progress or Progress()
    output = Path(config.run.output).resolve()
    staging = Staging(output)
    # the cache's own name is not resolved: a cache path that is a link is refused, never followed
    shared_cache = unlinked(cache_root(config)) if use_cache else None
    check_apart(config, output, shared_cache)
    try:
        with ExitStack() as held:
            held.enter_context(staging.held())
            if shared_cache is not None:
                claim(shared_cache, CACHE_KIND)
                held.enter_context(locked(shared_cache, f"cache {shared_cache}", shared=True))
            staging.prepare()
            if not use_cache:
                staging.clear_work()
                claim(staging.cache, CACHE_KIND)
            cache = TokenCache(shared_cache or staging.cache)
            try:
                return _build(config, progress, staging, cache, dry_run)
            finally:
                release()
                if not use_cache:
                    staging.clear_work()
    except OSError as exc:
        where = exc.filename or config.run.output
        raise PacktoolError(
            f"{where}: {exc.strerror or exc}; the build stopped and {staging.output} still holds the previous build"
        ) from None


def _build(config: BuildConfig, progress: Progress, staging: Staging, cache: TokenCache, dry_run: bool) -> Built:
    progress.step(f"loading tokenizer {config.tokenizer.path}")
    stages = stages_for(config)  # setup problems (tokenizer, template) surface here, before any work
    items = _encode_items(config, stages, cache)
    with make_executor(config.run.executor, config.run.workers, config.run.ray_address) as executor:
        encode_reused, results, routes = 0, [], Counter[str]()
        repaired = []  # what was found changed since it was written, and redone
        with progress.phase("encode", sum(item.bytes for item in items), "B") as bar:
            for done, (item, result) in enumerate(zip(items, executor.map(encode_item, items)), start=1):
                if result.failure is not None:
                    raise PacktoolError(result.failure)
                encode_reused += result.reused
                routes.update(result.routes)
                results.append(result)
                repaired += [result.repaired] if result.repaired else []
                bar.update(item.bytes)
                _kill_hook("encode", done)
        nodes = {"encode": dict(executor.nodes)}
        _return_freed_memory()

        partitions = [_partition(item, cache) for item in items]
        records = reencoded(config, cache, items, results, partitions)
        key = plan_key(config, plan_inputs(config, partitions))
        if dry_run:
            # an interrupted build's staged work stays untouched; the preview's plan goes with it
            folder = staging.root / f"dry-run-{key}"
            try:
                plan = make_plan(config, partitions, folder, key)
                _check_outcome(config, plan)  # before the folder goes: a failure copies the plan's rejects
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            shown = preview(config, plan)
            return Built(
                shown,
                staging.output,
                len(items),
                encode_reused,
                0,
                0,
                nodes,
                tuple(repaired),
                records,
                quota_misses=_planned_quota_misses(config, plan.quota_reached),
                render_routes=dict(routes),
                unsampled=_unsampled(config, {"accounting": plan.accounting}),
            )
        held = holds_build(staging.output, key, config.config_hash)
        if held is not None:  # the same bytes again: keep them, write nothing
            missed = _quota_misses(config, held)
            staging.keep_only(None)  # what an interrupted or earlier build left there is not needed now
            return Built(
                held,
                staging.output,
                len(items),
                encode_reused,
                0,
                0,
                nodes,
                tuple(repaired),
                records,
                quota_misses=missed,
                up_to_date=True,
                render_routes=dict(routes),
                unsampled=_unsampled(config, held),
            )
        staging.keep_only(key)
        damaged = stored_plan_problem(staging.plan(key), key, partitions)
        if damaged is not None:  # nothing staged from it can be trusted either
            staging.forget(key)
            repaired.append(damaged)
        with progress.phase("plan", 1, "plan") as bar:
            plan = make_plan(config, partitions, staging.plan(key), key)
            bar.update(1)
        _kill_hook("plan", 1)
        _check_outcome(config, plan)
        _return_freed_memory()
        share(plan)

        out = staging.out(key)
        emits = emit_items(plan, out, staging.done(key), config.shards.rows_per_shard, config.shards.row_group_rows)
        infos: dict[str, list[ShardInfo]] = {f.name: [] for f in plan.folders}
        shards_reused = shards_repaired = 0
        with progress.phase("emit", len(emits), "shards") as bar:
            for done, (emitted, outcome) in enumerate(zip(emits, executor.map(emit_item, emits)), start=1):
                infos[emitted.folder].append(outcome.info)
                shards_reused += outcome.reused
                shards_repaired += bool(outcome.repaired)
                repaired += [outcome.repaired] if outcome.repaired else []
                bar.update(1)
                _kill_hook("emit", done)
        nodes["emit"] = dict(executor.nodes - Counter(nodes["encode"]))
    release()
    _return_freed_memory()

    manifest = write_outputs(config, stages, plan, out, infos)
    missed = _quota_misses(config, manifest)
    staging.publish(key, swapped=lambda: _kill_hook("publish", 1))
    return Built(
        manifest,
        staging.output,
        len(items),
        encode_reused,
        len(emits),
        shards_reused,
        nodes,
        tuple(repaired),
        records,
        shards_repaired,
        missed,
        render_routes=dict(routes),
        unsampled=_unsampled(config, manifest),
    )


def _return_freed_memory() -> None:
    """Hand back to the system what the phase that just ended freed but its allocators kept: Arrow's pool
    (mimalloc keeps freed pages for reuse) and glibc's heaps (numpy arrays below the mmap threshold, which
    rises to the largest array freed). Kept, one phase's peak stays resident under the next phases' and adds
    to theirs: at 100k short samples, `-j 1`, the driver's RssAnon at the end of encode, plan and emit went
    93 -> 65, 110 -> 70 and 127 -> 75 MB (issue 43)."""
    pa.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _quota_misses(config: BuildConfig, manifest: dict[str, Any]) -> tuple[str, ...]:
    """One line per quota the build's shards fall short of; under on_quota_miss: fail, the build's end."""
    return _judged(config, tuple(quota_misses(source_quotas(config), manifest["stats"]["sources"])))


def _planned_quota_misses(config: BuildConfig, reached: dict[str, dict[str, int]]) -> tuple[str, ...]:
    """A dry run's quota misses, judged as the build's are but on what the plan gives OUT of each quota's unit
    (Plan.quota_reached): short by a part or whole (every sample rejected, or gone to the overflow bucket, which
    the accounting's segments count); under on_quota_miss: fail, the dry run's end."""
    return _judged(config, tuple(quota_misses(source_quotas(config), reached)))


def _judged(config: BuildConfig, missed: tuple[str, ...]) -> tuple[str, ...]:
    if missed and config.outcome.on_quota_miss == "fail":
        raise BuildError(
            "\n".join(missed) + "\nnothing was published (on_quota_miss: fail, as --strict sets); "
            "lower the quota, or fix the source that could not meet it"
        )
    return missed


def _unsampled(config: BuildConfig, manifest: dict[str, Any]) -> tuple[str, ...]:
    weights = {s.name: s.plan.weight for s in config.sources if s.plan.quota is None}
    return tuple(unsampled_sources(weights, manifest["accounting"]))


def _encode_items(config: BuildConfig, stages: Stages, cache: TokenCache) -> list[EncodeItem]:
    tokenizer_hash = sha256_file(config.tokenizer.path)
    if config.tokenizer.config_path:
        tokenizer_hash += sha256_file(config.tokenizer.config_path)
    if config.processor:  # images' token counts come from these files: a changed one encodes again
        folder = Path(config.processor)
        tokenizer_hash += "".join(sha256_file(folder / name) for name in PROCESSOR_FILES if (folder / name).is_file())
    template = stages.template
    template_hash = "none" if template is None else f"{template.key}:{canonical_json(template.variables)}"
    items = []
    for source in config.sources:
        settings = source_settings(source, config)
        for file in source_files(source):
            ranges = row_ranges(file, source.max_samples, CachedRanges(cache))
            label = file_label(source, file)
            key_of = partial(
                encode_key,
                file=label,
                tokenizer_hash=tokenizer_hash,
                template_hash=template_hash,
                settings=settings,
            )
            last = last_range(cache, source.name, label)
            for row_range in ranges:
                key = key_of(content=row_range.content, start=row_range.start)
                grown_from = None  # the file's last range at the last build, since grown: its entry may hold
                if last is not None and last[0] == row_range.start and last[1] != row_range.content:  # our first rows
                    grown_from = key_of(content=last[1], start=last[0])
                stop_at_bad = config.outcome.on_error == "fail"
                items.append(
                    EncodeItem(
                        config,
                        source.name,
                        file,
                        key,
                        str(cache.root),
                        stop_at_bad,
                        source.max_samples,
                        row_range.start,
                        row_range.end,
                        1 / len(ranges),
                        row_range.content,
                        row_range.rows,
                        row_range.offset,
                        row_range.size,
                        row_range.unit,
                        grown_from,
                    )
                )
    return items


def _partition(item: EncodeItem, cache: TokenCache) -> Partition:
    report = cache.load_report(item.key)
    if report is None:
        raise PacktoolError(f"{cache.report(item.key)}: cache entry vanished during the build (was the cache cleared?)")
    return Partition(item.key, str(cache.partition(item.key)), item.source, report)


def _kill_hook(phase: str, done: int) -> None:
    hook = os.environ.get(KILL_HOOK, "").split(":")
    if hook[:2] == [phase, str(done)]:
        os.kill(os.getpid(), getattr(signal, f"SIG{hook[2] if len(hook) > 2 else 'KILL'}"))


def preview(config: BuildConfig, plan: Plan) -> dict[str, Any]:
    """What a build would write: per output folder its packs, shards, segments, tokens and token efficiency."""
    outputs = {}
    for folder in plan.folders:
        layout = folder.layout
        tokens = int(folder.length[layout.members].sum()) if isinstance(layout, PackPlan) else int(folder.length.sum())
        outputs[folder.name or "."] = {
            "capacity": folder.capacity,
            "packs": folder.n_packs,
            "shards": -(-folder.n_packs // config.shards.rows_per_shard),
            "segments": len(folder.ref),
            "tokens": tokens,
            "token_efficiency": round(tokens / (folder.n_packs * folder.capacity), 6) if folder.n_packs else 0.0,
        }
    return {
        "dry_run": True,
        "plan_hash": plan.key,
        "outputs": outputs,
        "accounting": plan.accounting,
        "rejects": {"count": plan.rejects.count, "by_reason": plan.rejects.by_reason},
    }


def format_preview(preview: dict[str, Any]) -> str:
    lines = [f"{'source':<20} {'read':>8} {'kept':>8} {'rejected':>9} {'dropped':>8} {'truncated':>10}"]
    for name, a in preview["accounting"].items():
        truncated = sum(t["samples"] for t in a["truncated"].values())
        lines.append(
            f"{name:<20} {a['read']:>8,} {a['kept']:>8,} {sum(a['rejected'].values()):>9,} "
            f"{sum(a['dropped'].values()):>8,} {truncated:>10,}"
        )
    lines.append("")
    for name, o in preview["outputs"].items():
        lines.append(
            f"{'OUT' if name == '.' else name + '/'}: {o['packs']:,} packs of {o['capacity']:,} in "
            f"{o['shards']:,} shard(s), {o['segments']:,} segments, {o['tokens']:,} tokens, "
            f"token efficiency {o['token_efficiency']:.4f}"
        )
    reasons = ", ".join(f"{k}={v}" for k, v in preview["rejects"]["by_reason"].items())
    lines.append(f"not trained: {preview['rejects']['count']:,}{f' ({reasons})' if reasons else ''}")
    lines.append("dry run: no shard was written")
    return "\n".join(lines)


def failed_rejects_path(output: str | Path) -> Path:
    """Where a build that fails on its rejects leaves them: beside OUT, in a name only packtool uses
    (like the staging folder), since OUT itself keeps the previous build."""
    out = Path(output).resolve()
    return out.parent / f".{out.name}.packtool-{REJECTS}"


def _rejects_problem(config: BuildConfig, plan: Plan, summary: str) -> BuildError:
    """The failure with the first rejects named and all of them written where the message says."""
    path = failed_rejects_path(config.run.output)
    copy_rejects(plan.rejects.path, path)
    count = plan.rejects.count
    first = "".join(f"\n  {r['location']}: [{r['reason']}] {r['detail']}" for r in plan.rejects.first(3))
    more = f"\n  ... {count - 3} more" if count > 3 else ""
    return BuildError(f"{summary}\nfirst rejects:{first}{more}\nall {count} rejects: {path}")


def _check_outcome(config: BuildConfig, plan: Plan) -> None:
    """Exit status tells the truth: an empty output, or a source that lost too much, is not published."""
    failed_rejects_path(config.run.output).unlink(missing_ok=True)  # a failed earlier build's, now stale
    problems = []
    for name, a in plan.accounting.items():
        lost = sum(a["rejected"].values()) + sum(a["dropped"].values())
        if a["read"] and lost / a["read"] > config.outcome.max_reject_share:
            lost_by = Counter(a["rejected"]) + Counter(a["dropped"])
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(lost_by.items()))
            problems.append(
                f"source {name!r} lost {lost} of {a['read']} records ({lost / a['read']:.0%} > max_reject_share "
                f"{config.outcome.max_reject_share:g}): {reasons}"
            )
    if problems:
        summary = "\n".join(problems) + "\nnothing was published; fix the input or template, or raise max_reject_share"
        raise _rejects_problem(config, plan, summary)
    if sum(f.n_packs for f in plan.folders) == 0:
        read = sum(a["read"] for a in plan.accounting.values())
        listed = ", ".join(f"{k}={v}" for k, v in plan.rejects.by_reason.items()) or "no input records"
        summary = f"no pack to write: none of {read} record(s) was kept ({listed}); nothing was published"
        raise _rejects_problem(config, plan, summary) if plan.rejects.count else BuildError(summary)
    held_out = sum(f.n_packs for f in plan.folders if f.name == "validation")
    if held_out and not sum(f.n_packs for f in plan.folders if f.name != "validation"):
        asked = f"samples: {config.validation.samples:,}" if config.validation.samples else "share"
        raise BuildError(
            f"no pack to train: the validation split ({asked}) holds every kept record ({held_out:,} pack(s) in "
            "validation/); nothing was published; lower validation.samples or validation.share"
        )


__all__ = ["Built", "build"]
