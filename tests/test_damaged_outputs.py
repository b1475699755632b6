"""Every reading command answers a damaged output (a manifest or shard flipped, truncated, mistyped or foreign)
with exit 1 and one line naming the file, never a traceback; the fuzzing here is seeded and bounded."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support import claim_rows

from packtool.cli import main
from packtool.format import sha256_file
from packtool.seal import seal_manifest

SHARD = "shard-00001.parquet"


@pytest.fixture
def out(quickstart_build, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(quickstart_build, copy)
    return copy


def _commands(out: Path) -> dict[str, list[str]]:
    """Each reading command on OUT."""
    return {
        "verify": ["verify", str(out)],
        "stats": ["stats", str(out)],
        "inspect": ["inspect", str(out), "--row", "300", "--limit", "2", "--no-text"],  # a row of shard 1
        "inspect --id": ["inspect", str(out), "--id", "qs-chat-00007", "--no-text", "--limit", "2"],
        "find": ["find", str(out), "qs-chat-00007"],
        "report": ["report", str(out), "-o", str(out.parent / "report.html")],
    }


def _run(args: list[str]):
    result = CliRunner().invoke(main, args)
    assert "Traceback" not in result.output, (args, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    return result


def _answered(result, name: str, command: str) -> None:
    """Exit 1 and the file named: one `Error:` line, or verify's report."""
    assert result.exit_code == 1, (command, result.output)
    assert name in result.output, (command, name, result.output)
    if command != "verify":
        assert result.output.count("\n") == 1 and result.output.startswith("Error: "), (command, result.output)


def _all_refuse(out: Path, name: str) -> None:
    for command, args in _commands(out).items():
        _answered(_run(args), name, command)


def _no_traceback(out: Path, name: str) -> None:
    """A damage that may still decode (a flipped digit, a flipped bit in a token): exit 0, or exit 1 naming the file."""
    for command, args in _commands(out).items():
        result = _run(args)
        if result.exit_code != 0 or command == "verify":
            _answered(result, name, command)


def _reseal(out: Path, change) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    change(manifest)
    (out / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))


def _matching_manifest(out: Path, shard: Path) -> None:
    """The damage as a hostile edit would hide it: the manifest's size and checksum updated to the file."""

    def update(manifest):
        entry = next(e for e in manifest["shards"] if e["file"] == shard.name)
        entry.update(bytes=shard.stat().st_size, sha256=sha256_file(shard))

    _reseal(out, update)


def test_12_byte_flips_in_a_shard(out):
    shard = out / SHARD
    original = shard.read_bytes()
    rng = random.Random(20)
    for _ in range(12):
        damaged = bytearray(original)
        damaged[rng.randrange(len(original))] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(damaged))
        _no_traceback(out, SHARD)


