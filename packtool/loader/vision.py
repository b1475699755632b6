"""The images of a vision build's packs: read, checked against their record, preprocessed, placed in a micro-batch.

A vision build (docs/vision.md, docs/format.md) stores per pack the images in token order and the
mRoPE positions the model computes for each document alone. What the loader adds (in its workers)::

    shard row     image_refs ["a.png", ""]  image_data [b"", <bytes>]  image_sha256 [..]  image_grids [1 4 6  1 2 2]
       |          mrope_positions [t_0..t_{n-1}, h_0..h_{n-1}, w_0..w_{n-1}]
       v
    bytes         image_data when not empty, else root / image_ref (root: the manifest's vision root or
                  image_root=); their sha256 must be the recorded one
    picture       decoded by Pillow, upright (EXIF orientation, as transformers' load_image)
    processor     transformers' PIL image processor built from OUT/processor/ (its files checked against
                  the manifest): pixel_values [patches, C*t*p*p] and each image's grid, which must equal
                  the planned one (a mismatch is one DatasetError naming the image)
       |
       v
    micro-batch   pixel_values (the packs' images, concatenated in token order), image_grid_thw int64
                  [n_images, 3], mrope_position_ids int64 [3, 1, T]: each pack's stored rows at its
                  tokens, ordinary positions (the text row) for fixed-shape padding

The model then reads `[text row; t; h; w]` as its position_ids (`boundaries.model_inputs`): the
text row restarts in every document, which is how Qwen-VL models find the documents of a packed
row when attention_mask is None; the vision tower's attention is per image by construction
(its cu_seqlens and windows come from image_grid_thw), so images never see each other.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from packtool.arrow import list_parts
from packtool.errors import DatasetError, one_line
from packtool.format import IMAGE_FIELDS, MROPE_FIELD, PROCESSOR_FOLDER, Manifest, sha256_file

__all__ = ["VISION_COLUMNS", "ImageSource", "PackImages", "place_images"]

# A vision build's per-pack columns (docs/format.md "Images"), in the order shards hold them.
VISION_COLUMNS = (MROPE_FIELD.name, *(field.name for field in IMAGE_FIELDS))
# Families whose images the loader preprocesses: transformers' PIL Qwen2-VL image processor serves all three.
GRID_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # the file transformers builds the image processor from


@dataclass(frozen=True, slots=True)
class PackImages:
    """One pack's images as loaded: the model's inputs for them and the pack's stored mRoPE rows."""

    pixel_values: torch.Tensor  # float32 [patches, C * t * p * p], the pack's images in token order
    image_grid_thw: torch.Tensor  # int64 [n_images, 3]
    mrope_positions: np.ndarray | None  # int64 (3, n_tokens); None for a family without mRoPE


@dataclass(frozen=True, slots=True)
class VisionRows:
    """A row group's vision columns: the mRoPE rows as (offsets, values), the small per-image lists as Python."""

    mrope: tuple[list[int], np.ndarray] | None
    refs: list[list[str]]
    sha256: list[list[str]]
    grids: list[list[int]]
    data: list[list[bytes]]

    @classmethod
    def of(cls, table: pa.Table) -> VisionRows:
        mrope = None
        if "mrope_positions" in table.column_names:
            offsets, values = list_parts(table.column("mrope_positions"))
            mrope = (offsets.tolist(), values)
        return cls(
            mrope,
            table.column("image_refs").to_pylist(),
            table.column("image_sha256").to_pylist(),
            table.column("image_grids").to_pylist(),
            table.column("image_data").to_pylist(),
        )

    def mrope_of(self, row: int) -> np.ndarray | None:
        if self.mrope is None:
            return None
        offsets, values = self.mrope
        return values[offsets[row] : offsets[row + 1]].astype(np.int64).reshape(3, -1)


