"""Records keep their images when the build has a processor (read_file(images=True)): image content parts,
TRL's bare parts with an `images` column, LLaMA-Factory's `<image>` placeholders, Parquet / `datasets` Image
cells; relative paths against the data file's folder or the source's image_root."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from packtool.config import DEFAULT_FIELDS, DEFAULT_SHAREGPT_ROLES, SourceConfig
from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.sources import read_file
from packtool.vision.inputs import ImageRef

ANSWER = {"role": "assistant", "content": "A cat."}


def read(tmp_path: Path, fmt: str, records: list[dict], *, images: bool = True, **settings) -> list:
    path = tmp_path / "data" / "chat.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    roles = dict(DEFAULT_SHAREGPT_ROLES) if fmt == "sharegpt" else {}
    source = SourceConfig("src", (str(path),), (), fmt, dict(DEFAULT_FIELDS[fmt]), role_map=roles, **settings)
    return list(read_file(source, str(path), images=images))


def test_content_parts_place_their_images_in_the_text(tmp_path):
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": "a.png"},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": "sub/b.png"}},
        {"type": "image", "path": "/abs/c.png"},
    ]
    (example,) = read(tmp_path, "messages", [{"messages": [{"role": "user", "content": parts}, ANSWER]}])
    user = example.messages[0]
    assert (user.content, user.image_at) == ("Compare with", (8, 12, 12))
    assert user.pieces() == ["Compare ", "with", "", ""]
    assert user.as_template_dict()["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": "with"},
        {"type": "image"},
        {"type": "image"},
    ]
    folder = tmp_path / "data"
    assert example.images == (
        ImageRef("messages[0].content[1]", path=folder / "a.png"),
        ImageRef("messages[0].content[3]", path=folder / "sub/b.png"),
        ImageRef("messages[0].content[4]", path=Path("/abs/c.png")),
    )
    assert example.messages[1].image_at == () and example.messages[1].as_template_dict()["content"] == "A cat."


def test_llamafactory_placeholders_are_cut_out_where_the_images_go(tmp_path):
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "<image>What is it?<image>"},
            {"from": "gpt", "value": "A cat."},
            {"from": "human", "value": "And <image>?"},
            {"from": "gpt", "value": "A dog."},
        ],
        "images": ["a.png", "b.png", "c.png"],
    }
    alpaca = {"instruction": "Name <image>.", "input": "<image>", "output": "Two.", "images": ["a.png", "b.png"]}
    (chat,) = read(tmp_path, "sharegpt", [sharegpt])
    assert [(m.content, m.image_at) for m in chat.messages] == [
        ("What is it?", (0, 11)),
        ("A cat.", ()),
        ("And ?", (4,)),
        ("A dog.", ()),
    ]
    assert [ref.path.name for ref in chat.images] == ["a.png", "b.png", "c.png"]
    assert [ref.field for ref in chat.images] == ["images[0]", "images[1]", "images[2]"]
    (instruction,) = read(tmp_path, "alpaca", [alpaca])
    assert (instruction.messages[0].content, instruction.messages[0].image_at) == ("Name .\n\n", (5, 8))


def test_trl_bare_image_parts_take_the_images_column_in_order(tmp_path):
    png = base64.b64encode(b"\x89PNG bytes").decode()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        ANSWER,
    ]
    record = {"messages": messages, "images": ["a.png", f"data:image/png;base64,{png}"]}
    (example,) = read(tmp_path, "messages", [record])
    assert example.images[0] == ImageRef("images[0]", path=tmp_path / "data" / "a.png")
    assert example.images[1] == ImageRef("images[1]", data=b"\x89PNG bytes")
    (error,) = read(tmp_path, "messages", [{**record, "images": ["a.png"]}])
    assert isinstance(error, RecordError) and (error.kind, error.field) == ("bad_record", "messages[0].content[2]")
    (error,) = read(tmp_path, "messages", [{**record, "images": ["a.png", "b.png", "c.png"]}])
    assert isinstance(error, RecordError) and error.kind == "image_count_mismatch"
    named = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]}, ANSWER]
    (error,) = read(tmp_path, "messages", [{"messages": named, "images": ["b.png"]}])  # b.png would go unseen
    assert isinstance(error, RecordError) and error.kind == "image_count_mismatch"
    assert "0 image part(s) without an image for 1 image(s)" in error.reason


def test_image_root_is_where_relative_paths_are(tmp_path):
    root = tmp_path / "pictures"
    record = {"conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "A cat."}]}
    (example,) = read(tmp_path, "sharegpt", [{**record, "images": ["cat.png"]}], image_root=str(root))
    assert example.images[0].path == root / "cat.png"


def test_parquet_image_cells_bytes_or_path(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    user = {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "What?"}]}
    answer = {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}
    rows = [
        {"messages": [user, answer], "images": [{"bytes": b"\x89PNG cell", "path": "ignored.png"}]},
        {"messages": [user, answer], "images": [{"bytes": None, "path": "on_disk.png"}]},
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    source = SourceConfig("src", (str(path),), (), "messages", dict(DEFAULT_FIELDS["messages"]))
    carried, named = read_file(source, str(path), images=True)
    assert carried.images == (ImageRef("images[0]", data=b"\x89PNG cell"),)
    assert named.images == (ImageRef("images[0]", path=tmp_path / "on_disk.png"),)
    assert carried.messages[0] == Message("user", "What?", image_at=(0,))
    (refused, _) = read_file(source, str(path))  # no processor: rejected, naming the setting
    assert isinstance(refused, RecordError) and refused.kind == "images_not_supported"
    assert "`processor:`" in refused.reason


@pytest.mark.parametrize(
    ("fmt", "record", "says"),
    [
        ("messages", {"messages": [{"role": "user", "content": "Hi"}, ANSWER], "videos": ["a.mp4"]}, "videos yet"),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}, ANSWER]},
            "videos yet",
        ),
        ("preference", {"prompt": "<image>?", "chosen": "a", "rejected": "b", "images": ["a.png"]}, "not preference"),
        ("text", {"text": "<image> a page", "images": ["a.png"]}, "not text"),
    ],
)
def test_media_a_build_does_not_make_stay_rejected(tmp_path, fmt, record, says):
    (error,) = read(tmp_path, fmt, [record])
    assert isinstance(error, RecordError) and error.kind == "images_not_supported" and says in error.reason


def test_a_record_without_images_reads_as_before(tmp_path):
    record = {"messages": [{"role": "user", "content": "Say <image> twice."}, ANSWER]}
    with_images, without = read(tmp_path, "messages", [record]), read(tmp_path, "messages", [record], images=False)
    assert with_images == without and isinstance(with_images[0], Example) and with_images[0].images == ()
