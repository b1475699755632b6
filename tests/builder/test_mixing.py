"""Source mixing (builder.mixing): multipliers from weights, repeats that keep their ids, token shares."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import shard_rows, two_chat_sources

from packtool.builder import build
from packtool.builder.mixing import source_multipliers


def test_source_multipliers():
    assert source_multipliers({"a": 100, "b": 50}, {"a": 1000, "b": 5000}, {"a": 2.0, "b": 0.5}, "multiplier") == {
        "a": 2.0,
        "b": 0.5,
    }
    shares = source_multipliers({"a": 100, "b": 50}, {"a": 1000, "b": 5000}, {"a": 1.0, "b": 1.0}, "samples")
    assert shares == pytest.approx({"a": 0.75, "b": 1.5})  # 75 + 75 samples: equal sample shares
    tokens = source_multipliers({"a": 100, "b": 50}, {"a": 1000, "b": 5000}, {"a": 1.0, "b": 1.0}, "tokens")
    assert tokens["a"] * 1000 == pytest.approx(tokens["b"] * 5000)


def test_mixing_repeats_keep_ids_and_realize_weights(tmp_path, write_config, write_jsonl):
    config = two_chat_sources(tmp_path, write_config, write_jsonl, source_0_weight=2.5, source_1_weight=0.5)
    manifest = build(config).manifest
    rows = shard_rows(Path(config.run.output))
    copies = [(sid, rep) for r in rows for sid, rep in zip(r["sample_ids"], r["sample_repeats"])]
    a = [c for c in copies if c[0].startswith("a")]
    b = [c for c in copies if c[0].startswith("b")]
    assert len(a) == 100 and len(b) == 10  # 40 x 2.5 and 20 x 0.5
    assert len(set(a)) == len(a)  # each copy is a distinct (id, repeat) segment
    assert sorted({rep for _, rep in a}) == [0, 1, 2]
    assert manifest["stats"]["sources"]["a"]["repeats"] == 60
    assert build(config).manifest["stats"] == manifest["stats"]  # seeded: the same copies every time


def test_token_share_mixing(tmp_path, write_config, write_jsonl):
    config = two_chat_sources(tmp_path, write_config, write_jsonl, mixing={"by": "tokens"})
    stats = build(config).manifest["stats"]["sources"]
    assert stats["a"]["token_share"] == pytest.approx(0.5, abs=0.03)
    assert stats["b"]["token_share"] == pytest.approx(0.5, abs=0.03)
