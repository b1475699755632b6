"""Image placeholders expanded on token ids (packtool.vision.layout) against the processor path:
transformers' Qwen2.5-VL processor on the same text and pictures, then the model's get_rope_index."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support import images_only_processor, shared

from packtool.errors import RecordError
from packtool.records import Tokenized
from packtool.vision.layout import expand_images, expand_tokenized
from packtool.vision.positions import mrope_positions
from packtool.vision.processors import Grid, ImagePlan, processor_from_config

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen-VL chat templates render for one image
QWEN2_5_VL = {"processor_class": "Qwen2_5_VLProcessor", "min_pixels": 3136, "max_pixels": 28 * 28 * 256}


def random_conversation(rng: random.Random) -> tuple[str, list]:
    pictures = [Image.new("RGB", (rng.randint(8, 300), rng.randint(8, 300))) for _ in range(rng.randint(0, 3))]
    question = "".join(IMAGE + rng.choice(["What is this?", "\n", "and", ""]) for _ in pictures) + "Compare them."
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nThey differ.<|im_end|>\n"
    return text, pictures


def test_expanded_ids_and_positions_equal_the_processor_path(rope_index):
    folder = shared("tokenizers", "qwen2.5")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = processor_from_config(QWEN2_5_VL, where="qwen2.5-vl")
    reference = images_only_processor(Qwen2VLImageProcessorPil.from_dict(QWEN2_5_VL), tokenizer)
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


def _document(ids: list[int], targets: list[bool], messages: list[int]) -> Tokenized:
    return Tokenized(
        example_id="x",
        source="s",
        sample_hash="h",
        input_ids=np.asarray(ids, dtype=np.int32),
        targets=np.asarray(targets),
        roles=np.asarray([2 + (m > 0) for m in messages], dtype=np.int8),
        message_index=np.asarray(messages, dtype=np.int16),
    )


def test_an_encoded_document_keeps_its_facts_aligned_and_image_tokens_never_targets():
    """An image inside a trained message (an assistant that shows a picture) is read, never written."""
    document = _document([1, 9, 2, 3, 9, 4], [False, False, False, True, True, True], [0, 0, 0, 1, 1, 1])
    plans = [ImagePlan(n_tokens=3, grid=Grid(1, 2, 6)), ImagePlan(n_tokens=2, grid=Grid(1, 2, 4))]
    expanded, layout = expand_tokenized(document, 9, plans)
    assert expanded.input_ids.dtype == np.int32 and layout.spans == ((1, 4), (6, 8))
    assert expanded.input_ids.tolist() == [1, 9, 9, 9, 2, 3, 9, 9, 4]
    assert expanded.targets.tolist() == [False] * 5 + [True, False, False, True]
    assert expanded.message_index.tolist() == [0] * 5 + [1] * 4
    assert expanded.roles.tolist() == [2] * 5 + [3] * 4
    with pytest.raises(RecordError, match="rendered 2 image placeholder"):
        expand_tokenized(document, 9, plans[:1])


def test_an_encoded_document_equals_the_processor_path():
    """The real Qwen2.5 tokens with the answer as targets: the processor's ids, its image tokens no targets."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared("tokenizers", "qwen2.5"))
    ours = processor_from_config(QWEN2_5_VL, where="qwen2.5-vl")
    reference = images_only_processor(Qwen2VLImageProcessorPil.from_dict(QWEN2_5_VL), tokenizer)
    rng = random.Random(41)
    for _ in range(10):
        text, pictures = random_conversation(rng)
        ids = tokenizer(text)["input_ids"]
        answer = len(tokenizer(text.rsplit("They differ.", 1)[0])["input_ids"])
        targets = [i >= answer for i in range(len(ids))]
        document = _document(ids, targets, [int(i >= answer) for i in range(len(ids))])
        expanded, _ = expand_tokenized(
            document, reference.image_token_id, [ours.plan(p.height, p.width) for p in pictures]
        )
        expected = reference(
            text=[text], images=pictures or None, return_tensors="np", do_rescale=False, do_normalize=False
        )
        np.testing.assert_array_equal(expanded.input_ids, expected["input_ids"][0])
        images = expected["mm_token_type_ids"][0] == 1
        assert not expanded.targets[images].any()
        assert expanded.targets[~images].tolist() == [t for i, t in zip(ids, targets) if i != reference.image_token_id]
