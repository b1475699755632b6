"""The accelerated routes to the reference render's result, and the one entry that picks between them.

A conversation's text comes from the first route that can give it:

    recipe     its shape's skeleton and trained pattern were rendered before: the whole Rendered is
               filled in (recipes.py), no render, no check
    skeleton   its shape's marked render with the contents cut out (skeletons.py) is filled, then checked
    minijinja  minijinja's marked and plain pair, compared (packtool.minijinja_engine), then checked
    slots      a jinja2 render that marks its tools, calls and names too teaches its shape a skeleton
    jinja2     the reference's marked jinja2 render, which teaches a skeleton where the template allowed
    reference  Accelerators off (render: reference, PACKTOOL_RENDER=reference): render_reference alone

Which route a conversation takes depends on what the conversations before it taught (Accelerators),
never its result: every route hands reference.finish the marked text the reference would strip, and
tests/test_parity.py holds each route to the reference's text, spans and targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from packtool.chat_templates import ChatTemplate
from packtool.config import TrainPolicy
from packtool.errors import TemplateRaised
from packtool.minijinja_engine import MiniTemplate
from packtool.records import Example, Message, Rendered
from packtool.render.accelerators import Accelerators, Learned
from packtool.render.marks import _mark_literals, _marked, _strip_markers, _Stripped, _template_size, _template_verdicts
from packtool.render.recipes import _Recipe
from packtool.render.reference import Prepared, finish, marked_content_fails, prepare, render_reference
from packtool.render.skeletons import MAX_READ_TRIES, Shape, _ReadSkeletons, _shape, _Skeleton, _Slots, _SlotWalk
from packtool.template_limits import TemplateLimit


def render_chat(
    example: Example, template: ChatTemplate, policy: TrainPolicy, accelerators: Accelerators | None = None
) -> Rendered:
    """Render one conversation and derive its target character ranges: through the accelerated routes
    where `accelerators` are on, the reference otherwise; a conversation with images takes the reference
    alone (the routes decline content lists). Raises RecordError for this sample only."""
    if accelerators is None or not accelerators.on or example.images:
        rendered = render_reference(example, template, policy)
        if accelerators is not None:
            accelerators.routes["reference"] += 1
        return rendered
    return _render_chat(example, template, policy, accelerators, learn_slots=True)


@dataclass(slots=True)
class _Way:
    """One conversation's way through the routes (mutable: each route fills in what it found): the
    route, the stripped marked render, the texts minijinja's pair gave, whether the template looked
    inside a content, and what the render may teach (a skeleton to keep recipes on, a reading one)."""

    route: str
    skeleton: _Skeleton | None
    read: _ReadSkeletons | None
    stripped: _Stripped | None = None
    marked_text: str | None = None
    plain_text: str | None = None
    marked: list[dict[str, Any]] | None = None  # the messages as the marked render gets them
    inspected: bool = False
    reusable: bool = False
    learned_reading: _Skeleton | None = None  # a skeleton this render's questions and answers would give


def _render_chat(
    example: Example, template: ChatTemplate, policy: TrainPolicy, accelerators: Accelerators, *, learn_slots: bool
) -> Rendered:
    """render_chat through the accelerators; `learn_slots=False` renders a conversation with slots as one
    without a shape (its slot-marked render taught nothing, or met a limit)."""
    learned = accelerators.of(template)
    cores = [m.content.strip() for m in example.messages]
    shape, slots = _shape(example, cores)
    prepared = prepare(example, template, policy, cores, contents_only=shape is not None and slots is None)
    shape = shape if prepared.literals is None else None
    skeleton, read = _known(learned, shape, example.messages)
    recipe_key = (
        tuple(prepared.trained),
        policy.end_of_turn,
        template.generation_header,
        template.has_generation_blocks,
    )
    known_json = prepared.record.tool_json if prepared.record is not None else None
    copy_texts = skeleton.texts(cores, slots, known_json) if skeleton is not None else None
    tools_implied = False
    if copy_texts is not None and skeleton is not None and skeleton.fits(copy_texts):
        recipe = skeleton.recipes.get(recipe_key)
        if recipe is not None:
            accelerators.routes["recipe"] += 1
            return recipe.rendered(example, copy_texts)
        # a recipe can be learned from it (not yet for a shape with slots, whose tool checks depend on
        # the slots' words: see _check_tools_printed)
        way = _Way("skeleton", skeleton, read, skeleton.fill(copy_texts), reusable=slots is None)
        tools_implied = skeleton.tool_checks_implied
    else:
        way = _Way("", skeleton, read)
    slot_learning = learn_slots and _learns_slots(learned, shape, slots, skeleton, read)
    if slots is not None and way.stripped is None and not slot_learning:
        shape = None
    # minijinja's two renders (marked and plain, compared) cost less than one jinja2 render with its
    # tracking, for a conversation no skeleton can cover (tools, tool calls, reasoning; glaive tool
    # records: Qwen2.5 56 against 88 us, Llama 3.2 95 against 116, Phi-3 23 against 23) and for the
    # conversations of a shape whose questions no skeleton of it answered alike. A skeleton or a
    # recipe is faster still, so the shapes jinja2 can teach one keep it.
    unshaped = shape is None or (read is not None and read.tries >= MAX_READ_TRIES)
    if way.stripped is None and accelerators.minijinja and template.fast is not None and unshaped:
        _minijinja_pair(example, template.fast, prepared, known_json, way)
    with _template_verdicts(template.name):
        if way.stripped is None and slot_learning and shape is not None and slots is not None:
            if not _learn_slots(example, template, learned, shape, slots, prepared, known_json, way):
                return _render_chat(example, template, policy, accelerators, learn_slots=False)
        elif way.stripped is None and way.marked_text is None:
            _jinja2_marked(example, template, accelerators, learned, shape, prepared, way)
        stripped = way.stripped if way.stripped is not None else _strip_markers(way.marked_text or "")
        text = (
            way.plain_text
            if way.plain_text is not None
            else _text(example, template, prepared, accelerators, way, stripped)
        )
    rendered = finish(example, template, policy, prepared, stripped, text, tools_implied=tools_implied)
    accelerators.routes[way.route] += 1
    _teach(way, rendered, recipe_key, prepared.cores, slots)
    return rendered


def _known(
    learned: Learned, shape: Shape | None, messages: tuple[Message, ...]
) -> tuple[_Skeleton | None, _ReadSkeletons | None]:
    """The shape's skeleton; for a shape that looks inside contents, the reading skeleton these messages
    answer alike (if any) and the shape's reading skeletons."""
    if shape is None:
        return None, None
    read = learned.inspecting_shapes.get(shape)
    return (read.replaying(messages) if read is not None else learned.skeletons.get(shape)), read


