"""Builds with preference pairs and completion groups (issue 13): schema v2 end to end.

The DPO build reads the two LLaMA-Factory demo files with Qwen2.5's template; the group build reads
a small synthetic file. Both must verify, and the tools must see pairs and groups.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support import QUICKSTART, shared

from packtool.builder import build
from packtool.cli import main
from packtool.commands.find import find
from packtool.commands.show import inspect_json
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.format import read_manifest
from packtool.packing_items import KIND_CODES


@pytest.fixture(scope="module")
def dpo_build(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpo")
    config = {
        "sources": [
            {"name": "en", "path": str(shared("datasets", "llamafactory_dpo_en_demo.json")), "format": "preference"},
            {"name": "zh", "path": str(shared("datasets", "llamafactory_dpo_zh_demo.json")), "format": "preference"},
        ],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "template": "model",
        "capacity": 1024,
        "output": str(folder / "out"),
        "workers": 1,
    }
    (folder / "config.yaml").write_text(json.dumps(config), encoding="utf-8")
    build(load_config(folder / "config.yaml"))
    return folder / "out"


def _rows(out: Path) -> list[dict]:
    return [row for s in read_manifest(out).shards for row in pq.read_table(s.file).to_pylist()]


def test_dpo_demo_build_verifies_with_every_pair_whole_in_one_pack(dpo_build):
    result = verify(dpo_build)
    assert result.ok, result.problems
    manifest = read_manifest(dpo_build).raw
    assert manifest["schema_version"] == 2 and manifest["kind_codes"] == KIND_CODES
    assert manifest["truncation"]["items"] == "left"
    sides: dict[int, list[tuple[int, str]]] = {}
    for row in _rows(dpo_build):
        for kind, group, sample_id in zip(row["segment_kinds"], row["segment_groups"], row["sample_ids"]):
            sides.setdefault(group, []).append((kind, sample_id))
    # every group is one chosen and one rejected side of the same record, never alone in a pack
    assert all(sorted(k for k, _ in v) == [1, 2] and v[0][1] == v[1][1] for v in sides.values())
    for name in ("en", "zh"):
        a = manifest["accounting"][name]
        assert a["read"] == 300 and a["pairs"] == a["kept"] and a["segments"] == 2 * a["kept"]
        assert a["kept"] + a["dropped"].get("pair_too_long", 0) == 300
    assert len(sides) == manifest["accounting"]["en"]["pairs"] + manifest["accounting"]["zh"]["pairs"]
    kinds = manifest["stats"]["kinds"]
    assert kinds["pairs"] == len(sides) and kinds["groups"] == 0
    assert kinds["per_kind"]["chosen"]["segments"] == kinds["per_kind"]["rejected"]["segments"] == len(sides)
    rejects = [json.loads(line) for line in (dpo_build / "rejects.jsonl").read_text().splitlines()]
    assert {r["reason"] for r in rejects} <= {"pair_too_long"}
    assert len(rejects) == 600 - len(sides)


def test_inspect_stats_and_find_see_pairs(dpo_build):
    pack = inspect_json(dpo_build, row=0, limit=1, text=False)["packs"][0]
    items = [d["item"] for d in pack["documents"]]
    assert [i["kind"] for i in items[:2]] == ["chosen", "rejected"] and items[0]["group"] == items[1]["group"]
    shown = CliRunner().invoke(main, ["inspect", str(dpo_build), "--no-text", "-n", "1", "--no-color"])
    assert shown.exit_code == 0 and f"chosen of group {items[0]['group']}" in shown.output
    stats = CliRunner().invoke(main, ["stats", str(dpo_build)])
    assert stats.exit_code == 0 and f"pairs {len(_pairs(dpo_build)):,}" in stats.output
    trace = find(dpo_build, pack["documents"][0]["sample_id"])
    assert sorted(p.item.split(" of ")[0] for p in trace.placements) == ["chosen", "rejected"]
    assert all(p.piece == "" for p in trace.placements)


def _pairs(out: Path) -> set[int]:
    return {g for row in _rows(out) for g in row["segment_groups"]}


def test_verify_catches_a_split_pair(dpo_build, tmp_path):
    import shutil

    import pyarrow as pa

    copy = tmp_path / "copy"
    shutil.copytree(dpo_build, copy)
    shard = copy / "shard-00000.parquet"
    table = pq.read_table(shard)
    kinds = table["segment_kinds"].to_pylist()
    kinds[0] = [2] * len(kinds[0])  # every side of pack 0 claims to be rejected
    table = table.set_column(
        table.schema.get_field_index("segment_kinds"), "segment_kinds", pa.array(kinds, pa.list_(pa.int8()))
    )
    pq.write_table(table, shard)
    problems = verify(copy).problems
    assert any("row 0" in p and "not a pair or a group" in p for p in problems)


def test_group_build_keeps_completions_with_their_rewards(tmp_path, write_config):
    records = [
        {"prompt": "2+2?", "completions": ["4", "5", "four"], "rewards": [1.0, 0.0, 0.5]},
        {
            "prompt": [{"role": "user", "content": "Name a colour."}],
            "completions": ["red", "blue"],
            "advantages": [0.3, -0.3],
        },
        {"prompt": "word " * 200, "completions": ["a", "b"]},  # no room even with the prompt cut to one token: dropped
        {"prompt": "x", "completions": []},  # a bad record
    ]
    (tmp_path / "groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    config = {
        "sources": [
            {"name": "rl", "path": "groups.jsonl", "format": "group"},
            {"name": "chat", "path": "chat.jsonl", "format": "messages"},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "template": "chatml",
        "capacity": 64,
        "truncation": {"strategy": "right", "items": "drop"},
        "packing": {"strategy": "bfd", "shuffle": False},
        "on_error": "skip",
        "max_reject_share": 1.0,
        "output": "out",
        "workers": 1,
    }
    build(load_config(write_config(config)))
    out = tmp_path / "out"
    assert verify(out).ok, verify(out).problems
    manifest = read_manifest(out).raw
    rl = manifest["accounting"]["rl"]
    assert (rl["read"], rl["groups"], rl["segments"]) == (4, 2, 5)
    assert rl["dropped"] == {"group_too_long": 1} and sum(rl["rejected"].values()) == 1
    by_group: dict[int, list[tuple[int, int, float, float]]] = {}
    singles = 0
    for row in _rows(out):
        for g, k, i, r, a in zip(
            row["segment_groups"],
            row["segment_kinds"],
            row["completion_index"],
            row["segment_rewards"],
            row["segment_advantages"],
        ):
            if g < 0:
                singles += 1
                assert k == KIND_CODES["single"] and math.isnan(r) and math.isnan(a)
            else:
                by_group.setdefault(g, []).append((k, i, r, a))
    assert singles == 1
    groups = sorted(by_group.values(), key=len, reverse=True)
    assert [(k, i) for k, i, _, _ in groups[0]] == [(3, 0), (3, 1), (3, 2)]
    assert [r for _, _, r, _ in groups[0]] == [1.0, 0.0, 0.5] and all(math.isnan(a) for *_, a in groups[0])
    assert [a for *_, a in groups[1]] == [0.3, -0.3]
    assert (
        manifest["stats"]["kinds"]["groups"] == 2
        and manifest["stats"]["kinds"]["per_kind"]["completion"]["segments"] == 5
    )


def test_a_plain_build_stays_schema_v1(tmp_path, write_config):
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    config = {
        "sources": [{"name": "chat", "path": "chat.jsonl", "format": "messages"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "template": "chatml",
        "capacity": 64,
        "output": "out",
        "workers": 1,
    }
    build(load_config(write_config(config)))
    manifest = read_manifest(tmp_path / "out").raw
    assert manifest["schema_version"] == 1 and "kind_codes" not in manifest and "kinds" not in manifest["stats"]
    assert "segment_groups" not in pq.read_schema(tmp_path / "out" / "shard-00000.parquet").names


def test_a_group_with_more_segments_than_max_segments_is_one_line(tmp_path, write_config):
    (tmp_path / "groups.jsonl").write_text(json.dumps({"prompt": "q", "completions": ["a", "b", "c"]}) + "\n")
    config = {
        "sources": [{"name": "rl", "path": "groups.jsonl", "format": "group"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "template": "chatml",
        "capacity": 64,
        "packing": {"strategy": "bfd", "max_segments": 2},
        "output": "out",
        "workers": 1,
    }
    result = CliRunner().invoke(main, ["build", str(write_config(config))])
    assert result.exit_code == 1 and "packing.max_segments 2 < 3" in result.output
    assert "Traceback" not in result.output


def test_held_out_pairs_stay_whole_in_the_validation_split(tmp_path, write_config):
    config = {
        "sources": [
            {
                "name": "en",
                "path": str(shared("datasets", "llamafactory_dpo_en_demo.json")),
                "format": "preference",
                "max_samples": 24,
            }
        ],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "template": "model",
        "capacity": 2048,
        "validation": {"share": 0.3},
        "output": "out",
        "workers": 1,
    }
    build(load_config(write_config(config)))
    out = tmp_path / "out"
    assert verify(out).ok, verify(out).problems
    held = _rows(out / "validation")
    assert held, "the seed holds out no pair; pick another share"
    sides: dict[int, list[int]] = {}
    for row in held:
        for g, k in zip(row["segment_groups"], row["segment_kinds"]):
            sides.setdefault(g, []).append(k)
    assert all(sorted(k) == [1, 2] for k in sides.values())
    ids = {i for row in held for i in row["sample_ids"]}
    assert not ids & {i for row in _rows(out) for i in row["sample_ids"]}  # no pair on both sides of the split


def test_a_second_build_in_one_process_fits_pairs_to_its_own_capacity(tmp_path, write_config):
    """The process keeps its loaded tokenizer and template between builds (a notebook, a Ray worker), but
    never the first build's capacity: pairs are cut while encoding, to the capacity of the build at hand."""
    source = {"name": "en", "path": str(shared("datasets", "llamafactory_dpo_en_demo.json")), "format": "preference"}
    common = {"tokenizer": str(shared("tokenizers", "qwen2.5")), "template": "model", "workers": 1}
    build(
        load_config(
            write_config(
                {**common, "sources": [{**source, "max_samples": 8}], "capacity": 2048, "output": "wide"}, "wide.yaml"
            )
        )
    )
    narrow = {
        **common,
        "sources": [{**source, "max_samples": 16}],
        "capacity": 512,
        "output": "narrow",
        "max_reject_share": 1.0,
    }
    manifest = build(load_config(write_config(narrow, "narrow.yaml"))).manifest
    assert manifest["accounting"]["en"]["truncated"]["left"]["samples"] > 0  # pairs were cut to 512, not 2048
    assert verify(tmp_path / "narrow").ok
    for row in _rows(tmp_path / "narrow"):
        assert len(row["input_ids"]) <= 512
        for group in set(row["segment_groups"]):
            sides = [k for k, g in zip(row["segment_kinds"], row["segment_groups"]) if g == group]
            assert sorted(sides) == [1, 2]  # both sides of every pair, each cut to fit
