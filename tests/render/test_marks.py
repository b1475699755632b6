"""The sentinels and a record's strings (render.marks): every string a record brings is searched, and a marker is
found where the pattern finds one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.records import Example, Message
from packtool.render.marks import _MARKERS, _holds_marker


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