def _teach(way: _Way, rendered: Rendered, recipe_key: tuple[Any, ...], cores: list[str], slots: _Slots | None) -> None:
    """Keep what a checked render taught: its reading skeleton, and the recipe of the skeleton it followed."""
    if way.learned_reading is not None and way.read is not None:  # the plain render agreed with the marked one
        way.read.skeletons.append(way.learned_reading)
        way.skeleton, way.reusable = way.learned_reading, slots is None
    if way.reusable and way.skeleton is not None and recipe_key not in way.skeleton.recipes:
        way.skeleton.recipes[recipe_key] = _Recipe.of(way.skeleton.literals, way.skeleton.copies, rendered, cores)


def _learns_slots(
    learned: Learned, shape: Shape | None, slots: _Slots | None, skeleton: _Skeleton | None, read: _ReadSkeletons | None
) -> bool:
    """Whether this conversation's render marks its slots to teach its shape a skeleton (see _Slots):
    while jinja2 has tries and there is room to keep what it would teach (otherwise it is only a slower
    render). A shape without slots learns from its plain marked render; one that brings something no
    slot holds never learns."""
    if shape is None or slots is None or skeleton is not None:
        return False
    if (read is not None and read.tries >= MAX_READ_TRIES) or not learned.has_room():
        return False
    # a slot-marked jinja2 render costs several renders by minijinja: only a shape seen before pays it
    return read is not None or learned.seen_before(shape)


def _text(
    example: Example,
    template: ChatTemplate,
    prepared: Prepared,
    accelerators: Accelerators,
    way: _Way,
    stripped: _Stripped,
) -> str:
    """The plain text to check the marked render against. One render is enough when the template only
    copied contents (see Tracked). Literal sentinels sit in untracked strings (tool calls, tools), so
    those samples render twice."""
    if way.inspected or prepared.literals is not None:
        return _plain_render(example, template, prepared, accelerators)
    return stripped[0]


def _plain_render(example: Example, template: ChatTemplate, prepared: Prepared, accelerators: Accelerators) -> str:
    # minijinja prints jinja2's bytes where it qualifies, and leaves every failure to jinja2's verdict
    plain = [m.as_template_dict() for m in example.messages]
    fast = template.fast if accelerators.minijinja else None
    text = fast.render(plain, prepared.tools) if fast is not None else None
    return text if text is not None else template.render(plain, prepared.tools)


