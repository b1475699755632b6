"""Render an Example with a chat template and track, for every character, whose it is and whether it is trained.

One render, two views. Each message's content (whitespace-trimmed core) is wrapped in a pair of
private-use sentinel characters that carry the message index, the template runs once with the
marked messages, the sentinels are cut out, and their positions become content spans. The
template also runs on the unmarked messages and the two texts must be byte-identical: a template
that rewrites content (strips, splits, reorders it) is caught here instead of yielding a
shifted mask.

    messages  = [user "Hi", assistant "Hello!"]
    marked    = <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
    text      = <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    targets   =                                                      ^^^^^^^^^^^^^^^^   (content + end marker)

An assistant target starts right after the assistant header the template prints for
`add_generation_prompt` (so tool calls and think blocks that follow the header are trained),
and ends after the first end-of-turn marker behind the content. Templates that carry
`{% generation %}` blocks define targets themselves, exactly as transformers'
`return_assistant_tokens_mask` reads them.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from operator import add
from typing import Any, NamedTuple

import jinja2

from packtool.chat_templates import ChatTemplate, special_token_strings
from packtool.config import TrainPolicy
from packtool.errors import RecordError, TemplateRaised
from packtool.records import Example, Message, Rendered, Span, spells_literal
from packtool.sandbox import (
    CONTENT_MARKS,
    GENERATION_CLOSE,
    GENERATION_OPEN,
    MARK_BASE,
    MAX_TEMPLATE_CHARS,
    JsonSlot,
    TemplateLimit,
    _tojson,
    close_mark,
    marked_content,
    open_mark,
)

# Put in front of every special-token literal a record brings (a user typing `<|im_end|>`, a tool
# description spelling `<|im_start|>system`): its rendered position tells encode what to escape and
# tells the mask which end markers are data, not structure.
_LITERAL = chr(0x10FFF2)
_MAX_MESSAGES = (0x10FFF0 - MARK_BASE) // 2
_MARKERS = re.compile("[\U00100000-\U0010ffff]")


def _holds_marker(text: str) -> bool:
    """Whether text holds a plane-16 private-use character (what _MARKERS matches). In UTF-8 exactly
    those code points start with the byte F4, and a byte search is ~17x faster than the regex over a
    Qwen3 reasoning record's JSON (0.9 against 14.5 us); an ASCII text (a flag) holds none."""
    return not text.isascii() and b"\xf4" in text.encode("utf-8", "surrogatepass")


def trained_messages(messages: tuple[Message, ...], policy: TrainPolicy) -> list[bool]:
    """Which messages are targets: the role policy, `last` vs `all` turns, then the per-message override."""
    trained = [m.role in policy.roles and m.role != "tool" for m in messages]
    if not policy.tool_calls:
        trained = [t and not m.tool_calls for t, m in zip(trained, messages)]
    if policy.turns == "last":
        last = max((i for i, t in enumerate(trained) if t), default=None)
        trained = [i == last for i in range(len(messages))]
    return [m.train if m.train is not None and m.role != "tool" else t for t, m in zip(trained, messages)]


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


def render_chat(example: Example, template: ChatTemplate, policy: TrainPolicy) -> Rendered:
    """Render one conversation and derive its target character ranges. Raises RecordError for this sample only."""
    return _render_chat(example, template, policy, learn_slots=True)


