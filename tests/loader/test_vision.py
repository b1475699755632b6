"""A vision build through the loader (packtool.loader.vision): each pack's images read, checked by sha256,
preprocessed and checked against their planned grid; and the proof of issue 40: a tiny random Qwen2.5-VL fed
packed micro-batches through `model_inputs` gives each document the logits it gets alone through
transformers' processor path (Qwen2_5_VLProcessor on the same conversation and pictures).

The build is written here by hand with the shard columns and manifest object of the vision plan
(docs/format.md): ids, grids and positions come from the processor path and packtool.vision, the
shards from the project's own writer (conftest.write_build) with the vision columns added.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from support import images_only_processor, shared

from packtool.errors import DatasetError
from packtool.format import IMAGE_FIELDS, MANIFEST, MROPE_FIELD, sha256_file
from packtool.labels import cu_seqlens_from_lengths, labels_for
from packtool.records import ROLE_CODES
from packtool.shards import OutputPack, write_json_atomic
from packtool.vision.positions import mrope_positions
from packtool.vision.processors import Grid

Image = pytest.importorskip("PIL.Image")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from packtool.loader import PackedDataset, collate, packed_batches  # noqa: E402
from packtool.loader.boundaries import model_inputs  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen-VL chat templates render for one image
# Small pictures (4-16 image tokens each) keep the [T, V] logits of a 151,936-token vocabulary small.
PREPROCESSOR = {
    "processor_class": "Qwen2_5_VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 3136,
    "max_pixels": 28 * 28 * 16,
}
CAPACITY = 160


@dataclass(frozen=True)
class Document:
    text: str
    files: list[tuple[str, bytes, bool]]  # (name, bytes, embedded in the shard)

    def pictures(self) -> list:
        """Upright, as transformers' load_image hands a file to the processor (the build plans them so)."""
        from PIL import ImageOps

        return [ImageOps.exif_transpose(Image.open(io.BytesIO(data))) for _, data, _ in self.files]


@pytest.fixture(scope="module")
def processor():
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared("tokenizers", "qwen2.5"))
    return images_only_processor(Qwen2VLImageProcessorPil.from_dict(PREPROCESSOR), tokenizer)


def random_documents(rng: random.Random, n: int) -> list[Document]:
    """Conversations with 0-3 pictures each (PNG or JPEG, random sides, some turned by EXIF; some stored in the
    shard)."""
    documents = []
    for d in range(n):
        files = []
        for i in range(rng.choice([0, 1, 1, 2, 3])):
            pixels = np.random.default_rng(rng.randrange(2**32)).integers(
                0, 256, (rng.randint(8, 140), rng.randint(8, 140), 3)
            )
            kind = rng.choice(["PNG", "JPEG"])
            buffer = io.BytesIO()
            exif = Image.Exif()
            exif[0x0112] = rng.choice([1, 6, 8])  # orientation: upright or turned a quarter either way
            Image.fromarray(pixels.astype(np.uint8)).save(buffer, kind, exif=exif)
            files.append((f"pictures/{d}-{i}.{kind.lower()}", buffer.getvalue(), rng.random() < 0.3))
        question = "".join(IMAGE + rng.choice(["What is this?", "\n", "and"]) for _ in files) + f"Question {d}."
        text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nAnswer {d}.<|im_end|>\n"
        documents.append(Document(text, files))
    return documents


def alone(document: Document, processor) -> dict:
    """The processor path: the document's text and pictures through Qwen2_5_VLProcessor."""
    return dict(processor(text=[document.text], images=document.pictures() or None, return_tensors="pt"))


def segments_of(encoded: dict) -> list:
    """The document as mrope_positions takes it: text lengths and image grids, from the processor's token types."""
    kinds = encoded["mm_token_type_ids"][0].tolist()
    grids = iter(encoded.get("image_grid_thw", torch.zeros(0, 3)).tolist())
    out: list = []
    start = 0
    for end in range(1, len(kinds) + 1):
        if end == len(kinds) or kinds[end] != kinds[start]:
            out.append(Grid(*map(int, next(grids))) if kinds[start] else end - start)
            start = end
    return out


