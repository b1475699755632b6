"""docs/format.md is the contract: its pack_hash recipe must recompute the hashes the build stores, and its
column tables and manifest field list must be the ones packtool.format declares."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
from support import REPO

from packtool.format import IMAGE_FIELDS, MANIFEST_FIELDS, MROPE_FIELD, SCHEMA, V2_COLUMNS

FORMAT = (REPO / "docs" / "format.md").read_text(encoding="utf-8")


def _section(heading: str) -> str:
    """The text from `heading` to the next heading of its level or above."""
    start = FORMAT.index(heading)
    level = heading.split(" ")[0]
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(FORMAT, start + len(heading))
    return FORMAT[start : end.start() if end else len(FORMAT)]


def _documented_columns(heading: str) -> list[pa.Field]:
    """The first column table of a section as Arrow fields: `| `name` | `list<int32>` | meaning |`."""
    rows = re.findall(r"^\| `(\w+)` \| `(list<)?(\w+)>?` \|", _section(heading), re.M)
    return [
        pa.field(name, pa.list_(pa.type_for_alias(value)) if listed else pa.type_for_alias(value))
        for name, listed, value in rows
    ]


def _documented_manifest_fields(heading: str) -> set[str]:
    """The top-level names of a section's first code block: each unindented line starts `name[, name]   text`."""
    block = re.search(r"```\n(.*?)```", _section(heading), re.S).group(1)
    lines = [line for line in block.splitlines() if line and not line[0].isspace()]
    names = {name.strip() for line in lines for name in re.split(r"\s{2,}", line)[0].split(",")}
    return {name for name in names if "." not in name}  # `stats.kinds`: a part of a field listed above


def test_the_documented_pack_hash_recipe_recomputes_the_stored_hashes(quickstart_build):
    section = FORMAT[FORMAT.index("### Recomputing `pack_hash`") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(code, namespace)  # the reader's copy of the recipe, exactly as documented
    table = pq.read_table(next(iter(sorted(quickstart_build.glob("shard-*.parquet")))))
    rows = table.to_pylist()
    assert rows
    for row in rows:
        assert namespace["pack_hash"](row["input_ids"], row["labels"], row["cu_seqlens"]) == row["pack_hash"]


def test_the_column_tables_are_the_shard_schema():
    assert _documented_columns("## Shard schema (one row per pack)") == list(SCHEMA)
    v2 = _documented_columns("## Per-segment columns (schema version 2)")
    assert v2 == [pa.field(column.name, pa.list_(column.arrow)) for column in V2_COLUMNS]
    assert _documented_columns("## Images (a build with an image processor)") == [MROPE_FIELD, *IMAGE_FIELDS]


def test_the_manifest_field_list_is_the_declared_fields():
    documented = _documented_manifest_fields("## Manifest (`manifest.json`)")
    added = _documented_manifest_fields("### Manifest additions")  # what schema v2 adds (kind_codes) or extends
    added |= _documented_manifest_fields("## Images (a build with an image processor)")  # vision
    assert documented | added == {name for name, _ in MANIFEST_FIELDS}
