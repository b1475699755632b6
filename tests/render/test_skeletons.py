"""One render per conversation shape (render.skeletons): a skeleton, with tools a slot skeleton, renders what the
template renders for every conversation of its shape, or is not kept; its records are still checked."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    PARITY_MODELS,
    chat,
    count_renders,
    encode_one,
    learned,
    model_template,
    qwen_model,
    routed,
    shared,
    template_file,
)

import packtool.minijinja_engine
import packtool.render.accelerators
from packtool.chat_templates import load_template
from packtool.config import TrainPolicy
from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.render import render_chat
from packtool.render.routes import _render_chat


def test_a_conversation_of_a_known_shape_is_not_rendered_again(monkeypatch):
    _, template = qwen_model()
    calls = count_renders(template, monkeypatch)
    first = render_chat(chat(("user", "Name a prime."), ("assistant", "7")), template, TrainPolicy(), routed(template))
    again = render_chat(
        chat(("user", "Another one?"), ("assistant", " 11\n")), template, TrainPolicy(), routed(template)
    )
    same_shape = render_chat(
        chat(("user", "And one more."), ("assistant", " 13\n")), template, TrainPolicy(), routed(template)
    )
    assert calls == [2]  # the whitespace around a content is part of the shape; the words are not
    for rendered in (first, again, same_shape):
        plain = template.render([m.as_template_dict() for m in rendered.example.messages], None)
        assert rendered.text == plain
    assert same_shape.text[slice(*same_shape.target_ranges[0][:2])] == " 13\n<|im_end|>"


def test_skeletons_kept_per_template_are_capped(monkeypatch):
    monkeypatch.setattr(packtool.render.accelerators, "MAX_SKELETONS", 2)
    _, template = qwen_model()
    template = replace(template)
    for turns in (1, 2, 3, 4):
        example = chat(*[("user", "Hi"), ("assistant", "Hello")] * turns)
        rendered = render_chat(example, template, TrainPolicy(), routed(template))
        assert rendered.text == template.render([m.as_template_dict() for m in example.messages], None)
    assert len(learned(template).skeletons) == 2


def test_a_template_branching_on_words_never_lends_its_render_to_another_conversation(tmp_path):
    """A template that looks for a word takes its branch on the conversation holding it, whatever
    conversations of the same shape came first (they inspected a content, so none was kept)."""
    source = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{% if message.role == 'assistant' and 'secret' in message.content %}NOTE: {% endif %}"
        "{{ message.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    template = load_template(template_file(tmp_path, source), {})
    plain = render_chat(chat(("user", "Hi"), ("assistant", "Hello")), template, TrainPolicy(), routed(template))
    assert "NOTE" not in plain.text
    assert learned(template).skeletons == {}
    branched = render_chat(chat(("user", "Hi"), ("assistant", "a secret")), template, TrainPolicy(), routed(template))
    assert branched.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nNOTE: a secret<|im_end|>\n"
    start, end, _ = branched.target_ranges[0]
    assert branched.text[start:end] == "NOTE: a secret<|im_end|>"


REPEATING = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% set ns = namespace(copies='') %}{% for _ in range(1000) %}{% set ns.copies = ns.copies ~ message.content %}"
    "{% endfor %}{{ message.content }}<|im_end|>\n{% endfor %}"
)


def test_a_conversation_whose_render_could_pass_a_size_limit_is_rendered(tmp_path):
    """The template copies each content 1000 times without looking at it: a short conversation makes
    the shape's skeleton, and a long one of that shape still meets the limit a render would hit."""
    template = load_template(template_file(tmp_path, REPEATING), {})
    short = render_chat(chat(("user", "Hi"), ("assistant", "Hello")), template, TrainPolicy(), routed(template))
    assert short.text.endswith("Hello<|im_end|>\n") and len(learned(template).skeletons) == 1
    medium = chat(("user", "Hi"), ("assistant", "x" * 300))  # 300 K characters built: below the limit
    unkept = replace(template)
    assert render_chat(medium, template, TrainPolicy(), routed(template)) == render_chat(
        medium, unkept, TrainPolicy(), routed(unkept)
    )
    long = chat(("user", "Hi"), ("assistant", "x" * 9000))  # 9 M characters: over the 8 Mi limit
    for fresh in (template, replace(template)):
        with pytest.raises(RecordError) as caught:
            render_chat(long, fresh, TrainPolicy(), routed(fresh))
        assert caught.value.kind == "template_limit"


