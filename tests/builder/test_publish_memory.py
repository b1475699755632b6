"""What a build allocates after its shards are written (issue 43). The canary selection reads up to MAX_PACKS
packs: their tokens stay numpy views of the shards' columns, never Python ints (as lists, the selection of a
build of capacity 2048 peaked at ~300 MB), and only the documents of records with an empty field are remembered
for the empty_field canary. The stats pass reads every shard and keeps nothing per document.
Sizes, not times; the phases at scale are bench/scale_bench.py."""

from __future__ import annotations

import tracemalloc

import pytest
from support import QUICKSTART, chat_rows

import packtool.builder.manifest as manifest_module
from packtool.builder import build
from packtool.canaries import MAX_PACKS, choose_canaries
from packtool.config import load_config
from packtool.format import read_manifest
from packtool.summaries import summarize

SMALL, LARGE = 200, 1600
CAPACITY = 256
# bytes the selection allocates at most per token it reads: Python lists of the token columns were ~90, then a
# document record kept per sample hash (for empty_field) 3.3; ~0 now (only the empty-field records' hashes are kept)
PEAK_PER_TOKEN = 1
# bytes the stats pass allocates at most per document read beyond the first shards (48-108 before, 0.3-0.8 now:
# the interleave windows' totals, 8 B a source per window of packs, and their copies as the stats are made)
PEAK_PER_DOCUMENT = 4


def selected(tmp_path, write_config, write_jsonl, samples: int, monkeypatch) -> tuple[int, int]:
    """A build of `samples` chats: tracemalloc's peak while it chose its canaries, and the tokens of its shards."""
    (tmp_path / str(samples)).mkdir()
    write_jsonl(chat_rows(samples, 30, "a"), f"{samples}/a.jsonl")
    raw = {
        "sources": [{"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": CAPACITY,
        "output": "out",
    }
    config = load_config(write_config(raw, f"{samples}/config.yaml"), workers="1")
    peaks = []

    def traced(*args, **kwargs):
        tracemalloc.start()
        try:
            chosen = choose_canaries(*args, **kwargs)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        return chosen

    monkeypatch.setattr(manifest_module, "choose_canaries", traced)
    stats = build(config, use_cache=False).manifest["stats"]
    assert stats["packs"] < MAX_PACKS  # every pack is read
    return peaks[0], stats["tokens"]


def test_canary_selection_keeps_no_python_object_per_token(tmp_path, write_config, write_jsonl, monkeypatch):
    selected(tmp_path, write_config, write_jsonl, 50, monkeypatch)  # the first selection's imports and caches
    small_peak, small_tokens = selected(tmp_path, write_config, write_jsonl, SMALL, monkeypatch)
    large_peak, large_tokens = selected(tmp_path, write_config, write_jsonl, LARGE, monkeypatch)
    per_token = (large_peak - small_peak) / (large_tokens - small_tokens)
    assert per_token < PEAK_PER_TOKEN, (per_token, small_tokens, large_tokens)


# Two outputs of short documents: chats in interleave windows, and completion groups beside chats (pairs and
# groups cannot be interleaved), each read by the stats pass 2 then 16 times over.
STATS_OUTPUTS = {
    "interleaved": {"mixing": {"by": "samples", "interleave": {"window": 8, "tolerance": 0.5}}},
    "groups": {"template": "chatml"},
}


@pytest.mark.parametrize("output", sorted(STATS_OUTPUTS))
def test_stats_pass_holds_nothing_per_document(output, tmp_path, write_config, write_jsonl):
    """summarize reads one shard at a time and keeps histograms, window totals and counts, never a value per
    document or per pack: reading the same shards 8 times over allocates no more per document than once (the
    lengths kept for the percentiles, each document's pack and amounts for the interleave windows and a set of
    group ids: 48 B a document here with groups, 108 interleaved, ~0.5-1 GB at 10M samples; issue 43)."""
    write_jsonl(chat_rows(900, 1, "a"), "a.jsonl")
    sources = [{"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}}]
    if output == "groups":
        groups = [
            {"prompt": f"question {i}?", "completions": ["yes", "no", "maybe" + " so" * (i % 4)]} for i in range(100)
        ]
        write_jsonl(groups, "groups.jsonl")
        sources.append({"name": "rl", "path": "groups.jsonl", "format": "group"})
    else:
        write_jsonl(chat_rows(300, 4, "b"), "b.jsonl")
        sources.append({"name": "b", "path": "b.jsonl", "format": "messages", "fields": {"id": "id"}})
    raw = {
        "sources": sources,
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "rows_per_shard": 16,
        "row_group_rows": 16,
        "output": "out",
        **STATS_OUTPUTS[output],
    }
    build(load_config(write_config(raw), workers="1"), use_cache=False)
    manifest = read_manifest(tmp_path / "out")
    files = [entry.file for entry in manifest.shards]
    once = summarize(files, manifest)  # and the first pass's imports and caches
    assert len(files) > 4 and once["segments"] > 300
    assert once["kinds"]["groups"] == 100 if output == "groups" else once["interleave"]["windows"] > 4

    def traced(times: int) -> tuple[int, dict]:
        tracemalloc.start()
        try:
            stats = summarize(files * times, manifest)
            return tracemalloc.get_traced_memory()[1], stats
        finally:
            tracemalloc.stop()

    small_peak, small = traced(2)
    large_peak, large = traced(16)
    assert large["segments"] == 16 * once["segments"]
    assert large["sources"]["a"]["segment_lengths"]["p90"] == once["sources"]["a"]["segment_lengths"]["p90"]
    per_document = (large_peak - small_peak) / (large["segments"] - small["segments"])
    assert per_document < PEAK_PER_DOCUMENT, (per_document, small_peak, large_peak)
