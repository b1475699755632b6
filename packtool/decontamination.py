"""Decontamination: which training text overlaps an eval set, matched so that formatting does not hide it.

    eval record --eval_strings--> its strings (every string field, recursively; `fields` narrows them)
        each string --words--> normalized words (NFKC, casefold, everything but letters and digits a space)
            >= ngram words               every window of `ngram` words  -> EvalIndex.grams
            min_words .. ngram-1 words   the whole string as one run     -> EvalIndex.shorts
            >= min_words words           the whole string                -> EvalIndex.exact

    training sample --(prompt pieces, target pieces)--> EvalIndex.check --> Finding | None
        a piece that is an eval string (exact), holds one of its windows (ngram) or a whole short item
        (short) overlaps it: in a target piece the sample is contaminated, in a prompt piece it is reported.

Words run across line breaks, so an answer rewrapped into 8-word lines keeps every 13-word window
(matching per line, as paragraph-based tools do, finds none: marin#6852's 0.87 -> 0.00). A short
item (a multiple-choice option, a one-line answer) has no window of `ngram` words: it matches as a
contiguous run of its words, when it has at least `min_words` ("yes" or "A" would match anything).

Two implementations, one answer: `ReferenceIndex` (Python sets of word tuples, as datatrove and NeMo
Curator match) states the rule; `EvalIndex` hashes a batch's words in numpy (each word's bytes 8 at a
time, mixed: the same hash in every process), word runs with polynomial prefix sums over uint64, reads
bit filters on runs of `min_words` words (the window filter at every ngram - min_words + 1'th word only:
see EvalIndex), looks up only what passes in sorted hash tables bucketed by their top bits, and finds what
the reference finds (tests/test_decontamination.py, hypothesis). A 64-bit hash may collide: for 10M eval
windows and 1e10 training windows, about 5e-3 false matches in all.
"""

from __future__ import annotations

import bisect
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from packtool.config import DEFAULT_MAX_RECORD_BYTES, Decontamination, canonical_json
from packtool.errors import PacktoolError, RecordError
from packtool.format import sha256_file
from packtool.reading import raw_records

RULES = ("exact", "ngram", "short")  # in the order a sample's findings are preferred
PARTS = ("target", "prompt")

_NOT_WORD = re.compile(r"[\W_]+")
# ASCII text skips NFKC (the identity on ASCII) and the regex: one bytes.translate lowercases letters and
# makes every other ASCII byte a space; bytes of non-ASCII characters (already folded) stay word bytes.
_ASCII_FOLD = bytes(
    b if (48 <= b <= 57 or 97 <= b <= 122 or b >= 128) else b + 32 if 65 <= b <= 90 else 32 for b in range(256)
)


def fold(text: str) -> str:
    """`text` normalized: NFKC, casefolded, every run of characters that are not letters or digits one space."""
    if text.isascii():
        return text.encode().translate(_ASCII_FOLD).decode()
    return _NOT_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold())


def words(text: str) -> list[str]:
    """The normalized words of `text`, across line breaks: `words("The Cat\\nsat.") == ["the", "cat", "sat"]`."""
    return fold(text).split()


def eval_strings(record: Any, fields: Sequence[str] = (), path: str = "") -> Iterator[tuple[str, str]]:
    """(path, string) of every string in an eval record, recursively (`messages[1].content`, `choices[2]`);
    `fields` keeps those under the named top-level keys."""
    if isinstance(record, str):
        yield path, record
    elif isinstance(record, dict):
        for key, value in record.items():
            if path or not fields or key in fields:
                yield from eval_strings(value, (), f"{path}.{key}" if path else str(key))
    elif isinstance(record, list):
        for i, value in enumerate(record):
            yield from eval_strings(value, (), f"{path}[{i}]")


@dataclass(frozen=True, slots=True)
class EvalItem:
    """Where an eval string came from: the file as the config names it, the record (FILE:N, and its id when it
    has one) and the string's path in the record."""

    file: str
    record: str
    field: str


