"""Per-source quotas in tokens or target tokens: met within one sample, deterministic, repeats counted."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import three_real_sources

from packtool.builder import build
from packtool.builder.mixing import quota_plan
from packtool.config import ConfigError, Quota, load_config
from packtool.shards import locate
from packtool.stats import format_stats, summarize


def test_quota_plan_example():
    positions, repeats = quota_plan(np.array([5, 3, 4]), 20, seed=0)
    assert positions[:3].tolist() == [0, 1, 2] and repeats.tolist() == [0, 0, 0, 1, 1]
    total = int(np.array([5, 3, 4])[positions].sum())
    assert 20 <= total < 20 + 5


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 5000), st.integers(0, 2**32))
def test_quota_is_met_within_one_sample(amounts, quota, seed):
    amounts = np.array(amounts, dtype=np.int64)
    positions, repeats = quota_plan(amounts, quota, seed=seed)
    total = int(amounts[positions].sum())
    last_pass = positions[repeats == repeats.max()]
    assert quota <= total and total - amounts[last_pass].max() < quota  # within one sample
    for k in range(int(repeats.max())):  # whole passes before the last: every sample once
        assert sorted(positions[repeats == k].tolist()) == list(range(len(amounts)))
    assert len(set(last_pass.tolist())) == len(last_pass)  # a sample at most once per pass
    again = quota_plan(amounts, quota, seed=seed)
    assert all((a == b).all() for a, b in zip(again, (positions, repeats), strict=True))  # deterministic


@pytest.mark.parametrize(
    ("quota", "message"),
    [
        ({"target_tokens": 10, "tokens": 10}, "give exactly one of target_tokens, tokens"),
        ({"samples": 10}, "quota.samples: unknown key"),
        ({"tokens": 0}, "quota.tokens: must be between 1"),
        ({"tokens": "many"}, "quota.tokens: expected"),
    ],
)
def test_bad_quotas_are_reported(write_config, write_jsonl, quota, message):
    data = write_jsonl([{"text": "hello"}])
    raw = {"sources": [{"name": "a", "path": str(data), "format": "text", "quota": quota}], "output": "out"}
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(raw))


def test_quota_and_weight_exclude_each_other(write_config, write_jsonl):
    data = write_jsonl([{"text": "hello"}])
    source = {"name": "a", "path": str(data), "format": "text", "quota": {"tokens": 10}, "weight": 2}
    with pytest.raises(ConfigError, match="a source with a quota takes as many copies as the quota needs"):
        load_config(write_config({"sources": [source], "output": "out"}))


def test_three_real_sources_meet_their_quotas(tmp_path, write_config):
    """Down-sampled (code alpaca), up-sampled (a small chat set) and split documents (c4), on a real tokenizer."""
    quotas = {
        "code": Quota("target_tokens", 40_000),
        "chat": Quota("target_tokens", 150_000),
        "web": Quota("tokens", 90_000),
    }
    raw = three_real_sources({name: {quota.unit: quota.amount} for name, quota in quotas.items()}, tmp_path / "out")
    config = load_config(write_config(raw))
    manifest = build(config).manifest
    assert manifest["mixing"]["quotas"]["web"] == {"unit": "tokens", "amount": 90_000}
    _, stored, files = locate(tmp_path / "out")
    stats = summarize(files, stored)
    largest = _largest_document(tmp_path / "out")
    for name, quota in quotas.items():
        unit = "targets" if quota.unit == "target_tokens" else "tokens"
        realized = stats["sources"][name][unit]
        assert quota.amount <= realized < quota.amount + largest[name][unit], (name, realized)
    assert stats["sources"]["chat"]["repeats"] > 0 and stats["sources"]["code"]["repeats"] == 0
    realized = stats["sources"]["web"]["tokens"]
    assert f"quota web: 90,000 tokens, realized {realized:,}" in format_stats(stats)
    rebuilt = build(load_config(write_config({**raw, "output": str(tmp_path / "again")}))).manifest
    assert [s["sha256"] for s in rebuilt["shards"]] == [s["sha256"] for s in manifest["shards"]]


def _largest_document(folder):
    """Per source, the largest document's tokens and targets in the shards (one sample's worth)."""
    largest: dict[str, dict[str, int]] = {}
    for shard in sorted(folder.glob("shard-*.parquet")):
        for row in pq.read_table(shard, columns=["sources", "doc_cu_seqlens", "labels"]).to_pylist():
            labels = np.array(row["labels"])
            for d, source in enumerate(row["sources"]):
                a, b = row["doc_cu_seqlens"][d], row["doc_cu_seqlens"][d + 1]
                entry = largest.setdefault(source, {"tokens": 0, "targets": 0})
                entry["tokens"] = max(entry["tokens"], b - a)
                entry["targets"] = max(entry["targets"], int((labels[a:b] != -100).sum()))
    return largest
