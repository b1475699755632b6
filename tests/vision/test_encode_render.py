"""Image parts rendered through the chat template: the template's own placeholder is structure, the text around
it is the message's content in pieces, and the render is transformers' apply_chat_template on the same content
list. Conversations with images take the reference route only."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import shared

from packtool.chat_templates import load_template
from packtool.config import TokenizerConfig, TrainPolicy
from packtool.encode import load_tokenizer
from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.render import render_chat
from packtool.render.accelerators import Accelerators
from packtool.vision.inputs import ImageRef

VL_MODEL = Path(__file__).parent / "qwen2_5_vl"  # a Qwen2.5-VL-style template and processor config
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen():
    folder = shared("tokenizers", "qwen2.5")
    tokenizer = load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))
    return tokenizer, load_template(str(VL_MODEL / "chat_template.jinja"), tokenizer.config)


def pictured(*messages: Message) -> Example:
    count = sum(len(m.image_at) for m in messages)
    return Example("x", "s", "h", messages, images=tuple(ImageRef(f"images[{i}]", data=b"") for i in range(count)))


CONVERSATIONS = [
    (Message("user", "What is it?", image_at=(0,)), Message("assistant", "A cat.")),
    (Message("user", " Compare  these\n", image_at=(9, 9, 16)), Message("assistant", "The first is red.")),
    (
        Message("system", "Look closely."),
        Message("user", "One", image_at=(3,)),
        Message("assistant", "Seen."),
        Message("user", "", image_at=(0, 0)),
        Message("assistant", "Two more."),
    ),
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_render_is_apply_chat_template_on_the_content_parts(qwen, messages):
    transformers = pytest.importorskip("transformers")
    _, template = qwen
    reference = transformers.AutoTokenizer.from_pretrained(shared("tokenizers", "qwen2.5"))
    example = pictured(*messages)
    accelerators = Accelerators()
    rendered = render_chat(example, template, TrainPolicy(), accelerators)
    plain = [m.as_template_dict() for m in messages]
    assert rendered.text == reference.apply_chat_template(plain, chat_template=template.source, tokenize=False)
    assert rendered.text.count(PLACEHOLDER) == len(example.images)
    # the placeholders are the template's: no content range holds one, and each piece of text is its own span
    assert not any(PLACEHOLDER in rendered.text[start:end] for start, end in rendered.content_ranges)
    for i, message in enumerate(messages):
        spans = [rendered.text[s.start : s.end] for s in rendered.spans if s.message == i]
        assert spans == [core for piece in message.pieces() if (core := piece.strip())]
    answers = [rendered.text[start:end] for start, end, _ in rendered.target_ranges]
    assert answers == [f"{m.content}<|im_end|>" for m in messages if m.role == "assistant"]
    assert accelerators.routes == {"reference": 1}  # the accelerated routes decline content lists


def test_a_trained_message_with_images_is_one_target_around_them(qwen):
    _, template = qwen
    example = pictured(Message("user", "Look: and", image_at=(6,)), Message("assistant", "Yes."))
    rendered = render_chat(example, template, TrainPolicy(roles=("user", "assistant")))
    (user, answer) = [rendered.text[start:end] for start, end, _ in rendered.target_ranges]
    assert user == f"Look: {PLACEHOLDER}and<|im_end|>" and answer == "Yes.<|im_end|>"


def test_a_user_typing_the_placeholder_is_data_not_an_image(qwen):
    _, template = qwen
    example = pictured(Message("user", f"Type {PLACEHOLDER} here", image_at=(0,)), Message("assistant", "Ok."))
    rendered = render_chat(example, template, TrainPolicy())
    assert rendered.text.count(PLACEHOLDER) == 2
    typed = rendered.text.index(f"Type {PLACEHOLDER}") + len("Type ")
    # each token the user spelled is a literal inside the content, which special_tokens: escape keeps as text
    assert [rendered.text[start:end] for start, end in rendered.literal_ranges] == [
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
    ]
    assert rendered.literal_ranges[0][0] == typed and rendered.literal_fields == ("messages[0].content",)


def test_a_template_that_rewrites_the_text_around_images_is_refused(qwen, tmp_path):
    tokenizer, _ = qwen
    source = (VL_MODEL / "chat_template.jinja").read_text().replace("{{ part.text }}", "{{ part.text | upper }}")
    (tmp_path / "upper.jinja").write_text(source)
    template = load_template(str(tmp_path / "upper.jinja"), tokenizer.config)
    example = pictured(Message("user", "What is it?", image_at=(0,)), Message("assistant", "A cat."))
    with pytest.raises(RecordError, match="template") as caught:
        render_chat(example, template, TrainPolicy())
    assert caught.value.kind == "mask_check"
