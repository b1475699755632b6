"""The sandbox chat templates run in: transformers' immutable jinja sandbox plus counted limits.

Untrusted templates cannot reach Python internals (jinja's sandbox), and every render spends from
a budget of operations, sizes and depth (the limits below), so a hostile or runaway template
rejects its sample instead of hanging a build or exhausting memory. Marked content strings are
`Tracked`: a render that only copies them needs no second, plain render to prove its text (see
packtool.render).
"""

from __future__ import annotations

import contextvars
import functools
import json
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from markupsafe import Markup

from packtool.errors import TemplateRaised

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

# Template limits. Each is a count, never a time, so a sample is rejected for the same reason on
# every machine and executor and the output bytes stay identical. A real chat template spends
# a few hundred operations on a conversation and prints what the data holds; these bounds are
# orders of magnitude above that and far below what would hang a build or exhaust memory.
MAX_TEMPLATE_OPERATIONS = 1_000_000  # loop iterations + calls + arithmetic, per render
MAX_TEMPLATE_CHARS = 1 << 23  # 8 Mi characters: any string or sequence a template builds, its output included
MAX_TEMPLATE_DEPTH = 64  # nested macro calls (runaway recursion)
MAX_INT_BITS = 1 << 16  # results of ** (3**(3**20) would take minutes and gigabytes)
MAX_LIPSUM = 100  # lipsum paragraphs


class TemplateLimit(Exception):
    """A render went past one of the limits above: the sample is rejected (kind `template_limit`)."""


@dataclass(slots=True)
class Budget:
    operations: int = 0
    depth: int = 0
    inspected: bool = False  # the template looked inside a marked content string (see Tracked)
    # Each look inside a content as (message index, str method, arguments, result) while every one was a
    # predicate on a content object as given (see _reading); None from the first look of any other kind.
    readings: list[tuple[int, str, tuple[Any, ...], bool]] | None = field(default_factory=list)
    # id of each marked content object the render was given -> its message index (see ChatTemplate.render_tracked)
    contents: dict[int, int] = field(default_factory=dict)
    peak: int = 0  # the largest string or sequence size checked against MAX_TEMPLATE_CHARS (see _Skeleton)
    # A marked content went through tojson, which escapes it: the copy looks verbatim for a content with
    # no quote, backslash or control character and is not for the next one, so no skeleton may be
    # learned from this render (the one-render proof still holds: escaping is per character).
    escaped: bool = False
    # Sentinel indices from here on mark what tojson printed of a JsonSlot: (slot number, its arguments)
    # for each print, in the order the template asked (see JsonSlot).
    prints_from: int = 0
    prints: list[tuple[int, tuple[tuple[str, Any], ...]]] = field(default_factory=list)
    # id -> (container, its expanded size) for the lists, tuples and dicts this render met (see _expanded);
    # the container is held so that its id is not reused while the render runs
    expanded: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def spend(self, n: int = 1) -> None:
        self.operations += n
        if self.operations > MAX_TEMPLATE_OPERATIONS:
            raise TemplateLimit(
                f"more than {MAX_TEMPLATE_OPERATIONS:,} operations (loop iterations, calls, arithmetic) in one render"
            )


# One budget per render; a context variable keeps concurrent renders on two threads apart.
BUDGET: contextvars.ContextVar[Budget] = contextvars.ContextVar("packtool_template_budget")


def _spend(n: int = 1) -> Budget:
    budget = BUDGET.get(None)
    if budget is None:  # a render outside ChatTemplate.render (a test calling jinja directly)
        budget = Budget()
        BUDGET.set(budget)
    budget.spend(n)
    return budget


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

_COPYING_METHODS = frozenset({"strip", "lstrip", "rstrip"})
_CONTAINMENT = frozenset({"in", "notin"})  # jinja's names of the `in` and `not in` operators
_ORDERINGS = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
}
_COPYING_FILTERS = frozenset({"trim", "string", "tojson"})


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


# Looks inside a content that can be asked again of another conversation's content, marked and plain,
# without a render (render._Skeleton.replays): a yes/no question with plain arguments, asked of a content
# object the render was given (not of a string made from it: `content.strip().startswith(x)` is not
# `content.startswith(x)`). Qwen3 asks `'</think>' in content` and `content.startswith('<tool_response>')`.
READINGS = frozenset({"__contains__", "startswith", "endswith", "__eq__", "__ne__"})


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
        *_COPYING_METHODS,
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


