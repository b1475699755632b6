"""format.Manifest: manifest.json as a type (read, checked, written back byte for byte), the field declaration
the builder writes and the readers check (format.ManifestFields), and the v2 column table."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from support import QUICKSTART

from packtool.builder import build
from packtool.config import load_config
from packtool.errors import PackFormatError
from packtool.format import (
    MANIFEST,
    MANIFEST_FIELDS,
    SCHEMA,
    SCHEMA_V2,
    V2_COLUMNS,
    Manifest,
    ManifestFields,
    ShardEntry,
    manifest_problems,
    read_manifest,
    write_manifest,
)
from packtool.seal import SEAL
from packtool.shards import SegmentColumns


def _fields(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "schema_version": 1,
        "capacity": 64,
        "mode": "packed",
        "tokenizer": {"file": "../tok/tokenizer.json", "pad_token_id": None, "vocab_size": 300},
        "shards": [
            {"file": "shard-00000.parquet", "rows": 2, "tokens": 90, "targets": 40, "bytes": 812, "sha256": "ab"}
        ],
        "validation": {"folder": "validation", "packs": 1},
        "note": "a field no accessor models: kept as written",
    }
    return {**fields, **changes}


def test_written_manifest_reads_back_typed_and_to_json_is_the_file(tmp_path: Path) -> None:
    write_manifest(tmp_path, _fields())
    manifest = read_manifest(tmp_path)
    assert manifest.to_json() == (tmp_path / MANIFEST).read_text(encoding="utf-8")
    assert Manifest.from_json(manifest.to_json(), tmp_path) == manifest
    assert (manifest.schema_version, manifest.capacity, manifest.stream) == (1, 64, False)
    assert (manifest.pad_id, manifest.vocab_size, manifest.tokenizer_file) == (0, 300, "../tok/tokenizer.json")
    assert manifest.shards == (ShardEntry(tmp_path / "shard-00000.parquet", 2, 90, 40, 812, "ab"),)
    assert manifest.parts == {"validation": "validation"}
    assert manifest.raw["note"] == "a field no accessor models: kept as written"
    assert manifest.sealed and manifest.seal_matches


def test_an_edited_field_breaks_the_seal(tmp_path: Path) -> None:
    sealed = write_manifest(tmp_path, _fields())
    edited = Manifest.from_dict({**sealed, "capacity": 128}, tmp_path)
    assert edited.sealed and not edited.seal_matches
    assert not Manifest.from_dict(_fields(), tmp_path).sealed


def test_problems_name_the_field_and_refuse_the_manifest(tmp_path: Path) -> None:
    raw = _fields(capacity=0, shards=[{"file": "../x.parquet", "rows": 1}])
    with pytest.raises(PackFormatError, match=r"manifest\.json: 'capacity' must be a positive integer.*more"):
        Manifest.from_dict(raw, tmp_path)
    problems = dataclasses.replace(Manifest.from_dict(_fields(), tmp_path), raw=raw).problems()
    assert problems[0].startswith("'capacity' must be a positive integer")
    assert any("shards[0].file '../x.parquet'" in p for p in problems)
    assert any("shards[0].tokens must be a count" in p for p in problems)


def test_an_unknown_schema_version_is_the_one_problem_named(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text(json.dumps(_fields(schema_version=9, capacity="x")), encoding="utf-8")
    with pytest.raises(PackFormatError, match=r"schema_version 9; this packtool reads \[1, 2\]") as caught:
        read_manifest(tmp_path)
    assert "more" not in str(caught.value)


@pytest.mark.parametrize("text", ["{", "[1, 2]", "[" * 100_000])
def test_a_manifest_that_is_not_a_json_object_is_one_error(tmp_path: Path, text: str) -> None:
    (tmp_path / MANIFEST).write_text(text, encoding="utf-8")
    with pytest.raises(PackFormatError, match=r"manifest\.json: (not valid JSON|expected a JSON object)"):
        read_manifest(tmp_path)


def test_the_v2_column_table_is_the_v2_schema_and_the_segment_record() -> None:
    assert list(SCHEMA_V2) == list(SCHEMA) + [pa.field(c.name, pa.list_(c.arrow)) for c in V2_COLUMNS]
    assert [c.field for c in V2_COLUMNS] == [f.name for f in dataclasses.fields(SegmentColumns)]
    for column in V2_COLUMNS:
        assert pa.from_numpy_dtype(column.dtype) == column.arrow, column.name


def test_the_manifest_names_the_model_template_files_the_build_used(tmp_path: Path, write_config, write_jsonl) -> None:
    """A model folder saved by transformers >= 4.43 holds chat_template.jinja, which wins over the key, and
    maybe additional_chat_templates/tool_use.jinja, which renders the records that bring tools."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(QUICKSTART / "tokenizer", folder)
    key = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    (folder / "chat_template.jinja").write_text(key.replace("<|im_start|>", "<|im_start|> "), encoding="utf-8")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(key, encoding="utf-8")
    write_jsonl([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
    raw = {"sources": [{"name": "chat", "path": "data.jsonl", "format": "messages"}], "tokenizer": str(folder)}
    config = load_config(write_config({**raw, "capacity": 64, "output": "out"}))
    template = build(config).manifest["template"]
    assert (template["name"], template["file"], template["named"]) == ("model", "chat_template.jinja", "default")
    assert template["sha256"] == hashlib.sha256((folder / "chat_template.jinja").read_bytes()).hexdigest()
    assert template["tools"] == {
        "name": "model:tool_use",
        "sha256": hashlib.sha256(key.encode()).hexdigest(),
        "file": "additional_chat_templates/tool_use.jinja",
        "named": "tool_use",
    }
    assert read_manifest(Path(config.run.output)).problems() == []


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("chatml", "'template' must be an object or null, got 'chatml'"),
        ({"name": "model", "file": 3}, "template.file must be a string or null, got 3"),
        ({"name": "model", "tools": {"named": ["tool_use"]}}, "template.tools.named must be a string or null"),
        ({"name": "model", "tools": "tool_use"}, "template.tools must be an object {name, sha256, file, named}"),
    ],
)
def test_a_damaged_template_entry_is_named(tmp_path: Path, template: object, problem: str) -> None:
    with pytest.raises(PackFormatError, match=re.escape(problem)):
        Manifest.from_dict(_fields(template=template), tmp_path)


