"""Generated images for the vision tests: random sizes and aspect ratios, PNG/JPEG/WebP, EXIF
orientations, L/RGB/RGBA/LA/P modes (palettes with and without transparency), CMYK JPEGs.

Most are tiny (a side of 1-96 pixels: the processors upscale them past min_pixels), a few are
long and thin (aspect ratios near and past the processor's limit of 200) and a few are larger;
shrinking past max_pixels is exercised by a tight config rather than by large files, which would
cost the processor seconds each.
"""

from __future__ import annotations

import importlib
import io
import random
import types
from dataclasses import dataclass

import pytest

N_IMAGES = 1000


@dataclass(frozen=True)
class Generated:
    name: str
    data: bytes
    stored_size: tuple[int, int]  # (width, height) as written, before the EXIF orientation
    orientation: int


# Modes each format can store; a generated image in another mode is converted first.
STORES = {"PNG": ("L", "RGB", "RGBA", "LA", "P"), "JPEG": ("L", "RGB", "CMYK"), "WEBP": ("RGB", "RGBA")}


def random_size(rng: random.Random, index: int) -> tuple[int, int]:
    if index % 200 == 0:
        return rng.choice([(640, 480), (300, 900), (1000, 20)])
    if index % 25 == 1:
        # long and thin: aspect ratios around 200, where the processor starts refusing
        short = rng.randint(1, 3)
        long = short * rng.randint(150, 260)
        return (long, short) if rng.random() < 0.5 else (short, long)
    return rng.randint(1, 96), rng.randint(1, 96)


def make_image(rng: random.Random, index: int) -> Generated:
    from PIL import Image

    image_format = rng.choice(list(STORES))
    mode = rng.choice(STORES[image_format])
    size = random_size(rng, index)
    colour = tuple(rng.randint(0, 255) for _ in range(4))
    base = Image.new("RGBA", size, colour)
    image = base.convert("RGB").convert("P") if mode == "P" else base.convert(mode)
    save: dict = {}
    if mode == "P" and rng.random() < 0.5:
        save["transparency"] = 0  # a palette with a transparent entry
    orientation = rng.randint(1, 8)
    if orientation != 1 or rng.random() < 0.5:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif
    if image_format == "WEBP":
        save["lossless"] = rng.random() < 0.5
    buffer = io.BytesIO()
    image.save(buffer, image_format, **save)
    return Generated(f"{index}.{image_format.lower()}", buffer.getvalue(), size, orientation)


@pytest.fixture(scope="session")
def generated_images() -> list[Generated]:
    pytest.importorskip("PIL.Image")  # the tests that need no image run without Pillow
    rng = random.Random(40)
    return [make_image(rng, index) for index in range(N_IMAGES)]


@pytest.fixture(scope="session")
def pictures(generated_images) -> list:
    """Each generated image decoded as transformers' load_image hands it to a processor (EXIF orientation applied)."""
    from PIL import Image, ImageOps

    return [ImageOps.exif_transpose(Image.open(io.BytesIO(generated.data))) for generated in generated_images]


# The models whose get_rope_index the positions are held to: (module, class) in transformers.
ROPE_MODELS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
}


@pytest.fixture(scope="session")
def rope_index():
    """rope_index(family, token_types, grids, merge_size=2): the model's get_rope_index for one document alone,
    called without building the model: it reads only the merge size (and Qwen2.5-VL's tokens per second,
    which images do not use). token_types: 0 text, 1 image, per token; grids: image_grid_thw rows."""
    torch = pytest.importorskip("torch")

    def positions(family: str, token_types, grids, merge_size: int = 2):
        module, name = ROPE_MODELS[family]
        model_class = getattr(importlib.import_module(module), name)
        vision = types.SimpleNamespace(spatial_merge_size=merge_size, tokens_per_second=2)
        model = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
        model.get_vision_position_ids = types.MethodType(model_class.get_vision_position_ids, model)
        kinds = torch.tensor([list(token_types)], dtype=torch.int32)
        grid_rows = torch.tensor([list(grid) for grid in grids], dtype=torch.long) if len(grids) else None
        ids = torch.zeros_like(kinds, dtype=torch.long)
        found, _ = model_class.get_rope_index(model, ids, kinds, image_grid_thw=grid_rows)
        return found[:, 0].numpy()

    return positions
