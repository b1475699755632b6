"""What `packtool stats` shows of an output's summary (the numbers themselves: tests/test_summaries.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from support import QUICKSTART, REPO, shared

from packtool.cli import main
from packtool.format import read_manifest
from packtool.summaries import length_summary


@pytest.fixture(scope="module")
def with_lengths(quickstart_build, tmp_path_factory) -> Path:
    """The quickstart output with a `lengths` block as the build records it (written here by hand)."""
    out = tmp_path_factory.mktemp("lengths") / "out"
    shutil.copytree(quickstart_build, out)
    manifest = json.loads((out / "manifest.json").read_text())
    long = np.array([10, 300, 900, 1500, 4000])
    manifest["lengths"] = {
        "chat": {"before": length_summary(long, 1024), "after": length_summary(np.minimum(long, 1024), 1024)},
        "docs": {"before": length_summary(np.array([5, 6]), 1024), "after": length_summary(np.array([5, 6]), 1024)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_stats_shows_length_percentiles_and_capacity(with_lengths):
    result = CliRunner().invoke(main, ["stats", str(with_lengths)])
    assert result.exit_code == 0, result.output
    assert "sample lengths in tokens" in result.output
    assert "p99 4,000  max 4,000  over capacity 2" in result.output
    assert "over capacity 0" in result.output  # after truncation
    assert "──── capacity 1,024 ────" in result.output
    assert "(1024, inf)" in result.output


def test_stats_json_carries_lengths(with_lengths):
    result = CliRunner().invoke(main, ["stats", str(with_lengths), "--json"])
    assert result.exit_code == 0, result.output
    lengths = json.loads(result.output)["lengths"]
    assert lengths["chat"]["before"]["max"] == 4000 and lengths["chat"]["after"]["max"] == 1024
    assert lengths["chat"]["before"]["histogram"]["counts"][-1] == 2


def test_stats_on_a_manifest_without_lengths_says_so(quickstart_build, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(quickstart_build, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("lengths", None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["stats", str(out)])
    assert result.exit_code == 0, result.output
    assert "lengths: not recorded" in result.output
    assert json.loads(CliRunner().invoke(main, ["stats", str(out), "--json"]).output)["lengths"] is None


def test_stats_refuses_a_shard_whose_document_columns_disagree(quickstart_build, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "edited"
    shutil.copytree(quickstart_build, out)
    shard = out / "shard-00000.parquet"
    table = pq.read_table(shard)
    sources = table.column("sources").to_pylist()
    sources[0] = sources[0] + ["extra"]
    pq.write_table(table.set_column(table.schema.get_field_index("sources"), "sources", pa.array(sources)), shard)
    result = CliRunner().invoke(main, ["stats", str(out)])
    assert (
        result.exit_code == 1 and "shard-00000.parquet: " in result.output and "truncated or replaced" in result.output
    )
    (out / "manifest.json").unlink()  # the shard alone: nothing to compare its size with, its columns are read
    result = CliRunner().invoke(main, ["stats", str(shard)])
    assert result.exit_code == 1 and "shard-00000.parquet" in result.output and "sources" in result.output
    assert "Traceback" not in result.output


def _excerpt_matches(excerpt: list[str], full: list[str]) -> bool:
    """Whether `full` reads as `excerpt` where each "..." line stands for any run of lines (even none)."""
    chunks: list[list[str]] = [[]]
    for line in excerpt:
        if line == "...":
            chunks.append([])
        else:
            chunks[-1].append(line)
    head, *middle, tail = chunks if len(chunks) > 1 else [chunks[0], chunks[0]]
    if full[: len(head)] != head or (tail and full[len(full) - len(tail) :] != tail):
        return False
    at, end = len(head), len(full) - len(tail)
    for chunk in middle:
        while at + len(chunk) <= end and full[at : at + len(chunk)] != chunk:
            at += 1
        if at + len(chunk) > end:
            return False
        at += len(chunk)
    return True


def test_excerpt_matching():
    full = ["a", "b", "c", "d", "e"]
    assert _excerpt_matches(["a", "...", "c", "...", "e"], full)
    assert _excerpt_matches(["a", "b", "...", "d", "e"], full)
    assert not _excerpt_matches(["a", "...", "d", "c", "...", "e"], full)
    assert not _excerpt_matches(["a", "b", "c"], full)


def test_the_documented_stats_block_is_what_stats_prints_on_the_quickstart(quickstart_build):
    """docs/commands.md's example cannot drift from the real output (it had: other token counts, no lengths)."""
    doc = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    section = doc.split("## `packtool stats` on the quickstart", 1)[1]
    block = section.split("```\n", 2)[1].splitlines()
    assert block[0] == "$ packtool stats out/quickstart"
    result = CliRunner().invoke(main, ["stats", str(quickstart_build)])
    assert result.exit_code == 0, result.output
    assert _excerpt_matches(block[1:], result.output.splitlines()), result.output


