"""What a build allocates after its shards are written (issue 43). The canary selection reads up to MAX_PACKS
packs: their tokens stay numpy views of the shards' columns, never Python ints (as lists, the selection of a
build of capacity 2048 peaked at ~300 MB). Sizes, not times; the phases at scale are bench/scale_bench.py."""

from __future__ import annotations

import tracemalloc

from support import QUICKSTART, chat_rows

import packtool.builder.manifest as manifest_module
from packtool.builder import build
from packtool.canaries import MAX_PACKS, choose_canaries
from packtool.config import load_config

SMALL, LARGE = 200, 1600
CAPACITY = 256
# bytes the selection allocates at most per token it reads (Python lists of the token columns: ~90); ~3 now
PEAK_PER_TOKEN = 8


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
