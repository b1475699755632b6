"""`packtool canary`: the last check before a long run, on the build itself and the model to train.

1. The canary set (packtool.canaries): one document of each risky kind, recorded in the manifest at build time
   (`canaries`), so the same build always prints the same canaries; an output built before that field gets
   the set selected again, with a notice. Each is printed as `inspect` prints it.

2. The overfit: a tiny random copy of MODEL (or its weights) trains on the canary documents through
   packtool's own path (packtool.loader.overfit); the loss must fall by OVERFIT_FACTOR.
3. The end of a turn: for each chat canary, greedy generation from the prompt before its last answer
   must give that answer back, then the end-of-turn token the template printed after it, and that
   token must be one eos stops at.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packtool.canaries import KINDS, OPTIONAL_KINDS, Canary, CanarySet, choose_canaries
from packtool.commands.show import PackRef, load_decoder, pack_lines, visible
from packtool.errors import PacktoolError
from packtool.format import ROLE_CODES, Manifest
from packtool.labels import IGNORE_INDEX
from packtool.shards import locate

__all__ = ["KINDS", "OPTIONAL_KINDS", "canary", "canary_set", "format_canary", "select_canaries"]

CHAT_KINDS = ("empty_field", "tools", "unicode", "code")  # canaries whose last answer generation must give back
# The loss of the last step must be at most a tenth of the first's: the tiny copy falls 8.3 -> 0.1 (80x)
# on the quickstart canaries in 50 steps; labels that point at the wrong tokens plateau far above.
OVERFIT_FACTOR = 10.0
DEFAULT_STEPS = 60
_ASSISTANT = ROLE_CODES["assistant"]
SELECTED_NOW = "the manifest records no canary set (built before packtool recorded one): selected now from the build"


def canary_set(output: str | Path) -> tuple[CanarySet, bool]:
    """The canary set the manifest records (and True), or for an older output the one selected now (and False)."""
    folder, manifest, _ = locate(output)
    recorded = manifest.raw.get("canaries") if manifest is not None and Path(output).is_dir() else None
    if recorded is not None:
        return CanarySet.from_dict(recorded, folder), True
    return select_canaries(output), False


def select_canaries(output: str | Path) -> CanarySet:
    """The canary set of an output folder selected from its shards, manifest and source records, as the builder
    selects it before recording it (packtool.canaries)."""
    from packtool.commands.find import SourceFiles

    folder, manifest, files = locate(output)
    if manifest is None or not Path(output).is_dir():
        raise PacktoolError(f"{output}: give the output folder (the one holding manifest.json), not one shard")
    decoder = load_decoder(files[0], manifest, None, folder)
    sources = SourceFiles(folder, manifest, None)
    config = sources.config
    return choose_canaries(
        files,
        manifest.capacity,
        manifest.raw.get("accounting") or {},
        decoder,
        None if config is None else config.sources,
        "" if config is not None else sources.describe(),
        images=config is not None and config.processor is not None,
    )


def _ref(item: Canary) -> PackRef:
    return PackRef(item.shard, item.row, item.documents)


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
    recorded: bool = True  # the set is the manifest's (False: an older output's, selected now)

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
    chosen, recorded = canary_set(output)
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
        recorded,
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
        pack = checked_row(_ref(item))
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
    lines += [] if report.recorded else [f"notice: {SELECTED_NOW}"]
    lines += [f"missing: {kind}: {why}" for kind, why in report.missing.items()]
    for item in report.canaries:
        around = PACKED_AROUND if item.documents is None else None
        lines += ["", f"== {item.kind}: {', '.join(item.sample_ids[:4])}{' ...' if len(item.sample_ids) > 4 else ''}"]
        lines += pack_lines(_ref(item), decoder, limit=None, around=around, color=color, text=around is None)
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
