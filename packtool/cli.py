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
@click.option("--workers", "-j", help="Processes for render + encode: a number or 'auto' (overrides `workers`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
def build(config: Path, output: str | None, capacity: int | None, workers: str | None, quiet: bool) -> None:
    """Render, tokenize, truncate, pack and write shards as CONFIG describes.

    CONFIG may also be the name of a bundled config (e.g. `quickstart`).

    \b
    Example:
        packtool build configs/quickstart.yaml --output out/quickstart --capacity 2048 --workers auto
    """
    from packtool.config import load_config, resolve_config_path
    from packtool.pipeline import build as run_build
    from packtool.stats import format_stats

    try:
        config_path = resolve_config_path(config)
        if output is None and not config.is_file():
            output = f"out/{config.name}"  # a bundled config: write under the working folder, not site-packages
        # --output is a path the user typed, so it is relative to the working folder
        output = str(Path(output).resolve()) if output is not None else None
        settings = load_config(config_path, output=output, capacity=capacity, workers=workers)
        show_bar = not quiet and sys.stderr.isatty()
        from tqdm import tqdm  # lazy: tqdm pulls in importlib.metadata, 0.1 s that --help does not need

        with tqdm(desc="samples", unit=" samples", disable=not show_bar) as bar:
            manifest = run_build(settings, progress=bar.update)
    except PacktoolError as error:
        raise _fail(error) from None
    if not quiet:
        click.echo(format_stats(manifest["stats"]))
        click.echo(f"\nwrote {len(manifest['shards'])} shard(s) and manifest.json to {settings.output}")
        rejected = manifest["rejects"]["count"]
        if rejected:
            click.echo(
                f"{rejected} sample(s) not trained, each with its reason, in "
                f"{Path(settings.output) / manifest['rejects']['file']}"
            )


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
def audit_command(config: Path, rows: int) -> None:
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
        report = audit(load_config(resolve_config_path(config), output="."), rows=rows)
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
