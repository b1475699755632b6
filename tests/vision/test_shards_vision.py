"""The shards and manifest of a build with images (docs/format.md "Images"): each pack's images in token order with
their spans in the pack row, their documents, grids, references and bytes, and (mRoPE) every token's positions
equal to each document's own from packtool.vision.positions; the processor's files copied into OUT/processor/.

Until the encode stage fills Tokenized.images from records, these builds give the quickstart's chats images by
placing a synthetic one in each chosen sample as the store receives it: the store, plan, emit and manifest are
what is tested, on real builds of real records."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import QUICKSTART

from packtool.builder import build
from packtool.builder.emit import _packed, _Segments
from packtool.builder.plan_files import VisionPlan
from packtool.builder.store import SINGLE, PartitionWriter
from packtool.config import load_config
from packtool.format import IMAGE_FIELDS, PROCESSOR_FOLDER, WHOLE, read_manifest
from packtool.packing import PackPlan
from packtool.records import ROLE_CODES, PlacedImage, Tokenized
from packtool.vision.positions import pack_positions
from packtool.vision.processors import Grid

IMAGE_TOKEN = 7  # the token the synthetic images take (the quickstart tokenizer has no image token)
QWEN2_VL = {
    "processor_class": "Qwen2VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 50176,
}


def png(seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8 + seed % 5, 6 + seed % 3), (seed * 40 % 256, 90, 200)).save(out, "PNG")
    return out.getvalue()


def with_image(sample: Tokenized, number: int, folder: Path, embedded: bool) -> Tokenized:
    """The sample with one image placed over tokens of its first user message (the text around it kept)."""
    user = np.flatnonzero(sample.roles == ROLE_CODES["user"])
    if len(user) < 4:
        return sample
    n_tokens = min(1 + number % 6, len(user) - 3)
    start = int(user[1])
    data = png(number)
    reference = ""
    if not embedded:
        reference = f"images/{number}.png"
        (folder / reference).write_bytes(data)
    image = PlacedImage(
        reference=reference,
        sha256=hashlib.sha256(data).hexdigest(),
        n_bytes=len(data),
        width=28,
        height=28 * n_tokens,
        grid=(1, 2, 2 * n_tokens),
        start=start,
        end=start + n_tokens,
        data=data if embedded else None,
    )
    ids = sample.input_ids.copy()
    ids[start : start + n_tokens] = IMAGE_TOKEN
    targets = sample.targets.copy()
    targets[start : start + n_tokens] = False
    return dataclasses.replace(sample, input_ids=ids, targets=targets, images=(image,))


@pytest.fixture
def images_placed(monkeypatch, tmp_path):
    """Every other stored chat sample gets an image; every third of those carries its bytes (no file)."""
    (tmp_path / "images").mkdir()
    append = PartitionWriter.append
    numbers = iter(range(10_000))

    def placing(self, sample, *args, **kwargs):
        if sample.source == "chat" and not sample.images:
            number = next(numbers)
            if number % 2 == 0:
                sample = with_image(sample, number, tmp_path, embedded=number % 3 == 0)
        return append(self, sample, *args, **kwargs)

    monkeypatch.setattr(PartitionWriter, "append", placing)
    return tmp_path


def vision_config(folder: Path, **settings) -> Path:
    processor = folder / "processor-in"
    processor.mkdir(exist_ok=True)
    (processor / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL))
    config = {
        "sources": [
            {"name": "chat", "path": str(QUICKSTART / "chat.jsonl"), "format": "messages", "fields": {"id": "id"}},
            {"name": "instructions", "path": str(QUICKSTART / "alpaca.jsonl"), "format": "alpaca"},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "processor": "processor-in",
        "capacity": 4096,
        "output": "out",
        "executor": "serial",
        "rows_per_shard": 8,
        **settings,
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def packs(out: Path) -> list[dict]:
    return [row for entry in read_manifest(out).shards for row in pq.read_table(entry.file).to_pylist()]


def check_pack(row: dict, merge_size: int = 2) -> int:
    """A pack's image columns agree with its tokens, documents and positions; its number of images."""
    n = len(row["input_ids"])
    documents = np.diff(row["doc_cu_seqlens"])
    starts = np.asarray(row["doc_cu_seqlens"][:-1])
    spans = np.asarray(row["image_spans"]).reshape(-1, 2)
    grids = np.asarray(row["image_grids"]).reshape(-1, 3)
    k = len(row["image_refs"])
    assert len(row["image_sha256"]) == len(row["image_sizes"]) == len(row["image_documents"]) == k
    assert len(row["image_data"]) == len(spans) == len(grids) == k
    parts: list[list[int | Grid]] = [[] for _ in documents]
    at = starts.copy()
    for (start, end), grid, document in zip(spans.tolist(), grids.tolist(), row["image_documents"]):
        assert starts[document] <= start < end <= starts[document] + documents[document]
        assert end - start == grid[0] * grid[1] * grid[2] // merge_size**2
        assert (np.asarray(row["input_ids"][start:end]) == IMAGE_TOKEN).all()
        assert (np.asarray(row["labels"][start:end]) == -100).all()
        parts[document] += [int(start - at[document]), Grid(*grid)]
        at[document] = end
    for d, length in enumerate(documents.tolist()):
        parts[d].append(int(starts[d] + length - at[d]))
    positions = pack_positions(parts, merge_size)
    assert np.array_equal(np.asarray(row["mrope_positions"]).reshape(3, n), positions)
    return k


