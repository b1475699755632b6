"""Render an Example with a chat template and track, for every character, whose it is and whether it is trained.

One render, two views. Each message's content (whitespace-trimmed core) is wrapped in a pair of
private-use sentinel characters that carry the message index, the template runs once with the
marked messages, the sentinels are cut out, and their positions become content spans. The
template also runs on the unmarked messages and the two texts must be byte-identical: a template
that rewrites content (strips, splits, reorders it) is caught here instead of yielding a
shifted mask.

    messages  = [user "Hi", assistant "Hello!"]
    marked    = <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
    text      = <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    targets   =                                                      ^^^^^^^^^^^^^^^^   (content + end marker)

An assistant target starts right after the assistant header the template prints for
`add_generation_prompt` (so tool calls and think blocks that follow the header are trained),
and ends after the first end-of-turn marker behind the content. Templates that carry
`{% generation %}` blocks define targets themselves, exactly as transformers'
`return_assistant_tokens_mask` reads them.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import datetime as _dt
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter, SecurityError
from markupsafe import Markup

from packtool.config import BuildConfig, TrainPolicy, bundled_folder
from packtool.errors import PacktoolError, RecordError, TemplateRaised
from packtool.records import Example, Message, Rendered, Span, literal_pattern

# Plane-16 private-use characters: never meaningful text, and removed before tokenization.
_MARK_BASE = 0x100000
_GEN_OPEN = chr(0x10FFF0)
_GEN_CLOSE = chr(0x10FFF1)
# Put in front of every special-token literal a record brings (a user typing `<|im_end|>`, a tool
# description spelling `<|im_start|>system`): its rendered position tells encode what to escape and
# tells the mask which end markers are data, not structure.
_LITERAL = chr(0x10FFF2)
_MAX_MESSAGES = (0x10FFF0 - _MARK_BASE) // 2
_MARKERS = re.compile("[\U00100000-\U0010ffff]")

# End-of-turn markers of the common chat formats; the template's eos_token is added to these.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")
# Fixed so that templates calling strftime_now (Llama 3.x prints "Today Date") render the same
# text on every run; override with template_vars.date (ISO) or date_string.
DEFAULT_DATE = "2026-01-01"


def open_mark(index: int) -> str:
    return chr(_MARK_BASE + 2 * index)


def close_mark(index: int) -> str:
    return chr(_MARK_BASE + 2 * index + 1)


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
class _Budget:
    operations: int = 0
    depth: int = 0
    inspected: bool = False  # the template looked inside a marked content string (see _Tracked)
    peak: int = 0  # the largest string or sequence size checked against MAX_TEMPLATE_CHARS (see _Skeleton)
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
_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("packtool_template_budget")


def _spend(n: int = 1) -> _Budget:
    budget = _BUDGET.get(None)
    if budget is None:  # a render outside ChatTemplate.render (a test calling jinja directly)
        budget = _Budget()
        _BUDGET.set(budget)
    budget.spend(n)
    return budget


# -- one render, and the proof that the plain render would be the same ---------------------------
#
# The marked render differs from the plain one only in the content strings, which carry sentinel
# characters. A template whose output depends on content only by copying it (printing, `+`, `~`,
# trim, tojson, truthiness: the same with or without sentinels) gives, once the sentinels are cut
# out, exactly the plain render. So marked contents are `_Tracked` strings: any other use (a
# comparison, `in`, `|length`, slicing, `.startswith`, iteration, a filter) sets `inspected`, and
# then, only then, render_chat renders the plain messages as well and compares the two texts.
# Results derived from a tracked string (`+`, `~`, trim, tojson) stay tracked, so copying a
# content into a variable first does not hide a later inspection.

_COPYING_METHODS = frozenset({"strip", "lstrip", "rstrip"})
_COPYING_FILTERS = frozenset({"trim", "string", "tojson"})


class _Tracked(str):
    """A marked content string that reports being inspected (methods defined below the class)."""

    __slots__ = ()

    def __str__(self) -> str:
        return self

    def __bool__(self) -> bool:  # empty exactly when the plain content is: the sentinels wrap a non-empty core
        return str.__len__(self) > 0

    def __add__(self, other: Any) -> Any:
        result = str.__add__(self, other)
        return result if result is NotImplemented else _Tracked(result)

    def __radd__(self, other: Any) -> Any:
        return _Tracked(str.__add__(other, self)) if isinstance(other, str) else NotImplemented

    def _copying(self, name: str, chars: Any = None) -> str:
        if chars is not None and (not isinstance(chars, str) or chars.strip()):
            _inspected()  # stripping anything but whitespace could eat a sentinel's neighbour
        return _Tracked(getattr(str, name)(self, chars))

    def strip(self, chars: Any = None) -> str:
        return self._copying("strip", chars)

    def lstrip(self, chars: Any = None) -> str:
        return self._copying("lstrip", chars)

    def rstrip(self, chars: Any = None) -> str:
        return self._copying("rstrip", chars)


def _inspected() -> None:
    budget = _BUDGET.get(None)
    if budget is not None:
        budget.inspected = True


def _inspecting(name: str) -> Any:
    method = getattr(str, name)

    def inspecting(self: str, *args: Any, **kwargs: Any) -> Any:
        _inspected()
        return method(self, *args, **kwargs)

    inspecting.__name__ = name
    return inspecting


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
        setattr(_Tracked, _name, _inspecting(_name))
_Tracked.__hash__ = _inspecting("__hash__")  # type: ignore[method-assign]


def _is_tracked(values: Iterable[Any]) -> bool:
    return any(isinstance(value, _Tracked) for value in values)


def _holds_containers(values: Iterable[Any]) -> bool:
    return any(isinstance(value, list | tuple | dict) for value in values)


def _tainted(result: Any) -> Any:
    """A string made from values that may hold a marked content (`message | tojson`,
    `[content] | join`, a macro's output) stays tracked, so inspecting it later is noticed."""
    return _Tracked(result) if isinstance(result, str) and not isinstance(result, _Tracked) else result


def _check_size(size: int, what: str) -> None:
    budget = _BUDGET.get(None)
    if budget is not None and size > budget.peak:
        budget.peak = size
    if size > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"{what} of {size:,} items exceeds the {MAX_TEMPLATE_CHARS:,} a template may build")