def test_16_byte_flips_in_the_manifest(out):
    path = out / "manifest.json"
    original = path.read_bytes()
    rng = random.Random(21)
    for _ in range(16):
        damaged = bytearray(original)
        damaged[rng.randrange(len(original))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        _no_traceback(out, "manifest.json")


def _cuts(shard: Path) -> list[int]:
    """Every row-group boundary of a shard (where each group's pages start, where the footer starts, the magic
    bytes around it) and a few arbitrary offsets."""
    data = shard.read_bytes()
    meta = pq.ParquetFile(shard).metadata
    starts = []
    for group in range(meta.num_row_groups):
        column = meta.row_group(group).column(0)
        starts.append(min(o for o in (column.dictionary_page_offset, column.data_page_offset) if o is not None))
    footer = len(data) - 8 - struct.unpack("<i", data[-8:-4])[0]
    return sorted({*starts, footer, len(data) - 8, len(data) - 4, len(data) - 1, 0, 1, len(data) // 3})


def test_a_shard_truncated_at_every_row_group_boundary(out, tmp_path):
    shard = out / SHARD
    original = shard.read_bytes()
    alone = tmp_path / "alone" / SHARD  # no manifest beside it: nothing to compare its size with
    alone.parent.mkdir()
    cuts = _cuts(shard)
    assert len(cuts) >= 8
    for cut in cuts:
        shard.write_bytes(original[:cut])
        _all_refuse(out, SHARD)  # by its size against the manifest's
        alone.write_bytes(original[:cut])
        for command in ("stats", "inspect"):
            _answered(_run([command, str(alone)]), SHARD, command)  # by Parquet itself
    shard.write_bytes(original)
    _reseal(out, lambda m: None)
    for cut in cuts:
        shard.write_bytes(original[:cut])
        _matching_manifest(out, shard)  # the size check passes: Parquet itself must refuse it
        _all_refuse(out, SHARD)


def _rewrite(shard: Path, table: pa.Table) -> None:
    pq.write_table(table, shard, row_group_size=64)


@pytest.mark.parametrize(
    "change",
    [
        lambda t: pa.table({"a": [1, 2, 3]}),
        lambda t: t.drop_columns(["sources"]),
        lambda t: t.drop_columns(["input_ids"]),
        lambda t: t.set_column(
            t.schema.get_field_index("sample_ids"), "sample_ids", pa.array([[1]] * t.num_rows, pa.list_(pa.int64()))
        ),
        lambda t: t.set_column(t.schema.get_field_index("n_tokens"), "n_tokens", t.column("n_tokens").cast(pa.int64())),
        lambda t: t.append_column("extra", pa.array([0] * t.num_rows)),
        lambda t: t.set_column(
            t.schema.get_field_index("sources"), "sources", pa.array([None] * t.num_rows, pa.list_(pa.string()))
        ),
        lambda t: t.set_column(
            t.schema.get_field_index("doc_cu_seqlens"),
            "doc_cu_seqlens",
            pa.array([[0, 10**6]] * t.num_rows, pa.list_(pa.int32())),
        ),
    ],
    ids=["foreign", "no-sources", "no-input-ids", "ids-as-ints", "int64-count", "extra-column", "nulls", "offsets"],
)
def test_a_foreign_or_mistyped_shard(out, change):
    shard = out / SHARD
    _rewrite(shard, change(pq.read_table(shard)))
    _all_refuse(out, SHARD)  # its size differs from the manifest's
    _matching_manifest(out, shard)
    _all_refuse(out, SHARD)


def _set(path: list, value):
    def change(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


WRONG = ["x", 7, -1, 2.5, True, None, [], {}, [1]]
FIELDS = [
    ["capacity"],
    ["schema_version"],
    ["shards"],
    ["shards", 1],
    ["shards", 1, "file"],
    ["shards", 1, "rows"],
    ["shards", 1, "bytes"],
    ["shards", 1, "sha256"],
    ["accounting"],
    ["accounting", "chat"],
    ["accounting", "chat", "kept"],
    ["accounting", "chat", "rejected"],
    ["accounting", "chat", "truncated"],
    ["rejects"],
    ["rejects", "file"],
    ["tokenizer"],
    ["tokenizer", "file"],
    ["config"],
    ["lengths"],
    ["lengths", "chat"],
    ["lengths", "chat", "before"],
    ["lengths", "chat", "before", "histogram"],
    ["mode"],
    ["mixing"],
    ["overflow"],
]


NULLABLE = (["tokenizer", "file"], ["overflow"], ["lengths"], ["rejects"])  # absent in some outputs


@pytest.mark.parametrize("field", FIELDS, ids=[".".join(map(str, f)) for f in FIELDS])
def test_wrong_types_in_each_manifest_field(out, field):
    original = json.loads((out / "manifest.json").read_text())
    current = original
    for key in field:
        current = current[key] if key in current or isinstance(current, list) else None
    for value in WRONG:
        if type(value) is type(current) or (value is None and field in NULLABLE):
            continue  # the real value's type, or a documented null
        (out / "manifest.json").write_text(json.dumps(original))
        _reseal(out, _set(field, value))  # resealed: the types themselves must be refused
        _all_refuse(out, "manifest.json")


# ---- hostile outputs: made to mislead a reader rather than damaged by accident ----


def test_a_shard_swapped_for_another_valid_shard(out):
    shutil.copy(out / "shard-00000.parquet", out / SHARD)  # a sound packtool shard, not the one listed
    _all_refuse(out, SHARD)


def test_a_manifest_listing_a_shard_twice(out):
    _reseal(out, lambda m: m["shards"].append(dict(m["shards"][0])))
    _all_refuse(out, "manifest.json")


def test_a_shard_linked_to_a_file_outside_the_output(out, tmp_path):
    outside = tmp_path / "elsewhere.parquet"
    (out / SHARD).rename(outside)
    (out / SHARD).symlink_to(outside)  # the same bytes: only where it lives is wrong
    _all_refuse(out, SHARD)


def test_a_shard_that_is_a_fifo_is_not_opened(out):
    import os

    (out / SHARD).unlink()
    os.mkfifo(out / SHARD)  # opening it would block every command forever
    _all_refuse(out, SHARD)


def test_a_huge_row_count_claimed_in_the_manifest(out):
    _reseal(out, lambda m: m["shards"][1].update(rows=10**12))
    _answered(_run(["verify", str(out)]), "the manifest says rows 1000000000000", "verify")
    for command, args in _commands(out).items():  # the others read the shards, not the claim
        if command != "verify":
            assert _run(args).exit_code == 0, command


def test_json_nested_deeper_than_the_stack(out):
    (out / "rejects.jsonl").write_text("[" * 200_000 + "\n")
    for command in ("find", "verify"):
        _answered(_run(_commands(out)[command]), "rejects.jsonl", command)
    (out / "rejects.jsonl").write_text("[1, 2]\n")  # JSON, but no reject record
    for command in ("find", "verify"):
        _answered(_run(_commands(out)[command]), "rejects.jsonl:1: not a reject record", command)
    (out / "manifest.json").write_text("[" * 200_000)
    _all_refuse(out, "manifest.json")


def test_a_manifest_naming_a_foreign_tokenizer(out):
    _reseal(out, lambda m: m["tokenizer"].update(file=str(out / "manifest.json")))
    result = _run(["inspect", str(out), "--limit", "1"])
    _answered(result, "not a tokenizer.json", "inspect")


def test_a_footer_claiming_a_billion_rows(out):
    shard = out / SHARD
    claim_rows(shard, 10**9)
    assert pq.ParquetFile(shard).metadata.num_rows == 10**9
    _matching_manifest(out, shard)  # only the footer lies
    _all_refuse(out, "its footer claims 1000000000 rows, its row groups hold 200")
