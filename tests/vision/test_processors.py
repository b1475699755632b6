"""Grids and token counts from image sizes (packtool.vision.processors) against transformers' own
image processors (the PIL ones, which need no torchvision) on 1,000 generated images."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packtool.errors import ConfigError, RecordError
from packtool.vision.processors import (
    Gemma3Processor,
    Grid,
    Idefics3Processor,
    QwenVLProcessor,
    load_processor,
    processor_from_config,
    smart_resize,
)

pytest.importorskip("PIL.Image")
qwen_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
gemma_module = pytest.importorskip("transformers.models.gemma3.image_processing_pil_gemma3")
idefics3_module = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")
smolvlm_module = pytest.importorskip("transformers.models.smolvlm.image_processing_pil_smolvlm")

# The image settings of the released models' preprocessor_config.json files.
QWEN2_VL = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
QWEN2_5_VL = {**QWEN2_VL, "processor_class": "Qwen2_5_VLProcessor"}
QWEN3_VL = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
# Small images cross both bounds of this one: the shrinking branch of the resize, with no large file.
QWEN_TIGHT = {**QWEN2_VL, "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 8}
GEMMA3 = {
    "image_processor_type": "Gemma3ImageProcessor",
    "processor_class": "Gemma3Processor",
    "size": {"height": 896, "width": 896},
    "do_pan_and_scan": None,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


# Nearest-neighbour resizing and no rescaling or normalizing: what the grid depends on runs, in a third of the time.
CHEAP = {"resample": 0, "do_rescale": False, "do_normalize": False}


def reference_grid(reference, picture) -> Grid | None:
    """transformers' image_grid_thw for one picture, or None when it refuses the picture.

    Resampling, rescaling and normalizing change pixel values, never the grid: the cheapest are used."""
    try:
        grid = reference(picture, **CHEAP, return_tensors="np")["image_grid_thw"]
    except ValueError as error:
        assert "aspect ratio" in str(error)
        return None
    return Grid(*(int(side) for side in grid[0]))


@pytest.mark.parametrize(
    ("config", "family"),
    [(QWEN2_VL, "qwen2_vl"), (QWEN3_VL, "qwen3_vl"), (QWEN_TIGHT, "qwen2_vl")],
    ids=["qwen2_vl", "qwen3_vl", "tight"],
)
def test_qwen_grids_and_tokens_equal_the_processor(pictures, config, family):
    ours = processor_from_config(config, where="preprocessor_config.json")
    assert isinstance(ours, QwenVLProcessor) and ours.family == family
    reference = qwen_module.Qwen2VLImageProcessorPil.from_dict(config)
    refused = 0
    for picture in pictures:
        expected = reference_grid(reference, picture)
        if expected is None:
            with pytest.raises(RecordError, match="aspect ratio over 200") as caught:
                ours.plan(picture.height, picture.width)
            assert caught.value.kind == "image_aspect"
            refused += 1
            continue
        plan = ours.plan(picture.height, picture.width)
        assert plan.grid == expected, picture.size
        # the processor expands <|image_pad|> to grid.prod() // merge_size**2 tokens
        assert plan.n_tokens == int(np.prod(expected)) // reference.merge_size**2
    assert 0 < refused < len(pictures) // 20


def test_qwen2_5_vl_reads_as_qwen2_vl_with_its_own_family(pictures):
    """Qwen2.5-VL ships Qwen2-VL's image processor with the same settings; only the family differs."""
    qwen2 = processor_from_config(QWEN2_VL, where="q2")
    qwen2_5 = processor_from_config(QWEN2_5_VL, where="q2.5")
    assert isinstance(qwen2_5, QwenVLProcessor) and qwen2_5.family == "qwen2_5_vl"
    reference = qwen_module.Qwen2VLImageProcessorPil.from_dict(QWEN2_5_VL)
    for picture in pictures[:100]:
        expected = reference_grid(reference, picture)
        if expected is not None:
            assert qwen2_5.plan(picture.height, picture.width) == qwen2.plan(picture.height, picture.width)
            assert qwen2_5.plan(picture.height, picture.width).grid == expected


def test_the_worked_examples_of_the_docstrings():
    plan = processor_from_config(QWEN2_VL, where="q2").plan(600, 1000)
    assert smart_resize(600, 1000, 28, 3136, 12845056) == (588, 1008)
    assert (plan.grid, plan.n_tokens) == (Grid(1, 42, 72), 756)
    tiled = processor_from_config(IDEFICS3, where="idefics3").plan(600, 1000)
    assert (tiled.tiles, tiled.n_tokens) == ((3, 4), 13 * 169)


