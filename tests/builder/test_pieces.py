"""Schema v2 numbers the pieces of a split text: each segment says which part of its sample it is and where
it starts, and the pieces put back in order are the sample (docs/format.md "Pieces")."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from support import shared

from packtool.builder import build
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.format import read_manifest

TEXTS = [" ".join(f"word{i}-{j}" for j in range(n)) for i, n in enumerate((5, 90, 40, 170))]


def _documents(out: Path) -> dict[str, list[tuple[int, int, list[int]]]]:
    """sample id -> [(piece, offset, tokens)] over every segment of the output."""
    found: dict[str, list[tuple[int, int, list[int]]]] = {}
    for shard in read_manifest(out).shards:
        for row in pq.read_table(shard.file).to_pylist():
            cu = row["cu_seqlens"]
            for d, sample_id in enumerate(row["sample_ids"]):
                piece = (row["segment_pieces"][d], row["segment_piece_offsets"][d], row["input_ids"][cu[d] : cu[d + 1]])
                found.setdefault(sample_id, []).append(piece)
    return found


def test_split_pieces_name_their_part_and_reassemble_the_text(tmp_path, write_config):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = {
        "sources": [{"name": "texts", "path": str(texts), "format": "text"}],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "truncation": "split",
        "workers": 1,
    }
    build(load_config(write_config({**common, "capacity": 64, "output": "split"}, "split.yaml")))
    build(load_config(write_config({**common, "capacity": 4096, "output": "whole"}, "whole.yaml")))
    split, whole = _documents(tmp_path / "split"), _documents(tmp_path / "whole")
    assert read_manifest(tmp_path / "split").schema_version == 2
    assert verify(tmp_path / "split").ok and verify(tmp_path / "whole").ok
    assert set(split) == set(whole) and len(whole) == len(TEXTS)
    cut = 0
    for sample_id, [(number, offset, tokens)] in whole.items():
        assert (number, offset) == (-1, 0)  # nothing was cut at capacity 4096
        pieces = sorted(split[sample_id])
        if len(tokens) <= 64:
            assert pieces == [(-1, 0, tokens)]
            continue
        cut += 1
        assert [p[0] for p in pieces] == list(range(len(pieces)))
        assert [p[1] for p in pieces] == [64 * k for k in range(len(pieces))]
        assert [t for p in pieces for t in p[2]] == tokens  # the pieces in order are the text
    assert cut >= 2