WORDS = st.text(alphabet=st.sampled_from(list('ab \n\t.<|>é中😀{}"\\')), max_size=12)


TURN = st.tuples(st.sampled_from(["user", "assistant"]), st.sampled_from(["", " ", "\n", "  \n"]), WORDS)


POLICIES = st.builds(
    TrainPolicy,
    roles=st.sampled_from([("assistant",), ("assistant", "user")]),
    turns=st.sampled_from(["all", "last"]),
    end_of_turn=st.booleans(),
)


def _rendered_or_rejected(example, template, policy):
    try:
        return render_chat(example, template, policy, routed(template))
    except RecordError as error:
        return (error.kind, error.reason)


def _assert_kept_renders_as_fresh(example, template, policy):
    """A render through what `template` has kept (skeletons, recipes) equals a render with nothing kept,
    or fails the same way."""
    fresh = replace(template)
    kept = _rendered_or_rejected(example, template, policy)
    assert kept == _rendered_or_rejected(example, fresh, policy), example


@pytest.mark.parametrize("model", PARITY_MODELS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations=st.lists(st.lists(TURN, min_size=1, max_size=4), min_size=2, max_size=6), policy=POLICIES)
def test_a_shape_s_skeleton_renders_what_the_template_renders(model, conversations, policy):
    """Conversations of few shapes (roles, whitespace around contents, empty contents), rendered one
    after another with one template (through the shape's skeleton and recipe once learned), give
    what each gives rendered alone with no skeleton kept."""
    folder = shared("tokenizers", model)
    template = model_template(str(folder))
    for turns in conversations:
        example = chat(*((role, f"{pad}{words}{pad[::-1]}") for role, pad, words in turns))
        _assert_kept_renders_as_fresh(example, template, policy)


def _fresh_without_slots(example, template, policy):
    """The render a conversation with tools got before slot skeletons: nothing kept, nothing learned."""
    fresh = replace(template)
    try:
        return _render_chat(example, fresh, policy, routed(fresh), learn_slots=False)
    except RecordError as error:
        return (error.kind, error.reason)


SLOT_WORDS = st.one_of(
    st.text(alphabet=st.sampled_from(list("ab \n\t.<|>é中😀{}\"\\'")), max_size=10),
    st.sampled_from(("{{ tools }}", "get_time", " padded ", "\n", "", "null", "0")),
)


SLOT_SCALARS = st.one_of(SLOT_WORDS, st.integers(-5, 5), st.booleans(), st.none(), st.floats(-1, 1))


