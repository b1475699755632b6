"""`packtool verify` passes a real build and names the shard, row and promise a tampered one breaks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.cli import main
from packtool.labels import IGNORE_INDEX
from packtool.verify import row_problems, verify


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out


def test_a_fresh_build_verifies(build):
    result = CliRunner().invoke(main, ["verify", str(build)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output
    assert verify(build).packs == json.loads((build / "manifest.json").read_text())["stats"]["packs"]


def _tampered(build: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(build, copy)
    shard = copy / "shard-00000.parquet"
    rows = pq.read_table(shard).to_pylist()
    change(rows[3])
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(shard)), shard)
    return copy


def test_a_label_moved_across_a_boundary_is_caught(build, tmp_path):
    def leak(row):  # the next segment's first token becomes a target: the EOS -> next sample pair
        start = row["cu_seqlens"][1]
        row["labels"][start] = row["input_ids"][start]

    result = CliRunner().invoke(main, ["verify", str(_tampered(build, tmp_path, leak))])
    assert result.exit_code == 1
    assert "shard-00000.parquet: bytes or sha256 differ" in result.output
    assert "shard-00000.parquet row 3: a segment start carries a label" in result.output
    assert "pack_hash is" in result.output


def test_row_problems_on_hand_made_rows():
    good = {
        "input_ids": [5, 6, 2, 7, 2],
        "labels": [IGNORE_INDEX, 6, 2, IGNORE_INDEX, 2],
        "cu_seqlens": [0, 3, 5],
        "doc_cu_seqlens": [0, 3, 5],
        "sample_ids": ["a", "b"],
        "sample_hashes": ["x", "y"],
        "sample_repeats": [0, 0],
        "sources": ["s", "s"],
        "n_tokens": 5,
        "n_targets": 3,
        "attn_cost": 13,
    }
    from packtool.shards import pack_hash

    good["pack_hash"] = pack_hash(good["input_ids"], good["labels"], good["cu_seqlens"])
    assert row_problems(good, capacity=8) == []
    assert row_problems(good, capacity=4) == ["5 tokens > capacity 4"]
    shifted = {**good, "labels": [6, 2, IGNORE_INDEX, 2, IGNORE_INDEX]}
    assert any("differs from its token" in p for p in row_problems(shifted, capacity=8))
    broken = {**good, "cu_seqlens": [0, 3, 3, 5]}
    assert row_problems(broken, capacity=8)[0].startswith("cu_seqlens")
