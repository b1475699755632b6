"""Thin command-line interface: parse, call one library function, print.

`PacktoolError` becomes one line and exit code 1; anything else keeps its traceback (a bug).
"""

from __future__ import annotations

import json
import sys
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
    from packtool.build.progress import BarProgress, Progress
    from packtool.config import load_config, resolve_config_path
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
        built = run_build(settings, progress=progress, use_cache=not no_cache)
    except PacktoolError as error:
        raise _fail(error) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; the previous output is unchanged, rerun to resume") from None
    if not quiet:
        manifest = built.manifest
        click.echo(format_stats(manifest["stats"]))
        click.echo(
            f"\nencode: {built.encode_reused} of {built.encode_items} file(s) reused from the cache; "
            f"emit: {built.shards_reused} of {built.shards} shard(s) resumed"
        )
        click.echo(f"wrote {len(manifest['shards'])} shard(s) and manifest.json to {settings.output}")
        rejected = manifest["rejects"]["count"]
        if rejected:
            click.echo(
                f"{rejected} sample(s) not trained, each with its reason, in "
                f"{Path(settings.output) / manifest['rejects']['file']}"
            )


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
@click.option("--row", "-r", default=0, show_default=True, help="Pack (row) index in the shard.")
@click.option("--limit", "-n", type=int, help="Show at most this many tokens per document.")
@click.option(
    "--around", "-a", type=int, help="Show only tokens this close to a document start or a context/target switch."
)
@click.option(
    "--tokenizer", type=click.Path(exists=True), help="tokenizer.json to decode with (default: from manifest)."
)
@click.option("--color/--no-color", default=None, help="Highlight targets (default: when writing to a terminal).")
def inspect_command(
    shard: Path, row: int, limit: int | None, around: int | None, tokenizer: str | None, color: bool | None
) -> None:
    """Print one pack token by token: id, piece, role, segment, position, attention range, label.

    SHARD is a .parquet shard or an output folder (its first shard).

    \b
    Example:
        packtool inspect out/quickstart/shard-00000.parquet --row 3 --around 3
    """
    from packtool.show import inspect_pack

    use_color = sys.stdout.isatty() if color is None else color
    try:
        click.echo(inspect_pack(shard, row=row, limit=limit, around=around, tokenizer=tokenizer, color=use_color))
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
def audit_command(config: Path, rows: int, overrides: tuple[str, ...]) -> None:
    """Check the template + tokenizer before a long build; exit 1 if a check fails.

    Runs built-in probe conversations (system prompts, repeated roles, multi-turn tool calls,
    control-token text in content) and the first ROWS rows of each source, and reports each
    check with its evidence; the first failing sample is shown token by token.

    \b
    Example:
        packtool audit configs/quickstart.yaml --rows 100
    """
    from packtool.audit import audit, format_audit
    from packtool.config import load_config, resolve_config_path

    try:
        report = audit(load_config(resolve_config_path(config), output=".", overrides=overrides), rows=rows)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(format_audit(report))
    if not report.ok:
        raise SystemExit(1)


@main.command(name="verify")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
def verify_command(path: Path) -> None:
    """Re-check an output from its bytes: checksums, offsets, labels, counts, pack hashes; exit 1 on a problem.

    PATH is an output folder or one shard.

    \b
    Example:
        packtool verify out/quickstart
    """
    from packtool.verify import format_verification, verify

    try:
        result = verify(path)
    except PacktoolError as error:
        raise _fail(error) from None
    click.echo(format_verification(result))
    if not result.ok:
        raise SystemExit(1)
