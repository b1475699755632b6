"""Where a record's images are (packtool.vision.inputs): paths, data: URIs, Image cells, URLs, placeholders."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from packtool.errors import RecordError
from packtool.vision.inputs import ImageRef, message_images, placeholder_images, record_texts, resolve

BASE = Path("/data/set")
PNG = b"\x89PNG\r\n\x1a\n"


def test_references_resolve_against_the_data_files_folder():
    assert resolve("img/cat.png", "images[0]", BASE) == ImageRef("images[0]", path=BASE / "img/cat.png")
    assert resolve("/abs/cat.png", "f", BASE).path == Path("/abs/cat.png")
    assert resolve("file:///abs/cat.png", "f", BASE).path == Path("/abs/cat.png")
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert resolve(uri, "f", BASE) == ImageRef("f", data=PNG)
    assert resolve({"bytes": PNG, "path": "ignored.png"}, "f", BASE).data == PNG  # a `datasets` Image cell
    assert resolve({"bytes": None, "path": "cat.png"}, "f", BASE).path == BASE / "cat.png"


@pytest.mark.parametrize(
    ("reference", "kind", "says"),
    [
        ("https://example.com/cat.png", "image_remote", "is a URL: packtool reads no network"),
        ("s3://bucket/cat.png", "image_remote", "is a URL"),
        ("data:image/png;base64,@@@", "image_corrupt", "not valid base64"),
        ("data:image/png,rawbytes", "bad_record", "must be base64"),
        (7, "bad_record", "got 7"),
        ("", "bad_record", "got ''"),
    ],
)
def test_references_that_cannot_be_read_are_rejects(reference, kind, says):
    with pytest.raises(RecordError, match=says) as caught:
        resolve(reference, "images[3]", BASE)
    assert (caught.value.kind, caught.value.field) == (kind, "images[3]")


def test_message_parts_in_conversation_order():
    messages = [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "and"}]},
        {"role": "user", "content": [{"type": "image", "path": "b.png"}, {"type": "image_url", "image_url": "c.png"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "d.png"}}]},
    ]
    refs = message_images(messages, BASE)
    assert [(ref.field, ref.path) for ref in refs] == [
        ("messages[1].content[0]", BASE / "a.png"),
        ("messages[2].content[0]", BASE / "b.png"),
        ("messages[2].content[1]", BASE / "c.png"),
        ("messages[3].content[0]", BASE / "d.png"),
    ]
    assert message_images("not a list", BASE) == ()
    with pytest.raises(RecordError, match="names no image") as caught:
        message_images([{"role": "user", "content": [{"type": "image"}]}], BASE)
    assert caught.value.field == "messages[0].content[0]"


def test_placeholders_match_the_images_one_for_one():
    record = {
        "conversations": [{"from": "human", "value": "<image><image>Compare."}, {"from": "gpt", "value": "Same."}],
        "images": ["a.png", "b.png"],
        "id": 4,
    }
    texts = record_texts(record)
    assert texts == ["human", "<image><image>Compare.", "gpt", "Same."]
    refs = placeholder_images(texts, record["images"], BASE)
    assert [ref.field for ref in refs] == ["images[0]", "images[1]"]
    with pytest.raises(RecordError, match=r"2 <image> placeholder\(s\) in the text for 1 image\(s\)") as caught:
        placeholder_images(texts, ["a.png"], BASE)
    assert caught.value.kind == "image_count_mismatch"
    assert len(placeholder_images(["<image>"], "one.png", BASE)) == 1  # a lone string is one image
