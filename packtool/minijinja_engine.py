"""A second engine for chat templates: minijinja, where it is proven to print jinja2's bytes.

A conversation that takes no render skeleton (it brings tools, tool calls or reasoning, or its template
looks inside its contents as Qwen3 splits `</think>` out of every assistant turn) is rendered on its
own, marked and plain (see packtool.render). minijinja (a compiled Jinja engine, the optional extra
`packtool[minijinja]`) renders the same template about ten times faster than the jinja2 sandbox
(bench/render_bench.py), so its two renders cost less than jinja2's one with its tracking.

It is used for a template only when all of this holds, checked once at load (`qualify`):

1. minijinja is installed;
2. the template uses only constructs whose values cannot outgrow the data (`_SizeBound`): no macros,
   recursive loops, `*`, `**`, range, set blocks, `{% generation %}`, and no value that grows from
   one loop iteration to the next; every value it builds is then at most `growth` times the
   record's strings and the template's own text;
3. the probe conversations render byte-identically in both engines, marked and plain.

Per sample, minijinja renders only when `growth` times the sample's size is within MAX_TEMPLATE_CHARS,
under fuel (its instruction count) and a count of the characters it prints. Any failure there (fuel
spent, a size exceeded, the template raising or failing on the sample) returns None, and the sample
is rendered by jinja2 as if minijinja were absent: every verdict, rejection reason and limit message
is jinja2's, and minijinja only ever supplies texts jinja2 would have printed.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes

from packtool.template_limits import MAX_TEMPLATE_CHARS, MAX_TEMPLATE_OPERATIONS, TemplateLimit
from packtool.template_ops import FUNCTIONS, SAME_SIZE_FILTERS, SAME_SIZE_METHODS, SCALAR_FILTERS, SCALAR_METHODS
from packtool.template_tracking import _tojson

try:
    import minijinja
except ImportError:  # the optional extra: jinja2 renders every template
    minijinja = None  # type: ignore[assignment]  # the module or None: checked before any use
MINIJINJA_INSTALLED = minijinja is not None

# tojson escapes a character as at most 6 (\uXXXX) and adds quotes, commas and colons per item.
_TOJSON_GROWTH = 12
# A fixed point that has not settled after this many passes grows with every loop iteration.
_PASSES = 32


class NotQualified(Exception):
    """Why a template stays on jinja2 (the notice names it)."""


class _SizeBound:
    """How many times the data a template's largest value can be: walks the syntax tree once per
    pass, giving every variable the largest bound any of its assignments can have, until nothing
    changes. A bound that keeps growing is a value that grows per loop iteration (`{% set s = s ~ s %}`);
    jinja2's sandbox checks each such value as it is built, minijinja cannot, so the template stays
    on jinja2. Bounds are multiples of the sample's size (its strings, the template's text, the
    special tokens): a name the template reads but never sets is data, bound 1.

        {% set ns = namespace(x='') %}{% for m in messages %}{% set c = m.content.strip() %}...
        messages: 1   m: 1   c: 1   ns.x: 1 (the literal '')
        {% set ns.x = ns.x + c %} inside the loop: ns.x 1 -> 2 -> 3 -> ... never settles: refused
    """

    def __init__(self, tree: nodes.Template) -> None:
        self.tree = tree
        self.names: dict[str, int] = {}
        self.attributes: dict[str, int] = {}  # namespace attributes by name, whatever namespace holds them
        self.largest = 1

    def growth(self) -> int:
        for _ in range(_PASSES):
            before = (dict(self.names), dict(self.attributes))
            self._statements(self.tree.body)
            if before == (self.names, self.attributes):
                return self.largest
        raise NotQualified("a value grows with every loop iteration")

    def _set(self, target: nodes.Node, bound: int) -> None:
        if isinstance(target, nodes.Name):
            self.names[target.name] = max(self.names.get(target.name, 0), bound)
        elif isinstance(target, nodes.NSRef):
            self.attributes[target.attr] = max(self.attributes.get(target.attr, 0), bound)
        elif isinstance(target, nodes.Tuple):
            for item in target.items:
                self._set(item, bound)
        else:
            raise NotQualified(f"assignment to {type(target).__name__}")

    def _statements(self, body: Iterable[nodes.Node]) -> None:
        for node in body:
            if isinstance(node, nodes.Output):
                for item in node.nodes:
                    if not isinstance(item, nodes.TemplateData):
                        self._expression(item)
            elif isinstance(node, nodes.If):
                self._expression(node.test)
                self._statements(node.body)
                for branch in node.elif_:
                    self._statements([branch])
                self._statements(node.else_)
            elif isinstance(node, nodes.For):
                if node.recursive:
                    raise NotQualified("a recursive loop")
                self._set(node.target, self._expression(node.iter))
                if node.test is not None:
                    self._expression(node.test)
                self._statements(node.body)
                self._statements(node.else_)
            elif isinstance(node, nodes.Assign):
                self._set(node.target, self._expression(node.node))
            elif not isinstance(node, nodes.Continue | nodes.Break):
                raise NotQualified(f"{{% {type(node).__name__.lower()} %}}")

    def _expression(self, node: nodes.Node) -> int:
        bound = self._bound(node)
        self.largest = max(self.largest, bound)
        return bound

    def _bound(self, node: nodes.Node) -> int:
        each = self._expression
        if isinstance(node, nodes.Const | nodes.TemplateData):
            return 1  # its text is part of the template's, which the sample's size counts
        if isinstance(node, nodes.Name):
            return self.names.get(node.name, 1)
        if isinstance(node, nodes.Getattr):
            return max(each(node.node), self.attributes.get(node.attr, 0))
        if isinstance(node, nodes.Getitem):
            each(node.arg)
            return each(node.node)
        if isinstance(node, nodes.Slice):
            for part in (node.start, node.stop, node.step):
                if part is not None:
                    each(part)
            return 1
        if isinstance(node, nodes.Add | nodes.Concat | nodes.List | nodes.Tuple | nodes.Dict):
            parts = (
                [node.left, node.right]
                if isinstance(node, nodes.Add)
                else [p for pair in node.items for p in (pair.key, pair.value)]
                if isinstance(node, nodes.Dict)
                else node.nodes
                if isinstance(node, nodes.Concat)
                else node.items
            )
            return 1 + sum(map(each, parts))
        # numbers only: minijinja refuses `%` on a string (jinja2 formats with it; the probe would differ)
        if isinstance(node, nodes.Sub | nodes.Div | nodes.FloorDiv | nodes.Mod | nodes.Neg | nodes.Pos | nodes.Not):
            for child in node.iter_child_nodes():
                each(child)
            return 1
        if isinstance(node, nodes.And | nodes.Or):
            return max(each(node.left), each(node.right))
        if isinstance(node, nodes.CondExpr):
            each(node.test)
            return max(each(node.expr1), each(node.expr2) if node.expr2 is not None else 1)
        if isinstance(node, nodes.Compare):
            each(node.expr)
            for operand in node.ops:
                each(operand.expr)
            return 1
        if isinstance(node, nodes.Test):
            each(node.node)
            for argument in node.args:
                each(argument)
            return 1
        if isinstance(node, nodes.Filter):
            return self._filter(node)
        if isinstance(node, nodes.Call):
            return self._call(node)
        raise NotQualified(f"the expression {type(node).__name__}")

    def _arguments(self, node: nodes.Filter | nodes.Call) -> list[int]:
        return [self._expression(a) for a in node.args] + [self._expression(k.value) for k in node.kwargs]

    def _filter(self, node: nodes.Filter) -> int:
        if node.node is None or node.dyn_args is not None or node.dyn_kwargs is not None:
            raise NotQualified(f"the filter block or call form of |{node.name}")
        value = self._expression(node.node)
        arguments = self._arguments(node)
        if node.name in SCALAR_FILTERS:
            return 1
        if node.name in SAME_SIZE_FILTERS:
            return value
        if node.name == "default" or node.name == "d":
            return max([value, *arguments])
        if node.name == "tojson":
            return _TOJSON_GROWTH * value  # indent is checked on the result (_checked_tojson)
        separators = [str(a.value) for a in node.args if isinstance(a, nodes.Const)]
        if node.name == "join" and len(separators) == len(node.args) and not node.kwargs:
            # a literal separator between each two items: at most one per character (or item) of the data
            return value * (1 + sum(map(len, separators)))
        if node.name == "map" and not node.args and [k.key for k in node.kwargs] == ["attribute"]:
            return value
        raise NotQualified(f"the filter |{node.name}")

    def _call(self, node: nodes.Call) -> int:
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise NotQualified("a call with *args or **kwargs")
        arguments = self._arguments(node)
        if isinstance(node.node, nodes.Name) and node.node.name in FUNCTIONS:
            return 1 + sum(arguments)
        if isinstance(node.node, nodes.Getattr):
            owner = self._expression(node.node.node)
            if node.node.attr in SCALAR_METHODS:
                return 1
            if node.node.attr in SAME_SIZE_METHODS:
                return max([owner, *arguments])
        raise NotQualified(f"the call {_described(node.node)}")


def _described(node: nodes.Node) -> str:
    if isinstance(node, nodes.Name):
        return f"{node.name}()"
    if isinstance(node, nodes.Getattr):
        return f".{node.attr}()"
    return type(node).__name__


def _longest_literal(tree: nodes.Template) -> int:
    texts = [n.data for n in tree.find_all(nodes.TemplateData)]
    texts += [str(n.value) for n in tree.find_all(nodes.Const)]
    return max(map(len, texts), default=1) or 1


class _Overflow(Exception):
    """The characters a minijinja render printed passed MAX_TEMPLATE_CHARS: jinja2 decides."""


@dataclass(frozen=True, slots=True)
class MiniTemplate:
    """A qualified template compiled by minijinja. `render` answers None whenever jinja2 must render
    the sample instead."""

    environment: Any
    growth: int  # every value a render builds is at most growth x the sample's size
    fixed_size: int  # the template's text, special tokens and variables: part of every sample's size
    context: dict[str, Any]

    def render(
        self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = False
    ) -> str | None:
        fits = self.growth * (self.fixed_size + _data_size(messages, tools)) <= MAX_TEMPLATE_CHARS
        return self._render(messages, tools, add_generation_prompt) if fits else None

    def render_pair(
        self,
        marked: list[dict],
        marked_tools: list[dict] | None,
        plain: list[dict],
        plain_tools: list[dict] | None,
        size: int,
        known_json: Iterable[tuple[Any, str]] = (),
    ) -> tuple[str, str] | None:
        """The marked and the plain text of one sample; None when jinja2 must render it. `size`: at
        least the characters of the marked conversation's data (its strings and numbers, its keys:
        what the bound `growth` multiplies, tojson's quotes and escapes included), which the caller
        counts while checking them. `known_json`: values with what tojson, given no arguments, writes
        of them (the caller wrote them already)."""
        if self.growth * (self.fixed_size + size) > MAX_TEMPLATE_CHARS:
            return None
        # the plain render writes the same tools and calls as the marked one
        memo = _TOJSON_MEMO.set({(id(value), ""): (value, text) for value, text in known_json})
        try:
            first = self._render(marked, marked_tools, False)
            second = self._render(plain, plain_tools, False) if first is not None else None
        finally:
            _TOJSON_MEMO.reset(memo)
        return None if first is None or second is None else (first, second)

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str | None:
        token = _PRINTED.set([0])
        try:
            text = self.environment.render_template(
                "t", **self.context, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
            )
        except Exception:  # fuel, a size, the template's own error: all for jinja2 to judge
            return None
        finally:
            _PRINTED.reset(token)
        return text if len(text) <= MAX_TEMPLATE_CHARS else None


def _data_size(messages: list[dict], tools: list[dict] | None) -> int:
    """At least the characters of every string and number in the conversation: JSON writes each in
    full (escapes only add to it). A value JSON cannot write is counted by its str()."""
    return len(json.dumps([messages, tools], ensure_ascii=False, default=str))


# Characters printed by `{{ }}` in the current render; one count per render, and a context variable
# keeps renders on two threads apart (the finalizer is the environment's, shared by both).
_PRINTED: contextvars.ContextVar[list[int]] = contextvars.ContextVar("packtool_minijinja_printed")


def _count_printed(value: Any) -> Any:
    printed = _PRINTED.get()
    if isinstance(value, str):
        printed[0] += len(value)
    else:  # a number or none prints a few characters; a list or mapping its items
        printed[0] += 32 if value is None or isinstance(value, int | float) else len(str(value))
    if printed[0] > MAX_TEMPLATE_CHARS:
        raise _Overflow
    return value


def qualify(
    source: str,
    tree: nodes.Template,
    context: dict[str, Any],
    strftime_now: Callable[[str], str],
    raise_exception: Callable[[str], None],
) -> MiniTemplate:
    """The template compiled by minijinja, or NotQualified saying why jinja2 keeps it. The probe
    renders (comparing the two engines' texts) are the caller's: it has the renderer to compare with."""
    if not MINIJINJA_INSTALLED:
        raise NotQualified("minijinja is not installed (pip install 'packtool[minijinja]')")
    growth = _SizeBound(tree).growth()
    longest = _longest_literal(tree)
    environment = minijinja.Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        # each instruction prints at most the longest literal, or a value that the count checks
        fuel=min(MAX_TEMPLATE_OPERATIONS, MAX_TEMPLATE_CHARS // longest),
        finalizer=_count_printed,
    )
    environment.add_filter("tojson", _checked_tojson)
    environment.add_global("raise_exception", raise_exception)
    environment.add_global("strftime_now", strftime_now)
    try:
        environment.add_template("t", source)
    except Exception as exc:  # minijinja's parser refuses what jinja2 accepted
        raise NotQualified(f"minijinja cannot compile it: {str(exc).splitlines()[0]}") from None
    fixed = len(source) + sum(len(str(v)) for v in context.values())
    return MiniTemplate(environment, growth, fixed, context)


# tojson's texts during one render_pair, by the identity of the value written and the filter's
# arguments. minijinja hands a filter the caller's own Python objects, which no qualified template can
# change (no mutating method is allowed), and each entry holds its value, so no other object can take
# its id while the pair renders.
_TOJSON_MEMO: contextvars.ContextVar[dict[tuple[int, str], tuple[Any, str]] | None] = contextvars.ContextVar(
    "packtool_minijinja_tojson", default=None
)


def _checked_tojson(value: Any, **kwargs: Any) -> str:
    memo = _TOJSON_MEMO.get()
    key = (id(value), repr(sorted(kwargs.items())) if kwargs else "")
    if memo is not None and (known := memo.get(key)) is not None and known[0] is value:
        return known[1]
    text = _tojson(value, **kwargs)
    if len(text) > MAX_TEMPLATE_CHARS:
        raise TemplateLimit("tojson result")
    if memo is not None:
        memo[key] = (value, text)
    return text
