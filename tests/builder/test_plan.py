"""The build's plan (builder.plan): packs grouped by source, and the overflow bucket with accounting that adds up."""

from __future__ import annotations

from pathlib import Path

from support import chat_rows, shard_rows, two_chat_sources

from packtool.builder import build
from packtool.format import read_manifest


def test_group_by_source_never_mixes_groups(tmp_path, write_config, write_jsonl):
    config = two_chat_sources(tmp_path, write_config, write_jsonl, packing={"strategy": "bfd", "group_by": "source"})
    build(config)
    rows = shard_rows(Path(config.run.output))
    assert all(len(set(r["sources"])) == 1 for r in rows)
    assert {s for r in rows for s in r["sources"]} == {"a", "b"}
    mixed = build(two_chat_sources(tmp_path, write_config, write_jsonl)).manifest
    assert mixed["stats"]["packs"] <= len(rows)


def test_overflow_bucket_and_accounting_add_up(tmp_path, write_config, write_jsonl):
    write_jsonl(chat_rows(3, 400, "long"), "long.jsonl")
    long_source = {"name": "long", "path": "long.jsonl", "format": "messages", "fields": {"id": "id"}}
    config = two_chat_sources(
        tmp_path, write_config, write_jsonl, extra_sources=[long_source], overflow={"mode": "bucket", "capacity": 1024}
    )
    manifest = build(config).manifest
    out = Path(tmp_path / "out")
    assert manifest["overflow"]["segments"] == 3
    assert read_manifest(out / "overflow").capacity == 1024
    bucket_rows = shard_rows(out / "overflow")
    assert sorted(s for r in bucket_rows for s in r["sample_ids"]) == ["long0", "long1", "long2"]
    assert all(r["n_tokens"] <= 1024 for r in bucket_rows)
    assert all(r["n_tokens"] <= 256 for r in shard_rows(out))
    for name, a in manifest["accounting"].items():
        assert a["read"] == a["kept"] + sum(a["rejected"].values()) + sum(a["dropped"].values()), name
    assert manifest["accounting"]["long"]["overflow"] == 3
    packed = sum(len(r["sample_ids"]) for r in shard_rows(out)) + sum(len(r["sample_ids"]) for r in bucket_rows)
    assert packed == sum(a["segments"] for a in manifest["accounting"].values())


def test_a_conversation_split_cannot_cut_is_rejected_saying_why(tmp_path, write_config, write_jsonl):
    """truncation: split keeps plain text only; a chat too long for it is too_long with split's own reason,
    not the line of truncation: drop, which the config did not choose."""
    import json

    config = two_chat_sources(
        tmp_path, write_config, write_jsonl, truncation={"strategy": "split"}, capacity=64, max_reject_share=1
    )
    build(config, use_cache=False)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    too_long = [r for r in rejects if r["reason"] == "too_long"]
    assert too_long and all("strategy 'split' applies to plain text" in r["detail"] for r in too_long)
    assert not any("truncation: drop" in r["detail"] for r in rejects)