def write_vision_build(out: Path, root: Path, groups: list[list[Document]], processor, build_writer) -> Path:
    """A vision build of these packs (each a list of documents), its pictures under `root`: the text columns
    by the project's writer, then the vision columns, the processor folder and the manifest's vision object."""
    image_token = processor.image_token_id
    rows, vision = [], []
    for p, documents in enumerate(groups):
        encoded = [alone(d, processor) for d in documents]
        ids = np.concatenate([e["input_ids"][0].numpy() for e in encoded]).astype(np.int32)
        cu = cu_seqlens_from_lengths([e["input_ids"].shape[1] for e in encoded])
        labels = labels_for(ids, ids != image_token, cu)  # as the build: no image token is a target
        rows.append(
            OutputPack(
                ids, labels, cu, cu, np.full(len(ids), ROLE_CODES["text"], np.int8),
                [f"doc:{p}-{i}" for i in range(len(documents))], ["0" * 32] * len(documents),
                [0] * len(documents), ["vision"] * len(documents),
            )
        )  # fmt: skip
        files = [(f, doc) for doc, d in enumerate(documents) for f in d.files]
        spans = [(lo + cu[doc], hi + cu[doc]) for doc, e in enumerate(encoded) for lo, hi in _runs(e)]
        grids = [g for e in encoded for g in e.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)).tolist()]
        positions = np.concatenate([mrope_positions(segments_of(e), 2) for e in encoded], axis=1)
        vision.append(
            {
                "mrope_positions": positions.reshape(-1).tolist(),
                "image_refs": ["" if embedded else name for (name, _, embedded), _ in files],
                "image_sha256": [_sha256(data) for (_, data, _), _ in files],
                "image_sizes": [len(data) for (_, data, _), _ in files],
                "image_grids": [v for g in grids for v in g],
                "image_spans": [v for s in spans for v in s],
                "image_documents": [doc for _, doc in files],
                "image_data": [data if embedded else b"" for (_, data, embedded), _ in files],
            }
        )
        for (name, data, embedded), _ in files:
            if not embedded:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_bytes(data)
    build_writer(out, rows, capacity=CAPACITY, packs_per_shard=3, row_group_size=2)
    manifest = json.loads((out / MANIFEST).read_text())
    at = 0
    for entry in manifest["shards"]:
        file = out / entry["file"]
        table = pq.read_table(file)
        for field in [MROPE_FIELD, *IMAGE_FIELDS]:  # after the others, as a vision build writes them
            values = [v[field.name] for v in vision[at : at + table.num_rows]]
            table = table.append_column(field, pa.array(values, field.type))
        pq.write_table(table, file, row_group_size=2)
        entry.update(bytes=file.stat().st_size, sha256=sha256_file(file))
        at += table.num_rows
    (out / "processor").mkdir()
    (out / "processor" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    manifest["vision"] = {
        "processor": {
            "family": "qwen2_5_vl",
            "class": "Qwen2_5_VLProcessor",
            "files": {"preprocessor_config.json": sha256_file(out / "processor" / "preprocessor_config.json")},
        },
        "image_token_id": image_token,
        "images": "reference",
        "root": str(root.resolve()),
        "n_images": sum(len(v["image_refs"]) for v in vision),
        "n_image_tokens": int(sum(np.prod(np.reshape(v["image_grids"], (-1, 3)), axis=1).sum() // 4 for v in vision)),
    }
    write_json_atomic(out / MANIFEST, manifest)
    return out


def _runs(encoded: dict) -> list[tuple[int, int]]:
    """[start, end) of each image's tokens in the document."""
    kinds = np.asarray([*encoded["mm_token_type_ids"][0].tolist(), 0])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], kinds])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def tiny_qwen2_5_vl():
    """A random Qwen2.5-VL: two decoder layers, a two-block vision tower (one windowed, one full), float32."""
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 151_936,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
            "use_cache": True,  # the checkpoints' default: model_inputs must turn it off
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
            "window_size": 56,  # windows of 2 x 2 merged patches: pictures of several windows
        },
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen2_vl(image_token_id: int):
    """A random Qwen2-VL on the vision quickstart's vocabulary (configs/quickstart_vision/model: 4,096 text tokens,
    then its vision tokens): two decoder layers, a two-block vision tower, float32."""
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config={
            "vocab_size": 4100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2},
        image_token_id=image_token_id,
        video_token_id=4099,
        vision_start_token_id=4096,
        vision_end_token_id=4098,
    )
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return random_documents(random.Random(40), 9)


