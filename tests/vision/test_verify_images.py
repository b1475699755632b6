"""`packtool verify` of a build with images: a sound one passes, and each damage to what the image columns promise
is a problem naming it (commands.verify_images)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_shards_vision import images_placed, packs, vision_config  # noqa: F401 (images_placed: a fixture)

from packtool.builder import build
from packtool.commands.verify import format_verification, verify
from packtool.config import load_config
from packtool.format import PROCESSOR_FOLDER, pack_hash, read_manifest


@pytest.fixture
def built(images_placed):  # noqa: F811
    build(load_config(vision_config(images_placed)))
    return images_placed


def rewritten(out, column, change):
    """Rewrite the first shard holding an image with `change(row)` applied to `column` of that row."""
    for entry in read_manifest(out).shards:
        table = pq.read_table(entry.file)
        rows = table.to_pylist()
        at = next((i for i, row in enumerate(rows) if row["image_refs"]), None)
        if at is None:
            continue
        rows[at][column] = change(rows[at])
        schema = pq.read_schema(entry.file)
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), entry.file)
        return rows[at]
    raise AssertionError("no pack holds an image")


def problems(out) -> str:
    result = verify(out)
    assert not result.ok
    return "\n".join(result.problems)


def test_a_sound_build_with_images_verifies(built):
    result = verify(built / "out")
    assert result.ok, result.problems


def test_the_ok_line_says_which_images_were_checked(built):
    """Each referenced file hashed once, each embedded image's bytes hashed: the OK line and --json count them."""
    rows = packs(built / "out")
    files = {ref for row in rows for ref in row["image_refs"] if ref}
    embedded = sum(1 for row in rows for data in row["image_data"] if data)
    assert files and embedded
    result = verify(built / "out")
    assert result.images is not None and result.images.as_dict() == {"files": len(files), "embedded": embedded}
    assert format_verification(result).endswith(f"card; images checked: {len(files)} file(s), {embedded} embedded)")
    assert result.as_dict()["images"] == {"files": len(files), "embedded": embedded}
    shard = read_manifest(built / "out").shards[0].file
    assert "images checked: " in format_verification(verify(shard))  # one shard: what that shard references


def test_a_changed_or_missing_image_file_is_named(built):
    out = built / "out"
    files = sorted((built / "images").iterdir())
    files[0].write_bytes(files[0].read_bytes() + b"!")
    files[1].unlink()
    found = problems(out)
    assert f"image {files[0]}: sha256" in found and "changed after the build" in found
    assert f"image {files[1]}: cannot be read" in found


def test_a_changed_processor_file_is_named(built):
    copied = built / "out" / PROCESSOR_FOLDER / "preprocessor_config.json"
    copied.write_text(copied.read_text().replace("50176", "50177"))
    assert "preprocessor_config.json: sha256 differs from the manifest" in problems(built / "out")


@pytest.mark.parametrize(
    ("column", "change", "expected"),
    [
        ("image_spans", lambda row: [v + 1 for v in row["image_spans"]], "is not the image token"),
        ("image_grids", lambda row: [1, 2, 2 * 40, *row["image_grids"][3:]], "its grid [1, 2, 80] gives 40"),
        (
            "mrope_positions",
            lambda row: [v + (i == 5) for i, v in enumerate(row["mrope_positions"])],
            "mrope_positions differ",
        ),
        ("image_documents", lambda row: [99] * len(row["image_documents"]), "are not documents of the pack"),
        ("image_sha256", lambda row: ["0" * 64] * len(row["image_sha256"]), "record"),
        ("image_refs", lambda row: row["image_refs"][:-1], "values for"),
    ],
)
def test_each_damaged_image_column_is_a_problem(built, column, change, expected):
    rewritten(built / "out", column, change)
    assert expected in problems(built / "out")


def test_an_image_token_outside_every_span_is_a_problem(built):
    out = built / "out"
    token = read_manifest(out).vision["image_token_id"]

    def stray(row):
        """The token after the pack's last image becomes the image token, its label and pack hash to match."""
        ids, labels = list(row["input_ids"]), list(row["labels"])
        end = max(row["image_spans"][1::2])
        ids[end] = token
        labels[end] = token if labels[end] != -100 else -100
        row["labels"] = labels
        row["pack_hash"] = pack_hash(np.array(ids), np.array(labels), np.array(row["cu_seqlens"]))
        return ids

    rewritten(out, "input_ids", stray)
    assert "outside every image span" in problems(out)


def test_embedded_bytes_that_do_not_hash_are_a_problem(images_placed):  # noqa: F811
    build(load_config(vision_config(images_placed, images="embed")))
    out = images_placed / "out"
    result = verify(out)
    assert result.ok and result.images is not None
    assert result.images.as_dict() == {"files": 0, "embedded": read_manifest(out).vision["n_images"]}
    rewritten(out, "image_data", lambda row: [data + b"x" for data in row["image_data"]])
    assert "its stored bytes do not hash as recorded" in problems(out)
    assert hashlib.sha256(b"").hexdigest()  # empty data would be a reference's: embed builds hold every image


def test_a_damaged_vision_field_is_one_line(built):
    from packtool.errors import PackFormatError

    out = built / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["vision"]["images"] = "pictures"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert "vision.images must be one of reference, embed, got 'pictures'" in problems(out)
    with pytest.raises(PackFormatError, match=r"vision\.images must be one of"):
        read_manifest(out)
