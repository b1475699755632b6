"""The reference render: mark, render with jinja2, strip, check, targets. No accelerator, nothing learned.

Every accelerated route (packtool.render.routes) must give this render's text, spans and targets, or
its verdict; the accelerators only find the same marked text sooner and hand it to `finish`.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import jinja2

from packtool.chat_templates import ChatTemplate
from packtool.config import TrainPolicy
from packtool.errors import RecordError, TemplateRaised
from packtool.records import Example, Message, Rendered, Span
from packtool.render.marks import (
    _MAX_MESSAGES,
    _check_data_strings,
    _mark_literals,
    _marked,
    _RecordText,
    _strip_markers,
    _Stripped,
    _template_verdicts,
)
from packtool.render.targets import (
    _block_owners,
    _check_tools_printed,
    _targets_from_generation_blocks,
    _targets_from_headers,
    _Turns,
    trained_messages,
)
from packtool.template_limits import TemplateLimit


class Prepared(NamedTuple):
    """What every route reads of one conversation before it renders: each message's whitespace-trimmed
    content, which messages are trained, the fields that spell a special token (and the pattern, when
    one does), the tools as the template gets them, and the record's text when the check wrote it.
    (A NamedTuple: made once per sample, where a frozen dataclass cost a recipe render ~1 us of ~12.)"""

    cores: list[str]
    trained: list[bool]
    literal_fields: tuple[str, ...]
    literals: re.Pattern[str] | None
    tools: list[Any] | None
    record: _RecordText | None


def prepare(
    example: Example, template: ChatTemplate, policy: TrainPolicy, cores: list[str], *, contents_only: bool = False
) -> Prepared:
    """The checks a conversation passes before any render; `cores`: each message's whitespace-trimmed
    content (`contents_only`: see _check_data_strings)."""
    messages = example.messages
    if len(messages) > _MAX_MESSAGES:
        raise RecordError(f"{len(messages)} messages exceed the {_MAX_MESSAGES} packtool can track", kind="bad_record")
    literal_fields, record = _check_data_strings(example, template.literals, contents_only=contents_only)
    trained = trained_messages(messages, policy)
    for i, message in enumerate(messages):
        if trained[i] and not cores[i] and not message.tool_calls:
            # Nothing but an end marker to learn; templates without an assistant header (and any
            # trained user turn) could not even place it. A data defect (seen in real alpaca sets),
            # not a turn to train.
            raise RecordError(f"message {i} ({message.role}) is empty: nothing to train", kind="bad_record")
    literals = template.literals if literal_fields else None
    tools = list(example.tools) if example.tools else None
    return Prepared(cores, trained, literal_fields, literals, tools, record)


def render_reference(example: Example, template: ChatTemplate, policy: TrainPolicy) -> Rendered:
    """Render one conversation with jinja2 alone and derive its target character ranges."""
    prepared = prepare(example, template, policy, [m.content.strip() for m in example.messages])
    plain = [m.as_template_dict() for m in example.messages]
    marked = [_marked(message, i, prepared.literals) for i, message in enumerate(plain)]
    with _template_verdicts(template.name):
        try:
            marked_text, spent = template.render_tracked(
                marked, _mark_literals(prepared.tools, prepared.literals), mark=True
            )
        except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
            template.render(plain, prepared.tools)
            raise marked_content_fails() from None
        stripped = _strip_markers(marked_text)
        # One render is enough when the template only copied contents (see Tracked). Literal
        # sentinels sit in untracked strings (tool calls, tools), so those samples render twice.
        # A conversation with images (content parts) is compared with its plain render always: the reference
        # route is theirs alone, and a content list is what a template may branch on.
        inspected = spent.inspected or prepared.literals is not None or bool(example.images)
        text = template.render(plain, prepared.tools) if inspected else stripped[0]
    return finish(example, template, policy, prepared, stripped, text, tools_implied=False)


def _check_pieces_printed(text: str, ranges: list[tuple[int, int]], message: Message, i: int) -> None:
    """A message with images must print each piece of its text between them once, in order, as given."""
    expected = [core for piece in message.pieces() if (core := piece.strip())]
    if [text[start:end] for start, end in ranges] != expected:
        raise RecordError(
            f"the template does not print the text of message {i} ({message.role}) around its images once each, "
            "in order, as given, so its targets would not be the data's words",
            kind="mask_check",
        )


def marked_content_fails() -> RecordError:
    """A verdict reached on marked content stands only if the plain render reaches it too: raise this
    after the plain render passed."""
    return RecordError(
        "the template fails on sentinel-marked content but not on the plain content (it inspects "
        "the content), so its mask cannot be derived safely",
        kind="mask_check",
    )


def finish(
    example: Example,
    template: ChatTemplate,
    policy: TrainPolicy,
    prepared: Prepared,
    stripped: _Stripped,
    text: str,
    *,
    tools_implied: bool,
) -> Rendered:
    """The checks of a marked render (`stripped`) against the plain text, then spans and targets.
    `tools_implied`: the skeleton this render follows passes _check_tools_printed for every
    conversation of its shape."""
    messages = example.messages
    clean, contents, generations, literal_at = stripped
    if clean != text:
        raise RecordError(
            "the template rewrites message content (trims, splits, reorders or branches on it), so its "
            "mask cannot be derived safely",
            kind="mask_check",
        )
    for i, ranges in contents.items():
        if messages[i].image_at:
            _check_pieces_printed(text, ranges, messages[i], i)
            continue
        expected = messages[i].content.strip()
        printed = {text[start:end] for start, end in ranges}
        # A JSON-quoted copy is the same words: Llama 3.x prints tool results through `tojson`.
        if printed != {expected} and not printed <= {expected, json.dumps(expected, ensure_ascii=False)[1:-1]}:
            raise RecordError(
                f"the template changes the content of message {i} ({messages[i].role}) while "
                "printing it, so its targets would not be the data's words",
                kind="mask_check",
            )
    # A message whose content never reaches the text would be lost without a trace (Mistral-Nemo's
    # template prints the system prompt only when the conversation ends with a user turn; Phi-3's
    # drops tool results): reject the sample and name the message instead.
    for i, message in enumerate(messages):
        if message.content.strip() and i not in contents:
            raise RecordError(
                f"the template does not print the content of message {i} ({message.role}) as given "
                "(it drops or rewrites it), so training on this render would silently lose it",
                kind="template_error",
            )
    literals = prepared.literals
    literal_ranges = tuple(
        (at, found.end()) for at in literal_at if literals and (found := literals.match(text, at)) is not None
    )
    # A message with images is printed in pieces around them; its turn spans its first piece to its last.
    if example.images:
        contents = {i: [(r[0][0], r[-1][1])] if messages[i].image_at else r for i, r in contents.items()}
    owners = _block_owners(generations, contents, [m.role for m in messages]) if generations else []
    blocks = {}
    for (start, _), mine in reversed(list(zip(generations, owners))):
        blocks.update(dict.fromkeys(mine, start))  # a message's first block
    turns = _Turns(text, messages, contents, template.generation_header, literal_ranges, blocks)
    if not tools_implied:
        _check_tools_printed(example, turns)
    spans = tuple(
        Span(start, end, i, messages[i].role, False)
        for i, ranges in sorted(stripped[1].items())
        for start, end in ranges
    )
    if template.has_generation_blocks:
        targets = _targets_from_generation_blocks(generations, owners, prepared.trained)
    else:
        targets = _targets_from_headers(turns, prepared.trained, template, policy)
    # Tool calls carry no sentinel, so a template that ignores them (Gemma 3, Phi-3) would train an
    # empty turn: each called function's name must appear inside its message's target.
    for start, end, i in targets:
        calls = messages[i].tool_calls if i >= 0 else ()
        if any(str(call.get("function", {}).get("name", "")) not in text[start:end] for call in calls):
            raise RecordError(
                f"the template does not print the tool calls of message {i} ({messages[i].role}), "
                "so its target would be an empty turn",
                kind="template_error",
            )
    return Rendered(
        example=example,
        text=text,
        spans=spans,
        content_ranges=tuple((s.start, s.end) for s in spans),
        target_ranges=tuple(targets),
        literal_ranges=literal_ranges,
        literal_fields=prepared.literal_fields,
    )
