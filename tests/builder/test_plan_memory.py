"""The plan holds its samples in numpy arrays, not as Python objects (issue 43): what it allocates grows by a
bounded number of bytes per sample and by no Python object per sample. Sizes, not times; the per-phase
breakdown at scale is bench/scale_bench.py --only trace."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
from support import QUICKSTART, chat_rows

import packtool.builder as builder_module
from packtool.builder import build
from packtool.builder.plan import make_plan
from packtool.builder.store import BATCH_ROWS, PartitionReader, PartitionWriter
from packtool.config import load_config
from packtool.records import Tokenized

SMALL, LARGE = 500, 4000
HELD_PER_SAMPLE = 160  # bytes the plan keeps per sample (its arrays: ref, repeat, length, members, lengths); ~55 now
PEAK_PER_SAMPLE = 300  # bytes the plan phase allocates at most per sample, arrays being built included; ~145 now
# Python objects (gc-tracked) the plan keeps per sample: none. One per sample reads 1.0; a few dozen objects made
# once in the process (a cache, a lazy import) read up to ~0.011 between these sizes (seen in CI), hence 0.1
OBJECTS_PER_SAMPLE = 0.1


def planned(tmp_path, write_config, write_jsonl, samples: int, monkeypatch) -> dict[str, int]:
    """A build of `samples` chats (two sources); what its make_plan call held, peaked at and kept as objects."""
    folder = tmp_path / str(samples)
    folder.mkdir()
    write_jsonl(chat_rows(samples // 2, 8, "a"), f"{samples}/a.jsonl")
    write_jsonl(chat_rows(samples - samples // 2, 20, "b"), f"{samples}/b.jsonl")
    raw = {
        "sources": [
            {"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}},
            {"name": "b", "path": "b.jsonl", "format": "messages", "fields": {"id": "id"}, "weight": 1.5},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
    }
    config = load_config(write_config(raw, f"{samples}/config.yaml"), workers="1")
    measured: dict[str, int] = {}

    def traced(*args):
        gc.collect()
        objects = len(gc.get_objects())
        tracemalloc.start()
        try:
            plan = make_plan(*args)
            held, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        gc.collect()
        measured.update(held=held, peak=peak, objects=len(gc.get_objects()) - objects)
        return plan

    monkeypatch.setattr(builder_module, "make_plan", traced)
    manifest = build(config, use_cache=False).manifest
    assert sum(a["read"] for a in manifest["accounting"].values()) == samples
    return measured


def test_the_plan_holds_arrays_not_an_object_per_sample(tmp_path, write_config, write_jsonl, monkeypatch):
    planned(tmp_path, write_config, write_jsonl, 100, monkeypatch)  # the first plan's imports and caches
    small = planned(tmp_path, write_config, write_jsonl, SMALL, monkeypatch)
    large = planned(tmp_path, write_config, write_jsonl, LARGE, monkeypatch)
    per_sample = {key: (large[key] - small[key]) / (LARGE - SMALL) for key in small}
    assert per_sample["held"] < HELD_PER_SAMPLE, per_sample
    assert per_sample["peak"] < PEAK_PER_SAMPLE, per_sample
    assert per_sample["objects"] < OBJECTS_PER_SAMPLE, per_sample


def test_reading_a_partition_row_by_row_keeps_no_id_or_hash(tmp_path):
    """Emit reads ids and hashes row by row from the mapped columns; a process that wrote every shard holds
    none of them afterwards (a per-batch list of them once held every sample's id and hash)."""
    writer = PartitionWriter(tmp_path / "part.arrow", "a")
    ids = [f"a:{i}-{'x' * (i % 9)}" for i in range(2 * BATCH_ROWS + 5)]
    for i, example_id in enumerate(ids):
        tokens = np.arange(1, 4, dtype=np.int32)
        sample = Tokenized(
            example_id, "a", f"{i:032x}", tokens, np.ones(3, bool), np.zeros(3, np.int8), np.zeros(3, np.int16)
        )
        writer.append(sample, f"f.jsonl:{i + 1}", i)
    writer.close()
    reader = PartitionReader(tmp_path / "part.arrow")

    read = [(parts.example_id, parts.sample_hash) for parts in map(reader.parts, range(reader.rows))]
    assert read == [(example_id, f"{i:032x}") for i, example_id in enumerate(ids)]
    del read  # Python's free lists of small tuples are full now, before tracing
    reader.close()
    reader = PartitionReader(tmp_path / "part.arrow")  # a fresh one: nothing of its rows read yet
    tracemalloc.start()
    try:
        chars = sum(len(p.example_id) + len(p.sample_hash) for p in map(reader.parts, range(reader.rows)))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert chars == sum(len(i) + 32 for i in ids)
    assert held / reader.rows < 4  # nothing per row; a per-batch list of the strings held ~150 bytes a row
    reader.close()
