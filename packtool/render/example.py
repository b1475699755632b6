"""One record of either kind to a Rendered: a plain document as itself, a chat through its template."""

from __future__ import annotations

from typing import Any

from packtool.chat_templates import ChatTemplate, special_token_strings
from packtool.config import TrainPolicy
from packtool.errors import RecordError
from packtool.records import Example, Rendered, Span
from packtool.render.accelerators import Accelerators
from packtool.render.routes import render_chat


def render_text(example: Example, special_tokens: dict[str, str], *, add_bos: bool, add_eos: bool) -> Rendered:
    """A plain document: every character is a target, but a prompt's (`context_chars`); BOS/EOS strings
    are structure, not content, and EOS is trained as the document's end."""
    document = example.text or ""
    bos = special_tokens.get("bos_token", "") if add_bos else ""
    eos = special_tokens.get("eos_token", "") if add_eos else ""
    text = f"{bos}{document}{eos}"
    content = (len(bos), len(bos) + len(document))
    if not example.context_chars:
        spans: tuple[Span, ...] = (Span(content[0], content[1], -1, "text", True),)
        return Rendered(example, text, spans, content_ranges=(content,), target_ranges=((0, len(text), -1),))
    answer = content[0] + example.context_chars
    spans = (Span(content[0], answer, -1, "text", False), Span(answer, content[1], -1, "text", True))
    return Rendered(example, text, spans, content_ranges=(content,), target_ranges=((answer, len(text), -1),))


def render_example(
    example: Example,
    template: ChatTemplate | None,
    tokenizer_config: dict[str, Any],
    policy: TrainPolicy,
    *,
    add_bos: bool | None,
    add_eos: bool | None,
    accelerators: Accelerators | None = None,
) -> Rendered:
    """A chat example through its template, a text example as a document (EOS-terminated unless add_eos is
    False; BOS-led when add_bos is True, or when it is None and the tokenizer starts plain text with BOS).
    A chat example goes through the `accelerators` (see render_chat); without them, the reference."""
    if example.is_text:
        specials = template.special_tokens if template else special_token_strings(tokenizer_config)
        # Unset add_bos: the BOS `tokenizer(text)` starts with (add_bos_token, which load_tokenizer
        # fills from the post-processor), so documents look as they do to the model's own tokenizer.
        bos = tokenizer_config.get("add_bos_token") is True if add_bos is None else add_bos
        return render_text(example, specials, add_bos=bos, add_eos=add_eos is not False)
    if template is None:
        raise RecordError("no chat template is configured for a chat example", kind="template_error")
    return render_chat(example, template.serving(example.tools), policy, accelerators)
