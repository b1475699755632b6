"""Thin command-line interface: parse, call one library function, print.

`PacktoolError` and output that cannot be written (a full disk) become one line and exit code 1; anything else
keeps its traceback (a bug).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

import packtool
from packtool.errors import PacktoolError
from packtool.terminal import json_shown, shown
from packtool.workers import EXECUTORS, WORKERS_AUTO, WORKERS_CHOICES, usable_cores

if TYPE_CHECKING:
    from packtool.builder import Built

SET_HELP = (
    "Override a config key, validated like the file; repeatable. VALUE is read as YAML. "
    "sources.NAME.KEY addresses a source by name, e.g. --set capacity=4096 --set sources.chat.weight=2."
)


def _fail(error: PacktoolError) -> click.ClickException:
    # Messages quote ids, file names and values from the data: nothing in them may act on the terminal.
    return click.ClickException(shown(str(error), keep="\n"))


def _one_blas_thread() -> None:
    """Before numpy is first imported here or in a worker process (which inherits the environment).

    A build makes no BLAS call, but OpenBLAS starts a thread per core when numpy is imported and they
    spin before they sleep: ~0.1 CPU-s in every process, which a worker's start-up on 2 cores waits
    behind (`-j 2` on the 12k-sample alpaca bench: 0.91x wall, 0.88x CPU with one thread). A user's own
    setting stays.
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _echo_data(text: str, color: bool = False) -> None:
    """Print a command's text output; its formatter escaped the data in it (packtool.terminal), this catches any
    control character it missed. Coloured output carries our own escape sequences, so it relies on the formatter."""
    click.echo(text if color else shown(text, keep="\n\t"), color=color)


@click.group()
@click.version_option(packtool.__version__, prog_name="packtool")
def main() -> None:
    """Turn chat, instruction, tool-calling and plain-text data into packed training shards.

    \b
    Example:
        packtool build configs/quickstart.yaml --output out/quickstart
        packtool inspect out/quickstart/shard-00000.parquet --row 0 --limit 40
        packtool stats out/quickstart
    """


