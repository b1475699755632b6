"""Recipes (render.recipes): a conversation of a known shape is put together from its recipe without a render,
and gives what the template renders, for tricky contents and shapes too."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support import (
    PARITY_MODELS,
    chat,
    count_renders,
    learned,
    model_template,
    qwen_model,
    routed,
    shared,
)

from packtool.config import TrainPolicy
from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.render import render_chat


def test_a_conversation_of_a_known_shape_follows_its_recipe():
    """The second conversation of a shape is put together from the recipe (no render, no target
    search), and gives the Rendered a fresh render gives: text, spans and targets."""
    _, template = qwen_model()
    template = replace(template)
    policy = TrainPolicy(roles=("assistant",), end_of_turn=False)
    render_chat(
        chat(("system", " Be brief."), ("user", "Hi"), ("assistant", "Hello")), template, policy, routed(template)
    )
    (skeleton,) = learned(template).skeletons.values()
    (recipe,) = skeleton.recipes.values()
    assert recipe is not None and recipe.copies == (0, 1, 2)
    example = chat(("system", " Be terse."), ("user", "What is 6 x 7?"), ("assistant", "42, as asked."))
    followed = render_chat(example, template, policy, routed(template))
    assert followed == render_chat(example, replace(template), policy, routed(replace(template)))
    start, end, message = followed.target_ranges[0]
    assert (followed.text[start:end], message) == ("42, as asked.", 2)
    assert [followed.text[s.start : s.end] for s in followed.spans] == ["Be terse.", "What is 6 x 7?", "42, as asked."]


def test_a_recipe_is_kept_per_trained_pattern():
    """Two conversations of one shape whose messages train differently (a per-message `train`
    override) get their own recipes and the targets a fresh render gives each."""
    _, template = qwen_model()
    template = replace(template)
    turns = [("user", "Hi"), ("assistant", "Hello"), ("user", "Again?"), ("assistant", "Yes.")]
    both = Example("ex:0", "src", "hash", messages=tuple(Message(r, c) for r, c in turns))
    first_off = Example(
        "ex:1",
        "src",
        "hash",
        messages=tuple(Message(r, c, train=False if i == 1 else None) for i, (r, c) in enumerate(turns)),
    )
    for example in (both, first_off, both, first_off):
        rendered = render_chat(example, template, TrainPolicy(), routed(template))
        assert rendered == render_chat(example, replace(template), TrainPolicy(), routed(replace(template)))
    assert [i for _, _, i in render_chat(first_off, template, TrainPolicy(), routed(template)).target_ranges] == [3]
    (skeleton,) = learned(template).skeletons.values()
    assert len(skeleton.recipes) == 2 and None not in skeleton.recipes.values()


TRICKY_CONTENTS = (
    "{{ messages[0]['content'] }}",
    "{% for m in messages %}{{ m.role }}{% endfor %}",
    "assistant\n",
    "user",
    "im_start|>assistant\n<|im_end",  # the special tokens cut short: plain text
    "[INST] hi [/INST]",  # Mistral's control text (special there, so rendered; plain text elsewhere)
    "line\r\nbreaks\u2028and\ttabs",
    "中文 and 😀 emoji, \ue000 (private use, but not a marker)",
    "x" * 2000,
    "",
    "   ",
    # what Qwen3's template asks of contents: a think block, a lone closing tag, a tool response
    "<think>\nweighing it\n</think>\n\nthe answer",
    "a </think> b",
    '<tool_response>\n{"ok": true}\n</tool_response>',
)


# Shapes beyond user/assistant pairs: a system prompt, a lone turn, repeated roles, a tool result
# without a call id, an empty turn.
TRICKY_SHAPES = (
    ("system", "user", "assistant"),
    ("user",),
    ("assistant",),
    ("system",),
    ("user", "user", "assistant", "assistant"),
    ("user", "assistant", "user"),
    ("user", "assistant", "tool", "assistant"),
    ("system", "user", "assistant", "user", "assistant"),
)


def _twin(content: str) -> str:
    """Another content of the same _shape (the whitespace around the words kept): the conversation
    that teaches a shape its skeleton and recipe."""
    core = content.strip()
    if not core:
        return content
    lead = content[: len(content) - len(content.lstrip())]
    return f"{lead}learned words{content[len(lead) + len(core) :]}"


@pytest.mark.parametrize("model", PARITY_MODELS)
def test_recipes_give_what_the_template_renders_for_tricky_contents_and_shapes(model):
    """Each conversation is rendered after a twin of its shape taught the template its skeleton and
    recipe, and must equal a render with nothing kept (or fail the same way): a recipe that put a
    content, a span or a target anywhere else, or lent its text to a content the template treats
    otherwise, fails here."""
    template = replace(model_template(str(shared("tokenizers", model))))
    followed = 0
    for roles in TRICKY_SHAPES:
        for k in range(len(TRICKY_CONTENTS)):
            # every message gets a tricky content, a different one each
            contents = [TRICKY_CONTENTS[(k + j) % len(TRICKY_CONTENTS)] for j in range(len(roles))]
            example = chat(*zip(roles, contents))
            twin = chat(*zip(roles, map(_twin, contents)))
            outcomes = []
            for fresh in (template, replace(template)):
                for conversation in (twin, example):
                    try:
                        outcomes.append(render_chat(conversation, fresh, TrainPolicy(), routed(fresh)))
                    except RecordError as error:
                        outcomes.append((error.kind, error.reason))
            assert outcomes[1] == outcomes[3], (model, roles, contents)
            followed += any(skeleton.recipes for skeleton in learned(template).skeletons.values())
    if model == "qwen2.5":  # a template that never inspects content: its recipes were followed
        assert followed and all(
            None not in skeleton.recipes.values()
            for skeleton in learned(template).skeletons.values()
            if skeleton.recipes
        )


def test_a_recipe_renders_nothing_and_gives_every_tricky_content_its_own_span(monkeypatch):
    """Qwen2.5: once the shape's recipe is known, a conversation of that shape is put together
    without a template render, and each span holds its own content exactly."""
    _, template = qwen_model()
    template = replace(template)
    roles = ("system", "user", "assistant")
    render_chat(chat(*zip(roles, ("a", "b", "c"))), template, TrainPolicy(), routed(template))
    calls = count_renders(template, monkeypatch)
    for words in filter(None, map(str.strip, TRICKY_CONTENTS)):  # whitespace around words: another shape
        contents = [words, "{{ x }}", words[::-1]]
        rendered = render_chat(chat(*zip(roles, contents)), template, TrainPolicy(), routed(template))
        assert [rendered.text[s.start : s.end] for s in rendered.spans] == contents
        (start, end, message) = rendered.target_ranges[0]
        assert (rendered.text[start:end], message) == (f"{words[::-1]}<|im_end|>", 2)
    assert calls == [0]
