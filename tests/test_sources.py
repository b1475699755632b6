from __future__ import annotations

import hashlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import shared

from packtool import reading
from packtool.adapters import record_hash
from packtool.config import DEFAULT_FIELDS, DEFAULT_SHAREGPT_ROLES, SourceConfig
from packtool.errors import RecordError
from packtool.format import read_manifest
from packtool.reading import Span, _suspect, _text_problem, raw_records
from packtool.records import Message
from packtool.sources import read_file, read_source, source_files


def source(fmt: str, *paths: Path, **fields) -> SourceConfig:
    mapping = {**DEFAULT_FIELDS[fmt], **fields}
    roles = dict(DEFAULT_SHAREGPT_ROLES) if fmt == "sharegpt" else {}
    # labels as the config gives them: the path relative to the config's folder
    labels = {str(p): Path(p).name for p in paths}
    return SourceConfig("src", tuple(labels), (), fmt, mapping, role_map=roles, labels=labels)


def test_messages_with_tool_calls_parts_and_ids(write_jsonl):
    row = {
        "uid": "conv-7",
        "tools": json.dumps([{"type": "function", "function": {"name": "weather", "parameters": {}}}]),
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
            {"role": "assistant", "content": "It is -3 C.", "train": False},
        ],
    }
    (example,) = list(read_source(source("messages", write_jsonl([row]), id="uid")))
    assert example.id == "conv-7"
    assert example.messages[1].content == "Weather in Oslo?"
    call = example.messages[2].tool_calls[0]
    assert call["function"]["arguments"] == {"city": "Oslo"} and call["id"] == "c1"
    assert example.messages[3].tool_call_id == "c1"
    assert example.messages[4].train is False
    assert example.tools[0]["function"]["name"] == "weather"
    assert example.sample_hash == record_hash(row)


def test_sharegpt_function_call_and_observation(write_jsonl):
    row = {
        "conversations": [
            {"from": "human", "value": "Convert 5 USD"},
            {"from": "function_call", "value": '{"name": "convert", "arguments": {"amount": 5}}'},
            {"from": "observation", "value": '{"eur": 4.6}'},
            {"from": "gpt", "value": "About 4.6 EUR."},
        ],
        "tools": "[]",
    }
    (example,) = list(read_source(source("sharegpt", write_jsonl([row]))))
    assert [m.role for m in example.messages] == ["user", "assistant", "tool", "assistant"]
    assert example.messages[1].tool_calls[0]["function"] == {"name": "convert", "arguments": {"amount": 5}}
    assert example.id == "src:data.jsonl:1" and example.tools is None


def test_alpaca_with_system_and_history(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(
        json.dumps(
            [{"instruction": "Add", "input": "2+2", "output": "4", "system": "Math.", "history": [["Hi", "Hello"]]}]
        )
    )
    (example,) = list(read_source(source("alpaca", path)))
    assert [(m.role, m.content) for m in example.messages] == [
        ("system", "Math."),
        ("user", "Hi"),
        ("assistant", "Hello"),
        ("user", "Add\n\n2+2"),
        ("assistant", "4"),
    ]


def test_text_from_parquet_and_globs(tmp_path):
    for i in range(2):
        pq.write_table(pa.table({"text": [f"doc {i}a", f"doc {i}b"]}), tmp_path / f"part-{i}.parquet")
    paths = sorted(tmp_path.glob("part-*.parquet"))
    examples = list(read_source(source("text", *paths)))
    assert [e.text for e in examples] == ["doc 0a", "doc 0b", "doc 1a", "doc 1b"]
    # each id names its own file and row: adding a file renumbers nothing
    assert [e.id for e in examples] == [
        "src:part-0.parquet:0",
        "src:part-0.parquet:1",
        "src:part-1.parquet:0",
        "src:part-1.parquet:1",
    ]
    assert examples[2].location == "part-1.parquet:0"


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        ("{not json", "", "not valid JSON"),
        ('{"other": 1}', "messages", "missing"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role", "unknown role 'wizard'"),
        ('{"messages": [{"role": "user", "content": 42}]}', "messages[0].content", "string or a list of parts"),
        ('{"messages": []}', "messages", "empty conversation"),
    ],
)
def test_bad_records_name_file_line_and_field(write_jsonl, line, field, reason):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl([good, line])
    first, second = list(read_source(source("messages", path)))
    assert not isinstance(first, RecordError)
    assert isinstance(second, RecordError)
    assert second.file == "data.jsonl" and second.row == 2 and second.field == field
    assert reason in second.reason
    assert str(second).startswith("data.jsonl:2")