@main.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--output", "-o", help="Output folder (overrides `output` in the config).")
@click.option("--capacity", type=int, help="Tokens per pack (overrides `capacity` in the config).")
@click.option(
    "--workers", "-j", help=f"Processes for encode and emit: {WORKERS_CHOICES}; {WORKERS_AUTO} (overrides `workers`)."
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--max-samples", type=click.IntRange(min=1), help="Read only the first N records of every source.")
@click.option("--executor", type=click.Choice(EXECUTORS), help="Where work items run.")
@click.option("--address", help="Ray cluster address (with --executor ray).")
@click.option("--cache", "cache_dir", help="Token store folder (default: .packtool-cache beside the output).")
@click.option("--no-cache", is_flag=True, help="Reuse and resume nothing; keep no token store.")
@click.option(
    "--strict",
    is_flag=True,
    help="Fail when any source loses a record (max_reject_share 0) or misses its quota (on_quota_miss fail).",
)
@click.option("--dry-run", is_flag=True, help="Encode and plan, print what the build would write; write no shard.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
def build(
    config: Path,
    output: str | None,
    capacity: int | None,
    workers: str | None,
    overrides: tuple[str, ...],
    max_samples: int | None,
    executor: str | None,
    address: str | None,
    cache_dir: str | None,
    no_cache: bool,
    strict: bool,
    dry_run: bool,
    quiet: bool,
) -> None:
    """Encode, plan and emit packed shards as CONFIG describes; OUT is replaced only when the build is complete.

    CONFIG may also be the name of a bundled config (e.g. `quickstart`). A rerun of an interrupted
    build resumes it; encoded files are reused from the cache while their inputs are unchanged.

    \b
    Example:
        packtool build configs/quickstart.yaml --output out/quickstart --capacity 2048 --workers auto
        packtool build configs/quickstart.yaml -o out/try --max-samples 100 --set sources.chat.weight=2
    """
    _one_blas_thread()
    from packtool.builder import build as run_build
    from packtool.builder.executors import describe_workers
    from packtool.builder.progress import BarProgress, LogProgress, Progress
    from packtool.builder.stages import stages_for
    from packtool.commands.stats import format_headline, heavy_truncation
    from packtool.config import load_config, resolve_config_path

    settings_from_flags = [f"executor={executor}"] if executor else []
    settings_from_flags += [f"ray_address={address}"] if address else []
    # paths typed on the command line are relative to the working folder; a cache named by a link stays a link,
    # which the build refuses as it refuses `cache:` in the config (resolved, the link was written through)
    settings_from_flags += [f"cache={os.path.abspath(cache_dir)}"] if cache_dir else []
    settings_from_flags += ["max_reject_share=0", "on_quota_miss=fail"] if strict else []
    try:
        config_path = resolve_config_path(config)
        if output is None and not config.is_file():
            output = f"out/{config.name}"  # a bundled config: write under the working folder, not site-packages
        output = str(Path(output).resolve()) if output is not None else None
        settings = load_config(
            config_path,
            output=output,
            capacity=capacity,
            workers=workers,
            overrides=[*overrides, *settings_from_flags],
            max_samples=max_samples,
        )
        # a job log (nohup, SLURM, CI) cannot redraw a bar: it gets a line per phase and one every 10 s
        progress = Progress() if quiet else BarProgress() if sys.stderr.isatty() else LogProgress()
        replaced = _config_hash_in(Path(settings.run.output))
        with _interrupt_on_sigterm():
            built = run_build(settings, progress=progress, use_cache=not no_cache, dry_run=dry_run)
    except PacktoolError as error:
        raise _fail(error) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; the previous output is unchanged, rerun to resume") from None
    for repaired in built.repaired:
        click.echo(f"warning: {repaired}; not reused, written again", err=True)
    if not dry_run and replaced not in (None, built.manifest.get("config_hash")):
        click.echo(
            f"note: {settings.run.output} held a build of another config (config_hash {replaced[:12]}); "
            "this build replaced it",
            err=True,
        )
    for missed in built.quota_misses:
        click.echo(f"warning: {missed}; --strict makes this an error", err=True)
    for unsampled in built.unsampled:
        click.echo(f"warning: {unsampled}", err=True)
    if dry_run:
        from packtool.builder import format_preview

        click.echo(format_preview(built.manifest))
        return
    if not quiet:
        manifest = built.manifest
        # The headline only: `packtool stats OUT` prints the rest (the README's quick start runs both).
        click.echo("\n".join(format_headline(manifest["stats"])))
        if built.up_to_date:
            click.echo(
                f"\nencode: {built.records.describe()}\nup to date: {settings.run.output} already holds this "
                "build (same plan, code and config; every shard's sha256 checked); nothing written"
            )
        else:
            click.echo(
                f"\nencode: {built.records.describe()}; "
                f"emit: {built.shards_reused} of {built.shards} shard(s) resumed"
                + (f"; {built.shards_repaired} changed on disk since written, redone" if built.shards_repaired else "")
            )
            main_shards = len(manifest["shards"])
            parts = [f"{name}/" for name in ("overflow", "validation") if manifest.get(name)]
            beside = f" (+ {built.shards - main_shards} in {' and '.join(parts)})" if built.shards > main_shards else ""
            click.echo(f"wrote {main_shards} shard(s){beside} and manifest.json to {settings.run.output}")
        # `workers: auto` (the default) decides by the cores: say what it decided
        click.echo(
            f"ran as {describe_workers(settings.run.workers, settings.run.executor)} on {usable_cores()} usable core(s)"
        )
        template = stages_for(settings).template  # loaded by the build in this process, not again
        if template is not None:
            click.echo(f"template {template.described} rendered by {template.engine}")
            click.echo(_routes_line(built))
        for line in heavy_truncation(manifest):
            click.echo(f"note: {line}; per length: packtool stats {settings.run.output}")
        click.echo(f"per source, per reason and per length: packtool stats {settings.run.output}")
        if manifest.get("decontamination"):
            click.echo(_decontamination_line(manifest["decontamination"], settings.run.output))
        rejected = manifest["rejects"]["count"]
        if rejected:
            click.echo(
                f"{rejected} sample(s) not trained, each with its reason, in "
                f"{Path(settings.run.output) / manifest['rejects']['file']}"
            )


def _decontamination_line(record: dict, output: str) -> str:
    """The manifest's decontamination record in one line: what was found, what became of it, against what."""
    fate = "dropped, each in rejects.jsonl with its eval record" if record["action"] == "drop" else "kept"
    evals = record["against"]
    return (
        f"decontamination: {record['contaminated']:,} sample(s) contaminated ({fate}; action: {record['action']}), "
        f"{record['reported']:,} overlap(s) in prompts only (prompt_action: {record['prompt_action']}), against "
        f"{len(evals)} eval file(s) of {sum(e['strings'] for e in evals):,} strings; every overlap: "
        f"packtool decontaminate {output} --against EVAL"
    )


def _routes_line(built: Built) -> str:
    """How many samples each render route produced in this run: a fact of the run (a cached item renders
    nothing, and a route depends on what its process rendered before), so the summary says it, not the manifest."""
    from packtool.render.accelerators import describe_routes

    line = f"render routes this run (samples): {describe_routes(built.render_routes)}"
    if built.encode_reused:
        line += f"; {built.encode_reused} of {built.encode_items} encode item(s) came from the cache, not rendered"
    return line


def _config_hash_in(output: Path) -> str | None:
    """The config_hash of the build OUT holds now, or None (no build, or a manifest that cannot say)."""
    try:
        recorded = json.loads((output / "manifest.json").read_text(encoding="utf-8")).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, str) else None


@contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM ends a build like Ctrl-C: work items stop, OUT keeps the previous build, one line, exit 1."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@main.command(name="cache")
@click.argument("action", type=click.Choice(["list", "clear"]), default="list")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path), required=False)
def cache_command(action: str, folder: Path | None) -> None:
    """List the token store's entries with their sizes, or clear them.

    `clear` deletes only the entries of a folder a build marked as its cache, and refuses while a
    build uses it. FOLDER is a cache folder, or a build's output folder (its cache is `.packtool-cache`
    beside it, as the build put it unless `cache`/`--cache` said otherwise). Default: `out/.packtool-cache`,
    the cache of builds written under `out/` (`packtool build quickstart` writes `out/quickstart`).

    \b
    Example:
        packtool cache list out/quickstart
        packtool cache clear out/.packtool-cache
    """
    from packtool.builder.cache import CACHE_DIR, CACHE_KIND, TokenCache
    from packtool.builder.owned import is_marked

    if folder is None:
        folder = Path("out") / CACHE_DIR
    elif (folder / "manifest.json").is_file():  # a build output: the build's default cache sits beside it
        folder = folder.resolve().parent / CACHE_DIR
    store = TokenCache(folder)
    if action == "clear":
        try:
            freed = store.clear()
        except PacktoolError as error:
            raise _fail(error) from None
        click.echo(f"cleared {folder}: {freed:,} bytes freed")
        return
    if not folder.exists():  # "0 entries" would read as an empty cache where there is none
        raise click.ClickException(
            f"no cache at {folder}: no build has written one there. Name a build's output folder (its cache is "
            f"{CACHE_DIR} beside it) or the folder a build used as --cache"
        )
    if not is_marked(folder, CACHE_KIND):  # a mistyped folder read as an empty cache
        raise click.ClickException(f"{folder} is not a packtool cache (no packtool-owned.json marking it as one)")
    entries = store.entries()
    for entry in entries:
        shown = "damaged: a build encodes it again" if entry["damaged"] else f"{entry['samples']:>9,} samples  "
        click.echo(
            f"{entry['key'][:12]}  {entry['bytes']:>12,} B  {shown}"
            + ("" if entry["damaged"] else f"{entry['source']}  {entry['file']}")
        )
    total = sum(e["bytes"] for e in entries)
    damaged = sum(e["damaged"] for e in entries)
    click.echo(
        f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {total:,} bytes in {folder}"
        + (f" ({damaged} damaged: a build encodes them again)" if damaged else "")
    )


