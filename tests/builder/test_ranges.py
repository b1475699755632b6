"""Row ranges: a large input file is split into several encode work items, and nothing it writes
depends on the split (ids, locations, rejects, shards), on any executor."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import QUICKSTART

import packtool.ranges as file_ranges
from packtool.builder import build
from packtool.config import load_config
from packtool.format import read_manifest, sha256_file
from packtool.ranges import row_ranges

pytestmark = pytest.mark.timeout(300)


def _rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": " ".join(["answer"] * (5 + 11 * (i % 7)))},
            ]
        }
        for i in range(n)
    ]


def _outputs(folder: Path) -> dict[str, object]:
    """Every file's sha256; the manifest without plan_hash, which names the partitions the plan read."""
    files: dict[str, object] = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    manifest = read_manifest(folder).raw
    files["manifest"] = {k: v for k, v in manifest.items() if k not in ("plan_hash", "manifest_sha256")}
    return files


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """A JSON Lines file with blank lines, a line that is not JSON and a record without messages;
    a Parquet file of three row groups; an Arrow stream of batches of 5 rows."""
    lines = [json.dumps(r) for r in _rows(40)]
    lines[3] = ""
    lines[11] = "{not json"
    lines[17] = json.dumps({"text": "no messages here"})
    lines[30] = "   "
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    table = pa.table({"messages": [r["messages"] for r in _rows(25)]})
    pq.write_table(table, tmp_path / "chat.parquet", row_group_size=10)
    stream = pa.table({"messages": [r["messages"] for r in _rows(18)]})
    with pa.OSFile(str(tmp_path / "chat.arrow"), "wb") as sink, pa.ipc.new_stream(sink, stream.schema) as writer:
        for batch in stream.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    return tmp_path


def _config(folder: Path, output: str, workers: str):
    raw = {
        "sources": [
            {"name": "lines", "path": "chat.jsonl", "format": "messages"},
            {"name": "rows", "path": "chat.parquet", "format": "messages"},
            {"name": "stream", "path": "chat.arrow", "format": "messages"},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 128,
        "output": output,
        "rows_per_shard": 4,
        "on_error": "skip",
        "max_reject_share": 1.0,
    }
    (folder / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return load_config(folder / "config.json", workers=workers)


def _spans(file: Path, max_samples: int | None = None) -> list[tuple[int, int | None]]:
    return [(r.start, r.end) for r in row_ranges(str(file), max_samples)]


def test_row_ranges_cover_the_file_at_fixed_multiples(inputs, monkeypatch):
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", 7)
    assert _spans(inputs / "chat.jsonl") == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, None)]
    assert _spans(inputs / "chat.parquet") == [(0, 7), (7, 14), (14, 21), (21, None)]
    assert _spans(inputs / "chat.arrow") == [(0, 7), (7, 14), (14, None)]  # ranges cut across its batches
    assert _spans(inputs / "chat.jsonl", 10) == [(0, None)]  # max_samples counts records across the file
    (inputs / "array.json").write_text(json.dumps(_rows(20)), encoding="utf-8")
    assert _spans(inputs / "array.json") == [(0, 7), (7, 14), (14, None)]  # at element starts, found by parsing it
    assert _spans(inputs / "array.json", 10) == [(0, None)]
    assert _spans(inputs / "missing.jsonl") == [(0, None)]  # the read reports it, once


class _Memo:
    """A RangeMemo in a dict, recording what it is asked."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int], list[file_ranges.RowRange]] = {}
        self.asked: list[tuple[str, int]] = []

    def recall(self, whole: str, range_rows: int) -> list[file_ranges.RowRange] | None:
        self.asked.append((whole, range_rows))
        return self.kept.get((whole, range_rows))

    def remember(self, whole: str, range_rows: int, ranges: list[file_ranges.RowRange]) -> None:
        self.kept[(whole, range_rows)] = ranges


def test_a_memo_keeps_a_table_s_ranges_by_its_bytes_and_range_rows(inputs, monkeypatch):
    """Tables are remembered (decoding their rows costs more than reading their bytes); plain JSON Lines are
    hashed as they are read, and never asked for."""
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", 7)
    memo, table = _Memo(), inputs / "chat.parquet"
    hashed = row_ranges(str(table), None, memo)
    assert hashed == row_ranges(str(table), None) and list(memo.kept) == [(sha256_file(table), 7)]
    memo.kept[(sha256_file(table), 7)] = hashed[:1]
    assert row_ranges(str(table), None, memo) == hashed[:1]  # what a file of these bytes was split into
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", 8)
    assert [(r.start, r.end) for r in row_ranges(str(table), None, memo)] == [(0, 8), (8, 16), (16, 24), (24, None)]
    asked = len(memo.asked)
    row_ranges(str(inputs / "chat.jsonl"), None, memo)
    assert len(memo.asked) == asked


def test_a_split_file_writes_the_same_bytes_as_one_item(inputs, monkeypatch):
    whole = build(_config(inputs, "whole", "1"), use_cache=False)
    assert whole.encode_items == 3
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", 7)
    split = build(_config(inputs, "split", "1"), use_cache=False)
    assert split.encode_items == 6 + 4 + 3
    parallel = build(_config(inputs, "parallel", "2"), use_cache=False)
    rejects = [json.loads(line) for line in (inputs / "split" / "rejects.jsonl").read_text().splitlines()]
    assert [r["location"] for r in rejects] == ["chat.jsonl:12", "chat.jsonl:18"]  # lines, not range offsets
    assert whole.manifest["accounting"]["lines"]["read"] == 38
    assert _outputs(inputs / "whole") == _outputs(inputs / "split") == _outputs(inputs / "parallel")
    assert parallel.manifest["plan_hash"] == split.manifest["plan_hash"]  # same items, any worker count


def test_a_rebuild_reuses_every_range_from_the_cache(inputs, monkeypatch):
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", 7)
    config = _config(inputs, "out", "1")
    first = build(config)
    assert (first.encode_items, first.encode_reused) == (13, 0)
    before = _outputs(inputs / "out")
    again = build(config)
    assert again.encode_reused == again.encode_items == 13
    assert _outputs(inputs / "out") == before
