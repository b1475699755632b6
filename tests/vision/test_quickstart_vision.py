"""configs/quickstart-vision.yaml builds with no download and verifies: its chats keep their pictures, each
placed with the processor's grid, stored by reference or embedded, and the files it ships are what its generator
writes."""

from __future__ import annotations

import hashlib
import json
import shutil

import pyarrow.parquet as pq
import pytest
from support import REPO

from packtool.builder import build
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.format import read_manifest

CONFIG = REPO / "configs" / "quickstart-vision.yaml"
DATA = REPO / "configs" / "quickstart_vision"


@pytest.mark.parametrize("images", ["reference", "embed"])
def test_the_vision_quickstart_builds_and_verifies(tmp_path, images):
    pytest.importorskip("PIL")
    config = load_config(CONFIG, output=str(tmp_path / "out"), overrides=[f"images={images}"])
    built = build(config, use_cache=False)
    out = tmp_path / "out"
    result = verify(out)
    assert result.ok, result.problems
    manifest = read_manifest(out)
    records = [json.loads(line) for line in (DATA / "chat.jsonl").read_text().splitlines()]
    pictures = sum(
        len(r.get("images", []))
        + sum(1 for m in r["messages"] if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image")
        for r in records
    )
    vision = manifest.vision
    assert built.manifest["accounting"]["pictures"]["kept"] == len(records)  # nothing rejected
    assert vision["n_images"] == pictures and vision["images"] == images
    assert vision["processor"]["family"] == "qwen2_vl" and vision["root"] == str(CONFIG.parent)
    rows = pq.read_table(manifest.shards[0].file).to_pylist()
    for row in rows:
        for reference, digest, data in zip(row["image_refs"], row["image_sha256"], row["image_data"]):
            assert reference.startswith("quickstart_vision/images/")
            assert hashlib.sha256((CONFIG.parent / reference).read_bytes()).hexdigest() == digest
            assert (data != b"") == (images == "embed")


def test_the_shipped_pictures_are_small():
    pictures = sorted((DATA / "images").glob("*.png"))
    assert len(pictures) == 6 and sum(p.stat().st_size for p in pictures) < 4096


def test_an_image_changed_since_the_build_builds_again(tmp_path):
    """No encode key holds an image's content: the plan key holds the re-encoded partition's bytes, so OUT is not
    taken for up to date while one of its images changed."""
    from PIL import Image

    shutil.copytree(DATA, tmp_path / "quickstart_vision")
    shutil.copy(CONFIG, tmp_path / CONFIG.name)
    config = load_config(tmp_path / CONFIG.name, output=str(tmp_path / "out"))
    build(config)
    assert build(config).up_to_date
    picture = tmp_path / "quickstart_vision" / "images" / "red-square.png"
    Image.new("RGB", Image.open(picture).size, "black").save(picture)
    rebuilt = build(config)
    assert not rebuilt.up_to_date
    digest = hashlib.sha256(picture.read_bytes()).hexdigest()
    rows = pq.read_table(read_manifest(tmp_path / "out").shards[0].file).to_pylist()
    assert digest in {sha for row in rows for sha in row["image_sha256"]}
    assert verify(tmp_path / "out").ok


def test_processor_files_are_the_builds_own(tmp_path):
    """OUT/processor/ (and each sub-output's) is packtool's while it holds the recorded files alone: a rebuild
    replaces it, `push` uploads its files, and a file of the user's put there makes the folder the user's."""
    from packtool.builder.publish import user_entries
    from packtool.commands.push import push

    out = tmp_path / "out"
    settings = ["validation={share: 0.3}"]
    build(load_config(CONFIG, output=str(out), overrides=settings))
    assert user_entries(out) == []
    build(load_config(CONFIG, output=str(out), overrides=[*settings, "seed=5"]))
    assert verify(out).ok and (out / "validation" / "processor" / "preprocessor_config.json").is_file()
    uploaded = {name for name, _ in push(out, "someone/vision", dry_run=True).files}
    assert {"processor/preprocessor_config.json", "validation/processor/preprocessor_config.json"} <= uploaded
    (out / "processor" / "notes.txt").write_text("mine")
    assert user_entries(out) == ["processor"]


def test_the_loader_reads_every_picture_of_the_vision_quickstart(tmp_path):
    """The shards' image columns are what the loader reads: every picture loaded, checked against its sha256
    and preprocessed by transformers' image processor built from OUT/processor/ into the planned grid."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from packtool.loader import PackedDataset
    from packtool.loader.dataset import packed_batches

    out = tmp_path / "out"
    build(load_config(CONFIG, output=str(out)), use_cache=False)
    grids = [
        grid
        for entry in read_manifest(out).shards
        for row in pq.read_table(entry.file).to_pylist()
        for grid in zip(*[iter(row["image_grids"])] * 3)
    ]
    loaded = []
    for batch in packed_batches(PackedDataset(out, token_budget=256, shuffle=False), epochs=1):
        if batch.image_grid_thw is not None:
            loaded += [tuple(grid) for grid in batch.image_grid_thw.tolist()]
            assert batch.pixel_values is not None and len(batch.pixel_values) == int(batch.image_grid_thw.prod(1).sum())
    assert sorted(loaded) == sorted(grids) and len(loaded) == read_manifest(out).vision["n_images"]


def test_datasets_loads_a_vision_build_by_its_card(tmp_path):
    """The card's features are the shard schema with its image columns: `datasets` checks them as it loads."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "out"
    build(load_config(CONFIG, output=str(out)), use_cache=False)
    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf"))["train"]
    assert loaded.num_rows == read_manifest(out).shards[0].rows
    assert {"mrope_positions", "image_refs", "image_data"} <= set(loaded.column_names)