def test_a_manifest_from_before_template_files_were_recorded_still_reads(tmp_path: Path) -> None:
    old = {"name": "model", "sha256": "ab", "injects": []}
    assert Manifest.from_dict(_fields(template=old), tmp_path).problems() == []
    assert Manifest.from_dict(_fields(template=None), tmp_path).problems() == []


def test_a_build_writes_the_declared_fields_and_they_round_trip(quickstart_build: Path) -> None:
    """The builder writes ManifestFields; its manifest holds declared fields only, and read back into the
    declaration (with the seal) it is the same JSON."""
    raw = read_manifest(quickstart_build).raw
    names = [name for name, _ in MANIFEST_FIELDS]
    assert set(raw) <= set(names)
    assert ManifestFields(**raw).as_dict() == raw
    assert SEAL in names


def test_optional_fields_are_left_out_but_a_null_template_is_written() -> None:
    required = {
        name: 1 if name in ("schema_version", "capacity") else []
        for name, _ in MANIFEST_FIELDS
        if ManifestFields.__dataclass_fields__[name].default is not None
    }
    written = ManifestFields(**{**required, "template": None}).as_dict()
    assert "template" in written and written["template"] is None
    assert written.keys().isdisjoint({"stats", "overflow", "validation", "kind_codes", SEAL})


@pytest.mark.parametrize(
    "name", [name for name, _ in MANIFEST_FIELDS if name not in ("schema_version", "capacity", "shards")]
)
def test_a_manifest_without_a_field_an_older_packtool_did_not_write_still_reads(
    quickstart_build: Path, name: str
) -> None:
    raw = {key: value for key, value in read_manifest(quickstart_build).raw.items() if key != name}
    assert manifest_problems(raw) == []


@pytest.mark.parametrize(
    ("name", "problems"),
    [
        ("schema_version", ["schema_version None; this packtool reads [1, 2]"]),
        ("capacity", ["'capacity' must be a positive integer, got None"]),
        ("shards", ["'shards' must be a list, got None"]),
    ],
)
def test_a_manifest_without_a_field_every_reader_needs_is_refused(
    quickstart_build: Path, name: str, problems: list[str]
) -> None:
    raw = {key: value for key, value in read_manifest(quickstart_build).raw.items() if key != name}
    assert [p.split(" (rebuild")[0] for p in manifest_problems(raw)] == problems


def test_the_checks_run_in_declaration_order_and_stop_where_nothing_else_can_be_read() -> None:
    raw = _fields(capacity=0, shards="x", mode="train")
    assert manifest_problems(raw) == [
        "'capacity' must be a positive integer, got 0",
        "'shards' must be a list, got 'x'",
    ]
    assert manifest_problems(_fields(capacity=0, mode="train")) == [
        "'capacity' must be a positive integer, got 0",
        "'mode' must be 'packed' or 'stream', got 'train'",
    ]


@pytest.mark.parametrize(
    "recorded", ["/a/configs", {"path": "configs", "relative": "../configs"}, {"path": "/a/configs", "relative": 3}]
)
def test_a_config_folder_is_an_absolute_path_and_one_relative_to_the_folder(recorded: object) -> None:
    assert manifest_problems(_fields(config_folder={"path": "/a/configs", "relative": "../../a/configs"})) == []
    assert manifest_problems(_fields(config_folder=recorded)) == [
        f"'config_folder' must be {{path: absolute, relative: to this folder}}, got {recorded!r:.80}"
    ]
