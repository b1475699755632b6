"""Sentinels in and out: marking a conversation's contents (and the special-token literals a record spells),
cutting the marks out of a render into spans, and the checks on a record's own strings before any render."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import jinja2

from packtool.errors import RecordError, TemplateRaised
from packtool.records import Example, spells_literal
from packtool.template_limits import TemplateLimit
from packtool.template_tracking import GENERATION_CLOSE, GENERATION_OPEN, MARK_BASE, _tojson, marked_content

# Put in front of every special-token literal a record brings (a user typing `<|im_end|>`, a tool
# description spelling `<|im_start|>system`): its rendered position tells encode what to escape and
# tells the mask which end markers are data, not structure.
_LITERAL = chr(0x10FFF2)


_MAX_MESSAGES = (0x10FFF0 - MARK_BASE) // 2


_MARKERS = re.compile("[\U00100000-\U0010ffff]")


def _holds_marker(text: str) -> bool:
    """Whether text holds a plane-16 private-use character (what _MARKERS matches). In UTF-8 exactly
    those code points start with the byte F4, and a byte search is ~17x faster than the regex over a
    Qwen3 reasoning record's JSON (0.9 against 14.5 us); an ASCII text (a flag) holds none."""
    return not text.isascii() and b"\xf4" in text.encode("utf-8", "surrogatepass")


@contextlib.contextmanager
def _template_verdicts(name: str) -> Iterator[None]:
    """A template's own failure on one sample becomes that sample's RecordError (sentinels cut out
    of the words it quotes); a limit names the template, since a limit is the template's doing."""
    try:
        yield
    except TemplateRaised as exc:
        raise RecordError(f"template refused the sample: {_MARKERS.sub('', str(exc))}", kind="template_error") from None
    except TemplateLimit as exc:
        raise RecordError(f"template {name!r} stopped at a limit: {exc}", kind="template_limit") from None
    except jinja2.TemplateError as exc:
        raise RecordError(f"template failed: {_MARKERS.sub('', str(exc))}", kind="template_error") from None


def data_strings(example: Example) -> Iterator[tuple[str, str]]:
    """(field, text) for every string a chat record brings into the render: contents, reasoning,
    names and ids, tool calls (name, argument keys and values) and tool definitions (every key and
    value: names, descriptions, parameter schemas)."""
    for i, message in enumerate(example.messages):
        where = f"messages[{i}]"
        yield f"{where}.content", message.content
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = getattr(message, key)
            if value is not None:
                yield f"{where}.{key}", value
        for j, call in enumerate(message.tool_calls):
            yield from _strings(call, f"{where}.tool_calls[{j}]")
    for j, tool in enumerate(example.tools or ()):
        yield from _strings(tool, f"tools[{j}]")


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, f"{where} key")
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for j, item in enumerate(value):
            yield from _strings(item, f"{where}[{j}]")


class _RecordText(NamedTuple):
    """Every string a chat record brings, in one text to search (see _check_data_strings): the message
    strings as they are, then the tool calls and tools written as JSON; and each tool written as
    tojson writes it, which the minijinja renders reuse (None when a tool holds a value JSON cannot
    write: tojson fails there as it would have)."""

    text: str
    tool_json: tuple[str, ...] | None


def _check_data_strings(
    example: Example, literals: re.Pattern[str] | None, *, contents_only: bool
) -> tuple[tuple[str, ...], _RecordText | None]:
    """Reject private-use marker characters anywhere in the record; name the fields that spell a
    special token. Also the record's text when the check wrote it (for _template_size).

    `contents_only`: the record brings no string but its message contents (it has a _shape); each
    content is then searched as it is, and a content that is ASCII holds no marker (str.isascii
    reads a flag): alpaca with Qwen2.5, 15-18 -> 2-3 us per record.
    """
    if contents_only:
        if not any(
            _holds_marker(m.content) or (literals is not None and spells_literal(literals, m.content))
            for m in example.messages
        ):
            return (), None
        return _spelled_fields(example, literals), None
    # One search over all of the record's strings (most records spell nothing): a search per string,
    # with its field name, was a third of a Qwen3 reasoning sample's render. JSON leaves every
    # character as it is but quotes, backslashes and control characters, which no searched pattern
    # holds (else each string is searched on its own). A literal found across two joined strings only
    # sends the record to that search.
    record = _record_text(example)
    if not _holds_marker(record.text) and (
        literals is None or (_survives_json(literals.pattern) and not spells_literal(literals, record.text))
    ):
        return (), record
    return _spelled_fields(example, literals), record


