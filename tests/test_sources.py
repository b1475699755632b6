from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import shared

from packtool.config import DEFAULT_FIELDS, DEFAULT_SHAREGPT_ROLES, SourceConfig
from packtool.errors import RecordError
from packtool.sources import read_source, record_hash


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
