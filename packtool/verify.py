"""`packtool verify`: re-derive every promise of an output from its bytes, so nobody has to trust the builder.

Per shard: the file's size and sha256 equal the manifest's. Per pack row:

    cu_seqlens      starts at 0, strictly increasing, ends at len(input_ids) <= capacity
    labels          -100 at every segment start; elsewhere -100 or the token itself
    n_tokens, n_targets, attn_cost, pack_hash      recomputed and equal
    per-document columns                            one entry per doc_cu_seqlens segment

and per source the accounting adds up: read == kept + rejected + dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packtool.labels import IGNORE_INDEX
from packtool.shards import iter_rows, locate, pack_hash, sha256_file

MAX_PROBLEMS = 20  # enough to see a pattern; a corrupt shard would otherwise print a line per row


@dataclass
class Verification:
    shards: int = 0
    packs: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("... more problems not listed")


def verify(path: str | Path) -> Verification:
    folder, manifest, files = locate(path)
    result = Verification()
    capacity = int(manifest["capacity"]) if manifest else None
    listed = {s["file"]: s for s in manifest["shards"]} if manifest else {}
    for shard in files:
        result.shards += 1
        entry = listed.get(shard.name)
        if manifest is not None and entry is None:
            result.add(f"{shard.name}: not listed in the manifest")
        elif entry is not None and (shard.stat().st_size != entry["bytes"] or sha256_file(shard) != entry["sha256"]):
            result.add(f"{shard.name}: bytes or sha256 differ from the manifest (the file changed after the build)")
        for row_number, row in enumerate(iter_rows(shard)):
            result.packs += 1
            for problem in row_problems(row, capacity):
                result.add(f"{shard.name} row {row_number}: {problem}")
    if manifest is not None:
        for name, a in manifest.get("accounting", {}).items():
            accounted = a["kept"] + sum(a["rejected"].values()) + sum(a["dropped"].values())
            if a["read"] != accounted:
                result.add(f"accounting of source {name!r}: read {a['read']} != kept + rejected + dropped {accounted}")
    if not files:
        result.add(f"{folder}: no shards")
    return result


def row_problems(row: dict[str, Any], capacity: int | None) -> list[str]:
    """Every broken promise of one pack row (empty when the row is sound)."""
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    labels = np.asarray(row["labels"], dtype=np.int64)
    cu = np.asarray(row["cu_seqlens"], dtype=np.int64)
    docs = np.asarray(row["doc_cu_seqlens"], dtype=np.int64)
    problems = []
    for name, offsets in (("cu_seqlens", cu), ("doc_cu_seqlens", docs)):
        if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != len(ids) or (np.diff(offsets) <= 0).any():
            problems.append(f"{name} {offsets.tolist()[:8]}... must start at 0, increase and end at {len(ids)}")
    if problems:
        return problems
    if capacity is not None and len(ids) > capacity:
        problems.append(f"{len(ids)} tokens > capacity {capacity}")
    if len(labels) != len(ids):
        return [*problems, f"{len(labels)} labels for {len(ids)} tokens"]
    if (labels[cu[:-1]] != IGNORE_INDEX).any():
        problems.append("a segment start carries a label (the previous segment would predict it)")
    targets = labels != IGNORE_INDEX
    if (labels[targets] != ids[targets]).any():
        problems.append("a label differs from its token (labels are unshifted: the model shifts)")
    documents = len(docs) - 1
    for column in ("sample_ids", "sample_hashes", "sample_repeats", "sources"):
        if len(row[column]) != documents:
            problems.append(f"{column} has {len(row[column])} entries for {documents} documents")
    expected = {
        "n_tokens": len(ids),
        "n_targets": int(targets.sum()),
        "attn_cost": int((np.diff(cu) ** 2).sum()),
        "pack_hash": pack_hash(ids, labels, cu),
    }
    problems += [f"{key} is {row[key]!r}, recomputed {value!r}" for key, value in expected.items() if row[key] != value]
    return problems


def format_verification(result: Verification) -> str:
    head = f"{result.shards} shard(s), {result.packs} pack(s) checked"
    if result.ok:
        return f"{head}: OK (checksums, offsets, labels at segment starts, counts, pack hashes, accounting)"
    return "\n".join([f"{head}: {len(result.problems)} problem(s)", *(f"  - {p}" for p in result.problems)])
