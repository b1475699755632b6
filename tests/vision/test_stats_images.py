"""`packtool stats` of a build with images: images and image tokens per pack and per source, with their spread."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner
from test_shards_vision import images_placed, vision_config  # noqa: F401 (images_placed: a fixture)

from packtool.builder import build
from packtool.cli import main
from packtool.config import load_config
from packtool.format import read_manifest
from packtool.summaries import spread


def test_spread_of_an_amount():
    assert spread(np.array([0, 2, 2, 4])) == {"mean": 2.0, "min": 0, "p50": 2, "p90": 4, "max": 4, "cv": 0.707}
    assert spread(np.array([3, 3]))["cv"] == 0.0
    assert spread(np.array([], dtype=np.int64))["max"] == 0


def test_stats_prints_images_per_pack_and_per_source(images_placed):  # noqa: F811
    build(load_config(vision_config(images_placed)))
    out = images_placed / "out"
    images = read_manifest(out).raw["stats"]["images"]
    per_document = images["sources"]["chat"]["images_per_document"]
    assert images["images"] == sum(s["images"] for s in images["sources"].values()) > 0
    assert 0 < per_document["mean"] < 1 and per_document["min"] == 0 and per_document["max"] == 1  # every other
    assert images["per_pack"]["image_tokens"]["max"] >= images["per_pack"]["images"]["max"]
    result = CliRunner().invoke(main, ["stats", str(out)])
    assert result.exit_code == 0, result.output
    assert f"images {images['images']:,} ({images['image_tokens']:,} image tokens)" in result.output
    assert "per pack: images" in result.output and "chat" in result.output
