"""Tokenize rendered text and map character spans to per-token targets, roles and messages.

A token is a target when it holds a character of a target range, as transformers'
`return_assistant_tokens_mask` reads a generation span: a token straddling a target's start (the
header's newline and a reply's own, `\\n\\n` in Qwen's vocabulary) is a target, counted in
`Tokenized.straddled`. A token that runs past a target's end may only absorb whitespace (some
SentencePiece added tokens swallow the newline after `<|end|>`); past that, the sample is a
`mask_check` error, never a silently shifted mask.

Special-token literals inside message content (a user typing `<|im_end|>`) follow the source
policy: `escape` tokenizes content with special-token matching off, so such text stays plain
text; `keep` tokenizes it as a serving stack would; `reject` drops the sample. Template
structure is always tokenized with special tokens on.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate, chain, pairwise
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
from tokenizers import Encoding, Tokenizer, models, pre_tokenizers

from packtool.config import TokenizerConfig
from packtool.errors import PacktoolError, RecordError
from packtool.openings import KnownOpenings, Opening
from packtool.records import ROLE_CODES, Rendered, Tokenized, literal_pattern, spells_literal


@dataclass(frozen=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what packtool needs around it."""

    tokenizer: Tokenizer
    path: str
    sha256: str
    config: dict[str, Any]
    special_literals: re.Pattern[str] | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    @cached_property
    def literal_tokenizer(self) -> Tokenizer:
        """Same vocabulary with special-token matching off, for escaped literals. Built on first use:
        cloning a large vocabulary costs about as much as loading it."""
        literal = self._continuing(Tokenizer.from_str(self.tokenizer.to_str()))
        literal.encode_special_tokens = True
        return literal

    @cached_property
    def stripping_right(self) -> frozenset[int]:
        """The added tokens that take the whitespace after them into their offsets (`rstrip`: Phi-3's
        `<|assistant|>`, `<|end|>`), which no token id then holds."""
        return frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.rstrip)

    @cached_property
    def continuation_tokenizer(self) -> Tokenizer:
        """For a piece of text that does not start the text: a Metaspace pre-tokenizer that prepends
        "▁" only at the start of the text must not prepend it to a piece encoded on its own."""
        if not self._prepends_first():
            return self.tokenizer
        return self._continuing(Tokenizer.from_str(self.tokenizer.to_str()))

    @cached_property
    def openings(self) -> KnownOpenings:
        """The template openings tokenized once for this tokenizer (packtool.openings)."""
        return KnownOpenings(self.tokenizer, enabled=not self._prepends_first())

    def _prepends_first(self) -> bool:
        # the object, not tokenizer.json: writing a large vocabulary out and parsing it costs ~0.3 s
        pre = self.tokenizer.pre_tokenizer
        return isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first"

    def _continuing(self, tokenizer: Tokenizer) -> Tokenizer:
        if self._prepends_first():
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(text)


def load_tokenizer(config: TokenizerConfig) -> TextTokenizer:
    path = Path(config.path)
    try:
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise PacktoolError(f"{path}: cannot load tokenizer: {exc}") from None
    # Some tokenizer.json files carry fixed padding/truncation (BERT-style); packing needs neither.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokenizer_config: dict[str, Any] = {}
    if config.config_path:
        tokenizer_config = json.loads(Path(config.config_path).read_text(encoding="utf-8"))
    as_transformers_loads_it(tokenizer, tokenizer_config)
    added = {i: t for i, t in tokenizer.get_added_tokens_decoder().items() if t.special and t.content}
    specials = [t.content for t in added.values()]
    # Templates find the special tokens a record may spell here (render.load_template); a
    # tokenizer_config.json saved by transformers lists them, an older or hand-made one may not.
    tokenizer_config.setdefault(
        "added_tokens_decoder", {str(i): {"content": t.content, "special": True} for i, t in added.items()}
    )

    def config_token(key: str) -> str | None:
        value = tokenizer_config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    bos_id = _id_or_none(tokenizer, config_token("bos_token"))
    if tokenizer_config.get("add_bos_token") is None:
        # What `tokenizer(text)` does, as transformers reads the key: Llama 3.2's and Gemma 3's
        # post-processors start plain text with BOS (render_text follows this unless add_bos is set).
        tokenizer_config["add_bos_token"] = text_starts_with_bos(tokenizer, bos_id)
    return TextTokenizer(
        tokenizer=tokenizer,
        path=str(path),
        sha256=hashlib.sha256(raw).hexdigest(),
        config=tokenizer_config,
        special_literals=literal_pattern(specials),
        bos_id=bos_id,
        eos_id=_id_or_none(tokenizer, config_token("eos_token")),
        pad_id=_id_or_none(tokenizer, config_token("pad_token")),
    )


