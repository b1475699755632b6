"""mRoPE positions (packtool.vision.positions) against the models' own get_rope_index, document by document."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from packtool.vision.positions import mrope_positions, pack_positions
from packtool.vision.processors import Grid, QwenVLProcessor

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def model_positions(rope_index, family: str, segments: list, merge_size: int) -> np.ndarray:
    """The model's positions for a document given as segments: its token types and grids."""
    kinds: list[int] = []
    for segment in segments:
        kinds += (
            [1] * (segment.t * segment.h * segment.w // merge_size**2) if isinstance(segment, Grid) else [0] * segment
        )
    return rope_index(family, kinds, [segment for segment in segments if isinstance(segment, Grid)], merge_size)


def random_document(rng: random.Random, processor: QwenVLProcessor) -> list:
    """Text runs and images (never two images touching: the templates put text between them)."""
    segments: list = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.5 and (not segments or not isinstance(segments[-1], Grid)):
            height, width = rng.randint(1, 400), rng.randint(1, 400)
            if max(height, width) / min(height, width) <= 200:
                segments.append(processor.plan(height, width).grid)
        else:
            segments.append(rng.randint(1, 30))
    return segments or [rng.randint(1, 5)]


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_equal_the_models_get_rope_index(rope_index, family):
    rng = random.Random(family)
    patch = 16 if family == "qwen3_vl" else 14
    processor = QwenVLProcessor(family, patch_size=patch, min_pixels=4 * patch * patch, max_pixels=1024 * patch * patch)
    images = 0
    for _ in range(150):
        document = random_document(rng, processor)
        images += sum(isinstance(segment, Grid) for segment in document)
        expected = model_positions(rope_index, family, document, processor.merge_size)
        np.testing.assert_array_equal(mrope_positions(document, processor.merge_size), expected, err_msg=str(document))
    assert images > 100


def test_the_worked_example_of_the_docstring():
    positions = mrope_positions([3, Grid(1, 4, 6), 2], merge_size=2)
    assert positions.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]


def test_a_pack_restarts_in_every_document_and_text_alone_counts_on(rope_index):
    documents = [[3, Grid(1, 4, 6), 2], [5], [1, Grid(1, 2, 2), 1]]
    positions = pack_positions(documents, merge_size=2)
    assert positions.shape == (3, 11 + 5 + 3)
    assert positions[:, 11:16].tolist() == [[0, 1, 2, 3, 4]] * 3  # text only: ordinary positions in every row
    assert positions[:, 16:].tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    for start, document in ((0, documents[0]), (16, documents[2])):
        alone = model_positions(rope_index, "qwen2_vl", document, 2)
        np.testing.assert_array_equal(positions[:, start : start + alone.shape[1]], alone)


def test_touching_images_are_refused():
    with pytest.raises(ValueError, match="two images with no text between them"):
        mrope_positions([1, Grid(1, 2, 2), Grid(1, 2, 2)], merge_size=2)
    assert mrope_positions([], merge_size=2).shape == (3, 0)


def test_the_documented_example_runs():
    text = (Path(__file__).resolve().parents[2] / "docs" / "vision.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(block, "docs/vision.md", "exec"), {})
