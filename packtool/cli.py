"""Thin command-line interface: parse, call one library function, print.

`PacktoolError` becomes one line and exit code 1; anything else keeps its traceback (a bug).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

import packtool
from packtool.errors import PacktoolError

SET_HELP = (
    "Override a config key, validated like the file; repeatable. VALUE is read as YAML. "
    "sources.NAME.KEY addresses a source by name, e.g. --set capacity=4096 --set sources.chat.weight=2."
)


def _fail(error: PacktoolError) -> click.ClickException:
    return click.ClickException(str(error))


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
@click.option("--workers", "-j", help="Processes for encode and emit: a number or 'auto' (overrides `workers`).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--max-samples", type=click.IntRange(min=1), help="Read only the first N records of every source.")
@click.option("--executor", type=click.Choice(["processes", "serial", "ray"]), help="Where work items run.")
@click.option("--address", help="Ray cluster address (with --executor ray).")
@click.option("--cache", "cache_dir", help="Token store folder (default: .packtool-cache beside the output).")
@click.option("--no-cache", is_flag=True, help="Reuse and resume nothing; keep no token store.")
@click.option("--strict", is_flag=True, help="Fail when any source loses a record (max_reject_share 0).")
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
    from packtool.build import build as run_build
    from packtool.build.executors import describe_workers
    from packtool.build.progress import BarProgress, Progress
    from packtool.config import load_config, resolve_config_path, usable_cores
    from packtool.stats import format_stats

    settings_from_flags = [f"executor={executor}"] if executor else []
    settings_from_flags += [f"ray_address={address}"] if address else []
    # paths typed on the command line are relative to the working folder
    settings_from_flags += [f"cache={Path(cache_dir).resolve()}"] if cache_dir else []
    settings_from_flags += ["max_reject_share=0"] if strict else []
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
        progress = BarProgress() if not quiet and sys.stderr.isatty() else Progress()
        with _interrupt_on_sigterm():
            built = run_build(settings, progress=progress, use_cache=not no_cache, dry_run=dry_run)
    except PacktoolError as error:
        raise _fail(error) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; the previous output is unchanged, rerun to resume") from None
    if dry_run:
        from packtool.build import format_preview

        click.echo(format_preview(built.manifest))
        return
    if not quiet:
        manifest = built.manifest
        click.echo(format_stats(manifest["stats"]))
        click.echo(
            f"\nencode: {built.encode_reused} of {built.encode_items} file(s) reused from the cache; "
            f"emit: {built.shards_reused} of {built.shards} shard(s) resumed"
        )
        click.echo(f"wrote {len(manifest['shards'])} shard(s) and manifest.json to {settings.output}")
        # `workers: auto` (the default) decides by the cores: say what it decided
        click.echo(f"ran as {describe_workers(settings.workers, settings.executor)} on {usable_cores()} usable core(s)")
        rejected = manifest["rejects"]["count"]
        if rejected:
            click.echo(
                f"{rejected} sample(s) not trained, each with its reason, in "
                f"{Path(settings.output) / manifest['rejects']['file']}"
            )


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
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path), default=".packtool-cache")
def cache_command(action: str, folder: Path) -> None:
    """List the token store's entries with their sizes, or clear them.

    FOLDER is the cache folder (default `.packtool-cache` in the working folder; a build's default
    is `.packtool-cache` beside its output).

    \b
    Example:
        packtool cache list out/.packtool-cache
        packtool cache clear out/.packtool-cache
    """
    from packtool.build.cache import TokenCache

    store = TokenCache(folder)
    if action == "clear":
        freed = store.clear()
        click.echo(f"cleared {folder}: {freed:,} bytes freed")
        return
    entries = store.entries()
    for entry in entries:
        click.echo(
            f"{entry['key'][:12]}  {entry['bytes']:>12,} B  {entry['samples']:>9,} samples  "
            f"{entry['source']}  {entry['file']}"
        )
    total = sum(e["bytes"] for e in entries)
    click.echo(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {total:,} bytes in {folder}")


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
    from packtool.show import inspect_json, inspect_pack

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
            click.echo(json.dumps(report, ensure_ascii=False, indent=1))
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
            click.echo(table, color=use_color)
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
    from packtool.shards import locate
    from packtool.stats import format_stats, summarize

    try:
        _, manifest, files = locate(path)
        summary = summarize(files, manifest)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_stats(summary))


@main.command(name="audit")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--rows", default=50, show_default=True, help="Rows of each source to check besides the built-in probes.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report (ok, checks with evidence, first failure) as JSON."
)
def audit_command(config: Path, rows: int, overrides: tuple[str, ...], as_json: bool) -> None:
    """Check the template + tokenizer before a long build; exit 1 if a check fails.

    Runs built-in probe conversations (system prompts, repeated roles, multi-turn tool calls,
    control-token text in content) and the first ROWS rows of each source, and reports each
    check with its evidence; the first failing sample is shown token by token.

    \b
    Example:
        packtool audit configs/quickstart.yaml --rows 100 --json
    """
    from dataclasses import asdict

    from packtool.audit import audit, format_audit
    from packtool.config import load_config, resolve_config_path

    try:
        report = audit(load_config(resolve_config_path(config), output=".", overrides=overrides), rows=rows)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(json.dumps({"ok": report.ok, **asdict(report)}, indent=2) if as_json else format_audit(report))
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
    from packtool.verify import format_verification, verify

    try:
        result = verify(path)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else format_verification(result))
    if not result.ok:
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
    from packtool.find import find, format_trace
    from packtool.shards import read_manifest
    from packtool.show import PackRef, load_decoder, pack_json, pack_lines

    use_color = sys.stdout.isatty() if color is None else color
    try:
        trace = find(output, key, config=config)
        refs = [PackRef(output / p.shard, p.row, (p.document,)) for p in trace.placements] if show else []
        decoder = load_decoder(refs[0].shard, read_manifest(output), None) if refs else None
        if as_json:
            report = trace.as_dict()
            if show:
                report["documents"] = [pack_json(r, decoder, limit=None, around=None, text=True) for r in refs]
            click.echo(json.dumps(report, ensure_ascii=False, indent=2))
            return
        click.echo(format_trace(trace))
        for ref in refs:
            lines = pack_lines(ref, decoder, limit=None, around=None, color=use_color, text=True)
            click.echo("\n" + "\n".join(lines), color=use_color)
    except PacktoolError as error:
        raise _fail(error) from None


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
    from packtool.report import write_report

    try:
        path = write_report(output, destination)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(f"wrote {path}")
