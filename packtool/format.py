"""The on-disk contract of docs/format.md, in one place: what the builder writes and every reader checks.

    shard schema (SCHEMA, SCHEMA_VERSION)      one Parquet row per pack
    SCHEMA_V2, SEGMENTS_SCHEMA_VERSION         the same plus per-segment columns (groups, pieces): builds with pairs,
                                               groups or split truncation
    pack_hash(input_ids, labels, cu_seqlens)   sha256 over the three arrays as little-endian int32
    attn_cost(cu_seqlens)                      sum of squared segment lengths (quadratic attention cost)
    check_cu_seqlens(cu, n)                    0, strictly increasing, ends at n: what varlen kernels need
    read_manifest / write_manifest             manifest.json, sealed and written last; schema version checked on read

The builder, verify, stats, inspect and the loader all import these; none recomputes them its own way.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packtool import SCHEMA_VERSION
from packtool.errors import PackFormatError
from packtool.labels import IGNORE_INDEX
from packtool.seal import seal_manifest

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
# A build with a preference or group source, or with `split` truncation, writes version 2 (build.plan
# shard_schema_version); every other build writes the v1 bytes.
SEGMENTS_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION, SEGMENTS_SCHEMA_VERSION)
INT32_MAX = int(np.iinfo(np.int32).max)  # varlen kernels take int32 offsets: a row's tokens must fit

SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("labels", pa.list_(pa.int32())),
        pa.field("cu_seqlens", pa.list_(pa.int32())),
        pa.field("doc_cu_seqlens", pa.list_(pa.int32())),
        pa.field("token_roles", pa.list_(pa.int8())),
        pa.field("sample_ids", pa.list_(pa.string())),
        pa.field("sample_hashes", pa.list_(pa.string())),
        pa.field("sample_repeats", pa.list_(pa.int32())),
        pa.field("sources", pa.list_(pa.string())),
        pa.field("n_tokens", pa.int32()),
        pa.field("n_targets", pa.int32()),
        pa.field("attn_cost", pa.int64()),
        pa.field("pack_hash", pa.string()),
    ],
    metadata={"packtool.schema_version": str(SCHEMA_VERSION)},
)

# Per attention segment, aligned with cu_seqlens (docs/format.md "Pairs and groups" and "Pieces"); floats
# are NaN where none. Version 2 is never a stream build, so its segments are its documents.
SEGMENT_FIELDS = [
    pa.field("segment_groups", pa.list_(pa.int64())),
    pa.field("segment_kinds", pa.list_(pa.int8())),
    pa.field("completion_index", pa.list_(pa.int16())),
    pa.field("segment_rewards", pa.list_(pa.float64())),
    pa.field("segment_advantages", pa.list_(pa.float64())),
    pa.field("segment_pieces", pa.list_(pa.int32())),
    pa.field("segment_piece_offsets", pa.list_(pa.int32())),
]
SCHEMA_V2 = pa.schema(list(SCHEMA) + SEGMENT_FIELDS, metadata={"packtool.schema_version": str(SEGMENTS_SCHEMA_VERSION)})
WHOLE = -1  # segment_pieces of a segment that is its sample whole (nothing was cut from it)


def conventions(stream: bool) -> dict[str, Any]:
    """How to read labels, positions and attention in an output (the manifest's `conventions`)."""
    return {
        "labels": "hf_unshifted",  # the model shifts: logits at t predict labels[t + 1]
        "ignore_index": IGNORE_INDEX,
        "positions": "continuous" if stream else "restart_per_segment",
        "attention": "causal_across_documents" if stream else "block_diagonal_causal",
    }


def pack_hash(input_ids: np.ndarray, labels: np.ndarray, cu_seqlens: np.ndarray) -> str:
    """sha256 (first 16 bytes, hex) over the three arrays as little-endian int32, each followed by b"|"."""
    digest = hashlib.sha256()
    for array in (input_ids, labels, cu_seqlens):
        digest.update(np.ascontiguousarray(array, dtype="<i4").tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:32]


def attn_cost(cu_seqlens: np.ndarray) -> int:
    """Quadratic attention cost of one pack: sum of l_i^2 over its attention segments.

    cu_seqlens [0, 3, 5, 9] -> segments 3, 2, 4 -> 9 + 4 + 16 = 29
    """
    return attn_cost_of_lengths(np.diff(np.asarray(cu_seqlens, dtype=np.int64)))


def attn_cost_of_lengths(lengths: np.ndarray) -> int:
    """sum(l_i^2) over segment lengths (the same cost, from lengths instead of offsets)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int((lengths**2).sum())


def cu_seqlens_problem(cu_seqlens: np.ndarray, n_tokens: int) -> str | None:
    """Why these offsets are not valid varlen attention boundaries for n_tokens tokens (None when they are).

    Rules: 1-D with at least 2 offsets, starts at 0, strictly increasing (no empty segment), ends
    at n_tokens, and n_tokens fits int32 (varlen kernels take int32 offsets).
    """
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or len(cu) < 2:
        return f"must be 1-D with at least 2 offsets, got shape {cu.shape}"
    if int(cu[0]) != 0:
        return f"must start at 0, starts at {int(cu[0])}"
    steps = np.diff(cu.astype(np.int64))
    if (steps <= 0).any():
        bad = int(np.argmax(steps <= 0))
        return f"must be strictly increasing; offsets {int(cu[bad])} -> {int(cu[bad + 1])} at segment {bad}"
    if int(cu[-1]) != n_tokens:
        return f"ends at {int(cu[-1])} but the row has {n_tokens} tokens"
    if n_tokens > INT32_MAX:
        return f"{n_tokens} tokens do not fit int32 offsets (max {INT32_MAX}); lower the token budget"
    return None


def check_cu_seqlens(cu_seqlens: np.ndarray, n_tokens: int, name: str = "cu_seqlens") -> None:
    """Raise PackFormatError unless cu_seqlens are valid boundaries for n_tokens tokens."""
    problem = cu_seqlens_problem(cu_seqlens, n_tokens)
    if problem is not None:
        raise PackFormatError(f"{name} {problem}")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON to a temporary name and rename it: readers see the old file or the new one, never half."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest goes last, sealed (packtool.seal): its presence means every file it lists is complete."""
    sealed = seal_manifest(manifest)
    write_json_atomic(folder / MANIFEST, sealed)
    return sealed


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of an output folder, with its schema version checked."""
    path = folder / MANIFEST
    if not path.is_file():
        raise PackFormatError(f"{folder}: no {MANIFEST}; not a packtool output folder, or the build did not finish")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackFormatError(f"{path}: not valid JSON ({exc}); rebuild the output") from None
    if not isinstance(manifest, dict):
        raise PackFormatError(f"{path}: expected a JSON object")
    version = manifest.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise PackFormatError(
            f"{path}: schema_version {version!r}; this packtool reads {list(SUPPORTED_SCHEMA_VERSIONS)} "
            "(rebuild with this version, or install the packtool that wrote it)"
        )
    return manifest