@pytest.fixture
def vision_build(tmp_path, documents, processor, build_writer):
    groups, pack = [], []
    for document in documents:  # first fit in order: 1-3 documents a pack
        if pack and sum(alone(d, processor)["input_ids"].shape[1] for d in [*pack, document]) > CAPACITY:
            groups.append(pack)
            pack = []
        pack.append(document)
    groups.append(pack)
    return write_vision_build(tmp_path / "out", tmp_path / "images", groups, processor, build_writer)


def _micro_batches(path: Path, how: str):
    if how == "collate":  # the Trainer's way: packs in plan order, collated
        return [collate(list(PackedDataset(path, shuffle=False)))]
    dataset = PackedDataset(path, shuffle=False, token_budget=4 * CAPACITY, fixed_shape=how == "fixed_shape")
    return list(packed_batches(dataset))


@pytest.mark.parametrize("how", ["packed_batches", "fixed_shape", "collate"])
def test_packed_logits_equal_each_document_alone_through_the_processor_path(vision_build, documents, processor, how):
    model = tiny_qwen2_5_vl()
    expected = {}
    with torch.no_grad():
        for document in documents:
            encoded = alone(document, processor)
            expected[tuple(encoded["input_ids"][0].tolist())] = (model(**encoded).logits[0], encoded)
        seen = 0
        for mb in _micro_batches(vision_build, how):
            assert mb.mrope_position_ids.shape == (3, 1, mb.n_tokens)
            logits = model(**model_inputs(mb, model)).logits[0]
            grids = []
            for lo, hi in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist(), strict=True):
                key = tuple(mb.input_ids[0, lo:hi].tolist())
                if key not in expected:  # fixed-shape padding
                    continue
                want, encoded = expected[key]
                torch.testing.assert_close(logits[lo:hi], want, rtol=0, atol=1e-5)
                grids += encoded.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)).tolist()
                seen += 1
            assert mb.image_grid_thw.tolist() == grids  # the images in token order, as planned
    assert seen == len(documents)
    assert sum(len(d.files) for d in documents) >= 8 and any(not d.files for d in documents)


def test_the_text_row_is_what_keeps_the_documents_apart(vision_build, documents, processor):
    """Without the restarting text row (3-row positions), attention runs across the documents of the row."""
    model = tiny_qwen2_5_vl()
    mb = _micro_batches(vision_build, "packed_batches")[0]
    inputs = model_inputs(mb, model)
    assert inputs["position_ids"].shape == (4, 1, mb.n_tokens)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        leaky = model(**{**inputs, "position_ids": inputs["position_ids"][1:]}).logits[0]
    last = mb.cu_seqlens[-2].item()
    assert (packed[last:] - leaky[last:]).abs().max() > 1e-3


def test_an_image_changed_since_the_build_is_named(vision_build):
    manifest = json.loads((vision_build / MANIFEST).read_text())
    root = Path(manifest["vision"]["root"])
    changed = sorted(root.rglob("*.png")) or sorted(root.rglob("*.jpeg"))
    changed[0].write_bytes(changed[0].read_bytes() + b"\0")
    with pytest.raises(DatasetError, match=rf"{changed[0].name}.*sha256 .* != recorded"):
        _micro_batches(vision_build, "packed_batches")