# Tokenizer classes that transformers (5.x) rebuilds around the vocabulary instead of running
# tokenizer.json's normalizer and pre-tokenizer (models/llama/tokenization_llama.py).
_METASPACE_CLASSES = {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast"}


def as_transformers_loads_it(tokenizer: Tokenizer, tokenizer_config: dict[str, Any]) -> None:
    """Make `tokenizers` produce the ids transformers (and so inference servers) produce.

    For SentencePiece-style Llama tokenizers (Phi-3-mini, Llama 2, Mistral 7B v0.1) transformers
    drops tokenizer.json's legacy normalizer (Prepend("▁") + Replace(" ", "▁"), which puts a "▁" in
    front of every piece between added tokens) and pre-tokenizes with Metaspace instead: spaces
    become "▁", and "▁" is prepended only to the piece at the very start of the text
    (prepend_scheme "first", as `legacy: false` asks; "always" with `legacy: true`, "never" with
    `add_prefix_space: false`). After an added token nothing is prepended:

        "<|user|>\nHow are you"   tokenizer.json: <|user|> ▁<0x0A> ... ▁How   transformers: <|user|> How (5328)
    """
    if tokenizer_config.get("tokenizer_class") not in _METASPACE_CLASSES:
        return
    if not isinstance(tokenizer.model, models.BPE):
        return
    legacy = tokenizer_config.get("legacy") is True
    scheme = "never" if tokenizer_config.get("add_prefix_space") is False else "always" if legacy else "first"
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)


def text_starts_with_bos(tokenizer: Tokenizer, bos_id: int | None) -> bool:
    """Whether the tokenizer's own post-processor puts BOS in front of plain text."""
    if bos_id is None:
        return False
    return (
        tokenizer.encode("a", add_special_tokens=True).ids[:1]
        == [bos_id]
        != tokenizer.encode("a", add_special_tokens=False).ids[:1]
    )


def _id_or_none(tokenizer: Tokenizer, text: str | None) -> int | None:
    return tokenizer.token_to_id(text) if isinstance(text, str) else None


def has_special_literal(rendered: Rendered, tokenizer: TextTokenizer) -> bool:
    """Whether any string the record brings spells a special token (printed by the template or not):
    whether escaped_ranges finds any, stopping at the first (it runs on every sample)."""
    if rendered.literal_fields or rendered.literal_ranges:
        return True
    pattern = tokenizer.special_literals
    text = rendered.text
    return pattern is not None and any(
        spells_literal(pattern, text, start, end) for start, end in rendered.content_ranges
    )


