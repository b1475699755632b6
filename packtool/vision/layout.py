"""A document's tokens with its images expanded to the processor's count, and what the positions need.

The chat template renders each image once, as the model's image placeholder between its vision
markers; the processor then repeats the placeholder `plan.n_tokens` times. Doing the same on the
token ids gives the processor's ids without tokenizing the repeats:

    rendered   [u, s, P, e, w, x]          P = <|image_pad|>, s/e = <|vision_start|>/<|vision_end|>
    plans      [ImagePlan(n_tokens=4, grid=(1, 4, 4))]
    expanded   [u, s, P, P, P, P, e, w, x]
    spans      [(2, 6)]                    each image's tokens, [start, end)
    segments   [2, Grid(1, 4, 4), 3]       text runs and grids, for positions.mrope_positions

`expand_tokenized` does the same to an encoded document, every per-token fact kept aligned: an
image token takes its placeholder's role and message and is never a target (the model reads an
image, it does not write one).

For the mRoPE families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), whose plans carry a grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import RecordError
from ..records import Tokenized
from .processors import Grid, ImagePlan


@dataclass(frozen=True, slots=True)
class ImageLayout:
    input_ids: np.ndarray  # int64, the images expanded
    spans: tuple[tuple[int, int], ...]
    segments: tuple[int | Grid, ...]


def expand_images(ids: Sequence[int] | np.ndarray, image_token_id: int, plans: Sequence[ImagePlan]) -> ImageLayout:
    """`ids` with each image placeholder repeated to its plan's count; one placeholder per plan, in order."""
    tokens = np.asarray(ids, dtype=np.int64)
    places = np.flatnonzero(tokens == image_token_id)
    if len(places) != len(plans):
        raise RecordError(
            f"the template rendered {len(places)} image placeholder(s) for {len(plans)} image(s)",
            kind="image_count_mismatch",
        )
    pieces: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    segments: list[int | Grid] = []
    start = length = 0
    for place, plan in zip(places, plans):
        if plan.grid is None:
            raise ValueError("expand_images lays out grid-based (mRoPE) images; this plan has no grid")
        pieces += [tokens[start:place], np.full(plan.n_tokens, image_token_id, dtype=np.int64)]
        length += int(place) - start
        spans.append((length, length + plan.n_tokens))
        segments += [int(place) - start, plan.grid]
        length += plan.n_tokens
        start = int(place) + 1
    pieces.append(tokens[start:])
    segments.append(len(tokens) - start)
    return ImageLayout(np.concatenate(pieces), tuple(spans), tuple(segments))


def expand_tokenized(
    document: Tokenized, image_token_id: int, plans: Sequence[ImagePlan]
) -> tuple[Tokenized, ImageLayout]:
    """`document` with its images expanded as `expand_images` expands its ids; targets, roles and messages follow."""
    layout = expand_images(document.input_ids, image_token_id, plans)
    repeats = np.ones(len(document), dtype=np.int64)
    repeats[document.input_ids == image_token_id] = [plan.n_tokens for plan in plans]
    targets = np.repeat(document.targets, repeats)
    for start, end in layout.spans:
        targets[start:end] = False
    expanded = Tokenized(
        example_id=document.example_id,
        source=document.source,
        sample_hash=document.sample_hash,
        input_ids=layout.input_ids.astype(document.input_ids.dtype),
        targets=targets,
        roles=np.repeat(document.roles, repeats),
        message_index=np.repeat(document.message_index, repeats),
        message_roles=document.message_roles,
        structured_messages=document.structured_messages,
        straddled=document.straddled,
    )
    return expanded, layout
