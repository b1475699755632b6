"""Known openings: the template text that starts many samples, tokenized once and proven to cut cleanly.

Most conversations open with the same template text: Qwen2.5 prints its default system prompt in front
of every conversation that has none (22 of an alpaca sample's ~150 tokens), Llama 3.2 a dated system
header. `tokenizers` cuts a text at its added tokens first and tokenizes the pieces between them on
their own, so for an opening that ends with an added token T

    tokens(opening + rest) == tokens(opening) + tokens(rest)      (offsets of the rest shifted)

unless something lets T's match, or the piece after T, see across the cut. What could, and is ruled
out for T before an opening is tried (cut_tokens):
  - T strips the whitespace after it (`rstrip`: Phi-3's `<|end|>` swallows the next newline);
  - T is matched after normalization, or is part of a longer added token (the match could run on);
  - T ends in a space or a word character (a `single_word` token after it sees another boundary);
  - the pre-tokenizer treats the text's first piece apart (Metaspace with prepend_scheme "first"):
    then no opening is used at all.
Before any sample uses an opening, T is proven on a set of awkward continuations (spaces, newlines,
every added token, byte-level and SentencePiece markers, CJK, an emoji; once per token: what follows
T cannot depend on what precedes it), and the opening on the start of the sample it came from. One
that differs is refused for good.

Candidates end before a message's content (the last cut token before it) that comes before the
first target: the template's own text, that text with a system prompt or tool list many records
share. The opening used last is tried first (most samples of a source share one), then the longest
known candidate. A candidate is tried when it is seen a second time, so one that
holds what differs per record costs a search (~1-5 us) and no proof, and what is remembered stays
bounded (MAX_REMEMBERED). None of this changes a token: it decides only how much text goes through
the tokenizer again.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding, Tokenizer

from packtool.records import literal_pattern

# Fewer tokens than this are not worth the indirection (Qwen3's `<|im_start|>` alone: one token).
MIN_TOKENS = 8
# Candidates remembered per tokenizer and process: those seen once are forgotten together past this
# many (a tool list that comes back within that many samples is still proven), and no more are proven
# or refused once this many are.
MAX_REMEMBERED = 4096
REST_CHECKED = 256  # characters of the sample's own rest checked behind a new opening
AWKWARD = ("", " ", "  x", "\n", "\n\n x", "\t\ty", "x", "Hello world", "Ġx", "▁x", "é", "你好", "😀", "12 345")


@dataclass(frozen=True)
class Opening:
    """A text start and its tokens: ids, and each token's first character and end."""

    text: str
    ids: np.ndarray  # int32
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def tokens_before(self, at: int) -> int:
        """How many of the opening's tokens start before character `at` (at <= len(text))."""
        return bisect_left(self.starts, at)


class KnownOpenings:
    """The openings proven for one tokenizer in this process (shared by the encode threads)."""

    def __init__(self, tokenizer: Tokenizer, enabled: bool):
        """`enabled` False where the pre-tokenizer treats the first piece of a text apart (Metaspace
        with prepend_scheme "first"): a rest tokenized alone would start a text."""
        self.tokenizer = tokenizer
        self._cut = literal_pattern(cut_tokens(tokenizer)) if enabled else None
        self._added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        self._known: dict[str, Opening] = {}
        self._seen: set[str] = set()  # candidates seen once (forgotten together past MAX_REMEMBERED)
        self._refused: set[str] = set()
        self._tokens: dict[str, bool] = {}  # cut token -> proven on the awkward continuations
        self._last: Opening | None = None  # most samples of a source share one opening
        self._lock = threading.Lock()

    def find(self, text: str, stops: Sequence[int]) -> Opening | None:
        """The opening used last where `text` starts with it within the last of `stops`, else the longest
        known one among the candidates that end with the last cut token at or before each of `stops`
        (ascending character positions); a candidate seen before is proven (or refused) here first."""
        limit = stops[-1] if stops else 0
        last = self._last
        if last is not None and len(last.text) <= limit and text.startswith(last.text):
            return last
        if self._cut is None:
            return None
        found = [(match.end(), match.group()) for match in self._cut.finditer(text, 0, limit)]
        ends = [end for end, _ in found]
        for end, token in sorted({found[i - 1] for stop in stops if (i := bisect_right(ends, stop))}, reverse=True):
            candidate = text[:end]
            opening = self._known.get(candidate) or self._sighted(candidate, token, text[end:])
            if opening is not None:
                self._last = opening
                return opening
        return None

    def _sighted(self, candidate: str, token: str, rest: str) -> Opening | None:
        """A candidate's first sighting is remembered, its second proves or refuses it."""
        if candidate in self._refused:
            return None
        with self._lock:  # one thread proves a candidate; the others find it known or refused
            if candidate in self._known or candidate in self._refused:
                return self._known.get(candidate)
            if candidate not in self._seen:
                if len(self._seen) >= MAX_REMEMBERED:
                    self._seen.clear()
                self._seen.add(candidate)
                return None
            if len(self._known) + len(self._refused) >= MAX_REMEMBERED:
                return None
            proven = self._proven(candidate, token, rest)
            if proven is None:
                self._refused.add(candidate)
            else:
                self._known[candidate] = proven
            return proven

    def _proven(self, candidate: str, token: str, rest: str) -> Opening | None:
        """The opening, where its cut token is proven and the sample's own start of the rest follows it as
        it follows nothing; what comes after a cut token does not depend on the text before it (the
        token's match ends every piece before it), so the awkward continuations run once per token."""
        encoding, clean = self._proof(candidate, (rest[:REST_CHECKED],))
        if len(encoding.ids) < MIN_TOKENS:
            return None
        if token not in self._tokens:
            self._tokens[token] = self._proof(token, (*AWKWARD, " ".join(self._added), "".join(self._added)))[1]
        if not (self._tokens[token] and clean):
            return None
        starts, ends = zip(*encoding.offsets)
        return Opening(candidate, np.asarray(encoding.ids, dtype=np.int32), starts, ends)

    def _proof(self, opening: str, continuations: Sequence[str]) -> tuple[Encoding, bool]:
        """The opening's encoding, and whether tokens(opening + c) == tokens(opening) + tokens(c), offsets
        included, for every continuation c. One encode_batch, which lets the other encode threads run: an
        encode call per text held the GIL (~1 ms for the proof of a glaive tool list)."""
        texts = [opening, *(opening + c for c in continuations), *continuations]
        encoding, *pieces = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        wholes, alones = pieces[: len(continuations)], pieces[len(continuations) :]
        shift = len(opening)
        clean = all(
            whole.ids == encoding.ids + alone.ids
            and whole.offsets == encoding.offsets + [(a + shift, b + shift) for a, b in alone.offsets]
            for whole, alone in zip(wholes, alones, strict=True)
        )
        return encoding, clean


def cut_tokens(tokenizer: Tokenizer) -> list[str]:
    """The added tokens an opening may end with (see the module docstring)."""
    added = [t for t in tokenizer.get_added_tokens_decoder().values() if t.content]
    contents = [t.content for t in added]
    return [
        t.content
        for t in added
        if not (t.rstrip or t.normalized or t.single_word)
        and not (t.content[-1].isspace() or t.content[-1].isalnum() or t.content[-1] == "_")
        and not any(t.content in other and t.content != other for other in contents)
    ]
