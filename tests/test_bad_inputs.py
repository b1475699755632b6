"""A bad-input corpus, built end to end through the CLI: every case gets its documented answer.

Each input case writes one small source file (usually a good record, then the case at line 2 /
row 1), builds it under `on_error: skip` and checks what was kept, what was rejected and why,
that every record read is accounted for, and that nothing printed a traceback. Cases that are
rejected are built again under `on_error: fail`: one line naming the file, the line or row, the
field and the reason, exit 1. Config cases must fail before any tokenization with one line.
The answers are documented in docs/format.md ("Bad input: what happens to it").
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.cli import main
from packtool.format import read_manifest

GOOD = {
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    "alpaca": {"instruction": "Say hi", "output": "hi"},
    "text": {"text": "a short document about packing"},
}


IMAGE_TURNS = [{"from": "human", "value": "<image>What is this?"}, {"from": "gpt", "value": "A cat."}]


def _lines(fmt: str, *bad: str | bytes, crlf: bool = False) -> bytes:
    """A good record on line 1, then each bad line as written."""
    end = b"\r\n" if crlf else b"\n"
    rows = [json.dumps(GOOD[fmt]).encode(), *(b if isinstance(b, bytes) else b.encode() for b in bad)]
    return b"".join(row + end for row in rows)


def _parquet(columns: dict[str, list]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue()


def _msg(content: str, role: str = "user") -> str:
    """A messages record whose first message has this raw JSON content (escapes as written)."""
    return f'{{"messages": [{{"role": "{role}", "content": {content}}}, {{"role": "assistant", "content": "ok"}}]}}'


def _truncated_gzip(lines: int) -> bytes:
    """JSON Lines of distinct documents, gzip-compressed and cut in the middle of the stream."""
    data = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " + str(i**7)}).encode() + b"\n" for i in range(lines)))
    return data[: len(data) // 2]


@dataclass(frozen=True)
class Case:
    name: str
    format: str
    file: str
    data: bytes | Callable[[], bytes]
    kept: int
    rejected: dict[str, int] = field(default_factory=dict)
    where: str = ""  # what the one-line error under on_error: fail names (file:line, field)
    reason: str = ""  # a piece of the reason (in rejects.jsonl detail and in the error line)
    settings: dict = field(default_factory=dict)  # top-level config keys for this case


# A record over max_record_bytes (set to 2 KiB below): never parsed or tokenized, one reject naming its line.
SMALL_LIMIT = {"max_record_bytes": 2048}
TOO_LARGE = "is over max_record_bytes (2,048)"
LONG_TEXT = json.dumps({"text": "word " * 2000})


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


CASES = [
    # messages, JSON Lines
    Case("valid", "messages", "c.jsonl", _lines("messages", json.dumps(GOOD["messages"])), kept=2),
    Case(
        "invalid_utf8",
        "messages",
        "c.jsonl",
        _lines("messages", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'),
        kept=1,
        rejected={"parse_error": 1},
        where="c.jsonl:2",
        reason="not valid UTF-8: byte 0xe9",
    ),
    Case(
        "lone_surrogate",
        "messages",
        "c.jsonl",
        _lines("messages", _msg('"a\\ud800b"')),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[0].content'",
        reason="lone surrogate (U+D800)",
    ),
    Case(
        "escaped_surrogate_pair_is_text", "messages", "c.jsonl", _lines("messages", _msg('"smile \\ud83d\\ude00"')), 2
    ),
    Case(
        "nesting_5000_deep",
        "messages",
        "c.jsonl",
        _lines("messages", '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"),
        kept=1,
        rejected={"parse_error": 1},
        where="c.jsonl:2",
        reason="nested too deeply",
    ),
    Case(
        "nan_literal",
        "messages",
        "c.jsonl",
        _lines("messages", '{"score": NaN, ' + _msg('"x"')[1:]),
        kept=1,
        rejected={"parse_error": 1},
        where="c.jsonl:2, field 'score'",
        reason="NaN is not valid JSON",
    ),
    Case(
        "infinity_literal",
        "messages",
        "c.jsonl",
        _lines("messages", '{"score": -Infinity, ' + _msg('"x"')[1:]),
        kept=1,
        rejected={"parse_error": 1},
        where="c.jsonl:2",
        reason="-Infinity is not valid JSON",
    ),
    Case(
        "nul_character",
        "messages",
        "c.jsonl",
        _lines("messages", _msg('"a\\u0000b"')),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[0].content'",
        reason="NUL character",
    ),
    Case("content_null_is_empty_text", "messages", "c.jsonl", _lines("messages", _msg("null")), kept=2),
    Case(
        "content_null_on_the_trained_answer",
        "messages",
        "c.jsonl",
        _lines("messages", '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}'),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2",
        reason="is empty: nothing to train",
    ),
    Case("utf8_bom", "messages", "c.jsonl", b"\xef\xbb\xbf" + _lines("messages", json.dumps(GOOD["messages"])), 2),
    Case("crlf_line_ends", "messages", "c.jsonl", _lines("messages", json.dumps(GOOD["messages"]), crlf=True), 2),
    Case("blank_lines", "messages", "c.jsonl", _lines("messages", "", "   ", json.dumps(GOOD["messages"])), kept=2),
    Case(
        "broken_json",
        "messages",
        "c.jsonl",
        _lines("messages", '{"messages": [}'),
        kept=1,
        rejected={"parse_error": 1},
        where="c.jsonl:2",
        reason="not valid JSON",
    ),
    Case(
        "missing_messages",
        "messages",
        "c.jsonl",
        _lines("messages", '{"conversation": []}'),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages'",
        reason="missing",
    ),
    Case(
        "unknown_role",
        "messages",
        "c.jsonl",
        _lines("messages", _msg('"x"', role="wizard")),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[0].role'",
        reason="unknown role 'wizard'",
    ),
    Case(
        "content_is_a_number",
        "messages",
        "c.jsonl",
        _lines("messages", _msg("42")),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[0].content'",
        reason="string or a list of parts",
    ),
    Case(
        "empty_conversation",
        "messages",
        "c.jsonl",
        _lines("messages", '{"messages": []}'),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages'",
        reason="empty conversation",
    ),
    Case(
        "record_is_an_array",
        "messages",
        "c.jsonl",
        _lines("messages", "[1, 2]"),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2",
        reason="expected a JSON object, got list",
    ),
    Case(
        "content_part_tool_call_not_json",
        "messages",
        "c.jsonl",
        _lines(
            "messages",
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": '
            '[{"type": "tool_call", "text": "{oops"}]}]}',
        ),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[1].content'",
        reason="not valid JSON",
    ),
    Case(
        "tool_call_arguments_not_json",
        "messages",
        "c.jsonl",
        _lines(
            "messages",
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": '
            '[{"function": {"name": "f", "arguments": "{oops"}}]}]}',
        ),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[1].tool_calls'",
        reason="tool-call arguments: not valid JSON",
    ),
    Case(
        "train_flag_not_boolean",
        "messages",
        "c.jsonl",
        _lines(
            "messages",
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": "yes"}]}',
        ),
        kept=1,
        rejected={"bad_record": 1},
        where="c.jsonl:2, field 'messages[1].train'",
        reason="train/weight must be true/false",
    ),
    # sharegpt
    Case(
        "sharegpt_nan_in_tools_string",
        "sharegpt",
        "s.jsonl",
        _lines("sharegpt", '{"tools": "[{\\"name\\": \\"f\\", \\"max\\": NaN}]", ' + json.dumps(GOOD["sharegpt"])[1:]),
        kept=1,
        rejected={"bad_record": 1},
        where="s.jsonl:2, field 'tools'",
        reason="tools string: NaN is not valid JSON",
    ),
    Case("sharegpt_valid", "sharegpt", "s.jsonl", _lines("sharegpt", json.dumps(GOOD["sharegpt"])), kept=2),
    Case(
        "sharegpt_unknown_speaker",
        "sharegpt",
        "s.jsonl",
        _lines("sharegpt", '{"conversations": [{"from": "narrator", "value": "x"}]}'),
        kept=1,
        rejected={"bad_record": 1},
        where="s.jsonl:2, field 'conversations[0].from'",
        reason="unknown speaker 'narrator'",
    ),
    Case(
        "sharegpt_value_not_a_string",
        "sharegpt",
        "s.jsonl",
        _lines("sharegpt", '{"conversations": [{"from": "human", "value": ["x"]}]}'),
        kept=1,
        rejected={"bad_record": 1},
        where="s.jsonl:2, field 'conversations[0].value'",
        reason="expected a string, got list",
    ),
    Case(
        "sharegpt_function_call_not_json",
        "sharegpt",
        "s.jsonl",
        _lines(
            "sharegpt", '{"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f("}]}'
        ),
        kept=1,
        rejected={"bad_record": 1},
        where="s.jsonl:2, field 'conversations[1].value'",
        reason="function_call value: not valid JSON",
    ),
    Case(
        "sharegpt_tools_string_not_json",
        "sharegpt",
        "s.jsonl",
        _lines("sharegpt", '{"tools": "[{", ' + json.dumps(GOOD["sharegpt"])[1:]),
        kept=1,
        rejected={"bad_record": 1},
        where="s.jsonl:2, field 'tools'",
        reason="tools string: not valid JSON",
    ),
    Case(
        "sharegpt_lone_surrogate_in_system",
        "sharegpt",
        "s.jsonl",
        _lines("sharegpt", '{"system": "\\udc00", ' + json.dumps(GOOD["sharegpt"])[1:]),
        kept=1,
        rejected={"bad_record": 1},
        where="s.jsonl:2, field 'system'",
        reason="lone surrogate",
    ),
    # alpaca
    Case("alpaca_valid", "alpaca", "a.jsonl", _lines("alpaca", '{"instruction": "q", "input": "", "output": "a"}'), 2),
    Case(
        "alpaca_missing_output",
        "alpaca",
        "a.jsonl",
        _lines("alpaca", '{"instruction": "q"}'),
        kept=1,
        rejected={"bad_record": 1},
        where="a.jsonl:2, field 'output'",
        reason="missing",
    ),
    Case(
        "alpaca_instruction_not_a_string",
        "alpaca",
        "a.jsonl",
        _lines("alpaca", '{"instruction": {"text": "q"}, "output": "a"}'),
        kept=1,
        rejected={"bad_record": 1},
        where="a.jsonl:2, field 'instruction'",
        reason="expected a string, got dict",
    ),
    Case(
        "alpaca_bad_history",
        "alpaca",
        "a.jsonl",
        _lines("alpaca", '{"instruction": "q", "output": "a", "history": [["only one"]]}'),
        kept=1,
        rejected={"bad_record": 1},
        where="a.jsonl:2, field 'history[0]'",
        reason="[prompt, response] pairs",
    ),
    Case(
        "alpaca_empty_output",
        "alpaca",
        "a.jsonl",
        _lines("alpaca", '{"instruction": "q", "output": ""}'),
        kept=1,
        rejected={"bad_record": 1},
        where="a.jsonl:2",
        reason="is empty: nothing to train",
    ),
    # text
    Case("text_valid", "text", "t.jsonl", _lines("text", '{"text": "second document"}'), kept=2),
    Case(
        "text_empty",
        "text",
        "t.jsonl",
        _lines("text", '{"text": ""}'),
        kept=1,
        rejected={"bad_record": 1},
        where="t.jsonl:2, field 'text'",
        reason="empty text",
    ),
    Case(
        "text_null",
        "text",
        "t.jsonl",
        _lines("text", '{"text": null}'),
        kept=1,
        rejected={"bad_record": 1},
        where="t.jsonl:2, field 'text'",
        reason="missing",
    ),
    Case(
        "text_is_a_number",
        "text",
        "t.jsonl",
        _lines("text", '{"text": 3.5}'),
        kept=1,
        rejected={"bad_record": 1},
        where="t.jsonl:2, field 'text'",
        reason="expected a string, got float",
    ),
    # JSON arrays (rows 0-based)
    Case("array_valid", "text", "t.json", json.dumps([GOOD["text"], {"text": "two"}]).encode(), kept=2),
    Case(
        "array_nan_in_one_row",
        "text",
        "t.json",
        b'[{"text": "one", "score": 1.5}, {"text": "two", "score": NaN}, {"text": "Infinity and NaN as words"}]',
        kept=2,
        rejected={"parse_error": 1},
        where="t.json:1, field 'score'",
        reason="NaN is not valid JSON",
    ),
    Case(
        "array_of_arrays",
        "text",
        "t.json",
        b"[[1, 2], " + json.dumps(GOOD["text"]).encode() + b"]",
        kept=1,
        rejected={"bad_record": 1},
        where="t.json:0",
        reason="expected a JSON object, got list",
    ),
    Case(
        "array_element_not_an_object",
        "text",
        "t.json",
        json.dumps([GOOD["text"], "just a string"]).encode(),
        kept=1,
        rejected={"bad_record": 1},
        where="t.json:1",
        reason="expected a JSON object, got str",
    ),
    Case(
        "array_with_nul",
        "text",
        "t.json",
        b'[{"text": "fine"}, {"text": "bin\\u0000ary"}]',
        kept=1,
        rejected={"bad_record": 1},
        where="t.json:1, field 'text'",
        reason="NUL character",
    ),
    Case(
        "array_truncated",
        "text",
        "t.json",
        b'[{"text": "fine"}, {"text": "cut',
        kept=1,  # the rows before the break are read; the rest is one unreadable_file reject at the row
        rejected={"unreadable_file": 1},
        where="t.json:1",
        reason="not valid JSON",
    ),
    Case(
        "json_object_not_records",
        "text",
        "t.json",
        b'{\n  "text": "one pretty-printed object"\n}\n',
        kept=0,
        rejected={"unreadable_file": 1},
        where="t.json",
        reason="pretty-printed JSON object",
    ),
    # Parquet (rows 0-based) and files that cannot be read at all
    Case("parquet_valid", "text", "t.parquet", lambda: _parquet({"text": ["one", "two"]}), kept=2),
    Case(
        "parquet_null_text",
        "text",
        "t.parquet",
        lambda: _parquet({"text": ["one", None]}),
        kept=1,
        rejected={"bad_record": 1},
        where="t.parquet:1, field 'text'",
        reason="missing",
    ),
    Case(
        "parquet_nul_text",
        "text",
        "t.parquet",
        lambda: _parquet({"text": ["one", "t\x00wo"]}),
        kept=1,
        rejected={"bad_record": 1},
        where="t.parquet:1, field 'text'",
        reason="NUL character",
    ),
    Case(
        "parquet_messages_struct",
        "messages",
        "m.parquet",
        lambda: _parquet({"messages": [GOOD["messages"]["messages"]] * 2}),
        kept=2,
    ),
    Case(
        "parquet_zero_bytes",
        "text",
        "t.parquet",
        b"",
        kept=0,
        rejected={"unreadable_file": 1},
        where="t.parquet",
        reason="file is empty (0 bytes)",
    ),
    Case(
        "parquet_truncated",
        "text",
        "t.parquet",
        lambda: _parquet({"text": ["one", "two"] * 50})[:200],
        kept=0,
        rejected={"unreadable_file": 1},
        where="t.parquet",
        reason="cannot read as parquet",
    ),
    Case(
        "parquet_suffix_on_json_lines",  # the reader goes by content, not by suffix
        "text",
        "t.parquet",
        _lines("text", '{"text": "two"}'),
        kept=2,
    ),
    Case(
        "jsonl_line_over_max_record_bytes",
        "text",
        "t.jsonl",
        _lines("text", LONG_TEXT, '{"text": "after"}'),
        kept=2,
        rejected={"record_too_large": 1},
        where="t.jsonl:2",
        reason=TOO_LARGE,
        settings=SMALL_LIMIT,
    ),
    Case(
        "jsonl_number_with_more_digits_than_python_reads",  # was: the rest of the file an unreadable_file
        "text",
        "t.jsonl",
        _lines("text", '{"text": "x", "n": ' + "9" * 10_000 + "}", '{"text": "after"}'),
        kept=2,
        rejected={"parse_error": 1},
        where="t.jsonl:2",
        reason="Exceeds the limit (4300 digits)",
    ),
    Case(
        "jsonl_first_line_over_max_record_bytes",
        "text",
        "t.jsonl",
        (LONG_TEXT + "\n" + json.dumps(GOOD["text"]) + "\n").encode(),
        kept=1,
        rejected={"record_too_large": 1},
        where="t.jsonl:1",
        reason=TOO_LARGE,
        settings=SMALL_LIMIT,
    ),
    Case(
        "jsonl_last_line_over_max_record_bytes_no_newline",
        "text",
        "t.jsonl",
        _lines("text") + LONG_TEXT.encode(),
        kept=1,
        rejected={"record_too_large": 1},
        where="t.jsonl:2",
        reason="a line of 10,012 bytes is over max_record_bytes (2,048)",
        settings=SMALL_LIMIT,
    ),
    Case(
        "zstd_line_over_max_record_bytes",
        "text",
        "t.jsonl.zst",
        lambda: _zstd(_lines("text", LONG_TEXT, '{"text": "after"}')),
        kept=2,
        rejected={"record_too_large": 1},
        where="t.jsonl.zst:2",
        reason=TOO_LARGE,
        settings=SMALL_LIMIT,
    ),
    Case(
        "parquet_row_over_max_record_bytes",
        "text",
        "t.parquet",
        lambda: _parquet({"text": ["one", "word " * 2000, "three"]}),
        kept=2,
        rejected={"record_too_large": 1},
        where="t.parquet:1",
        reason="the text of this row is over max_record_bytes (2,048)",
        settings=SMALL_LIMIT,
    ),
    Case(
        "json_array_row_over_max_record_bytes",
        "text",
        "t.json",
        json.dumps([GOOD["text"], {"text": "word " * 2000}]).encode(),
        kept=1,
        rejected={"record_too_large": 1},
        where="t.json:1",
        reason=TOO_LARGE,
        settings=SMALL_LIMIT,
    ),
    Case(
        "jsonl_zero_bytes",
        "messages",
        "c.jsonl",
        b"",
        kept=0,
        rejected={"unreadable_file": 1},
        where="c.jsonl",
        reason="file is empty (0 bytes)",
    ),
    Case(
        "jsonl_binary_garbage",
        "messages",
        "c.jsonl",
        b"PK\x03\x04\x14\x00\x00\x00binary",
        kept=0,
        rejected={"unreadable_file": 1},
        where="c.jsonl",
        reason="not JSON Lines, a JSON array, Parquet or Arrow",
    ),
    Case(
        "gzip_truncated_after_good_lines",
        "text",
        "t.jsonl.gz",
        lambda: _truncated_gzip(400),
        kept=-1,  # however many lines the cut leaves whole; the rest of the file is one unreadable_file reject
        rejected={"unreadable_file": 1},
        where="t.jsonl.gz",
        reason="damaged after line",
    ),
    # records with images: never trained as text while images are not built (docs/vision.md)
    Case(
        "sharegpt_images",
        "sharegpt",
        "c.jsonl",
        _lines("sharegpt", json.dumps({**GOOD["sharegpt"], "conversations": IMAGE_TURNS, "images": ["cat.png"]})),
        kept=1,
        rejected={"images_not_supported": 1},
        where="c.jsonl:2, field 'images'",
        reason="images are built only with `processor:` set",
    ),
    Case(
        "sharegpt_image_url",
        "sharegpt",
        "c.jsonl",
        _lines("sharegpt", json.dumps({"conversations": IMAGE_TURNS, "images": ["https://example.com/c.png"]})),
        kept=1,
        rejected={"image_remote": 1},
        where="c.jsonl:2, field 'images[0]'",
        reason="is a URL: packtool reads no network",
    ),
    Case(
        "sharegpt_placeholders_and_images_disagree",
        "sharegpt",
        "c.jsonl",
        _lines("sharegpt", json.dumps({"conversations": IMAGE_TURNS, "images": ["a.png", "b.png"]})),
        kept=1,
        rejected={"image_count_mismatch": 1},
        where="c.jsonl:2, field 'images'",
        reason="1 <image> placeholder(s) in the text for 2 image(s)",
    ),
    Case(
        "messages_image_part",
        "messages",
        "c.jsonl",
        _lines("messages", _msg('[{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What?"}]')),
        kept=1,
        rejected={"images_not_supported": 1},
        where="c.jsonl:2, field 'messages[0].content[0]'",
        reason="images are built only with `processor:` set",
    ),
]


def _config(tmp_path: Path, case: Case, on_error: str) -> Path:
    data = case.data() if callable(case.data) else case.data
    (tmp_path / case.file).write_bytes(data)
    (tmp_path / "good.jsonl").write_bytes(_lines("text"))
    config = {
        # a good second source, so that a case whose file yields nothing still leaves a build to check
        "sources": [
            {"name": "src", "path": case.file, "format": case.format},
            {"name": "good", "path": "good.jsonl", "format": "text"},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        "on_error": on_error,
        "workers": 1,
        "max_reject_share": 1.0,
        **case.settings,
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _build(config: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    output = result.output + (repr(result.exception) if result.exit_code not in (0, 1) else "")
    return result.exit_code, output


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_documented_answer(tmp_path, case):
    code, output = _build(_config(tmp_path, case, "skip"))
    assert "Traceback" not in output
    assert code == 0, output
    manifest = read_manifest(tmp_path / "out").raw
    counts = manifest["accounting"]["src"]
    assert counts["read"] == counts["kept"] + sum(counts["rejected"].values()) + sum(counts["dropped"].values())
    assert counts["rejected"] == case.rejected
    if case.kept >= 0:
        assert counts["kept"] == case.kept
    else:
        assert counts["kept"] > 0
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    bad = [r for r in rejects if r["reason"] in case.rejected]
    assert len(bad) == sum(case.rejected.values())
    for entry in bad:
        assert case.reason in entry["detail"] and entry["location"].startswith(case.where.split(",")[0])


REJECTED = [c for c in CASES if c.rejected]


@pytest.mark.parametrize("case", REJECTED, ids=[c.name for c in REJECTED])
def test_bad_input_under_fail_is_one_line_naming_where_and_why(tmp_path, case):
    code, output = _build(_config(tmp_path, case, "fail"))
    assert code == 1 and "Traceback" not in output
    (line,) = output.strip().splitlines()
    assert line.startswith(f"Error: {case.where}") and case.reason in line, line


# Config cases: (name, change to a valid config, a piece of the one-line error). A change is a
# dict merged into the top level, or a callable that edits the config (and may write files).
def _source_key(key: str, value: object) -> Callable[[dict, Path], None]:
    def edit(config: dict, _: Path) -> None:
        config["sources"][0][key] = value

    return edit


def _broken_tokenizer_config(config: dict, folder: Path) -> None:
    tokenizer = folder / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_bytes((QUICKSTART / "tokenizer" / "tokenizer.json").read_bytes())
    (tokenizer / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}",')
    config["tokenizer"] = str(tokenizer)


def _output_is_a_file(config: dict, folder: Path) -> None:
    (folder / "taken").write_text("not a folder")
    config["output"] = "taken"


def _output_under_a_file(config: dict, folder: Path) -> None:
    (folder / "taken").write_text("not a folder")
    config["output"] = "taken/out"


CONFIG_CASES = [
    ("capacity_1e12_text", {"capacity": "1e12"}, "capacity: expected an integer, got str '1e12'"),
    ("capacity_1e12", {"capacity": 10**12}, "capacity: must be between 2 and 1,048,576 (tokens per pack)"),
    ("capacity_2_pow_31", {"capacity": 2**31}, "capacity: must be between 2 and 1,048,576"),
    ("capacity_float", {"capacity": 2048.5}, "capacity: expected an integer"),
    ("capacity_one", {"capacity": 1}, "capacity: must be between 2"),
    ("seed_negative", {"seed": -1}, "seed: must be between 0 and"),
    (
        "max_segments_zero",
        {"packing": {"strategy": "bfd", "max_segments": 0}},
        "packing.max_segments: must be between 1",
    ),
    ("row_group_rows_zero", {"row_group_rows": 0}, "row_group_rows: must be between 1"),
    ("rows_per_shard_zero", {"rows_per_shard": 0}, "rows_per_shard: must be between 1"),
    ("weight_inf", _source_key("weight", float("inf")), "sources[0].weight: must be a positive finite number, got inf"),
    ("weight_nan", _source_key("weight", float("nan")), "sources[0].weight: must be a positive finite number, got nan"),
    ("weight_negative", _source_key("weight", -2), "sources[0].weight: must be a positive finite number"),
    ("template_date", {"template_vars": {"date": "yesterday"}}, "template_vars.date: expected an ISO date"),
    ("fallback_turns", {"truncation": {"strategy": "turns", "fallback": "turns"}}, "'turns' cannot be a fallback"),
    ("fallback_unknown", {"truncation": {"strategy": "turns", "fallback": "sideways"}}, "'sideways' is not one of"),
    ("tokenizer_config_malformed", _broken_tokenizer_config, "tokenizer_config.json is not valid JSON"),
    ("output_is_a_file", _output_is_a_file, "is a file, not a folder"),
    ("output_under_a_file", _output_under_a_file, "which is a file, not a folder"),
    ("misspelt_key", {"capacty": 64}, "capacty: unknown key; did you mean 'capacity'?"),
    ("trl_max_length", {"max_length": 64}, "max_length: unknown key; packtool calls this 'capacity'"),
    ("trl_max_seq_length", {"max_seq_length": 64}, "packtool calls this 'capacity'"),
    ("axolotl_sequence_len", {"sequence_len": 64}, "packtool calls this 'capacity'"),
    ("llamafactory_cutoff_len", {"cutoff_len": 64}, "packtool calls this 'capacity'"),
    ("format_share_gpt", _source_key("format", "share_gpt"), "'share_gpt' is not one of"),
    ("train_on_inputs", {"train_on_inputs": True}, "packtool calls this sources[].train.roles: [user, assistant]"),
    ("val_size", {"val_size": 0.1}, "packtool calls this validation"),
    ("max_samples_top_level", {"max_samples": 10}, "packtool calls this sources[].max_samples"),
    ("packing_true", {"packing": True}, "packtool always packs"),
    ("workers_zero", {"workers": 0}, "workers: expected a positive integer or 'auto'"),
    ("on_error_unknown", {"on_error": "ignore"}, "on_error: 'ignore' is not one of fail, skip"),
    ("source_key_misspelt", _source_key("fromat", "text"), "sources[0].fromat: unknown key; did you mean 'format'?"),
    ("validation_share_too_big", {"validation": {"share": 2}}, "validation.share: must be between"),
    ("max_reject_share_too_big", {"max_reject_share": 2}, "max_reject_share: must be between 0.0 and 1.0"),
    ("executor_unknown", {"executor": "dask"}, "executor: 'dask' is not one of processes, serial, ray"),
    ("max_record_bytes_tiny", {"max_record_bytes": 10}, "max_record_bytes: must be between 1,024 and"),
    ("max_record_bytes_text", {"max_record_bytes": "16MB"}, "max_record_bytes: expected an integer, got str '16MB'"),
]


@pytest.mark.parametrize(("name", "change", "expected"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_one_line_before_any_work(tmp_path, name, change, expected):
    import yaml

    (tmp_path / "t.jsonl").write_bytes(_lines("text"))
    config = {
        "sources": [{"name": "src", "path": "t.jsonl", "format": "text"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": "out",
        "workers": 1,
    }
    if callable(change):
        change(config, tmp_path)
    else:
        config.update(change)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code, output = _build(path)
    assert code == 1 and "Traceback" not in output
    (line,) = output.strip().splitlines()
    assert expected in line, line
    assert not (tmp_path / "out").exists()  # failed before the build touched anything
    if name == "format_share_gpt":
        assert "packtool calls this 'sharegpt'" in line