@main.command(name="inspect")
@click.argument("shard", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--row", "-r", default=0, show_default=True, help="Pack index: in the shard, or across a folder's shards."
)
@click.option("--doc", "-d", type=int, help="Show only this document (0-based) of the pack.")
@click.option("--id", "sample_id", help="Show every document of this sample id (searches all shards of a folder).")
@click.option("--limit", "-n", type=int, help="Show at most this many tokens per document.")
@click.option(
    "--around", "-a", type=int, help="Show only tokens this close to a document start or a context/target switch."
)
@click.option(
    "--text/--no-text", default=None, help="Print each document's decoded text (default: on, off with --around)."
)
@click.option(
    "--tokenizer", type=click.Path(exists=True), help="tokenizer.json to decode with (default: from manifest)."
)
@click.option("--color/--no-color", default=None, help="Highlight targets (default: when writing to a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print packs, documents and tokens as JSON.")
def inspect_command(
    shard: Path,
    row: int,
    doc: int | None,
    sample_id: str | None,
    limit: int | None,
    around: int | None,
    text: bool | None,
    tokenizer: str | None,
    color: bool | None,
    as_json: bool,
) -> None:
    """Print one pack token by token: id, piece, role, segment, position, attention range, label.

    SHARD is a .parquet shard or an output folder (rows counted across its shards). Target tokens
    end with `*` (and are bold green on a terminal), so piped output keeps them.

    \b
    Example:
        packtool inspect out/quickstart/shard-00000.parquet --row 3 --around 3
        packtool inspect out/quickstart --id qs-chat-00007 --no-text
    """
    from packtool.commands.show import inspect_json, inspect_pack

    use_color = sys.stdout.isatty() if color is None else color
    try:
        if as_json:
            report = inspect_json(
                shard,
                row=row,
                doc=doc,
                sample_id=sample_id,
                limit=limit,
                around=around,
                tokenizer=tokenizer,
                text=text is not False,
            )
            click.echo(json_shown(report, indent=1))
        else:
            table = inspect_pack(
                shard,
                row=row,
                doc=doc,
                sample_id=sample_id,
                limit=limit,
                around=around,
                tokenizer=tokenizer,
                color=use_color,
                text=text,
            )
            _echo_data(table, color=use_color)
    except PacktoolError as error:
        raise _fail(error) from None


