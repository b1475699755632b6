"""The loader's one reader of the on-disk contract: manifest, shard paths, pack_hash, cu_seqlens.

Everything the loader trusts about a build folder is checked here and nowhere else, so the
contract can move to a shared module without touching the readers: the manifest keys
(`schema_version`, `capacity`, `tokenizer.pad_token_id`, `shards[].file/rows/sha256`), shard
paths confined to the build folder, the `pack_hash` definition and the `cu_seqlens` rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from packtool.errors import DatasetError, PackFormatError
from packtool.format import MANIFEST, check_cu_seqlens, pack_hash, sha256_file
from packtool.format import read_manifest as read_manifest_json
from packtool.labels import IGNORE_INDEX


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard as the manifest lists it, its path already confined to the build folder."""

    file: Path
    rows: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """The manifest keys the loader reads."""

    folder: Path
    capacity: int
    pad_id: int
    vocab_size: int | None
    shards: tuple[ShardEntry, ...]
    raw: dict[str, Any]


def read_manifest(folder: str | Path) -> Manifest:
    """Parse `folder/manifest.json`; refuse unknown schema versions and shard paths outside the folder."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        raw = read_manifest_json(folder)
    except PackFormatError as err:
        raise DatasetError(str(err)) from None
    root = folder.resolve()
    shards = []
    for i, entry in enumerate(raw.get("shards") or []):
        name = str(entry.get("file", ""))
        file = (root / name).resolve()
        # A manifest is data: a path like "../../etc/x" or "/abs" must not make the loader read outside the build.
        if Path(name).is_absolute() or not file.is_relative_to(root) or file == root:
            raise DatasetError(
                f"{path}: shards[{i}].file {name!r} points outside the build folder {root}; "
                "shard paths must be relative names inside it"
            )
        shards.append(ShardEntry(file, int(entry["rows"]), str(entry.get("sha256", ""))))
    pad = (raw.get("tokenizer") or {}).get("pad_token_id")
    vocab = (raw.get("tokenizer") or {}).get("vocab_size")
    return Manifest(folder, int(raw["capacity"]), 0 if pad is None else int(pad), vocab, tuple(shards), raw)


def first_altered_row(file: Path) -> str:
    """Where a shard whose sha256 failed differs from its own hashes: 'row N (pack_hash ...)' or a part of the file.

    Only called after a checksum failure, so its cost (hashing every pack) is paid on the error path.
    """
    try:
        parquet = pq.ParquetFile(file)
        first = 0
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(
                group, columns=["input_ids", "labels", "cu_seqlens", "n_targets", "pack_hash"]
            )
            cols = {name: table.column(name).to_pylist() for name in table.column_names}
            for i in range(table.num_rows):
                ids, labels, cu = (np.asarray(cols[n][i]) for n in ("input_ids", "labels", "cu_seqlens"))
                if pack_hash(ids, labels, cu) != cols["pack_hash"][i]:
                    return f"row {first + i} (its pack_hash does not match its input_ids, labels, cu_seqlens)"
                if int((labels != -100).sum()) != cols["n_targets"][i]:
                    return f"row {first + i} (n_targets {cols['n_targets'][i]} != its labels)"
            first += table.num_rows
    except Exception as err:  # any decode failure still localises the damage to this shard
        return f"undecodable bytes ({type(err).__name__}: {one_line(err)})"
    return "row unknown (the damage is in metadata or a column the loader does not hash)"


def one_line(err: BaseException) -> str:
    """The first line of an exception's text (pyarrow's end in a newline; errors here are one line)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_shard(entry: ShardEntry) -> None:
    """Raise DatasetError unless the shard's bytes hash to the manifest's sha256."""
    if not entry.file.is_file():
        raise DatasetError(f"{entry.file}: listed in the manifest but missing")
    got = sha256_file(entry.file)
    if got != entry.sha256:
        raise DatasetError(
            f"{entry.file}: {first_altered_row(entry.file)}: sha256 {got[:16]}... != manifest {entry.sha256[:16]}...; "
            "the shard was altered or replaced: rebuild or restore it (verify=False skips this check)"
        )


def validate_cu_seqlens(
    cu_seqlens: Sequence[int] | np.ndarray | Any, total: int, max_seqlen: int | None = None
) -> None:
    """Raise PackFormatError unless `cu_seqlens` describes `total` tokens exactly.

    Rules: starts at 0, strictly increasing (no empty segment), ends at `total`, fits int32,
    and `max_seqlen` (when given) equals the longest segment.
    """
    cu = cu_seqlens.detach().cpu().numpy() if hasattr(cu_seqlens, "detach") else np.asarray(cu_seqlens)
    check_cu_seqlens(cu, total)
    longest = int(np.diff(cu.astype(np.int64)).max())
    if max_seqlen is not None and int(max_seqlen) != longest:
        raise PackFormatError(f"max_seqlen {max_seqlen} != longest segment {longest}")


def first_broken_pack(
    ids_offsets: np.ndarray,
    label_offsets: np.ndarray,
    cu_offsets: np.ndarray,
    cu_values: np.ndarray,
    labels: np.ndarray | None,
) -> int:
    """The first row of a row group whose pack breaks the contract, or -1; one vectorised pass for all rows.

    Arrow list columns as (offsets, values). Rules per pack: as many labels as input_ids;
    cu_seqlens starts at 0, increases strictly and ends at the pack's length; and, when `labels`
    (the flat label values) is given, -100 at every segment start.
    """
    lens = np.diff(ids_offsets)
    cu_lens = np.diff(cu_offsets)
    bad = (np.diff(label_offsets) != lens) | (cu_lens < 2)
    if bad.any():
        return int(np.argmax(bad))
    cu = cu_values.astype(np.int64)
    firsts, lasts = cu_offsets[:-1], cu_offsets[1:] - 1
    bad |= (cu[firsts] != 0) | (cu[lasts] != lens)
    falls = np.diff(cu) <= 0
    falls[lasts[:-1]] = False  # the step from one pack's last offset to the next pack's 0
    if falls.any():  # rows looked up only for the offending steps: a clean row group pays one comparison
        bad[np.searchsorted(cu_offsets, np.flatnonzero(falls), side="right") - 1] = True
    if labels is not None:
        inner = np.ones(len(cu), bool)
        inner[lasts] = False
        wrong = labels[(cu + np.repeat(label_offsets[:-1], cu_lens))[inner]] != IGNORE_INDEX
        if wrong.any():
            bad[np.repeat(np.arange(len(lens)), cu_lens)[inner][wrong]] = True
    return int(np.argmax(bad)) if bad.any() else -1
