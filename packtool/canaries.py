"""The canary set of a build (docs/canary.md): one document of each risky kind, chosen by a pure function of the
shards, the manifest's capacity and accounting, and (for an empty field only) the source records.

The builder records the set in the manifest (`canaries`, docs/format.md) once the shards are written, and
`packtool canary` prints what is recorded, so a later packtool never chooses other canaries for the same build;
for an output built before the field, the command selects the set again with the same function.

    kind              the document chosen (the shortest that qualifies; the first among equals)
    short_text        a document of text-role tokens only (a text source)
    empty_field       a sample whose record holds an empty message or text ("" content beside tool calls)
    tools             a conversation with a tool result and two or more assistant turns
    unicode           a conversation or text with a character beyond the Latin scripts (CJK, RTL, emoji)
    code              a conversation or text with a fenced code block
    truncated         a piece of a split sample, or a document cut to the capacity in a source that truncated
    packed_row        the shortest whole pack of two or more documents (the most documents among equals)
    preference_pair   both answers of a pair (a build with preference sources only)
    completion_group  the completions of a group (a build with group sources only)
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packtool.arrow import list_parts
from packtool.format import KIND_CODES, ROLE_CODES, WHOLE
from packtool.shards import read_columns

KINDS = ("short_text", "empty_field", "tools", "unicode", "code", "truncated", "packed_row")
OPTIONAL_KINDS = ("preference_pair", "completion_group")  # looked for; their absence is no gap in a plain build
# Selection reads at most this many packs (manifest order) and source records per source: a bound on a
# large build's cost, still a fixed function of the build.
MAX_PACKS = 2048
MAX_RECORDS = 20_000  # ~70 us a record to parse again: about 1.4 s a source at most (docs/canary.md)
LATIN_END = 0x24F  # Latin Extended-B: above it, scripts and symbols a byte-level tokenizer splits oddly
_BEYOND_LATIN = re.compile(f"[^\\x00-\\u{LATIN_END:04x}]")
_TEXT, _TOOL, _ASSISTANT = ROLE_CODES["text"], ROLE_CODES["tool"], ROLE_CODES["assistant"]
_CHAT_ROLES = [ROLE_CODES[r] for r in ("system", "user", "assistant", "tool")]
_TOKEN_COLUMNS = ["input_ids", "token_roles"]
_COLUMNS = [*_TOKEN_COLUMNS, "doc_cu_seqlens", "sample_ids", "sample_hashes", "sources"]
_SEGMENTS = ["segment_kinds", "segment_groups", "segment_pieces"]


@dataclass(frozen=True, slots=True)
class Canary:
    """One canary: the documents of one pack (None: the whole pack) and the sample ids they hold."""

    kind: str
    shard: Path
    row: int
    documents: tuple[int, ...] | None
    sample_ids: tuple[str, ...]
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        """As the manifest records it: the shard by its file name in the output folder."""
        documents = None if self.documents is None else list(self.documents)
        return {
            "kind": self.kind,
            "shard": self.shard.name,
            "row": self.row,
            "documents": documents,
            "sample_ids": list(self.sample_ids),
            "tokens": self.tokens,
        }

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], folder: Path) -> Canary:
        """A recorded entry (checked by format.manifest_problems), its shard in `folder`."""
        documents = entry["documents"]
        return cls(
            entry["kind"],
            folder / entry["shard"],
            entry["row"],
            None if documents is None else tuple(documents),
            tuple(entry["sample_ids"]),
            entry["tokens"],
        )


@dataclass(frozen=True, slots=True)
class CanarySet:
    canaries: tuple[Canary, ...]
    missing: dict[str, str]  # kind -> why the build has none

    def as_dict(self) -> dict[str, Any]:
        """The manifest's `canaries`."""
        return {"set": [c.as_dict() for c in self.canaries], "missing": dict(self.missing)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], folder: Path) -> CanarySet:
        return cls(tuple(Canary.from_dict(e, folder) for e in record["set"]), dict(record["missing"]))


@dataclass(frozen=True, slots=True)
class _Doc:
    """One document as selection sees it."""

    shard: Path
    row: int
    document: int
    start: int
    end: int
    sample_id: str
    sample_hash: str
    source: str