def escaped_ranges(rendered: Rendered, tokenizer: TextTokenizer) -> list[tuple[int, int]]:
    """Where the text spells a special token that came from data: the positions render marked, plus
    any match inside content (a text document, or a token the template's list lacks)."""
    found = set(rendered.literal_ranges)
    if tokenizer.special_literals is not None:
        for start, end in rendered.content_ranges:
            found.update(m.span() for m in tokenizer.special_literals.finditer(rendered.text, start, end))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(found):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def encode_batch(
    batch: list[tuple[Rendered, str]],
    tokenizer: TextTokenizer,
    *,
    add_bos: bool = False,
    add_eos: bool = False,
    literals: list[bool] | None = None,
) -> list[Tokenized | RecordError]:
    """Encode rendered samples; each comes with its source's special-token policy.

    add_bos prepends the tokenizer's BOS where the text does not start with one (never a second
    one); add_eos appends EOS to a chat sample that does not end with one (documents get theirs
    from render_text). `literals[i]` is has_special_literal of sample i when the caller has it
    already (the build counts literals for every policy): the search runs once per sample.

    Each sample's mask boundaries are found and checked on its own (a few lookups); its labels,
    roles and message indices are then painted for the whole batch at once (see _labelled).
    """
    if literals is None:
        literals = [policy != "keep" and has_special_literal(rendered, tokenizer) for rendered, policy in batch]
    results: list[_Aligned | RecordError | None] = [None] * len(batch)
    whole: list[int] = []
    for i, ((rendered, policy), literal) in enumerate(zip(batch, literals, strict=True)):
        if policy != "keep" and literal:
            if policy == "reject":
                fields = ", ".join(rendered.literal_fields[:3]) or "content"
                results[i] = RecordError(
                    f"{fields} spell(s) a special token (special_tokens: reject; escape keeps the text as plain text)",
                    kind="special_token_literal",
                    sample_id=rendered.example.id,
                )
                continue
            ids, offsets = _encode_escaped(rendered, tokenizer)
            results[i] = _aligned(rendered, ids, OffsetTable(offsets), tokenizer.stripping_right)
        else:
            whole.append(i)
    # A document's BOS is tokenized apart from its text, as the post-processor adds it to
    # tokenizer(text): a Metaspace tokenizer then prepends "▁" to the first word ("▁The", not "The").
    heads = [_document_head(batch[i][0]) for i in whole]
    # A chat's template opening, where known, is not tokenized again (packtool.openings).
    openings = [None if head else _opening(batch[i][0], tokenizer) for i, head in zip(whole, heads)]
    encodings = tokenizer.tokenizer.encode_batch(
        [
            batch[i][0].text[len(opening.text) if opening else head :]
            for i, head, opening in zip(whole, heads, openings)
        ],
        add_special_tokens=False,
    )
    for i, head, opening, encoding in zip(whole, heads, openings, encodings):
        edges: TokenEdges
        if opening is not None:
            rest = np.fromiter(encoding.ids, dtype=np.int32, count=len(encoding))
            ids, edges = np.concatenate([opening.ids, rest]), OpenedEdges(opening, EncodingEdges(encoding))
        elif head:
            ids, offsets = _arrays(encoding, head)
            head_ids, head_offsets = _arrays(
                tokenizer.tokenizer.encode(batch[i][0].text[:head], add_special_tokens=False), 0
            )
            ids, edges = np.concatenate([head_ids, ids]), OffsetTable(np.concatenate([head_offsets, offsets]))
        else:
            ids, edges = np.fromiter(encoding.ids, dtype=np.int32, count=len(encoding)), EncodingEdges(encoding)
        results[i] = _aligned(batch[i][0], ids, edges, tokenizer.stripping_right)
    aligned = [r for r in results if isinstance(r, _Aligned)]
    labelled = iter(_labelled(aligned, tokenizer, add_bos, add_eos))
    return [next(labelled) if isinstance(r, _Aligned) else r for r in results if r is not None]


def _opening(rendered: Rendered, tokenizer: TextTokenizer) -> Opening | None:
    """The known opening the chat's text starts with: it ends before a message's content that comes
    before the first target (or before the first target, where none does)."""
    first_target = min((start for start, _, _ in rendered.target_ranges), default=len(rendered.text))
    stops = sorted(start for start, _ in rendered.content_ranges if start < first_target) or [first_target]
    return tokenizer.openings.find(rendered.text, stops)


def _document_head(rendered: Rendered) -> int:
    """Length of the BOS string render_text put in front of a document (0 for chats)."""
    if not rendered.example.is_text or not rendered.content_ranges:
        return 0
    return rendered.content_ranges[0][0]


def _arrays(encoding: Encoding, shift: int) -> tuple[np.ndarray, np.ndarray]:
    offsets = encoding.offsets
    # fromiter over the flattened pairs is ~30% faster than asarray on a list of tuples (a hot path).
    ids = np.fromiter(encoding.ids, dtype=np.int32, count=len(offsets))
    flat = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    return ids, flat.reshape(-1, 2) + shift


