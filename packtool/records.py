"""The typed records that cross stage boundaries.

    sources -> Example -> render -> Rendered -> encode -> Tokenized -> truncate -> Tokenized -> pack/emit
    sources -> PreferencePair | CompletionGroup -> encode -> one Tokenized per answer -> truncate_item -> ...

Each record is frozen and checks its own invariants, so a bug in one stage surfaces where it
happens instead of as a wrong label three stages later.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import numpy as np

from packtool.errors import RecordError
from packtool.format import ROLE_CODES
from packtool.vision.inputs import ImageRef

ROLES = ("system", "user", "assistant", "tool")
ROLE_NAMES = {code: name for name, code in ROLE_CODES.items()}


def literal_pattern(literals: Iterable[str]) -> re.Pattern[str] | None:
    """A regex finding special-token literals (longest first, so `<|im_start|>` never matches as `<|im_`).

    The leading class of first characters lets the search skip most positions at once: Mistral has
    1,000 special tokens, and every string a record brings is searched.
    """
    ordered = sorted({t for t in literals if t}, key=len, reverse=True)
    if not ordered:
        return None
    first = "".join(sorted({re.escape(t[0]) for t in ordered}))
    return re.compile(f"(?=[{first}])(?:{'|'.join(re.escape(t) for t in ordered)})")


def spells_literal(pattern: re.Pattern[str], text: str, start: int = 0, end: int | None = None) -> bool:
    """Whether text[start:end] holds a literal of a literal_pattern.

    Only a literal's first character can start one, and str.find runs at memchr speed where the
    regex steps through every position: the pattern is tried where those characters are (alpaca
    contents with Qwen2.5: 4.5 -> 0.6 us; a Qwen3 tool-calling record's JSON, 4.7k characters: 8 ->
    0.5 us). A text full of them (markup, code) is searched by the regex in one pass instead.
    """
    end = len(text) if end is None else end
    tries = 0
    # keyed by the pattern's text: a str keeps its hash, a compiled pattern hashes its whole program
    for first in _literal_starts(pattern.pattern):
        at = text.find(first, start, end)
        while at >= 0:
            tries += 1
            if tries > _LITERAL_TRIES:
                return pattern.search(text, start, end) is not None
            if pattern.match(text, at, end) is not None:
                return True
            at = text.find(first, at + 1, end)
    return False


# Places spells_literal tries the pattern at before it lets the regex search the whole text.
_LITERAL_TRIES = 32


@functools.cache
def _literal_starts(pattern: str) -> tuple[str, ...]:
    """The first characters of a literal_pattern's literals, read back from its leading class."""
    head = re.match(r"\(\?=\[((?:\\.|[^\]\\])*)\]\)", pattern, re.DOTALL)
    if head is None:
        raise ValueError(f"not a literal_pattern: {pattern[:40]!r}")
    return tuple(re.sub(r"\\(.)", r"\1", head.group(1), flags=re.DOTALL))


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message in OpenAI shape. `train` is the per-message override read from the data."""

    role: str
    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    train: bool | None = None
    # Where the message's images sit in `content` (character offsets, in order; two images side by side
    # share one): the template gets the content as parts then, as transformers hands a content list over.
    image_at: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {', '.join(ROLES)}")
        if self.image_at and (
            list(self.image_at) != sorted(self.image_at)
            or not 0 <= self.image_at[0] <= self.image_at[-1] <= len(self.content)
        ):
            raise ValueError(f"image offsets {self.image_at} are not in order inside the content")

    def as_template_dict(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects (keys absent when unset, as HF callers pass them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content_parts() if self.image_at else self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out

    def pieces(self) -> list[str]:
        """The content's text between its images (one piece without images; empty ones included)."""
        bounds = (0, *self.image_at, len(self.content))
        return [self.content[start:end] for start, end in pairwise(bounds)]

    def content_parts(self) -> list[dict[str, str]]:
        """The content as a list of parts: each non-empty piece a text part, an image part where each image sits.

        "<image>What is it?" read as image_at (0,), content "What is it?"
            -> [{"type": "image"}, {"type": "text", "text": "What is it?"}]
        """
        parts = []
        for i, piece in enumerate(self.pieces()):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts


