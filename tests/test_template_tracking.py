"""What a template looks at (packtool.template_tracking): a template that branches on a content, reads it in any
way or captures it is caught with one render, or renders twice and still passes; `in` keeps its Python meaning."""

from __future__ import annotations

import pytest
from support import (
    CONVERSATION,
    chat,
    count_renders,
    qwen_model,
    routed,
    shared,
    template_file,
)

from packtool.chat_templates import JINJA2_ONLY, load_template
from packtool.config import TokenizerConfig, TrainPolicy
from packtool.encode import load_tokenizer
from packtool.errors import RecordError
from packtool.render import render_chat

BRANCHES = {
    # each prints an extra note for an assistant content of more than 5 characters: the marked content
    # (two sentinels longer) takes the branch where the plain one does not, and the header moves
    "length": "message.content | length > 5",
    "method": "message.content.startswith('Hello')",
    "contains": "message.content in ['Hello', 'Bye']",
    "compare": "message.content == 'Hello'",
    "copied_then_inspected": "(message.content ~ '') | length > 5",
    "added_then_inspected": "(message.content + '').endswith('llo')",
    # {"role": "assistant", "content": "Hello"} is 41 characters
    "json_then_inspected": "(message | tojson) | length > 41",
    "slice": "message.content[0] == 'H'",
    "joined_list_then_inspected": "([message.content] | join) | length > 5",
    "method_join_then_inspected": "(''.join([message.content])) | length > 5",
    "formatted": "('%s!' % message.content) | length > 6",
    # a plain string's own `in`: str.__contains__ of the right operand, which a Tracked content never sees
    "in_a_string": "message.content in 'Hello Bye'",
    "not_in_a_string": "message.content not in 'Hello Bye'",
    "in_a_chain": "'' < message.content in 'Hello Bye'",
    "in_test": "message.content is in 'Hello Bye'",
    "in_test_by_select": "(messages | selectattr('content', 'in', 'Hello Bye') | list) | length > 0",
    # a string joined from a generator of contents: no container argument shows where it came from
    "joined_generator_then_compared": "messages | map(attribute='content') | join == 'HiHello'",
    # identity: CPython shares the literal 'Hello' with an equal plain content, never with a marked one
    "sameas": "message.content is sameas 'Hello'",
}


@pytest.mark.parametrize("how", sorted(BRANCHES))
def test_a_template_that_branches_on_content_is_caught_with_one_render(how, tmp_path):
    from packtool.render.marks import _marked, _strip_markers

    source = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{% if message.role == 'assistant' and " + BRANCHES[how] + " %}NOTE: {% endif %}"
        "{{ message.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    template = load_template(template_file(tmp_path, source), {})
    example = chat(("user", "Hi"), ("assistant", "Hello"))
    # the marked render, sentinels cut out, differs from the plain render a serving stack sees
    plain = template.render([m.as_template_dict() for m in example.messages], None)
    marked = template.render(
        [_marked(m.as_template_dict(), i) for i, m in enumerate(example.messages)], None, mark=True
    )
    assert _strip_markers(marked)[0] != plain
    with pytest.raises(RecordError) as caught:
        render_chat(example, template, TrainPolicy(), routed(template))
    assert caught.value.kind == "mask_check"


# Ways a template can read a content: each either counts as an inspection (the plain render is made and
# compared) or cannot tell the marked content from the plain one. `C` is the assistant's content, "Hello".
READINGS = [
    "C == 'Hello'",
    "'Hello' == C",
    "C < 'I'",
    "'I' > C",
    "C in 'Hello Bye'",
    "C not in 'Bye Hello'",
    "'ell' in C",
    "(C ~ '') == 'Hello'",
    "(C + '') == 'Hello'",
    "(C * 2) == 'HelloHello'",
    "[C] == ['Hello']",
    "C in {'Hello': 1}",
    "C is sameas 'Hello'",
    "C is lower",
    "C is eq 'Hello'",
    "C is lt 'I'",
    "C is in 'Hello Bye'",
    "C is string",
    "C | length > 5",
    "C | first == 'H'",
    "C | lower == 'hello'",
    "C | trim('H') == 'ello'",
    "C | truncate(3) == 'Hello'",
    "C | list | length > 5",
    "C | reverse | join == 'olleH'",
    "C | e == 'Hello'",
    "C | string == 'Hello'",
    "C | int == 0",
    "C | unique | list | length == 4",
    "C | sort | join == 'Hello'",
    "C | map('upper') | join == 'HELLO'",
    "C | trim == 'Hello'",
    "C.startswith('H')",
    "C.find('H') == 0",
    "C.strip('H') == 'ello'",
    "C.strip() == 'Hello'",
    "C[0] == 'H'",
    "C[1:] == 'ello'",
    "('%s' % C) == 'Hello'",
    "'{}'.format(C) == 'Hello'",
    "namespace(a=C).a == 'Hello'",
    "[C] | join == 'Hello'",
    "[C] | select('equalto', 'Hello') | list | length == 1",
    "(C | tojson) == '\"Hello\"'",
    "range(C | length) | list | length > 5",
    "messages | map(attribute='content') | join == 'HiHello'",
    "'Hello' in messages | map(attribute='content')",
    "messages | map(attribute='content') | list | string == \"['Hi', 'Hello']\"",
    "messages | tojson | length > 10",
    "messages | selectattr('content', 'equalto', 'Hello') | list | length == 1",
    "messages | groupby('content') | list",
    "(messages | sort(attribute='content') | first).content == 'Hello'",
    "messages | map(attribute='content') | max == 'Hi'",
    "messages | map(attribute='content') | map('length') | sum == 7",
    "(messages[1] | dictsort | first | last) == 'Hello'",
]


