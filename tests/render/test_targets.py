"""Which characters are trained (render.targets): the end of a turn and a printed value, each against a plain
search over the whole text; a tool the template drops rejects its sample, counted per source."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import QUICKSTART, encode_one, qwen_model, routed, target_text, template_file

from packtool.chat_templates import load_template
from packtool.config import TrainPolicy
from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.render import render_chat
from packtool.render.targets import _end_of_turn, _printed_at


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(st.sampled_from(list("<|>ab")), max_size=40),
    markers=st.lists(st.text(st.sampled_from(list("<|>ab")), min_size=1, max_size=3), min_size=1, max_size=4),
    data=st.data(),
)
def test_the_end_of_a_turn_is_the_first_marker_outside_data(text, markers, data):
    """_end_of_turn searches for all markers at once; it answers what looking for every marker over the
    whole range does: the earliest start outside the skipped ranges (ties: the smaller marker)."""
    start = data.draw(st.integers(0, len(text)))
    limit = data.draw(st.integers(start, len(text)))
    skip = tuple(
        (a, a + data.draw(st.integers(0, 5))) for a in data.draw(st.lists(st.integers(0, len(text)), max_size=3))
    )
    found = [
        (at, marker)
        for marker in markers
        for at in range(start, limit - len(marker) + 1)
        if text.startswith(marker, at) and not any(a <= at < b for a, b in skip)
    ]
    first = min(found, default=None)
    for include in (False, True):
        expected = None if first is None else first[0] + (len(first[1]) if include else 0)
        assert _end_of_turn(text, start, limit, tuple(markers), include=include, skip=skip) == expected


def test_markers_starting_at_the_same_place_end_the_turn_the_same_way_whichever_is_listed_first():
    for markers in (("ab", "a"), ("a", "ab")):
        assert _end_of_turn("xxab", 0, 4, markers, include=True) == 3
    assert _end_of_turn("xxab", 0, 4, ("b", "ab"), include=False, skip=((2, 3),)) == 3


_PRINTABLE_VALUES = st.one_of(
    st.text(alphabet=st.sampled_from('ab"\\é\n{} '), max_size=6), st.integers(-99, 99), st.booleans(), st.none()
)


@settings(max_examples=300, deadline=None)
@given(
    value=_PRINTABLE_VALUES,
    noise=st.text(alphabet=st.sampled_from('ab"\\é\n{}: '), max_size=30),
    hint=st.integers(0, 40),
)
def test_a_printed_value_is_found_exactly_when_one_of_its_forms_is_in_the_text(value, noise, hint):
    """_printed_at tries the value as it is first and alone: the verdict (printed or not) is still whether any
    form a template may print (raw, JSON with or without escapes, Python) is in the text."""
    forms = {str(value), json.dumps(value), json.dumps(value, ensure_ascii=False)}
    if isinstance(value, str):
        forms |= {form[1:-1] for form in forms if form.startswith('"')} | {repr(value)[1:-1]}
    for text in (noise, noise + json.dumps(value) + noise, noise[:3] + str(value)):
        at = _printed_at(value, text, hint)
        assert (at >= 0) == any(form in text for form in forms)
        assert at < 0 or any(text.startswith(form, at) for form in forms)


TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}


TOOL_DEF = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"properties": {"city": {}, "days": {}}}},
}


def _tool_example() -> Example:
    return Example(
        "ex:tools",
        "src",
        "h",
        messages=(
            Message("user", "Weather?"),
            Message("assistant", "", tool_calls=(TOOL_CALL,)),
            Message("tool", "sunny"),
            Message("assistant", "Sunny."),
        ),
        tools=(TOOL_DEF,),
    )


DEFINITIONS = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
)


TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALLS{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CALLS = {
    "name_and_arguments": "{{ c.function.name }}({{ c.function.arguments | tojson }})",
    "python_repr": "{{ c.function.name }} {{ c.function.arguments }}",
    "name_only": "{{ c.function.name }}()",
    "nothing": "",
}


@pytest.mark.parametrize(
    ("definitions", "calls", "dropped"),
    [
        (True, "name_and_arguments", None),
        (True, "python_repr", None),
        (True, "name_only", "'Oslo', 3"),
        (True, "nothing", "'get_weather', 'Oslo', 3"),
        (False, "name_and_arguments", "'get_weather', 'city', 'days'"),
    ],
)
def test_tools_the_template_drops_reject_the_sample(tmp_path, definitions, calls, dropped):
    source = (DEFINITIONS if definitions else "") + TURNS.replace("CALLS", CALLS[calls])
    template = load_template(template_file(tmp_path, source), {})
    if dropped is None:
        assert "get_weather" in render_chat(_tool_example(), template, TrainPolicy(), routed(template)).text
        return
    with pytest.raises(RecordError) as caught:
        render_chat(_tool_example(), template, TrainPolicy(), routed(template))
    assert caught.value.kind == "template_dropped_tools"
    assert dropped in caught.value.reason
    assert ("tools[0]" if not definitions else "tool call 0 of message 1") in caught.value.reason


@pytest.mark.parametrize("code", ["print('</s>')", "<end_of_turn> and <|end|>", "x<|eot_id|>y"])
def test_an_end_marker_the_template_never_prints_is_words_in_a_tool_call(code):
    """Qwen2.5 ends its turns with <|im_end|> alone; `</s>`, `<end_of_turn>` or `<|eot_id|>` in a tool
    call's code are plain text there. The call's target runs to its <|im_end|> (it ended inside the code,
    so the rest of the call and the end marker were not trained)."""
    tokenizer, template = qwen_model()
    assert template.end_markers == ("<|im_end|>",)
    tool = {"type": "function", "function": {"name": "run", "parameters": {"properties": {"code": {}}}}}
    call = {"type": "function", "function": {"name": "run", "arguments": {"code": code}}}
    messages = (
        Message("user", "Run it"),
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", "1"),
        Message("assistant", "Done."),
    )
    example = Example("ex:0", "src", "hash", messages=messages, tools=(tool,))
    rendered = render_chat(example, template, TrainPolicy(), routed(template))
    start, end, message = rendered.target_ranges[0]
    assert message == 1 and rendered.text[start:end].endswith("</tool_call><|im_end|>")
    assert json.dumps(code, ensure_ascii=False) in rendered.text[start:end]
    sample = encode_one(example, tokenizer, template)
    assert target_text(tokenizer, sample).count("<|im_end|>") == 2


def test_dropped_tools_are_counted_per_source(tmp_path, write_config, write_jsonl):
    from packtool.builder import build
    from packtool.config import load_config

    example = _tool_example()
    row = {"messages": [m.as_template_dict() for m in example.messages], "tools": [TOOL_DEF]}
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    write_jsonl([row, plain, row])
    (tmp_path / "t.jinja").write_text(TURNS.replace("CALLS", CALLS["name_and_arguments"]), encoding="utf-8")
    source = {"name": "s", "path": "data.jsonl", "format": "messages"}
    config = load_config(
        write_config(
            {
                "sources": [source],
                "tokenizer": str(QUICKSTART / "tokenizer"),
                "template": "t.jinja",
                "capacity": 256,
                "on_error": "skip",
                "max_reject_share": 1.0,  # two of three rows are rejected on purpose
                "output": "out",
            }
        )
    )
    manifest = build(config).manifest
    assert manifest["accounting"]["s"]["rejected"] == {"template_dropped_tools": 2}
    assert manifest["accounting"]["s"]["kept"] == 1
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert reasons == ["template_dropped_tools"] * 2