def test_pair_lengths_are_labelled_as_cut_not_before_truncation(quickstart_build, tmp_path):
    """truncation.items cuts a pair's prompt when it is encoded, before the build records its length."""
    out = tmp_path / "out"
    shutil.copytree(quickstart_build, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"]["sources"][0]["format"] = "preference"  # chat, as if it were a pair source
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["stats", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert '  chat: pairs / groups, "as cut" = after truncation.items cut their prompts' in lines
    assert any(line.startswith("chat                 as cut n ") for line in lines)
    assert any(line.startswith("docs                 before n ") for line in lines)


def test_target_tokens_starting_in_the_prompt_are_counted_in_the_build_summary_and_stats(
    tmp_path, write_config, write_jsonl
):
    """Qwen2.5: a reply opening with a newline shares the token `\\n\\n` with its header; that token is a
    target (as transformers' assistant mask has it), counted per source, and both the build summary and
    `packtool stats` say so. A tool conversation with an empty result is kept (issue 37)."""
    folder = shared("tokenizers", "qwen2.5")
    straddling = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHello"}]}
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    call = {"type": "function", "function": {"name": "clock", "arguments": {}}}
    tool = {
        "type": "function",
        "function": {"name": "clock", "description": "The time", "parameters": {"type": "object", "properties": {}}},
    }
    empty_result = {
        "tools": [tool],
        "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": ""},
            {"role": "assistant", "content": "The clock said nothing."},
        ],
    }
    write_jsonl([straddling, plain, empty_result])
    config = write_config(
        {
            "sources": [{"name": "chat", "path": "data.jsonl", "format": "messages"}],
            "tokenizer": str(folder),
            "capacity": 512,
            "output": "out",
        }
    )
    built = CliRunner().invoke(main, ["build", str(config)])
    assert built.exit_code == 0, built.output
    summary_line = "  straddling                  1   target tokens starting in the prompt, trained (docs/templates.md)"
    assert summary_line in built.output.splitlines()
    accounting = read_manifest(tmp_path / "out").raw["accounting"]["chat"]
    assert (accounting["kept"], accounting["rejected"], accounting["straddling_targets"]) == (3, {}, 1)
    shown = CliRunner().invoke(main, ["stats", str(tmp_path / "out")])
    assert shown.exit_code == 0, shown.output
    assert summary_line in shown.output.splitlines()
    assert "straddling_targets=1" in shown.output


def test_heavy_truncation_is_named_per_source():
    """More than a tenth of a source's kept samples cut to fit: a line for the build summary."""
    from packtool.commands.stats import heavy_truncation

    def source(kept: int, truncated: dict) -> dict:
        return {"kept": kept, "truncated": truncated}

    manifest = {
        "capacity": 2048,
        "config": {"sources": [{"name": "dpo", "format": "preference"}, {"name": "chat", "format": "messages"}]},
        "accounting": {
            "dpo": source(300, {"left": {"samples": 81, "tokens": 9_000, "targets": 0}}),
            "chat": source(100, {"right": {"samples": 10, "tokens": 500, "targets": 400}}),  # a tenth: not more
            "docs": source(50, {"split": {"samples": 40, "tokens": 0, "targets": 0}}),  # split loses nothing
        },
    }
    assert heavy_truncation(manifest) == [
        "81 of 300 dpo pairs or groups lost prompt tokens to fit capacity 2048 (truncated.left)"
    ]
    manifest["accounting"]["chat"]["truncated"]["right"]["samples"] = 11
    assert heavy_truncation(manifest)[1] == "11 of 100 chat samples lost tokens to fit capacity 2048 (truncated.right)"


def test_a_build_that_cuts_many_samples_says_so(tmp_path):
    config = str(QUICKSTART.parent / "quickstart.yaml")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", config, "-o", str(out), "--max-samples", "30", "--capacity", "96"])
    assert result.exit_code == 0, result.output
    assert re.search(
        r"^note: \d+ of \d+ chat samples lost tokens to fit capacity 96 \(truncated\.", result.output, re.M
    )


def test_notes_stand_apart_from_what_was_rejected_dropped_or_cut(quickstart_build):
    """Special-token literals of kept samples were listed under "rejected / dropped / truncated"."""
    from packtool.commands.stats import format_stats

    stats = json.loads(CliRunner().invoke(main, ["stats", str(quickstart_build), "--json"]).output)
    chat = stats["accounting"]["chat"]
    assert chat["special_token_literals"] > 0 and not chat["rejected"] and not chat["dropped"]

    def row(text: str) -> str:
        return next(line for line in text.splitlines() if line.startswith("chat ") and "|" in line)

    literals = f"special_token_literals={chat['special_token_literals']}"
    assert row(format_stats(stats)).endswith(f"  - | {literals}")
    chat["rejected"] = {"bad_record": 2}
    chat["straddling_targets"] = 3
    assert row(format_stats(stats)).endswith(f"  rejected.bad_record=2 | {literals}, straddling_targets=3")