def _render_chat(example: Example, template: ChatTemplate, policy: TrainPolicy, *, learn_slots: bool) -> Rendered:
    """render_chat; `learn_slots=False` renders a conversation with slots as one without a shape (its
    slot-marked render taught nothing, or met a limit)."""
    messages = example.messages
    if len(messages) > _MAX_MESSAGES:
        raise RecordError(f"{len(messages)} messages exceed the {_MAX_MESSAGES} packtool can track", kind="bad_record")
    cores = [m.content.strip() for m in messages]
    shape, slots = _shape(example, cores)
    contents_only = shape is not None and slots is None
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

    def plain_render() -> str:
        # minijinja prints jinja2's bytes where it qualifies, and leaves every failure to jinja2's verdict
        plain = [m.as_template_dict() for m in messages]
        text = template.fast.render(plain, tools) if template.fast is not None else None
        return text if text is not None else template.render(plain, tools)

    shape = shape if literals is None else None
    skeleton = template.skeletons.get(shape) if shape is not None else None
    read = template.inspecting_shapes.get(shape) if shape is not None else None  # the shape looks inside contents
    if read is not None:
        skeleton = read.replaying(messages)
    # A shape with slots learns its skeletons from renders that mark them (see _Slots), while jinja2 has
    # tries; otherwise its conversations render as conversations without a shape (nothing is learned
    # from a render that marks contents alone: it prints the slots' words as literals).
    has_tries = read is None or read.tries < MAX_READ_TRIES
    slot_learning = learn_slots and shape is not None and slots is not None and skeleton is None and has_tries
    # with no room left to keep what it would teach, a slot-marked render is only a slower render
    slot_learning = slot_learning and max(len(template.skeletons), len(template.inspecting_shapes)) < MAX_SKELETONS
    if slot_learning and read is None and hash(shape) not in template.slot_shapes_seen:
        # a slot-marked jinja2 render costs several renders by minijinja: only a shape seen before pays it
        if len(template.slot_shapes_seen) < MAX_SHAPES_SEEN:
            template.slot_shapes_seen.add(hash(shape))
        slot_learning = False
    learned_reading = None  # a skeleton this render's questions and answers would give, kept once it checks out
    recipe_key = (tuple(trained), policy.end_of_turn, template.generation_header, template.has_generation_blocks)
    known_json = record.tool_json if record is not None else None
    copy_texts = skeleton.texts(cores, slots, known_json) if skeleton is not None else None
    if copy_texts is not None and skeleton is not None and skeleton.fits(copy_texts):
        recipe = skeleton.recipes.get(recipe_key)
        if recipe is not None:
            return recipe.rendered(example, copy_texts)
        stripped: _Stripped | None = skeleton.fill(copy_texts)
        tools_implied = skeleton.tool_checks_implied
    else:
        tools_implied = False
        stripped = None  # _strip_markers of the marked render: a skeleton's or minijinja's, when they supply it
    if slots is not None and stripped is None and not slot_learning:
        shape = None
    # this render follows a skeleton: a recipe can be learned from it (not yet for a shape with slots,
    # whose tool checks depend on the slots' words: see _check_tools_printed)
    reusable = stripped is not None and slots is None
    marked_text = None
    inspected = False
    plain_text = None
    # minijinja's two renders (marked and plain, compared) cost less than one jinja2 render with its
    # tracking, for a conversation no skeleton can cover (tools, tool calls, reasoning; glaive tool
    # records: Qwen2.5 56 against 88 us, Llama 3.2 95 against 116, Phi-3 23 against 23) and for the
    # conversations of a shape whose questions no skeleton of it answered alike. A skeleton or a
    # recipe is faster still, so the shapes jinja2 can teach one keep it.
    unshaped = shape is None or (read is not None and read.tries >= MAX_READ_TRIES)
    marked: list[dict[str, Any]] | None = None  # the messages as the marked render gets them
    if stripped is None and template.fast is not None and unshaped:
        plain = [m.as_template_dict() for m in messages]
        marked = [_marked(message, i, literals) for i, message in enumerate(plain)]
        size = _template_size(example, record)
        # the tools are the record's own dicts (the marked render's too, unless it marks literals in
        # copies), so what tojson writes of them is known
        known = zip(tools or (), known_json) if known_json is not None else ()
        texts = template.fast.render_pair(marked, _mark_literals(tools, literals), plain, tools, size, known)
        stripped = _strip_markers(texts[0]) if texts is not None else None
        # minijinja supplies only texts jinja2 would accept: anything else, jinja2 renders and judges
        if texts is not None and stripped is not None and stripped[0] == texts[1]:
            marked_text, plain_text = texts
        else:
            stripped = None
    with _template_verdicts(template.name):
        if stripped is None and slot_learning and shape is not None and slots is not None:
            walked = _SlotWalk(len(messages), mark=True).walk(example)  # the slots _shape walked, marked
            assert walked is not None
            _, _, slot_marked, slot_tools = walked
            learned, spent = None, None
            try:
                slot_text, spent = template.render_tracked(
                    slot_marked or [], slot_tools or None, mark=True, prints_from=len(messages) + len(slots.leaves)
                )
            except TemplateLimit:  # this conversation's size: the shape may still learn from another
                return _render_chat(example, template, policy, learn_slots=False)
            except (TemplateRaised, jinja2.TemplateError):
                pass  # the template refused a marked slot (Mistral checks an id's length): learns nothing
            if spent is not None and not spent.escaped and (not spent.inspected or spent.readings is not None):
                readings = tuple(spent.readings or ())
                learned = _Skeleton.of(slot_text, messages, spent.peak, readings, slots, tuple(spent.prints))
            learned_texts = learned.texts(cores, slots, known_json) if learned is not None else None
            if learned is None or spent is None or learned_texts is None:
                # the template looked at a slot, or printed one otherwise than verbatim or through tojson
                _refuse_slots(template, shape)
                return _render_chat(example, template, policy, learn_slots=False)
            stripped = learned.fill(learned_texts)
            inspected = spent.inspected
            if not inspected and len(template.skeletons) < MAX_SKELETONS:
                template.skeletons[shape] = skeleton = learned
            elif inspected:
                if read is None and len(template.inspecting_shapes) < MAX_SKELETONS:
                    read = template.inspecting_shapes[shape] = _ReadSkeletons()
                if read is not None:
                    read.tries += 1
                    learned_reading = learned
        elif stripped is None and marked_text is None:
            if marked is None:  # minijinja's pair, where it rendered, left them for jinja2 to judge
                marked = [_marked(m.as_template_dict(), i, literals) for i, m in enumerate(messages)]
            try:
                marked_text, spent = template.render_tracked(marked, _mark_literals(tools, literals), mark=True)
            except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
                # a verdict reached on marked content stands only if the plain render reaches it too
                plain_render()
                raise RecordError(
                    "the template fails on sentinel-marked content but not on the plain content (it inspects "
                    "the content), so its mask cannot be derived safely",
                    kind="mask_check",
                ) from None
            inspected = spent.inspected
            if shape is not None and not inspected and not spent.escaped and len(template.skeletons) < MAX_SKELETONS:
                learned = _Skeleton.of(marked_text, messages, spent.peak)
                if learned is not None:
                    template.skeletons[shape] = skeleton = learned
                    reusable = True
            elif shape is not None and (inspected or spent.escaped):
                if read is None and len(template.inspecting_shapes) < MAX_SKELETONS:
                    read = template.inspecting_shapes[shape] = _ReadSkeletons()
                if read is not None:
                    read.tries += 1
                    # every look was a question render can ask again, and every copy verbatim
                    if inspected and spent.readings is not None and not spent.escaped:
                        learned_reading = _Skeleton.of(marked_text, messages, spent.peak, tuple(spent.readings))
        clean, contents, generations, literal_at = (
            stripped if stripped is not None else _strip_markers(marked_text or "")
        )
        # One render is enough when the template only copied contents (see Tracked). Literal
        # sentinels sit in untracked strings (tool calls, tools), so those samples render twice.
        text = plain_text if plain_text is not None else plain_render() if inspected or literals is not None else clean
    if clean != text:
        raise RecordError(
            "the template rewrites message content (trims, splits, reorders or branches on it), so its "
            "mask cannot be derived safely",
            kind="mask_check",
        )
    for i, ranges in contents.items():
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
    literal_ranges = tuple(
        (at, found.end()) for at in literal_at if literals and (found := literals.match(text, at)) is not None
    )
    owners = _block_owners(generations, contents, [m.role for m in messages]) if generations else []
    blocks = {}
    for (start, _), mine in reversed(list(zip(generations, owners))):
        blocks.update(dict.fromkeys(mine, start))  # a message's first block
    turns = _Turns(text, messages, contents, template.generation_header, literal_ranges, blocks)
    if not tools_implied:
        _check_tools_printed(example, turns)
    spans = tuple(
        Span(start, end, i, messages[i].role, False) for i, ranges in sorted(contents.items()) for start, end in ranges
    )
    if template.has_generation_blocks:
        targets = _targets_from_generation_blocks(generations, owners, trained)
    else:
        targets = _targets_from_headers(turns, trained, template, policy)
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
    rendered = Rendered(
        example=example,
        text=text,
        spans=spans,
        content_ranges=tuple((s.start, s.end) for s in spans),
        target_ranges=tuple(targets),
        literal_ranges=literal_ranges,
        literal_fields=literal_fields,
    )
    if learned_reading is not None and read is not None:  # the plain render agreed with the marked one
        read.skeletons.append(learned_reading)
        skeleton, reusable = learned_reading, slots is None
    if reusable and skeleton is not None and recipe_key not in skeleton.recipes:
        skeleton.recipes[recipe_key] = _Recipe.of(skeleton, rendered, cores)
    return rendered


def _refuse_slots(template: ChatTemplate, shape: Shape) -> None:
    """A shape whose slot-marked render taught nothing: its conversations render as ones without a
    shape (minijinja, where it qualifies) from now on."""
    read = template.inspecting_shapes.get(shape)
    if read is None and len(template.inspecting_shapes) < MAX_SKELETONS:
        read = template.inspecting_shapes[shape] = _ReadSkeletons()
    if read is not None:
        read.tries = MAX_READ_TRIES


Shape = tuple[Any, ...]


def _shape(example: Example, cores: list[str]) -> tuple[Shape | None, _Slots | None]:
    """All a template sees of a conversation apart from the words of its strings, and those strings.

    A conversation of contents alone: each message's role and the whitespace around its content (a
    content of whitespace only, given whole, reaches the template unmarked), and no slots. One that
    brings more (tools, tool calls, names, ids, reasoning) also has its slots (see _Slots): its shape
    holds the rest (which fields each message has, the keys of each call, the whitespace around each
    string, every number and flag). (None, None) when it brings something no slot holds (a list, a
    tool that is not an object): such a conversation is always rendered.
    """
    shape: list[tuple[str, str, str | None]] = []
    slotted = bool(example.tools)
    for m, core in zip(example.messages, cores):
        if m.tool_calls or m.tool_call_id is not None or m.name is not None or m.reasoning_content is not None:
            slotted = True
        if not core:
            shape.append((m.role, m.content, None))
            continue
        lead = len(m.content) - len(m.content.lstrip())
        shape.append((m.role, m.content[:lead], m.content[lead + len(core) :]))
    if not slotted:
        return tuple(shape), None
    walked = _SlotWalk(len(example.messages), mark=False).walk(example)
    if walked is None:
        return None, None
    extras, slots, _, _ = walked
    return ("slots", tuple(shape), extras), slots