class ImageSource:
    """A vision build's images and image processor: `load` gives one pack's `PackImages`, every image checked.

    The processor is built on first use in each process (DataLoader workers build their own), from
    OUT/processor/ alone, after its files hash as the manifest records them.
    """

    def __init__(self, manifest: Manifest, image_root: str | Path | None = None) -> None:
        vision = manifest.vision  # its fields' types checked with the manifest (format.manifest_problems)
        if vision is None:
            raise DatasetError(f"{manifest.folder}: the manifest has no vision object; not a build with images")
        self.folder = manifest.folder / PROCESSOR_FOLDER
        self.family = vision["processor"]["family"]
        if self.family not in GRID_FAMILIES:
            raise DatasetError(
                f"{manifest.folder}: the loader preprocesses {', '.join(GRID_FAMILIES)} images, not {self.family}"
            )
        self.files: dict[str, str] = vision["processor"]["files"]
        self.root = Path(image_root if image_root is not None else vision["root"])
        self._processor: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """A worker builds its own processor (it is cheap to build and not always cheap to send)."""
        return {**{k: getattr(self, k) for k in ("folder", "family", "files", "root")}, "_processor": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def processor(self) -> Any:
        if self._processor is None:
            self._processor = self._build_processor()
        return self._processor

    def _build_processor(self) -> Any:
        if PREPROCESSOR_CONFIG not in self.files:
            raise DatasetError(f"{self.folder}: the manifest's vision.processor names no {PREPROCESSOR_CONFIG}")
        for name, recorded in self.files.items():
            file = self.folder / name
            if not file.is_file():
                raise DatasetError(f"{file}: the build's image processor file is missing; rebuild the output")
            if sha256_file(file) != recorded:
                raise DatasetError(f"{file}: changed since the build (sha256 differs from the manifest's); rebuild")
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(self.folder)

    def load(self, rows: VisionRows, row: int, where: str) -> PackImages:
        """Pack `row` of a row group's vision columns; `where` names it (shard and row) in an error."""
        refs, grids = rows.refs[row], rows.grids[row]
        planned = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
        if len(planned) != len(refs):
            raise DatasetError(f"{where}: {len(refs)} images but {len(grids)} grid values; rebuild the shards")
        mrope = rows.mrope_of(row)
        if not refs:
            return PackImages(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.int64), mrope)
        pictures = [
            self._picture(ref, data, sha, f"{where}: image {i} ({ref or 'embedded'})")
            for i, (ref, data, sha) in enumerate(zip(refs, rows.data[row], rows.sha256[row], strict=True))
        ]
        out = self.processor()(images=pictures, return_tensors="pt")
        got = out["image_grid_thw"].to(torch.int64)
        for i, (have, want) in enumerate(zip(got.tolist(), planned.tolist(), strict=True)):
            if have != want:
                raise DatasetError(
                    f"{where}: image {i} ({refs[i] or 'embedded'}): the processor gives grid {have}, the build planned "
                    f"{want}; the image processor or the picture is not the build's"
                )
        return PackImages(out["pixel_values"].to(torch.float32), got, mrope)

    def _picture(self, ref: str, data: bytes, sha256: str, name: str) -> Any:
        """One image's bytes, checked against its recorded sha256, decoded upright."""
        if not data:
            file = self.root / ref
            try:
                data = file.read_bytes()
            except OSError as err:
                why = one_line(err)
                raise DatasetError(f"{name}: cannot read {file} ({why}); restore it or pass image_root=") from None
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise DatasetError(f"{name}: sha256 {got[:16]}... != recorded {sha256[:16]}...: not the build's image")
        from PIL import Image, ImageOps

        try:
            picture = Image.open(io.BytesIO(data))
            picture.load()
            ImageOps.exif_transpose(picture, in_place=True)  # upright, as load_image; without a copy of the pixels
            return picture
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise DatasetError(f"{name}: cannot be decoded ({one_line(err)})") from None


def place_images(
    packs: Sequence[PackImages | None], lengths: Sequence[int], slots: Sequence[int], text_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's (pixel_values, image_grid_thw, mrope_position_ids [3, 1, T]) from its packs' images.

    Pack k's tokens start at `slots[k]` (its offset in the row: the packs before it, or k * capacity
    in fixed shape) and hold `lengths[k]` tokens; tokens no pack stores rows for (fixed-shape
    padding, a pack without mRoPE rows) take the text positions in all three rows.
    """
    mrope = text_positions.reshape(1, 1, -1).repeat(3, 1, 1)
    pixels, grids = [], []
    for images, start, n in zip(packs, slots, lengths, strict=True):
        if images is None:
            continue
        if images.mrope_positions is not None:
            if images.mrope_positions.shape[1] != n:
                raise DatasetError(
                    f"a pack of {n} tokens stores mRoPE positions for {images.mrope_positions.shape[1]}; rebuild it"
                )
            mrope[:, 0, start : start + n] = torch.from_numpy(images.mrope_positions)
        if len(images.image_grid_thw):
            pixels.append(images.pixel_values)
            grids.append(images.image_grid_thw)
    pixel_values = torch.cat(pixels) if pixels else torch.zeros(0, 0)
    image_grid_thw = torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.int64)
    return pixel_values, image_grid_thw, mrope