@dataclass(frozen=True, slots=True)
class Finding:
    """A training sample's overlap with an eval string: in which part, by which rule, and the words shared."""

    item: EvalItem
    part: str  # target | prompt
    rule: str  # exact | ngram | short
    overlap: str  # the shared words, normalized

    def describe(self) -> str:
        return f"{self.part} overlaps eval {self.item.record} field '{self.item.field}' ({self.rule}): '{self.overlap}'"

    def as_dict(self) -> dict[str, str]:
        return {
            "file": self.item.file,
            "record": self.item.record,
            "field": self.item.field,
            "part": self.part,
            "rule": self.rule,
            "overlap": self.overlap,
        }


# A sample as the checks read it: its prompt pieces and its target pieces (message contents as rendered).
Sample = tuple[Sequence[str], Sequence[str]]


def _first(findings: Iterable[Finding]) -> Finding | None:
    """A target overlap before a prompt one, then by rule (exact, ngram, short); the first found within those."""
    ranked = sorted(enumerate(findings), key=lambda f: (PARTS.index(f[1].part), RULES.index(f[1].rule), f[0]))
    return ranked[0][1] if ranked else None


class ReferenceIndex:
    """The rule, in Python sets of word tuples (as datatrove's and NeMo Curator's n-gram matching hold them)."""

    def __init__(self, items: Iterable[tuple[EvalItem, str]], ngram: int, min_words: int) -> None:
        self.ngram, self.min_words = ngram, min_words
        self.exact: dict[tuple[str, ...], EvalItem] = {}
        self.grams: dict[tuple[str, ...], EvalItem] = {}
        self.shorts: dict[tuple[str, ...], EvalItem] = {}
        for item, text in items:
            seq = tuple(words(text))
            if len(seq) < min_words:
                continue
            self.exact.setdefault(seq, item)
            if len(seq) < ngram:
                self.shorts.setdefault(seq, item)
            for i in range(len(seq) - ngram + 1):
                self.grams.setdefault(seq[i : i + ngram], item)
        self.short_lengths = sorted({len(seq) for seq in self.shorts})

    def check(self, samples: Sequence[Sample]) -> list[Finding | None]:
        return [self._check_one(prompts, targets) for prompts, targets in samples]

    def _check_one(self, prompts: Sequence[str], targets: Sequence[str]) -> Finding | None:
        found = []
        for part, pieces in (("prompt", prompts), ("target", targets)):
            for piece in pieces:
                seq = tuple(words(piece))
                if seq in self.exact:
                    found.append(Finding(self.exact[seq], part, "exact", " ".join(seq)))
                for i in range(len(seq) - self.ngram + 1):
                    if (gram := seq[i : i + self.ngram]) in self.grams:
                        found.append(Finding(self.grams[gram], part, "ngram", " ".join(gram)))
                for length in self.short_lengths:
                    for i in range(len(seq) - length + 1):
                        if (run := seq[i : i + length]) in self.shorts:
                            found.append(Finding(self.shorts[run], part, "short", " ".join(run)))
        return _first(found)


# Odd multipliers: word runs hash as sum(word_hash[i + j] * Q**j) mod 2**64, read off prefix sums.
_Q = 0x9E3779B97F4A7C15
_Q_INVERSE = pow(_Q, -1, 1 << 64)
_LENGTH_SALT = 0xD6E8FEB86659FD93  # a run's hash also depends on its length (a run of 3 != of 4)
# A bit filter: about 16 bits per hash, up to 2**27 bits (16 MB, beside the 80 MB of 10M windows).
_FILTER_BITS_PER_HASH = 16
_MIN_FILTER_BITS, _MAX_FILTER_BITS = 10, 27
# A table's buckets: about 2-4 hashes per value of their top bits (10M hashes: 2**22 buckets, 16 MB of offsets).
_HASHES_PER_BUCKET = 4


class _Powers:
    """Q**i and Q**-i mod 2**64 for i < len, grown by doubling (one table per process)."""

    def __init__(self) -> None:
        self.up = np.ones(1, np.uint64)
        self.down = np.ones(1, np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.up) < n:
            size = max(n, 2 * len(self.up))
            self.up, self.down = _cumulative_powers(_Q, size), _cumulative_powers(_Q_INVERSE, size)
        return self.up[:n], self.down[:n]


