"""Per-source quotas in tokens or target tokens: met within one sample, deterministic, repeats counted."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from support import QUICKSTART, three_real_sources

from packtool.builder import build
from packtool.builder.mixing import MAX_COPIES, quota_misses, quota_plan, repeat_plan
from packtool.cli import main
from packtool.commands.stats import format_stats
from packtool.config import ConfigError, Quota, load_config
from packtool.errors import BuildError
from packtool.shards import locate
from packtool.summaries import summarize


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
        ({"tokens": -5}, "quota.tokens: must be between 1"),
        ({"tokens": 1.0e13}, "quota.tokens: expected an integer, got float"),
        ({"tokens": True}, "quota.tokens: expected an integer, got True"),
        ({"target_tokens": None}, "give exactly one of target_tokens, tokens|quota.target_tokens: is required"),
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


def test_a_quota_too_large_to_plan_is_refused_before_it_is_allocated():
    """10**13 target tokens is inside the config's range; on 3 samples of ~4 it once asked numpy for terabytes."""
    with pytest.raises(BuildError, match=r"source 'chat': quota 10,000,000,000,000 \(12 a pass\) needs "):
        quota_plan(np.array([5, 3, 4]), 10**13, seed=0, source="chat")
    with pytest.raises(BuildError, match=rf"over the {MAX_COPIES:,} a plan holds in memory"):
        repeat_plan(10, 1e12, seed=0, source="chat")  # a weight of 1e12 with mixing.by: multiplier
    with pytest.raises(BuildError, match=r"weight 1e\+308 needs 1\.00e\+309 copies of its 10 samples"):
        repeat_plan(10, 1e308, seed=0, source="chat")  # h37: the count was a line of 309 digits
    positions, _ = quota_plan(np.ones(10, np.int64), MAX_COPIES, seed=0)  # the limit itself is planned
    assert len(positions) == MAX_COPIES


def test_a_large_source_taken_once_or_down_sampled_is_never_refused():
    n = MAX_COPIES + 5
    assert len(repeat_plan(n, 0.5, seed=0)[0]) == round(n / 2)


def test_quota_misses_name_realized_asked_and_the_tolerance():
    quotas = {"docs": Quota("target_tokens", 50_000), "web": Quota("tokens", 100)}
    realized = {"web": {"tokens": 130, "targets": 0}}  # web met (within one sample); docs kept nothing
    assert quota_misses(quotas, realized) == [
        "quota 'docs' missed: realized 0 of 50,000 target_tokens (short by 50,000; a quota is met within one "
        "sample); the source holds none in OUT: see packtool stats"
    ]
    assert quota_misses({"web": Quota("tokens", 200)}, realized) == [
        "quota 'web' missed: realized 130 of 200 tokens (short by 70; a quota is met within one sample)"
    ]


def _rejected_source(tmp_path, write_config, write_jsonl, **settings):
    """Source a (kept) and source b (a quota, every record rejected: no `messages` field)."""
    write_jsonl(
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c"}]}] * 4, "a.jsonl"
    )
    write_jsonl([{"text": "not a conversation"}] * 3, "b.jsonl")
    raw = {
        "sources": [
            {"name": "a", "path": "a.jsonl", "format": "messages"},
            {"name": "b", "path": "b.jsonl", "format": "messages", "quota": {"target_tokens": 50_000}},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": str(tmp_path / "out"),
        "on_error": "skip",
        "max_reject_share": 1.0,
        "workers": 1,
        **settings,
    }
    return write_config(raw)


def test_a_quota_no_record_could_meet_is_a_warning_in_the_build_summary(tmp_path, write_config, write_jsonl):
    config = _rejected_source(tmp_path, write_config, write_jsonl)
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert result.exit_code == 0, result.output
    warning = (
        "warning: quota 'b' missed: realized 0 of 50,000 target_tokens (short by 50,000; a quota is met within one "
        "sample); the source holds none in OUT: see packtool stats; --strict makes this an error"
    )
    assert warning in result.output.splitlines()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["mixing"]["quotas"]["b"]["amount"] == 50_000


@pytest.mark.parametrize("how", [["--strict"], ["--set", "on_quota_miss=fail"]])
def test_a_missed_quota_fails_a_strict_build_and_publishes_nothing(tmp_path, write_config, write_jsonl, how):
    config = _rejected_source(tmp_path, write_config, write_jsonl)
    result = CliRunner().invoke(main, ["build", str(config), "-q", *how])
    assert result.exit_code == 1 and "Traceback" not in result.output
    if how == ["--strict"]:  # --strict fails on the lost records first, before any shard is written
        assert "source 'b' lost 3 of 3 records" in result.output
    else:
        assert "Error: quota 'b' missed: realized 0 of 50,000 target_tokens" in result.output
        assert "nothing was published (on_quota_miss: fail, as --strict sets)" in result.output
    assert not (tmp_path / "out").exists()


def test_strict_fails_on_a_quota_whose_samples_all_went_to_overflow(tmp_path, write_config, write_jsonl):
    """No record lost, so max_reject_share 0 passes it; every sample of b is over capacity and goes whole to
    OUT/overflow/, so OUT holds none of b: the quota is what --strict catches."""
    config = _rejected_source(tmp_path, write_config, write_jsonl, overflow="bucket")
    long = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 200}]}
    write_jsonl([long] * 3, "b.jsonl")
    result = CliRunner().invoke(main, ["build", str(config), "-q", "--strict"])
    assert result.exit_code == 1 and "Error: quota 'b' missed: realized 0 of 50,000 target_tokens" in result.output
    assert not (tmp_path / "out").exists()


def test_on_quota_miss_takes_warn_or_fail(write_config, write_jsonl):
    data = write_jsonl([{"text": "hello"}])
    raw = {"sources": [{"name": "a", "path": str(data), "format": "text"}], "output": "out", "on_quota_miss": "ignore"}
    with pytest.raises(ConfigError, match="on_quota_miss: 'ignore' is not one of warn, fail"):
        load_config(write_config(raw))
