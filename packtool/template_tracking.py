"""Tracking what a chat template inspects: sentinel marks around contents, Tracked strings, JsonSlots.

A marked content is a `Tracked` string: copying it (printing, `+`, `~`, the copying filters and
methods of template_ops) goes unnoticed, any other use sets the render's `inspected` (and a reading
that can be asked again is recorded), so render_chat knows when one marked render proves the plain
text. A JsonSlot stands for a tool definition or call arguments that a render may only print whole.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterable
from typing import Any

from packtool.template_limits import BUDGET
from packtool.template_ops import COPYING_METHODS, READINGS

# Plane-16 private-use characters: never meaningful text, and removed before tokenization. Message
# i's content is wrapped in open_mark(i) and close_mark(i) for a marked render (packtool.render).
MARK_BASE = 0x100000


def open_mark(index: int) -> str:
    return chr(MARK_BASE + 2 * index)


def close_mark(index: int) -> str:
    return chr(MARK_BASE + 2 * index + 1)


def marked_content(content: str, index: int, core_text: Callable[[str], str] = str) -> str | None:
    """Message `index`'s content with its core (stripped) between the message's marks, as `core_text` gives
    the core; whitespace around it stays outside, so templates that trim contents print the same text.
    None for a content of whitespace only, which reaches the template as it is."""
    core = content.strip()
    if not core:
        return None
    lead = content[: len(content) - len(content.lstrip())]
    return Tracked(f"{lead}{open_mark(index)}{core_text(core)}{close_mark(index)}{content[len(lead) + len(core) :]}")


# Plane-16 private-use characters (above the message marks) that wrap what a
# `{% generation %}` block prints in a marked render.
GENERATION_OPEN = chr(0x10FFF0)


GENERATION_CLOSE = chr(0x10FFF1)


# -- one render, and the proof that the plain render would be the same ---------------------------
#
# The marked render differs from the plain one only in the content strings, which carry sentinel
# characters. A template whose output depends on content only by copying it (printing, `+`, `~`,
# trim, tojson, truthiness: the same with or without sentinels) gives, once the sentinels are cut
# out, exactly the plain render. So marked contents are `Tracked` strings: any other use (a
# comparison, `in`, `|length`, slicing, `.startswith`, iteration, a filter) sets `inspected`, and
# then, only then, render_chat renders the plain messages as well and compares the two texts.
# Results derived from a tracked string (`+`, `~`, trim, tojson) stay tracked, so copying a
# content into a variable first does not hide a later inspection.


_CONTAINMENT = frozenset({"in", "notin"})  # jinja's names of the `in` and `not in` operators


_ORDERINGS = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
}


class Tracked(str):
    """A marked content string that reports being inspected (methods defined below the class)."""

    __slots__ = ()

    def __str__(self) -> str:
        return self

    def __bool__(self) -> bool:  # empty exactly when the plain content is: the sentinels wrap a non-empty core
        return str.__len__(self) > 0

    def __add__(self, other: Any) -> Any:
        result = str.__add__(self, other)
        return result if result is NotImplemented else Tracked(result)

    def __radd__(self, other: Any) -> Any:
        return Tracked(str.__add__(other, self)) if isinstance(other, str) else NotImplemented

    def _copying(self, name: str, chars: Any = None) -> str:
        if chars is not None and (not isinstance(chars, str) or chars.strip()):
            _inspected()  # stripping anything but whitespace could eat a sentinel's neighbour
        return Tracked(getattr(str, name)(self, chars))

    def strip(self, chars: Any = None) -> str:
        return self._copying("strip", chars)

    def lstrip(self, chars: Any = None) -> str:
        return self._copying("lstrip", chars)

    def rstrip(self, chars: Any = None) -> str:
        return self._copying("rstrip", chars)


def _inspected() -> None:
    budget = BUDGET.get(None)
    if budget is not None:
        budget.inspected = True
        budget.readings = None


def _inspecting(name: str, kind: type = str) -> Any:
    """`kind`'s method `name`, noting an inspection first (Tracked's, JsonSlot's)."""
    method = getattr(kind, name)

    def inspecting(self: Any, *args: Any, **kwargs: Any) -> Any:
        _inspected()
        return method(self, *args, **kwargs)

    inspecting.__name__ = name
    return inspecting


def _plain_argument(value: Any) -> bool:
    if type(value) is tuple:
        return all(_plain_argument(item) for item in value)
    return type(value) in (str, int, bool) or value is None


def _reading(name: str) -> Any:
    method = getattr(str, name)

    def reading(self: str, *args: Any, **kwargs: Any) -> Any:
        budget = BUDGET.get(None)
        if budget is None:
            return method(self, *args, **kwargs)
        budget.inspected = True
        readings, budget.readings = budget.readings, None  # kept only if this look can be asked again
        result = method(self, *args, **kwargs)
        index = budget.contents.get(id(self))
        if readings is not None and index is not None and not kwargs and _plain_argument(args) and type(result) is bool:
            readings.append((index, name, args, result))
            budget.readings = readings
        return result

    reading.__name__ = name
    return reading