@main.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
def stats(path: Path, as_json: bool) -> None:
    """Token efficiency, targets, per-source shares, and what was dropped or truncated, and why.

    PATH is an output folder or one shard.

    \b
    Example:
        packtool stats out/quickstart --json
    """
    from packtool.commands.stats import format_stats
    from packtool.shards import locate
    from packtool.summaries import summarize

    try:
        _, manifest, files = locate(path)
        summary = summarize(files, manifest)
    except PacktoolError as error:
        raise _fail(error) from None
    _echo_data(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_stats(summary))


@main.command(name="audit")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option("--rows", default=50, show_default=True, help="Rows of each source to check besides the built-in probes.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report (ok, checks with evidence, first failure) as JSON."
)
@click.option(
    "--probe",
    "model",
    metavar="MODEL",
    help="Instead of a config: check that packed documents stay apart in MODEL (a family name, config.json, "
    "model folder or cached hub id); see docs/isolation.md.",
)
@click.option(
    "--data",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="--probe on the documents of this build's first packs (default: synthetic rows).",
)
@click.option("--backend", "backends", multiple=True, help="--probe these attention backends (default: all here).")
@click.option(
    "--feed",
    "feeds",
    multiple=True,
    type=click.Choice(["model_inputs", "position_ids", "one_document_per_row"]),
    help="--probe these ways of feeding the packed row (default: model_inputs, what packtool feeds, and one "
    "document per row where that fails).",
)
@click.option(
    "--weights", is_flag=True, help="--probe the real weights (local folder or cache) instead of a tiny copy."
)
def audit_command(
    config: Path | None,
    rows: int,
    overrides: tuple[str, ...],
    as_json: bool,
    model: str | None,
    data: Path | None,
    backends: tuple[str, ...],
    feeds: tuple[str, ...],
    weights: bool,
) -> None:
    """Check the template + tokenizer before a long build, or a model's packing isolation; exit 1 on a failure.

    Runs built-in probe conversations (system prompts, repeated roles, multi-turn tool calls,
    control-token text in content) and the first ROWS rows of each source, and reports each
    check with its evidence; the first failing sample is shown token by token.

    With --probe MODEL: a tiny random model of MODEL's architecture runs packed rows on every
    attention backend here; packed logits must equal each document alone, changing one document
    must not move another's logits or gradients, and the loss must keep its normaliser.

    \b
    Example:
        packtool audit configs/quickstart.yaml --rows 100 --json
        packtool audit --probe qwen3_5 --feed position_ids --feed one_document_per_row
    """
    from dataclasses import asdict

    if model is not None:
        _probe(model, data, backends, feeds, weights, as_json)
        return
    if config is None:
        raise click.UsageError("give a CONFIG to audit, or --probe MODEL")

    from packtool.commands.audit import audit, format_audit
    from packtool.config import load_config, resolve_config_path

    try:
        report = audit(load_config(resolve_config_path(config), output=".", overrides=overrides), rows=rows)
    except PacktoolError as error:
        raise _fail(error) from None
    _echo_data(json.dumps({"ok": report.ok, **asdict(report)}, indent=2) if as_json else format_audit(report))
    if not report.ok:
        raise SystemExit(1)


