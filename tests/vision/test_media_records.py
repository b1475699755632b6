"""A build without `processor:` (or a format whose images are not built) rejects a record that carries images,
counted with its reason, never trained as text; tests/vision/test_encode_records.py reads them with one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packtool.config import DEFAULT_FIELDS, DEFAULT_SHAREGPT_ROLES, SourceConfig
from packtool.errors import RecordError
from packtool.records import Example
from packtool.sources import read_source


def source_of(tmp_path: Path, fmt: str, records: list[dict]) -> SourceConfig:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    roles = dict(DEFAULT_SHAREGPT_ROLES) if fmt == "sharegpt" else {}
    return SourceConfig("src", (str(path),), (), fmt, dict(DEFAULT_FIELDS[fmt]), role_map=roles, labels={})


SHAREGPT_TURNS = [{"from": "human", "value": "<image>What is shown?"}, {"from": "gpt", "value": "A cat."}]
MESSAGES = [{"role": "user", "content": "What is shown?"}, {"role": "assistant", "content": "A cat."}]


def with_part(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is shown?"}]}, MESSAGES[1]]


@pytest.mark.parametrize(
    ("fmt", "record", "field"),
    [
        ("sharegpt", {"conversations": SHAREGPT_TURNS, "images": ["cat.png"]}, "images"),
        ("messages", {"messages": MESSAGES, "videos": ["clip.mp4"]}, "videos"),
        ("alpaca", {"instruction": "<image><image>Two?", "output": "Yes.", "images": ["a.png", "b.png"]}, "images"),
        ("messages", {"messages": with_part({"type": "image", "image": "cat.png"})}, "messages[0].content[0]"),
        (
            "messages",
            {"messages": with_part({"type": "image_url", "image_url": {"url": "a.png"}})},
            "messages[0].content[0]",
        ),
    ],
)
def test_a_record_with_images_is_rejected_with_its_reason(tmp_path, fmt, record, field):
    plain = {key: value for key, value in record.items() if key not in ("images", "videos")}
    if fmt == "messages" and "videos" not in record:
        plain = {"messages": MESSAGES}
    parsed = list(read_source(source_of(tmp_path, fmt, [record, plain])))
    error, kept = parsed
    assert isinstance(error, RecordError) and isinstance(kept, Example)
    assert error.kind == "images_not_supported"
    assert error.field == field and error.row == 1
    built = "videos yet" if field == "videos" else "`processor:`"
    assert built in str(error) and "docs/vision.md" in str(error)


@pytest.mark.parametrize(
    ("fmt", "record", "kind", "field", "says"),
    [
        (
            "sharegpt",
            {"conversations": SHAREGPT_TURNS, "images": ["a.png", "b.png"]},
            "image_count_mismatch",
            "images",
            "1 <image> placeholder(s) in the text for 2 image(s)",
        ),
        (
            "sharegpt",
            {"conversations": SHAREGPT_TURNS, "images": ["https://example.com/cat.png"]},
            "image_remote",
            "images[0]",
            "'https://example.com/cat.png' is a URL",
        ),
        (
            "messages",
            {"messages": with_part({"type": "image_url", "image_url": {"url": "http://x/y.jpg"}})},
            "image_remote",
            "messages[0].content[0]",
            "packtool reads no network",
        ),
    ],
)
def test_what_a_record_says_of_its_images_is_its_own_reject(tmp_path, fmt, record, kind, field, says):
    (error,) = read_source(source_of(tmp_path, fmt, [record]))
    assert isinstance(error, RecordError)
    assert (error.kind, error.field) == (kind, field) and says in str(error)


def test_an_empty_images_list_is_plain_text(tmp_path):
    (parsed,) = read_source(source_of(tmp_path, "sharegpt", [{"conversations": SHAREGPT_TURNS, "images": []}]))
    assert isinstance(parsed, Example)