def _record_text(example: Example) -> _RecordText:
    # The message strings joined as they are: JSON-escaping them was most of the record's JSON (a Qwen3
    # reasoning record: 25 -> 13 us, the rest its tools and calls).
    strings = [s for m in example.messages for s in (m.content, m.reasoning_content, m.name, m.tool_call_id) if s]
    calls = [m.tool_calls for m in example.messages if m.tool_calls]
    try:
        tool_json = tuple(map(_tojson, example.tools or ()))
        nested = f"{json.dumps(calls, ensure_ascii=False)} [{', '.join(tool_json)}]"
    except (TypeError, ValueError):  # a value JSON cannot write (YAML's dates): counted by its str()
        tool_json = None
        nested = json.dumps([calls, example.tools], ensure_ascii=False, default=str)
    return _RecordText("\0".join([*strings, nested]), tool_json)


def _template_size(example: Example, record: _RecordText | None) -> int:
    """The record's size as a template could print it (see MiniTemplate.render_pair): its strings, its
    tool calls and tools as JSON, and 128 characters per message for its keys (all six, quoted), its
    role and the quotes of its strings; twice over for the sentinels of a marked render."""
    text = (_record_text(example) if record is None else record).text
    return 2 * (len(text) + 128 * len(example.messages))


@functools.cache
def _survives_json(pattern: str) -> bool:
    """Whether the literals of a literal_pattern are written by JSON as they are (no quote,
    backslash or control character in them)."""
    return '"' not in pattern and "\\\\" not in pattern and not any(ord(c) < 0x20 for c in pattern)


def _spelled_fields(example: Example, literals: re.Pattern[str] | None) -> tuple[str, ...]:
    spelled = []
    for where, text in data_strings(example):
        if _holds_marker(text):
            raise RecordError("holds plane-16 private-use characters, which packtool reserves as markers", field=where)
        if literals is not None and literals.search(text):
            spelled.append(where)
    return tuple(spelled)


def _mark_literals(value: Any, literals: re.Pattern[str] | None) -> Any:
    """A copy with the literal sentinel in front of every special-token literal inside every string."""
    if literals is None or value is None:
        return value
    if isinstance(value, str):
        return literals.sub(lambda found: _LITERAL + found.group(), value)
    if isinstance(value, dict):
        return {_mark_literals(k, literals): _mark_literals(v, literals) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mark_literals(item, literals) for item in value]
    return value


def _marked(message: dict[str, Any], index: int, literals: re.Pattern[str] | None = None) -> dict[str, Any]:
    """A copy of a message's template dict (Message.as_template_dict) with its content core wrapped in
    sentinels; surrounding whitespace stays outside so templates that trim content still produce the
    same text. Special-token literals in any of its strings get the literal sentinel."""
    out = _mark_literals(message, literals) if literals is not None else dict(message)
    if isinstance(message["content"], list):  # a message with images: each text part is a piece of its content
        out["content"] = [_marked_part(part, index, literals) for part in message["content"]]
        return out
    content = marked_content(message["content"], index, lambda core: _mark_literals(core, literals))
    if content is not None:
        out["content"] = content
    return out


def _marked_part(part: dict[str, Any], index: int, literals: re.Pattern[str] | None) -> dict[str, Any]:
    text = part.get("text")
    content = marked_content(text, index, lambda core: _mark_literals(core, literals)) if text is not None else None
    return _mark_literals(part, literals) if content is None else {**part, "text": content}


# A marked render without its sentinels: the text, each message's content ranges, the generation blocks,
# where data literals start.
_Stripped = tuple[str, dict[int, list[tuple[int, int]]], list[tuple[int, int]], list[int]]


def _strip_markers(marked: str) -> _Stripped:
    """The text without sentinels, each message's content ranges, the generation blocks and where
    data literals start."""
    pieces: list[str] = []
    length = 0
    last = 0
    opened: dict[int, int] = {}
    contents: dict[int, list[tuple[int, int]]] = {}
    generations: list[tuple[int, int]] = []
    literal_at: list[int] = []
    gen_start: int | None = None
    for match in _MARKERS.finditer(marked):
        pieces.append(marked[last : match.start()])
        length += match.start() - last
        last = match.end()
        char = match.group()
        if char == _LITERAL:
            literal_at.append(length)
        elif char == GENERATION_OPEN:
            gen_start = length
        elif char == GENERATION_CLOSE:
            if gen_start is not None:
                generations.append((gen_start, length))
            gen_start = None
        else:
            index, is_close = divmod(ord(char) - MARK_BASE, 2)
            if is_close:
                if index in opened:
                    contents.setdefault(index, []).append((opened.pop(index), length))
            else:
                opened[index] = length
    pieces.append(marked[last:])
    return "".join(pieces), contents, generations, literal_at
