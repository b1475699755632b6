"""Resource limits on a chat template's render: a budget of operations, sizes and depth per render.

A hostile or runaway template meets a limit (TemplateLimit) and rejects its sample instead of hanging
a build or exhausting memory: loops, calls and arithmetic spend operations, and every string or
sequence a template builds is checked against MAX_TEMPLATE_CHARS before or as it is built. The
per-render Budget also carries what template_tracking notes (inspected, readings, prints).
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter

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


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if n > MAX_LIPSUM or max > MAX_LIPSUM:
        raise TemplateLimit(f"lipsum(n={n}, max={max}) above the limit of {MAX_LIPSUM}")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)
