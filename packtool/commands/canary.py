"""`packtool canary`: the last check before a long run, on the build itself and the model to train.

1. The canary set: one document of each risky kind, chosen from the build by a pure function of its
   sealed shards and manifest (and, for an empty field, of its source records), so the same build
   always gives the same canaries; each printed as `inspect` prints it.

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

2. The overfit: a tiny random copy of MODEL (or its weights) trains on the canary documents through
   packtool's own path (packtool.loader.overfit); the loss must fall by OVERFIT_FACTOR.
3. The end of a turn: for each chat canary, greedy generation from the prompt before its last answer
   must give that answer back, then the end-of-turn token the template printed after it, and that
   token must be one eos stops at.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packtool.commands.show import PackRef, load_decoder, pack_lines, visible
from packtool.errors import PacktoolError
from packtool.format import KIND_CODES, ROLE_CODES, WHOLE, Manifest
from packtool.labels import IGNORE_INDEX
from packtool.shards import locate, read_columns

KINDS = ("short_text", "empty_field", "tools", "unicode", "code", "truncated", "packed_row")
OPTIONAL_KINDS = ("preference_pair", "completion_group")  # looked for; their absence is no gap in a plain build
CHAT_KINDS = ("empty_field", "tools", "unicode", "code")  # canaries whose last answer generation must give back
# The loss of the last step must be at most a tenth of the first's: the tiny copy falls 8.3 -> 0.1 (80x)
# on the quickstart canaries in 50 steps; labels that point at the wrong tokens plateau far above.
OVERFIT_FACTOR = 10.0
DEFAULT_STEPS = 60
# Selection reads at most this many packs (manifest order) and source records per source: a bound on a
# large build's cost, still a fixed function of the build.
MAX_PACKS = 2048
MAX_RECORDS = 100_000
LATIN_END = 0x24F  # Latin Extended-B: above it, scripts and symbols a byte-level tokenizer splits oddly
_TEXT, _TOOL, _ASSISTANT = ROLE_CODES["text"], ROLE_CODES["tool"], ROLE_CODES["assistant"]
_CHAT_ROLES = [ROLE_CODES[r] for r in ("system", "user", "assistant", "tool")]
_COLUMNS = ["input_ids", "labels", "token_roles", "doc_cu_seqlens", "sample_ids", "sample_hashes", "sources"]
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

    @property
    def ref(self) -> PackRef:
        return PackRef(self.shard, self.row, self.documents)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shard": self.shard.name, "documents": self.documents}


@dataclass(frozen=True, slots=True)
class CanarySet:
    canaries: tuple[Canary, ...]
    missing: dict[str, str]  # kind -> why the build has none


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
    pack: tuple[int, int, Path, int, int] | None = None  # (tokens, -documents, shard, row, documents)
    grouped: dict[str, tuple[Path, int, tuple[int, ...], tuple[str, ...], int]] = field(default_factory=dict)
    by_hash: dict[str, tuple[int, _Doc]] = field(default_factory=dict)

    def offer(self, kind: str, length: int, doc: _Doc) -> None:
        if kind not in self.docs or length < self.docs[kind][0]:
            self.docs[kind] = (length, doc)


def select_canaries(output: str | Path) -> CanarySet:
    """The canary set of an output folder: a pure function of its shards and manifest (see the module docstring)."""
    folder, manifest, files = locate(output)
    if manifest is None or not Path(output).is_dir():
        raise PacktoolError(f"{output}: give the output folder (the one holding manifest.json), not one shard")
    decoder = load_decoder(files[0], manifest, None, folder)
    truncating = {name for name, counts in (manifest.raw.get("accounting") or {}).items() if _truncated(counts)}
    best = _Best()
    for shard, row, pack in _packs(files):
        _offer_pack(best, shard, row, pack, decoder, manifest.capacity, truncating)
    empty_why = _offer_empty(best, folder, manifest)
    canaries = [
        Canary(k, d.shard, d.row, (d.document,), (d.sample_id,), n)
        for k in KINDS
        if k in best.docs
        for n, d in [best.docs[k]]
    ]
    if best.pack is not None:
        tokens, _, shard, row, _ = best.pack
        ids = tuple(_column(shard, "sample_ids")[row])
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


def _packs(files: list[Path]) -> Iterator[tuple[Path, int, dict[str, list[Any]]]]:
    seen = 0
    for shard in files:
        table = read_columns(shard, _COLUMNS, _SEGMENTS)
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        for row in range(table.num_rows):
            if seen == MAX_PACKS:
                return
            seen += 1
            yield shard, row, {name: values[row] for name, values in columns.items()}


def _offer_pack(
    best: _Best, shard: Path, row: int, pack: dict[str, Any], decoder: Any, capacity: int, truncating: set[str]
) -> None:
    docs = pack["doc_cu_seqlens"]
    roles = np.asarray(pack["token_roles"], dtype=np.int8)
    count = len(docs) - 1
    if count >= 2:
        key = (len(pack["input_ids"]), -count, shard, row, count)
        if best.pack is None or key[:2] < best.pack[:2]:
            best.pack = key
    kinds = pack.get("segment_kinds")
    for d in range(count):
        start, end = docs[d], docs[d + 1]
        doc = _Doc(shard, row, d, start, end, pack["sample_ids"][d], pack["sample_hashes"][d], pack["sources"][d])
        best.by_hash.setdefault(doc.sample_hash, (end - start, doc))
        if kinds is not None and kinds[d] != KIND_CODES["single"]:
            _offer_grouped(best, shard, row, pack, d)
            continue
        for kind in _document_kinds(pack, d, roles[start:end], decoder, capacity, truncating):
            best.offer(kind, end - start, doc)


def _document_kinds(
    pack: dict[str, Any], d: int, roles: np.ndarray, decoder: Any, capacity: int, truncating: set[str]
) -> list[str]:
    start, end = pack["doc_cu_seqlens"][d], pack["doc_cu_seqlens"][d + 1]
    chat = bool(np.isin(roles, _CHAT_ROLES).any())
    kinds = []
    if not chat and (roles == _TEXT).any():
        kinds.append("short_text")
    if chat and (roles == _TOOL).any() and _runs(roles == _ASSISTANT) >= 2:
        kinds.append("tools")
    pieces = pack.get("segment_pieces")
    if (pieces is not None and pieces[d] != WHOLE) or (end - start == capacity and pack["sources"][d] in truncating):
        kinds.append("truncated")
    text = decoder.decode(pack["input_ids"][start:end], skip_special_tokens=False)
    if any(ord(ch) > LATIN_END for ch in text):
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


def _offer_empty(best: _Best, folder: Path, manifest: Manifest) -> str:
    """Offer the shortest kept sample whose record holds an empty message or text; the reason when none."""
    from packtool.commands.find import SourceFiles
    from packtool.records import RecordError
    from packtool.sources import read_source

    sources = SourceFiles(folder, manifest, None)
    if sources.config is None:
        return f"the build's source records could not be read ({sources.describe()})"
    for source in sources.config.sources:
        for number, example in enumerate(read_source(source)):
            if number == MAX_RECORDS:
                break
            if isinstance(example, RecordError) or not _has_empty_field(example):
                continue
            hit = best.by_hash.get(example.sample_hash)
            if hit is not None and hit[1].source == source.name:
                best.offer("empty_field", *hit)
    return f"no kept record with an empty message or text in the first {MAX_RECORDS} records of each source"


def _has_empty_field(example: Any) -> bool:
    if example.text is not None:
        return example.text == ""
    return any(m.content == "" for m in example.messages)


def _column(shard: Path, name: str) -> list[Any]:
    return read_columns(shard, [name]).column(name).to_pylist()


# ---- the overfit and the end of a turn ----


@dataclass(frozen=True, slots=True)
class Turn:
    """What one chat canary must generate: its last answer, then the end-of-turn token after it."""

    kind: str
    sample_id: str
    prompt: np.ndarray
    answer: tuple[int, ...]
    end_of_turn: int  # the special token the template printed after the answer (-1: none)
    end_trained: bool  # whether that token is a target


@dataclass(frozen=True, slots=True)
class TurnCheck:
    kind: str
    sample_id: str
    answer_tokens: int
    reproduced: int  # leading answer tokens generated right
    ended: bool  # the token after the answer was the end-of-turn token
    end_of_turn: str  # its piece
    failures: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CanaryReport:
    output: str
    model: str
    canaries: tuple[Canary, ...]
    missing: dict[str, str]
    description: str = ""
    feed: str = ""
    notices: tuple[str, ...] = ()
    losses: tuple[float, ...] = ()
    factor: float = math.nan
    eos: tuple[int, ...] = ()
    eos_from: str = ""
    turns: tuple[TurnCheck, ...] = ()
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["canaries"] = [c.as_dict() for c in self.canaries]
        out["factor"] = None if math.isnan(self.factor) else self.factor
        return {"ok": self.ok, **out}


def canary(
    output: str | Path, model: str = "llama", *, weights: bool = False, steps: int = DEFAULT_STEPS
) -> CanaryReport:
    """The canary set of `output`, the overfit of MODEL on it and the generation checks (module docstring)."""
    from packtool.loader.overfit import generation_eos, greedy, guarded_feed, load_model, overfit

    if steps < 1:
        raise PacktoolError(f"--steps {steps}: give 1 or more")
    chosen = select_canaries(output)
    folder, manifest, files = locate(output)
    decoder = load_decoder(files[0], manifest, None, folder)
    packs, turns = _training_rows(chosen.canaries, special_ids(decoder))
    header = generation_header(folder, manifest) if turns else None
    tuned = load_model(model, vocab_size=decoder.get_vocab_size(with_added_tokens=True), weights=weights)
    feed, notices = guarded_feed(tuned.model)
    losses = overfit(tuned.model, packs, feed, steps=steps)
    failures = []
    factor = losses[0] / max(losses[-1], 1e-12)
    if not factor >= OVERFIT_FACTOR:
        failures.append(
            f"the loss fell {losses[0]:.3f} -> {losses[-1]:.3f} ({factor:.1f}x) in {steps} steps, less than "
            f"{OVERFIT_FACTOR:g}x: the model does not learn the canaries (labels, mask or too few --steps)"
        )
    stated = generation_eos(model)
    eos, eos_from = stated if stated is not None else (_tokenizer_eos(manifest), "the build tokenizer's eos")
    checks = tuple(
        _check_turn(turn, greedy(tuned.model, turn.prompt, len(turn.answer) + 1), decoder, header) for turn in turns
    )
    failures += [line for check in checks for line in check.failures]
    failures += _eos_failures(turns, eos, eos_from, decoder)
    return CanaryReport(
        str(output),
        model,
        chosen.canaries,
        chosen.missing,
        tuned.description,
        getattr(feed, "__name__", "?"),
        notices,
        tuple(losses),
        factor,
        eos,
        eos_from,
        checks,
        tuple(failures),
    )


def generation_header(folder: Path, manifest: Manifest | None) -> str | None:
    """What the build's template prints for add_generation_prompt (`<|im_start|>assistant\\n`), from the config
    the manifest records; None where the config or template cannot be read, or the template prints none."""
    from packtool.chat_templates import template_for
    from packtool.commands.find import SourceFiles
    from packtool.encode import load_tokenizer

    if manifest is None:
        return None
    config = SourceFiles(folder, manifest, None).config
    if config is None:
        return None
    try:
        template = template_for(config, load_tokenizer(config.tokenizer).config)
    except PacktoolError:
        return None
    return template.generation_header if template is not None else None


def _tokenizer_eos(manifest: Manifest | None) -> tuple[int, ...]:
    eos = manifest.raw.get("tokenizer", {}).get("eos_token_id") if manifest is not None else None
    return (eos,) if isinstance(eos, int) else ()


def _training_rows(canaries: tuple[Canary, ...], special: frozenset[int]) -> tuple[list[Any], list[Turn]]:
    """The packs the overfit trains on (the documents of every canary packed in one row, the packed row as
    built) and the turns the chat canaries must generate."""
    from packtool.commands.show import checked_row
    from packtool.loader.collate import LoadedPack

    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    packs, turns = [], []
    seen: set[tuple[Path, int, int, str]] = set()  # documents trained ("doc") and turns checked ("turn")
    for item in canaries:
        pack = checked_row(item.ref)
        all_ids = np.asarray(pack["input_ids"], dtype=np.int64)
        all_labels = np.asarray(pack["labels"], dtype=np.int64)
        if item.documents is None:
            packs.append(LoadedPack(all_ids, all_labels, np.asarray(pack["doc_cu_seqlens"], dtype=np.int64)))
            continue
        cu = pack["doc_cu_seqlens"]
        for d in item.documents:
            lo, hi = cu[d], cu[d + 1]
            if (item.shard, item.row, d, "doc") not in seen:
                seen.add((item.shard, item.row, d, "doc"))
                ids.append(all_ids[lo:hi])
                labels.append(all_labels[lo:hi])
            if item.kind in CHAT_KINDS and (item.shard, item.row, d, "turn") not in seen:
                seen.add((item.shard, item.row, d, "turn"))
                roles = np.asarray(pack["token_roles"][lo:hi], dtype=np.int8)
                turn = _last_turn(item.kind, pack["sample_ids"][d], all_ids[lo:hi], all_labels[lo:hi], roles, special)
                if turn is not None:
                    turns.append(turn)
    if ids:
        lengths = np.cumsum([0, *map(len, ids)])
        packs.insert(0, LoadedPack(np.concatenate(ids), np.concatenate(labels), lengths))
    return packs, turns


def _last_turn(
    kind: str, sample_id: str, ids: np.ndarray, labels: np.ndarray, roles: np.ndarray, special: frozenset[int]
) -> Turn | None:
    """The document's last trained answer: the last run of targets with an assistant token, the prompt before
    it, and the first template-written special token after its assistant tokens (the end of the turn)."""
    assistant = np.flatnonzero((roles == _ASSISTANT) & (labels != IGNORE_INDEX))
    if not len(assistant):
        return None
    last = int(assistant[-1])
    start = last
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    after = [t for t in range(start, len(ids)) if int(ids[t]) in special]
    end = after[0] if after else -1
    answer = ids[start:end] if end >= 0 else ids[start : last + 1]
    return Turn(
        kind,
        sample_id,
        ids[:start],
        tuple(int(t) for t in answer),
        int(ids[end]) if end >= 0 else -1,
        end >= 0 and labels[end] != IGNORE_INDEX,
    )


def special_ids(decoder: Any) -> frozenset[int]:
    """The tokenizer's special tokens: the end-of-turn markers a template prints are among them."""
    return frozenset(i for i, token in decoder.get_added_tokens_decoder().items() if token.special)


