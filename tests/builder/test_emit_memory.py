"""Emit's token-store maps hold no page past the shard that read it (issue 43): the readers stay open across the
shards a process writes, and each page a shard read stayed mapped (the process's RssFile) until emit ended, ~1 KB
a sample of the whole build. What is pinned is the kernel's count of the maps' resident pages, per map."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import QUICKSTART, chat_rows

import packtool.builder as builder_module
import packtool.builder.emit as emit_module
from packtool.builder import build
from packtool.config import load_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def resident_kb(paths: set[str]) -> int:
    """The resident kB of this process's maps of `paths` (/proc/self/smaps: a map's header line, then its Rss)."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            mine = len(fields) >= 6 and fields[5] in paths
        elif mine and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_no_token_store_page_stays_mapped_after_a_shard(tmp_path, write_config, write_jsonl, monkeypatch):
    write_jsonl(chat_rows(600, 40, "a"), "a.jsonl")
    raw = {
        "sources": [{"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "rows_per_shard": 20,
        "output": "out",
    }
    config = load_config(write_config(raw), workers="1")  # the serial executor emits in this process
    after: list[tuple[int, int]] = []  # per shard: the maps open, their resident kB

    def emit_item(item):
        result = emit_module.emit_item(item)
        after.append((len(emit_module._READERS), resident_kb(set(emit_module._READERS))))
        return result

    monkeypatch.setattr(builder_module, "emit_item", emit_item)
    build(config, use_cache=False)
    assert len(after) > 3 and all(maps for maps, _ in after)
    assert [kb for _, kb in after] == [0] * len(after)