def _check_size(size: int, what: str) -> None:
    budget = BUDGET.get(None)
    if budget is not None and size > budget.peak:
        budget.peak = size
    if size > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"{what} of {size:,} items exceeds the {MAX_TEMPLATE_CHARS:,} a template may build")


def _sized(value: Any) -> int:
    # str.__len__, not len(): the limits must not count as the template inspecting a Tracked string
    if isinstance(value, str):
        return str.__len__(value)
    return len(value) if isinstance(value, list | tuple | bytes) else 0


def _expanded(value: Any) -> int:
    """The size of `value` written out: characters of a string, digits of an int, and for a list,
    tuple or dict its items, each counted in full however often it repeats. `[x, x]` ten times over
    is a few operations that print as 2**10 copies of x; this is what printing it would cost."""
    if isinstance(value, str):
        return str.__len__(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if not isinstance(value, list | tuple | dict):
        return 1
    budget = BUDGET.get(None)
    memo = budget.expanded if budget is not None else {}
    known = memo.get(id(value))
    if known is not None:
        return known[1]
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    try:  # the common case, a list of strings, summed in C (a 4 M item `'x' * n | list` in 0.05 s)
        size = 1 + len(items) + sum(map(str.__len__, items))
    except TypeError:
        size = 1 + sum(map(_expanded, items))
    memo[id(value)] = (value, size)
    return size


def _built(value: Any, what: str) -> Any:
    """`value`, once its expanded size is within the limit."""
    _check_size(_expanded(value), what)
    return value


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before computing it, a result that would be huge."""
    numbers = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and numbers and right > 0:
        if abs(left) > 1 and max(left.bit_length(), 1) * right > MAX_INT_BITS:
            raise TemplateLimit(f"{left} ** {right} exceeds {MAX_INT_BITS} bits")
    elif operator == "*" and numbers:  # squaring in a loop doubles the bits each time
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product of {left.bit_length() + right.bit_length()} bits exceeds {MAX_INT_BITS}")
    elif operator == "*":
        for seq, times in ((left, right), (right, left)):
            if _sized(seq) and isinstance(times, int):
                _check_size(_expanded(seq) * times, "a repeated string or list")
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)


# A %-conversion: an optional (key), flags, then a width and a precision, either given as * (taken from the values).
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(text: str, values: Any) -> None:
    """Refuse `text % values` (or `text | format(...)`) when its result could pass MAX_TEMPLATE_CHARS:
    each conversion may print the largest value and its width and precision; `'%999999999d' % 1`
    would allocate a gigabyte before any check after the fact."""
    conversions = _PERCENT.findall(text)
    if not conversions:
        return
    items = (
        list(values.values()) if isinstance(values, dict) else list(values) if isinstance(values, tuple) else [values]
    )
    numbers = [int(n) for pair in conversions for n in pair if n.isdigit()]
    if any("*" in pair for pair in conversions):
        numbers += [abs(v) for v in items if isinstance(v, int)]
    largest = max(map(_expanded, items), default=0)
    size = str.__len__(text) + sum(numbers) + len(conversions) * largest
    if size > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(
            f"a %-format that could print {size:,} characters (widths, precisions and values) exceeds the "
            f"{MAX_TEMPLATE_CHARS:,} a template may build"
        )


class _CheckedFields:
    """str.format and format_map in a template: each field's width and precision is checked before
    the field is formatted, and the text built so far after (`'{:>999999999}'.format(1)` allocated
    a gigabyte before the rendered text was checked)."""

    built = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self.built = str.__len__(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        _spend()
        numbers = sum(map(int, re.findall(r"\d+", format_spec)))
        _check_size(self.built + numbers + _expanded(value), "a str.format result")
        text = super().format_field(value, format_spec)  # type: ignore[misc]
        self.built += _sized(text)
        _check_size(self.built, "a str.format result")
        return text


class _CheckedFormatter(_CheckedFields, SandboxedFormatter):
    pass


class _CheckedEscapeFormatter(_CheckedFields, SandboxedEscapeFormatter):
    pass


def _spend_per_item(value: Any, *args: Any, **kwargs: Any) -> int:
    """Filters that run Python for each item or character of their input (unique, batch, sort, ...)."""
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


def _spend_per_character(value: Any, *args: Any, **kwargs: Any) -> int:
    """urlize runs a regular expression per word: ~1 us a character, so a character is an operation."""
    return _sized(value)


def _spend_wordwrap(
    text: Any, width: int = 79, break_long_words: bool = True, wrapstring: Any = None, *args: Any, **kwargs: Any
) -> int:
    """textwrap is ~1 us a character, and breaking a long word copies what is left of it at every cut:
    a word of n characters at width w copies n*n/(2w) (100,000 characters at width 1: 2.5 s)."""
    size = _sized(text)
    if not isinstance(width, int) or width < 1:
        return size  # textwrap raises on it
    _check_size(size * (1 + _sized(wrapstring or "\n")), "the result of |wordwrap")  # a wrapstring at each cut
    longest = max(map(len, str(text).split()), default=0) if break_long_words else 0
    return size + longest * longest // (2 * width * 1024)  # 1 operation per KiB copied


def _spend_pprint(value: Any, *args: Any, **kwargs: Any) -> int:
    _spend(_expanded(value))  # a value too large to walk is refused before the walk
    return _pprint_cost(value, {})


def _pprint_cost(value: Any, seen: dict[int, int]) -> int:
    """pprint writes a value that does not fit a line by writing each item, so every level of
    nesting writes its whole subtree again: the expanded sizes of all subtrees, shared ones once."""
    if not isinstance(value, list | tuple | dict):
        return 1
    if id(value) not in seen:
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        seen[id(value)] = _expanded(value) + sum(_pprint_cost(item, seen) for item in items)
    return seen[id(value)]


def _check_indent(text: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    """indent adds its prefix to every line: 4 M newlines at width 1000 asked for 4 G characters."""
    prefix = _sized(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    if isinstance(text, str):
        _check_size(str.__len__(text) + (text.count("\n") + 1) * prefix, "the result of |indent")
    return 0


def _check_format(text: Any, *args: Any, **kwargs: Any) -> int:
    if isinstance(text, str):
        _check_percent(text, kwargs or args)
    return 0


def _check_join(value: Any, separator: Any = "", *args: Any, **kwargs: Any) -> int:
    if isinstance(value, list | tuple):
        _check_size(_expanded(value) + len(value) * _sized(separator), "the result of |join")
    return 0


# What a filter spends before it runs, beyond its one operation: checks that refuse a result that
# would pass MAX_TEMPLATE_CHARS before it is built, and operations for the filters whose time grows
# faster than the text they return (pprint walks nested values once per level it fits on a line).
_FILTER_COSTS: dict[str, Any] = {
    "urlize": _spend_per_character,
    "wordwrap": _spend_wordwrap,
    "indent": _check_indent,
    "format": _check_format,
    "join": _check_join,
    "pprint": _spend_pprint,
    **dict.fromkeys(("unique", "batch", "slice", "sort", "groupby", "dictsort", "xmlattr"), _spend_per_item),
}


def _check_method(owner: str, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """str methods whose result can outgrow their arguments: expandtabs, join, translate."""
    if name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_size(str.__len__(owner) + owner.count("\t") * tabsize, "an expandtabs() result")
    elif name == "join" and args and isinstance(args[0], list | tuple):
        _check_size(_expanded(args[0]) + len(args[0]) * str.__len__(owner), "a join() result")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((_sized(v) for v in args[0].values()), default=1)
        _check_size(str.__len__(owner) * longest, "a translate() result")


def _check_arguments(args: tuple, kwargs: dict[str, Any]) -> None:
    """Numbers that size a result (center(10**9), indent, ljust, zfill) and replace() that multiplies."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TEMPLATE_CHARS:
            raise TemplateLimit(
                f"argument {value:,} exceeds the {MAX_TEMPLATE_CHARS:,} characters a template may build"
            )


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        count = len(text) + 1 if not old else text.count(old)
        _check_size(len(text) + count * (len(new) - len(old)), "a replace() result")


def _limited_filter(function: Any, name: str) -> Any:
    """A filter that counts as an operation (more for those in _FILTER_COSTS), checks its size
    arguments and the size of its result."""
    cost = _FILTER_COSTS.get(name)

    @functools.wraps(function)
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = _spend()
        _check_arguments(args, kwargs)
        if name == "replace" or cost is not None:
            # the environment or eval context jinja passes first is not an argument
            plain = [a for a in args if not isinstance(a, jinja2.Environment) and not hasattr(a, "environment")]
            if name == "replace" and len(plain) >= 3:
                _check_replace(*plain[:3])
            if cost is not None and plain:
                _spend(cost(*plain, **kwargs))
        tracked = _is_tracked((*args, *kwargs.values()))
        if tracked and name not in _COPYING_FILTERS:
            _inspected()
        result = function(*args, **kwargs)
        _check_size(
            _expanded(result) if isinstance(result, list | tuple | dict) else _sized(result), f"the result of |{name}"
        )
        # (a JsonSlot's print, Tracked, is the slot's own copy: not a content escaped)
        if name == "tojson" and type(result) is str and CONTENT_MARKS.search(result) is not None:
            budget.escaped = True
        if tracked or name == "tojson" or _holds_containers(args) or _holds_content(result):
            return _tainted(result)
        return result

    return limited


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles every loop to iterate through `environment.counted` and every `~` through
    `environment.joined`: the two ways a template spends time or memory without calling anything.
    Comparisons with `in` or `not in` go through `environment.compared` (see there)."""

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:
        if not any(operand.op in _CONTAINMENT for operand in node.ops):
            super().visit_Compare(node, frame)
            return
        # each later operand as a thunk: a chain evaluates it only while the comparisons hold
        self.write("environment.compared(")
        self.visit(node.expr, frame)
        for operand in node.ops:
            self.write(f", {operand.op!r}, lambda: ")
            self.visit(operand.expr, frame)
        self.write(")")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        counted = nodes.EnvironmentAttribute("counted")
        if not (isinstance(node.iter, nodes.Call) and node.iter.node == counted):
            node.iter = nodes.Call(counted, [node.iter], [], None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    def _built(self, node: nodes.List | nodes.Tuple | nodes.Dict, frame: Frame, visit: Any) -> None:
        """A list, tuple or dict the template writes goes through `environment.built`: nesting one
        in itself doubles what printing it costs, with no loop or call to count."""
        if getattr(node, "ctx", "load") != "load":  # a tuple to unpack into (`for a, b in ...`)
            visit(self, node, frame)
            return
        self.write("environment.built(")
        visit(self, node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._built(node, frame, CodeGenerator.visit_List)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        self._built(node, frame, CodeGenerator.visit_Tuple)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._built(node, frame, CodeGenerator.visit_Dict)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.joined((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox plus counted limits (module constants above) on time and memory."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _spend()
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            if getattr(__obj, "__name__", None) == "replace":
                _check_replace(owner, *args[:2])
            _check_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        # calls reach str.format past the method table (the sandbox formats itself), and any
        # function given a marked content may look at it
        if _is_tracked((*args, *kwargs.values())) or (
            isinstance(owner, Tracked) and __obj.__name__ not in _COPYING_METHODS and __obj.__name__ not in READINGS
        ):
            _inspected()  # a reading (startswith, endswith) is noted by Tracked's own method, which runs next
        if not isinstance(__obj, Macro):
            result = super().call(__context, __obj, *args, **kwargs)
            if isinstance(result, list | tuple | dict):  # dict(a=x, b=x), x.copy(): built like a literal
                _check_size(_expanded(result), "a list or mapping a call returned")
            return _tainted(result) if _holds_containers(args) or _holds_content(result) else result
        budget.depth += 1
        try:
            if budget.depth > MAX_TEMPLATE_DEPTH:
                raise TemplateLimit(f"macro calls nested deeper than {MAX_TEMPLATE_DEPTH} (runaway recursion)")
            return _tainted(super().call(__context, __obj, *args, **kwargs))  # may print any content it reads
        finally:
            budget.depth -= 1

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _spend()
        if operator == "+":  # the hot one (templates build turns with +): checked after, at most 2x the limit
            result = left + right  # a Tracked operand keeps the result tracked (Tracked.__add__/__radd__)
            if type(result) is str:  # the common case, inlined: 10 of these per conversation
                size = str.__len__(result)
                if size > budget.peak:
                    budget.peak = size
                    _check_size(size, "a concatenation")
                return result
            _check_size(_expanded(result) if isinstance(result, list | tuple) else _sized(result), "a concatenation")
            if isinstance(left, Tracked) or isinstance(right, Tracked):  # Markup + content loses the type
                return _tainted(result)
            return result
        if isinstance(left, Tracked) or isinstance(right, Tracked):
            _inspected()
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def built(value: Any) -> Any:
        return _built(value, "a list or mapping the template writes")

    def wrap_str_format(self, value: Any) -> Any:
        """A str's format or format_map through _CheckedFormatter (jinja's own checks only attributes)."""
        if super().wrap_str_format(value) is None:  # not the format method of a string
            return None
        text: str = value.__self__
        formatter = (
            _CheckedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) else _CheckedFormatter(self)
        )
        by_mapping = value.__name__ == "format_map"

        def formatted(*args: Any, **kwargs: Any) -> str:
            if not by_mapping:
                return type(text)(formatter.vformat(text, args, kwargs))
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one mapping")
            return type(text)(formatter.vformat(text, (), args[0]))

        return functools.update_wrapper(formatted, value)

    @staticmethod
    def compared(left: Any, *chain: Any) -> Any:
        """A comparison chain (`a in b`, `a < b not in c`) as Python evaluates it, where looking for
        a content inside something is an inspection: `content in 'yes no'` runs the plain string's
        own __contains__, which a Tracked content never sees (its sentinels would make every such
        test false, and the render followed a branch that the plain content does not take)."""
        result: Any = True
        for op, right_of in zip(chain[::2], chain[1::2]):
            right = right_of()
            if op in _CONTAINMENT:
                if isinstance(left, Tracked):
                    _inspected()
                result = (left in right) if op == "in" else (left not in right)
            else:
                result = _ORDERINGS[op](left, right)
            if not result:
                return result
            left = right
        return result

    @staticmethod
    def counted(iterable: Any) -> Iterator[Any]:
        for item in iterable:
            _spend()
            yield item

    @staticmethod
    def joined(parts: tuple[Any, ...]) -> str:
        texts = [str(part) for part in parts]
        _check_size(sum(map(_sized, texts)), "a ~ concatenation")
        return Tracked("".join(texts)) if _is_tracked(parts) else "".join(texts)

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]  # jinja joins output with it
        texts = []
        size = 0
        for piece in pieces:
            size += _sized(piece)
            _check_size(size, "the rendered text")
            texts.append(piece)
        # `{% set x %}...{% endset %}` and caller() join their output here too: keep a content's taint
        return Tracked("".join(texts)) if _is_tracked(texts) else "".join(texts)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if n > MAX_LIPSUM or max > MAX_LIPSUM:
        raise TemplateLimit(f"lipsum(n={n}, max={max}) above the limit of {MAX_LIPSUM}")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` as transformers defines it; marks assistant output."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares tags as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        mark = nodes.Name("__packtool_mark", "load")
        return nodes.CallBlock(self.call_method("_wrap", [mark]), [], [], body).set_lineno(lineno)

    @staticmethod
    def _wrap(mark: Any, caller: Any) -> str:
        body = caller()
        return f"{GENERATION_OPEN}{body}{GENERATION_CLOSE}" if mark is True else body


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (jinja's built-in escapes <, >, & and breaks tool JSON).
    if not (ensure_ascii or indent is not None or separators is not None or sort_keys):
        return _PLAIN_JSON.encode(value)  # json.dumps builds an encoder per call for these arguments: ~1.5 us
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_PLAIN_JSON = json.JSONEncoder(ensure_ascii=False)


def _template_tojson(value: Any, **kwargs: Any) -> str:
    """The templates' tojson: a JsonSlot prints its own copy (see there)."""
    return _print_slot(value, **kwargs) if type(value) is JsonSlot else _tojson(value, **kwargs)


def _test_sameas(value: Any, other: Any) -> bool:
    """`value is sameas other`: identity, which a marked content (its own object) never shares with a
    literal that the plain string might be (CPython shares short strings)."""
    if isinstance(value, Tracked | JsonSlot) or isinstance(other, Tracked | JsonSlot):
        _inspected()
    return value is other


def _test_in(value: Any, seq: Any) -> bool:
    """`value is in seq` (also `select('in', ...)`): a comparison like `value in seq`."""
    return bool(LimitedSandbox.compared(value, "in", lambda: seq))


def make_environment() -> LimitedSandbox:
    """The sandbox transformers renders chat templates in (untrusted templates cannot reach Python
    internals), with counted limits on time and memory."""
    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _template_tojson
    env.filters = {name: _limited_filter(f, name) for name, f in env.filters.items()}
    env.tests["in"] = _test_in
    env.tests["sameas"] = _test_sameas
    env.globals["raise_exception"] = _raise_exception
    env.globals["lipsum"] = _lipsum
    return env