_POWERS = _Powers()


def _cumulative_powers(base: int, size: int) -> np.ndarray:
    factors = np.full(size, base, np.uint64)
    factors[0] = 1
    return np.cumprod(factors)  # uint64 products wrap mod 2**64, the ring these hashes live in


@dataclass(frozen=True, slots=True)
class _Batch:
    """The words of a batch of pieces as hashes: `prefix[i]` sums word_hash[j] * Q**j for j < i; piece p holds
    words first[p]..first[p + 1]."""

    prefix: np.ndarray  # uint64 [W + 1]
    first: np.ndarray  # int64 [P + 1]
    piece: np.ndarray  # int64 [W]: the piece of each word

    def runs(self, starts: np.ndarray, lengths: np.ndarray | int) -> np.ndarray:
        """The hash of each run of `lengths` words from `starts` (uint64)."""
        _, down = _POWERS.upto(len(self.prefix))
        lengths = np.asarray(lengths, np.int64)
        body = (self.prefix[starts + lengths] - self.prefix[starts]) * down[starts]
        return body ^ (lengths.astype(np.uint64) * np.uint64(_LENGTH_SALT))

    def every_run(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(inside, hash) of the run of n words from each word that has n - 1 after it: inside where the run stays
        in one piece. Slices, not gathers: the same hashes as `runs`."""
        count = len(self.piece) - n + 1
        if n < 1 or count <= 0:
            return np.zeros(0, bool), np.zeros(0, np.uint64)
        _, down = _POWERS.upto(count)
        body = (self.prefix[n:] - self.prefix[:count]) * down
        body ^= np.uint64(n * _LENGTH_SALT % (1 << 64))
        return self.piece[:count] == self.piece[n - 1 :], body

    def windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, hash) of every run of n words inside one piece."""
        inside, hashes = self.every_run(n)
        starts = np.flatnonzero(inside)
        return starts, hashes[starts]

    def wholes(self, min_words: int) -> tuple[np.ndarray, np.ndarray]:
        """(piece, hash) of every piece of at least min_words words, whole."""
        lengths = np.diff(self.first)
        pieces = np.flatnonzero(lengths >= max(min_words, 1))
        return pieces, self.runs(self.first[pieces], lengths[pieces])


def _batch(pieces: Sequence[str]) -> _Batch:
    """The words of `pieces` hashed in numpy, with no Python object per word: each word's bytes 8 at a time (one
    chunk for most words), each chunk mixed into the word's hash. Words are `words(piece)`, byte for byte
    (tests/test_decontamination.py holds the two to the same answers)."""
    text = " ".join(pieces)
    if text.isascii():  # the common case: one translate for the whole batch, a byte per character
        folded = text.encode().translate(_ASCII_FOLD)
        sizes = np.fromiter(map(len, pieces), np.int64, len(pieces))
    else:
        encoded = [p.encode().translate(_ASCII_FOLD) if p.isascii() else fold(p).encode() for p in pieces]
        folded = b" ".join(encoded)
        sizes = np.fromiter(map(len, encoded), np.int64, len(encoded))
    # a space before the first piece and after each, so every word has a space before and after it; 7 more: a
    # word's last chunk reads 8 bytes
    data = np.frombuffer(b" " + folded + b" " * 8, np.uint8)
    word = data[: len(data) - 7] != 32
    edges = np.flatnonzero(word[1:] != word[:-1]) + 1
    starts, ends = edges[0::2], edges[1::2]  # every word starts, then ends (at a space)
    hashes = _word_hashes(data, starts, ends - starts)
    piece_ends = 1 + np.cumsum(sizes + 1)
    first = np.zeros(len(pieces) + 1, np.int64)
    first[1:] = np.searchsorted(starts, piece_ends)  # words of piece p: those that start before its end
    piece = np.repeat(np.arange(len(pieces), dtype=np.int64), np.diff(first))
    up, _ = _POWERS.upto(len(hashes) + 1)
    prefix = np.zeros(len(hashes) + 1, np.uint64)
    np.cumsum(hashes * up[: len(hashes)], out=prefix[1:])
    return _Batch(prefix, first, piece)


# the bytes of a chunk that belong to its word: _CHUNK_MASKS[min(bytes left, 8)]
_CHUNK_MASKS = np.array([(1 << (8 * n)) - 1 for n in range(9)], np.uint64)


def _word_hashes(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The hash of each word data[start : start + length]: each 8-byte chunk (little-endian, the bytes past the
    word's end masked off) mixed in turn. A word has no zero byte (`fold` makes it a space), so its first chunk
    is its length too: two words of up to 8 bytes never share a hash, longer ones by chance (2**-64)."""
    # the 8 bytes from every offset as one little-endian uint64, an unaligned view of `data` (2.3x a gather of
    # 8-byte rows)
    chunks = np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
    hashes = _mix(chunks[starts] & _CHUNK_MASKS[np.minimum(lengths, 8)])
    todo = np.flatnonzero(lengths > 8)  # the few words of more than one chunk
    offset, left = starts[todo] + 8, lengths[todo] - 8
    while todo.size:
        hashes[todo] = _mix(hashes[todo] ^ (chunks[offset] & _CHUNK_MASKS[np.minimum(left, 8)]))
        longer = left > 8
        todo, offset, left = todo[longer], offset[longer] + 8, left[longer] - 8
    return hashes


def _mix(values: np.ndarray) -> np.ndarray:
    """A bijective mix of uint64 values (murmur3's finalizer): a word's hash no longer linear in its bytes."""
    values = values ^ (values >> np.uint64(33))
    values *= np.uint64(0xFF51AFD7ED558CCD)
    values ^= values >> np.uint64(33)
    values *= np.uint64(0xC4CEB9FE1A85EC53)
    values ^= values >> np.uint64(33)
    return values


def _sorted_unique(hashes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`hashes` sorted without repeats, each with the value of its first occurrence."""
    unique, first = np.unique(hashes, return_index=True)
    return unique, values[first]


# Two bits per hash, in the one 64-bit word its top bits pick (one cache miss): for the 12 low bits of a hash, the
# word with bits (h & 63) and (h >> 6 & 63) set. Against 10M windows in 16 MB, 4-5% of the runs pass (one bit
# per hash: 10%), some of them runs that eval windows do hold; each costs `stride` table lookups. A third bit
# (~1% in theory) measured no faster.
_PAIR_MASKS = np.array([(1 << (v & 63)) | (1 << (v >> 6)) for v in range(1 << 12)], np.uint64)


@dataclass(frozen=True, eq=False)
class _BitFilter:
    """A blocked Bloom filter of uint64 hashes: two bits in the word their top bits pick. No false negative."""

    words: np.ndarray  # uint64
    shift: np.uint64  # 64 - log2(len(words))

    @classmethod
    def of(cls, hashes: np.ndarray) -> _BitFilter:
        wanted = (len(hashes) * _FILTER_BITS_PER_HASH).bit_length()
        bits = min(max(wanted, _MIN_FILTER_BITS), _MAX_FILTER_BITS) - 6  # 2**6 bits a word
        found = cls(np.zeros(1 << bits, np.uint64), np.uint64(64 - bits))
        np.bitwise_or.at(found.words, found._word(hashes), _masks(hashes))
        return found

    def holds(self, hashes: np.ndarray) -> np.ndarray:
        """Whether each hash may be in the filter (bool); every hash it was built from is."""
        wanted = _masks(hashes)
        return (self.words[self._word(hashes)] & wanted) == wanted

    def _word(self, hashes: np.ndarray) -> np.ndarray:
        return (hashes >> self.shift).view(np.intp)


# Indices as views of uint64 values under 2**63: indexing by uint64 costs ~10x intp, and a view copies nothing.
def _masks(hashes: np.ndarray) -> np.ndarray:
    return _PAIR_MASKS[(hashes & np.uint64(4095)).view(np.intp)]


@dataclass(frozen=True, eq=False)
class _Table:
    """Sorted uint64 hashes, and where the hashes of each value of their top bits start: a lookup reads one offset
    and the 2-4 hashes after it, where a binary search of 10M hashes misses the cache at about half of its 23 steps
    (np.searchsorted was a third of a check against 10M windows, even with its queries sorted)."""

    hashes: np.ndarray  # sorted, repeats allowed (short items sharing their first words)
    starts: np.ndarray  # int32 [2**bits + 1]: the hashes whose top bits are b are hashes[starts[b] : starts[b + 1]]
    shift: np.uint64  # 64 - bits

    @classmethod
    def of(cls, hashes: np.ndarray) -> _Table:
        bits = max(len(hashes) // _HASHES_PER_BUCKET, 1).bit_length()
        shift = np.uint64(64 - bits)
        counts = np.bincount((hashes >> shift).view(np.intp), minlength=1 << bits)
        starts = np.zeros(len(counts) + 1, np.int32)  # tables of up to 2**31 hashes
        np.cumsum(counts, out=starts[1:])
        return cls(hashes, starts, shift)

    def __len__(self) -> int:
        return len(self.hashes)

    def find(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in `hashes` that the table holds, increasing; the place in the table of each, its first)."""
        bucket = (hashes >> self.shift).view(np.intp)
        place, end = self.starts[bucket].astype(np.intp), self.starts[bucket + 1]
        found = np.full(len(hashes), -1, np.intp)
        todo = np.arange(len(hashes))
        while todo.size:  # a step through every bucket at once: ~2 steps, the longest bucket's length at most
            live = place < end
            todo, place, end = todo[live], place[live], end[live]
            held, wanted = self.hashes[place], hashes[todo]
            hit = held == wanted
            found[todo[hit]] = place[hit]
            on = held < wanted
            todo, place, end = todo[on], place[on] + 1, end[on]
        at = np.flatnonzero(found >= 0)
        return at, found[at]


@dataclass(frozen=True, eq=False)
class EvalIndex:
    """An eval set's strings as hash tables (see the module docstring), and where each came from.

    The filters are read on runs of min_words words. A window of `ngram` words holds stride = ngram - min_words + 1
    such runs, at consecutive words, so one of them starts at a multiple of the stride: the window filter holds
    every run of the eval windows, and a check reads it at every stride-th word of the batch only, then looks up
    the stride windows around each run that passes (ngram 13, min_words 6: one probe per 8 words; a probe in a
    16 MB filter is a cache miss). A short item has fewer runs than the stride: its first run (its anchor) is
    looked for at every word, in a filter of the anchors alone (a few hundred kB, in cache)."""

    ngram: int
    min_words: int
    items: tuple[EvalItem, ...]
    grams: _Table  # window hashes
    gram_items: np.ndarray  # the item of each (its first)
    gram_filter: _BitFilter  # every run of min_words words inside an eval window
    short_anchors: _Table  # the hash of each short item's first min_words words
    short_lengths: np.ndarray  # the item's words (in the order of short_anchors)
    short_hashes: np.ndarray  # the hash of the item whole
    short_items: np.ndarray
    short_filter: _BitFilter  # the anchors
    exact: _Table  # the hash of each string whole (>= min_words words)
    exact_items: np.ndarray

    @classmethod
    def build(cls, items: Iterable[tuple[EvalItem, str]], ngram: int, min_words: int) -> EvalIndex:
        listed, texts = [], []
        for item, text in items:
            listed.append(item)
            texts.append(text)
        batch = _batch(texts)
        gram_starts, gram_hashes = batch.windows(ngram)
        grams, gram_items = _sorted_unique(gram_hashes, batch.piece[gram_starts])
        lengths = np.diff(batch.first)
        inside, runs = batch.every_run(min_words)
        in_windows = runs[inside & (lengths[batch.piece[: len(runs)]] >= ngram)]
        whole_pieces, whole_hashes = batch.wholes(min_words)
        exact, exact_items = _sorted_unique(whole_hashes, whole_pieces)
        short = whole_pieces[lengths[whole_pieces] < ngram]
        short_hashes, short_items = _sorted_unique(batch.runs(batch.first[short], lengths[short]), short)
        anchors = batch.runs(batch.first[short_items], min_words)
        order = np.argsort(anchors, kind="stable")
        return cls(
            ngram,
            min_words,
            tuple(listed),
            _Table.of(grams),
            gram_items.astype(np.int32),  # eval strings number under 2**31: 4 bytes a window, not 8
            _BitFilter.of(in_windows),
            _Table.of(anchors[order]),
            lengths[short_items][order],
            short_hashes[order],
            short_items[order].astype(np.int32),
            _BitFilter.of(anchors),
            _Table.of(exact),
            exact_items.astype(np.int32),
        )

    @property
    def sizes(self) -> dict[str, int]:
        """How much the index holds: eval strings, distinct windows, short items and whole strings."""
        return {"strings": len(self.items), "ngrams": len(self.grams), "short": len(self.short_hashes)}

    def check(self, samples: Sequence[Sample]) -> list[Finding | None]:
        """Each sample's first overlap (a target one before a prompt one; exact, then ngram, then short), or None."""
        pieces: list[str] = []
        ends: list[int] = []  # where each sample's prompt pieces end, then its target pieces
        for prompts, targets in samples:
            pieces += prompts
            ends.append(len(pieces))
            pieces += targets
            ends.append(len(pieces))
        batch = _batch(pieces)
        hits: list[tuple[int, int, int, str, int]] = []  # (piece, start, length, rule, item)
        whole_pieces, whole_hashes = batch.wholes(self.min_words)
        at, place = self.exact.find(whole_hashes)
        for p, i in zip(whole_pieces[at].tolist(), place.tolist()):
            hits.append((p, 0, int(batch.first[p + 1] - batch.first[p]), "exact", int(self.exact_items[i])))
        inside, runs = batch.every_run(self.min_words)
        starts = self._window_starts(batch, inside, runs)
        at, place = self.grams.find(batch.runs(starts, self.ngram))
        for start, i in zip(starts[at].tolist(), place.tolist()):
            p = int(batch.piece[start])
            hits.append((p, start - int(batch.first[p]), self.ngram, "ngram", int(self.gram_items[i])))
        if len(self.short_anchors):
            maybe = np.flatnonzero(inside & self.short_filter.holds(runs))
            hits += self._short_hits(batch, maybe, runs[maybe])
        found: list[list[Finding]] = [[] for _ in samples]
        folded: dict[int, list[str]] = {}
        for p, start, length, rule, item in hits:
            seq = folded.setdefault(p, words(pieces[p]))
            overlap = " ".join(seq[start : start + length])
            group = bisect.bisect_right(ends, p)  # 2 * sample, + 1 in its targets
            found[group // 2].append(Finding(self.items[item], ("prompt", "target")[group % 2], rule, overlap))
        return [_first(f) if f else None for f in found]

    def _window_starts(self, batch: _Batch, inside: np.ndarray, runs: np.ndarray) -> np.ndarray:
        """The starts, increasing, of the windows inside one piece that may be eval windows: the stride windows
        that hold a stride-th run passing the window filter."""
        stride = self.ngram - self.min_words + 1
        probed = np.arange(stride - 1, len(runs), stride)
        probed = probed[inside[probed] & self.gram_filter.holds(runs[probed])]
        starts = (probed[:, None] + np.arange(1 - stride, 1)).ravel()  # each window holds one probed run
        starts = starts[starts <= len(batch.piece) - self.ngram]
        return starts[batch.piece[starts] == batch.piece[starts + self.ngram - 1]]

    def _short_hits(
        self, batch: _Batch, starts: np.ndarray, anchors: np.ndarray
    ) -> list[tuple[int, int, int, str, int]]:
        """Short items found whole: a run of min_words words that starts one (its anchor), then the item's full
        length from there. Items sharing an anchor sit together in the sorted anchors, `place` at the first."""
        if not len(self.short_anchors):
            return []
        at, place = self.short_anchors.find(anchors)
        start, anchor = starts[at], anchors[at]
        table = self.short_anchors.hashes
        hits = []
        while place.size:
            held = place < len(table)
            start, anchor, place = start[held], anchor[held], place[held]
            same = table[place] == anchor
            start, anchor, place = start[same], anchor[same], place[same]
            length = self.short_lengths[place]
            piece = batch.piece[start]
            fits = start + length <= batch.first[piece + 1]
            whole = np.flatnonzero(fits)
            whole = whole[batch.runs(start[whole], length[whole]) == self.short_hashes[place[whole]]]
            for i in whole.tolist():
                p = int(piece[i])
                item = int(self.short_items[place[i]])
                hits.append((p, int(start[i] - batch.first[p]), int(length[i]), "short", item))
            place = place + 1
        return hits


@dataclass(frozen=True, eq=False)
class EvalSet:
    """The eval files of a `decontamination:` section read into one index, and what the manifest records of them."""

    settings: Decontamination
    index: EvalIndex
    files: tuple[dict[str, Any], ...]  # {file (as the config names it), sha256, records, strings}
    key: str  # sha256 of the files' labels and hashes and the settings: in every encode key

    def record(self) -> dict[str, Any]:
        """The manifest's `decontamination` without its counts (builder.manifest adds those)."""
        d = self.settings
        return {
            "against": list(self.files),
            "ngram": d.ngram,
            "min_line_words": d.min_line_words,
            "action": d.action,
            "prompt_action": d.prompt_action,
            "fields": list(d.fields),
            "index": self.index.sizes,
        }

    def drops(self, finding: Finding) -> bool:
        """Whether this overlap costs its sample: the action of the part it was found in."""
        return (self.settings.action if finding.part == "target" else self.settings.prompt_action) == "drop"


def eval_set_key(settings: Decontamination) -> tuple[str, list[tuple[str, str]]]:
    """(the sha256 of what an eval set's index is built from, each file's (label, sha256)): its files by content
    and the settings (the actions too: they decide which samples an encode keeps)."""
    hashes = [(label, sha256_file(path)) for path, label in settings.labels.items()]
    d = settings
    facts = [hashes, d.ngram, d.min_line_words, d.action, d.prompt_action, list(d.fields)]
    return hashlib.sha256(canonical_json(facts).encode()).hexdigest(), hashes


# Eval sets already read by this process, by EvalSet.key: a worker serves many encode items.
_EVAL_SETS: dict[str, EvalSet] = {}


def eval_set(settings: Decontamination) -> EvalSet:
    """The eval set of a `decontamination:` section, read once per process and content (a changed file is read
    again). An eval record that cannot be read, or a file with no string to match, is a PacktoolError: a check
    against part of an eval set would pass what it never saw."""
    key, hashes = eval_set_key(settings)
    known = _EVAL_SETS.get(key)
    if known is not None and known.settings == settings:
        return known
    items: list[tuple[EvalItem, str]] = []
    files = []
    for (path, label), (_, sha256) in zip(settings.labels.items(), hashes, strict=True):
        records, before = 0, len(items)
        for n, record in raw_records(path, label, 0, None, DEFAULT_MAX_RECORD_BYTES):
            if isinstance(record, RecordError):
                raise PacktoolError(
                    f"decontamination.against: {record.describe()}; an eval set is read whole or not at all"
                )
            records += 1
            name = f"{label}:{n}"
            if isinstance(record, dict) and isinstance(record.get("id"), str | int):
                name += f" (id {record['id']})"
            items += (
                (EvalItem(label, name, where or "(record)"), text)
                for where, text in eval_strings(record, settings.fields)
            )
        if len(items) == before:
            fields = f"fields {list(settings.fields)}" if settings.fields else "string fields"
            raise PacktoolError(f"decontamination.against: {label}: {records} records and no {fields} to match in them")
        files.append({"file": label, "sha256": sha256, "records": records, "strings": len(items) - before})
    index = EvalIndex.build(items, settings.ngram, settings.min_line_words)
    found = EvalSet(settings, index, tuple(files), key)
    _EVAL_SETS[key] = found
    return found
