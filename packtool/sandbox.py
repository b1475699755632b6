"""The sandbox chat templates run in: transformers' immutable jinja sandbox, its limits and its tracking.

Untrusted templates cannot reach Python internals (jinja's sandbox). Two jobs ride on every call,
filter and operator the environment compiles: resource limits (packtool.template_limits: every render
spends from a budget of operations, sizes and depth, so a hostile or runaway template rejects its
sample instead of hanging a build or exhausting memory), and tracking what the template inspects
(packtool.template_tracking: marked content strings are `Tracked`, so a render that only copies them
needs no second, plain render to prove its text; see packtool.render). Which filters and methods copy
and which look is one table, packtool.template_ops, that minijinja's qualification reads too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import Markup

from packtool.errors import TemplateRaised
from packtool.template_limits import (
    _FILTER_COSTS,
    MAX_TEMPLATE_DEPTH,
    TemplateLimit,
    _built,
    _check_arguments,
    _check_binop,
    _check_method,
    _check_replace,
    _check_size,
    _CheckedEscapeFormatter,
    _CheckedFormatter,
    _expanded,
    _lipsum,
    _sized,
    _spend,
)
from packtool.template_ops import COPYING_FILTERS, COPYING_METHODS, READINGS
from packtool.template_tracking import (
    _CONTAINMENT,
    _ORDERINGS,
    CONTENT_MARKS,
    GENERATION_CLOSE,
    GENERATION_OPEN,
    JsonSlot,
    Tracked,
    _holds_containers,
    _holds_content,
    _inspected,
    _is_tracked,
    _print_slot,
    _tainted,
    _tojson,
)


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
        if tracked and name not in COPYING_FILTERS:
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
            isinstance(owner, Tracked) and __obj.__name__ not in COPYING_METHODS and __obj.__name__ not in READINGS
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
