"""Image facts read from a file's header, as the model's processor will see the image, without decoding pixels.

    bytes ─► image_facts(data, max_pixels) ─► ImageFacts(format, width, height, mode, orientation, frames, sha256)
                    │
                    └─► RecordError(kind=...) with the reason, one per image (REJECT_KINDS)

`width` x `height` is the picture after its EXIF orientation, as transformers' `load_image`
(`PIL.ImageOps.exif_transpose`) hands it to the processor: orientations 5-8 swap the stored sides.

    stored 640 x 480, orientation 6 (rotate 90)  ->  ImageFacts(width=480, height=640, orientation=6)

What is checked without decoding: the header (format, size, mode, frames, orientation), and that
the file is whole: a PNG's chunks end in IEND and each passes its CRC; a JPEG has its end-of-image
marker after the first scan; a WebP holds the bytes its RIFF header counts; a GIF ends in its
trailer. Damage inside a JPEG's compressed data is found only by decoding it (the loader does).
"""

from __future__ import annotations

import hashlib
import io
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RecordError
from . import pillow

# Pillow's own warning threshold for a decompression bomb (MAX_IMAGE_PIXELS, 1 GiB / 4 / 3): a
# 10,000 x 8,000 photo passes, a 30,000 x 30,000 PNG of a few KB (3.6 GB decoded as RGBA) does not.
DEFAULT_MAX_PIXELS = 89_478_485

# Modes whose conversion by the processor (transformers' convert_to_rgb: an alpha channel or a
# palette's transparency composited on white, otherwise Image.convert("RGB")) gives the picture
# the file shows. Measured for the others: 16-bit and 32-bit integer and float images (I;16, I,
# F) are clipped to 0..255, so a 16-bit scan turns almost white; LAB and HSV come out wrong.
ACCEPTED_MODES = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"})

# rejects.jsonl reasons for an image, each with its detail in the error's text
REJECT_KINDS = ("image_missing", "image_corrupt", "image_too_large", "image_mode", "image_animated")

_SWAPS_SIDES = frozenset({5, 6, 7, 8})  # EXIF orientations that transpose the picture
_EXIF_ORIENTATION = 0x0112
_PNG_METADATA = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt"})


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """One image as the processor will receive it. `sha256` is of the file's bytes (provenance)."""

    format: str  # Pillow's name: PNG, JPEG, WEBP, GIF, ...
    width: int  # after the EXIF orientation
    height: int
    mode: str
    orientation: int  # EXIF orientation, 1 when absent
    frames: int
    sha256: str
    n_bytes: int


def read_image_facts(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageFacts:
    """The facts of the image file at `path`; a missing or unreadable file is an `image_missing` reject."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RecordError(
            f"image {str(path)!r} cannot be read: {error.strerror or error}", kind="image_missing"
        ) from None
    return image_facts(data, max_pixels)


def image_facts(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageFacts:
    """The facts of one image file's bytes, or a RecordError whose `kind` is one of REJECT_KINDS."""
    image = _open(data)
    width, height = image.size
    if width * height > max_pixels:
        raise RecordError(
            f"image of {width} x {height} = {width * height:,} pixels is over the limit of {max_pixels:,} "
            "(a decompression bomb, or raise the limit)",
            kind="image_too_large",
        )
    late_metadata = _check_whole(image.format or "", data, image)
    if image.mode not in ACCEPTED_MODES:
        raise RecordError(
            f"image mode {image.mode} is not one the processor converts faithfully to RGB "
            f"(it takes {', '.join(sorted(ACCEPTED_MODES))}); convert it to 8-bit RGB",
            kind="image_mode",
        )
    frames = int(getattr(image, "n_frames", 1))
    if frames > 1:
        raise RecordError(
            f"{image.format} image has {frames} frames; the processor would take the first alone", kind="image_animated"
        )
    orientation = _orientation(image, late_metadata)
    if orientation in _SWAPS_SIDES:
        width, height = height, width
    return ImageFacts(
        format=image.format or "",
        width=width,
        height=height,
        mode=image.mode,
        orientation=orientation,
        frames=frames,
        sha256=hashlib.sha256(data).hexdigest(),
        n_bytes=len(data),
    )


def _open(data: bytes) -> Any:
    image_module = pillow()
    try:
        return image_module.open(io.BytesIO(data))
    except image_module.DecompressionBombError as error:
        raise RecordError(f"image is a decompression bomb: {error}", kind="image_too_large") from None
    except image_module.UnidentifiedImageError:
        raise RecordError(f"not an image file Pillow recognizes ({len(data)} bytes)", kind="image_corrupt") from None
    except Exception as error:  # Pillow raises many types for a known format's damaged header
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RecordError(f"not an image Pillow can read ({len(data)} bytes): {detail}", kind="image_corrupt") from None


def _orientation(image: Any, late_metadata: bool) -> int:
    """The EXIF orientation as exif_transpose reads it (EXIF, PNG text profiles, XMP), without decoding.

    Pillow's PNG reader decodes the pixels to look for metadata stored after them; only such a
    PNG (rare) pays for that, every other file is read from its header."""
    exif = image.getexif() if late_metadata else pillow().Image.getexif(image)
    value = exif.get(_EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _check_whole(image_format: str, data: bytes, image: Any) -> bool:
    """Raise `image_corrupt` for a file cut short or damaged; True for a PNG with metadata after its pixels."""
    problem: str | None = None
    late_metadata = False
    if image_format == "PNG":
        problem, late_metadata = _png_problem(data)
    elif image_format in ("JPEG", "MPO"):
        scan_start = min((tile[2] for tile in image.tile), default=0)
        if data.find(b"\xff\xd9", scan_start) < 0:
            problem = "truncated: no end-of-image marker after the image data"
    elif image_format == "WEBP":
        declared = int.from_bytes(data[4:8], "little") + 8
        if declared > len(data):
            problem = f"truncated: {len(data)} bytes of the {declared} its RIFF header counts"
    elif image_format == "GIF" and not data.rstrip(b"\x00").endswith(b";"):
        problem = "truncated: no GIF trailer"
    if problem:
        raise RecordError(f"{image_format} image is {problem}", kind="image_corrupt")
    return late_metadata


def _png_problem(data: bytes) -> tuple[str | None, bool]:
    """(what is wrong, or None; whether metadata chunks follow the pixel data) from the chunk list."""
    view = memoryview(data)
    position, seen_pixels, late_metadata = 8, False, False
    while position + 12 <= len(data):
        length = int.from_bytes(view[position : position + 4], "big")
        kind = bytes(view[position + 4 : position + 8])
        end = position + 12 + length
        if end > len(data):
            break
        if zlib.crc32(view[position + 4 : end - 4]) != int.from_bytes(view[end - 4 : end], "big"):
            return f"damaged: its {kind.decode('latin-1')} chunk at byte {position} fails its CRC", late_metadata
        if kind == b"IEND":
            return None, late_metadata
        seen_pixels = seen_pixels or kind == b"IDAT"
        late_metadata = late_metadata or (seen_pixels and kind in _PNG_METADATA)
        position = end
    return f"truncated: {len(data)} bytes end inside a chunk, before IEND", late_metadata