@pytest.mark.parametrize("reading", READINGS)
def test_no_reading_of_a_content_goes_unnoticed(reading, tmp_path):
    from packtool.render.marks import _marked, _strip_markers

    condition = reading.replace("C", "message.content")
    source = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{% if message.role == 'assistant' and (" + condition + ") %}NOTE: {% endif %}"
        "{{ message.content }}<|im_end|>\n{% endfor %}"
    )
    template = load_template(template_file(tmp_path, source), {})
    example = chat(("user", "Hi"), ("assistant", "Hello"))
    plain = template.render([m.as_template_dict() for m in example.messages], None)
    marked, spent = template.render_tracked(
        [_marked(m.as_template_dict(), i) for i, m in enumerate(example.messages)], None, mark=True
    )
    assert spent.inspected or _strip_markers(marked)[0] == plain


@pytest.mark.parametrize(
    ("expression", "printed"),
    [
        ("'a' in 'cat'", "True"),
        ("'a' not in 'dog'", "True"),
        ("1 < 2 in [2, 3]", "True"),
        ("1 < 2 not in [2, 3]", "False"),
        ("2 < 1 in raise_exception('evaluated past a false comparison')", "False"),  # a chain stops there
        ("[1] in [[1], [2]] == true", "False"),  # ([1] in [[1], [2]]) and ([[1], [2]] == true)
        ("'a' is in 'cat'", "True"),
    ],
)
def test_comparisons_with_in_keep_their_python_meaning(expression, printed):
    from packtool.sandbox import make_environment

    assert make_environment().from_string("{{ " + expression + " }}").render() == printed


@pytest.mark.parametrize(
    "capture",
    [
        "{% set c %}{{ message.content }}{% endset %}",
        "{% macro m() %}{{ message.content }}{% endmacro %}{% set c = m() %}",
    ],
)
def test_content_captured_by_a_block_or_macro_stays_tracked(capture, tmp_path):
    source = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        + capture
        + "{% if message.role == 'assistant' and c | length > 5 %}NOTE: {% endif %}"
        "{{ message.content }}<|im_end|>\n{% endfor %}"
    )
    template = load_template(template_file(tmp_path, source), {})
    with pytest.raises(RecordError) as caught:
        render_chat(chat(("user", "Hi"), ("assistant", "Hello")), template, TrainPolicy(), routed(template))
    assert caught.value.kind == "mask_check"


def test_a_template_that_only_copies_content_renders_once(monkeypatch):
    _, template = qwen_model()
    calls = count_renders(template, monkeypatch)
    rendered = render_chat(CONVERSATION, template, TrainPolicy(), routed(template))
    assert calls == [1]
    assert rendered.text == template.render([m.as_template_dict() for m in CONVERSATION.messages], None)


@pytest.mark.parametrize("minijinja", [True, False])
def test_a_template_that_inspects_content_renders_twice_and_still_passes(minijinja, monkeypatch):
    if minijinja:
        pytest.importorskip("minijinja")
    else:
        monkeypatch.setenv(JINJA2_ONLY, "1")
    folder = shared("tokenizers", "qwen3")
    tokenizer = load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))
    template = load_template("model", tokenizer.config)  # looks for '</think>' inside each assistant content
    assert (template.fast is not None) is minijinja
    calls = count_renders(template, monkeypatch)
    first = render_chat(CONVERSATION, template, TrainPolicy(), routed(template))
    assert calls == [2]  # the marked and the plain render
    again = render_chat(CONVERSATION, template, TrainPolicy(), routed(template))
    assert calls == [2]  # the same answers to the same questions: the skeleton they taught, no render
    assert first == again
    assert first.text == template.render([m.as_template_dict() for m in CONVERSATION.messages], None)
    assert "11, and here is some code" in first.text