for _name in sorted(vars(str)):
    if _name not in {
        "__new__",
        "__init__",
        "__getattribute__",
        "__str__",
        "__repr__",
        "__bool__",
        "__add__",
        "__radd__",
        "__reduce__",
        "__reduce_ex__",
        "__getnewargs__",
        "__sizeof__",
        "__class__",
        "__doc__",
        "__init_subclass__",
        "__subclasshook__",
        "__format__",
        "maketrans",
        *COPYING_METHODS,
    } and callable(getattr(str, _name)):
        setattr(Tracked, _name, _reading(_name) if _name in READINGS else _inspecting(_name))


Tracked.__hash__ = _inspecting("__hash__")  # type: ignore[method-assign]


def _is_tracked(values: Iterable[Any]) -> bool:
    return any(isinstance(value, Tracked) for value in values)


def _holds_containers(values: Iterable[Any]) -> bool:
    return any(isinstance(value, list | tuple | dict) for value in values)


# The sentinels around a marked content's core (open_mark, close_mark): the data holds none (render
# rejects a record that does), so a string holding one was made from a content.
CONTENT_MARKS = re.compile(f"[{chr(MARK_BASE)}-{chr(ord(GENERATION_OPEN) - 1)}]")


def _holds_content(result: Any) -> bool:
    """Whether a string holds (part of) a marked content, however it was made: a filter or call given
    a generator (`messages | map(attribute='content') | join`) has no container argument to show it."""
    return isinstance(result, str) and not isinstance(result, Tracked) and CONTENT_MARKS.search(result) is not None


def _tainted(result: Any) -> Any:
    """A string made from values that may hold a marked content (`message | tojson`,
    `[content] | join`, a macro's output) stays tracked, so inspecting it later is noticed."""
    return Tracked(result) if isinstance(result, str) and not isinstance(result, Tracked) else result


class JsonSlot(dict):  # type: ignore[type-arg]
    """A record's value that a render may only write whole through tojson (a tool definition, a call's
    arguments), given to the render that teaches a skeleton in place of the value (render._Slots).

    tojson prints it between the sentinels of a print of its own (Budget.prints), which the skeleton
    fills with that value's JSON for any other record of the shape. Every other use (a key, an item,
    an attribute, its length, iterating it, comparing or printing it) is an inspection: the render
    asked something of the value, and teaches no skeleton. Type tests (`is mapping`) see a dict, as
    they would the value, and its truth is the value's (a slot is never empty). Dunder names pass (the
    interpreter's own lookups; the sandbox gives a template none of them), and the slot's own two
    attributes are hidden from any other reader, so `tool._value` finds nothing, as on a dict.
    """

    __slots__ = ("_slot", "_value")

    def __init__(self, value: dict[str, Any], slot: int) -> None:
        super().__init__(value)
        _SLOT.__set__(self, slot)
        _VALUE.__set__(self, value)  # read past the dict's own methods, which note an inspection

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__"):
            return super().__getattribute__(name)
        _inspected()
        if name in JsonSlot.__slots__:
            raise AttributeError(name)
        return super().__getattribute__(name)

    def __bool__(self) -> bool:
        return True


_SLOT, _VALUE = JsonSlot._slot, JsonSlot._value  # type: ignore[attr-defined]  # the slots' descriptors


def _print_slot(slot: JsonSlot, **kwargs: Any) -> str:
    """What tojson prints of a slot in a render: its JSON between a print's sentinels."""
    budget = BUDGET.get(None)
    text = _tojson(_VALUE.__get__(slot), **kwargs)
    if budget is None:  # outside ChatTemplate.render: nothing to learn
        return text
    index = budget.prints_from + len(budget.prints)
    if ord(close_mark(0)) + 2 * index >= ord(GENERATION_OPEN):
        _inspected()  # no sentinel left for it: an inspection, so nothing is learned
        return text
    budget.prints.append((_SLOT.__get__(slot), tuple(sorted(kwargs.items()))))
    return Tracked(f"{open_mark(index)}{text}{close_mark(index)}")


# the operators and conversions Python looks up on the type, past __getattribute__
for _name in (
    *("__len__", "__iter__", "__reversed__", "__getitem__", "__contains__", "__or__", "__ror__"),
    *("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__repr__", "__str__", "__format__"),
):
    setattr(JsonSlot, _name, _inspecting(_name, dict))


JsonSlot.__hash__ = None  # type: ignore[assignment]  # as a dict's


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (jinja's built-in escapes <, >, & and breaks tool JSON).
    if not (ensure_ascii or indent is not None or separators is not None or sort_keys):
        return _PLAIN_JSON.encode(value)  # json.dumps builds an encoder per call for these arguments: ~1.5 us
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_PLAIN_JSON = json.JSONEncoder(ensure_ascii=False)