def _check_turn(turn: Turn, generated: list[int], decoder: Any, header: str | None) -> TurnCheck:
    """The generated tokens against the trained answer and its end; `header`: the template's generation prompt
    (None: unknown), which the trained prompt must end with, or serving renders another prompt than training."""
    n = len(turn.answer)
    reproduced = next((i for i in range(n) if generated[i] != turn.answer[i]), n)
    piece = _piece(decoder, turn.end_of_turn) if turn.end_of_turn >= 0 else "?"
    where = f"{turn.kind} canary {turn.sample_id!r}"
    failures = []
    if header is not None and not decoder.decode(turn.prompt.tolist(), skip_special_tokens=False).endswith(header):
        failures.append(
            f"{where}: the trained prompt does not end with the template's generation prompt {visible(header)!r}: "
            "serving (add_generation_prompt) renders another prompt than the one trained"
        )
    if reproduced < n:
        failures.append(
            f"{where}: the answer is not reproduced: token {reproduced} of {n} is "
            f"{_piece(decoder, generated[reproduced])!r}, trained {_piece(decoder, turn.answer[reproduced])!r} "
            "(raise --steps, or the answer's labels are off)"
        )
    ended = turn.end_of_turn >= 0 and generated[n] == turn.end_of_turn
    if turn.end_of_turn < 0:
        failures.append(
            f"{where}: the generated turn does not end: the template prints no special token after the answer"
        )
    elif not turn.end_trained:
        failures.append(
            f"{where}: the generated turn does not end with {piece!r} (id {turn.end_of_turn}): the end-of-turn marker "
            "is never a target (train.end_of_turn: false, or a template quirk that leaves it out of the targets)"
        )
    elif not ended and reproduced == n:
        failures.append(
            f"{where}: the generated turn does not end: {_piece(decoder, generated[n])!r} follows the answer, "
            f"not {piece!r} (raise --steps)"
        )
    return TurnCheck(turn.kind, turn.sample_id, n, reproduced, ended, piece, tuple(failures))


