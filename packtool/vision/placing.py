"""A document's images placed: each image's facts read, its plan from the processor, its tokens expanded.

    Example.images --plan_images--> PlannedImage per image (facts from the header, the processor's plan)
                                    or the RecordError of the first image that cannot be used
    Tokenized + plans --place_images--> Tokenized with each placeholder expanded and `images` filled:
                                    PlacedImage(reference, sha256, n_bytes, width, height, grid, start, end, data)

The encode stage (builder.stages) plans a record's images when it renders it and places them once its
text is tokenized. A record whose image is missing, damaged or refused is a reject with that image's
reason (images.REJECT_KINDS, processors.PLAN_REJECT_KINDS), its field naming the image.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import RecordError
from ..records import PlacedImage, Tokenized
from .images import ImageFacts, image_facts, read_image_facts
from .inputs import ImageRef
from .layout import expand_tokenized
from .processors import ImagePlan, ImageProcessor

# The image placeholder token of the families whose images expand_tokenized lays out (a grid per image).
IMAGE_TOKENS = {"qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>"}


@dataclass(frozen=True, slots=True)
class PlannedImage:
    ref: ImageRef
    facts: ImageFacts
    plan: ImagePlan


@dataclass
class ImageReader:
    """The facts of the images one work item's records name: a file is read once however many records name
    it, and again only when its stat (device, inode, size, times) says it changed. A file that is there but
    cannot be used (damaged, too large) keeps its reject the same way; a missing one is looked for each time."""

    _known: dict[tuple, ImageFacts | RecordError] = field(default_factory=dict)

    def facts(self, ref: ImageRef) -> ImageFacts:
        if ref.data is not None:
            return image_facts(ref.data)
        assert ref.path is not None
        try:
            st = os.stat(ref.path)
        except OSError:
            return read_image_facts(ref.path)  # its image_missing reject, with the reason
        key = (str(ref.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        known = self._known.get(key)
        if known is None:
            try:
                known = read_image_facts(ref.path)
            except RecordError as error:
                known = error
            self._known[key] = known
        if isinstance(known, RecordError):
            raise RecordError(known.reason, kind=known.kind)
        return known


def plan_images(
    refs: tuple[ImageRef, ...], reader: ImageReader, processor: ImageProcessor, image_token_id: int | None
) -> tuple[PlannedImage, ...]:
    """Each image's facts and plan, in order; the RecordError (its field naming the image) of the first that
    cannot be used, or of a processor whose images packtool does not lay out in the text."""
    token = IMAGE_TOKENS.get(processor.family)
    if token is None:
        raise RecordError(
            f"{processor.family} images are planned, but their text expansion is not built yet (docs/vision.md)",
            kind="images_not_supported",
        )
    if image_token_id is None:
        raise RecordError(
            f"the tokenizer has no {token} token, which {processor.family} images are", kind="images_not_supported"
        )
    planned = []
    for ref in refs:
        try:
            facts = reader.facts(ref)
            planned.append(PlannedImage(ref, facts, processor.plan(facts.height, facts.width)))
        except RecordError as error:
            error.field = ref.field
            raise
    return tuple(planned)


def place_images(document: Tokenized, planned: tuple[PlannedImage, ...], image_token_id: int, root: Path) -> Tokenized:
    """`document` with each image's placeholder expanded to its tokens and its PlacedImage beside them; a file's
    `reference` is its path relative to `root` (the build config's folder). A document without images must
    hold no image token (a record that spells one under `special_tokens: keep`): an image_count_mismatch."""
    if not planned:
        found = int(np.count_nonzero(document.input_ids == image_token_id))
        if found:
            raise RecordError(
                f"the text holds {found} image token(s) for no image (a record spelling the image placeholder, "
                "with special_tokens: keep)",
                kind="image_count_mismatch",
            )
        return document
    expanded, layout = expand_tokenized(document, image_token_id, [image.plan for image in planned])
    images = tuple(
        PlacedImage(
            reference=reference_of(image.ref, root),
            sha256=image.facts.sha256,
            n_bytes=image.facts.n_bytes,
            width=image.facts.width,
            height=image.facts.height,
            grid=tuple(image.plan.grid or ()),  # type: ignore[arg-type]  # a layout's plans all have grids
            start=start,
            end=end,
            data=image.ref.data,
        )
        for image, (start, end) in zip(planned, layout.spans, strict=True)
    )
    return replace(expanded, images=images)


def reference_of(ref: ImageRef, root: Path) -> str:
    """An image file's path relative to `root`, posix (`..` where it lies outside); "" for bytes a record carried."""
    if ref.path is None:
        return ""
    return Path(os.path.relpath(os.path.abspath(ref.path), os.path.abspath(root))).as_posix()