def _probe(
    model: str, data: Path | None, backends: tuple[str, ...], feeds: tuple[str, ...], weights: bool, as_json: bool
) -> None:
    try:
        from packtool.loader.probe import format_probe, probe
    except ImportError:  # torch or transformers: the probe needs both, whichever the loader asked for first
        raise click.ClickException(
            "packtool audit --probe needs PyTorch and transformers: pip install 'packtool[hf]'"
        ) from None
    try:
        report = probe(model, backends=backends or None, feeds=feeds or None, data=data, weights=weights)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else format_probe(report))
    if not report.ok:
        raise SystemExit(1)


@main.command(name="canary")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--model",
    default="llama",
    show_default=True,
    metavar="MODEL",
    help="What --probe accepts: a family name, config.json, model folder or cached hub id.",
)
@click.option("--weights", is_flag=True, help="Train MODEL's real weights (local folder or cache), not a tiny copy.")
@click.option("--steps", default=60, show_default=True, help="Optimizer steps of the overfit.")
@click.option("--json", "as_json", is_flag=True, help="Print the canaries, loss curve and checks as JSON.")
@click.option("--no-color", is_flag=True, help="Plain text even on a terminal.")
def canary_command(output: Path, model: str, weights: bool, steps: int, as_json: bool, no_color: bool) -> None:
    """The pre-flight check before a long run; exit 1 on a failure, one line each.

    Prints a fixed set of canary samples from OUTPUT (short text, empty field, multi-turn tools,
    Unicode, code, a truncated sample, a packed row; a pair and a group where the build has them)
    token by token, overfits MODEL on them through packtool's training path, and checks that
    greedy generation gives each chat canary's answer back and ends it with the template's
    end-of-turn token, one that eos stops at. See docs/canary.md.

    \b
    Example:
        packtool canary out/quickstart --model qwen3 --steps 60
    """
    from packtool.commands.canary import canary, format_canary

    try:
        report = canary(output, model, weights=weights, steps=steps)
    except PacktoolError as error:
        raise _fail(error) from None
    except ImportError:  # the overfit imports torch and transformers on first use
        raise click.ClickException(
            "packtool canary needs PyTorch and transformers: pip install 'packtool[hf]'"
        ) from None
    if as_json:
        _echo_data(json.dumps(report.as_dict(), indent=2))
    else:
        color = not no_color and sys.stdout.isatty()
        _echo_data(format_canary(report, color=color), color=color)
    if not report.ok:
        raise SystemExit(1)


@main.command(name="verify")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print {ok, folder, shards, packs, problems, warnings} as JSON.")
def verify_command(path: Path, as_json: bool) -> None:
    """Re-check an output from its bytes and its sealed manifest; exit 1 on a problem.

    Checks the shard list against the files present, each shard's bytes, sha256, rows, tokens and
    targets, every pack's offsets, labels and hash, the stats block, the accounting and
    rejects.jsonl, and the manifest's own hash (config, seed, capacity). PATH is an output folder,
    or one shard (checked against its folder's manifest).

    \b
    Example:
        packtool verify out/quickstart --json
    """
    from packtool.commands.verify import format_verification, verify

    try:
        result = verify(path)
    except PacktoolError as error:
        raise _fail(error) from None
    _echo_data(json.dumps(result.as_dict(), indent=2) if as_json else format_verification(result))
    if not result.ok:
        raise SystemExit(1)