def _eos_failures(turns: list[Turn], eos: tuple[int, ...], eos_from: str, decoder: Any) -> list[str]:
    """One line per end-of-turn token that eos does not include: generation runs past the end of the turn."""
    ends = dict.fromkeys(t.end_of_turn for t in turns if t.end_of_turn >= 0 and t.end_of_turn not in eos)
    return [
        f"eos {list(eos)} in {eos_from} differs from the template's end-of-turn token {_piece(decoder, end)!r} "
        f"(id {end}): generation would not stop at the end of a turn; add {end} to its eos_token_id"
        for end in ends
    ]


def _piece(decoder: Any, token: int) -> str:
    return visible(decoder.decode([int(token)], skip_special_tokens=False))


# ---- what is printed ----

PACKED_AROUND = 2  # the packed row is shown at its boundaries (inspect --around): a full pack is ~capacity lines


def format_canary(report: CanaryReport, *, color: bool = False) -> str:
    """The canary set token by token (as `inspect` prints it), the loss curve and the generation checks."""
    folder, manifest, files = locate(report.output)
    decoder = load_decoder(files[0], manifest, None, folder)
    lines = [f"canary set of {report.output}: {len(report.canaries)} canaries"]
    lines += [f"missing: {kind}: {why}" for kind, why in report.missing.items()]
    for item in report.canaries:
        around = PACKED_AROUND if item.documents is None else None
        lines += ["", f"== {item.kind}: {', '.join(item.sample_ids[:4])}{' ...' if len(item.sample_ids) > 4 else ''}"]
        lines += pack_lines(item.ref, decoder, limit=None, around=around, color=color, text=around is None)
    lines += ["", f"overfit: {report.description}, fed {report.feed}"]
    lines += [f"notice: {notice}" for notice in report.notices]
    lines.append(loss_curve(report.losses))
    lines.append(
        f"loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f} ({report.factor:.1f}x; "
        f"at least {OVERFIT_FACTOR:g}x needed)"
    )
    eos = ", ".join(map(str, report.eos)) or "none"
    lines.append(f"eos: {eos} ({report.eos_from})")
    for turn in report.turns:
        state = "ok" if not turn.failures else "FAILED"
        lines.append(
            f"generation {state}: {turn.kind} canary {turn.sample_id}: {turn.reproduced}/{turn.answer_tokens} answer "
            f"tokens, {'ends with' if turn.ended else 'does not end with'} {turn.end_of_turn!r}"
        )
    lines += [f"FAILED: {line}" for line in report.failures]
    lines.append(
        "ok: the canaries overfit and every generated turn ends where the template ends it"
        if report.ok
        else f"{len(report.failures)} failure(s)"
    )
    return "\n".join(lines)


def loss_curve(losses: tuple[float, ...], points: int = 10) -> str:
    """About `points` steps of the curve, the first and the last always among them."""
    every = max(1, math.ceil(len(losses) / points))
    shown = sorted({*range(0, len(losses), every), len(losses) - 1})
    return "loss by step: " + "  ".join(f"{i + 1}: {losses[i]:.3f}" for i in shown)