def test_real_reasoning_tool_dataset_parses():
    path = shared("datasets", "llamafactory_reason_tool_use_demo_50.jsonl")
    examples = list(read_source(source("messages", path)))
    assert len(examples) == 50 and not any(isinstance(e, RecordError) for e in examples)
    assert any(m.reasoning_content for e in examples for m in e.messages)
    assert any(m.tool_calls for e in examples for m in e.messages)


def test_read_file_ranges_count_lines_and_rows(tmp_path, write_jsonl):
    rows = [{"text": f"doc {i}"} for i in range(5)]
    path = write_jsonl([rows[0], rows[1], "", rows[2], rows[3]])  # line 3 is blank: no record, still a line
    src = source("text", path)
    assert source_files(src) == [str(path)]
    whole = list(read_file(src, str(path)))
    assert [e.location for e in whole] == ["data.jsonl:1", "data.jsonl:2", "data.jsonl:4", "data.jsonl:5"]
    # positions are 0-based lines, so a worker given [2, 4) reads lines 3 and 4
    assert [e.location for e in read_file(src, str(path), 2, 4)] == ["data.jsonl:4"]
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), parquet, row_group_size=2)
    psrc = source("text", parquet)
    assert [e.id for e in read_file(psrc, str(parquet), 1, 4)] == [f"src:rows.parquet:{i}" for i in (1, 2, 3)]
    assert [e.text for e in read_file(psrc, str(parquet), 3)] == ["doc 3", "doc 4"]


def test_max_samples_takes_the_first_records_across_files(tmp_path):
    for i in range(2):
        (tmp_path / f"p{i}.jsonl").write_text("".join(json.dumps({"text": f"{i}-{j}"}) + "\n" for j in range(3)))
    src = replace(source("text", tmp_path / "p0.jsonl", tmp_path / "p1.jsonl"), max_samples=4)
    assert [e.text for e in read_source(src)] == ["0-0", "0-1", "0-2", "1-0"]


def test_an_unreadable_file_is_one_error_naming_it(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    (error,) = list(read_source(source("text", empty)))
    assert isinstance(error, RecordError) and error.kind == "unreadable_file" and error.row is None
    assert str(error) == "empty.parquet: file is empty (0 bytes)" and error.sample_id == "src:empty.parquet"


@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0xFFFF, blacklist_categories=())))
def test_the_cheap_scan_never_misses_a_nul_or_lone_surrogate(text):
    """Records are walked only when the scan says so: it must flag every string the walk would reject."""
    encoded = json.dumps({"content": text})  # ensure_ascii: NUL and surrogates become \\u escapes
    if _text_problem(json.loads(encoded)) is not None:
        assert _suspect(encoded)


def test_arrow_file_and_stream_formats_with_ranges(tmp_path):
    table = pa.table({"text": [f"row {i}" for i in range(7)]})
    for name, open_writer in [("f.arrow", pa.ipc.new_file), ("s.arrow", pa.ipc.new_stream)]:
        with pa.OSFile(str(tmp_path / name), "wb") as sink, open_writer(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=3):  # batches of 3, 3, 1 rows
                writer.write_batch(batch)
        src = source("text", tmp_path / name)
        assert [e.text for e in read_file(src, str(tmp_path / name), 2, 5)] == ["row 2", "row 3", "row 4"]
        assert [e.location for e in read_source(src)][-1] == f"{name}:6"


def test_yaml_dates_in_the_config_stay_json(tmp_path, write_jsonl):
    from packtool.config import canonical_json, load_config

    write_jsonl([{"text": "x"}])
    config = tmp_path / "c.yaml"
    tokenizer = Path(__file__).resolve().parents[1] / "configs" / "quickstart" / "tokenizer"
    config.write_text(
        f"sources: [{{name: d, path: data.jsonl, format: text}}]\ntokenizer: {tokenizer}\n"
        "capacity: 64\noutput: out\ntemplate_vars: {date: 2026-03-01}\n"
    )
    loaded = load_config(config)
    assert loaded.template_vars["date"] == "2026-03-01" and '"2026-03-01"' in canonical_json(loaded.raw)