@dataclass(frozen=True, slots=True)
class _Slots:
    """A conversation's strings other than its contents, and the values a template may only write whole.

    `leaves`: the cores of reasoning, names, ids, call names and string arguments, which a render may
    print as they are (the whitespace around each is in the shape). `values`: tool definitions, then
    call arguments given as objects, which a render may only write through tojson (sandbox.JsonSlot).
    A skeleton's render was given each marked, so nothing it decided can have depended on them but
    through the copies it printed; `_SlotWalk` gives them in one order, for the shape and the render.
    """

    leaves: tuple[str, ...]
    values: tuple[dict[str, Any], ...]
    tools: int  # values[:tools] are the tool definitions
    # Each tool call as (its message, the sentinel index of its name's leaf, of its arguments' leaf, the
    # value slot of its arguments), None where the call has none of these (see _tool_checks_implied).
    calls: tuple[tuple[int, int | None, int | None, int | None], ...]


class _SlotWalk:
    """One walk over a conversation's fields for its slots (_Slots), its shape's rest, and with `mark`
    the template dicts of a render that marks them: message `n` + k's sentinels around leaf k, a
    JsonSlot for value k."""

    def __init__(self, messages: int, *, mark: bool) -> None:
        self.first_leaf = messages
        self.mark = mark
        self.leaves: list[str] = []
        self.values: list[dict[str, Any]] = []
        self.calls: list[tuple[int, int | None, int | None, int | None]] = []
        self.call: list[int | None] = [None, None, None]  # the call being walked: see _Slots.calls

    def walk(self, example: Example) -> tuple[Shape, _Slots, list[dict[str, Any]] | None, list[Any] | None] | None:
        """(the shape's rest, the slots, the marked messages, the marked tools); None where a field holds
        something no slot holds."""
        walked_tools = [self.value(tool) for tool in example.tools or ()]
        tools = [tool for tool in walked_tools if tool is not None]
        if len(tools) < len(walked_tools):
            return None
        parts, marked = [], []
        for i, message in enumerate(example.messages):
            extras = (message.tool_call_id, message.name, message.reasoning_content)
            fields: list[Any] = []
            out: dict[str, Any] = {"role": message.role, "content": message.content}
            if self.mark:
                out["content"] = marked_content(message.content, i) or message.content
            if message.tool_calls:
                calls = []
                for call in message.tool_calls:
                    self.call = [None, None, None]
                    walked_call = self.mapping(call, self.call_item)
                    if walked_call is None:
                        return None
                    calls.append(walked_call)
                    name, argument_leaf, argument_value = self.call
                    self.calls.append((i, name, argument_leaf, argument_value))
                fields.append(("tool_calls", tuple(part for part, _ in calls)))
                out["tool_calls"] = [value for _, value in calls]
            for key, text in zip(("tool_call_id", "name", "reasoning_content"), extras):
                if text is not None:
                    part, out[key] = self.leaf(text)
                    fields.append((key, part))
            parts.append(tuple(fields))
            marked.append(out)
        if self.first_leaf + len(self.leaves) >= _MAX_MESSAGES:
            return None  # no sentinel left for them
        slots = _Slots(tuple(self.leaves), tuple(self.values), len(tools), tuple(self.calls))
        rest = (tuple(parts), tuple(part for part, _ in tools))
        return rest, slots, marked if self.mark else None, [value for _, value in tools] if self.mark else None

    def leaf(self, text: str) -> tuple[Shape, Any]:
        core = text.strip()
        if not core:
            return ("=", text), text
        marked = marked_content(text, self.first_leaf + len(self.leaves)) if self.mark else text
        self.leaves.append(core)
        lead = text[: len(text) - len(text.lstrip())]
        return ("s", lead, text[len(lead) + len(core) :]), marked

    def value(self, value: Any) -> tuple[Shape, Any] | None:
        if not isinstance(value, dict) or not value:
            return None
        marked = JsonSlot(value, len(self.values)) if self.mark else value
        self.values.append(value)
        return ("json",), marked

    def mapping(self, value: Any, item: Any) -> tuple[Shape, dict[str, Any]] | None:
        if not isinstance(value, dict):
            return None
        parts, out = [], {}
        for key, field_value in value.items():
            walked = item(key, field_value) if isinstance(key, str) else None
            if walked is None:
                return None
            parts.append((key, walked[0]))
            out[key] = walked[1]
        return tuple(parts), out

    def call_item(self, key: str, value: Any) -> tuple[Shape, Any] | None:
        if key == "function" and isinstance(value, dict):
            return self.mapping(value, self.function_item)
        return self.scalar(value)

    def function_item(self, key: str, value: Any) -> tuple[Shape, Any] | None:
        if key == "arguments" and isinstance(value, dict) and value:
            self.call[2] = len(self.values)
            return self.value(value)
        leaves = len(self.leaves)
        walked = self.scalar(value)
        if key in ("name", "arguments") and len(self.leaves) > leaves:
            self.call[0 if key == "name" else 1] = self.first_leaf + leaves
        return walked

    def scalar(self, value: Any) -> tuple[Shape, Any] | None:
        if isinstance(value, str):
            return self.leaf(value)
        if value is None or isinstance(value, bool | int | float):
            return ("=", type(value).__name__, value), value  # the type too: True == 1
        if isinstance(value, dict) and not value:
            return ("{}",), {}
        return None


# Skeletons kept per template: real data has a few shapes (turn counts, whitespace habits); data
# with many more (every conversation its own) must not grow memory without bound.
MAX_SKELETONS = 4096
# Shapes with slots remembered as seen once (a hash each, ~60 bytes): past this, a new shape is not
# learned from (its conversations render as ones without a shape).
MAX_SHAPES_SEEN = 1 << 16
# How much longer than its content a copy of it can get: tojson writes a character outside the
# Basic Multilingual Plane as two \uXXXX escapes.
_TOJSON_GROWTH = 12