def _encode_escaped(rendered: Rendered, tokenizer: TextTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Literals that came from data with special-token matching off, everything else with it on."""
    text = rendered.text
    literals = escaped_ranges(rendered, tokenizer)
    cuts = sorted({0, len(text), *(x for r in literals for x in r)})
    literal_starts = {s for s, _ in literals}
    ids_parts, offset_parts = [], []
    for start, end in pairwise(cuts):
        if start == end:
            continue
        if start in literal_starts:
            engine = tokenizer.literal_tokenizer
        else:
            engine = tokenizer.tokenizer if start == 0 else tokenizer.continuation_tokenizer
        ids, offsets = _arrays(engine.encode(text[start:end], add_special_tokens=False), start)
        ids_parts.append(ids)
        offset_parts.append(offsets)
    return np.concatenate(ids_parts), np.concatenate(offset_parts)


class TokenEdges(Protocol):
    """Where tokens start and end in the text, asked only at the characters the mask needs."""

    def runs(self, ranges: list[tuple[int, int]]) -> list[list[int]]:
        """For each character range [start, end), the tokens [a, b) whose first character lies in it
        (token starts never decrease, so they are one run)."""
        ...

    def edges(self, token: int) -> tuple[int, int]:
        """The token's (first character, last character + 1)."""
        ...

    def tokens_before(self, at: int) -> int:
        """How many tokens start before character `at`."""
        ...


class OffsetTable:
    """Every token's offsets as arrays: for a text tokenized in pieces (escaped literals, a document's BOS)."""

    def __init__(self, offsets: np.ndarray):
        self.starts = np.ascontiguousarray(offsets[:, 0])
        self.ends = offsets[:, 1]

    @classmethod
    def of(cls, encoding: Encoding) -> OffsetTable:
        return cls(_arrays(encoding, 0)[1])

    def runs(self, ranges: list[tuple[int, int]]) -> list[list[int]]:
        if not ranges:
            return []
        return np.searchsorted(self.starts, np.asarray(ranges, dtype=np.int64).ravel()).reshape(-1, 2).tolist()

    def edges(self, token: int) -> tuple[int, int]:
        return int(self.starts[token]), int(self.ends[token])

    def tokens_before(self, at: int) -> int:
        return int(np.searchsorted(self.starts, at))


class _LookedUp:
    """TokenEdges whose runs are one tokens_before lookup per boundary (a sample has a handful)."""

    def runs(self, ranges: list[tuple[int, int]]) -> list[list[int]]:
        return [[self.tokens_before(start), self.tokens_before(end)] for start, end in ranges]

    def tokens_before(self, at: int) -> int:
        raise NotImplementedError


# Tokens stepped over from char_to_token's answer before falling back to the whole table: more than
# one only where one character is several tokens (byte-level pieces of one CJK character).
_LOOKUP_STEPS = 8


class EncodingEdges(_LookedUp):
    """One Encoding's token edges looked up where a mask boundary falls (char_to_token, then
    token_to_chars of the neighbours) instead of converting every offset: a sample has a handful
    of boundaries and hundreds of tokens (alpaca with Qwen2.5: 33-43 us per sample for the whole
    conversion). The answer is checked against its neighbours, as searchsorted would find it;
    anything the lookup cannot settle falls back to the table.

        text     <|im_start|>assistant\n Paris<|im_end|>
        tokens   [<|im_start|>][assistant][\n][ Paris][<|im_end|>]
        at = 23 (' Paris')   char_to_token -> 3, starts at 23   tokens before: 3
    """

    def __init__(self, encoding: Encoding):
        self.encoding = encoding
        self.count = len(encoding)
        self._table: OffsetTable | None = None

    def edges(self, token: int) -> tuple[int, int]:
        # None for a token without a place in the text (one a post-processor added): the table has (0, 0)
        found = self.encoding.token_to_chars(token)
        return found if found is not None else self.table().edges(token)

    def tokens_before(self, at: int) -> int:
        """How many tokens start before character `at` (searchsorted of the token starts)."""
        token = self.encoding.char_to_token(at)
        if token is None:
            # past the text's end every token starts before `at`; elsewhere a character no token
            # covers (a normalizer dropped it): ask the table
            token = self.count if self.count == 0 or at >= self.edges(self.count - 1)[1] else -1
        if token >= 0:
            for _ in range(_LOOKUP_STEPS):
                if token > 0 and self.edges(token - 1)[0] >= at:
                    token -= 1
                elif token < self.count and self.edges(token)[0] < at:
                    token += 1
                else:
                    return token
        return self.table().runs([(at, at)])[0][0]

    def table(self) -> OffsetTable:
        if self._table is None:
            self._table = OffsetTable.of(self.encoding)
        return self._table


class OpenedEdges(_LookedUp):
    """Token edges of a text encoded as a known opening plus the rest on its own (offsets of the rest
    counted from the opening's end)."""

    def __init__(self, opening: Opening, rest: TokenEdges):
        self.opening = opening
        self.rest = rest
        self.length = len(opening.text)
        self.count = len(opening.starts)

    def edges(self, token: int) -> tuple[int, int]:
        if token < self.count:
            return self.opening.starts[token], self.opening.ends[token]
        start, end = self.rest.edges(token - self.count)
        return start + self.length, end + self.length

    def tokens_before(self, at: int) -> int:
        if at <= self.length:
            return self.opening.tokens_before(at)
        return self.count + self.rest.tokens_before(at - self.length)


def _straddling_runs(
    text: str,
    ids: np.ndarray,
    edges: TokenEdges,
    targets: list[tuple[int, int, int]],
    runs: list[list[int]],
    stripping: frozenset[int],
) -> tuple[list[list[int]], list[tuple[int, int]]] | tuple[int, int]:
    """Each target's token run with a token straddling its start taken in, and those tokens as (token
    index, the target's message); or the token that runs past a target's end over more than whitespace,
    as (token index, target number).

    A target is what the loss must teach, so a token holding any of its characters is a target, as
    transformers' `return_assistant_tokens_mask` (every token overlapping a generation span) and TRL's
    assistant-only loss read it: a Qwen content opening with a newline puts that newline in one token
    with the header's (`\\n\\n`), and leaving that token out would never train the newline. Such a
    token starts in the prompt, so it is counted (`Tokenized.straddled`). A special token that strips
    the whitespace after it (`stripping`: Phi-3's `<|assistant|>`) holds the target's first whitespace
    in its offsets but not in its id, which the prompt alone spells: it stays context (transformers'
    overlap mask would take it in), and that whitespace reaches no token, for packtool as for the
    serving stack. A token running past a target's end may absorb only whitespace (some SentencePiece
    added tokens swallow the newline after `<|end|>`): past that, what follows the target would be
    trained as part of it.

        tokens   [<|im_start|>][assistant][\\n\\n][Hello][<|im_end|>]
        target                          ^start (content "\\nHello")     run [3, 5) -> [2, 5), 1 straddling
    """
    taken: list[list[int]] = []
    straddlers: list[tuple[int, int]] = []
    previous = 0  # where the run of the target before ends: a token already a target is not counted again
    for j, ((start, end, message), (a, b)) in enumerate(zip(targets, runs)):
        before_end = edges.edges(a - 1)[1] if a > 0 else start
        if before_end > start and not (int(ids[a - 1]) in stripping and text[start:before_end].isspace()):
            a -= 1
            if a >= previous:
                straddlers.append((a, message))
        if b > a:
            last_end = edges.edges(b - 1)[1]
            if last_end > end and text[end:last_end].strip():
                return b - 1, j
        taken.append([a, b])
        previous = max(previous, b)
    return taken, straddlers


class _Aligned(NamedTuple):
    """A sample whose mask boundaries passed the check: its tokens and the token run of each range."""

    rendered: Rendered
    ids: np.ndarray
    targets: list[tuple[int, int, int]]  # rendered.target_ranges, sorted
    target_runs: list[list[int]]  # the tokens [a, b) of each target range, a straddling token included
    span_runs: list[list[int]]  # the tokens [a, b) of each of rendered.spans
    straddlers: list[tuple[int, int]]  # target tokens that start before their target, with its message


def _aligned(
    rendered: Rendered, ids: np.ndarray, edges: TokenEdges, stripping: frozenset[int]
) -> _Aligned | RecordError:
    """The sample's token runs, or the RecordError of a token that runs past a target's end. `stripping`:
    TextTokenizer.stripping_right."""
    text = rendered.text
    targets = sorted(rendered.target_ranges)
    spans = rendered.spans
    runs = edges.runs([(start, end) for start, end, _ in targets] + [(s.start, s.end) for s in spans])
    taken = _straddling_runs(text, ids, edges, targets, runs[: len(targets)], stripping)
    if isinstance(taken[0], int):
        t, j = taken
        piece = text[slice(*edges.edges(t))]
        return RecordError(
            f"token {piece!r} crosses the end of the target span of message {targets[j][2]}; "
            "the mask cannot be aligned to tokens",
            kind="mask_check",
            sample_id=rendered.example.id,
        )
    target_runs, straddlers = taken
    return _Aligned(rendered, ids, targets, target_runs, runs[len(targets) :], straddlers)


def _labelled(
    aligned: list[_Aligned], tokenizer: TextTokenizer, add_bos: bool, add_eos: bool
) -> list[Tokenized | RecordError]:
    """Targets, roles and message indices of aligned samples, painted on their concatenated tokens.

    A token belongs to the range holding its first character, but for a target's straddling token
    (_straddling_runs), which is its turn's. Token starts never decrease, so each range is one run of
    tokens: paint the runs (targets, then contents over them, then the straddling tokens). Roles are
    looked up for all tokens at once in the concatenated message roles of the samples:

        sample 0  [user, assistant]   sample 1  [system, user, assistant]    role table  u a | s u a
        message_index 0: -1 0 0 -1 1 1 -1    base 0          1: -1 0 -1 1 1 -1 2 2    base 2
        role of a token: table[base + message_index] (template where -1; assistant where a target)

    Each sample's arrays are views of the batch's; only a sample that gets BOS or EOS added is copied.
    """
    lengths = [len(a.ids) for a in aligned]
    starts = [0, *accumulate(lengths)]
    total = starts[-1]
    ids = np.concatenate([a.ids for a in aligned]).astype(np.int32, copy=False) if aligned else np.zeros(0, np.int32)
    targets = np.zeros(total, dtype=bool)
    message_index = np.full(total, -1, dtype=np.int16)
    for a, base in zip(aligned, starts):
        for (x, y), (_, _, message) in zip(a.target_runs, a.targets):
            targets[base + x : base + y] = True
            message_index[base + x : base + y] = message
        for (x, y), span in zip(a.span_runs, a.rendered.spans):
            message_index[base + x : base + y] = span.message
        for token, message in a.straddlers:  # a target, whatever content it starts in: its turn's
            message_index[base + token] = message

    message_roles = [tuple(m.role for m in a.rendered.example.messages) for a in aligned]
    table = np.fromiter(
        (ROLE_CODES[role] for roles_ in message_roles for role in roles_),
        dtype=np.int8,
        count=sum(map(len, message_roles)),
    )
    table_starts = np.repeat(np.asarray([0, *accumulate(map(len, message_roles))][:-1], dtype=np.int64), lengths)
    in_message = message_index >= 0
    roles = np.full(total, ROLE_CODES["template"], dtype=np.int8)
    roles[in_message] = table[table_starts[in_message] + message_index[in_message]]
    roles[~in_message & targets] = ROLE_CODES["assistant"]

    results: list[Tokenized | RecordError] = []
    for k, a in enumerate(aligned):
        example = a.rendered.example
        cut = slice(starts[k], starts[k + 1])
        sample = Tokenized(
            example_id=example.id,
            source=example.source,
            sample_hash=example.sample_hash,
            input_ids=ids[cut],
            targets=targets[cut],
            roles=roles[cut],
            message_index=message_index[cut],
            message_roles=message_roles[k],
            structured_messages=frozenset(
                i for i, m in enumerate(example.messages) if m.tool_calls or m.role == "tool"
            ),
            straddled=len(a.straddlers),
        )
        if example.is_text:
            sample.roles[:] = ROLE_CODES["text"]
        results.append(_ended(sample, example.is_text, tokenizer, add_bos, add_eos))
    return results


def _ended(
    sample: Tokenized, is_text: bool, tokenizer: TextTokenizer, add_bos: bool, add_eos: bool
) -> Tokenized | RecordError:
    """The sample with the BOS and EOS asked for (see encode_batch), or the RecordError of a doubled BOS."""
    ids, targets, roles, message_index = sample.input_ids, sample.targets, sample.roles, sample.message_index
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if add_bos and bos is not None and (len(ids) == 0 or ids[0] != bos):
        ids = np.concatenate([[bos], ids]).astype(np.int32)
        targets = np.concatenate([[False], targets])
        roles = np.concatenate([[ROLE_CODES["template"]], roles]).astype(np.int8)
        message_index = np.concatenate([[-1], message_index]).astype(np.int16)
    if add_eos and not is_text and eos is not None and (len(ids) == 0 or ids[-1] != eos):
        # Closes the conversation; a target only when the last message is trained, so that the
        # model learns to stop after its own final turn and never after a user's.
        last = len(sample.message_roles) - 1
        last_trained = bool(targets.any()) and int(message_index[targets].max()) == last
        ids = np.concatenate([ids, [eos]]).astype(np.int32)
        targets = np.concatenate([targets, [last_trained]])
        roles = np.concatenate([roles, [ROLE_CODES["assistant" if last_trained else "template"]]]).astype(np.int8)
        message_index = np.concatenate([message_index, [last if last_trained else -1]]).astype(np.int16)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        return RecordError(
            "doubled BOS: the template prints one and another was added", kind="double_bos", sample_id=sample.example_id
        )
    if ids is sample.input_ids and message_index is sample.message_index:
        return sample
    return replace(sample, input_ids=ids, targets=targets, roles=roles, message_index=message_index)
