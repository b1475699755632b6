"""The seam between the reference render and the routes that reach its result sooner.

One `Accelerators` is held by whatever renders many conversations (the encode stages, one per
process and config): what the skeletons and recipes learned of each template, whether minijinja may
render, and how many samples each route produced. None of it is the template's: a ChatTemplate
stays a frozen value, and a render without Accelerators is the reference (packtool.render.reference).

    render: reference            (config)      } every accelerator off: each conversation through
    PACKTOOL_RENDER=reference    (environment) } render_reference; shard bytes are the same either way
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from packtool.chat_templates import ChatTemplate
from packtool.render.skeletons import MAX_SHAPES_SEEN, MAX_SKELETONS, Shape, _ReadSkeletons, _Skeleton

# Set to `reference` to render every conversation with the reference alone, whatever the config says
# (a worker process inherits it).
RENDER_ENV = "PACKTOOL_RENDER"


@dataclass(eq=False)
class Learned:
    """What the accelerators learned of one template from the conversations rendered so far.

    `skeletons`: conversation shape -> its marked render with the contents cut out (_Skeleton).
    `inspecting_shapes`: shapes whose jinja2 render looked inside a content (or escaped one through
    tojson) -> the skeletons learned from renders that only asked yes/no questions of contents, with
    the answers; minijinja renders those of the shape that none of them fits, once jinja2 has had its
    tries. `slot_shapes_seen`: hashes of the shapes with slots seen once: a shape teaches its skeleton
    from its second conversation, so data whose every conversation has a shape of its own pays no
    learning.
    """

    skeletons: dict[Shape, _Skeleton] = field(default_factory=dict)
    inspecting_shapes: dict[Shape, _ReadSkeletons] = field(default_factory=dict)
    slot_shapes_seen: set[int] = field(default_factory=set)

    def has_room(self) -> bool:
        """Skeletons kept per template are bounded (MAX_SKELETONS)."""
        return max(len(self.skeletons), len(self.inspecting_shapes)) < MAX_SKELETONS

    def has_room_for_skeleton(self) -> bool:
        return len(self.skeletons) < MAX_SKELETONS

    def keep(self, shape: Shape, skeleton: _Skeleton) -> bool:
        """Keep the shape's skeleton, where there is room."""
        if not self.has_room_for_skeleton():
            return False
        self.skeletons[shape] = skeleton
        return True

    def reading(self, shape: Shape) -> _ReadSkeletons | None:
        """The shape's entry among the inspecting ones, made where there is room."""
        read = self.inspecting_shapes.get(shape)
        if read is None and len(self.inspecting_shapes) < MAX_SKELETONS:
            read = self.inspecting_shapes[shape] = _ReadSkeletons()
        return read

    def seen_before(self, shape: Shape) -> bool:
        """Whether a shape with slots was met before; remembers it (up to MAX_SHAPES_SEEN) if not."""
        if hash(shape) in self.slot_shapes_seen:
            return True
        if len(self.slot_shapes_seen) < MAX_SHAPES_SEEN:
            self.slot_shapes_seen.add(hash(shape))
        return False


@dataclass(eq=False)
class Accelerators:
    """The accelerated routes' state for one renderer. `on=False` is the switch: every conversation
    through the reference (still counted); `minijinja=False` keeps minijinja out (the template's
    `fast` compile) while skeletons and recipes still learn. `routes` counts the samples each route
    gave: recipe, skeleton, minijinja, slots, jinja2 (see routes.py) or reference."""

    on: bool = True
    minijinja: bool = True
    routes: Counter[str] = field(default_factory=Counter)
    # keyed by the compiled template's identity: a copy that only adds generation_header (the text does
    # not depend on it) shares what the original learned; the template is kept so its id stays its own
    _learned: dict[int, tuple[Any, Learned]] = field(default_factory=dict)

    def of(self, template: ChatTemplate) -> Learned:
        entry = self._learned.get(id(template.compiled))
        if entry is None:
            entry = self._learned[id(template.compiled)] = (template.compiled, Learned())
        return entry[1]


# Every route, fastest first (Accelerators.routes counts samples under these names; see routes.py).
ROUTES = ("recipe", "skeleton", "slots", "minijinja", "jinja2", "reference")


def describe_routes(routes: dict[str, int]) -> str:
    """`recipe 11,790 · skeleton 200 · jinja2 52`: the samples each route produced, fastest route first."""
    return " · ".join(f"{route} {routes[route]:,}" for route in ROUTES if routes.get(route)) or "none"


def render_mode(render: str) -> str:
    """The config's `render`, or `reference` while PACKTOOL_RENDER=reference (read now, not at import)."""
    return "reference" if os.environ.get(RENDER_ENV) == "reference" else render


def accelerators_for(render: str) -> Accelerators:
    """The accelerators a build renders with: all off for `render: reference` or PACKTOOL_RENDER=reference."""
    return Accelerators(on=render_mode(render) != "reference")
