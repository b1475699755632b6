"""What a Ray build's driver sends and receives per work item (issue 43 item 3).

The driver holds the plan's arrays and nothing per sample as Python objects; work items stream their results
(at most `depth` in flight, tests/builder/test_executors.py). What is left to grow with the data is each item and
each result: an encode item that carried its records, an encode result that carried its report (the rejects, the
straddling targets), an emit item that carried the plan's arrays would each cross the network once per task and
sit in the driver until taken. Pinned: a build of ten times the records per input file sends and receives, item for
item, the same number of bytes, within a few digits, and each is small.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import QUICKSTART, chat_rows

import packtool.builder as builder_module
from packtool.builder import build
from packtool.builder.executors import RayExecutor
from packtool.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240, method="thread")]  # a misconfigured Ray hangs
FILES = 2  # input files: two encode items, one per node of the loopback cluster
# Bytes an item or a result may grow by between the two builds: the numbers in them (row counts, bytes, token
# counts) gain a digit or two; a list with an entry per sample would add thousands.
SLACK = 64
# An encode item carries the build's config (~2 KB for this one); a result, a shard's description or a cache key.
ITEM_BYTES, RESULT_BYTES = 4096, 1024


class MeasuredRay(RayExecutor):
    """The Ray executor, noting the pickled size of every item it sends and every result it hands back."""

    def __init__(self, workers: int, address: str | None = None) -> None:
        super().__init__(workers, address)
        self.sizes: dict[tuple[str, str], list[int]] = defaultdict(list)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        name = fn.__name__

        def sent(items: Iterable[Any]) -> Iterator[Any]:
            for item in items:
                self.sizes[name, "item"].append(len(pickle.dumps(item)))
                yield item

        for result in super().map(fn, sent(items)):
            self.sizes[name, "result"].append(len(pickle.dumps(result)))
            yield result


def payload_sizes(folder: Path, records: int, monkeypatch) -> dict[tuple[str, str], list[int]]:
    """The sizes MeasuredRay saw in a Ray build of FILES files of `records` chats each, a tenth of them bad JSON
    and the last one too long (so each item's report holds rejects that grow with its records, and a truncation)."""
    folder.mkdir()
    for f in range(FILES):
        rows = chat_rows(records, 20 + 30 * (f % 2), f"f{f}-")
        lines = [
            "{not json" if i % 10 == 3 else json.dumps(row)
            for i, row in enumerate([*rows[:-1], {**rows[-1], "messages": rows[-1]["messages"] * 40}])
        ]
        (folder / f"{f}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    raw = {
        "sources": [{"name": "chat", "path": "*.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "truncation": {"strategy": "right"},
        "rows_per_shard": 100_000,  # one shard: the same emit items at both sizes
        "on_error": "skip",
        "max_reject_share": 0.5,
        "output": "out",
    }
    (folder / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    executors: list[MeasuredRay] = []

    def measured(kind: str, workers: int | str, address: str | None = None) -> MeasuredRay:
        executors.append(MeasuredRay(2, address))
        return executors[-1]

    monkeypatch.setattr(builder_module, "make_executor", measured)
    built = build(load_config(folder / "config.json", overrides=["executor=ray"]), use_cache=False)
    assert built.manifest["accounting"]["chat"]["read"] == FILES * records
    assert built.manifest["rejects"]["count"] >= FILES * records // 10  # the reports did grow
    return executors[0].sizes


def test_a_ray_builds_items_and_results_do_not_grow_with_its_samples(tmp_path, ray_two_nodes, monkeypatch):
    small = payload_sizes(tmp_path / "small", 40, monkeypatch)
    large = payload_sizes(tmp_path / "large", 400, monkeypatch)
    assert (
        set(small) == set(large) == {(fn, kind) for fn in ("encode_item", "emit_item") for kind in ("item", "result")}
    )
    for key, sizes in large.items():
        assert len(sizes) == len(small[key])  # item for item: the same files and shards
        grown = [after - before for before, after in zip(small[key], sizes, strict=True)]
        assert max(grown) <= SLACK, f"{key}: {small[key]} -> {sizes} bytes for ten times the records"
        assert max(sizes) <= (ITEM_BYTES if key[1] == "item" else RESULT_BYTES), f"{key}: {sizes} bytes"