def test_images_moved_elsewhere_are_read_from_image_root(vision_build, tmp_path):
    root = tmp_path / "images"
    moved = root.rename(tmp_path / "moved")
    with pytest.raises(DatasetError, match=r"cannot read .*pictures.*pass image_root="):
        _micro_batches(vision_build, "packed_batches")
    dataset = PackedDataset(vision_build, shuffle=False, token_budget=4 * CAPACITY, image_root=moved)
    assert sum(len(mb.image_grid_thw) for mb in packed_batches(dataset)) >= 8


def test_a_grid_other_than_the_planned_one_is_named(vision_build):
    """The image processor is the build's (its files checked), so a grid that differs is a shard written wrong."""
    file = sorted(vision_build.glob("*.parquet"))[0]
    table = pq.read_table(file)
    grids = table.column("image_grids").to_pylist()
    row = next(i for i, g in enumerate(grids) if g)
    grids[row][1] += 2  # the first image's height, in patches
    index = table.column_names.index("image_grids")
    field = next(f for f in IMAGE_FIELDS if f.name == "image_grids")
    table = table.set_column(index, field, pa.array(grids, field.type))
    pq.write_table(table, file, row_group_size=2)
    manifest = json.loads((vision_build / MANIFEST).read_text())
    entry = next(e for e in manifest["shards"] if e["file"] == file.name)
    entry.update(bytes=file.stat().st_size, sha256=sha256_file(file))
    write_json_atomic(vision_build / MANIFEST, manifest)
    with pytest.raises(DatasetError, match=rf"{file.name} row {row}: image 0 .*the processor gives grid .* planned"):
        list(PackedDataset(vision_build, shuffle=False))


def test_a_changed_image_processor_is_refused(vision_build):
    config = vision_build / "processor" / "preprocessor_config.json"
    config.write_text(json.dumps({**PREPROCESSOR, "max_pixels": 28 * 28 * 64}))
    with pytest.raises(DatasetError, match=r"preprocessor_config\.json: changed since the build"):
        _micro_batches(vision_build, "packed_batches")


def test_shards_and_manifest_of_different_builds_are_refused(vision_build):
    manifest = json.loads((vision_build / MANIFEST).read_text())
    del manifest["vision"]
    write_json_atomic(vision_build / MANIFEST, manifest)
    with pytest.raises(DatasetError, match="image columns and the manifest no vision object"):
        PackedDataset(vision_build)


def test_images_given_to_a_model_without_a_vision_tower_are_refused(vision_build):
    mb = _micro_batches(vision_build, "packed_batches")[0]
    config = transformers.Qwen2Config(
        vocab_size=151_936, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(DatasetError, match=r"holds \d+ images and Qwen2ForCausalLM's forward takes no pixel_values"):
        model_inputs(mb, transformers.Qwen2ForCausalLM(config))


def test_a_vision_micro_batch_moves_its_images_with_it(vision_build):
    mb = _micro_batches(vision_build, "packed_batches")[0]
    moved = mb.to("meta")
    assert moved.pixel_values.device.type == moved.mrope_position_ids.device.type == "meta"
    assert replace(mb, pixel_values=None).vision_inputs() == {}


def test_workers_preprocess_the_images(vision_build):
    def batches(workers: int) -> list:
        dataset = PackedDataset(vision_build, shuffle=False, token_budget=CAPACITY, num_workers=workers)
        return list(packed_batches(dataset))

    here, there = batches(0), batches(2)
    assert [mb.pack_hashes for mb in here] == [mb.pack_hashes for mb in there]
    for a, b in zip(here, there, strict=True):
        assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)
        assert torch.equal(a.mrope_position_ids, b.mrope_position_ids)