@pytest.mark.parametrize("min_crop_size", [256, 8])
def test_gemma3_tokens_and_pan_and_scan_crops_equal_the_processor(pictures, min_crop_size):
    config = {**GEMMA3, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": min_crop_size}
    ours = processor_from_config(config, {"image_seq_length": 256}, where="gemma")
    assert isinstance(ours, Gemma3Processor)
    # the output size decides no count: a small one keeps the reference fast
    reference = gemma_module.Gemma3ImageProcessorPil.from_dict({**config, "size": {"height": 14, "width": 14}})
    crops_seen = set()
    for picture in pictures:
        plan = ours.plan(picture.height, picture.width)
        (expected,) = reference(picture, **CHEAP, return_tensors="np")["num_crops"]
        assert plan.crops == expected, picture.size
        assert plan.n_tokens == 256 * (1 + plan.crops)  # Gemma3Processor: one image sequence per crop and the image
        crops_seen.add(plan.crops)
    assert len(crops_seen) >= (2 if min_crop_size == 256 else 3)


def test_gemma3_without_pan_and_scan_is_one_fixed_image():
    ours = processor_from_config(GEMMA3, {"image_seq_length": 256}, where="gemma")
    assert ours.plan(50, 4000).n_tokens == 256 and ours.plan(50, 4000).crops == 0


IDEFICS3 = {
    "image_processor_type": "Idefics3ImageProcessor",
    "processor_class": "Idefics3Processor",
    "size": {"longest_edge": 1456},
    "max_image_size": {"longest_edge": 364},
    "do_image_splitting": True,
}
# The same arithmetic on small sides: every picture crosses a tile, for the price of small resizes.
IDEFICS3_SMALL = {**IDEFICS3, "size": {"longest_edge": 4 * 24}, "max_image_size": {"longest_edge": 24}}
SMOLVLM_SMALL = {
    **IDEFICS3_SMALL,
    "image_processor_type": "SmolVLMImageProcessor",
    "processor_class": "SmolVLMProcessor",
}


@pytest.mark.parametrize(
    ("config", "count", "module"),
    [
        (IDEFICS3_SMALL, 1000, "idefics3"),
        (SMOLVLM_SMALL, 1000, "smolvlm"),
        (IDEFICS3, 100, "idefics3"),
        ({**IDEFICS3_SMALL, "do_resize": False}, 300, "idefics3"),
    ],
    ids=["idefics3", "smolvlm", "idefics3_released", "no_resize"],
)
def test_idefics3_and_smolvlm_tiles_equal_the_processor(pictures, config, count, module):
    ours = processor_from_config(config, {"image_seq_len": 64}, where="tiled")
    assert isinstance(ours, Idefics3Processor) and ours.family == module
    classes = {
        "idefics3": idefics3_module.Idefics3ImageProcessorPil,
        "smolvlm": smolvlm_module.SmolVLMImageProcessorPil,
    }
    reference = classes[module].from_dict(config)
    shapes = set()
    for picture in pictures[:count]:
        found = reference(picture, **CHEAP, do_pad=False, return_row_col_info=True, return_tensors=None)
        expected = (found["rows"][0][0], found["cols"][0][0])
        plan = ours.plan(picture.height, picture.width)
        assert plan.tiles == expected, picture.size
        # Idefics3Processor: image_seq_len <image> tokens for each tile and for the global image
        assert plan.n_tokens == 64 * (expected[0] * expected[1] + 1)
        shapes.add(expected)
    assert len(shapes) >= 3


def test_a_model_folder_is_read(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(GEMMA3))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 64}))
    processor = load_processor(tmp_path)
    assert isinstance(processor, Gemma3Processor) and processor.image_seq_length == 64


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"image_processor_type": "SiglipImageProcessor"}, "'SiglipImageProcessor' is not supported yet"),
        ({**QWEN2_VL, "patch_size": 0}, "patch_size must be a positive integer, got 0"),
        ({**QWEN2_VL, "merge_size": "2"}, "merge_size must be a positive integer"),
        ({**QWEN3_VL, "size": {"max_pixels": 100}}, "size needs shortest_edge and longest_edge"),
        ({**QWEN2_VL, "do_resize": False}, "do_resize false is not supported"),
        ({**GEMMA3, "pan_and_scan_min_ratio_to_activate": "x"}, "must be a positive number"),
        ({**IDEFICS3, "size": {"height": 10, "width": 10}}, "size needs longest_edge"),
    ],
)
def test_bad_configs_are_one_line_naming_the_file(config, message):
    with pytest.raises(ConfigError, match="^model/preprocessor_config.json: .*" + message.replace("(", r"\(")):
        processor_from_config(config, where="model/preprocessor_config.json")


def test_unreadable_model_folders(tmp_path):
    with pytest.raises(ConfigError, match=r"preprocessor_config\.json: cannot be read"):
        load_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_processor(tmp_path)
