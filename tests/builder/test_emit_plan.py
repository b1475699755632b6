"""An emit worker maps the plan (issue 43): it holds the pages of the packs it writes, where loading plan.npz held
every folder's arrays (~65 B a sample a worker), and it lets go of a build's plan and store files before an item of
another build (a Ray worker or a process outlives a build). The serial executor runs the items in this process; with
`share` off it maps the plan as a worker does, and with `release` off the driver leaves it mapped as a worker does."""

from __future__ import annotations

import tracemalloc

import numpy as np
from support import QUICKSTART, chat_rows

import packtool.builder as builder_module
import packtool.builder.emit as emit_module
from packtool.builder import build
from packtool.builder.plan_files import mapped_npz
from packtool.config import load_config

SMALL, LARGE = 400, 4000
# what emit_item may allocate per sample of the plan beyond a shard's own: loading it read ~50 here
EMIT_PER_SAMPLE = 5


def worker_config(tmp_path, write_config, write_jsonl, samples: int, name: str):
    folder = tmp_path / name
    folder.mkdir()
    write_jsonl(chat_rows(samples, 8, name), f"{name}/a.jsonl")
    raw = {
        "sources": [{"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "rows_per_shard": 20,
        "output": "out",
    }
    return load_config(write_config(raw, f"{name}/config.yaml"), workers="1")


def as_a_worker(monkeypatch) -> list:
    """Builds in this process emit as a worker process does: each item maps the plan (no `share`) and nothing is
    released when the build ends. Returns, per emit_item call, (its item, the plans and store files held after it,
    its tracemalloc peak)."""
    calls: list = []

    def traced(item):
        tracemalloc.start()
        try:
            result = emit_module.emit_item(item)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        calls.append((item, dict(emit_module._PLANS), set(emit_module._READERS), peak))
        return result

    monkeypatch.setattr(builder_module, "share", lambda plan: None)
    monkeypatch.setattr(builder_module, "release", lambda: None)
    monkeypatch.setattr(builder_module, "emit_item", traced)
    return calls


def test_a_worker_maps_the_plan_and_holds_the_same_for_a_plan_ten_times_larger(
    tmp_path, write_config, write_jsonl, monkeypatch
):
    calls = as_a_worker(monkeypatch)
    peaks = {}
    try:
        for samples in (SMALL // 4, SMALL, LARGE):  # the first: imports and caches made once
            emit_module.release()
            build(worker_config(tmp_path, write_config, write_jsonl, samples, f"s{samples}"), use_cache=False)
            first, plans, _, peak = calls[0]
            plan = plans[first.plan_folder]
            arrays = [a for f in plan.folders for a in (f.ref, f.repeat, f.length, f.layout.members)]
            assert all(isinstance(a, np.memmap) for a in arrays)
            peaks[samples] = peak  # the first item's: the plan read, and one shard of 20 packs written
            calls.clear()
    finally:
        emit_module.release()
    per_sample = (peaks[LARGE] - peaks[SMALL]) / (LARGE - SMALL)
    assert per_sample < EMIT_PER_SAMPLE, peaks


def test_a_worker_lets_go_of_a_build_before_emitting_for_another(tmp_path, write_config, write_jsonl, monkeypatch):
    calls = as_a_worker(monkeypatch)
    try:
        for name in ("one", "two"):
            build(worker_config(tmp_path, write_config, write_jsonl, 60, name), use_cache=False)
    finally:
        emit_module.release()
    one = [c for c in calls if "/one/" in c[0].plan_folder]
    two = [c for c in calls if "/two/" in c[0].plan_folder]
    assert one and two
    held_by_one = one[-1][2]
    for item, plans, readers, _ in two:
        assert list(plans) == [item.plan_folder]
        assert not readers & held_by_one


def test_the_mapped_plan_is_the_loaded_plan(tmp_path):
    arrays = {
        "main.ref": np.arange(7, dtype=np.int64),
        "main.group": np.zeros(0, dtype=np.int64),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "flags": np.array([True, False, True]),
    }
    np.savez(tmp_path / "plan.npz", allow_pickle=False, **arrays)
    mapped = mapped_npz(tmp_path / "plan.npz")
    assert sorted(mapped) == sorted(arrays)
    for name, array in arrays.items():
        assert mapped[name].dtype == array.dtype and np.array_equal(mapped[name], array), name
        assert mapped[name].flags.f_contiguous == array.flags.f_contiguous
        assert isinstance(mapped[name], np.memmap) or not array.size
        assert not mapped[name].flags.writeable
