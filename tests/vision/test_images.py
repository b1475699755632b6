"""Image facts from headers (packtool.vision.images) against Pillow decoding the same files."""

from __future__ import annotations

import hashlib
import io
import struct
import sys
import zlib

import numpy as np
import pytest

from packtool.errors import PacktoolError, RecordError
from packtool.vision.images import ACCEPTED_MODES, image_facts, read_image_facts

Image = pytest.importorskip("PIL.Image")
ImageFile = pytest.importorskip("PIL.ImageFile")
ImageOps = pytest.importorskip("PIL.ImageOps")


def encode(image, image_format: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format, **save)
    return buffer.getvalue()


def rejected(data: bytes, **limits) -> RecordError:
    with pytest.raises(RecordError) as caught:
        image_facts(data, **limits)
    return caught.value


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A whole PNG file of a 1-bit picture whose pixel data is an empty stream: a decoder would fail on it."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    idat = png_chunk(b"IDAT", zlib.compress(b""))
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + idat + png_chunk(b"IEND", b"")


def test_facts_equal_the_decoded_picture_on_generated_images(generated_images, pictures):
    orientations = set()
    for generated, picture in zip(generated_images, pictures):
        facts = image_facts(generated.data)
        opened = Image.open(io.BytesIO(generated.data))
        assert (facts.width, facts.height) == picture.size, generated.name
        assert (facts.format, facts.mode, facts.frames) == (opened.format, opened.mode, 1), generated.name
        assert facts.orientation == generated.orientation, generated.name
        assert facts.sha256 == hashlib.sha256(generated.data).hexdigest()
        assert facts.n_bytes == len(generated.data)
        orientations.add(facts.orientation)
    assert orientations == set(range(1, 9))


def test_facts_decode_no_pixels(generated_images, monkeypatch):
    def refuse(self):
        raise AssertionError("pixels decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    for generated in generated_images[:200]:
        image_facts(generated.data)
    facts = image_facts(png_header_only(9000, 9000))  # 81 M pixels, read from the header alone
    assert (facts.width, facts.height) == (9000, 9000)


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP", "GIF"])
def test_a_file_cut_short_is_corrupt(image_format):
    data = encode(Image.new("RGB", (40, 30), (200, 10, 10)), image_format)
    for cut in sorted({1, 8, 16, len(data) // 3, len(data) // 2, len(data) - 2, len(data) - 1}):
        error = rejected(data[:cut])
        assert error.kind == "image_corrupt", (cut, str(error))
    assert "0x" not in str(rejected(data[:16]))  # no object address in the reason


def test_a_damaged_png_chunk_fails_its_crc():
    data = bytearray(encode(Image.new("RGB", (40, 30), (200, 10, 10)), "PNG"))
    data[data.index(b"IDAT") + 6] ^= 0xFF
    error = rejected(bytes(data))
    assert error.kind == "image_corrupt"
    assert "IDAT chunk" in str(error) and "CRC" in str(error)


def test_not_an_image_and_a_missing_file(tmp_path):
    assert rejected(b"just some text, not a picture").kind == "image_corrupt"
    with pytest.raises(RecordError, match="cannot be read") as caught:
        read_image_facts(tmp_path / "absent.png")
    assert caught.value.kind == "image_missing"


def test_decompression_bomb_is_rejected_before_any_decoding():
    error = rejected(png_header_only(20000, 20000))  # 400 M pixels in 70 bytes
    assert error.kind == "image_too_large"
    limited = rejected(encode(Image.new("RGB", (100, 100)), "PNG"), max_pixels=9_999)
    assert limited.kind == "image_too_large" and "10,000 pixels" in str(limited)


def test_modes_follow_what_the_processor_converts_faithfully():
    sixteen_bit = encode(Image.fromarray(np.full((8, 8), 4000, dtype=np.uint16)), "PNG")
    error = rejected(sixteen_bit)
    assert error.kind == "image_mode" and "I;16" in str(error)
    # a palette with a transparent entry: the processor composites it on white, as it does RGBA
    palette = encode(Image.new("RGB", (8, 8)).convert("P"), "PNG", transparency=0)
    assert image_facts(palette).mode == "P"
    assert image_facts(encode(Image.new("CMYK", (8, 8), (1, 2, 3, 4)), "JPEG")).mode == "CMYK"
    assert {"L", "RGB", "RGBA", "LA", "P", "CMYK"} <= ACCEPTED_MODES


@pytest.mark.parametrize("image_format", ["GIF", "PNG", "WEBP"])
def test_animated_files_are_rejected(image_format):
    frames = [Image.new("RGB", (16, 16), (80 * index, 0, 255 - 80 * index)) for index in range(3)]
    data = encode(frames[0], image_format, save_all=True, append_images=frames[1:], duration=100)
    error = rejected(data)
    assert error.kind == "image_animated" and "3 frames" in str(error)


def test_orientation_stored_after_the_pixels_of_a_png():
    """A PNG may keep its eXIf chunk after IDAT: Pillow finds it only by decoding, and so do we (rare)."""
    exif = Image.Exif()
    exif[0x0112] = 8
    plain = encode(Image.new("RGB", (30, 20)), "PNG")
    iend = plain.rindex(b"IEND") - 4
    late = plain[:iend] + png_chunk(b"eXIf", exif.tobytes()) + plain[iend:]
    facts = image_facts(late)
    assert facts.orientation == 8 and (facts.width, facts.height) == (20, 30)
    assert ImageOps.exif_transpose(Image.open(io.BytesIO(late))).size == (20, 30)


def test_without_pillow_a_vision_feature_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(PacktoolError, match=r'pip install "packtool\[vision\]"'):
        image_facts(b"\x89PNG")
