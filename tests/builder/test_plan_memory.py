"""The plan holds its samples in numpy arrays, not as Python objects (issue 43): what it allocates grows by a
bounded number of bytes per sample and by no Python object per sample. Sizes, not times; the per-phase
breakdown at scale is bench/scale_bench.py --only trace."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
from support import QUICKSTART, chat_rows

import packtool.builder as builder_module
from packtool.builder import _partition, build
from packtool.builder.plan import make_plan
from packtool.builder.store import BATCH_ROWS, PartitionReader, PartitionWriter
from packtool.config import load_config
from packtool.records import Tokenized

SMALL, LARGE = 500, 4000
# bytes the plan keeps per sample (its arrays: ref, repeat, length, members, offsets): ~37 now; 53 while it kept
# each source's lengths before and after truncation (16 B a sample), which it tallies now
HELD_PER_SAMPLE = 48
PEAK_PER_SAMPLE = 300  # bytes the plan phase allocates at most per sample, arrays being built included; ~112 now
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
    measured = _trace_make_plan(monkeypatch)
    manifest = build(config, use_cache=False).manifest
    assert sum(a["read"] for a in manifest["accounting"].values()) == samples
    return measured


def _trace_make_plan(monkeypatch) -> dict[str, int]:
    """What the build's make_plan call holds, peaks at and keeps as gc-tracked objects, filled in when it runs."""
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
    return measured


def test_the_plan_holds_arrays_not_an_object_per_sample(tmp_path, write_config, write_jsonl, monkeypatch):
    planned(tmp_path, write_config, write_jsonl, 100, monkeypatch)  # the first plan's imports and caches
    small = planned(tmp_path, write_config, write_jsonl, SMALL, monkeypatch)
    large = planned(tmp_path, write_config, write_jsonl, LARGE, monkeypatch)
    per_sample = {key: (large[key] - small[key]) / (LARGE - SMALL) for key in small}
    assert per_sample["held"] < HELD_PER_SAMPLE, per_sample
    assert per_sample["peak"] < PEAK_PER_SAMPLE, per_sample
    assert per_sample["objects"] < OBJECTS_PER_SAMPLE, per_sample


def lossy_rows(samples: int) -> list:
    """Chats of which half are lost, in blocks of six: a line that is not JSON (rejected by encode), a chat
    without a system message (no target under train.roles [system]: dropped by the plan), a copy of the chat
    before it (a duplicate under dedup), three kept."""
    rows: list = []
    for i in range(samples):
        chat = {
            "id": f"r{i}",
            "messages": [
                {"role": "system", "content": f"answer briefly, case {i}"},
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": "answer " * (3 + i % 5)},
            ],
        }
        kind = i % 6
        if kind == 0:
            rows.append(f"{{not json {i}")
        elif kind == 1:
            rows.append({**chat, "messages": chat["messages"][1:]})
        elif kind == 3:
            rows.append({**rows[-1], "id": f"r{i}"})
        else:
            rows.append(chat)
    return rows


def driver_held(tmp_path, write_config, write_jsonl, samples: int, monkeypatch) -> dict[str, int]:
    """A build of `samples` records, half of them lost; what the driver holds once the plan is made, counted from
    the moment the encode's reports are read (the partitions' reports, the plan and its rejects), and the plan's
    peak."""
    folder = tmp_path / f"lossy-{samples}"
    folder.mkdir()
    write_jsonl(lossy_rows(samples), f"lossy-{samples}/data.jsonl")
    raw = {
        "sources": [
            {
                "name": "a",
                "path": "data.jsonl",
                "format": "messages",
                "fields": {"id": "id"},
                "train": {"roles": ["system"]},
            }
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        "on_error": "skip",
        "dedup": "exact",
        "max_reject_share": 0.9,
    }
    config = load_config(write_config(raw, f"lossy-{samples}/config.yaml"), workers="1")
    measured: dict[str, int] = {}
    read_partition = _partition

    def first_read(*args):
        if not tracemalloc.is_tracing():
            gc.collect()
            measured["objects"] = len(gc.get_objects())
            tracemalloc.start()
        return read_partition(*args)

    def traced(*args):
        tracemalloc.reset_peak()
        try:
            made = make_plan(*args)
            held, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        gc.collect()
        measured.update(held=held, peak=peak, objects=len(gc.get_objects()) - measured["objects"])
        return made

    monkeypatch.setattr(builder_module, "_partition", first_read)
    monkeypatch.setattr(builder_module, "make_plan", traced)
    manifest = build(config, use_cache=False).manifest
    lost = manifest["rejects"]["by_reason"]
    assert lost == {"duplicate": samples // 6, "no_targets": samples // 6, "parse_error": samples // 6}, lost
    return measured


def test_the_driver_holds_no_object_per_reject(tmp_path, write_config, write_jsonl, monkeypatch):
    """Rejects are rows of a table beside each partition and lines of the plan's rejects file, never a dict per
    record in the driver: each dict held ~0.5 KB, 1 GB at 10M samples and 20% rejects (issue 43). Held here:
    ~26 B a sample now, ~350 before (peak ~150, ~1,440 before). A dict of strings and numbers is not gc-tracked,
    so the held bytes, not the object count, are what found them."""
    small_size, large_size = 1_200, 12_000
    driver_held(tmp_path, write_config, write_jsonl, 120, monkeypatch)  # the first build's imports and caches
    small = driver_held(tmp_path, write_config, write_jsonl, small_size, monkeypatch)
    large = driver_held(tmp_path, write_config, write_jsonl, large_size, monkeypatch)
    per_sample = {key: (large[key] - small[key]) / (large_size - small_size) for key in small}
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


def split_planned(tmp_path, write_config, write_jsonl, documents: int, monkeypatch) -> dict[str, int]:
    """A build of `documents` texts of ~1,500 words, each split into ~70 pieces at capacity 64; what its make_plan
    call held and peaked at, and the pieces it made."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rows = [
        {"text": f"doc {i} " + " ".join(words[(i * 7 + j * j) % 8] for j in range(1_500))} for i in range(documents)
    ]
    (tmp_path / f"split-{documents}").mkdir()
    write_jsonl(rows, f"split-{documents}/t.jsonl")
    raw = {
        "sources": [{"name": "t", "path": "t.jsonl", "format": "text"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": "out",
        "truncation": {"strategy": "split"},
    }
    config = load_config(write_config(raw, f"split-{documents}/config.yaml"), workers="1")
    measured = _trace_make_plan(monkeypatch)
    manifest = build(config, use_cache=False).manifest
    measured["pieces"] = manifest["stats"]["segments"]
    return measured


def test_a_split_document_costs_the_plan_arrays_not_a_tuple_per_piece(tmp_path, write_config, write_jsonl, monkeypatch):
    """Each piece of a split document was a tuple of six ints while the plan ran: 176 B a piece at the plan's
    peak (1.8 GB for a pretraining source of 10M pieces); six int64 in one array now, 56 B a piece."""
    split_planned(tmp_path, write_config, write_jsonl, 20, monkeypatch)  # the first plan's imports and buffers
    small = split_planned(tmp_path, write_config, write_jsonl, 200, monkeypatch)
    large = split_planned(tmp_path, write_config, write_jsonl, 400, monkeypatch)
    assert large["pieces"] > 1.9 * small["pieces"] > 20_000, (small, large)
    per_piece = {key: (large[key] - small[key]) / (large["pieces"] - small["pieces"]) for key in ("held", "peak")}
    assert per_piece["peak"] < 100 and per_piece["held"] < 64, per_piece