@dataclass(frozen=True, slots=True)
class _Skeleton:
    """A marked render with the content cores cut out, for every conversation of the same _shape.

    The render that made it never inspected a content (see Tracked), so nothing it decided can have
    depended on the words: the template runs the same way on any conversation of that shape, and
    its text is these literals with the other conversation's cores in their place (sentinels
    included), as a render would give it. A shape with slots (_Slots) has their copies too: each
    leaf's core, and each value's JSON where the render wrote one through tojson (JsonSlot). Only
    sizes follow the words: a copy n times longer makes every string the render builds at most n
    times longer (12n through tojson's escapes), so a conversation whose render could reach
    MAX_TEMPLATE_CHARS is rendered and meets the limit there.

        marked render  <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
        literals       '<|im_start|>user\\n'   '<|im_end|>\\n<|im_start|>assistant\\n'   '<|im_end|>\\n'
        copies         (0, 1)
    """

    literals: tuple[str, ...]  # literals[k] comes before the k-th copy, the last after all
    copies: tuple[int, ...]  # the sentinel index of each copy: a message's content, a leaf, a print (see texts)
    lengths: tuple[int, ...]  # per sentinel index, the length of its text in the render that made it
    messages: int  # sentinel indices below this are message contents
    peak: int  # the largest size that render built
    # The yes/no questions that render asked of contents, with its answers (sandbox.READINGS; see
    # replays); empty for a template that never looked inside a content.
    readings: tuple[tuple[int, str, tuple[Any, ...], bool], ...] = ()
    # What tojson printed of each JsonSlot, in order after the leaves: (value, the filter's arguments).
    prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = ()
    sentinels_in_literals: bool = False  # a literal holds a sentinel of its own (a generation block's)
    tool_checks_implied: bool = False  # see _tool_checks_implied

    @classmethod
    def of(
        cls,
        marked: str,
        messages: tuple[Message, ...],
        peak: int,
        readings: tuple[Any, ...] = (),
        slots: _Slots | None = None,
        prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = (),
    ) -> _Skeleton | None:
        """None when the render printed a content or a leaf other than verbatim (a JSON-escaped copy)."""
        cores = [m.content.strip() for m in messages]
        texts = _copy_texts(cores, slots, prints)
        if texts is None:
            return None
        literals: list[str] = []
        copies: list[int] = []
        start, opened = 0, -1
        for match in CONTENT_MARKS.finditer(marked):
            index, is_close = divmod(ord(match.group()) - MARK_BASE, 2)
            if index >= len(texts):
                return None
            if not is_close and opened < 0:
                literals.append(marked[start : match.start()])
                opened = index
            elif is_close and opened == index and marked[start : match.start()] == texts[index]:
                copies.append(index)
                opened = -1
            else:
                return None
            start = match.end()
        if opened >= 0:
            return None
        literals.append(marked[start:])
        marks = any(_MARKERS.search(literal) for literal in literals)
        implied = slots is not None and _tool_checks_implied(copies, len(cores), slots, prints)
        return cls(
            tuple(literals), tuple(copies), tuple(map(len, texts)), len(cores), peak, readings, prints, marks, implied
        )

    # Trained-message pattern and target settings -> the recipe for them (None: this shape has none).
    recipes: dict[tuple[Any, ...], _Recipe | None] = field(default_factory=dict, compare=False, repr=False)

    def replays(self, messages: tuple[Message, ...]) -> bool:
        """Whether both renders of these messages (marked and plain) would ask what this skeleton's render
        asked and get its answers, and so run as it ran.

        A render is a function of what it reads. Before its first question about a content, a render
        of this shape reads what every conversation of the shape shares; given the same answer it goes
        on the same way to the same next question; and it only copies contents otherwise (Tracked
        noticed anything else, and no skeleton was kept). So a marked render given these answers prints
        this skeleton with these contents, and a plain render given them runs the same course and prints
        the same text without the sentinels: one render's text, as a skeleton without questions gives it.

            Qwen3, assistant turn 1:  '</think>' in content -> False   (content "4", and "The sum is 4")
        """
        for index, method, arguments, answer in self.readings:
            content = messages[index].content
            marked = marked_content(content, index)
            ask = getattr(str, method)
            if marked is None or ask(content, *arguments) is not answer or ask(marked, *arguments) is not answer:
                return False
        return True

    def texts(self, cores: list[str], slots: _Slots | None, known_json: tuple[str, ...] | None) -> list[str] | None:
        """The text of each sentinel index for a conversation of this shape: its content cores, its leaves,
        and what tojson prints of its values (`known_json`: its tools' JSON, written already); None when a
        value cannot be written (tojson fails there: the conversation must be rendered)."""
        if len(self.lengths) == self.messages:
            return cores
        return _copy_texts(cores, slots, self.prints, known_json)

    def fits(self, texts: list[str]) -> bool:
        """Whether a render of the conversation with these texts (see texts) stays under MAX_TEMPLATE_CHARS
        (else it must really be rendered)."""
        growth = max([len(text) / n for text, n in zip(texts, self.lengths) if n] + [1.0])
        return self.peak * growth * _TOJSON_GROWTH <= MAX_TEMPLATE_CHARS

    def fill(self, texts: list[str]) -> _Stripped:
        """What _strip_markers gives of the marked render of the conversation with these texts (see texts),
        the render that marks contents alone: its text and where each content is, put together directly
        (a Qwen3 tool record: 14 -> 3 us), or by that function where a literal holds another sentinel
        (a generation block's)."""
        if self.sentinels_in_literals:
            parts = [self.literals[0]]
            for index, literal in zip(self.copies, self.literals[1:]):
                text = texts[index]
                parts += (
                    (open_mark(index), text, close_mark(index), literal) if index < self.messages else (text, literal)
                )
            return _strip_markers("".join(parts))
        parts = [self.literals[0]]
        at = len(self.literals[0])
        contents: dict[int, list[tuple[int, int]]] = {}
        for index, literal in zip(self.copies, self.literals[1:]):
            text = texts[index]
            if index < self.messages:
                contents.setdefault(index, []).append((at, at + len(text)))
            parts += (text, literal)
            at += len(text) + len(literal)
        return "".join(parts), contents, [], []


def _tool_checks_implied(
    copies: list[int], messages: int, slots: _Slots, prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]
) -> bool:
    """Whether _check_tools_printed passes for every conversation of a skeleton's shape, so that a fill
    need not run it (a Qwen3 tool record: 17 us).

    It does when each tool definition is printed whole through tojson outside every content and every
    call's region, and each call's name leaf and its arguments (their leaf, or their JSON) inside its
    region: a JSON text holds every key and string of its value in a form _printed_at looks for, and
    which copies lie in which region depends on the order of the copies alone, which the shape fixes
    (regions are bounded by contents: see _check_tools_printed). A skeleton that prints them some other
    way (or a name in the reasoning only) has every fill checked.
    """
    first_print = messages + len(slots.leaves)
    contents = [(k, index) for k, index in enumerate(copies) if index < messages]

    def region(i: int) -> range:
        upper = next((k for k, message in contents if message > i), len(copies))
        lower = max((k for k, message in contents if message < i and k < upper), default=-1)
        return range(lower + 1, upper)

    def printed_value(slot: int, where: Iterable[int]) -> bool:
        return any(copies[k] >= first_print and prints[copies[k] - first_print][0] == slot for k in where)

    regions = {i: region(i) for i, *_ in slots.calls}
    inside = {k for where in regions.values() for k in where}
    outside = [k for k in range(len(copies)) if copies[k] >= messages and k not in inside]
    if not all(printed_value(tool, outside) for tool in range(slots.tools)):
        return False
    for i, name, argument_leaf, argument_value in slots.calls:
        where = regions[i]
        named = name is not None and any(copies[k] == name for k in where)
        if argument_leaf is not None:
            argued = any(copies[k] == argument_leaf for k in where)
        else:
            argued = argument_value is not None and printed_value(argument_value, where)
        if not (named and argued):
            return False
    return True


def _copy_texts(
    cores: list[str],
    slots: _Slots | None,
    prints: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...],
    known_json: tuple[str, ...] | None = None,
) -> list[str] | None:
    if slots is None:
        return cores if not prints else None
    texts = [*cores, *slots.leaves]
    try:
        for value, arguments in prints:
            if known_json is not None and not arguments and value < len(known_json):
                texts.append(known_json[value])  # a tool's JSON, written for the record's data check
            else:
                texts.append(_tojson(slots.values[value], **dict(arguments)))
    except (TypeError, ValueError, RecursionError):  # what tojson fails on, a render fails on too
        return None
    return texts


