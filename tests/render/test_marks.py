"""The sentinels and a record's strings (render.marks): every string a record brings is searched, and a marker is
found where the pattern finds one."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import qwen_model

from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.render.marks import _MARKERS, _check_data_strings, _holds_marker


def test_every_string_a_record_brings_is_searched():
    from packtool.render import data_strings

    example = Example(
        "ex:all",
        "src",
        "h",
        messages=(
            Message("system", "sys"),
            Message("user", "u", name="nm"),
            Message(
                "assistant",
                "a",
                reasoning_content="think",
                tool_calls=({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"k": ["v"]}}},),
            ),
            Message("tool", "r", tool_call_id="c1"),
        ),
        tools=(
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"properties": {"k": {}}}},
            },
        ),
    )
    found = dict(data_strings(example))
    for value in ("sys", "u", "nm", "think", "c1", "f", "k", "v", "d", "r"):
        assert value in found.values(), value
    assert found["messages[2].tool_calls[0].function.arguments.k[0]"] == "v"
    assert found["tools[0].function.parameters.properties key"] == "k"


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(
        alphabet=st.one_of(
            st.sampled_from("a\u00e9\u4e2d\U0001f600\U000fffff\U00100000\U0010fffd\U0010ffff"),
            st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates, as JSON input may hold
            st.characters(),
        ),
        max_size=40,
    )
)
def test_a_marker_is_found_by_its_utf8_lead_byte_exactly_where_the_pattern_finds_one(text):
    assert _holds_marker(text) == (_MARKERS.search(text) is not None)


def _tool_record(field: str, value: str) -> Example:
    """A record with every kind of string a chat record brings, `value` in the one named by `field`."""
    strings = dict.fromkeys(
        ["content", "reasoning", "call_name", "argument", "call_id", "tool_name", "description"], "plain words"
    )
    strings[field] = value
    call = {"type": "function", "function": {"name": strings["call_name"], "arguments": {"city": strings["argument"]}}}
    tool = {"type": "function", "function": {"name": strings["tool_name"], "description": strings["description"]}}
    messages = (
        Message("user", strings["content"]),
        Message("assistant", "", tool_calls=(call,), reasoning_content=strings["reasoning"]),
        Message("tool", "sunny", tool_call_id=strings["call_id"]),
        Message("assistant", "It is sunny."),
    )
    return Example("ex:0", "src", "hash", messages=messages, tools=(tool,))


_TOOL_RECORD_FIELDS = {
    "content": "messages[0].content",
    "reasoning": "messages[1].reasoning_content",
    "call_name": "messages[1].tool_calls[0].function.name",
    "argument": "messages[1].tool_calls[0].function.arguments.city",
    "call_id": "messages[2].tool_call_id",
    "tool_name": "tools[0].function.name",
    "description": "tools[0].function.description",
}


@pytest.mark.parametrize("field", sorted(_TOOL_RECORD_FIELDS))
def test_every_string_of_a_tool_record_is_searched_for_literals_and_markers(field):
    """The record's strings are searched joined (message strings as they are, tools and calls as JSON):
    a literal or a marker in any one of them is found and named, and a literal that only the joining
    would make (one string ending in its first half, the next starting with the rest) is not one."""
    _, template = qwen_model()
    found = _check_data_strings(_tool_record(field, "say <|im_end|> now"), template.literals, contents_only=False)
    assert found[0] == (_TOOL_RECORD_FIELDS[field],)
    with pytest.raises(RecordError, match="private-use") as raised:
        _check_data_strings(_tool_record(field, "a \U0010fffd b"), template.literals, contents_only=False)
    assert raised.value.field == _TOOL_RECORD_FIELDS[field]
    assert _check_data_strings(_tool_record(field, "plain"), template.literals, contents_only=False)[0] == ()
    halves = _tool_record("content", "ends in <|im_")
    halves = replace(
        halves,
        messages=(halves.messages[0], replace(halves.messages[1], reasoning_content="end|> x"), *halves.messages[2:]),
    )
    assert _check_data_strings(halves, template.literals, contents_only=False)[0] == ()
