"""No character from the data acts on the terminal: ids, sources, file names and text with escape sequences, CR,
BEL, C1 controls, bidi overrides or newlines are printed escaped by every command, coloured or piped, and
`--json` stays valid JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from support import QUICKSTART

from packtool.cli import main
from packtool.terminal import hidden, json_shown, shown

HOSTILE_IDS = [
    "esc\x1b[2Jclear",
    "cr\rOK",
    "bell\x07",
    "bidi\u202etxt.exe",
    "c1\x9b31m",
    "nl\nforged line",
    "tab\tid",
    "del\x7f",
    "sep\u2028line",
]
TEXT = "a \x1b[31mred\x1b[0m word, \r a carriage return, \x07 a bell, \u202e bidi, \x9b c1,\na newline\tand a tab"
# What may reach the terminal raw: newlines (the layout); tabs only inside a document's decoded text.
SGR = re.compile(r"\x1b\[[0-9;]*m")  # our own colour (--color), not data


def _raw(output: str, *, keep: str = "\n") -> list[str]:
    return sorted({repr(ch) for ch in SGR.sub("", output) if hidden(ch) and ch not in keep})


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    """An output whose sample ids, source name and texts carry control and bidi characters."""
    import yaml

    folder = tmp_path_factory.mktemp("hostile")
    rows = [{"id": sample_id, "text": f"{n}: {TEXT}"} for n, sample_id in enumerate(HOSTILE_IDS)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = {"name": "src\x1b]0;title\x07", "path": "data.jsonl", "format": "text", "fields": {"id": "id"}}
    config = {"sources": [source], "tokenizer": str(QUICKSTART / "tokenizer"), "capacity": 64, "output": "out"}
    (folder / "c.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = CliRunner().invoke(main, ["build", str(folder / "c.yaml"), "-q"])
    assert result.exit_code == 0, result.output
    return folder / "out"


def _run(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    return result.output


def test_shown_escapes_what_a_terminal_obeys():
    assert shown("id\x1b[2J") == "id\\x1b[2J"
    assert shown("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert shown("evil\u202etxt\u2066") == "evil\\u202etxt\\u2066"
    assert shown("c1\x9b del\x7f tag\U000e0041") == "c1\\x9b del\\x7f tag\\U000e0041"
    assert shown("line 1\n\tline 2", keep="\n\t") == "line 1\n\tline 2"
    assert shown("é 日本語 👨\u200d👩\u200d👧 ok") == "é 日本語 👨\u200d👩\u200d👧 ok"  # scripts and joiners stay


@given(st.text())
def test_shown_and_json_shown_leave_nothing_hidden(text):
    assert not any(hidden(ch) for ch in shown(text))
    printed = json_shown({"text": text, "list": [text]}, indent=2)
    assert not any(hidden(ch) and ch != "\n" for ch in printed)
    assert json.loads(printed) == {"text": text, "list": [text]}


def test_inspect_escapes_ids_sources_and_text(hostile):
    for flag in ("--color", "--no-color"):
        output = _run("inspect", str(hostile), "--id", "nl\nforged line", flag)
        assert _raw(output, keep="\n\t") == [], flag
        assert "document 0: nl\\nforged line (source src\\x1b]0;title\\x07" in output
        assert "a newline\tand a tab" in output  # the decoded text keeps its layout
        assert "\\x1b[31mred\\x1b[0m word, \\r a carriage return, \\x07 a bell, \\u202e bidi, \\x9b c1" in output
    whole = _run("inspect", str(hostile), "--row", "3", "--no-color")
    assert _raw(whole, keep="\n\t") == []
    report = _run("inspect", str(hostile), "--id", "bidi\u202etxt.exe", "--json")
    assert _raw(report) == []
    ids = [d["sample_id"] for p in json.loads(report)["packs"] for d in p["documents"]]
    assert ids == ["bidi\u202etxt.exe"]  # the JSON holds the data as it is


def test_find_stats_verify_and_report_escape_data(hostile, tmp_path):
    for sample_id in HOSTILE_IDS:
        text = _run("find", str(hostile), sample_id)
        assert _raw(text) == [] and shown(sample_id) in text
        as_json = _run("find", str(hostile), sample_id, "--json", "--show")
        assert _raw(as_json) == [] and json.loads(as_json)["key"] == sample_id
        assert _raw(_run("find", str(hostile), sample_id, "--show", "--color"), keep="\n\t") == []
    stats = _run("stats", str(hostile))
    assert _raw(stats) == [] and "src\\x1b]0;title\\x07" in stats
    assert _raw(_run("report", str(hostile), "-o", str(tmp_path / "r.html"))) == []
    (hostile / "x\x1b[2J\u202e.parquet").write_bytes(b"PAR1")  # a file name verify reports
    try:
        verified = _run("verify", str(hostile), exit_code=1)
    finally:
        (hostile / "x\x1b[2J\u202e.parquet").unlink()
    assert _raw(verified) == [] and "x\\x1b[2J\\u202e.parquet: present in" in verified


def test_error_messages_escape_what_they_quote(hostile):
    for args in (["find", str(hostile), "no\x1b[2J\u202ekey"], ["inspect", str(hostile), "--id", "no\rsuch\x9b"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and result.output.count("\n") == 1
        assert _raw(result.output) == [], result.output


def test_a_pipe_gets_the_same_escapes(hostile, tmp_path):
    piped = subprocess.run(
        [sys.executable, "-m", "packtool", "find", str(hostile), "bidi\u202etxt.exe", "--show"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert _raw(piped.stdout, keep="\n\t") == [] and "bidi\\u202etxt.exe" in piped.stdout


def test_a_megabyte_sample_id_is_printed_whole_and_safe(tmp_path):
    import yaml

    huge = "\x1b[2J" + "x" * 1_000_000 + "\u202e"
    rows = [{"id": huge, "text": "a short text"}, {"id": "small", "text": "another"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = {"name": "s", "path": "data.jsonl", "format": "text", "fields": {"id": "id"}}
    config = {"sources": [source], "tokenizer": str(QUICKSTART / "tokenizer"), "capacity": 64, "output": "out"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    assert CliRunner().invoke(main, ["build", str(tmp_path / "c.yaml"), "-q"]).exit_code == 0
    output = _run("inspect", str(tmp_path / "out"), "--no-text")
    assert _raw(output) == [] and shown(huge) in output and "document 1: small" in output
    assert _run("verify", str(tmp_path / "out")).count("\n") == 1


def test_audit_escapes_source_names(hostile):
    output = _run("audit", str(hostile.parent / "c.yaml"), "--rows", "3")
    assert _raw(output) == [] and "rows:src\\x1b]0;title\\x07" in output
