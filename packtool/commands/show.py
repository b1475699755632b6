"""`packtool inspect`: a pack printed token by token, the canary a reviewer reads before training.

    idx    id  piece            role       seg  pos  attends   label
      0  151644  <|im_start|>   template     0    0  [0, 0]    ·
      ...
     17     198  ⏎              assistant    0   17  [0, 17]   198  *     <- target (also bold green on a terminal)

Whitespace and control characters are made visible (␣ for space, ⏎ for newline, ⇥ for tab), so a
label that lands on the wrong side of a newline is seen, not guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from packtool.errors import PackFormatError, PacktoolError, one_line
from packtool.format import KIND_CODES, WHOLE, Manifest
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths, labels_for, position_ids
from packtool.records import ROLE_NAMES, Tokenized
from packtool.shards import locate, open_shard, read_columns, read_row
from packtool.terminal import escape_char, shown

_VISIBLE = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def visible(piece: str) -> str:
    """A token's text with whitespace drawn and every other unprintable character (a no-break space too) escaped."""
    out = piece.translate(_VISIBLE)
    return "".join(ch if ch.isprintable() else escape_char(ch) for ch in out)


def load_decoder(shard: Path, manifest: Manifest | None, tokenizer_path: str | None, folder: Path | None = None) -> Any:
    """The tokenizer to decode with: `tokenizer_path`, else the manifest's, which is relative to the manifest's
    `folder` (default: the shard's own folder; absolute in outputs of older versions)."""
    from tokenizers import Tokenizer

    recorded = manifest.tokenizer_file if manifest is not None else None
    path = tokenizer_path or (str((folder or shard.parent) / recorded) if recorded else None)
    if not path or not Path(path).is_file():
        raise PacktoolError(
            f"{shard}: cannot find the tokenizer to decode with ({path or 'no manifest'}); pass --tokenizer PATH"
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception on a malformed file
        raise PacktoolError(f"{path}: not a tokenizer.json ({one_line(error)}); pass --tokenizer PATH") from None


@dataclass(frozen=True, slots=True)
class PackRef:
    """One pack: a shard file and a row inside it, and the documents of that pack to show (None: all)."""

    shard: Path
    row: int
    documents: tuple[int, ...] | None = None


def select_packs(
    target: str | Path, *, row: int = 0, doc: int | None = None, sample_id: str | None = None
) -> tuple[Manifest | None, list[PackRef]]:
    """What `inspect` shows: row `row` of a shard, or pack number `row` counted across a folder's shards in
    manifest order; with `sample_id`, every document of that id in the shard or in all of the folder's shards."""
    _, manifest, files = locate(target)
    if sample_id is not None:
        refs = [
            PackRef(shard, number, tuple(i for i, s in enumerate(ids) if s == sample_id))
            for shard in files
            for number, ids in enumerate(_column(shard, "sample_ids"))
            if sample_id in ids
        ]
        if not refs:
            raise PacktoolError(f"{target}: no document with sample id {sample_id!r} in {len(files)} shard(s)")
        return manifest, refs
    if row < 0:
        raise PacktoolError(f"{target}: row {row} must be >= 0")
    local = row
    for shard in files:
        rows = open_shard(shard).metadata.num_rows
        if local < rows:
            return manifest, [PackRef(shard, local, None if doc is None else (doc,))]
        local -= rows
    total = row - local
    raise PacktoolError(f"{target}: row {row} out of range ({total} pack(s) in {len(files)} shard(s))")


def _column(shard: Path, name: str) -> list[Any]:
    return read_columns(shard, [name]).column(name).to_pylist()


def inspect_pack(
    target: str | Path,
    *,
    row: int = 0,
    doc: int | None = None,
    sample_id: str | None = None,
    limit: int | None = None,
    around: int | None = None,
    tokenizer: str | None = None,
    color: bool = False,
    text: bool | None = None,
) -> str:
    """The table of one pack (or of the documents with `sample_id`). `limit`: the first tokens of each
    document only; `around`: only the tokens within that distance of a document start or of a switch
    between context and target, the places where a wrong mask shows. `text` (default: on unless
    `around`) adds each document's decoded text."""
    manifest, refs = select_packs(target, row=row, doc=doc, sample_id=sample_id)
    decoder = load_decoder(refs[0].shard, manifest, tokenizer)
    show_text = around is None if text is None else text
    blocks = [
        "\n".join(pack_lines(ref, decoder, limit=limit, around=around, color=color, text=show_text)) for ref in refs
    ]
    return "\n\n".join(blocks)


def checked_row(ref: PackRef) -> dict[str, Any]:
    """The pack's row, refused in one line unless sound (verify.row_problems): its offsets index everything shown."""
    from packtool.commands.verify import row_problems

    pack = read_row(ref.shard, ref.row)
    problems = row_problems(pack, None)
    if problems:
        raise PackFormatError(
            f"{ref.shard} row {ref.row}: {problems[0]}: a damaged shard; `packtool verify` lists every problem"
        )
    return pack


def pack_lines(
    ref: PackRef, decoder: Any, *, limit: int | None, around: int | None, color: bool, text: bool
) -> list[str]:
    """One pack as text. With `around`, the column header is printed once and each document gets one
    line, so a pack of many short documents stays readable."""
    pack = checked_row(ref)
    ids = np.asarray(pack["input_ids"], dtype=np.int64)
    labels = np.asarray(pack["labels"], dtype=np.int64)
    cu = np.asarray(pack["cu_seqlens"], dtype=np.int64)
    docs = np.asarray(pack["doc_cu_seqlens"], dtype=np.int64)
    documents = _documents(ref, len(docs) - 1)
    out = [
        f"{shown(ref.shard.name)} row {ref.row}: {len(ids)} tokens, {len(cu) - 1} attention segment(s), "
        f"{len(docs) - 1} document(s), {int((labels != IGNORE_INDEX).sum())} targets, "
        f"pack_hash {shown(pack['pack_hash'])}"
    ]
    compact = around is not None
    if compact:
        out.append(TABLE_HEADER)
    for d in documents:
        start, end = int(docs[d]), int(docs[d + 1])
        head = (
            f"document {d}: {shown(pack['sample_ids'][d])} (source {shown(pack['sources'][d])}, "
            f"hash {shown(pack['sample_hashes'][d][:12])}, repeat {pack['sample_repeats'][d]}{_item_label(pack, d)}), "
            f"tokens [{start}, {end})"
        )
        out += [f"── {head}"] if compact else ["", f"── {head} ──"]
        span = range(start, end) if around is None else boundary_tokens(labels, start, end, around)
        table = token_rows(ids, labels, pack["token_roles"], cu, decoder, span, limit=limit, color=color)
        out.extend(table[1:] if compact else table)
        if limit is not None and len(span) > limit:
            out.append(f"   ... {len(span) - limit} more tokens")
        if text:
            out.append("text:")
            out.append(shown(decoder.decode(ids[start:end].tolist(), skip_special_tokens=False), keep="\n\t"))
    return out


def segment_item(pack: dict[str, Any], d: int) -> dict[str, Any] | None:
    """Schema v2: what document d is within its pair or group ({kind, group, completion_index, reward, advantage});
    None for a plain sample or a v1 pack. In packed modes documents and attention segments coincide."""
    if "segment_kinds" not in pack or pack["segment_groups"][d] < 0:
        return None
    names = {code: name for name, code in KIND_CODES.items()}
    item = {"kind": names[pack["segment_kinds"][d]], "group": pack["segment_groups"][d]}
    if pack["completion_index"][d] >= 0:
        item["completion_index"] = pack["completion_index"][d]
    for column, name in (("segment_rewards", "reward"), ("segment_advantages", "advantage")):
        if not math.isnan(pack[column][d]):
            item[name] = pack[column][d]
    return item


def segment_piece(pack: dict[str, Any], d: int) -> dict[str, int] | None:
    """Schema v2: which piece of its sample document d is ({number, offset}: the piece's first token is
    token `offset` of the sample); None for a whole sample or a v1 pack."""
    if "segment_pieces" not in pack or pack["segment_pieces"][d] == WHOLE:
        return None
    return {"number": pack["segment_pieces"][d], "offset": pack["segment_piece_offsets"][d]}


def _item_label(pack: dict[str, Any], d: int) -> str:
    piece = segment_piece(pack, d)
    label = "" if piece is None else f", piece {piece['number']} from token {piece['offset']} of the sample"
    item = segment_item(pack, d)
    if item is None:
        return label
    extra = "".join(f", {k} {item[k]}" for k in ("completion_index", "reward", "advantage") if k in item)
    return f"{label}, {item['kind']} of group {item['group']}{extra}"


def _documents(ref: PackRef, count: int) -> list[int]:
    chosen = list(range(count)) if ref.documents is None else list(ref.documents)
    for d in chosen:
        if not 0 <= d < count:
            raise PacktoolError(f"{ref.shard}: row {ref.row} has {count} document(s); --doc {d} is out of range")
    return chosen


def inspect_json(
    target: str | Path,
    *,
    row: int = 0,
    doc: int | None = None,
    sample_id: str | None = None,
    limit: int | None = None,
    around: int | None = None,
    tokenizer: str | None = None,
    text: bool = True,
) -> dict[str, Any]:
    """What `inspect --json` prints: the selected packs with their documents and, per token, the table's columns."""
    manifest, refs = select_packs(target, row=row, doc=doc, sample_id=sample_id)
    decoder = load_decoder(refs[0].shard, manifest, tokenizer)
    return {"packs": [pack_json(ref, decoder, limit=limit, around=around, text=text) for ref in refs]}


def pack_json(ref: PackRef, decoder: Any, *, limit: int | None, around: int | None, text: bool) -> dict[str, Any]:
    pack = checked_row(ref)
    ids = np.asarray(pack["input_ids"], dtype=np.int64)
    labels = np.asarray(pack["labels"], dtype=np.int64)
    cu = np.asarray(pack["cu_seqlens"], dtype=np.int64)
    docs = np.asarray(pack["doc_cu_seqlens"], dtype=np.int64)
    positions = position_ids(cu)
    documents = []
    for d in _documents(ref, len(docs) - 1):
        start, end = int(docs[d]), int(docs[d + 1])
        span = list(range(start, end) if around is None else boundary_tokens(labels, start, end, around))
        tokens = []
        for t in span[:limit] if limit is not None else span:
            seg = int(np.searchsorted(cu, t, side="right") - 1)
            tokens.append(
                {
                    "index": t,
                    "id": int(ids[t]),
                    "piece": decoder.decode([int(ids[t])], skip_special_tokens=False),
                    "role": ROLE_NAMES.get(int(pack["token_roles"][t]), "?"),
                    "segment": seg,
                    "position": int(positions[t]),
                    "attends": [int(cu[seg]), t],
                    "label": int(labels[t]),
                    "target": bool(labels[t] != IGNORE_INDEX),
                }
            )
        entry: dict[str, Any] = {
            "document": d,
            "sample_id": pack["sample_ids"][d],
            "source": pack["sources"][d],
            "sample_hash": pack["sample_hashes"][d],
            "repeat": pack["sample_repeats"][d],
            "start": start,
            "end": end,
            "targets": int((labels[start:end] != IGNORE_INDEX).sum()),
            "tokens": tokens,
        }
        item, piece = segment_item(pack, d), segment_piece(pack, d)
        if item is not None:
            entry["item"] = item
        if piece is not None:
            entry["piece"] = piece
        if text:
            entry["text"] = decoder.decode(ids[start:end].tolist(), skip_special_tokens=False)
        documents.append(entry)
    return {
        "shard": ref.shard.name,
        "row": ref.row,
        "pack_hash": pack["pack_hash"],
        "n_tokens": len(ids),
        "n_targets": int((labels != IGNORE_INDEX).sum()),
        "cu_seqlens": cu.tolist(),
        "documents": documents,
    }


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
            # The marker is always there: colour alone is lost when output is piped (click strips it).
            line = click.style(f"{line}  *", fg="green", bold=True) if color else f"{line}  *"
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