def _minijinja_pair(
    example: Example, fast: MiniTemplate, prepared: Prepared, known_json: tuple[str, ...] | None, way: _Way
) -> None:
    """minijinja's marked and plain renders, kept where they agree; the marked messages are kept either
    way for jinja2, which renders and judges anything else."""
    tools, literals = prepared.tools, prepared.literals
    plain = [m.as_template_dict() for m in example.messages]
    way.marked = [_marked(message, i, literals) for i, message in enumerate(plain)]
    size = _template_size(example, prepared.record)
    # the tools are the record's own dicts (the marked render's too, unless it marks literals in
    # copies), so what tojson writes of them is known
    known = zip(tools or (), known_json) if known_json is not None else ()
    texts = fast.render_pair(way.marked, _mark_literals(tools, literals), plain, tools, size, known)
    stripped = _strip_markers(texts[0]) if texts is not None else None
    # minijinja supplies only texts jinja2 would accept: anything else, jinja2 renders and judges
    if texts is not None and stripped is not None and stripped[0] == texts[1]:
        way.route, way.stripped, (way.marked_text, way.plain_text) = "minijinja", stripped, texts


def _learn_slots(
    example: Example,
    template: ChatTemplate,
    learned: Learned,
    shape: Shape,
    slots: _Slots,
    prepared: Prepared,
    known_json: tuple[str, ...] | None,
    way: _Way,
) -> bool:
    """The slot-marked jinja2 render: its skeleton, filled, is this conversation's marked render, and is
    kept for the shape. False where it taught nothing: the conversation renders as one without a shape."""
    messages = example.messages
    walked = _SlotWalk(len(messages), mark=True).walk(example)  # the slots _shape walked, marked
    assert walked is not None
    _, _, slot_marked, slot_tools = walked
    skeleton, spent = None, None
    try:
        slot_text, spent = template.render_tracked(
            slot_marked or [], slot_tools or None, mark=True, prints_from=len(messages) + len(slots.leaves)
        )
    except TemplateLimit:  # this conversation's size: the shape may still learn from another
        return False
    except (TemplateRaised, jinja2.TemplateError):
        pass  # the template refused a marked slot (Mistral checks an id's length): learns nothing
    if spent is not None and not spent.escaped and (not spent.inspected or spent.readings is not None):
        readings = tuple(spent.readings or ())
        skeleton = _Skeleton.of(slot_text, messages, spent.peak, readings, slots, tuple(spent.prints))
    texts = skeleton.texts(prepared.cores, slots, known_json) if skeleton is not None else None
    if skeleton is None or spent is None or texts is None:
        # the template looked at a slot, or printed one otherwise than verbatim or through tojson
        _refuse_slots(learned, shape)
        return False
    way.route, way.stripped, way.inspected = "slots", skeleton.fill(texts), spent.inspected
    if not way.inspected:
        way.skeleton = skeleton if learned.keep(shape, skeleton) else way.skeleton
    elif way.inspected:
        way.read = way.read if way.read is not None else learned.reading(shape)
        if way.read is not None:
            way.read.tries += 1
            way.learned_reading = skeleton
    return True


def _jinja2_marked(
    example: Example,
    template: ChatTemplate,
    accelerators: Accelerators,
    learned: Learned,
    shape: Shape | None,
    prepared: Prepared,
    way: _Way,
) -> None:
    """The reference's marked jinja2 render; a shape whose render only copied its contents keeps the
    skeleton it gives, one whose render looked inside them counts a try (and keeps a reading skeleton
    where every look was a question render can ask again, and every copy verbatim)."""
    messages = example.messages
    if way.marked is None:  # minijinja's pair, where it rendered, left them for jinja2 to judge
        way.marked = [_marked(m.as_template_dict(), i, prepared.literals) for i, m in enumerate(messages)]
    try:
        marked_text, spent = template.render_tracked(
            way.marked, _mark_literals(prepared.tools, prepared.literals), mark=True
        )
    except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
        _plain_render(example, template, prepared, accelerators)
        raise marked_content_fails() from None
    way.route, way.marked_text, way.inspected = "jinja2", marked_text, spent.inspected
    if shape is not None and not spent.inspected and not spent.escaped and learned.has_room_for_skeleton():
        skeleton = _Skeleton.of(marked_text, messages, spent.peak)
        if skeleton is not None and learned.keep(shape, skeleton):
            way.skeleton, way.reusable = skeleton, True
    elif shape is not None and (spent.inspected or spent.escaped):
        way.read = way.read if way.read is not None else learned.reading(shape)
        if way.read is not None:
            way.read.tries += 1
            if spent.inspected and spent.readings is not None and not spent.escaped:
                way.learned_reading = _Skeleton.of(marked_text, messages, spent.peak, tuple(spent.readings))


def _refuse_slots(learned: Learned, shape: Shape) -> None:
    """A shape whose slot-marked render taught nothing: its conversations render as ones without a
    shape (minijinja, where it qualifies) from now on."""
    read = learned.reading(shape)
    if read is not None:
        read.tries = MAX_READ_TRIES
