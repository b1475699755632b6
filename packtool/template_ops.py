"""The one allow-list of what a chat template does with a value, read by both engines.

The jinja2 sandbox tracks marked contents (packtool.template_tracking): a copy of a content is not a
look at it, so a render that only copies needs no plain render beside it. minijinja
(packtool.minijinja_engine) renders a template only where a size bound holds for every filter,
method and function it calls. Both read these sets, so they cannot disagree: a method that copies a
content keeps its size, and a reading (a yes/no question) returns a scalar.
"""

from __future__ import annotations

# str methods whose result is (part of) the content itself: not a look at it
COPYING_METHODS = frozenset({"strip", "lstrip", "rstrip"})
# filters that print a content as it is, or as JSON: not a look at it
COPYING_FILTERS = frozenset({"trim", "string", "tojson"})
# Looks inside a content that can be asked again of another conversation's content, marked and plain,
# without a render (render.skeletons._Skeleton.replays): a yes/no question with plain arguments, asked of a
# content object the render was given (not of a string made from it: `content.strip().startswith(x)` is not
# `content.startswith(x)`). Qwen3 asks `'</think>' in content` and `content.startswith('<tool_response>')`.
READINGS = frozenset({"__contains__", "startswith", "endswith", "__eq__", "__ne__"})

# Filters and str methods a template minijinja renders may use (minijinja_engine._SizeBound): those
# whose result is at most their input, and those that return a scalar. Others (escape, indent, center,
# format, replace, wordwrap, ...) can outgrow their input and keep a template on jinja2; tojson is
# bounded on its own (minijinja_engine._TOJSON_GROWTH).
SAME_SIZE_FILTERS = (COPYING_FILTERS - {"tojson"}) | frozenset(
    {"lower", "upper", "title", "capitalize", "first", "last", "reverse", "list", "unique", "sort"}
    | {"items", "dictsort", "selectattr", "rejectattr", "select", "reject", "safe"}
)
SCALAR_FILTERS = frozenset({"length", "count", "int", "float", "abs", "bool"})
SAME_SIZE_METHODS = COPYING_METHODS | frozenset(
    {"lower", "upper", "title", "capitalize", "split", "items", "keys", "values", "get"}
)
SCALAR_METHODS = frozenset(name for name in READINGS if not name.startswith("__")) | frozenset(
    {"isdigit", "isalpha", "isspace", "count", "find"}
)
# The template's functions; their results are checked in Python (strftime output is a date line).
FUNCTIONS = frozenset({"namespace", "raise_exception", "strftime_now"})
