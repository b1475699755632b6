"""Image placeholders expanded on token ids (packtool.vision.layout) against the processor path:
transformers' Qwen2.5-VL processor on the same text and pictures, then the model's get_rope_index."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support import shared

from packtool.errors import RecordError
from packtool.vision.layout import expand_images
from packtool.vision.positions import mrope_positions
from packtool.vision.processors import Grid, ImagePlan, processor_from_config

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.processing_utils import ProcessorMixin  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen-VL chat templates render for one image
QWEN2_5_VL = {"processor_class": "Qwen2_5_VLProcessor", "min_pixels": 3136, "max_pixels": 28 * 28 * 256}


class ImagesOnlyProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without its video processor, which needs torchvision; images go the same way."""

    def __init__(self, image_processor, tokenizer):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer)


def random_conversation(rng: random.Random) -> tuple[str, list]:
    pictures = [Image.new("RGB", (rng.randint(8, 300), rng.randint(8, 300))) for _ in range(rng.randint(0, 3))]
    question = "".join(IMAGE + rng.choice(["What is this?", "\n", "and", ""]) for _ in pictures) + "Compare them."
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nThey differ.<|im_end|>\n"
    return text, pictures


def test_expanded_ids_and_positions_equal_the_processor_path(rope_index):
    folder = shared("tokenizers", "qwen2.5")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = processor_from_config(QWEN2_5_VL, where="qwen2.5-vl")
    reference = ImagesOnlyProcessor(Qwen2VLImageProcessorPil.from_dict(QWEN2_5_VL), tokenizer)
    image_token_id = reference.image_token_id
    rng = random.Random(40)
    images = 0
    for _ in range(40):
        text, pictures = random_conversation(rng)
        rendered = tokenizer(text)["input_ids"]
        layout = expand_images(rendered, image_token_id, [ours.plan(p.height, p.width) for p in pictures])
        expected = reference(
            text=[text], images=pictures or None, return_tensors="np", resample=0, do_rescale=False, do_normalize=False
        )
        np.testing.assert_array_equal(layout.input_ids, expected["input_ids"][0])
        kinds = expected["mm_token_type_ids"][0]
        assert [int(kinds[start:end].sum()) for start, end in layout.spans] == [
            end - start for start, end in layout.spans
        ]
        assert int(kinds.sum()) == sum(end - start for start, end in layout.spans)
        grids = [Grid(*map(int, row)) for row in expected["image_grid_thw"]] if pictures else []
        np.testing.assert_array_equal(
            mrope_positions(layout.segments, ours.merge_size), rope_index("qwen2_5_vl", kinds, grids)
        )
        images += len(pictures)
    assert images > 30


def test_the_worked_example_of_the_docstring():
    layout = expand_images([1, 2, 9, 3, 4, 5], 9, [ImagePlan(n_tokens=4, grid=Grid(1, 4, 4))])
    assert layout.input_ids.tolist() == [1, 2, 9, 9, 9, 9, 3, 4, 5]
    assert layout.spans == ((2, 6),) and layout.segments == (2, Grid(1, 4, 4), 3)


def test_a_placeholder_count_that_differs_is_a_reject():
    with pytest.raises(RecordError, match=r"rendered 2 image placeholder\(s\) for 1 image\(s\)") as caught:
        expand_images([9, 1, 9], 9, [ImagePlan(n_tokens=4, grid=Grid(1, 4, 4))])
    assert caught.value.kind == "image_count_mismatch"
