"""mRoPE positions of one document, as Qwen2-VL, Qwen2.5-VL and Qwen3-VL compute them for it alone.

A document is a run of segments: text (a count of tokens) and images (their processor grid).
Text counts on in all three rows; an image's tokens take (temporal, height, width) positions
from where the text stopped, on the grid merged by `merge_size`, and the text after it resumes
at that start plus the image's longer merged side. Every document starts at 0; a text-only
document gets ordinary positions 0..n-1 in every row.

    text 3, image grid (1, 4, 6) with merge 2 (2 x 3 merged = 6 tokens), text 2:

                 t  t  t | i  i  i  i  i  i | t  t
    temporal     0  1  2 | 3  3  3  3  3  3 | 6  7
    height       0  1  2 | 3  3  3  4  4  4 | 6  7
    width        0  1  2 | 3  4  5  3  4  5 | 6  7      (6 = 3 + max(2, 3))

tests/vision/test_positions.py holds this to the models' own `get_rope_index` on random documents.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .processors import Grid


def mrope_positions(segments: Sequence[int | Grid], merge_size: int) -> np.ndarray:
    """Positions (3, n) int64 of one document: rows temporal, height, width; n = its tokens."""
    rows: list[np.ndarray] = []
    start = 0
    previous_was_image = False
    for segment in segments:
        if isinstance(segment, Grid):
            if previous_was_image:
                # the model finds images as runs of image tokens: two runs that touch are one to it
                raise ValueError("two images with no text between them: the model reads them as one image")
            rows.append(_image_positions(segment, merge_size, start))
            start += max(segment.h, segment.w) // merge_size
            previous_was_image = True
        elif segment > 0:
            rows.append(np.broadcast_to(np.arange(start, start + segment, dtype=np.int64), (3, segment)))
            start += segment
            previous_was_image = False
    if not rows:
        return np.zeros((3, 0), dtype=np.int64)
    return np.concatenate(rows, axis=1)


def pack_positions(documents: Sequence[Sequence[int | Grid]], merge_size: int) -> np.ndarray:
    """Positions (3, n) of a pack: each document's own, restarting at 0, one after another."""
    parts = [mrope_positions(document, merge_size) for document in documents]
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)


def _image_positions(grid: Grid, merge_size: int, start: int) -> np.ndarray:
    """One image's (3, t * h/m * w/m) positions: time, then rows, then columns, each offset by `start`."""
    height, width = grid.h // merge_size, grid.w // merge_size
    temporal, rows, columns = np.meshgrid(
        np.arange(grid.t, dtype=np.int64),
        np.arange(height, dtype=np.int64),
        np.arange(width, dtype=np.int64),
        indexing="ij",
    )
    return np.stack([temporal.ravel(), rows.ravel(), columns.ravel()]) + start


def document_positions(
    n_tokens: int, spans: Sequence[tuple[int, int]], grids: Sequence[Sequence[int]], merge_size: int
) -> np.ndarray:
    """The (3, n_tokens) positions of one document whose images take tokens [start, end) of `spans` (in order) with
    these (t, h, w) grids: what a shard's mrope_positions hold, and what `verify` recomputes them from."""
    segments: list[int | Grid] = []
    at = 0
    for (start, end), grid in zip(spans, grids, strict=True):
        segments += [start - at, Grid(*grid)]
        at = end
    segments.append(n_tokens - at)
    positions = mrope_positions(segments, merge_size)
    if positions.shape[1] != n_tokens:
        raise ValueError(f"the images' grids give {positions.shape[1]} positions to a document of {n_tokens} tokens")
    return positions
