"""`packtool inspect`: a pack printed token by token, the canary a reviewer reads before training.

    idx    id  piece            role       seg  pos  attends   label
      0  151644  <|im_start|>   template     0    0  [0, 0]    ·
      ...
     17     198  ⏎              assistant    0   17  [0, 17]   198        <- target (bold green on a terminal)

Whitespace and control characters are made visible (␣ for space, ⏎ for newline, ⇥ for tab), so a
label that lands on the wrong side of a newline is seen, not guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import numpy as np

from packtool.errors import PacktoolError
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths, labels_for, position_ids
from packtool.records import ROLE_NAMES, Tokenized
from packtool.shards import locate, read_row

_VISIBLE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def visible(piece: str) -> str:
    out = piece.translate(_VISIBLE)
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in out)


def load_decoder(shard: Path, manifest: dict[str, Any] | None, tokenizer_path: str | None) -> Any:
    from tokenizers import Tokenizer

    path = tokenizer_path or (manifest or {}).get("tokenizer", {}).get("file")
    if not path or not Path(path).is_file():
        raise PacktoolError(
            f"{shard}: cannot find the tokenizer to decode with ({path or 'no manifest'}); pass --tokenizer PATH"
        )
    return Tokenizer.from_file(path)


def inspect_pack(
    shard: str | Path,
    *,
    row: int = 0,
    limit: int | None = None,
    around: int | None = None,
    tokenizer: str | None = None,
    color: bool = False,
) -> str:
    """The table of one pack. `limit`: the first tokens of each document only; `around`: only the
    tokens within that distance of a document start or of a switch between context and target,
    the places where a wrong mask shows."""
    _, manifest, files = locate(shard)
    path = files[0]
    pack = read_row(path, row)
    decoder = load_decoder(path, manifest, tokenizer)
    ids = np.asarray(pack["input_ids"], dtype=np.int64)
    labels = np.asarray(pack["labels"], dtype=np.int64)
    cu = np.asarray(pack["cu_seqlens"], dtype=np.int64)
    docs = np.asarray(pack["doc_cu_seqlens"], dtype=np.int64)
    roles = pack["token_roles"]

    out = [
        f"{path.name} row {row}: {len(ids)} tokens, {len(cu) - 1} attention segment(s), "
        f"{len(docs) - 1} document(s), {int((labels != IGNORE_INDEX).sum())} targets, pack_hash {pack['pack_hash']}"
    ]
    for d in range(len(docs) - 1):
        start, end = int(docs[d]), int(docs[d + 1])
        out.append("")
        out.append(
            f"── document {d}: {pack['sample_ids'][d]} (source {pack['sources'][d]}, "
            f"hash {pack['sample_hashes'][d][:12]}, repeat {pack['sample_repeats'][d]}), "
            f"tokens [{start}, {end}) ──"
        )
        shown = range(start, end) if around is None else boundary_tokens(labels, start, end, around)
        out.extend(token_rows(ids, labels, roles, cu, decoder, shown, limit=limit, color=color))
        if limit is not None and len(shown) > limit:
            out.append(f"   ... {len(shown) - limit} more tokens")
        text = decoder.decode(ids[start:end].tolist(), skip_special_tokens=False)
        out.append("text:")
        out.append(text)
    return "\n".join(out)


def boundary_tokens(labels: Any, start: int, end: int, around: int) -> list[int]:
    """Token indices of [start, end) within `around` of the start or of a context/target switch."""
    is_target = np.asarray(labels[start:end]) != IGNORE_INDEX
    switches = np.flatnonzero(is_target[1:] != is_target[:-1]) + 1
    keep = np.zeros(end - start, dtype=bool)
    for anchor in [0, *switches.tolist()]:
        keep[max(anchor - around, 0) : anchor + around + 1] = True
    return (np.flatnonzero(keep) + start).tolist()


TABLE_HEADER = f"{'idx':>6} {'id':>8}  {'piece':<18} {'role':<9} {'seg':>4} {'pos':>5}  {'attends':<13} label"


def token_rows(
    ids: Any,
    labels: Any,
    roles: Any,
    cu_seqlens: Any,
    decoder: Any,
    span: range | list[int],
    *,
    limit: int | None = None,
    color: bool = False,
) -> list[str]:
    """The header and one line per token of `span` (at most `limit`): the table `inspect` prints.

    Shared by `inspect` (a shard row) and `tokenized_table` (a sample before packing, as `audit`
    shows its first failing sample), so both read the same.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    positions = position_ids(cu)
    out = [TABLE_HEADER]
    previous = None
    for t in list(span)[:limit] if limit is not None else span:
        if previous is not None and t != previous + 1:
            out.append(f"{'...':>6}")
        previous = t
        seg = int(np.searchsorted(cu, t, side="right") - 1)
        label = int(labels[t])
        target = label != IGNORE_INDEX
        line = (
            f"{t:>6} {int(ids[t]):>8}  {visible(decoder.decode([int(ids[t])], skip_special_tokens=False)):<18.18}"
            f" {ROLE_NAMES.get(int(roles[t]), '?'):<9} {seg:>4} {int(positions[t]):>5}  "
            f"{f'[{int(cu[seg])}, {t}]':<13} {label if target else '·'}"
        )
        if target:
            line = click.style(line, fg="green", bold=True) if color else f"{line}  *"
        out.append(line)
    return out


def tokenized_table(sample: Tokenized, decoder: Any, *, limit: int | None = None, color: bool = False) -> str:
    """One sample as `inspect` shows a document: a single segment, labels as packing would write them."""
    ids = np.asarray(sample.input_ids, dtype=np.int64)
    cu = cu_seqlens_from_lengths([len(ids)])
    labels = labels_for(sample.input_ids, sample.targets, cu)
    out = token_rows(ids, labels, sample.roles, cu, decoder, range(len(ids)), limit=limit, color=color)
    if limit is not None and len(ids) > limit:
        out.append(f"   ... {len(ids) - limit} more tokens")
    return "\n".join(out)
