"""Skeletons: a conversation shape's marked render with the contents (and slots) cut out, filled with the
words of any conversation of the shape instead of rendering it (an accelerator: see routes.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from packtool.records import Example, Message
from packtool.render.marks import _MARKERS, _MAX_MESSAGES, _strip_markers, _Stripped
from packtool.render.recipes import _Recipe
from packtool.template_limits import MAX_TEMPLATE_CHARS
from packtool.template_tracking import (
    CONTENT_MARKS,
    MARK_BASE,
    JsonSlot,
    _tojson,
    close_mark,
    marked_content,
    open_mark,
)

Shape = tuple[Any, ...]


def _shape(example: Example, cores: list[str]) -> tuple[Shape | None, _Slots | None]:
    """All a template sees of a conversation apart from the words of its strings, and those strings.

    A conversation of contents alone: each message's role and the whitespace around its content (a
    content of whitespace only, given whole, reaches the template unmarked), and no slots. One that
    brings more (tools, tool calls, names, ids, reasoning) also has its slots (see _Slots): its shape
    holds the rest (which fields each message has, the keys of each call, the whitespace around each
    string, every number and flag). (None, None) when it brings something no slot holds (a list, a
    tool that is not an object): such a conversation is always rendered.
    """
    shape: list[tuple[str, str, str | None]] = []
    slotted = bool(example.tools)
    for m, core in zip(example.messages, cores):
        if m.tool_calls or m.tool_call_id is not None or m.name is not None or m.reasoning_content is not None:
            slotted = True
        if not core:
            shape.append((m.role, m.content, None))
            continue
        lead = len(m.content) - len(m.content.lstrip())
        shape.append((m.role, m.content[:lead], m.content[lead + len(core) :]))
    if not slotted:
        return tuple(shape), None
    walked = _SlotWalk(len(example.messages), mark=False).walk(example)
    if walked is None:
        return None, None
    extras, slots, _, _ = walked
    return ("slots", tuple(shape), extras), slots


@dataclass(frozen=True, slots=True)
class _Slots:
    """A conversation's strings other than its contents, and the values a template may only write whole.

    `leaves`: the cores of reasoning, names, ids, call names and string arguments, which a render may
    print as they are (the whitespace around each is in the shape). `values`: tool definitions, then
    call arguments given as objects, which a render may only write through tojson (sandbox.JsonSlot).
    A skeleton's render was given each marked, so nothing it decided can have depended on them but
    through the copies it printed; `_SlotWalk` gives them in one order, for the shape and the render.
    """

    leaves: tuple[str, ...]
    values: tuple[dict[str, Any], ...]
    tools: int  # values[:tools] are the tool definitions
    # Each tool call as (its message, the sentinel index of its name's leaf, of its arguments' leaf, the
    # value slot of its arguments), None where the call has none of these (see _tool_checks_implied).
    calls: tuple[tuple[int, int | None, int | None, int | None], ...]


class _SlotWalk:
    """One walk over a conversation's fields for its slots (_Slots), its shape's rest, and with `mark`
    the template dicts of a render that marks them: message `n` + k's sentinels around leaf k, a
    JsonSlot for value k."""

    def __init__(self, messages: int, *, mark: bool) -> None:
        self.first_leaf = messages
        self.mark = mark
        self.leaves: list[str] = []
        self.values: list[dict[str, Any]] = []
        self.calls: list[tuple[int, int | None, int | None, int | None]] = []
        self.call: list[int | None] = [None, None, None]  # the call being walked: see _Slots.calls

    def walk(self, example: Example) -> tuple[Shape, _Slots, list[dict[str, Any]] | None, list[Any] | None] | None:
        """(the shape's rest, the slots, the marked messages, the marked tools); None where a field holds
        something no slot holds."""
        walked_tools = [self.value(tool) for tool in example.tools or ()]
        tools = [tool for tool in walked_tools if tool is not None]
        if len(tools) < len(walked_tools):
            return None
        parts, marked = [], []
        for i, message in enumerate(example.messages):
            extras = (message.tool_call_id, message.name, message.reasoning_content)
            fields: list[Any] = []
            out: dict[str, Any] = {"role": message.role, "content": message.content}
            if self.mark:
                out["content"] = marked_content(message.content, i) or message.content
            if message.tool_calls:
                calls = []
                for call in message.tool_calls:
                    self.call = [None, None, None]
                    walked_call = self.mapping(call, self.call_item)
                    if walked_call is None:
                        return None
                    calls.append(walked_call)
                    name, argument_leaf, argument_value = self.call
                    self.calls.append((i, name, argument_leaf, argument_value))
                fields.append(("tool_calls", tuple(part for part, _ in calls)))
                out["tool_calls"] = [value for _, value in calls]
            for key, text in zip(("tool_call_id", "name", "reasoning_content"), extras):
                if text is not None:
                    part, out[key] = self.leaf(text)
                    fields.append((key, part))
            parts.append(tuple(fields))
            marked.append(out)
        if self.first_leaf + len(self.leaves) >= _MAX_MESSAGES:
            return None  # no sentinel left for them
        slots = _Slots(tuple(self.leaves), tuple(self.values), len(tools), tuple(self.calls))
        rest = (tuple(parts), tuple(part for part, _ in tools))
        return rest, slots, marked if self.mark else None, [value for _, value in tools] if self.mark else None

    def leaf(self, text: str) -> tuple[Shape, Any]:
        core = text.strip()
        if not core:
            return ("=", text), text
        marked = marked_content(text, self.first_leaf + len(self.leaves)) if self.mark else text
        self.leaves.append(core)
        lead = text[: len(text) - len(text.lstrip())]
        return ("s", lead, text[len(lead) + len(core) :]), marked

    def value(self, value: Any) -> tuple[Shape, Any] | None:
        if not isinstance(value, dict) or not value:
            return None
        marked = JsonSlot(value, len(self.values)) if self.mark else value
        self.values.append(value)
        return ("json",), marked

    def mapping(self, value: Any, item: Any) -> tuple[Shape, dict[str, Any]] | None:
        if not isinstance(value, dict):
            return None
        parts, out = [], {}
        for key, field_value in value.items():
            walked = item(key, field_value) if isinstance(key, str) else None
            if walked is None:
                return None
            parts.append((key, walked[0]))
            out[key] = walked[1]
        return tuple(parts), out

    def call_item(self, key: str, value: Any) -> tuple[Shape, Any] | None:
        if key == "function" and isinstance(value, dict):
            return self.mapping(value, self.function_item)
        return self.scalar(value)

    def function_item(self, key: str, value: Any) -> tuple[Shape, Any] | None:
        if key == "arguments" and isinstance(value, dict) and value:
            self.call[2] = len(self.values)
            return self.value(value)
        leaves = len(self.leaves)
        walked = self.scalar(value)
        if key in ("name", "arguments") and len(self.leaves) > leaves:
            self.call[0 if key == "name" else 1] = self.first_leaf + leaves
        return walked

    def scalar(self, value: Any) -> tuple[Shape, Any] | None:
        if isinstance(value, str):
            return self.leaf(value)
        if value is None or isinstance(value, bool | int | float):
            return ("=", type(value).__name__, value), value  # the type too: True == 1
        if isinstance(value, dict) and not value:
            return ("{}",), {}
        return None


# Skeletons kept per template: real data has a few shapes (turn counts, whitespace habits); data
# with many more (every conversation its own) must not grow memory without bound.
MAX_SKELETONS = 4096


# Shapes with slots remembered as seen once (a hash each, ~60 bytes): past this, a new shape is not
# learned from (its conversations render as ones without a shape).
MAX_SHAPES_SEEN = 1 << 16


# How much longer than its content a copy of it can get: tojson writes a character outside the
# Basic Multilingual Plane as two \uXXXX escapes.
_TOJSON_GROWTH = 12


@dataclass(frozen=True, slots=True)
class _Skeleton:
    """A marked render with the content cores cut out, for every conversation of the same _shape.

    The render that made it never inspected a content (see Tracked), so nothing it decided can have
    depended on the words: the template runs the same way on any conversation of that shape, and
    its text is these literals with the other conversation's cores in their place (sentinels
    included), as a render would give it. A shape with slots (_Slots) has their copies too: each
    leaf's core, and each value's JSON where the render wrote one through tojson (JsonSlot). Only
    sizes follow the words: a copy n times longer makes every string the render builds at most n
    times longer (12n through tojson's escapes), so a conversation whose render could reach
    MAX_TEMPLATE_CHARS is rendered and meets the limit there.

        marked render  <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
        literals       '<|im_start|>user\\n'   '<|im_end|>\\n<|im_start|>assistant\\n'   '<|im_end|>\\n'
        copies         (0, 1)
    """

    literals: tuple[str, ...]  # literals[k] comes before the k-th copy, the last after all
    copies: tuple[int, ...]  # the sentinel index of each copy: a message's content, a leaf, a print (see texts)
    lengths: tuple[int, ...]  # per sentinel index, the length of its text in the render that made it
    messages: int  # sentinel indices below this are message contents
    peak: int  # the largest size that render built
    # The yes/no questions that render asked of contents, with its answers (sandbox.READINGS; see
    # replays); empty for a template that never looked inside a content.
    readings: tuple[tuple[int, str, tuple[Any, ...], bool], ...] = ()
    # What tojson printed of each JsonSlot, in order after the leaves: (value, the filter's arguments).
    prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = ()
    sentinels_in_literals: bool = False  # a literal holds a sentinel of its own (a generation block's)
    tool_checks_implied: bool = False  # see _tool_checks_implied

    @classmethod
    def of(
        cls,
        marked: str,
        messages: tuple[Message, ...],
        peak: int,
        readings: tuple[Any, ...] = (),
        slots: _Slots | None = None,
        prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = (),
    ) -> _Skeleton | None:
        """None when the render printed a content or a leaf other than verbatim (a JSON-escaped copy)."""
        cores = [m.content.strip() for m in messages]
        texts = _copy_texts(cores, slots, prints)
        if texts is None:
            return None
        literals: list[str] = []
        copies: list[int] = []
        start, opened = 0, -1
        for match in CONTENT_MARKS.finditer(marked):
            index, is_close = divmod(ord(match.group()) - MARK_BASE, 2)
            if index >= len(texts):
                return None
            if not is_close and opened < 0:
                literals.append(marked[start : match.start()])
                opened = index
            elif is_close and opened == index and marked[start : match.start()] == texts[index]:
                copies.append(index)
                opened = -1
            else:
                return None
            start = match.end()
        if opened >= 0:
            return None
        literals.append(marked[start:])
        marks = any(_MARKERS.search(literal) for literal in literals)
        implied = slots is not None and _tool_checks_implied(copies, len(cores), slots, prints)
        return cls(
            tuple(literals), tuple(copies), tuple(map(len, texts)), len(cores), peak, readings, prints, marks, implied
        )

    # Trained-message pattern and target settings -> the recipe for them (None: this shape has none).
    recipes: dict[tuple[Any, ...], _Recipe | None] = field(default_factory=dict, compare=False, repr=False)

    def replays(self, messages: tuple[Message, ...]) -> bool:
        """Whether both renders of these messages (marked and plain) would ask what this skeleton's render
        asked and get its answers, and so run as it ran.

        A render is a function of what it reads. Before its first question about a content, a render
        of this shape reads what every conversation of the shape shares; given the same answer it goes
        on the same way to the same next question; and it only copies contents otherwise (Tracked
        noticed anything else, and no skeleton was kept). So a marked render given these answers prints
        this skeleton with these contents, and a plain render given them runs the same course and prints
        the same text without the sentinels: one render's text, as a skeleton without questions gives it.

            Qwen3, assistant turn 1:  '</think>' in content -> False   (content "4", and "The sum is 4")
        """
        for index, method, arguments, answer in self.readings:
            content = messages[index].content
            marked = marked_content(content, index)
            ask = getattr(str, method)
            if marked is None or ask(content, *arguments) is not answer or ask(marked, *arguments) is not answer:
                return False
        return True

    def texts(self, cores: list[str], slots: _Slots | None, known_json: tuple[str, ...] | None) -> list[str] | None:
        """The text of each sentinel index for a conversation of this shape: its content cores, its leaves,
        and what tojson prints of its values (`known_json`: its tools' JSON, written already); None when a
        value cannot be written (tojson fails there: the conversation must be rendered)."""
        if len(self.lengths) == self.messages:
            return cores
        return _copy_texts(cores, slots, self.prints, known_json)

    def fits(self, texts: list[str]) -> bool:
        """Whether a render of the conversation with these texts (see texts) stays under MAX_TEMPLATE_CHARS
        (else it must really be rendered)."""
        growth = max([len(text) / n for text, n in zip(texts, self.lengths) if n] + [1.0])
        return self.peak * growth * _TOJSON_GROWTH <= MAX_TEMPLATE_CHARS

    def fill(self, texts: list[str]) -> _Stripped:
        """What _strip_markers gives of the marked render of the conversation with these texts (see texts),
        the render that marks contents alone: its text and where each content is, put together directly
        (a Qwen3 tool record: 14 -> 3 us), or by that function where a literal holds another sentinel
        (a generation block's)."""
        if self.sentinels_in_literals:
            parts = [self.literals[0]]
            for index, literal in zip(self.copies, self.literals[1:]):
                text = texts[index]
                parts += (
                    (open_mark(index), text, close_mark(index), literal) if index < self.messages else (text, literal)
                )
            return _strip_markers("".join(parts))
        parts = [self.literals[0]]
        at = len(self.literals[0])
        contents: dict[int, list[tuple[int, int]]] = {}
        for index, literal in zip(self.copies, self.literals[1:]):
            text = texts[index]
            if index < self.messages:
                contents.setdefault(index, []).append((at, at + len(text)))
            parts += (text, literal)
            at += len(text) + len(literal)
        return "".join(parts), contents, [], []


def _tool_checks_implied(
    copies: list[int], messages: int, slots: _Slots, prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]
) -> bool:
    """Whether _check_tools_printed passes for every conversation of a skeleton's shape, so that a fill
    need not run it (a Qwen3 tool record: 17 us).

    It does when each tool definition is printed whole through tojson outside every content and every
    call's region, and each call's name leaf and its arguments (their leaf, or their JSON) inside its
    region: a JSON text holds every key and string of its value in a form _printed_at looks for, and
    which copies lie in which region depends on the order of the copies alone, which the shape fixes
    (regions are bounded by contents: see _check_tools_printed). A skeleton that prints them some other
    way (or a name in the reasoning only) has every fill checked.
    """
    first_print = messages + len(slots.leaves)
    contents = [(k, index) for k, index in enumerate(copies) if index < messages]

    def region(i: int) -> range:
        upper = next((k for k, message in contents if message > i), len(copies))
        lower = max((k for k, message in contents if message < i and k < upper), default=-1)
        return range(lower + 1, upper)

    def printed_value(slot: int, where: Iterable[int]) -> bool:
        return any(copies[k] >= first_print and prints[copies[k] - first_print][0] == slot for k in where)

    regions = {i: region(i) for i, *_ in slots.calls}
    inside = {k for where in regions.values() for k in where}
    outside = [k for k in range(len(copies)) if copies[k] >= messages and k not in inside]
    if not all(printed_value(tool, outside) for tool in range(slots.tools)):
        return False
    for i, name, argument_leaf, argument_value in slots.calls:
        where = regions[i]
        named = name is not None and any(copies[k] == name for k in where)
        if argument_leaf is not None:
            argued = any(copies[k] == argument_leaf for k in where)
        else:
            argued = argument_value is not None and printed_value(argument_value, where)
        if not (named and argued):
            return False
    return True


def _copy_texts(
    cores: list[str],
    slots: _Slots | None,
    prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...],
    known_json: tuple[str, ...] | None = None,
) -> list[str] | None:
    if slots is None:
        return cores if not prints else None
    texts = [*cores, *slots.leaves]
    try:
        for value, arguments in prints:
            if known_json is not None and not arguments and value < len(known_json):
                texts.append(known_json[value])  # a tool's JSON, written for the record's data check
            else:
                texts.append(_tojson(slots.values[value], **dict(arguments)))
    except (TypeError, ValueError, RecursionError):  # what tojson fails on, a render fails on too
        return None
    return texts


# Renders by jinja2 (which notes the questions) of a shape that looks inside its contents, before
# minijinja renders the conversations of that shape that no skeleton learned from them fits: each
# answer pattern (Qwen3: a content holding `</think>` or not) costs one such render, and a template
# whose looks are never questions pays this many jinja2 renders per shape where it paid one.
MAX_READ_TRIES = 8


@dataclass(slots=True)
class _ReadSkeletons:
    """The skeletons of one shape whose template looks inside contents, one per pattern of answers."""

    skeletons: list[_Skeleton] = field(default_factory=list)
    tries: int = 0  # jinja2 renders of the shape so far

    def replaying(self, messages: tuple[Message, ...]) -> _Skeleton | None:
        return next((skeleton for skeleton in self.skeletons if skeleton.replays(messages)), None)