def test_a_build_with_images_writes_their_columns_manifest_and_processor(images_placed):
    folder = images_placed
    built = build(load_config(vision_config(folder)))
    out = folder / "out"
    manifest = read_manifest(out)
    rows = packs(out)
    columns = pq.read_schema(manifest.shards[0].file).names
    assert columns[-len(IMAGE_FIELDS) - 1 :] == ["mrope_positions", *(f.name for f in IMAGE_FIELDS)]
    n_images = sum(check_pack(row) for row in rows)
    assert n_images > 10
    named = ("image_refs", "image_data", "image_sha256")
    refs = [image for row in rows for image in zip(*(row[c] for c in named))]
    for ref, data, sha in refs:
        stored = data if ref == "" else (folder / ref).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == sha
        assert (data == b"") == (ref != "")  # images: reference keeps files out of the shards
    assert {ref == "" for ref, _, _ in refs} == {True, False}

    vision = manifest.vision
    assert vision["n_images"] == n_images == built.manifest["stats"]["images"]["images"]
    assert vision["image_token_id"] == IMAGE_TOKEN and vision["images"] == "reference"
    assert vision["root"] == str(folder.resolve())
    assert vision["processor"]["family"] == "qwen2_vl" and vision["processor"]["class"] == "Qwen2VLProcessor"
    copied = out / PROCESSOR_FOLDER / "preprocessor_config.json"
    assert vision["processor"]["files"] == {"preprocessor_config.json": hashlib.sha256(copied.read_bytes()).hexdigest()}
    stats = manifest.raw["stats"]["images"]
    assert stats["sources"]["instructions"]["images"] == 0
    assert stats["sources"]["chat"]["images"] == n_images
    assert stats["per_pack"]["images"]["max"] >= 1


def test_images_embed_stores_every_file_in_the_shards(images_placed):
    folder = images_placed
    build(load_config(vision_config(folder, images="embed")))
    rows = packs(folder / "out")
    embedded = [(data, sha) for row in rows for data, sha in zip(row["image_data"], row["image_sha256"])]
    assert embedded and all(hashlib.sha256(data).hexdigest() == sha for data, sha in embedded)
    assert read_manifest(folder / "out").vision["images"] == "embed"


def test_images_embed_stores_a_file_changed_since_it_was_encoded_as_it_is_now(images_placed):
    """The token store's entry of an image changed since (no key holds an image's content) is encoded again
    (builder.encode.stale_image), so the bytes embedded are the file's now, under its new hash."""
    folder = images_placed
    build(load_config(vision_config(folder)))  # encoded once: the store holds the images' hashes
    for path in (folder / "images").iterdir():
        path.write_bytes(path.read_bytes() + b"x")
    build(load_config(vision_config(folder, images="embed")))
    rows = packs(folder / "out")
    files = [
        (folder / ref, data, sha)
        for row in rows
        for ref, data, sha in zip(row["image_refs"], row["image_data"], row["image_sha256"])
        if ref
    ]
    assert files and all(
        data == path.read_bytes() and hashlib.sha256(data).hexdigest() == sha for path, data, sha in files
    )


def test_a_text_build_writes_no_image_column():
    config = load_config(QUICKSTART.parent / "quickstart.yaml")
    assert config.processor is None  # the quickstart builds of tests/test_shards.py keep their bytes


class FakeGather:
    def __init__(self, samples: list[tuple[int, tuple[PlacedImage, ...]]], vision: VisionPlan):
        self.samples = samples
        self.plan = type("P", (), {"schema_version": 1, "vision": vision})()

    def segments(self, ks: np.ndarray) -> _Segments:
        picked = [self.samples[k] for k in ks.tolist()]
        ids = []
        for n, images in picked:
            row = np.arange(n, dtype=np.int32) % 5 + 100
            for image in images:
                row[image.start : image.end] = IMAGE_TOKEN
            ids.append(row)
        return _Segments(
            lengths=np.array([n for n, _ in picked], dtype=np.int64),
            input_ids=np.concatenate(ids),
            targets=np.ones(sum(n for n, _ in picked), dtype=bool),
            roles=np.zeros(sum(n for n, _ in picked), dtype=np.int8),
            example_ids=[f"s{k}" for k in ks.tolist()],
            sample_hashes=["0" * 64] * len(ks),
            sources=["chat"] * len(ks),
            repeats=np.zeros(len(ks), dtype=np.int32),
            segment_roles=[SINGLE] * len(ks),
            groups=np.full(len(ks), -1),
            parts=np.tile(np.array([WHOLE, 0], dtype=np.int32), (len(ks), 1)),
            images=[images for _, images in picked],
        )