@st.composite
def tool_conversation_lists(draw):
    """Conversations with tools, tool calls, reasoning, names and ids. One layout (which fields, how many
    tools, the arguments' keys and kinds) for the whole list, so that a shape's skeleton is learned and
    followed; words that JSON escapes or a template could misread, with whitespace around them (another
    shape each time) only in some lists."""
    padded = draw(st.booleans())
    n_tools = draw(st.integers(1, 2))
    keys = draw(st.lists(st.sampled_from(["city", "days"]), min_size=0, max_size=2, unique=True))
    kinds = [draw(st.sampled_from(["word", "int", "bool", "none", "float"])) for _ in keys]
    with_id, system, said = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    reasons = (draw(st.booleans()), draw(st.booleans()))

    def words() -> str:
        text = draw(SLOT_WORDS)
        return text if padded else text.strip() or "w"

    def value(kind: str) -> Any:
        scalars = {"int": st.integers(-5, 5), "bool": st.booleans(), "none": st.none(), "float": st.floats(-1, 1)}
        return words() if kind == "word" else draw(scalars[kind])

    def tool() -> dict[str, Any]:
        parameters = {"properties": {words(): {}}}
        return {"type": "function", "function": {"name": words(), "description": words(), "parameters": parameters}}

    conversations = []
    for _ in range(draw(st.integers(3, 6))):
        tools = tuple(tool() for _ in range(n_tools))
        arguments = {key: value(kind) for key, kind in zip(keys, kinds)} if keys else words()
        call = {"type": "function", "function": {"name": tools[0]["function"]["name"], "arguments": arguments}}
        if with_id:
            call["id"] = words()
        calling = Message(
            "assistant", words() if said else "", tool_calls=(call,), reasoning_content=words() if reasons[0] else None
        )
        messages = [
            Message("user", words()),
            calling,
            Message("tool", words(), tool_call_id=call.get("id")),
            Message("assistant", words(), reasoning_content=words() if reasons[1] else None),
        ]
        if system:
            messages.insert(0, Message("system", words()))
        conversations.append(Example("ex:0", "src", "hash", messages=tuple(messages), tools=tools))
    return conversations


@pytest.mark.parametrize("model", PARITY_MODELS)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(conversations=tool_conversation_lists(), policy=POLICIES)
def test_a_tool_conversation_through_a_slot_skeleton_renders_what_the_template_renders(model, conversations, policy):
    """Conversations with tools, rendered one after another with one template (through the skeleton a
    shape's slot-marked render taught, once learned), give what each gives rendered with nothing kept and
    no slots, or fail the same way: quotes and backslashes that tojson escapes, template syntax, numbers
    and flags in arguments, whitespace around every string."""
    template = model_template(str(shared("tokenizers", model)))
    for example in conversations:
        assert _rendered_or_rejected(example, template, policy) == _fresh_without_slots(example, template, policy)


def _slot_records():
    """Conversations of one shape whose words differ: a slot skeleton learned from the first would print
    the first's words (or unescaped ones) in the others if it were wrong."""
    for name, zone, reasoning in (
        ("get_time", "UTC", "Check."),
        ("get_weather", 'Oslo "west"', "a\\b"),
        ("x", "\n", "z"),
    ):
        tool = {
            "type": "function",
            "function": {"name": name, "description": f"{name} it", "parameters": {"properties": {"zone": {}}}},
        }
        call = {"type": "function", "function": {"name": name, "arguments": {"zone": zone}}}
        messages = (
            Message("user", "Hi"),
            Message("assistant", "", tool_calls=(call,), reasoning_content=reasoning),
            Message("tool", "done"),
            Message("assistant", "Ok."),
        )
        yield Example("ex:0", "src", "hash", messages=messages, tools=(tool,))


SLOT_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}CALL{% endfor %}<|im_end|>\n{% endfor %}"
)


