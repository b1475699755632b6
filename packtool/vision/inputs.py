"""Where a record's images are, read from the conventions users have, before any file is opened.

    messages     {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What?"}]}
                 also {"type": "image", "path": "cat.png"} and
                 {"type": "image_url", "image_url": {"url": "cat.png" or "data:image/png;base64,..."}};
                 a bare {"type": "image"} takes the next entry of the record's `images` (TRL's convention)
    LLaMA-Factory / ShareGPT
                 "<image>" placeholders in the text and "images": ["cat.png", ...], one per placeholder, in order;
                 an entry may be a `datasets` Image cell, {"bytes": ..., "path": ...}

        -> (ImageRef(field="images[0]", path=Path("data/cat.png"), data=None), ...)   in the order the model sees them

A relative path is resolved against `base` (the data file's folder). There is no network: an
http(s) or other URL is an `image_remote` reject naming it; a placeholder count that differs from
the images is an `image_count_mismatch` reject. Pure: nothing here reads a file.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RecordError

PLACEHOLDER = "<image>"
# Content part types that are an image (a part of another type is the text's or a video's)
IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})
# rejects.jsonl reasons for a record whose images cannot be found from what it says
INPUT_REJECT_KINDS = ("image_remote", "image_count_mismatch", "image_corrupt")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image a record names: a local file (`path`) or bytes it carries (`data`), and where it says so."""

    field: str  # "messages[0].content[1]", "images[2]"
    path: Path | None = None
    data: bytes | None = None


def resolve(reference: Any, field: str, base: Path) -> ImageRef:
    """One image reference: a path (relative to `base`), a file:// or data: URI, or a {"bytes", "path"} cell."""
    if isinstance(reference, dict):
        if reference.get("bytes"):
            return ImageRef(field, data=bytes(reference["bytes"]))
        reference = reference.get("path")
    if not isinstance(reference, str) or not reference:
        raise RecordError(f"an image is a path, a data: URI or a {{bytes, path}} cell, got {reference!r}", field=field)
    if reference.startswith("data:"):
        return ImageRef(field, data=_data_uri(reference, field))
    if reference.startswith("file://"):
        reference = reference.removeprefix("file://")
    elif _URL.match(reference):
        raise RecordError(
            f"image {reference!r} is a URL: packtool reads no network; download it and give its path",
            kind="image_remote",
            field=field,
        )
    return ImageRef(field, path=base / reference)


def message_images(messages: Any, base: Path, column: str = "messages", images: Any = None) -> tuple[ImageRef, ...]:
    """The images of a `format: messages` record's content parts, in conversation order. A part that names no
    image takes the next entry of `images` (TRL's convention: `{"type": "image"}` parts and an `images` column)."""
    if not isinstance(messages, list):
        return ()
    entries = _entries(images)
    refs = []
    taken = 0
    for m, p, part in _image_parts(messages):
        field = f"{column}[{m}].content[{p}]"
        reference = _part_reference(part)
        if reference is None:
            if taken == len(entries):
                raise RecordError(
                    "an image part names no image: give `image`, `path` or `image_url`, or an `images` list",
                    field=field,
                )
            reference, field = entries[taken], f"images[{taken}]"
            taken += 1
        refs.append(resolve(reference, field, base))
    if refs and taken != len(entries):  # an entry no part takes would be dropped without a word
        raise RecordError(
            f"{taken} image part(s) without an image for {len(entries)} image(s) in `images`",
            kind="image_count_mismatch",
            field="images",
        )
    return tuple(refs)


def placeholder_images(texts: list[str], images: Any, base: Path, column: str = "images") -> tuple[ImageRef, ...]:
    """The images of a record in LLaMA-Factory's convention: one `<image>` in `texts` per entry of `images`."""
    entries = _entries(images)
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    if placeholders != len(entries):
        raise RecordError(
            f"{placeholders} {PLACEHOLDER} placeholder(s) in the text for {len(entries)} image(s) in `{column}`",
            kind="image_count_mismatch",
            field=column,
        )
    return tuple(resolve(entry, f"{column}[{i}]", base) for i, entry in enumerate(entries))


def record_texts(value: Any, skip: tuple[str, ...] = ("images", "videos")) -> list[str]:
    """Every string of a record, nested ones included, but those under the media columns: where placeholders are."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() if key not in skip for text in record_texts(item, ())]
    if isinstance(value, list):
        return [text for item in value for text in record_texts(item, ())]
    return []


def _image_parts(messages: list) -> Iterator[tuple[int, int, dict]]:
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for p, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                    yield m, p, part


def _part_reference(part: dict) -> Any:
    """The reference an image part holds: `image`, `path` or `image_url` ({"url": ...} or a string); None for none."""
    for key in ("image", "path", "image_url"):
        value = part.get(key)
        if isinstance(value, dict) and key == "image_url":
            value = value.get("url")
        if value is not None:
            return value
    return None


def _entries(images: Any) -> list:
    """A record's `images` column as a list (one entry given alone is a list of one)."""
    if images is None:
        return []
    return images if isinstance(images, list) else [images]


def _data_uri(uri: str, field: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma or not header.endswith(";base64"):
        raise RecordError("a data: URI image must be base64 (data:image/...;base64,...)", field=field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RecordError("a data: URI image is not valid base64", kind="image_corrupt", field=field) from None