# Renders by jinja2 (which notes the questions) of a shape that looks inside its contents, before
# minijinja renders the conversations of that shape that no skeleton learned from them fits: each
# answer pattern (Qwen3: a content holding `</think>` or not) costs one such render, and a template
# whose looks are never questions pays this many jinja2 renders per shape where it paid one.
MAX_READ_TRIES = 8


@dataclass(slots=True)
class _ReadSkeletons:
    """The skeletons of one shape whose template looks inside contents, one per pattern of answers."""

    skeletons: list[_Skeleton] = field(default_factory=list)
    tries: int = 0  # jinja2 renders of the shape so far

    def replaying(self, messages: tuple[Message, ...]) -> _Skeleton | None:
        return next((skeleton for skeleton in self.skeletons if skeleton.replays(messages)), None)


# A place in the rendered text as (literal piece k, characters into it): contents sit between pieces.
_Anchor = tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Recipe:
    """Everything render_chat derives for one _Skeleton and one trained-message pattern, with every
    position anchored in the skeleton's literals, so that a conversation of that shape needs neither
    the sentinel fill and strip nor the target search (alpaca with Qwen2.5, the whole render_chat: 50 ->
    22 us per sample; 13-14 us with the content cores stripped once and the data check of a record
    that brings only contents searching them as they are).

    What render_chat checks on a filled skeleton (each content printed once and verbatim, no tools,
    targets between the same literal markers) depends on the shape and the pattern alone, and was
    checked on the conversation the recipe was learned from; the recipe is kept only when it
    rebuilds that conversation's Rendered exactly.

        pieces   '<|im_start|>user\n'  ⟦0⟧  '<|im_end|>\n<|im_start|>assistant\n'  ⟦1⟧  '<|im_end|>\n'
        target   (1, 33) .. (2, 10), message 1: from the header's end to past <|im_end|>
    """

    pieces: tuple[str, ...]  # the skeleton's literals without sentinels; pieces[k] precedes content copy k
    piece_lengths: tuple[int, ...]
    copies: tuple[int, ...]  # the message each content copy is of
    spans: tuple[tuple[int, int, str], ...]  # (content copy, message, role) in Rendered.spans order
    targets: tuple[tuple[_Anchor, _Anchor, int], ...]

    @classmethod
    def of(cls, skeleton: _Skeleton, rendered: Rendered, texts: list[str]) -> _Recipe | None:
        """The recipe of the Rendered a filled skeleton gave (the skeleton's texts beside it)."""
        pieces = tuple(_MARKERS.sub("", literal) for literal in skeleton.literals)
        lengths = tuple(map(len, pieces))
        starts = _piece_starts(lengths, [texts[i] for i in skeleton.copies])
        copy_at = {start + len(piece): k for k, (start, piece) in enumerate(zip(starts, pieces))}
        ends = list(map(add, starts, lengths))
        anchors = [_anchor(starts, ends, at) for start, end, _ in rendered.target_ranges for at in (start, end)]
        spans = [(copy_at.get(span.start), span.message, span.role) for span in rendered.spans]
        if any(anchor is None for anchor in anchors) or any(k is None for k, _, _ in spans):
            return None
        recipe = cls(
            pieces,
            lengths,
            skeleton.copies,
            tuple((k, message, role) for k, message, role in spans if k is not None),
            tuple(
                (start, end, i)
                for start, end, (_, _, i) in zip(anchors[::2], anchors[1::2], rendered.target_ranges)
                if start is not None and end is not None
            ),
        )
        return recipe if recipe.rendered(rendered.example, texts) == rendered else None

    def rendered(self, example: Example, texts: list[str]) -> Rendered:
        """The Rendered of a conversation of this shape and pattern, with these texts (_Skeleton.texts)."""
        copied = [texts[i] for i in self.copies]
        lengths = self.piece_lengths
        starts = _piece_starts(lengths, copied)
        parts = [self.pieces[0]]
        for core, piece in zip(copied, self.pieces[1:]):
            parts += (core, piece)
        spans = tuple(
            Span(starts[k] + lengths[k], starts[k + 1], message, role, False) for k, message, role in self.spans
        )
        return Rendered(
            example=example,
            text="".join(parts),
            spans=spans,
            content_ranges=tuple((span.start, span.end) for span in spans),
            target_ranges=tuple((starts[ks] + ps, starts[ke] + pe, i) for (ks, ps), (ke, pe), i in self.targets),
        )


def _piece_starts(piece_lengths: tuple[int, ...], copied: list[str]) -> list[int]:
    """Where each literal piece starts in the text, with copied[k] between pieces k and k + 1."""
    return list(accumulate(map(add, piece_lengths, map(len, copied)), initial=0))


def _anchor(starts: list[int], ends: list[int], at: int) -> _Anchor | None:
    """The first piece holding position `at` (its end included); None inside a content. Pieces'
    ends never decrease, so a bisection finds it: a scan per target made a 10,000-turn
    conversation quadratic (7 s)."""
    k = bisect.bisect_left(ends, at)
    return (k, at - starts[k]) if k < len(ends) and starts[k] <= at else None


@contextlib.contextmanager
def _template_verdicts(name: str) -> Iterator[None]:
    """A template's own failure on one sample becomes that sample's RecordError (sentinels cut out
    of the words it quotes); a limit names the template, since a limit is the template's doing."""
    try:
        yield
    except TemplateRaised as exc:
        raise RecordError(f"template refused the sample: {_MARKERS.sub('', str(exc))}", kind="template_error") from None
    except TemplateLimit as exc:
        raise RecordError(f"template {name!r} stopped at a limit: {exc}", kind="template_limit") from None
    except jinja2.TemplateError as exc:
        raise RecordError(f"template failed: {_MARKERS.sub('', str(exc))}", kind="template_error") from None