def _sized(value: Any) -> int:
    # str.__len__, not len(): the limits must not count as the template inspecting a _Tracked string
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
    budget = _BUDGET.get(None)
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
        _spend()
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
        return _tainted(result) if tracked or name == "tojson" or _holds_containers(args) else result

    return limited


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles every loop to iterate through `environment.counted` and every `~` through
    `environment.joined`: the two ways a template spends time or memory without calling anything."""

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
        if (isinstance(owner, _Tracked) and __obj.__name__ not in _COPYING_METHODS) or _is_tracked(
            (*args, *kwargs.values())
        ):
            budget.inspected = True
        if not isinstance(__obj, Macro):
            result = super().call(__context, __obj, *args, **kwargs)
            if isinstance(result, list | tuple | dict):  # dict(a=x, b=x), x.copy(): built like a literal
                _check_size(_expanded(result), "a list or mapping a call returned")
            return _tainted(result) if _holds_containers(args) else result
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
            result = left + right  # a _Tracked operand keeps the result tracked (_Tracked.__add__/__radd__)
            if type(result) is str:  # the common case, inlined: 10 of these per conversation
                size = str.__len__(result)
                if size > budget.peak:
                    budget.peak = size
                    _check_size(size, "a concatenation")
                return result
            _check_size(_expanded(result) if isinstance(result, list | tuple) else _sized(result), "a concatenation")
            if isinstance(left, _Tracked) or isinstance(right, _Tracked):  # Markup + content loses the type
                return _tainted(result)
            return result
        if isinstance(left, _Tracked) or isinstance(right, _Tracked):
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
    def counted(iterable: Any) -> Iterator[Any]:
        for item in iterable:
            _spend()
            yield item

    @staticmethod
    def joined(parts: tuple[Any, ...]) -> str:
        texts = [str(part) for part in parts]
        _check_size(sum(map(_sized, texts)), "a ~ concatenation")
        return _Tracked("".join(texts)) if _is_tracked(parts) else "".join(texts)

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]  # jinja joins output with it
        texts = []
        size = 0
        for piece in pieces:
            size += _sized(piece)
            _check_size(size, "the rendered text")
            texts.append(piece)
        # `{% set x %}...{% endset %}` and caller() join their output here too: keep a content's taint
        return _Tracked("".join(texts)) if _is_tracked(texts) else "".join(texts)


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
        return f"{_GEN_OPEN}{body}{_GEN_CLOSE}" if mark is True else body


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (jinja's built-in escapes <, >, & and breaks tool JSON).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_environment() -> LimitedSandbox:
    """The sandbox transformers renders chat templates in (untrusted templates cannot reach Python
    internals), with counted limits on time and memory."""
    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(f, name) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["lipsum"] = _lipsum
    return env


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    name: str
    source: str
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as strings
    variables: dict[str, Any] = field(default_factory=dict)
    compiled: Any = None
    generation_header: str | None = None
    has_generation_blocks: bool = False
    # The special tokens a record may spell (the tokenizer's, from tokenizer_config.json).
    literals: re.Pattern[str] | None = None
    # Conversation shape -> the marked render with its contents cut out (see _Skeleton). Shared by a
    # copy that only adds generation_header: the rendered text does not depend on it.
    skeletons: dict[tuple[Any, ...], _Skeleton] = field(default_factory=dict, compare=False, repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def end_markers(self) -> tuple[str, ...]:
        eos = self.special_tokens.get("eos_token")
        return tuple(dict.fromkeys([*(m for m in [eos] if m), *END_MARKERS]))

    def render(
        self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = False, mark: bool = False
    ) -> str:
        """The rendered text. Raises TemplateRaised (the template's raise_exception), TemplateLimit,
        jinja2.TemplateError (any other failure of the template on these messages) or PacktoolError
        (a sandbox escape: the template itself is hostile)."""
        return self.render_tracked(messages, tools, add_generation_prompt=add_generation_prompt, mark=mark)[0]

    def render_tracked(
        self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = False, mark: bool = False
    ) -> tuple[str, _Budget]:
        """render(), and what the render spent: whether the template inspected a marked (_Tracked)
        content string, the largest size it built."""
        budget = _Budget()
        token = _BUDGET.set(budget)
        try:
            text = self.compiled.render(
                **self.special_tokens,
                **self.variables,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                __packtool_mark=mark,
            )
            return str.__str__(text), budget
        except SecurityError as exc:
            raise PacktoolError(
                f"template {self.name!r} tried to reach Python internals and was stopped: {exc}"
            ) from None
        except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
            raise
        except RecursionError:
            raise TemplateLimit("recursion deeper than Python allows (nested data or a recursive loop)") from None
        except MemoryError:
            raise TemplateLimit("the render ran out of memory") from None
        except Exception as exc:  # the template's own code failing on this sample (1/0, 'a' + 1, a bad key)
            raise jinja2.TemplateRuntimeError(f"{type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.reset(token)


def template_for(config: BuildConfig, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    """The configured template, or None when every source is plain text (no template is needed)."""
    formats = {source.format for source in config.sources}
    if formats <= {"text"}:
        return None
    if (
        formats <= {"text", "prompt_completion"}
        and config.template == "model"
        and not tokenizer_config.get("chat_template")
    ):
        # TRL's string prompt-completion is plain text, often for a base model whose tokenizer has no chat
        # template; a message-list record of such a source is then rejected on its own (template_error)
        return None
    return load_template(config.template, tokenizer_config, config.template_vars)


def bundled_templates() -> list[str]:
    folder = bundled_folder("templates")
    return sorted(p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja"))


def load_template(spec: str, tokenizer_config: dict[str, Any], variables: dict[str, Any] | None = None) -> ChatTemplate:
    """`spec` is `model` (the tokenizer's own chat_template), a bundled template name, or a .jinja path."""
    if spec == "model":
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # some configs hold several named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise PacktoolError(
                "template: model, but tokenizer_config.json has no chat_template; "
                f"use a bundled template ({', '.join(bundled_templates())}) or a .jinja file"
            )
        name = "model"
    elif spec.endswith(".jinja"):
        source, name = Path(spec).read_text(encoding="utf-8"), Path(spec).name
    else:
        path = bundled_folder("templates") / f"{spec}.jinja"
        if not path.is_file():
            raise PacktoolError(
                f"template: unknown bundled template {spec!r}; "
                f"choose one of {', '.join(bundled_templates())}, 'model' or a .jinja path"
            )
        source, name = path.read_text(encoding="utf-8"), spec
    env = make_environment()
    try:
        _refuse_other_files(env.parse(source), name)
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise PacktoolError(f"template {name!r} line {exc.lineno}: {exc.message}") from None

    variables = dict(variables or {})
    date = _dt.date.fromisoformat(str(variables.pop("date", DEFAULT_DATE)))
    compiled.globals["strftime_now"] = lambda fmt: date.strftime(fmt)
    specials = special_token_strings(tokenizer_config)
    added = tokenizer_config.get("added_tokens_decoder") or {}
    template = ChatTemplate(
        name=name,
        source=source,
        special_tokens=specials,
        variables=variables,
        compiled=compiled,
        has_generation_blocks="{% generation %}" in source or "{%- generation %}" in source,
        literals=literal_pattern(
            [
                *specials.values(),
                *(t.get("content", "") for t in added.values() if isinstance(t, dict) and t.get("special")),
            ]
        ),
    )
    return _with_generation_header(template)


def _refuse_other_files(tree: nodes.Template, name: str) -> None:
    """A chat template travels inside tokenizer_config.json alone: it may not pull in other files."""
    tags = {
        nodes.Include: "include",
        nodes.Import: "import",
        nodes.FromImport: "from ... import",
        nodes.Extends: "extends",
    }
    for node in tree.find_all(tuple(tags)):
        raise PacktoolError(
            f"template {name!r} line {node.lineno}: {{% {tags[type(node)]} %}} is not supported; "
            "a chat template must be one self-contained file (paste the other template in)"
        )


def special_token_strings(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _with_generation_header(template: ChatTemplate) -> ChatTemplate:
    """Find what the template prints to open an assistant turn: the difference add_generation_prompt makes."""
    probe = [{"role": "user", "content": "x"}]
    try:
        closed = template.render(probe, None)
        opened = template.render(probe, None, add_generation_prompt=True)
    except TemplateLimit as exc:
        raise PacktoolError(
            f"template {template.name!r} exceeds a template limit on a one-message conversation: {exc}"
        ) from None
    except (TemplateRaised, jinja2.TemplateError):
        return template
    if opened.startswith(closed) and len(opened) > len(closed):
        header = opened[len(closed) :]
        return replace(template, generation_header=header)
    return template


def trained_messages(messages: tuple[Message, ...], policy: TrainPolicy) -> list[bool]:
    """Which messages are targets: the role policy, `last` vs `all` turns, then the per-message override."""
    trained = [m.role in policy.roles and m.role != "tool" for m in messages]
    if not policy.tool_calls:
        trained = [t and not m.tool_calls for t, m in zip(trained, messages)]
    if policy.turns == "last":
        last = max((i for i, t in enumerate(trained) if t), default=None)
        trained = [i == last for i in range(len(messages))]
    return [m.train if m.train is not None and m.role != "tool" else t for t, m in zip(trained, messages)]


def render_text(example: Example, special_tokens: dict[str, str], *, add_bos: bool, add_eos: bool) -> Rendered:
    """A plain document: every character is a target, but a prompt's (`context_chars`); BOS/EOS strings
    are structure, not content, and EOS is trained as the document's end."""
    document = example.text or ""
    bos = special_tokens.get("bos_token", "") if add_bos else ""
    eos = special_tokens.get("eos_token", "") if add_eos else ""
    text = f"{bos}{document}{eos}"
    content = (len(bos), len(bos) + len(document))
    if not example.context_chars:
        spans: tuple[Span, ...] = (Span(content[0], content[1], -1, "text", True),)
        return Rendered(example, text, spans, content_ranges=(content,), target_ranges=((0, len(text), -1),))
    answer = content[0] + example.context_chars
    spans = (Span(content[0], answer, -1, "text", False), Span(answer, content[1], -1, "text", True))
    return Rendered(example, text, spans, content_ranges=(content,), target_ranges=((answer, len(text), -1),))


def render_chat(example: Example, template: ChatTemplate, policy: TrainPolicy) -> Rendered:
    """Render one conversation and derive its target character ranges. Raises RecordError for this sample only."""
    messages = example.messages
    if len(messages) > _MAX_MESSAGES:
        raise RecordError(f"{len(messages)} messages exceed the {_MAX_MESSAGES} packtool can track", kind="bad_record")
    literal_fields = _check_data_strings(example, template.literals)
    trained = trained_messages(messages, policy)
    for i, message in enumerate(messages):
        if trained[i] and message.role == "assistant" and not message.content.strip() and not message.tool_calls:
            # Nothing but an end marker to learn; templates without an assistant header could not
            # even place it. A data defect (seen in real alpaca sets), not a turn to train.
            raise RecordError(f"message {i} (assistant) is empty: nothing to train", kind="bad_record")
    literals = template.literals if literal_fields else None
    tools = list(example.tools) if example.tools else None

    def plain_render() -> str:
        return template.render([m.as_template_dict() for m in messages], tools)

    shape = _shape(example) if literals is None else None
    skeleton = template.skeletons.get(shape) if shape is not None else None
    recipe_key = (tuple(trained), policy.end_of_turn, template.generation_header, template.has_generation_blocks)
    if skeleton is not None and skeleton.fits(messages):
        recipe = skeleton.recipes.get(recipe_key)
        if recipe is not None:
            return recipe.rendered(example)
    marked_text = skeleton.fill(messages) if skeleton is not None else None
    reusable = marked_text is not None  # this render follows a skeleton: a recipe can be learned from it
    inspected = False
    with _template_verdicts(template.name):
        if marked_text is None:
            marked = [_marked(m, i, literals) for i, m in enumerate(messages)]
            try:
                marked_text, spent = template.render_tracked(marked, _mark_literals(tools, literals), mark=True)
            except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
                # a verdict reached on marked content stands only if the plain render reaches it too
                plain_render()
                raise RecordError(
                    "the template fails on sentinel-marked content but not on the plain content (it inspects "
                    "the content), so its mask cannot be derived safely",
                    kind="mask_check",
                ) from None
            inspected = spent.inspected
            if shape is not None and not inspected and len(template.skeletons) < MAX_SKELETONS:
                learned = _Skeleton.of(marked_text, messages, spent.peak)
                if learned is not None:
                    template.skeletons[shape] = skeleton = learned
                    reusable = True
        clean, contents, generations, literal_at = _strip_markers(marked_text)
        # One render is enough when the template only copied contents (see _Tracked). Literal
        # sentinels sit in untracked strings (tool calls, tools), so those samples render twice.
        text = plain_render() if inspected or literals is not None else clean
    if clean != text:
        raise RecordError(
            "the template rewrites message content (trims, splits, reorders or branches on it), so its "
            "mask cannot be derived safely",
            kind="mask_check",
        )
    for i, ranges in contents.items():
        expected = messages[i].content.strip()
        printed = {text[start:end] for start, end in ranges}
        # A JSON-quoted copy is the same words: Llama 3.x prints tool results through `tojson`.
        if printed != {expected} and not printed <= {expected, json.dumps(expected, ensure_ascii=False)[1:-1]}:
            raise RecordError(
                f"the template changes the content of message {i} ({messages[i].role}) while "
                "printing it, so its targets would not be the data's words",
                kind="mask_check",
            )
    # A message whose content never reaches the text would be lost without a trace (Mistral-Nemo's
    # template prints the system prompt only when the conversation ends with a user turn; Phi-3's
    # drops tool results): reject the sample and name the message instead.
    for i, message in enumerate(messages):
        if message.content.strip() and i not in contents:
            raise RecordError(
                f"the template does not print the content of message {i} ({message.role}) as given "
                "(it drops or rewrites it), so training on this render would silently lose it",
                kind="template_error",
            )
    _check_tools_printed(example, text, contents)
    spans = tuple(
        Span(start, end, i, messages[i].role, False) for i, ranges in sorted(contents.items()) for start, end in ranges
    )
    literal_ranges = tuple(
        (at, found.end()) for at in literal_at if literals and (found := literals.match(text, at)) is not None
    )
    if template.has_generation_blocks:
        targets = _targets_from_generation_blocks(generations, contents, trained, [m.role for m in messages])
    else:
        targets = _targets_from_headers(text, messages, contents, trained, template, policy, literal_ranges)
    # Tool calls carry no sentinel, so a template that ignores them (Gemma 3, Phi-3) would train an
    # empty turn: each called function's name must appear inside its message's target.
    for start, end, i in targets:
        calls = messages[i].tool_calls if i >= 0 else ()
        if any(str(call.get("function", {}).get("name", "")) not in text[start:end] for call in calls):
            raise RecordError(
                f"the template does not print the tool calls of message {i} ({messages[i].role}), "
                "so its target would be an empty turn",
                kind="template_error",
            )
    rendered = Rendered(
        example=example,
        text=text,
        spans=spans,
        content_ranges=tuple((s.start, s.end) for s in spans),
        target_ranges=tuple(targets),
        literal_ranges=literal_ranges,
        literal_fields=literal_fields,
    )
    if reusable and skeleton is not None and recipe_key not in skeleton.recipes:
        skeleton.recipes[recipe_key] = _Recipe.of(skeleton, rendered)
    return rendered


def _shape(example: Example) -> tuple[tuple[str, str, str | None], ...] | None:
    """All a template sees of a conversation apart from the words of its contents, when that is all
    there is besides roles: each message's role and the whitespace around its content (a content of
    whitespace only, given whole, reaches the template unmarked). None when the record brings more
    (tools, tool calls, names, ids, reasoning): such a conversation is always rendered."""
    if example.tools:
        return None
    shape: list[tuple[str, str, str | None]] = []
    for m in example.messages:
        if m.tool_calls or m.tool_call_id is not None or m.name is not None or m.reasoning_content is not None:
            return None
        core = m.content.strip()
        if not core:
            shape.append((m.role, m.content, None))
            continue
        lead = len(m.content) - len(m.content.lstrip())
        shape.append((m.role, m.content[:lead], m.content[lead + len(core) :]))
    return tuple(shape)


# Skeletons kept per template: real data has a few shapes (turn counts, whitespace habits); data
# with many more (every conversation its own) must not grow memory without bound.
MAX_SKELETONS = 4096
_MESSAGE_MARKS = re.compile("[\U00100000-\U0010ffef]")
# How much longer than its content a copy of it can get: tojson writes a character outside the
# Basic Multilingual Plane as two \uXXXX escapes.
_TOJSON_GROWTH = 12


@dataclass(frozen=True, slots=True)
class _Skeleton:
    """A marked render with the content cores cut out, for every conversation of the same _shape.

    The render that made it never inspected a content (see _Tracked), so nothing it decided can have
    depended on the words: the template runs the same way on any conversation of that shape, and
    its text is these literals with the other conversation's cores in their place (sentinels
    included), as a render would give it. Only sizes follow the words: a core n times longer makes
    every string the render builds at most n times longer (12n through tojson's escapes), so a
    conversation whose render could reach MAX_TEMPLATE_CHARS is rendered and meets the limit there.

        marked render  <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
        literals       '<|im_start|>user\\n'   '<|im_end|>\\n<|im_start|>assistant\\n'   '<|im_end|>\\n'
        copies         (0, 1)
    """

    literals: tuple[str, ...]  # literals[k] comes before the k-th content copy, the last after all
    copies: tuple[int, ...]  # the message each content copy is of
    core_lengths: tuple[int, ...]  # per message, in the render that made it
    peak: int  # the largest size that render built

    @classmethod
    def of(cls, marked: str, messages: tuple[Message, ...], peak: int) -> _Skeleton | None:
        """None when the render printed a content other than verbatim (a JSON-escaped copy)."""
        cores = [m.content.strip() for m in messages]
        literals: list[str] = []
        copies: list[int] = []
        start, opened = 0, -1
        for match in _MESSAGE_MARKS.finditer(marked):
            index, is_close = divmod(ord(match.group()) - _MARK_BASE, 2)
            if index >= len(cores):
                return None
            if not is_close and opened < 0:
                literals.append(marked[start : match.start()])
                opened = index
            elif is_close and opened == index and marked[start : match.start()] == cores[index]:
                copies.append(index)
                opened = -1
            else:
                return None
            start = match.end()
        if opened >= 0:
            return None
        literals.append(marked[start:])
        return cls(tuple(literals), tuple(copies), tuple(map(len, cores)), peak)

    # Trained-message pattern and target settings -> the recipe for them (None: this shape has none).
    recipes: dict[tuple[Any, ...], _Recipe | None] = field(default_factory=dict, compare=False, repr=False)

    def fits(self, messages: tuple[Message, ...]) -> bool:
        """Whether a render of these messages stays under MAX_TEMPLATE_CHARS (else it must really be rendered)."""
        growth = max([len(m.content.strip()) / n for m, n in zip(messages, self.core_lengths) if n] + [1.0])
        return self.peak * growth * _TOJSON_GROWTH <= MAX_TEMPLATE_CHARS

    def fill(self, messages: tuple[Message, ...]) -> str | None:
        """The marked render of these messages; None when it must really be rendered (sizes)."""
        if not self.fits(messages):
            return None
        cores = [m.content.strip() for m in messages]
        parts = [self.literals[0]]
        for index, literal in zip(self.copies, self.literals[1:]):
            parts += (open_mark(index), cores[index], close_mark(index), literal)
        return "".join(parts)


# A place in the rendered text as (literal piece k, characters into it): contents sit between pieces.
_Anchor = tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Recipe:
    """Everything render_chat derives for one _Skeleton and one trained-message pattern, with every
    position anchored in the skeleton's literals, so that a conversation of that shape needs neither
    the sentinel fill and strip nor the target search (alpaca with Qwen2.5: 50 -> 22 us per sample).

    What render_chat checks on a filled skeleton (each content printed once and verbatim, no tools,
    targets between the same literal markers) depends on the shape and the pattern alone, and was
    checked on the conversation the recipe was learned from; the recipe is kept only when it
    rebuilds that conversation's Rendered exactly.

        pieces   '<|im_start|>user\n'  ⟦0⟧  '<|im_end|>\n<|im_start|>assistant\n'  ⟦1⟧  '<|im_end|>\n'
        target   (1, 33) .. (2, 10), message 1: from the header's end to past <|im_end|>
    """

    pieces: tuple[str, ...]  # the skeleton's literals without sentinels; pieces[k] precedes content copy k
    copies: tuple[int, ...]  # the message each content copy is of
    spans: tuple[tuple[int, int, str], ...]  # (content copy, message, role) in Rendered.spans order
    targets: tuple[tuple[_Anchor, _Anchor, int], ...]

    @classmethod
    def of(cls, skeleton: _Skeleton, rendered: Rendered) -> _Recipe | None:
        pieces = tuple(_MARKERS.sub("", literal) for literal in skeleton.literals)
        starts = _piece_starts(pieces, skeleton.copies, rendered.example.messages)
        copy_at = {start + len(piece): k for k, (start, piece) in enumerate(zip(starts, pieces))}
        anchors = [_anchor(pieces, starts, at) for start, end, _ in rendered.target_ranges for at in (start, end)]
        spans = [(copy_at.get(span.start), span.message, span.role) for span in rendered.spans]
        if any(anchor is None for anchor in anchors) or any(k is None for k, _, _ in spans):
            return None
        recipe = cls(
            pieces,
            skeleton.copies,
            tuple((k, message, role) for k, message, role in spans if k is not None),
            tuple(
                (start, end, i)
                for start, end, (_, _, i) in zip(anchors[::2], anchors[1::2], rendered.target_ranges)
                if start is not None and end is not None
            ),
        )
        return recipe if recipe.rendered(rendered.example) == rendered else None

    def rendered(self, example: Example) -> Rendered:
        messages = example.messages
        cores = [messages[i].content.strip() for i in self.copies]
        starts = _piece_starts(self.pieces, self.copies, messages)
        parts = [self.pieces[0]]
        for core, piece in zip(cores, self.pieces[1:]):
            parts += (core, piece)
        spans = tuple(
            Span(starts[k] + len(self.pieces[k]), starts[k + 1], message, role, False)
            for k, message, role in self.spans
        )
        return Rendered(
            example=example,
            text="".join(parts),
            spans=spans,
            content_ranges=tuple((span.start, span.end) for span in spans),
            target_ranges=tuple((starts[ks] + ps, starts[ke] + pe, i) for (ks, ps), (ke, pe), i in self.targets),
        )


def _piece_starts(pieces: tuple[str, ...], copies: tuple[int, ...], messages: tuple[Message, ...]) -> list[int]:
    """Where each literal piece starts in the text of these messages."""
    starts = [0]
    for piece, index in zip(pieces, copies):
        starts.append(starts[-1] + len(piece) + len(messages[index].content.strip()))
    return starts


def _anchor(pieces: tuple[str, ...], starts: list[int], at: int) -> _Anchor | None:
    """The piece holding position `at` (its end included); None inside a content."""
    for k, (start, piece) in enumerate(zip(starts, pieces)):
        if start <= at <= start + len(piece):
            return k, at - start
    return None


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


def _check_tools_printed(example: Example, text: str, contents: dict[int, list[tuple[int, int]]]) -> None:
    """Every tool definition's name and parameter names, and every tool call's name and argument
    values, must reach the text, as message contents must. Templates re-serialize JSON (key order,
    spacing, quoting), so the pieces are compared, not the JSON.

    A call is looked for between the contents of its neighbours, so the tool definitions or the
    user's words cannot stand in for it; definitions anywhere outside message contents and calls.
    """
    spans = sorted((s, e, i) for i, ranges in contents.items() for s, e in ranges)
    regions = {}
    for i, message in enumerate(example.messages):
        if message.tool_calls:
            # neighbours in print order: a template may print an earlier message later (Mistral's system prompt)
            upper = min((s for s, _, k in spans if k > i), default=len(text))
            regions[i] = (max((e for _, e, k in spans if k < i and e <= upper), default=0), upper)
    # Definitions: outside every content and every call's region, so neither stands in for them.
    cuts = sorted([*((s, e) for s, e, _ in spans), *regions.values()])
    kept, at = [], 0
    for start, end in cuts:
        kept.append(text[at:start] if start > at else "")
        at = max(at, end)
    outside = "\0".join([*kept, text[at:]])
    # Templates print the tools in order, so each search starts where the previous name was found
    # (and only then looks from the start): searching all of a 4 MB render for each of 25,000 tools took 60 s.
    hint = 0
    for j, tool in enumerate(example.tools or ()):
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = function.get("name") if isinstance(function, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        pieces = [name, *(properties if isinstance(properties, dict) else ())]
        found = [_printed_at(p, outside, hint) if isinstance(p, str) and p else 0 for p in pieces]
        missing = [p for p, at in zip(pieces, found) if at < 0]
        hint = found[0] if found and found[0] > 0 else hint
        if missing:
            raise RecordError(
                f"the template does not print tool definition {name!r} (tools[{j}]): "
                f"{', '.join(map(repr, missing[:3]))} missing from the render, so the model would be trained "
                "to call a tool it never saw",
                kind="template_dropped_tools",
            )
    for i, message in enumerate(example.messages):
        if not message.tool_calls:
            continue
        region = text[slice(*regions[i])]
        for j, call in enumerate(message.tool_calls):
            function = call.get("function", {})
            pieces = [function.get("name"), *_leaves(function.get("arguments"))]
            missing = [p for p in pieces if p is not None and p != "" and _printed_at(p, region) < 0]
            if missing:
                raise RecordError(
                    f"the template does not print tool call {j} of message {i} ({message.role}): "
                    f"{', '.join(repr(p) for p in missing[:3])} missing from the render",
                    kind="template_dropped_tools",
                )


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _printed_at(value: Any, text: str, hint: int = 0) -> int:
    """Where a value appears in text as a template would print it (raw, JSON escaped or not, or
    Python), looked for from `hint` first; -1 when it does not appear."""
    forms = {str(value), json.dumps(value), json.dumps(value, ensure_ascii=False)}
    if isinstance(value, str):
        forms |= {form[1:-1] for form in forms if form.startswith('"')} | {repr(value)[1:-1]}
    # the 64 KiB after the hint first: a form the template does not use would otherwise be looked for to the end
    for start, end in ((hint, hint + (1 << 16)), (0, len(text))):
        for form in forms:
            at = text.find(form, start, end)
            if at >= 0:
                return at
    return -1


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


def _check_data_strings(example: Example, literals: re.Pattern[str] | None) -> tuple[str, ...]:
    """Reject private-use marker characters anywhere in the record; name the fields that spell a special token."""
    spelled = []
    for where, text in data_strings(example):
        if _MARKERS.search(text):
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


def _marked(message: Message, index: int, literals: re.Pattern[str] | None = None) -> dict[str, Any]:
    """The message with its content core wrapped in sentinels; surrounding whitespace stays outside so
    templates that trim content still produce the same text. Special-token literals in any of its
    strings get the literal sentinel."""
    out = _mark_literals(message.as_template_dict(), literals)
    core = message.content.strip()
    if core:
        lead = message.content[: len(message.content) - len(message.content.lstrip())]
        trail = message.content[len(lead) + len(core) :]
        out["content"] = _Tracked(f"{lead}{open_mark(index)}{_mark_literals(core, literals)}{close_mark(index)}{trail}")
    return out


def _strip_markers(
    marked: str,
) -> tuple[str, dict[int, list[tuple[int, int]]], list[tuple[int, int]], list[int]]:
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
        elif char == _GEN_OPEN:
            gen_start = length
        elif char == _GEN_CLOSE:
            if gen_start is not None:
                generations.append((gen_start, length))
            gen_start = None
        else:
            index, is_close = divmod(ord(char) - _MARK_BASE, 2)
            if is_close:
                if index in opened:
                    contents.setdefault(index, []).append((opened.pop(index), length))
            else:
                opened[index] = length
    pieces.append(marked[last:])
    return "".join(pieces), contents, generations, literal_at


def _targets_from_generation_blocks(
    generations: list[tuple[int, int]],
    contents: dict[int, list[tuple[int, int]]],
    trained: list[bool],
    roles: list[str],
) -> list[tuple[int, int, int]]:
    targets = []
    for start, end in generations:
        owners = [i for i, ranges in contents.items() for s, e in ranges if start <= s and e <= end]
        if not owners:
            # A block without content (an assistant turn that only calls tools) belongs to the one
            # content-less assistant message between its printed neighbours; without this, such
            # blocks were trained even under `turns: last` or `tool_calls: false`.
            before = max((i for i, r in contents.items() if r[-1][1] <= start), default=-1)
            after = min((i for i, r in contents.items() if r[0][0] >= end), default=len(trained))
            owners = [i for i in range(before + 1, after) if roles[i] == "assistant" and i not in contents]
            if len(owners) != 1:
                owners = []
        if not owners or any(trained[i] for i in owners):
            targets.append((start, end, owners[0] if owners else -1))
    return targets


def _targets_from_headers(
    text: str,
    messages: tuple[Message, ...],
    contents: dict[int, list[tuple[int, int]]],
    trained: list[bool],
    template: ChatTemplate,
    policy: TrainPolicy,
    literal_ranges: tuple[tuple[int, int], ...] = (),
) -> list[tuple[int, int, int]]:
    """Targets from the assistant header and the first end-of-turn marker; markers and headers that a
    record spells (literal_ranges) are data, never structure."""
    starts = sorted((s, i) for i, ranges in contents.items() for s, _ in ranges)
    positions = [s for s, _ in starts]
    ends = sorted(e for ranges in contents.values() for _, e in ranges)
    # Where the first content of a later message starts, for each message (bisect and this keep the
    # search per message logarithmic: scanning every content for every message took 183 s for 30,000)
    later = [len(text)] * (len(messages) + 1)
    first = {}
    for s, j in reversed(starts):
        first[j] = s
    for j in range(len(messages) - 1, -1, -1):
        later[j] = min(later[j + 1], first.get(j + 1, len(text)))
    targets = []
    for i, message in enumerate(messages):
        if not trained[i]:
            continue
        ranges = contents.get(i, [])
        if len(ranges) > 1:
            raise RecordError(
                f"the template prints message {i} ({message.role}) {len(ranges)} times; "
                "cannot tell which copy to train",
                kind="mask_check",
            )
        own = ranges[0] if ranges else None
        upper = own[0] if own else later[i]
        below = bisect.bisect_right(ends, upper)  # the last content end at or before upper, not its own
        while own and below and ends[below - 1] == own[1]:
            below -= 1
        lower = ends[below - 1] if below else 0
        if message.role == "assistant" and template.generation_header:
            header_at = _rfind_structure(text, template.generation_header, lower, upper, literal_ranges)
            start = header_at + len(template.generation_header) if header_at >= 0 else (own[0] if own else -1)
        else:
            start = own[0] if own else -1
            # Without a header, the content's own leading whitespace (kept outside the sentinels)
            # starts the target: BPE glues it to the next word (" Paris"), and a target starting
            # mid-token fails the encode check.
            lead = message.content[: len(message.content) - len(message.content.lstrip())]
            if own and lead and own[0] - len(lead) >= lower and text[own[0] - len(lead) : own[0]] == lead:
                start = own[0] - len(lead)
        if start < 0:
            raise RecordError(
                f"cannot locate message {i} ({message.role}) in the rendered text; the template "
                "drops it or prints it without an assistant header",
                kind="mask_check",
            )
        search_from = own[1] if own else start
        after = bisect.bisect_left(positions, search_from)  # the first content from search_from on, not its own
        while after < len(starts) and starts[after][1] == i:
            after += 1
        limit = starts[after][0] if after < len(starts) else len(text)
        end = _end_of_turn(
            text, search_from, limit, template.end_markers, include=policy.end_of_turn, skip=literal_ranges
        )
        if end is None:
            if not policy.end_of_turn and own:
                end = own[1]
            else:
                raise RecordError(
                    f"no end-of-turn marker ({', '.join(template.end_markers[:3])}, ...) after "
                    f"message {i} ({message.role})",
                    kind="mask_check",
                )
        targets.append((start, end, i))
    return targets


def _in_any(at: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(start <= at < end for start, end in ranges)


def _rfind_structure(text: str, needle: str, lower: int, upper: int, skip: tuple[tuple[int, int], ...]) -> int:
    at = text.rfind(needle, lower, upper)
    while at >= 0 and _in_any(at, skip):
        at = text.rfind(needle, lower, at)
    return at


def _end_of_turn(
    text: str,
    start: int,
    limit: int,
    markers: tuple[str, ...],
    *,
    include: bool,
    skip: tuple[tuple[int, int], ...] = (),
) -> int | None:
    found = []
    for marker in markers:
        at = text.find(marker, start, limit)
        while at >= 0 and _in_any(at, skip):
            at = text.find(marker, at + 1, limit)
        if at >= 0:
            found.append((at, marker))
    if not found:
        return None
    at, marker = min(found)
    return at + len(marker) if include else at


def render_example(
    example: Example,
    template: ChatTemplate | None,
    tokenizer_config: dict[str, Any],
    policy: TrainPolicy,
    *,
    add_bos: bool | None,
    add_eos: bool | None,
) -> Rendered:
    """A chat example through its template, a text example as a document (EOS-terminated unless add_eos is
    False; BOS-led when add_bos is True, or when it is None and the tokenizer starts plain text with BOS)."""
    if example.is_text:
        specials = template.special_tokens if template else special_token_strings(tokenizer_config)
        # Unset add_bos: the BOS `tokenizer(text)` starts with (add_bos_token, which load_tokenizer
        # fills from the post-processor), so documents look as they do to the model's own tokenizer.
        bos = tokenizer_config.get("add_bos_token") is True if add_bos is None else add_bos
        return render_text(example, specials, add_bos=bos, add_eos=add_eos is not False)
    if template is None:
        raise RecordError("no chat template is configured for a chat example", kind="template_error")
    return render_chat(example, template, policy)


_ROLE_WORDS = {"system", "user", "assistant", "model", "tool", "ipython", "function", "developer"}


def template_injections(template: ChatTemplate, tokenizer: Any = None) -> list[str]:
    """Text the template puts into every sample whatever the data: a default system prompt, date lines.

    What a conversation without a system message gets before its first user turn, less the user
    header itself (the part every later user turn repeats), split at special tokens and lines:

        [user x, assistant y]  ->  <|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\n x ...
        [.. , user z, ..]       ->                          ... y<|im_end|>\\n<|im_start|>user\\n z ...
        injected                =  ["You are Qwen, ..."]   (role names and special tokens are structure)

    `tokenizer` (a packtool.encode.TextTokenizer, optional) supplies its special tokens when the
    template's list lacks them.
    """
    x, y, z, w = (open_mark(i) for i in range(4))  # characters no template prints on its own
    one = [{"role": "user", "content": x}, {"role": "assistant", "content": y}]
    two = [*one, {"role": "user", "content": z}, {"role": "assistant", "content": w}]
    try:
        first = template.render(one, None)
        second = template.render(two, None)
    except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
        return []
    at_x, at_y, at_z = first.find(x), second.find(y), second.find(z)
    if min(at_x, at_y, at_z) < 0:
        return []
    preamble, user_header = first[:at_x], second[at_y + 1 : at_z]
    common = 0
    while common < min(len(preamble), len(user_header)) and preamble[-1 - common] == user_header[-1 - common]:
        common += 1
    cut = len(preamble) - common
    pattern = getattr(tokenizer, "special_literals", None) or template.literals
    # a suffix shared inside a special token (`<s>[INST]` vs `</s>[INST]`) does not split it
    for literal in pattern.finditer(preamble) if pattern is not None else ():
        if literal.start() < cut < literal.end():
            cut = literal.start()
    before = preamble[:cut]
    pieces = pattern.split(before) if pattern is not None else [before]
    lines = [line.strip() for piece in pieces for line in piece.splitlines()]
    return [line for line in lines if line and line.lower() not in _ROLE_WORDS]