@main.command(name="push")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo")
@click.option("--dry-run", is_flag=True, help="List the files that would be uploaded; contact nothing.")
@click.option("--private", is_flag=True, help="Create the repo private (when it does not exist yet).")
@click.option("--revision", help="The branch to commit to (default: main).")
def push_command(path: Path, repo: str, dry_run: bool, private: bool, revision: str | None) -> None:
    """Upload a build to a Hugging Face dataset repo in one commit, after `verify` passes.

    Only what the build wrote goes up (the card, manifests, rejects and shards); a file in the repo named
    like a build's output that this build does not write is refused. Needs huggingface_hub and a login
    (`hf auth login` or HF_TOKEN).

    \b
    Example:
        packtool push out/quickstart me/quickstart-packs --dry-run
    """
    from packtool.commands.push import format_push, push

    try:
        result = push(path, repo, dry_run=dry_run, private=private, revision=revision)
    except PacktoolError as error:
        raise _fail(error) from None
    _echo_data(format_push(result))


@main.command(name="decontaminate")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--against", multiple=True, required=True, help="An eval set: a file, glob, folder or ORG/NAME.")
@click.option("--ngram", type=int, default=None, help="Words per window of a long eval string (default 13).")
@click.option("--min-line-words", type=int, default=None, help="Words a short eval string needs to match (default 6).")
@click.option("--field", "fields", multiple=True, help="Read only this top-level field of the eval records.")
@click.option("-o", "--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def decontaminate_command(
    output: Path,
    against: tuple[str, ...],
    ngram: int | None,
    min_line_words: int | None,
    fields: tuple[str, ...],
    report_path: Path | None,
    as_json: bool,
) -> None:
    """Check an existing build against an eval set without rebuilding; exit 1 when a sample's targets overlap it.

    Every document of OUT is decoded with the build's tokenizer and matched as a build with `decontamination:`
    matches (docs/config.md): targets and prompts apart, an overlap in a prompt only is listed but does not fail.
    The report names each eval file with its sha256.

    \b
    Example:
        packtool decontaminate out/quickstart --against evals/gsm8k-test.jsonl -o out/gsm8k-check.json
    """
    from packtool.commands.decontaminate import decontaminate, format_decontamination
    from packtool.config import decontamination_settings

    given = {"ngram": ngram, "min_line_words": min_line_words, "fields": list(fields) or None}
    try:
        settings = decontamination_settings(
            list(against), Path.cwd(), **{k: v for k, v in given.items() if v is not None}
        )
        report = decontaminate(output, settings)
        if report_path is not None:
            report_path.write_text(json.dumps(report.as_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except PacktoolError as error:
        raise _fail(error) from None
    except OSError as error:
        raise _fail(PacktoolError(f"{error.filename or report_path}: {error.strerror or error}")) from None
    _echo_data(json.dumps(report.as_dict(), indent=2) if as_json else format_decontamination(report))
    if not report.ok:
        raise SystemExit(1)


@main.command(name="find")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("key")
@click.option("--show", is_flag=True, help="Print each document found token by token, as `inspect` does.")
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The config the output was built from (default: inferred from the manifest) to find source files.",
)
@click.option("--json", "as_json", is_flag=True, help="Print placements, origins and rejects as JSON.")
@click.option("--color/--no-color", default=None, help="Highlight targets with --show (default: on a terminal).")
def find_command(output: Path, key: str, show: bool, config: Path | None, as_json: bool, color: bool | None) -> None:
    """Trace a sample: where it lives in the shards and where it came from.

    KEY is a sample id, a pack_hash (or a prefix of it), SHARD.parquet:ROW, or a source location
    FILE:LINE (JSON Lines, 1-based) / FILE:ROW (JSON arrays, Parquet, 0-based) as rejects.jsonl
    writes it. Prints shard, row, document, token range, pack_hash and repeat of each document,
    the record's file:line, and whether that record still hashes as it did at build time.

    \b
    Example:
        packtool find out/quickstart qs-chat-00007 --show
        packtool find out/quickstart quickstart/chat.jsonl:8 --json
    """
    from packtool.commands.find import find, format_trace
    from packtool.commands.show import PackRef, load_decoder, pack_json, pack_lines
    from packtool.shards import read_manifest

    use_color = sys.stdout.isatty() if color is None else color
    try:
        trace = find(output, key, config=config)
        refs = [PackRef(output / p.shard, p.row, (p.document,)) for p in trace.placements] if show else []
        decoder = load_decoder(refs[0].shard, read_manifest(output), None, output) if refs else None
        if as_json:
            report = trace.as_dict()
            if show:
                report["documents"] = [pack_json(r, decoder, limit=None, around=None, text=True) for r in refs]
            click.echo(json_shown(report, indent=2))
            return
        _echo_data(format_trace(trace))
        for ref in refs:
            lines = pack_lines(ref, decoder, limit=None, around=None, color=use_color, text=True)
            _echo_data("\n" + "\n".join(lines), color=use_color)
    except PacktoolError as error:
        raise _fail(error) from None


@main.command(name="trace")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--step", type=click.IntRange(min=0), help="List what this step trained: packs and samples per rank.")
@click.option("--id", "sample_id", help="List every (epoch, step, rank, micro-batch) that trains this sample id.")
@click.option("--pack", "pack_hash", help="List every (epoch, step, rank, micro-batch) that trains this pack_hash.")
@click.option("--rank", type=click.IntRange(min=0), help="With --step: only this rank.")
@click.option("--world-size", type=click.IntRange(min=1), help="Ranks (default 1, or the state's).")
@click.option("--token-budget", type=click.IntRange(min=1), help="PackedDataset(token_budget=...).")
@click.option("--fixed-shape", is_flag=True, help="PackedDataset(fixed_shape=True).")
@click.option("--balance", type=click.Choice(["attention"]), help="PackedDataset(balance=...).")
@click.option("--packs-per-step", type=click.IntRange(min=1), help="PackedDataset(packs_per_step=...), with --balance.")
@click.option("--alpha", type=float, help="PackedDataset(alpha=...), with --balance.")
@click.option("--isolate-documents", is_flag=True, help="PackedDataset(isolate_documents=True).")
@click.option("--seed", type=int, help="PackedDataset(seed=...) (default 0, or the state's).")
@click.option("--no-shuffle", is_flag=True, help="PackedDataset(shuffle=False).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Packs mode: packs per micro-batch of a rank.")
@click.option("--accumulation", type=click.IntRange(min=1), help="Micro-batches per step (gradient accumulation).")
@click.option("--epochs", type=click.IntRange(min=1), help="Epochs of the run (default 1; with --id, all are listed).")
@click.option("--epoch", type=click.IntRange(min=0), help="Anchor: the epoch where --at-step starts (default 0).")
@click.option("--position", type=click.IntRange(min=0), help="Anchor: the position where --at-step starts (default 0).")
@click.option("--at-step", type=click.IntRange(min=0), help="Anchor: the step that starts there (default 0).")
@click.option(
    "--state",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Anchor and order from a saved PackedDataset.state_dict() (JSON).",
)
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Anchor and order from a checkpoint folder of packtool.loader.hf (packtool_data.json, trainer_state.json).",
)
@click.option("--locate", is_flag=True, help="With --step: find each sample's file:line (reads the source files).")
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --locate: the build's config (default: inferred from the manifest).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the trace as JSON.")
def trace_command(
    output: Path,
    step: int | None,
    sample_id: str | None,
    pack_hash: str | None,
    rank: int | None,
    state: Path | None,
    checkpoint: Path | None,
    locate: bool,
    config: Path | None,
    as_json: bool,
    **options: object,
) -> None:
    """What a step trained on, or when a sample or pack trains: the loader's own plan, read from the shards.

    The settings are the loader's (PackedDataset's options of the same names), so the trace is
    what that loader yields. Steps count from an anchor: step 0 at the start of epoch 0, or the
    step, epoch and position of a saved loader state (--state) or an HF checkpoint folder
    (--checkpoint). A resume under another world size is traced in two parts, each with its
    settings. Needs the loader extra (torch).

    \b
    Example:
        packtool trace out/quickstart --step 12 --world-size 4 --token-budget 8192 --epochs 3
        packtool trace out/quickstart --id qs-chat-00007 --world-size 4 --token-budget 8192 --epochs 3
        packtool trace out/quickstart --step 340 --checkpoint run/checkpoint-340 --world-size 2 --locate
    """
    keys = [k for k in (step, sample_id, pack_hash) if k is not None]
    try:
        if len(keys) != 1:
            raise PacktoolError("packtool trace: give exactly one of --step N, --id ID, --pack HASH")
        from packtool.commands import lineage

        # a flag not given is None (or False); --seed 0 or --position 0 is given, and overrides a state's
        given = {k: v for k, v in options.items() if v is not None and v is not False}
        chosen = {k.removeprefix("no_"): False if k == "no_shuffle" else v for k, v in given.items()}
        chosen = {{"at_step": "first_step"}.get(k, k): v for k, v in chosen.items()}
        if state is not None and checkpoint is not None:
            raise PacktoolError("packtool trace: give --state or --checkpoint, not both")
        if checkpoint is not None:
            settings = lineage.settings_from_checkpoint(checkpoint, **chosen)
        elif state is not None:
            settings = lineage.settings_from_state(lineage.read_state_file(state), str(state), **chosen)
        else:
            settings = lineage.TraceSettings(**chosen)  # type: ignore[arg-type]
        if step is not None:
            by_step = lineage.trace_step(output, step, settings, rank=rank, locate=locate, config=config)
            report, text = by_step.as_dict(), lineage.format_step(by_step)
        else:
            kind = "sample_id" if sample_id is not None else "pack_hash"
            by_key = lineage.trace_key(output, sample_id or pack_hash or "", settings, kind=kind)
            report, text = by_key.as_dict(), lineage.format_key(by_key)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(json.dumps(report, ensure_ascii=False, indent=2) if as_json else text)