def _check_tools_printed(example: Example, turns: _Turns) -> None:
    """Every tool definition's name and parameter names, and every tool call's name and argument
    values, must reach the text, as message contents must. Templates re-serialize JSON (key order,
    spacing, quoting), so the pieces are compared, not the JSON.

    A call is looked for between the contents of its neighbours, so the tool definitions or the
    user's words cannot stand in for it; definitions anywhere outside message contents and calls. A
    call's region starts no earlier than its turn's header: a neighbour with an empty content marks
    no place, and the region would reach back over the tool definitions.
    """
    text = turns.text
    spans = sorted((s, e, i) for i, ranges in turns.contents.items() for s, e in ranges)
    regions = {}
    for i, message in enumerate(example.messages):
        if message.tool_calls:
            # neighbours in print order: a template may print an earlier message later (Mistral's system prompt)
            upper = min((s for s, _, k in spans if k > i), default=len(text))
            lower = max((e for _, e, k in spans if k < i and e <= upper), default=0)
            turn = turns.turn_at(i)
            regions[i] = (turn if lower < turn <= upper else lower, upper)
    # Definitions: outside every content and every call's region, so neither stands in for them.
    cuts = sorted([*((s, e) for s, e, _ in spans), *regions.values()])
    kept, at = [], 0
    for start, end in cuts:
        kept.append(text[at:start] if start > at else "")
        at = max(at, end)
    outside = "\0".join([*kept, text[at:]])
    # Templates print the tools in order, so each search starts where the previous name was found
    # (and only then looks from the start): searching all of a 4 MB render for each of 25,000 tools took 60 s.
    hint = 0
    for j, tool in enumerate(example.tools or ()):
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = function.get("name") if isinstance(function, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        pieces = [name, *(properties if isinstance(properties, dict) else ())]
        found = [_printed_at(p, outside, hint) if isinstance(p, str) and p else 0 for p in pieces]
        missing = [p for p, at in zip(pieces, found) if at < 0]
        hint = found[0] if found and found[0] > 0 else hint
        if missing:
            raise RecordError(
                f"the template does not print tool definition {name!r} (tools[{j}]): "
                f"{', '.join(map(repr, missing[:3]))} missing from the render, so the model would be trained "
                "to call a tool it never saw",
                kind="template_dropped_tools",
            )
    for i, message in enumerate(example.messages):
        if not message.tool_calls:
            continue
        region = text[slice(*regions[i])]
        for j, call in enumerate(message.tool_calls):
            function = call.get("function", {})
            pieces = [function.get("name"), *_leaves(function.get("arguments"))]
            missing = [p for p in pieces if p is not None and p != "" and _printed_at(p, region) < 0]
            if missing:
                raise RecordError(
                    f"the template does not print tool call {j} of message {i} ({message.role}): "
                    f"{', '.join(repr(p) for p in missing[:3])} missing from the render",
                    kind="template_dropped_tools",
                )


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _printed_at(value: Any, text: str, hint: int = 0) -> int:
    """Where a value appears in text as a template would print it (raw, JSON escaped or not, or
    Python), looked for from `hint` first; -1 when it does not appear. Whether it appears does not depend
    on which form is tried first, so the form most templates print (the value as it is) goes first, alone:
    the other forms cost two JSON encodings per value (a third of a Qwen3 tool-call render)."""
    at = text.find(str(value), hint, hint + (1 << 16))
    if at >= 0:
        return at
    forms = {str(value), json.dumps(value), json.dumps(value, ensure_ascii=False)}
    if isinstance(value, str):
        forms |= {form[1:-1] for form in forms if form.startswith('"')} | {repr(value)[1:-1]}
    # the 64 KiB after the hint first: a form the template does not use would otherwise be looked for to the end
    for start, end in ((hint, hint + (1 << 16)), (0, len(text))):
        for form in forms:
            at = text.find(form, start, end)
            if at >= 0:
                return at
    return -1


def data_strings(example: Example) -> Iterator[tuple[str, str]]:
    """(field, text) for every string a chat record brings into the render: contents, reasoning,
    names and ids, tool calls (name, argument keys and values) and tool definitions (every key and
    value: names, descriptions, parameter schemas)."""
    for i, message in enumerate(example.messages):
        where = f"messages[{i}]"
        yield f"{where}.content", message.content
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = getattr(message, key)
            if value is not None:
                yield f"{where}.{key}", value
        for j, call in enumerate(message.tool_calls):
            yield from _strings(call, f"{where}.tool_calls[{j}]")
    for j, tool in enumerate(example.tools or ()):
        yield from _strings(tool, f"tools[{j}]")


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, f"{where} key")
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for j, item in enumerate(value):
            yield from _strings(item, f"{where}[{j}]")


class _RecordText(NamedTuple):
    """Every string a chat record brings, in one text to search (see _check_data_strings): the message
    strings as they are, then the tool calls and tools written as JSON; and each tool written as
    tojson writes it, which the minijinja renders reuse (None when a tool holds a value JSON cannot
    write: tojson fails there as it would have)."""

    text: str
    tool_json: tuple[str, ...] | None


def _check_data_strings(
    example: Example, literals: re.Pattern[str] | None, *, contents_only: bool
) -> tuple[tuple[str, ...], _RecordText | None]:
    """Reject private-use marker characters anywhere in the record; name the fields that spell a
    special token. Also the record's text when the check wrote it (for _template_size).

    `contents_only`: the record brings no string but its message contents (it has a _shape); each
    content is then searched as it is, and a content that is ASCII holds no marker (str.isascii
    reads a flag): alpaca with Qwen2.5, 15-18 -> 2-3 us per record.
    """
    if contents_only:
        if not any(
            _holds_marker(m.content) or (literals is not None and spells_literal(literals, m.content))
            for m in example.messages
        ):
            return (), None
        return _spelled_fields(example, literals), None
    # One search over all of the record's strings (most records spell nothing): a search per string,
    # with its field name, was a third of a Qwen3 reasoning sample's render. JSON leaves every
    # character as it is but quotes, backslashes and control characters, which no searched pattern
    # holds (else each string is searched on its own). A literal found across two joined strings only
    # sends the record to that search.
    record = _record_text(example)
    if not _holds_marker(record.text) and (
        literals is None or (_survives_json(literals.pattern) and not spells_literal(literals, record.text))
    ):
        return (), record
    return _spelled_fields(example, literals), record


def _record_text(example: Example) -> _RecordText:
    # The message strings joined as they are: JSON-escaping them was most of the record's JSON (a Qwen3
    # reasoning record: 25 -> 13 us, the rest its tools and calls).
    strings = [s for m in example.messages for s in (m.content, m.reasoning_content, m.name, m.tool_call_id) if s]
    calls = [m.tool_calls for m in example.messages if m.tool_calls]
    try:
        tool_json = tuple(map(_tojson, example.tools or ()))
        nested = f"{json.dumps(calls, ensure_ascii=False)} [{', '.join(tool_json)}]"
    except (TypeError, ValueError):  # a value JSON cannot write (YAML's dates): counted by its str()
        tool_json = None
        nested = json.dumps([calls, example.tools], ensure_ascii=False, default=str)
    return _RecordText("\0".join([*strings, nested]), tool_json)


def _template_size(example: Example, record: _RecordText | None) -> int:
    """The record's size as a template could print it (see MiniTemplate.render_pair): its strings, its
    tool calls and tools as JSON, and 128 characters per message for its keys (all six, quoted), its
    role and the quotes of its strings; twice over for the sentinels of a marked render."""
    text = (_record_text(example) if record is None else record).text
    return 2 * (len(text) + 128 * len(example.messages))


@functools.cache
def _survives_json(pattern: str) -> bool:
    """Whether the literals of a literal_pattern are written by JSON as they are (no quote,
    backslash or control character in them)."""
    return '"' not in pattern and "\\\\" not in pattern and not any(ord(c) < 0x20 for c in pattern)


def _spelled_fields(example: Example, literals: re.Pattern[str] | None) -> tuple[str, ...]:
    spelled = []
    for where, text in data_strings(example):
        if _holds_marker(text):
            raise RecordError("holds plane-16 private-use characters, which packtool reserves as markers", field=where)
        if literals is not None and literals.search(text):
            spelled.append(where)
    return tuple(spelled)


def _mark_literals(value: Any, literals: re.Pattern[str] | None) -> Any:
    """A copy with the literal sentinel in front of every special-token literal inside every string."""
    if literals is None or value is None:
        return value
    if isinstance(value, str):
        return literals.sub(lambda found: _LITERAL + found.group(), value)
    if isinstance(value, dict):
        return {_mark_literals(k, literals): _mark_literals(v, literals) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mark_literals(item, literals) for item in value]
    return value


