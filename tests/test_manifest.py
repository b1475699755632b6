"""format.Manifest: manifest.json as a type (read, checked, written back byte for byte) and the v2 column table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest

from packtool.errors import PackFormatError
from packtool.format import (
    MANIFEST,
    SCHEMA,
    SCHEMA_V2,
    V2_COLUMNS,
    Manifest,
    ShardEntry,
    read_manifest,
    write_manifest,
)
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