def _write_stream(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _json_cells(values: list) -> pa.Array:
    """An `arrow.json` extension array, as datasets' `Json` feature stores values: JSON text per cell."""
    return pa.ExtensionArray.from_storage(pa.json_(), pa.array([None if v is None else json.dumps(v) for v in values]))


def test_arrow_json_extension_cells_are_parsed_also_inside_lists_and_structs(tmp_path):
    first = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
    ]
    second = [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "ok"}]
    messages = pa.ListArray.from_arrays(pa.array([0, 2, 4], pa.int32()), _json_cells(first + second))
    parameters = _json_cells([{"type": "object", "properties": {"x": {"type": "integer"}}}, None])
    function = pa.StructArray.from_arrays([pa.array(["f", "g"]), parameters], names=["name", "parameters"])
    tools = pa.ListArray.from_arrays(
        pa.array([0, 1, 2], pa.int32()), pa.StructArray.from_arrays([function], ["function"])
    )
    path = _write_stream(tmp_path / "data.arrow", pa.table({"messages": messages, "tools": tools}))

    one, two = read_source(source("messages", path))
    assert one.messages[1].tool_calls[0]["function"]["arguments"] == {"x": 1}
    assert one.tools == (
        {"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
    )
    # g's parameters are null in the struct, so absent: a template would otherwise print "parameters": null
    assert two.messages[1].content == "ok" and two.tools == ({"function": {"name": "g"}},)
    assert one.sample_hash == record_hash(
        {
            "messages": first,
            "tools": [
                {"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
            ],
        }
    )


def test_struct_nulls_read_as_absent_keys(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q", "name": "ann"}, {"role": "assistant", "content": "a"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")  # row 0 holds name: null
    first, second = read_source(source("messages", tmp_path / "chat.parquet"))
    assert first.sample_hash == record_hash(rows[0]) and second.sample_hash == record_hash(rows[1])
    assert second.messages[0].name == "ann"


def test_bad_json_text_in_an_arrow_cell_is_a_reject_naming_its_path(tmp_path):
    storage = pa.array(['{"role": "user", "content": "q"}', '{"role": "assistant", "content": NaN}'])
    messages = pa.ListArray.from_arrays(
        pa.array([0, 2], pa.int32()), pa.ExtensionArray.from_storage(pa.json_(), storage)
    )
    path = _write_stream(tmp_path / "bad.arrow", pa.table({"messages": messages}))
    (error,) = read_source(source("messages", path))
    assert isinstance(error, RecordError) and error.field == "messages[1]" and "NaN is not valid JSON" in error.reason
    assert error.describe().startswith("bad.arrow:0, field 'messages[1]'")


def test_prompt_completion_strings_are_one_text_with_the_prompt_as_context(write_jsonl):
    path = write_jsonl([{"prompt": "The sky is", "completion": " blue."}])
    (example,) = read_source(source("prompt_completion", path))
    assert example.text == "The sky is blue." and example.context_chars == len("The sky is")


def test_prompt_completion_messages_train_only_the_completion(write_jsonl):
    row = {
        "prompt": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ],
        "completion": [{"role": "assistant", "content": "6"}],
    }
    (example,) = read_source(source("prompt_completion", write_jsonl([row])))
    assert [(m.role, m.train) for m in example.messages] == [
        ("user", False),
        ("assistant", False),
        ("user", False),
        ("assistant", True),
    ]


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "completion", "both must be strings"),
        ({"prompt": [{"role": "user", "content": "a"}], "completion": []}, "completion", "no assistant message"),
        ({"prompt": "a", "completion": ""}, "completion", "empty completion"),
        ({"completion": "b"}, "prompt", "missing"),
    ],
)
def test_prompt_completion_problems_name_the_field(write_jsonl, row, field, reason):
    (error,) = read_source(source("prompt_completion", write_jsonl([row])))
    assert isinstance(error, RecordError) and error.field == field and reason in error.reason