@dataclass
class _Best:
    """The candidates so far: the shortest document of each kind (first among equals), the fullest pack."""

    docs: dict[str, tuple[int, _Doc]] = field(default_factory=dict)
    # (tokens, -documents, shard, row, its sample ids)
    pack: tuple[int, int, Path, int, tuple[str, ...]] | None = None
    grouped: dict[str, tuple[Path, int, tuple[int, ...], tuple[str, ...], int]] = field(default_factory=dict)
    # the sample hashes of the records with an empty field, read before the packs, and the first document of each
    # met: a document per hash of every pack read was ~300 B a document, ~10 MB at 2,048 packs of 15 (issue 43)
    empty: set[str] = field(default_factory=set)
    by_hash: dict[str, tuple[int, _Doc]] = field(default_factory=dict)

    def offer(self, kind: str, length: int, doc: _Doc) -> None:
        if kind not in self.docs or length < self.docs[kind][0]:
            self.docs[kind] = (length, doc)


def choose_canaries(
    files: Sequence[Path],
    capacity: int,
    accounting: Mapping[str, Any],
    decoder: Any,
    sources: Sequence[Any] | None,
    unreadable: str = "",
    *,
    images: bool = False,
) -> CanarySet:
    """The canary set of the shards `files` (in manifest order) of a build of `capacity`, whose manifest
    `accounting` says which sources truncated; `decoder` is the build's tokenizers.Tokenizer and `sources` its
    SourceConfigs (None: the records cannot be read, `unreadable` says why), their records read with their
    images when the build had an image processor (`images`), as the build read them."""
    truncating = {name for name, counts in accounting.items() if _truncated(counts)}
    if sources is None:
        empty: list[tuple[str, str]] = []
        empty_why = f"the build's source records could not be read ({unreadable})"
    else:
        empty, empty_why = _empty_records(sources, images)
    best = _Best(empty={sample_hash for sample_hash, _ in empty})
    for shard, row, pack in _packs(files):
        _offer_pack(best, shard, row, pack, decoder, capacity, truncating)
    for sample_hash, source in empty:
        hit = best.by_hash.get(sample_hash)
        if hit is not None and hit[1].source == source:
            best.offer("empty_field", *hit)
    canaries = [
        Canary(k, d.shard, d.row, (d.document,), (d.sample_id,), n)
        for k in KINDS
        if k in best.docs
        for n, d in [best.docs[k]]
    ]
    if best.pack is not None:
        tokens, _, shard, row, ids = best.pack
        canaries.append(Canary("packed_row", shard, row, None, ids, tokens))
    for kind in OPTIONAL_KINDS:
        if kind in best.grouped:
            shard, row, docs, ids, tokens = best.grouped[kind]
            canaries.append(Canary(kind, shard, row, docs, ids, tokens))
    found = {c.kind for c in canaries}
    missing = {k: _why_missing(k, empty_why) for k in (*KINDS, *OPTIONAL_KINDS) if k not in found}
    return CanarySet(tuple(sorted(canaries, key=lambda c: (KINDS + OPTIONAL_KINDS).index(c.kind))), missing)


def _truncated(counts: Any) -> bool:
    truncated = counts.get("truncated") if isinstance(counts, dict) else None
    return isinstance(truncated, dict) and any(v.get("samples", 0) for v in truncated.values() if isinstance(v, dict))


def _why_missing(kind: str, empty_why: str) -> str:
    if kind == "empty_field":
        return empty_why
    if kind == "packed_row":
        return f"no pack holds two or more documents in the first {MAX_PACKS} packs"
    what = {
        "short_text": "no document of text tokens only (no text source)",
        "tools": "no conversation with a tool result and two or more assistant turns",
        "unicode": "no document with a character beyond the Latin scripts",
        "code": "no document with a fenced code block (```)",
        "truncated": "no sample was cut (no split piece, no document cut to the capacity)",
        "preference_pair": "no preference pair (no preference source)",
        "completion_group": "no completion group (no group source)",
    }[kind]
    return f"{what} in the first {MAX_PACKS} packs"


def _packs(files: Sequence[Path]) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """Each pack of the first MAX_PACKS: its token columns as numpy views, its per-document columns as lists.

    The tokens stay numpy: as Python lists, MAX_PACKS packs of a 2048 capacity were ~300 MB of int objects
    at once (a fixed cost, but the largest of a build's publish)."""
    seen = 0
    for shard in files:
        if seen == MAX_PACKS:
            return
        table = read_columns(shard, _COLUMNS, _SEGMENTS).slice(0, MAX_PACKS - seen)  # a large shard: no more rows
        tokens = {name: list_parts(table.column(name)) for name in _TOKEN_COLUMNS}
        per_document = {name: table.column(name).to_pylist() for name in table.column_names if name not in tokens}
        for row in range(table.num_rows):
            seen += 1
            pack = {name: values[offsets[row] : offsets[row + 1]] for name, (offsets, values) in tokens.items()}
            yield shard, row, pack | {name: values[row] for name, values in per_document.items()}


