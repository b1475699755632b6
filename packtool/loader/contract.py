"""The loader's one reader of the on-disk contract: manifest, shard paths, pack_hash, cu_seqlens.

Everything the loader trusts about a build folder is checked here: the manifest (packtool.format.Manifest,
its keys typed there), shard paths confined to the build folder, the `pack_hash` definition and the
`cu_seqlens` rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from packtool.errors import DatasetError, PackFormatError, one_line
from packtool.format import Manifest, ShardEntry, check_cu_seqlens, pack_hash, sha256_file
from packtool.format import read_manifest as format_read_manifest


def read_manifest(folder: str | Path) -> Manifest:
    """`folder/manifest.json` as format.read_manifest checks it (version and field types, shard names plain
    file names), with each shard's path resolved; refuse a shard that is a link to a file outside the folder."""
    folder = Path(folder)
    try:
        manifest = format_read_manifest(folder)
    except PackFormatError as err:
        raise DatasetError(str(err)) from None
    root = folder.resolve()
    shards = []
    for entry in manifest.shards:
        file = entry.file.resolve()
        # A manifest is data: a link must not make the loader read outside the build.
        if not file.is_relative_to(root):
            raise DatasetError(
                f"{entry.file}: a link to {file}, outside the build folder {root}; shards are files inside it"
            )
        shards.append(replace(entry, file=file))
    return replace(manifest, shards=tuple(shards))


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
