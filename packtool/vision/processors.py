"""How many tokens each image becomes, computed from its size alone, exactly as the model's processor does.

A processor is read from the model folder's `preprocessor_config.json` (and `processor_config.json`
for the text side), then asked one question per image, `plan(height, width)`:

    Qwen2-VL / Qwen2.5-VL / Qwen3-VL (patch 14 or 16, merge 2): resize within [min_pixels, max_pixels]
    to sides divisible by patch * merge, then one patch grid of (t=1, h, w) and h * w / merge**2 tokens.

        1000 x 600 photo, Qwen2-VL defaults  ->  resized 1008 x 588  ->  grid (1, 42, 72), 756 tokens
        (height 600 -> 588 = 21 * 28, width 1000 -> 1008 = 36 * 28; 42 * 72 / 4 = 756)

    Gemma-3 (fixed 896 x 896): image_seq_length tokens (256) for the image, and as many again for
    each pan-and-scan crop when `do_pan_and_scan` is on.

    Idefics3 / SmolVLM: the longest side resized, then tiles of a fixed square beside one global
    image, image_seq_len tokens each.

Heights and widths are the picture as the processor receives it: after the EXIF orientation
(`images.ImageFacts`). tests/vision/test_processors.py holds every number to transformers' own
image processors on generated images.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ..errors import ConfigError, RecordError

# The files a model folder's image processor is read from; both enter the encode key by content.
PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_FILES = (PREPROCESSOR_CONFIG, "processor_config.json")
# rejects.jsonl reason for an image the processor itself refuses
PLAN_REJECT_KINDS = ("image_aspect",)


class Grid(NamedTuple):
    """The processor's `image_grid_thw` for one image: patches along time, height and width."""

    t: int
    h: int
    w: int


@dataclass(frozen=True, slots=True)
class ImagePlan:
    """What one image becomes: its tokens in the text, and the numbers the model reads beside them."""

    n_tokens: int  # image placeholder tokens the processor's text expansion holds for this image
    grid: Grid | None = None  # mRoPE families: image_grid_thw, in patches
    crops: int = 0  # Gemma-3 pan and scan: crops beside the whole image, each with its own tokens
    tiles: tuple[int, int] = (0, 0)  # Idefics3 / SmolVLM: rows and columns of tiles beside the global image


class ImageProcessor(Protocol):
    @property
    def family(self) -> str: ...

    def plan(self, height: int, width: int) -> ImagePlan: ...


@dataclass(frozen=True, slots=True)
class QwenVLProcessor:
    """transformers' Qwen2VLImageProcessor, which Qwen2-VL, Qwen2.5-VL and Qwen3-VL all use for images."""

    family: str
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280  # the class default; released models' configs set their own

    def plan(self, height: int, width: int) -> ImagePlan:
        resized_height, resized_width = smart_resize(
            height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
        )
        # a still image is one temporal patch: the processor repeats it temporal_patch_size times
        grid = Grid(1, resized_height // self.patch_size, resized_width // self.patch_size)
        return ImagePlan(n_tokens=grid.t * grid.h * grid.w // self.merge_size**2, grid=grid)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen-VL resize: sides divisible by `factor`, area within [min_pixels, max_pixels], aspect kept.

    Rounding follows transformers' smart_resize step for step (round, then floor when too large,
    ceil when too small), so every size lands on the processor's grid."""
    if max(height, width) / min(height, width) > 200:
        raise RecordError(
            f"image of {width} x {height} has an aspect ratio over 200, which the processor refuses",
            kind="image_aspect",
        )
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        resized_height = max(factor, math.floor(height / beta / factor) * factor)
        resized_width = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * beta / factor) * factor
        resized_width = math.ceil(width * beta / factor) * factor
    return resized_height, resized_width


@dataclass(frozen=True, slots=True)
class Gemma3Processor:
    """transformers' Gemma3ImageProcessor + Gemma3Processor: a fixed square, optional pan-and-scan crops."""

    family: str = "gemma3"
    image_seq_length: int = 256
    do_pan_and_scan: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def plan(self, height: int, width: int) -> ImagePlan:
        crops = self.crops(height, width) if self.do_pan_and_scan else 0
        return ImagePlan(n_tokens=self.image_seq_length * (1 + crops), crops=crops)

    def crops(self, height: int, width: int) -> int:
        """Pan and scan: how many crops the long side is cut into (0 when the image is not long enough)."""
        long_side, short_side = max(height, width), min(height, width)
        if long_side / short_side < self.min_ratio_to_activate:
            return 0
        # floor(x + 0.5): the processor's half-up rounding of the aspect ratio
        count = min(math.floor(long_side / short_side + 0.5), math.floor(long_side / self.min_crop_size))
        count = min(self.max_num_crops, max(2, count))
        crop_long = math.ceil(long_side / count)
        return 0 if min(crop_long, short_side) < self.min_crop_size else count


