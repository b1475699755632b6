"""The token store keeps each sample's images (every PlacedImage field, embedded bytes too) and gives them back
on every read: emit's parts, truncation's whole sample, and a grown range's rows carried over."""

from __future__ import annotations

import numpy as np

from packtool.builder.store import PartitionReader, PartitionWriter
from packtool.records import PlacedImage, Tokenized

ON_DISK = PlacedImage("photos/cat.png", "f" * 64, 1234, 300, 200, (1, 14, 22), 3, 80)
EMBEDDED = PlacedImage("", "e" * 64, 5, 2, 2, (1, 4, 4), 90, 94, data=b"\x89PNG!")


def sample(i: int, images: tuple[PlacedImage, ...] = ()) -> Tokenized:
    n = 100
    return Tokenized(
        f"f:{i}",
        "s",
        "0" * 64,
        np.arange(n, dtype=np.int32),
        np.ones(n, bool),
        np.zeros(n, np.int8),
        np.zeros(n, np.int16),
        images=images,
    )


def test_images_round_trip_through_a_partition(tmp_path):
    writer = PartitionWriter(tmp_path / "a.arrow", "src")
    for i, images in enumerate([(), (ON_DISK, EMBEDDED), (), (EMBEDDED,)]):
        writer.append(sample(i, images), f"f:{i}", i)
    writer.close()
    reader = PartitionReader(tmp_path / "a.arrow")
    assert [reader.parts(r).images for r in range(4)] == [(), (ON_DISK, EMBEDDED), (), (EMBEDDED,)]
    assert reader.tokenized(1).images == (ON_DISK, EMBEDDED)
    assert reader.get(3).images == (EMBEDDED,)

    carried = PartitionWriter(tmp_path / "b.arrow", "src")
    carried.extend(tmp_path / "a.arrow")
    carried.close()
    assert PartitionReader(tmp_path / "b.arrow").tokenized(1).images == (ON_DISK, EMBEDDED)
    assert (tmp_path / "b.arrow").read_bytes() == (tmp_path / "a.arrow").read_bytes()