@pytest.mark.parametrize("seed", range(5))
def test_each_pack_holds_its_documents_images_and_positions(seed):
    """Emit's columns, pack by pack, against each document placed alone (pure: no build)."""
    rng = np.random.default_rng(seed)
    samples = []
    for k in range(30):
        n, images, at = int(rng.integers(5, 60)), [], 1
        while at < n - 6 and rng.random() < 0.6:
            tokens = int(rng.integers(1, 5))
            images.append(PlacedImage(f"i{k}-{at}.png", "a" * 64, 9, 28, 28, (1, 2, 2 * tokens), at, at + tokens))
            at += tokens + int(rng.integers(1, 6))
        samples.append((n, tuple(images)))
    members = rng.permutation(len(samples))
    cuts = np.sort(rng.choice(np.arange(1, len(samples)), size=6, replace=False))
    layout = PackPlan(members=members, offsets=np.array([0, *cuts.tolist(), len(samples)]))
    columns = _packed(FakeGather(samples, VisionPlan(2, False, "/")), layout, 1, 6)
    images = columns.images
    assert images is not None and images.mrope is not None
    for i in range(columns.packs):
        a, b = columns.token_offsets[i], columns.token_offsets[i + 1]
        c, d = columns.doc_cu_offsets[i], columns.doc_cu_offsets[i + 1]
        row = {
            "input_ids": columns.input_ids[a:b].tolist(),
            "labels": np.where(columns.input_ids[a:b] == IMAGE_TOKEN, -100, 0).tolist(),
            "doc_cu_seqlens": columns.doc_cu_seqlens[c:d].tolist(),
            "mrope_positions": images.mrope[3 * a : 3 * b].tolist(),
        }
        x, y = images.offsets[i], images.offsets[i + 1]
        row |= {
            "image_refs": images.refs[x:y],
            "image_sha256": images.sha256[x:y],
            "image_sizes": images.sizes[x:y].tolist(),
            "image_grids": images.grids[x:y].reshape(-1).tolist(),
            "image_spans": images.spans[x:y].reshape(-1).tolist(),
            "image_documents": images.documents[x:y].tolist(),
            "image_data": images.data[x:y],
        }
        members_here = members[layout.offsets[i + 1] : layout.offsets[i + 2]].tolist()
        assert check_pack(row) == sum(len(samples[k][1]) for k in members_here)


def test_a_shard_without_images_has_empty_image_columns_and_plain_positions():
    samples = [(n, ()) for n in (5, 3, 7)]
    layout = PackPlan(members=np.arange(3), offsets=np.array([0, 2, 3]))
    columns = _packed(FakeGather(samples, VisionPlan(2, True, "/")), layout, 0, 2)
    images = columns.images
    assert images is not None and images.offsets.tolist() == [0, 0, 0] and images.data == []
    assert images.grids.shape == (0, 3) and images.spans.shape == (0, 2)
    first = np.concatenate([np.arange(5), np.arange(3)])
    assert images.mrope is not None and images.mrope[:24].tolist() == np.tile(first, 3).tolist()


def test_images_embed_without_a_processor_is_one_config_line(tmp_path):
    from packtool.errors import ConfigError

    config = json.loads(vision_config(tmp_path).read_text())
    del config["processor"]
    (tmp_path / "text.json").write_text(json.dumps({**config, "images": "embed"}))
    with pytest.raises(ConfigError, match="images: embed stores the images of a build with an image processor"):
        load_config(tmp_path / "text.json")


def test_emit_embeds_only_the_bytes_that_were_encoded(tmp_path):
    """A file changed or gone between its encode and emit (another process writing it mid-build) is one line."""
    from packtool.builder.emit import _image_bytes
    from packtool.errors import BuildError

    data = png(1)
    (tmp_path / "a.png").write_bytes(data)
    image = PlacedImage("a.png", hashlib.sha256(data).hexdigest(), len(data), 8, 6, (1, 2, 2), 0, 1)
    embed = VisionPlan(2, True, str(tmp_path))
    assert _image_bytes(image, embed) == data
    assert _image_bytes(image, VisionPlan(2, False, str(tmp_path))) == b""
    carried = dataclasses.replace(image, reference="", data=data)
    assert _image_bytes(carried, VisionPlan(2, False, str(tmp_path))) == data
    (tmp_path / "a.png").write_bytes(data + b"x")
    with pytest.raises(BuildError, match=r"a\.png changed since it was encoded"):
        _image_bytes(image, embed)
    (tmp_path / "a.png").unlink()
    with pytest.raises(BuildError, match=r"cannot read .*a\.png"):
        _image_bytes(image, embed)