@dataclass(frozen=True, slots=True)
class Idefics3Processor:
    """transformers' Idefics3 / SmolVLM image processor and processor: the longest side resized to `longest_edge`,
    then tiled in squares of `tile_size` beside one global image, `image_seq_length` image tokens each.

        1000 x 600 photo, Idefics3 defaults (1456, tiles of 364): resized 1456 x 874, to the tile grid
        1456 x 1092, 3 rows x 4 columns + the global image = 13 x 169 = 2,197 image tokens

    The rows and columns also name the tiles' marker tokens (<row_1_col_1>, ...) in the text, which
    the tokenizer counts; `n_tokens` counts the image tokens alone."""

    family: str
    longest_edge: int = 4 * 364
    tile_size: int = 364
    image_seq_length: int = 169
    do_resize: bool = True
    do_image_splitting: bool = True

    def plan(self, height: int, width: int) -> ImagePlan:
        if not self.do_image_splitting:
            return ImagePlan(n_tokens=self.image_seq_length)
        if self.do_resize:
            height, width = _scale_longest_side(height, width, self.longest_edge, even=True)
            height, width = _scale_longest_side(height, width, IDEFICS3_MAX_SIDE, even=False, only_down=True)
        rows, columns = self.tiles(height, width)
        return ImagePlan(n_tokens=self.image_seq_length * (rows * columns + 1), tiles=(rows, columns))

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of the tile grid, (0, 0) for an image that fits one tile; the same float steps
        as the processor's resize_for_vision_encoder, so the sides land where its do."""
        aspect_ratio = width / height
        if width >= height:
            width = math.ceil(width / self.tile_size) * self.tile_size
            height = math.ceil(int(width / aspect_ratio) / self.tile_size) * self.tile_size
        else:
            height = math.ceil(height / self.tile_size) * self.tile_size
            width = math.ceil(int(height * aspect_ratio) / self.tile_size) * self.tile_size
        if height > self.tile_size or width > self.tile_size:
            return height // self.tile_size, width // self.tile_size
        return 0, 0


IDEFICS3_MAX_SIDE = 4096  # the processor's absolute cap on a side (MAX_IMAGE_SIZE)


def _scale_longest_side(height: int, width: int, side: int, *, even: bool, only_down: bool = False) -> tuple[int, int]:
    """The Idefics3 resize of the longest side to `side`, aspect kept by truncation (made even when asked)."""
    aspect_ratio = width / height
    if width >= height and not (only_down and width <= side):
        width = side
        height = int(width / aspect_ratio)
        height += 1 if even and height % 2 else 0
    elif height > width and not (only_down and height <= side):
        height = side
        width = int(height * aspect_ratio)
        width += 1 if even and width % 2 else 0
    return max(height, 1), max(width, 1)


QWEN_PROCESSORS = {
    "Qwen2VLImageProcessor": "qwen2_vl",
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
}
GEMMA3_PROCESSORS = ("Gemma3ImageProcessor", "Gemma3Processor")
IDEFICS3_PROCESSORS = {
    "Idefics3ImageProcessor": "idefics3",
    "Idefics3Processor": "idefics3",
    "SmolVLMImageProcessor": "smolvlm",
    "SmolVLMProcessor": "smolvlm",
}


def load_processor(folder: Path) -> ImageProcessor:
    """The image processor of a model folder: its preprocessor_config.json (+ processor_config.json)."""
    config_file = folder / PREPROCESSOR_CONFIG
    config = read_json_object(config_file)
    processor_file = folder / PROCESSOR_FILES[1]
    processor_config = read_json_object(processor_file) if processor_file.is_file() else {}
    return processor_from_config(config, processor_config, where=str(config_file))