def test_the_default_system_prompt_goes_first_only_where_there_is_none(write_jsonl):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {
            "messages": [
                {"role": "system", "content": "own"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
        },
    ]
    src = replace(source("messages", write_jsonl(rows)), system="Be brief.")
    plain, own = read_source(src)
    assert plain.messages[:2] == (Message("system", "Be brief.", train=False), Message("user", "q"))
    assert own.messages[0].content == "own" and len(own.messages) == 3
    assert plain.sample_hash == record_hash(rows[0])  # provenance is the record as read


def test_the_default_system_prompt_reaches_pair_prompts_but_not_text(write_jsonl):
    from packtool.records import PreferencePair

    pair = {
        "prompt": [{"role": "user", "content": "q"}],
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
    }
    (parsed,) = read_source(replace(source("preference", write_jsonl([pair], "pairs.jsonl")), system="S"))
    assert isinstance(parsed, PreferencePair) and parsed.prompt[0] == Message("system", "S", train=False)
    (text,) = read_source(
        replace(source("prompt_completion", write_jsonl([{"prompt": "a", "completion": "b"}])), system="S")
    )
    assert text.text == "ab"


def test_a_json_column_is_known_by_its_field_metadata_too(tmp_path):
    """How a file names the extension on disk: what a pyarrow that does not know `arrow.json` (before 19) reads."""
    named = pa.field(
        "messages", pa.list_(pa.field("item", pa.string(), metadata={"ARROW:extension:name": "arrow.json"}))
    )
    cells = [['{"role": "user", "content": "q"}', '{"role": "assistant", "content": "a"}']]
    table = pa.Table.from_arrays([pa.array(cells, named.type)], schema=pa.schema([named]))
    (example,) = read_source(source("messages", _write_stream(tmp_path / "old.arrow", table)))
    assert [m.content for m in example.messages] == ["q", "a"]


# --- max_record_bytes: memory per record is bounded ------------------------------------------

# VmHWM, the peak of this process's own memory: ru_maxrss keeps the peak of the forked pytest before exec.
_PEAK_BUILD = """
import re, sys
from pathlib import Path
from click.testing import CliRunner
from packtool.cli import main
result = CliRunner().invoke(main, ["build", sys.argv[1], "-q"])
print(result.exit_code, int(re.search(r"VmHWM:\\s*(\\d+)", Path("/proc/self/status").read_text()).group(1)) // 1024)
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak memory is read from Linux's /proc")
def test_a_huge_text_record_is_rejected_before_it_is_tokenized_in_bounded_memory(tmp_path):
    """A 12 MiB `format: text` record (the 200 MB one of issue 20 took 24 GB): over the 4 MiB
    default it is passed over while reading; the build, in one process, stays far below what
    tokenizing it would take (~150x its size: an 8 MiB record peaked at 1.26 GB). Not larger, so
    that a regression costs CI ~2 GB for a minute, not the machine."""
    import subprocess
    import sys

    from support import QUICKSTART

    with open(tmp_path / "docs.jsonl", "w") as handle:
        handle.write(json.dumps({"text": "a short document"}) + "\n")
        huge = '{"text": "' + "word " * ((12 << 20) // 5) + '"}'
        handle.write(huge + "\n")
        handle.write(json.dumps({"text": "after the huge one"}) + "\n")
    config = {
        "sources": [{"name": "docs", "path": "docs.jsonl", "format": "text"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        "on_error": "skip",
        "max_reject_share": 1.0,
        "workers": 1,
        "executor": "serial",
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_BUILD, str(tmp_path / "config.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    code, peak_mib = map(int, run.stdout.split())
    assert code == 0, run.stderr
    assert peak_mib < 500, f"peak {peak_mib} MiB"  # tokenizing the record whole: ~1.9 GB
    manifest = read_manifest(tmp_path / "out").raw
    assert manifest["accounting"]["docs"]["kept"] == 2
    assert manifest["accounting"]["docs"]["rejected"] == {"record_too_large": 1}
    (reject,) = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert reject["location"] == "docs.jsonl:2"
    assert f"a line of {len(huge):,} bytes is over max_record_bytes (4,194,304)" in reject["detail"]
    assert "raise max_record_bytes" in reject["detail"]


def test_large_rows_become_python_a_bounded_slice_at_a_time(tmp_path, monkeypatch):
    """Rows are converted _CONVERT_BYTES of Arrow data at a time (1024 rows of 4 MiB were 4 GiB at
    once); with a one-byte bound every row is its own slice and the records, rows and ranges are the same."""
    import packtool.reading as reading

    table = pa.table({"text": [f"row {i} " + "x" * i for i in range(7)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=4)
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=3)
    for name in ("t.parquet", "s.arrow"):
        src = source("text", tmp_path / name)
        whole = [(e.location, e.text) for e in read_source(src)]
        ranged = [e.text for e in read_file(src, str(tmp_path / name), 2, 6)]
        monkeypatch.setattr(reading, "_CONVERT_BYTES", 1)
        assert [(e.location, e.text) for e in read_source(src)] == whole
        assert [e.text for e in read_file(src, str(tmp_path / name), 2, 6)] == ranged == [t for _, t in whole[2:6]]
        monkeypatch.undo()
    assert whole[-1] == ("s.arrow:6", "row 6 xxxxxx")


def _lines_file(path: Path) -> tuple[list[bytes], int]:
    """JSON Lines with blank lines, a line over the size limit and one that is not JSON; the limit."""
    lines = [json.dumps({"text": f"line {i}"}).encode() for i in range(60)]
    lines[5], lines[21], lines[33] = b"", b"{not json", json.dumps({"text": "x" * 400}).encode()
    lines[40] = b"   "
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines, 200


@pytest.mark.parametrize(("line", "start", "stop"), [(10, 10, 30), (10, 14, None), (30, 30, 45), (34, 50, 60)])
def test_a_span_from_a_lines_offset_reads_what_a_scan_from_the_first_line_reads(tmp_path, line, start, stop):
    lines, limit = _lines_file(tmp_path / "f.jsonl")
    data = (tmp_path / "f.jsonl").read_bytes()
    offset = sum(len(x) + 1 for x in lines[:line])
    scan = list(raw_records(str(tmp_path / "f.jsonl"), "f.jsonl", start, stop, limit))
    span = Span(offset, line, len(data) - offset)
    seek = list(raw_records(str(tmp_path / "f.jsonl"), "f.jsonl", start, stop, limit, span))
    assert [n for n, _ in seek] == [n for n, _ in scan] and [repr(r) for _, r in seek] == [repr(r) for _, r in scan]
    # read to its end and hashed, even where the lines stopped earlier: what the caller checks against the plan
    assert (span.read, span.sha256(), span.more) == (
        len(data) - offset,
        hashlib.sha256(data[offset:]).hexdigest(),
        False,
    )


def test_a_span_reads_no_byte_past_its_end(tmp_path):
    lines, limit = _lines_file(tmp_path / "f.jsonl")
    data = (tmp_path / "f.jsonl").read_bytes()
    offset, size = sum(len(x) + 1 for x in lines[:10]), sum(len(x) + 1 for x in lines[10:20])
    span = Span(offset, 10, size)
    records = list(raw_records(str(tmp_path / "f.jsonl"), "f.jsonl", 10, None, limit, span))
    assert [n for n, _ in records][-1] == 20  # line 20 ends the span: the 40 after it are never read
    assert (span.sha256(), span.lines, span.more) == (
        hashlib.sha256(data[offset : offset + size]).hexdigest(),
        10,
        True,
    )


def test_a_span_reads_no_line_before_its_offset(tmp_path, monkeypatch):
    lines, limit = _lines_file(tmp_path / "f.jsonl")
    read: list[bytes] = []
    opened = reading.open_text

    class Counting(io.BufferedReader):
        def readline(self, size: int = -1) -> bytes:
            read.append(line := super().readline(size))
            return line

    monkeypatch.setattr(reading, "open_text", lambda path, kind, span: Counting(opened(path, kind, span).detach()))
    offset = sum(len(x) + 1 for x in lines[:50])
    span = Span(offset, 50, (tmp_path / "f.jsonl").stat().st_size - offset)
    records = list(raw_records(str(tmp_path / "f.jsonl"), "f.jsonl", 50, None, limit, span))
    assert [n for n, _ in records] == list(range(51, 61))
    assert len(read) <= 10 + 1  # lines 50..59, the end