@dataclass(frozen=True, slots=True)
class Example:
    """One input record in canonical form.

    A chat example has `messages`; a plain-text example has `text` and no messages (every token
    after its `context_chars` is a target). `sample_hash` is the sha256 of the raw record, so provenance survives any
    re-rendering.
    """

    id: str
    source: str
    sample_hash: str
    messages: tuple[Message, ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    text: str | None = None
    location: str = ""  # "file:row", for error messages
    # text only: its first N characters are a prompt, context that is not trained (prompt-completion strings)
    context_chars: int = 0
    # The images its messages show, in the order the model sees them (Message.image_at places each one).
    images: tuple[ImageRef, ...] = ()

    def __post_init__(self) -> None:
        if (self.text is None) == (not self.messages):
            raise ValueError(f"example {self.id!r} must have either text or messages, not both or neither")
        # (an adapter places a message's images; the images themselves are attached after it: adapters.with_images)
        if self.images and len(self.images) != sum(len(m.image_at) for m in self.messages):
            raise ValueError(f"example {self.id!r}: {len(self.images)} images for the places its messages give")
        if self.context_chars and not 0 < self.context_chars < len(self.text or ""):
            raise ValueError(f"example {self.id!r}: context_chars {self.context_chars} must lie inside its text")

    @property
    def is_text(self) -> bool:
        return self.text is not None


# A pair's prompt or one of its answers: messages in order.
Messages = tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """One prompt and two answers. `is_text`: the record gave plain strings, not messages.

    Plain strings are held as one user and one assistant message, so a chat template renders
    them; without a template they are a text continuation (`answer_example`).
    """

    id: str
    source: str
    sample_hash: str
    prompt: Messages
    chosen: Messages
    rejected: Messages
    tools: tuple[dict[str, Any], ...] | None = None
    location: str = ""
    is_text: bool = False

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        for name in ("chosen", "rejected"):
            _check_answer(getattr(self, name), name)

    @property
    def answers(self) -> tuple[Messages, Messages]:
        return (self.chosen, self.rejected)


@dataclass(frozen=True, slots=True)
class CompletionGroup:
    """One prompt and k completions; `rewards` / `advantages` hold one float per completion when given."""

    id: str
    source: str
    sample_hash: str
    prompt: Messages
    completions: tuple[Messages, ...]
    rewards: tuple[float, ...] | None = None
    advantages: tuple[float, ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    location: str = ""
    is_text: bool = False

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        if not self.completions:
            raise RecordError("a group needs at least one completion", field="completions")
        for i, completion in enumerate(self.completions):
            _check_answer(completion, f"completions[{i}]")
        for name in ("rewards", "advantages"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.completions):
                raise RecordError(f"{len(values)} values for {len(self.completions)} completions", field=name)

    @property
    def answers(self) -> tuple[Messages, ...]:
        return self.completions


def _check_prompt(prompt: Messages) -> None:
    if not prompt:
        raise RecordError("empty prompt: the answers need something to answer", field="prompt")


def _check_answer(answer: Messages, field: str) -> None:
    # The answer opens with the assistant turn that the prompt's generation header introduces,
    # and ends with one: a segment must finish on something the model learns to say.
    if not answer:
        raise RecordError("empty answer", field=field)
    if answer[0].role != "assistant" or answer[-1].role != "assistant":
        roles = ", ".join(m.role for m in answer)
        raise RecordError(f"an answer must start and end with an assistant message, got [{roles}]", field=field)


def answer_example(item: PreferencePair | CompletionGroup, answer: Messages, *, chat: bool = True) -> Example:
    """One answer with its prompt as an ordinary sample: a conversation, or (no template) one text document."""
    if chat:
        messages = item.prompt + answer
        return Example(
            item.id, item.source, item.sample_hash, messages=messages, tools=item.tools, location=item.location
        )
    text = item.prompt[0].content + answer[0].content
    return Example(item.id, item.source, item.sample_hash, text=text, location=item.location)


@dataclass(frozen=True, slots=True)
class Span:
    """A character range [start, end) of the rendered text that belongs to one message."""

    start: int
    end: int
    message: int  # index into Example.messages; -1 for plain text
    role: str
    target: bool


@dataclass(frozen=True, slots=True)
class Rendered:
    """Rendered text plus character spans. Characters outside every span were written by the template."""

    example: Example
    text: str
    spans: tuple[Span, ...]
    # Character ranges whose text came from the data (message contents): the special-token
    # literal policy applies inside them and never to template structure.
    content_ranges: tuple[tuple[int, int], ...] = ()
    # Where a string the record brings (content, reasoning, tool calls, tool definitions) spells a
    # special token in the text, and the fields that spell one (printed or not).
    literal_ranges: tuple[tuple[int, int], ...] = ()
    literal_fields: tuple[str, ...] = ()
    # (start, end, message index or -1): characters the model must learn to produce.
    target_ranges: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PlacedImage:
    """One image of a document: where its bytes are, what the processor makes of it, and its tokens.

    `reference` is the image file's path relative to the build config's folder (posix; `..` allowed),
    or "" when the record carried the bytes itself (a data: URI, a `datasets` Image cell), which
    `data` then holds. `grid` is the processor's (t, h, w) patch grid, as `image_grid_thw` gives it;
    [start, end) are the image's tokens in its document (every one the model's image token).
    """

    reference: str
    sha256: str  # of the file's bytes, hex
    n_bytes: int
    width: int  # after EXIF orientation, as the processor sees the picture
    height: int
    grid: tuple[int, int, int]
    start: int
    end: int
    data: bytes | None = None

    def moved(self, offset: int) -> PlacedImage:
        """The same image, its token span shifted by `offset`."""
        return replace(self, start=self.start + offset, end=self.end + offset)


@dataclass(frozen=True, slots=True)
class Tokenized:
    """Token ids with per-token facts.

    `targets[t]` is True when token t is something the model must learn to produce. The label
    array is derived later (labels.labels_for) because it also depends on where the segment
    starts inside a pack: the first token of a segment is never a target.
    `message_index[t]` is the message the token belongs to (-1: template text).
    """

    example_id: str
    source: str
    sample_hash: str
    input_ids: np.ndarray  # int32 [L]
    targets: np.ndarray  # bool [L]
    roles: np.ndarray  # int8 [L], ROLE_CODES
    message_index: np.ndarray  # int16 [L]
    message_roles: tuple[str, ...] = ()
    # Messages that must never be cut in half by truncation (tool calls, tool results).
    structured_messages: frozenset[int] = field(default_factory=frozenset)
    # Target tokens that start before their target: a token holding the prompt's last characters and the
    # target's first is a target (packtool.encode._straddling_runs), counted in the build's accounting.
    straddled: int = 0
    # The document's images in token order (vision-language builds; empty otherwise).
    images: tuple[PlacedImage, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("targets", "roles", "message_index"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{self.example_id}: {name} has {len(getattr(self, name))} entries, input_ids {n}")
        for image in self.images:
            if not 0 <= image.start < image.end <= n:
                raise ValueError(f"{self.example_id}: image tokens [{image.start}, {image.end}) outside {n} tokens")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_targets(self) -> int:
        """Targets that survive as labels once this sample starts a segment (its first token never counts)."""
        return int(self.targets[1:].sum())

    def sliced(self, keep: np.ndarray | slice) -> Tokenized:
        """A copy holding only the kept tokens (a boolean mask or a slice). An image is kept whole or
        left out whole: cutting one is a ValueError (truncation cuts at image granularity)."""
        return Tokenized(
            example_id=self.example_id,
            source=self.source,
            sample_hash=self.sample_hash,
            input_ids=self.input_ids[keep],
            targets=self.targets[keep],
            roles=self.roles[keep],
            message_index=self.message_index[keep],
            message_roles=self.message_roles,
            structured_messages=self.structured_messages,
            straddled=self.straddled,
            images=self._kept_images(keep),
        )

    def _kept_images(self, keep: np.ndarray | slice) -> tuple[PlacedImage, ...]:
        if not self.images:
            return ()
        kept = np.zeros(len(self), dtype=bool)
        kept[keep] = True
        new_index = np.cumsum(kept) - 1
        images = []
        for image in self.images:
            inside = int(kept[image.start : image.end].sum())
            if inside == 0:
                continue
            if inside != image.end - image.start:
                raise ValueError(f"{self.example_id}: a cut inside the image at tokens [{image.start}, {image.end})")
            images.append(image.moved(int(new_index[image.start]) - image.start))
        return tuple(images)


def prompt_length(segment: Tokenized) -> int:
    """Tokens before the first target: the prompt, including the assistant header that opens the answer."""
    where = np.flatnonzero(segment.targets)
    return int(where[0]) if where.size else len(segment)