def _marked(message: dict[str, Any], index: int, literals: re.Pattern[str] | None = None) -> dict[str, Any]:
    """A copy of a message's template dict (Message.as_template_dict) with its content core wrapped in
    sentinels; surrounding whitespace stays outside so templates that trim content still produce the
    same text. Special-token literals in any of its strings get the literal sentinel."""
    out = _mark_literals(message, literals) if literals is not None else dict(message)
    content = marked_content(message["content"], index, lambda core: _mark_literals(core, literals))
    if content is not None:
        out["content"] = content
    return out


# A marked render without its sentinels: the text, each message's content ranges, the generation blocks,
# where data literals start.
_Stripped = tuple[str, dict[int, list[tuple[int, int]]], list[tuple[int, int]], list[int]]


def _strip_markers(marked: str) -> _Stripped:
    """The text without sentinels, each message's content ranges, the generation blocks and where
    data literals start."""
    pieces: list[str] = []
    length = 0
    last = 0
    opened: dict[int, int] = {}
    contents: dict[int, list[tuple[int, int]]] = {}
    generations: list[tuple[int, int]] = []
    literal_at: list[int] = []
    gen_start: int | None = None
    for match in _MARKERS.finditer(marked):
        pieces.append(marked[last : match.start()])
        length += match.start() - last
        last = match.end()
        char = match.group()
        if char == _LITERAL:
            literal_at.append(length)
        elif char == GENERATION_OPEN:
            gen_start = length
        elif char == GENERATION_CLOSE:
            if gen_start is not None:
                generations.append((gen_start, length))
            gen_start = None
        else:
            index, is_close = divmod(ord(char) - MARK_BASE, 2)
            if is_close:
                if index in opened:
                    contents.setdefault(index, []).append((opened.pop(index), length))
            else:
                opened[index] = length
    pieces.append(marked[last:])
    return "".join(pieces), contents, generations, literal_at


def _block_owners(
    generations: list[tuple[int, int]], contents: dict[int, list[tuple[int, int]]], roles: list[str]
) -> list[list[int]]:
    """The messages whose turn each `{% generation %}` block is: those whose content it holds.

    A block without content (an assistant turn that only calls tools) belongs to a content-less
    assistant message between its printed neighbours; without this, such blocks were trained even
    under `turns: last` or `tool_calls: false`. An empty tool result leaves two such turns between
    the same neighbours: the k-th content-less block there is the k-th content-less assistant there,
    when the numbers agree (else the block has no owner and is trained).
    """
    owners: list[list[int]] = []
    gaps: dict[tuple[int, int], list[int]] = {}
    for k, (start, end) in enumerate(generations):
        owners.append([i for i, ranges in contents.items() for s, e in ranges if start <= s and e <= end])
        if not owners[-1]:
            before = max((i for i, r in contents.items() if r[-1][1] <= start), default=-1)
            after = min((i for i, r in contents.items() if r[0][0] >= end), default=len(roles))
            gaps.setdefault((before, after), []).append(k)
    for (before, after), blocks in gaps.items():
        silent = [i for i in range(before + 1, after) if roles[i] == "assistant" and i not in contents]
        if len(silent) == len(blocks):
            for k, i in zip(blocks, silent):
                owners[k] = [i]
    return owners


def _targets_from_generation_blocks(
    generations: list[tuple[int, int]], owners: list[list[int]], trained: list[bool]
) -> list[tuple[int, int, int]]:
    return [
        (start, end, mine[0] if mine else -1)
        for (start, end), mine in zip(generations, owners)
        if not mine or any(trained[i] for i in mine)
    ]


class _Turns:
    """Where each message's turn lies in a render, from the contents around it (an empty or
    whitespace-only content has no range, so it anchors nothing).

    `lower`: the last content end before a place. `header_at`: where an assistant message's generation
    header starts. A message with a content owns the last header before it. One without (a turn that
    only calls tools) has nothing of its own to search back from, and the gap between the contents
    around it can hold several turns: an empty tool result puts the next answer's header in the same
    gap. Each assistant message prints one header, in order, so the k-th assistant of the gap owns
    its k-th header; a gap with another number of headers than assistants (counting the one whose
    content closes it) locates none of its messages.

        user "Hi" | assistant, a call | tool "" | assistant "Done"
        Hi⟧<|im_end|>\\n<|im_start|>assistant\\n<tool_call>...<|im_end|>\\n<|im_start|>user\\n<tool_response>
        \\n\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n⟦Done
        gap (0, 3): headers at message 1's turn and message 3's; message 1 is the gap's first assistant
    """

    def __init__(
        self,
        text: str,
        messages: tuple[Message, ...],
        contents: dict[int, list[tuple[int, int]]],
        header: str | None,
        skip: tuple[tuple[int, int], ...],
        blocks: dict[int, int],
    ) -> None:
        self.text, self.messages, self.contents, self.header, self.skip = text, messages, contents, header, skip
        self.blocks = blocks
        self.ends = sorted(e for ranges in contents.values() for _, e in ranges)
        # which messages have contents, and how many of those before each index are assistants: built on
        # first use, as most renders have no turn without a content
        self.anchored: list[int] = []
        self.assistants: list[int] = []
        self.gaps: dict[tuple[int, int], list[int]] = {}

    def lower(self, i: int, upper: int) -> int:
        """The last content end at or before `upper` that is not message i's own (0 without one)."""
        below = bisect.bisect_right(self.ends, upper)
        own = self.contents.get(i)
        while own and below and self.ends[below - 1] == own[0][1]:
            below -= 1
        return self.ends[below - 1] if below else 0

    def turn_at(self, i: int) -> int:
        """Where message i's turn starts: its first `{% generation %}` block, or for an assistant its
        header; -1 where it cannot be told."""
        if i in self.blocks:
            return self.blocks[i]
        return self.header_at(i) if self.messages[i].role == "assistant" else -1

    def header_at(self, i: int) -> int:
        """Where message i's header starts; -1 where it cannot be told."""
        if self.header is None:
            return -1
        own = self.contents.get(i)
        if own:
            return _rfind_structure(self.text, self.header, self.lower(i, own[0][0]), own[0][0], self.skip)
        if not self.assistants:
            self.anchored = sorted(self.contents)
            self.assistants = list(accumulate((m.role == "assistant" for m in self.messages), initial=0))
        k = bisect.bisect_left(self.anchored, i)
        before = self.anchored[k - 1] if k else -1
        after = self.anchored[k] if k < len(self.anchored) else len(self.messages)
        closing = after < len(self.messages) and self.messages[after].role == "assistant"
        found = self._gap(before, after, self.header)
        if len(found) != self.assistants[after] - self.assistants[before + 1] + closing:
            return -1
        return found[self.assistants[i] - self.assistants[before + 1]]

    def _gap(self, before: int, after: int, header: str) -> list[int]:
        """The headers between message `before`'s last content and message `after`'s first."""
        if (before, after) not in self.gaps:
            lower = self.contents[before][-1][1] if before >= 0 else 0
            upper = self.contents[after][0][0] if after < len(self.messages) else len(self.text)
            found: list[int] = []
            at = self.text.find(header, lower, upper) if lower <= upper else -1
            while at >= 0:
                if not _in_any(at, self.skip):
                    found.append(at)
                at = self.text.find(header, at + 1, upper)
            self.gaps[before, after] = found
        return self.gaps[before, after]


