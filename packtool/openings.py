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
Each opening is then proven on the sample it came from and a set of awkward continuations (spaces,
newlines, every added token, byte-level and SentencePiece markers, CJK, an emoji) before any sample
uses it, and refused for good if one differs.

Candidates end before a message's content (the last cut token before it), up to the first target:
the template's own text, then that text with a system prompt many records share, and so on. A
candidate is tried when it is seen a second time, so one that holds what differs per record (a
user's prompt, a tool list) costs a search and no proof; after MAX_CANDIDATES distinct candidates no
new one is looked for, and the known ones stay in use. None of this changes a token: it decides only
how much text goes through the tokenizer again.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from packtool.records import literal_pattern

# Fewer tokens than this are not worth the indirection (Qwen3's `<|im_start|>` alone: one token).
MIN_TOKENS = 8
# Distinct candidates looked at per tokenizer and process: a candidate holding a user's prompt is new
# in every sample, and searching for candidates on every sample would cost ~1-10 us each.
MAX_CANDIDATES = 256
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
        self._known: tuple[Opening, ...] = ()  # longest first
        self._seen: set[str] = set()  # candidates seen once
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def find(self, text: str, stops: Sequence[int]) -> Opening | None:
        """The longest known opening of `text` that ends at or before the last of `stops`. Candidates end
        with the last cut token at or before each stop (ascending character positions), and one seen
        before is proven (or refused) here first, the longest first."""
        limit = stops[-1] if stops else 0
        for opening in self._known:
            if len(opening.text) <= limit and text.startswith(opening.text):
                return opening
        if self._cut is None or len(self._seen) >= MAX_CANDIDATES:
            return None
        ends = [match.end() for match in self._cut.finditer(text, 0, limit)]
        candidates = sorted({ends[i - 1] for stop in stops if (i := bisect_right(ends, stop))}, reverse=True)
        for end in candidates:
            candidate = text[:end]
            if candidate in self._refused:
                continue
            with self._lock:  # one thread proves a candidate; the others find it known or refused
                known = next((o for o in self._known if o.text == candidate), None)
                if known is not None:
                    return known
                if candidate in self._refused:
                    continue
                if candidate not in self._seen:
                    self._seen.add(candidate)
                    continue
                proven = self._proven(candidate, text[end:])
                if proven is None:
                    self._refused.add(candidate)
                    continue
                self._known = tuple(sorted((*self._known, proven), key=lambda o: len(o.text), reverse=True))
                return proven
        return None

    def _proven(self, candidate: str, rest: str) -> Opening | None:
        encoding = self.tokenizer.encode(candidate, add_special_tokens=False)
        if len(encoding.ids) < MIN_TOKENS:
            return None
        continuations = (rest, *AWKWARD, " ".join(self._added), "".join(self._added))
        for continuation in continuations:
            whole = self.tokenizer.encode(candidate + continuation, add_special_tokens=False)
            alone = self.tokenizer.encode(continuation, add_special_tokens=False)
            shift = len(candidate)
            if whole.ids != encoding.ids + alone.ids or whole.offsets != encoding.offsets + [
                (a + shift, b + shift) for a, b in alone.offsets
            ]:
                return None
        starts, ends = zip(*encoding.offsets)
        return Opening(candidate, np.asarray(encoding.ids, dtype=np.int32), starts, ends)


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