def _offer_pack(
    best: _Best, shard: Path, row: int, pack: dict[str, Any], decoder: Any, capacity: int, truncating: set[str]
) -> None:
    docs = pack["doc_cu_seqlens"]
    roles = pack["token_roles"]
    chat = np.isin(roles, _CHAT_ROLES)
    count = len(docs) - 1
    if count >= 2:
        key = (len(pack["input_ids"]), -count, shard, row, tuple(pack["sample_ids"]))
        if best.pack is None or key[:2] < best.pack[:2]:
            best.pack = key
    kinds = pack.get("segment_kinds")
    for d in range(count):
        start, end = docs[d], docs[d + 1]
        doc = _Doc(shard, row, d, start, end, pack["sample_ids"][d], pack["sample_hashes"][d], pack["sources"][d])
        if doc.sample_hash in best.empty:
            best.by_hash.setdefault(doc.sample_hash, (end - start, doc))
        if kinds is not None and kinds[d] != KIND_CODES["single"]:
            _offer_grouped(best, shard, row, pack, d)
            continue
        for kind in _document_kinds(best, pack, d, roles[start:end], chat[start:end], decoder, capacity, truncating):
            best.offer(kind, end - start, doc)


def _document_kinds(
    best: _Best,
    pack: dict[str, Any],
    d: int,
    roles: np.ndarray,
    chat_tokens: np.ndarray,
    decoder: Any,
    capacity: int,
    truncating: set[str],
) -> list[str]:
    """The kinds document `d` qualifies for, where it could still be the chosen one of that kind."""
    start, end = pack["doc_cu_seqlens"][d], pack["doc_cu_seqlens"][d + 1]
    chat = bool(chat_tokens.any())
    kinds = []
    if not chat and (roles == _TEXT).any():
        kinds.append("short_text")
    if chat and (roles == _TOOL).any() and _runs(roles == _ASSISTANT) >= 2:
        kinds.append("tools")
    pieces = pack.get("segment_pieces")
    if (pieces is not None and pieces[d] != WHOLE) or (end - start == capacity and pack["sources"][d] in truncating):
        kinds.append("truncated")
    if all(kind in best.docs and best.docs[kind][0] <= end - start for kind in ("unicode", "code")):
        return kinds  # no shorter than both chosen so far: decoding it could change neither (the costly part)
    text = decoder.decode(pack["input_ids"][start:end].tolist(), skip_special_tokens=False)
    if _BEYOND_LATIN.search(text):
        kinds.append("unicode")
    if "```" in text:
        kinds.append("code")
    return kinds


def _runs(flags: np.ndarray) -> int:
    """How many runs of True `flags` holds (turns of one role)."""
    return int(flags[0]) + int((flags[1:] & ~flags[:-1]).sum()) if len(flags) else 0


def _offer_grouped(best: _Best, shard: Path, row: int, pack: dict[str, Any], d: int) -> None:
    """The first pair and the first group met: every document of that group in this pack."""
    kind = "completion_group" if pack["segment_kinds"][d] == KIND_CODES["completion"] else "preference_pair"
    if kind in best.grouped:
        return
    group = pack["segment_groups"][d]
    docs = tuple(i for i, g in enumerate(pack["segment_groups"]) if g == group)
    cu = pack["doc_cu_seqlens"]
    tokens = sum(cu[i + 1] - cu[i] for i in docs)
    best.grouped[kind] = (shard, row, docs, tuple(pack["sample_ids"][i] for i in docs), tokens)


def _empty_records(sources: Sequence[Any], images: bool) -> tuple[list[tuple[str, str]], str]:
    """(sample hash, source) of each record, in order, whose record holds an empty message or text (the shortest
    kept document of them is the empty_field canary), and the reason when none is kept."""
    from packtool.records import Example
    from packtool.sources import read_source

    found = []
    for source in sources:
        for number, example in enumerate(read_source(source, images=images)):
            if number == MAX_RECORDS:
                break
            # a pair or a group is chosen whole (preference_pair, completion_group); a bad record was never kept
            if isinstance(example, Example) and _has_empty_field(example):
                found.append((example.sample_hash, source.name))
    return found, f"no kept record with an empty message or text in the first {MAX_RECORDS} records of each source"


def _has_empty_field(example: Any) -> bool:
    if example.text is not None:
        return example.text == ""
    return any(m.content == "" and not m.image_at for m in example.messages)  # a picture alone is no empty message