def test_a_trainer_trains_a_vision_build(vision_build, tmp_path):
    """PackedTrainer's collator feeds the images; TRL's padding-free examples, which cannot hold them, refuse."""
    from packtool.loader.hf import PackedTrainer, sft_example, trainer_dataset

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    fed: list[int] = []

    class Recording(PackedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            fed.append(len(inputs.get("image_grid_thw", ())))
            assert inputs["position_ids"].shape[0] == 4
            return super().training_step(model, inputs, num_items_in_batch)

    dataset = trainer_dataset(vision_build, args, shuffle=False)
    Recording(model=tiny_qwen2_5_vl().train(), args=args, train_dataset=dataset).train()
    assert len(fed) == 2 and sum(fed) > 0
    with pytest.raises(DatasetError, match="TRL's padding-free collator drops"):
        sft_example(next(iter(PackedDataset(vision_build))))


def test_an_image_root_for_a_build_without_images_is_refused(make_build, tmp_path):
    path, _ = make_build(n_packs=4)
    with pytest.raises(DatasetError, match=r"image_root .* holds no images"):
        PackedDataset(path, image_root=tmp_path)


def test_ways_that_would_drop_the_images_are_refused(vision_build):
    """One document per row and context-parallel slices have no place for images: one line, not a pack trained
    with its image tokens read as text."""
    from packtool.loader import context_parallel_slice
    from packtool.loader.boundaries import one_document_per_row

    mb = _micro_batches(vision_build, "packed_batches")[0]
    with pytest.raises(DatasetError, match="one document per row has no place for a vision build's images"):
        one_document_per_row(mb)
    with pytest.raises(ValueError, match="does not split a vision build's images"):
        context_parallel_slice(mb, 2, 0)


def test_the_vision_quickstart_trains_packed_as_each_document_alone(tmp_path):
    """A real build (configs/quickstart-vision.yaml) through PackedDataset and model_inputs into a tiny random
    Qwen2-VL: every document's logits equal those of the document alone, its pictures read from their files and
    preprocessed by the build's image processor, its positions computed by the model itself."""
    from PIL import ImageOps
    from support import REPO

    from packtool.builder import build
    from packtool.config import load_config

    config = load_config(REPO / "configs" / "quickstart-vision.yaml", output=str(tmp_path / "out"))
    build(config, use_cache=False)
    out = tmp_path / "out"
    vision = json.loads((out / MANIFEST).read_text())["vision"]
    processor = Qwen2VLImageProcessorPil.from_pretrained(out / "processor")
    rows = {
        row["pack_hash"]: row for shard in sorted(out.glob("*.parquet")) for row in pq.read_table(shard).to_pylist()
    }
    model = tiny_qwen2_vl(vision["image_token_id"])
    documents = 0
    with torch.no_grad():
        for mb in packed_batches(PackedDataset(out, shuffle=False, token_budget=config.capacity)):
            (row,) = [rows[h] for h in mb.pack_hashes]
            logits = model(**model_inputs(mb, model)).logits[0]
            bounds = mb.cu_seqlens.tolist()
            for d, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                ids = mb.input_ids[:, lo:hi]
                inputs = {"input_ids": ids, "mm_token_type_ids": (ids == vision["image_token_id"]).int()}
                refs = [r for r, doc in zip(row["image_refs"], row["image_documents"], strict=True) if doc == d]
                if refs:
                    pictures = [ImageOps.exif_transpose(Image.open(Path(vision["root"]) / r)) for r in refs]
                    inputs.update(processor(images=pictures, return_tensors="pt"))
                torch.testing.assert_close(logits[lo:hi], model(**inputs).logits[0], rtol=0, atol=1e-5)
                documents += 1
    assert documents == 24 and vision["n_images"] == 24


def test_a_family_the_loader_cannot_preprocess_is_refused_when_the_dataset_is_made(vision_build):
    manifest = json.loads((vision_build / MANIFEST).read_text())
    manifest["vision"]["processor"]["family"] = "gemma3"
    write_json_atomic(vision_build / MANIFEST, manifest)
    with pytest.raises(DatasetError, match="the loader preprocesses qwen2_vl, qwen2_5_vl, qwen3_vl images, not gemma3"):
        PackedDataset(vision_build)