def processor_from_config(config: dict, processor_config: dict | None = None, *, where: str) -> ImageProcessor:
    """The processor that `config` (preprocessor_config.json's object) describes; one ConfigError naming
    `where` with every problem found."""
    image_type = str(config.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    names = (image_type, str(config.get("processor_class", "")))
    problems: list[str] = []
    processor: ImageProcessor
    # the processor class says which Qwen model (the image processor class is shared), so it is asked first
    family = QWEN_PROCESSORS.get(names[1]) or QWEN_PROCESSORS.get(names[0])
    if family:
        processor = _qwen(config, family, problems)
    elif any(name in GEMMA3_PROCESSORS for name in names):
        processor = _gemma3(config, processor_config or {}, problems)
    elif tiled := IDEFICS3_PROCESSORS.get(names[1]) or IDEFICS3_PROCESSORS.get(names[0]):
        processor = _idefics3(config, processor_config or {}, tiled, problems)
    else:
        raise ConfigError(
            where,
            [
                f"image processor {image_type or names[1] or '(none named)'!r} is not supported yet "
                f"(supported: {', '.join([*QWEN_PROCESSORS, *GEMMA3_PROCESSORS, *IDEFICS3_PROCESSORS])}); "
                "see docs/vision.md"
            ],
        )
    if problems:
        raise ConfigError(where, problems)
    return processor


def _qwen(config: dict, family: str, problems: list[str]) -> QwenVLProcessor:
    if config.get("do_resize") is False:
        problems.append("do_resize false is not supported: every image would need sides on the patch grid")
    size = config.get("size")
    defaults = QwenVLProcessor(family)
    # the processor's own precedence: min_pixels / max_pixels override size's shortest / longest edge
    min_pixels = config.get("min_pixels")
    max_pixels = config.get("max_pixels")
    if isinstance(size, dict):
        min_pixels = size.get("shortest_edge") if min_pixels is None else min_pixels
        max_pixels = size.get("longest_edge") if max_pixels is None else max_pixels
        if min_pixels is None or max_pixels is None:
            problems.append("size needs shortest_edge and longest_edge (the processor refuses it too)")
    return QwenVLProcessor(
        family=family,
        patch_size=_positive(config, "patch_size", defaults.patch_size, problems),
        merge_size=_positive(config, "merge_size", defaults.merge_size, problems),
        temporal_patch_size=_positive(config, "temporal_patch_size", defaults.temporal_patch_size, problems),
        min_pixels=_positive({"min_pixels": min_pixels}, "min_pixels", defaults.min_pixels, problems),
        max_pixels=_positive({"max_pixels": max_pixels}, "max_pixels", defaults.max_pixels, problems),
    )


def _gemma3(config: dict, processor_config: dict, problems: list[str]) -> Gemma3Processor:
    defaults = Gemma3Processor()
    ratio = config.get("pan_and_scan_min_ratio_to_activate")
    ratio = defaults.min_ratio_to_activate if ratio is None else ratio
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or ratio <= 0:
        problems.append(f"pan_and_scan_min_ratio_to_activate must be a positive number, got {ratio!r}")
        ratio = defaults.min_ratio_to_activate
    return Gemma3Processor(
        image_seq_length=_positive(processor_config, "image_seq_length", defaults.image_seq_length, problems),
        # null in released configs: the processor's call defaults turn it off
        do_pan_and_scan=bool(config.get("do_pan_and_scan")),
        min_crop_size=_positive(config, "pan_and_scan_min_crop_size", defaults.min_crop_size, problems),
        max_num_crops=_positive(config, "pan_and_scan_max_num_crops", defaults.max_num_crops, problems),
        min_ratio_to_activate=float(ratio),
    )


def _idefics3(config: dict, processor_config: dict, family: str, problems: list[str]) -> Idefics3Processor:
    defaults = Idefics3Processor(family)
    edges = {}
    for key, default in (("size", defaults.longest_edge), ("max_image_size", defaults.tile_size)):
        value = config.get(key)
        if value is not None and not (isinstance(value, dict) and "longest_edge" in value):
            problems.append(f"{key} needs longest_edge, got {value!r}")
            value = None
        edges[key] = _positive(value or {}, "longest_edge", default, problems)
    return Idefics3Processor(
        family=family,
        longest_edge=edges["size"],
        tile_size=edges["max_image_size"],
        image_seq_length=_positive(processor_config, "image_seq_len", defaults.image_seq_length, problems),
        do_resize=config.get("do_resize") is not False,
        do_image_splitting=config.get("do_image_splitting") is not False,
    )


def _positive(config: dict, key: str, default: int, problems: list[str]) -> int:
    value = config.get(key)
    if value is None:
        return default
    if type(value) is not int or value <= 0:
        problems.append(f"{key} must be a positive integer, got {value!r}")
        return default
    return value


def read_json_object(path: Path) -> dict[str, Any]:
    """A model folder's JSON settings file, as one object; a ConfigError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(str(path), [f"cannot be read: {error.strerror or error}"]) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(str(path), [f"not valid JSON: {error}"]) from None
    if not isinstance(value, dict):
        raise ConfigError(str(path), [f"expected a JSON object, got {type(value).__name__}"])
    return value
