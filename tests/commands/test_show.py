"""`packtool inspect`: select packs and documents across a folder, compact boundary views, JSON, and target
markers that survive a pipe."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
from click.testing import CliRunner

from packtool.cli import main


def _inspect(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(main, ["inspect", *args])
    assert "Traceback" not in result.output
    assert result.exit_code == exit_code, result.output
    return result.output


def test_a_folder_row_counts_across_shards(quickstart_build):
    first = pq.ParquetFile(quickstart_build / "shard-00000.parquet").metadata.num_rows
    output = _inspect(str(quickstart_build), "--row", str(first + 2), "--limit", "2")
    assert output.startswith("shard-00001.parquet row 2:")
    assert "out of range" in _inspect(str(quickstart_build), "--row", "100000", exit_code=1)


def test_id_searches_every_shard_of_a_folder(quickstart_build):
    output = _inspect(str(quickstart_build), "--id", "qs-doc-0000", "--no-text", "--limit", "3")
    headers = [line for line in output.splitlines() if line.startswith("── document")]
    assert len(headers) > 1 and all("qs-doc-0000" in h for h in headers)  # every piece of the split document
    assert {line.split()[0] for line in output.splitlines() if " row " in line} >= {"shard-00000.parquet"}
    assert "text:" not in output
    assert "no document with sample id 'nope'" in _inspect(str(quickstart_build), "--id", "nope", exit_code=1)
    assert all(" piece " in h and "from token" in h for h in headers)  # each header names its piece
    report = json.loads(_inspect(str(quickstart_build), "--id", "qs-doc-0000", "--no-text", "--json"))
    pieces = sorted(d["piece"]["number"] for pack in report["packs"] for d in pack["documents"])
    assert pieces == list(range(len(headers)))


def test_doc_and_json(quickstart_build):
    report = json.loads(_inspect(str(quickstart_build / "shard-00000.parquet"), "--doc", "1", "--json"))
    [pack] = report["packs"]
    [document] = pack["documents"]
    assert document["document"] == 1 and pack["cu_seqlens"][1] == document["start"]
    assert len(document["tokens"]) == document["end"] - document["start"]
    assert document["tokens"][0]["label"] == -100 and not document["tokens"][0]["target"]
    assert sum(t["target"] for t in document["tokens"]) == document["targets"] > 0
    assert "text" in document
    assert "has 2 document(s); --doc 7 is out of range" in _inspect(
        str(quickstart_build / "shard-00000.parquet"), "--doc", "7", exit_code=1
    )


def test_around_is_compact_for_many_documents(quickstart_build):
    rows = pq.read_table(quickstart_build / "shard-00000.parquet", columns=["doc_cu_seqlens"]).to_pylist()
    busiest = max(range(len(rows)), key=lambda r: len(rows[r]["doc_cu_seqlens"]))
    documents = len(rows[busiest]["doc_cu_seqlens"]) - 1
    args = [str(quickstart_build / "shard-00000.parquet"), "--row", str(busiest), "--no-color"]
    compact = _inspect(*args, "--around", "1").splitlines()
    full = _inspect(*args, "--limit", "1000").splitlines()
    assert sum(line.split()[:3] == ["idx", "id", "piece"] for line in compact) == 1  # one column header per pack
    assert sum(line.startswith("── document") for line in compact) == documents  # one line per document
    assert not any(line == "text:" for line in compact)
    assert len(compact) < len(full) / 3


def test_target_markers_survive_a_pipe_with_and_without_color(quickstart_build, tmp_path):
    for flag in ("--color", "--no-color"):
        output = _inspect(str(quickstart_build / "shard-00000.parquet"), "--limit", "40", flag)
        assert any("  *" in line for line in output.splitlines()), flag
    piped = subprocess.run(
        [sys.executable, "-m", "packtool", "inspect", str(quickstart_build), "--color", "--limit", "40"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    marked = [line for line in piped.splitlines() if "*" in line]
    assert marked and "\x1b[" in marked[0]  # --color forces colour into the pipe, and the marker stays
