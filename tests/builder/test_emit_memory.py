"""Emit and the plan keep at most the store file they are reading mapped (issue 43). A packed shard draws its samples
from across the whole store, and the kernel maps page cache in large folios, so reading a shard in pack order kept
every partition's pages mapped (the process's RssFile, ~1 KB a sample at -j 1); the plan's column reads kept the
pages of every partition's columns mapped to its end (831 MB of RssFile at 10M samples). What is pinned is the
kernel's count of the store maps' resident pages (/proc/self/smaps), per map."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import QUICKSTART, chat_rows

import packtool.builder as builder_module
import packtool.builder.emit as emit_module
import packtool.builder.plan as plan_module
from packtool.builder import build
from packtool.builder.store import PartitionReader
from packtool.config import load_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
FILES = 6  # input files, so store partitions: without the fix a shard maps pages of all of them at once


def resident_kb(paths: set[str]) -> dict[str, int]:
    """The resident kB of this process's maps of `paths` (/proc/self/smaps: a map's header line, then its Rss)."""
    found: dict[str, int] = {}
    path = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            path = fields[5] if len(fields) >= 6 and fields[5] in paths else None
        elif path is not None and fields[0] == "Rss:":
            found[path] = found.get(path, 0) + int(fields[1])
    return found


def serial_build(write_config, write_jsonl, **settings):
    """A config of FILES input files (so FILES store partitions), built by the serial executor in this process."""
    for f in range(FILES):
        write_jsonl(chat_rows(150, 40, f"f{f}-"), f"{f}.jsonl")
    raw = {
        "sources": [{"name": "a", "path": "*.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        **settings,
    }
    return load_config(write_config(raw), workers="1")


def test_a_shard_keeps_one_store_file_mapped_at_a_time(tmp_path, write_config, write_jsonl, monkeypatch):
    config = serial_build(write_config, write_jsonl, rows_per_shard=40)  # the serial executor emits in this process
    while_reading: list[dict[str, int]] = []  # the maps' resident kB each time a reader's pages are dropped
    after_shard: list[int] = []
    drop_pages = PartitionReader.drop_pages

    def dropping(reader):
        while_reading.append(resident_kb(set(emit_module._READERS)))
        drop_pages(reader)

    def emit_item(item):
        result = emit_module.emit_item(item)
        after_shard.append(sum(resident_kb(set(emit_module._READERS)).values()))
        return result

    monkeypatch.setattr(PartitionReader, "drop_pages", dropping)
    monkeypatch.setattr(builder_module, "emit_item", emit_item)
    build(config, use_cache=False)
    assert len(after_shard) > 3 and while_reading
    mapped = [sum(kb > 0 for kb in resident.values()) for resident in while_reading]
    # the file just read, the next (its first row read) and pieces.arrow (its footer, read on opening), never all
    assert max(mapped) <= 3 < FILES, mapped
    assert after_shard == [0] * len(after_shard)


def test_the_plan_drops_each_partitions_pages_once_its_columns_are_read(
    tmp_path, write_config, write_jsonl, monkeypatch
):
    config = serial_build(write_config, write_jsonl)
    fit = plan_module._fit
    at_fit: list[dict[str, int]] = []  # the store maps' resident kB as the fit starts, every column read by then

    def fitting(config, stored, *args):
        at_fit.append(resident_kb({str(reader.path) for reader in stored.readers}))
        return fit(config, stored, *args)

    monkeypatch.setattr(plan_module, "_fit", fitting)
    build(config, use_cache=False)
    assert len(at_fit) == 1 and len(at_fit[0]) == FILES, at_fit  # each partition mapped (and read) by then
    assert sum(at_fit[0].values()) == 0, at_fit  # ... and none of its pages resident in this process