def _targets_from_headers(
    turns: _Turns,
    trained: list[bool],
    template: ChatTemplate,
    policy: TrainPolicy,
) -> list[tuple[int, int, int]]:
    """Targets from the assistant header and the first end-of-turn marker; markers and headers that a
    record spells (turns.skip: literal_ranges) are data, never structure."""
    text, messages, contents, literal_ranges = turns.text, turns.messages, turns.contents, turns.skip
    starts = sorted((s, i) for i, ranges in contents.items() for s, _ in ranges)
    positions = [s for s, _ in starts]
    # Where the first content of a later message starts, for each message (bisect and this keep the
    # search per message logarithmic: scanning every content for every message took 183 s for 30,000)
    later = [len(text)] * (len(messages) + 1)
    first = {}
    for s, j in reversed(starts):
        first[j] = s
    for j in range(len(messages) - 1, -1, -1):
        later[j] = min(later[j + 1], first.get(j + 1, len(text)))
    targets = []
    for i, message in enumerate(messages):
        if not trained[i]:
            continue
        ranges = contents.get(i, [])
        if len(ranges) > 1:
            raise RecordError(
                f"the template prints message {i} ({message.role}) {len(ranges)} times; "
                "cannot tell which copy to train",
                kind="mask_check",
            )
        own = ranges[0] if ranges else None
        upper = own[0] if own else later[i]
        if message.role == "assistant" and template.generation_header:
            header_at = turns.header_at(i)
            start = header_at + len(template.generation_header) if header_at >= 0 else (own[0] if own else -1)
        else:
            start = own[0] if own else -1
            # Without a header, the content's own leading whitespace (kept outside the sentinels)
            # starts the target: BPE glues it to the next word (" Paris"), a token the target would
            # otherwise start inside of (encode counts such a token as straddling).
            lead = message.content[: len(message.content) - len(message.content.lstrip())]
            lower = turns.lower(i, upper)
            if own and lead and own[0] - len(lead) >= lower and text[own[0] - len(lead) : own[0]] == lead:
                start = own[0] - len(lead)
        if start < 0:
            raise RecordError(
                f"cannot locate message {i} ({message.role}) in the rendered text; the template "
                "drops it or prints it without an assistant header",
                kind="mask_check",
            )
        search_from = own[1] if own else start
        after = bisect.bisect_left(positions, search_from)  # the first content from search_from on, not its own
        while after < len(starts) and starts[after][1] == i:
            after += 1
        limit = starts[after][0] if after < len(starts) else len(text)
        end = _end_of_turn(
            text, search_from, limit, template.end_markers, include=policy.end_of_turn, skip=literal_ranges
        )
        if end is None:
            if not policy.end_of_turn and own:
                end = own[1]
            else:
                raise RecordError(
                    f"no end-of-turn marker ({', '.join(template.end_markers[:3])}, ...) after "
                    f"message {i} ({message.role})",
                    kind="mask_check",
                )
        targets.append((start, end, i))
    return targets


def _in_any(at: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return bool(ranges) and any(start <= at < end for start, end in ranges)


def _rfind_structure(text: str, needle: str, lower: int, upper: int, skip: tuple[tuple[int, int], ...]) -> int:
    at = text.rfind(needle, lower, upper)
    while at >= 0 and _in_any(at, skip):
        at = text.rfind(needle, lower, at)
    return at


def _end_of_turn(
    text: str,
    start: int,
    limit: int,
    markers: tuple[str, ...],
    *,
    include: bool,
    skip: tuple[tuple[int, int], ...] = (),
) -> int | None:
    """Where the first end marker in text[start:limit] starts (or ends, with `include`); None without one.
    Of markers starting at one place, the smallest string. Markers starting in a `skip` range are data,
    not structure."""
    pattern = _any_marker(markers)
    found = pattern.search(text, start, limit)
    while found is not None and _in_any(found.start(), skip):
        found = pattern.search(text, found.start() + 1, limit)
    if found is None:
        return None
    return found.end() if include else found.start()


@functools.cache
def _any_marker(markers: tuple[str, ...]) -> re.Pattern[str]:
    """One search for all the markers (a find per marker was ~8 us of a Qwen3 tool-calling render): a
    regex tries its alternatives in order at the leftmost place any matches, so the smallest string
    goes first."""
    return re.compile("|".join(map(re.escape, sorted(set(markers)))) or "(?!)")  # none: a pattern never found


def render_example(
    example: Example,
    template: ChatTemplate | None,
    tokenizer_config: dict[str, Any],
    policy: TrainPolicy,
    *,
    add_bos: bool | None,
    add_eos: bool | None,
) -> Rendered:
    """A chat example through its template, a text example as a document (EOS-terminated unless add_eos is
    False; BOS-led when add_bos is True, or when it is None and the tokenizer starts plain text with BOS)."""
    if example.is_text:
        specials = template.special_tokens if template else special_token_strings(tokenizer_config)
        # Unset add_bos: the BOS `tokenizer(text)` starts with (add_bos_token, which load_tokenizer
        # fills from the post-processor), so documents look as they do to the model's own tokenizer.
        bos = tokenizer_config.get("add_bos_token") is True if add_bos is None else add_bos
        return render_text(example, specials, add_bos=bos, add_eos=add_eos is not False)
    if template is None:
        raise RecordError("no chat template is configured for a chat example", kind="template_error")
    return render_chat(example, template.serving(example.tools), policy)


_ROLE_WORDS = {"system", "user", "assistant", "model", "tool", "ipython", "function", "developer"}


def template_injections(template: ChatTemplate, tokenizer: Any = None) -> list[str]:
    """Text the template puts into every sample whatever the data: a default system prompt, date lines.

    What a conversation without a system message gets before its first user turn, less the user
    header itself (the part every later user turn repeats), split at special tokens and lines:

        [user x, assistant y]  ->  <|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\n x ...
        [.. , user z, ..]       ->                          ... y<|im_end|>\\n<|im_start|>user\\n z ...
        injected                =  ["You are Qwen, ..."]   (role names and special tokens are structure)

    `tokenizer` (a packtool.encode.TextTokenizer, optional) supplies its special tokens when the
    template's list lacks them.
    """
    x, y, z, w = (open_mark(i) for i in range(4))  # characters no template prints on its own
    one = [{"role": "user", "content": x}, {"role": "assistant", "content": y}]
    two = [*one, {"role": "user", "content": z}, {"role": "assistant", "content": w}]
    try:
        first = template.render(one, None)
        second = template.render(two, None)
    except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
        return []
    at_x, at_y, at_z = first.find(x), second.find(y), second.find(z)
    if min(at_x, at_y, at_z) < 0:
        return []
    preamble, user_header = first[:at_x], second[at_y + 1 : at_z]
    common = 0
    while common < min(len(preamble), len(user_header)) and preamble[-1 - common] == user_header[-1 - common]:
        common += 1
    cut = len(preamble) - common
    pattern = getattr(tokenizer, "special_literals", None) or template.literals
    # a suffix shared inside a special token (`<s>[INST]` vs `</s>[INST]`) does not split it
    for literal in pattern.finditer(preamble) if pattern is not None else ():
        if literal.start() < cut < literal.end():
            cut = literal.start()
    before = preamble[:cut]
    pieces = pattern.split(before) if pattern is not None else [before]
    lines = [line.strip() for piece in pieces for line in piece.splitlines()]
    return [line for line in lines if line and line.lower() not in _ROLE_WORDS]