@main.command(name="report")
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", "-o", "destination", type=click.Path(dir_okay=False, path_type=Path), help="HTML file to write.")
def report_command(output: Path, destination: Path | None) -> None:
    """Write one self-contained HTML page of plots (default: OUTPUT/report.html); it opens offline.

    Plots: sample lengths per source with the capacity marked, pack fill, documents per pack,
    target ratio per source, and kept/truncated/rejected/dropped records per source. The page
    embeds the numbers it plots, the same as `packtool stats --json`.

    \b
    Example:
        packtool report out/quickstart -o quickstart.html
    """
    from packtool.commands.report import write_report

    try:
        path = write_report(output, destination)
    except PacktoolError as error:
        raise _fail(error) from None
    _echo_data(f"wrote {path}")


def run() -> NoReturn:
    """The `packtool` command: `main` as a program, ending without the interpreter's teardown.

    Teardown frees every object one by one (after a build: the tokenizer, the templates, numpy and
    pyarrow), ~0.07 s that a user waits for once the output is complete. What teardown does that
    matters still runs: handlers registered with atexit (a Ray driver's shutdown, multiprocessing's
    clean-up, temporary folders) and the flush of standard output, whose failure (a full disk) is one
    line and exit 1, never a traceback. Where a thread other than ours still runs, the interpreter
    ends as usual.
    """
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except OSError as error:
        if not _raised_by_echo(error):  # not the output's failure: a bug, with its traceback
            raise
        _output_failed(error)
        status = 1
    others = [thread for thread in threading.enumerate() if thread is not threading.main_thread()]
    if any(thread.is_alive() and not thread.daemon for thread in others):
        sys.exit(status)
    atexit._run_exitfuncs()
    failure = _flush_output()
    if failure is not None:
        _output_failed(failure)
        status = status or 1
    with suppress(OSError):
        sys.stderr.flush()
    os._exit(status)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter treats it
    return 1


def _raised_by_echo(error: OSError) -> bool:
    """Whether the error came from printing (a full disk under a redirect; click itself ends a closed
    pipe quietly with exit 1): every command prints through click.echo."""
    return any(frame.f_code is click.echo.__code__ for frame, _ in traceback.walk_tb(error.__traceback__))


def _output_failed(error: OSError) -> None:
    with suppress(OSError):
        print(f"Error: writing the output: {error.strerror or error}", file=sys.stderr)


def _flush_output() -> OSError | None:
    try:
        sys.stdout.flush()
    except OSError as error:
        return error
    return None
