"""docs/config.md is checked against the config code: every key listed, required where the code requires
it, and each default in backticks the value the code uses when the key is absent."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from support import QUICKSTART, REPO

from packtool.config import DEFAULT_FIELDS, FORMATS, KEYS, ConfigError, parse_config

DOC = REPO / "docs" / "config.md"
ROW = re.compile(r"^\| `([^`]+)` \| (yes|no) \| (.*?) \| .* \|$")


def _documented() -> dict[str, tuple[bool, str]]:
    """key -> (required, default cell) for every row of the key tables."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            key, required, default = match.groups()
            if key in rows:
                raise AssertionError(f"docs/config.md lists {key} twice")
            rows[key] = (required == "yes", default)
    return rows


def _known() -> set[str]:
    return {f"{group}.{key}" if group else key for group, keys in KEYS.items() for key in keys}


def test_every_key_the_code_takes_is_documented_and_nothing_else():
    documented = set(_documented())
    assert _known() - documented == set(), "keys missing from docs/config.md"
    assert documented - _known() == set(), "keys in docs/config.md that the config does not take"


def _minimal(tmp_path: Path) -> dict:
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    return {
        "sources": [{"path": "chat.jsonl", "format": "messages"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": "out",
    }


def _set(raw: dict, key: str, value: object) -> dict:
    """raw with `key` (as the doc writes it: `packing.shuffle`, `sources[].train.roles`) set to value."""
    node = raw
    *parents, last = key.replace("sources[]", "sources.0").split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[last] = value
    return raw


def _parsed(raw: dict, tmp_path: Path):
    return replace(parse_config(raw, base_dir=tmp_path), raw={})  # raw holds the config as written


@pytest.mark.parametrize("key", sorted(_documented()))
def test_each_documented_default_is_the_code_s(tmp_path, key):
    required, default = _documented()[key]
    raw = _minimal(tmp_path)
    parent, _, name = key.replace("sources[]", "sources.0").rpartition(".")
    node = raw["sources"][0] if parent == "sources.0" else raw if not parent else {}
    if required:
        del node[name]
        with pytest.raises(ConfigError, match=re.escape(f"{key.replace('sources[]', 'sources[0]')}: is required")):
            parse_config(raw, base_dir=tmp_path)
        return
    assert name not in node, f"{key}: the smallest config the code takes has it, so it is required"
    value = re.fullmatch(r"`([^`]*)`", default)
    if value is None:
        assert default == "—" or "`" in default, f"{key}: a default is a value in backticks, words, or —"
        return
    written = _set(_minimal(tmp_path), key, yaml.safe_load(value.group(1)))
    assert _parsed(written, tmp_path) == _parsed(_minimal(tmp_path), tmp_path)


def test_the_fields_table_is_the_code_s():
    text = DOC.read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| `(\w+)` \| (`.*`) \|$", text, re.M))
    assert set(table) == set(FORMATS)
    for fmt, cell in table.items():
        assert re.findall(r"`(\w+)`", cell) == [k for k in DEFAULT_FIELDS[fmt] if k != "id"], fmt
        assert all(DEFAULT_FIELDS[fmt][k] == k for k in DEFAULT_FIELDS[fmt] if k != "id")


def test_the_content_parts_table_is_what_the_adapters_read():
    """LLaMA-Factory's parts ({"type": ..., "value": ...}) were read but nowhere documented."""
    from packtool.adapters import _message
    from packtool.errors import RecordError

    text = DOC.read_text(encoding="utf-8")
    table = text.split("| part `type` | becomes |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)`(?: or `(\w+)`)?", table, re.M))
    kinds = {kind for pair in documented for kind in pair if kind}
    assert kinds == {"text", "reasoning", "thinking", "tool_call"}
    parts = [
        {"type": "thinking", "value": "first"},
        {"type": "reasoning", "text": "then"},
        {"type": "text", "value": "It is "},
        {"value": "4."},
        {"type": "tool_call", "value": '{"name": "add", "arguments": {"a": 2}}'},
    ]
    answer = _message({"role": "assistant", "content": parts})
    assert answer.content == "It is 4." and answer.reasoning_content == "first\nthen"
    assert [call["function"]["name"] for call in answer.tool_calls] == ["add"]
    pictured = _message({"role": "user", "content": [{"type": "image", "value": "x.png"}, {"value": "What?"}]})
    assert (pictured.content, pictured.image_at) == ("What?", (0,))  # the build keeps the image with a processor
    with pytest.raises(RecordError, match="content part of type 'video': packtool does not build videos yet"):
        _message({"role": "assistant", "content": [{"type": "video", "value": "x.mp4"}]})
    with pytest.raises(RecordError, match="unsupported content part 'audio'"):
        _message({"role": "assistant", "content": [{"type": "audio", "value": "x.wav"}]})