SLOT_LOOKS = {
    # learned: every slot only copied, through tojson or as it is
    "tojson": (
        "{% for t in tools %}{{ t | tojson }}\n{% endfor %}",
        "{{ c.function.name }} {{ c.function.arguments | tojson }}",
        True,
    ),
    "tojson indented": (
        "{% for t in tools %}{{ t | tojson(indent=2) }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson(sort_keys=true) }}",
        True,
    ),
    # refused: each looks at a slot some other way
    "a key": (
        "{% for t in tools %}{{ t.function.name }}{{ t | tojson }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "items": (
        "{% for t in tools %}{% for k, v in t | dictsort %}{{ k }}{% endfor %}{{ t | tojson }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "the whole list": ("{{ tools | tojson }}", "{{ c.function.name }}{{ c.function.arguments | tojson }}", False),
    "printed as a dict": (
        "{% for t in tools %}{{ t }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "a print's length": (
        "{% for t in tools %}{{ t | tojson }}{{ t | tojson | length }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "a name compared": (
        "{% for t in tools %}{{ t | tojson }}{% endfor %}",
        "{% if c.function.name == 'get_time' %}TIME{% endif %}{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "an argument read": (
        "{% for t in tools %}{{ t | tojson }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments.zone }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "a call through tojson": ("{% for t in tools %}{{ t | tojson }}{% endfor %}", "{{ c | tojson }}", False),
    "a name of the slot's own": (
        "{% for t in tools %}{{ t._value }}{{ t._slot }}{{ t | tojson }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
    "the same tool twice": (
        "{% for t in tools %}{% if t is sameas tools[0] %}1{% endif %}{{ t | tojson }}{% endfor %}",
        "{{ c.function.name }}{{ c.function.arguments | tojson }}",
        False,
    ),
}


@pytest.mark.parametrize("look", sorted(SLOT_LOOKS))
def test_a_template_that_looks_at_a_slot_teaches_no_slot_skeleton(look):
    """A template that only copies a conversation's tools, calls and reasoning (tojson, or as they are)
    teaches its shape a skeleton; one that reads a key, iterates, compares, prints a dict or measures a
    print teaches none (each such use is noted), and every conversation renders as the template
    renders it either way."""
    tools, call, teaches = SLOT_LOOKS[look]
    source = "<|im_start|>system\n" + tools + "<|im_end|>\n" + SLOT_CHATML.replace("CALL", call)
    template = load_template("model", {"chat_template": source, "eos_token": "<|im_end|>"})
    for example in _slot_records():
        assert _rendered_or_rejected(example, template, TrainPolicy()) == _fresh_without_slots(
            example, template, TrainPolicy()
        )
    slotted = [key for key in learned(template).skeletons if key[0] == "slots"]
    assert bool(slotted) == teaches, look
    refused = [read for key, read in learned(template).inspecting_shapes.items() if key[0] == "slots"]
    assert all(not read.skeletons for read in refused) and bool(refused) != teaches


# Pieces of templates over a conversation's slots: copies a skeleton may keep, and looks it may not.
SLOT_PIECES_TOOLS = (
    "{{ t | tojson }}",
    "{{ t | tojson(indent=2) }}",
    "{{ t.function.name }}",
    "{{ (t | tojson)[:9] }}",
    "{{ t | tojson | replace('a', 'b') }}",
    "{% if t.function is defined %}D{% endif %}",
    "{{ tools | length }}",
    "{% if t is mapping %}M{% endif %}",
)


SLOT_PIECES_CALLS = (
    "{{ c.function.name }}",
    "{{ c.function.arguments | tojson }}",
    "{{ c.function.name | upper }}",
    "{% if c.function.name.startswith('get') %}G{% endif %}",
    "{{ c.function.arguments | length }}",
    "{% for k in c.function.arguments %}{{ k }}{% endfor %}",
    "{% set x = c.function.name %}{{ x ~ '!' }}",
    "{{ c | tojson }}",
    "{% if c.function.arguments is string %}S{% endif %}",
)


SLOT_PIECES_MESSAGES = (
    "{{ m.reasoning_content }}",
    "{{ m.reasoning_content | trim }}",
    "{% if m.reasoning_content %}R{% endif %}",
    "{{ m.reasoning_content | length }}",
    "{% if 'x' in m.reasoning_content %}X{% endif %}",
    "{{ m.tool_call_id }}",
    "{% if m.content.startswith('x') %}C{% endif %}",
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.tuples(
        st.lists(st.sampled_from(SLOT_PIECES_TOOLS), max_size=3),
        st.lists(st.sampled_from(SLOT_PIECES_CALLS), max_size=3),
        st.lists(st.sampled_from(SLOT_PIECES_MESSAGES), max_size=2),
    ),
    words=st.lists(
        st.tuples(
            st.sampled_from(["get_x", "x", "get", 'say "hi"']), st.sampled_from(["a", "x", "b\\c"]), SLOT_SCALARS
        ),
        min_size=3,
        max_size=5,
    ),
)
def test_any_mix_of_copies_and_looks_at_slots_renders_what_the_template_renders(pieces, words):
    """Templates made of random pieces that copy slots (tojson, a name as it is, a truth test) or look at
    them (keys, lengths, slices, comparisons, a call through tojson), over conversations of one shape
    with other words: each renders as the template renders it with nothing kept and no slots."""
    tools, calls, per_message = ("".join(p) for p in pieces)
    source = (
        "{% for t in tools %}" + tools + "{{ t | tojson }}\n{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        + per_message.replace("m.reasoning_content", "(m.reasoning_content or '')")
        + "{{ m.content }}{% for c in m.tool_calls or [] %}"
        + calls
        + "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    )
    template = load_template("model", {"chat_template": source, "eos_token": "<|im_end|>"})
    for name, reasoning, value in words:
        tool = {"type": "function", "function": {"name": name, "parameters": {"properties": {"zone": {}}}}}
        call = {"type": "function", "id": "c1", "function": {"name": name, "arguments": {"zone": value}}}
        messages = (
            Message("user", "xHi"),
            Message("assistant", "", tool_calls=(call,), reasoning_content=reasoning),
            Message("tool", "done", tool_call_id="c1"),
            Message("assistant", "Ok.", reasoning_content=reasoning),
        )
        example = Example("ex:0", "src", "hash", messages=messages, tools=(tool,))
        assert _rendered_or_rejected(example, template, TrainPolicy()) == _fresh_without_slots(
            example, template, TrainPolicy()
        ), source


@pytest.mark.parametrize(
    ("tools", "call"),
    [
        ("", "{{ c.function.name }}{{ c.function.arguments | tojson }}"),  # drops the definitions
        ("{% for t in tools %}{{ t | tojson }}{% endfor %}", "{{ c.function.name }}()"),  # drops the arguments
    ],
)
def test_a_template_that_drops_tools_is_caught_in_every_conversation_of_its_shape(tools, call):
    """The first conversation names its tool and arguments in its reasoning, so a template that drops
    the definitions or the arguments passes the tool checks there; the skeleton it teaches does not
    print them, so the next conversation of the shape is checked (and rejected), not let through."""

    def conversation(name: str, key: str, value: str, reasons: tuple[str, str]) -> Example:
        tool = {"type": "function", "function": {"name": name, "parameters": {"properties": {key: {}}}}}
        called = {"type": "function", "function": {"name": name, "arguments": {key: value}}}
        messages = (
            Message("user", "Hi"),
            Message("assistant", "", tool_calls=(called,), reasoning_content=reasons[0]),
            Message("tool", "done"),
            Message("assistant", "Ok.", reasoning_content=reasons[1]),
        )
        return Example("ex:0", "src", "hash", messages=messages, tools=(tool,))

    source = "<|im_start|>system\n" + tools + "<|im_end|>\n" + SLOT_CHATML.replace("CALL", call)
    template = load_template("model", {"chat_template": source, "eos_token": "<|im_end|>"})
    named = conversation("get_time", "zone", "Oslo", ("call get_time for Oslo", "get_time has a zone"))
    unnamed = conversation("get_date", "day", "Monday", ("call it", "done"))
    for example in (named, unnamed):
        assert _rendered_or_rejected(example, template, TrainPolicy()) == _fresh_without_slots(
            example, template, TrainPolicy()
        )
    assert any(key[0] == "slots" for key in learned(template).skeletons)
    with pytest.raises(RecordError) as caught:
        render_chat(unnamed, template, TrainPolicy(), routed(template))
    assert caught.value.kind == "template_dropped_tools"


def test_with_no_room_for_skeletons_a_tool_conversation_is_rendered_once(monkeypatch):
    """Past MAX_SKELETONS nothing a slot-marked render teaches could be kept, so none is made: each
    conversation gets the one render (minijinja's pair) it got before slots."""
    _, template = qwen_model()
    template = replace(template)
    monkeypatch.setattr(packtool.render.accelerators, "MAX_SKELETONS", 0)
    calls = count_renders(template, monkeypatch)
    example = next(_slot_records())
    for _ in range(3):
        assert render_chat(example, template, TrainPolicy(), routed(template)) == _fresh_without_slots(
            example, template, TrainPolicy()
        )
    assert calls == [0] and not learned(template).skeletons


def test_a_tool_conversation_of_a_known_shape_renders_nothing(monkeypatch):
    """Qwen2.5: a shape's second tool conversation teaches its skeleton, and later ones are that skeleton
    filled in (the tools' and arguments' JSON, the names, the contents), with no template render."""
    _, template = qwen_model()
    template = replace(template)
    first, *others = _slot_records()
    render_chat(first, template, TrainPolicy(), routed(template))
    assert not learned(template).skeletons  # a shape seen once teaches nothing: data of unique shapes pays no learning
    render_chat(first, template, TrainPolicy(), routed(template))
    assert [key[0] for key in learned(template).skeletons] == ["slots"]
    calls = count_renders(template, monkeypatch)
    real_pair = packtool.minijinja_engine.MiniTemplate.render_pair
    monkeypatch.setattr(
        packtool.minijinja_engine.MiniTemplate, "render_pair", lambda *a: calls.append(a) or real_pair(*a)
    )
    followed = [render_chat(example, template, TrainPolicy(), routed(template)) for example in others]
    assert calls == [0]
    monkeypatch.undo()
    for example, rendered in zip(others, followed):
        assert rendered == _fresh_without_slots(example, template, TrainPolicy())
        assert json.dumps(example.tools[0], ensure_ascii=False) in rendered.text


# Contents a recipe must carry as they are: template syntax, text spelling the template's own pieces
# (without special tokens), whitespace a template could trim, characters of other widths.
# Pieces of contents that Qwen3's template asks about ('</think>' in content, startswith('<tool_response>'),
# endswith('</tool_response>')), so that conversations of one shape answer its questions differently.
QUESTIONED = st.lists(
    st.sampled_from(["<think>", "</think>", "<tool_response>", "</tool_response>", "\n", " ", "4", "ok", "中"]),
    max_size=4,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(
    conversations=st.lists(
        st.lists(st.tuples(st.sampled_from(["user", "assistant"]), QUESTIONED), min_size=1, max_size=4),
        min_size=2,
        max_size=8,
    ),
    policy=POLICIES,
)
def test_a_skeleton_learned_from_questions_renders_what_the_template_renders(conversations, policy):
    """Qwen3 looks inside contents: a skeleton is kept with the questions its render asked and the answers
    it got, and a later conversation of the shape follows it only when its contents, marked and plain,
    answer alike. Rendered one after another with one template, each conversation gives what it gives
    rendered alone with nothing kept."""
    template = model_template(str(shared("tokenizers", "qwen3")))
    template = replace(template)
    for turns in conversations:
        example = chat(*turns)
        _assert_kept_renders_as_fresh(example, template, policy)


def test_qwen3_plain_chat_follows_a_skeleton_of_questions_and_answers(monkeypatch):
    """Two-turn chats with Qwen3: the first of a shape is rendered (jinja2, which notes the questions),
    later ones of the same answers follow its skeleton and recipe; a content that answers otherwise
    ('</think>' in it) is rendered and teaches its own."""
    template = replace(model_template(str(shared("tokenizers", "qwen3"))))
    calls = count_renders(template, monkeypatch)
    first = render_chat(chat(("user", "Name a prime."), ("assistant", "7")), template, TrainPolicy(), routed(template))
    assert calls == [2]  # the marked render, asking its questions, and the plain one
    (read,) = learned(template).inspecting_shapes.values()
    (skeleton,) = read.skeletons
    assert {(index, method) for index, method, _, _ in skeleton.readings} >= {(1, "__contains__")}
    again = render_chat(chat(("user", "Another one?"), ("assistant", "11")), template, TrainPolicy(), routed(template))
    assert calls == [2]  # followed: no render
    # '</think>' in it answers otherwise: rendered again (the template splits it, which no skeleton can follow)
    thinking = chat(("user", "And one more?"), ("assistant", "<think>\nsmall\n</think>\n\n13"))
    with pytest.raises(RecordError):  # the words are printed in two pieces (see the mask checks)
        render_chat(thinking, template, TrainPolicy(), routed(template))
    assert calls == [4] and len(read.skeletons) == 1
    for rendered in (first, again):
        plain = template.render([m.as_template_dict() for m in rendered.example.messages], None)
        assert rendered.text == plain
    assert again.text[slice(*again.target_ranges[0][:2])] == "<think>\n\n</think>\n\n11<|im_end|>"


def test_a_content_of_a_known_shape_is_still_searched_for_literals_and_markers():
    """The recipe path skips the render, not the record's checks: a special-token literal typed into
    a content of a shape whose recipe is known is named and escaped, a marker character rejected."""
    tokenizer, template = qwen_model()
    template = replace(template)
    render_chat(chat(("user", "Hi"), ("assistant", "Hello")), template, TrainPolicy(), routed(template))
    assert any(skeleton.recipes for skeleton in learned(template).skeletons.values())
    typed = chat(("user", "Say <|im_end|> please"), ("assistant", "Hello"))
    rendered = render_chat(typed, template, TrainPolicy(), routed(template))
    assert rendered.literal_fields == ("messages[0].content",)
    assert rendered == render_chat(typed, replace(template), TrainPolicy(), routed(replace(template)))
    sample = encode_one(typed, tokenizer, template)
    ends = (sample.input_ids == tokenizer.token_id("<|im_end|>")).sum()
    assert ends == rendered.text.count("<|im_end|>") - 1  # the typed one is plain text
    with pytest.raises(RecordError, match="private-use"):
        render_chat(chat(("user", "Hi \U00100000"), ("assistant", "Hello")), template, TrainPolicy(), routed(template))


@pytest.mark.parametrize("printed", ["{{ m.content | tojson }}", "{{ m | tojson }}", "{{ [m.content] | tojson }}"])
def test_a_content_printed_through_tojson_is_escaped_in_every_conversation_of_its_shape(printed):
    """tojson escapes quotes, backslashes and control characters: its copy of "Hi" looks verbatim, its
    copy of `He said "hi"` does not. A render that sent a content through it teaches no skeleton, so a
    later conversation of the same shape is printed as the template prints it, not filled in raw
    (it was: the second render below printed `"He said "hi""`)."""
    source = "{% for m in messages %}<|im_start|>{{ m.role }}\n" + printed + "<|im_end|>\n{% endfor %}"
    template = load_template("model", {"chat_template": source, "eos_token": "<|im_end|>"})
    render_chat(chat(("user", "Hi"), ("assistant", "Hello")), template, TrainPolicy(), routed(template))
    assert not learned(template).skeletons
    for user in ('He said "hi"', "a\\b", "tab\there", "two\nlines", "plain again"):
        example = chat(("user", user), ("assistant", 'Say "yes"'))
        rendered = render_chat(example, template, TrainPolicy(), routed(template))
        assert rendered == render_chat(example, replace(template), TrainPolicy(), routed(replace(template)))
        assert json.dumps(user)[1:-1] in rendered.text and '\\"yes\\"' in rendered.text
    assert not learned(template).skeletons
