"""The encode stage with a processor: random Qwen2.5-VL conversations encoded by packtool equal transformers'
processor path on the same conversation (apply_chat_template, then Qwen2_5_VLProcessor), with each image's
facts, grid and span in Tokenized.images and no image token a target; an image that cannot be used is a reject
of its record alone, with its reason."""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from support import images_only_processor, shared

from packtool.builder.stages import outcomes, stages_for
from packtool.config import BuildConfig, parse_config
from packtool.errors import RecordError
from packtool.records import Tokenized
from packtool.sources import read_file
from packtool.vision import placing

Image = pytest.importorskip("PIL.Image")
ImageOps = pytest.importorskip("PIL.ImageOps")
transformers = pytest.importorskip("transformers")
from test_images import png_header_only  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

VL_MODEL = Path(__file__).parent / "qwen2_5_vl"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"


def vision_config(folder: Path, fmt: str, records: list[dict], **source) -> BuildConfig:
    (folder / "data").mkdir(exist_ok=True)
    (folder / "data" / "chat.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    raw = {
        "sources": [{"path": "data/chat.jsonl", "format": fmt, **source}],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "template": str(VL_MODEL / "chat_template.jinja"),
        "processor": str(VL_MODEL),
        "capacity": 8192,
        "output": "out",
    }
    (folder / "config.yaml").write_text(json.dumps(raw))
    return parse_config(raw, base_dir=folder, config_file=str(folder / "config.yaml"))


def encoded(config: BuildConfig) -> list[Tokenized | RecordError]:
    source = config.sources[0]
    records = read_file(source, source.paths[0], images=True)
    return [outcome.result for outcome in outcomes(stages_for(config), source, records)]


@pytest.fixture(scope="module")
def reference():
    tokenizer = transformers.AutoTokenizer.from_pretrained(shared("tokenizers", "qwen2.5"))
    settings = json.loads((VL_MODEL / "preprocessor_config.json").read_text())
    return images_only_processor(Qwen2VLImageProcessorPil.from_dict(settings), tokenizer)


def processor_path(reference, messages: list[dict], pictures: list) -> dict:
    """transformers' own way: the chat template renders the conversation, the processor expands its images."""
    template = (VL_MODEL / "chat_template.jinja").read_text()
    text = reference.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    return reference(text=[text], images=pictures or None, return_tensors="np", do_rescale=False, do_normalize=False)


def check_equal(document: Tokenized, expected: dict, image_token_id: int) -> None:
    np.testing.assert_array_equal(document.input_ids, expected["input_ids"][0])
    kinds = expected["mm_token_type_ids"][0]
    assert [(image.start, image.end) for image in document.images] == spans_of(kinds)
    grids = [tuple(map(int, row)) for row in expected["image_grid_thw"]] if document.images else []
    assert [image.grid for image in document.images] == grids
    assert not document.targets[document.input_ids == image_token_id].any()


def spans_of(kinds: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], kinds, [0]])))
    return [(int(start), int(end)) for start, end in zip(edges[::2], edges[1::2])]


def usable(generated) -> bool:
    width, height = generated.stored_size
    return max(width, height) / min(width, height) <= 200  # past it, the processor refuses (a reject below)


def test_random_conversations_equal_the_processor_path(tmp_path, generated_images, pictures, reference):
    rng = random.Random(40)
    folder = tmp_path / "data" / "pictures"
    folder.mkdir(parents=True)
    chosen = [i for i, generated in enumerate(generated_images) if usable(generated)]
    records, expected_pictures = [], []
    for _ in range(40):
        shown = rng.sample(chosen, rng.randint(0, 3))
        parts: list[dict] = []
        for index in shown:
            (folder / generated_images[index].name).write_bytes(generated_images[index].data)
            parts.append({"type": "image", "image": f"pictures/{generated_images[index].name}"})
            parts.append({"type": "text", "text": rng.choice(["What is this?", "\n", " and ", "Look."])})
        parts.insert(rng.randint(0, len(parts)), {"type": "text", "text": "Compare them."})
        answer = {"role": "assistant", "content": rng.choice(["They differ.", "Both are squares.", "One."])}
        records.append({"messages": [{"role": "user", "content": parts}, answer]})
        expected_pictures.append([pictures[index] for index in shown])
    config = vision_config(tmp_path, "messages", records)
    image_token_id = reference.image_token_id
    documents = encoded(config)
    for record, document, shown in zip(records, documents, expected_pictures, strict=True):
        assert isinstance(document, Tokenized), document
        check_equal(document, processor_path(reference, record["messages"], shown), image_token_id)
        targets = reference.tokenizer.decode(document.input_ids[document.targets])
        assert targets == record["messages"][1]["content"] + "<|im_end|>"
    placed = [image for document in documents for image in document.images]
    assert len(placed) > 30
    for image in placed:
        data = (tmp_path / image.reference).read_bytes()  # relative to the config's folder
        assert image.reference.startswith("data/pictures/") and image.data is None
        assert (image.sha256, image.n_bytes) == (hashlib.sha256(data).hexdigest(), len(data))
        picture = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        assert (image.width, image.height) == picture.size


def test_llamafactory_placeholders_equal_the_processor_path(tmp_path, reference):
    """LLaMA-Factory replaces each <image> in the text with the model's placeholder before the template renders
    it (mm_plugin); packtool's image parts render the same text."""
    sizes = [(90, 40), (30, 200), (64, 64)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (40 * i, 90, 200)).save(tmp_path / f"{i}.jpg")
    turns = [
        {"from": "human", "value": "<image>What is it?\n<image>"},
        {"from": "gpt", "value": "Two birds."},
        {"from": "human", "value": "And this <image>?"},
        {"from": "gpt", "value": "A tree."},
    ]
    record = {"conversations": turns, "images": ["../0.jpg", "../1.jpg", "../2.jpg"]}
    (document,) = encoded(vision_config(tmp_path, "sharegpt", [record]))
    roles = {"human": "user", "gpt": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"].replace("<image>", PLACEHOLDER)} for t in turns]
    pictures = [Image.open(tmp_path / f"{i}.jpg") for i in range(3)]
    assert isinstance(document, Tokenized)
    check_equal(document, processor_path(reference, messages, pictures), reference.image_token_id)
    assert [image.reference for image in document.images] == ["0.jpg", "1.jpg", "2.jpg"]


def test_images_the_record_carries_have_their_bytes_and_no_reference(tmp_path):
    pytest.importorskip("pyarrow")
    import base64

    data = io.BytesIO()
    Image.new("RGB", (50, 70)).save(data, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()
    user = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "?"}],
    }
    (document,) = encoded(
        vision_config(tmp_path, "messages", [{"messages": [user, {"role": "assistant", "content": "A"}]}])
    )
    (image,) = document.images
    assert (image.reference, image.data, image.width, image.height) == ("", data.getvalue(), 50, 70)


def bad_images(folder: Path) -> dict[str, str]:
    """One file per reason an image is refused, named after it."""

    def save(name: str, image, image_format: str, **save) -> str:
        image.save(folder / name, image_format, **save)
        return name

    good = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(good, "PNG")
    (folder / "cut.png").write_bytes(good.getvalue()[:-20])
    (folder / "bomb.png").write_bytes(png_header_only(20000, 20000))
    frames = [Image.new("RGB", (16, 16), (80 * i, 0, 0)) for i in range(3)]
    return {
        "image_missing": "absent.png",
        "image_corrupt": "cut.png",
        "image_too_large": "bomb.png",
        "image_mode": save("deep.png", Image.fromarray(np.full((8, 8), 4000, dtype=np.uint16)), "PNG"),
        "image_animated": save("moving.gif", frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "image_aspect": save("thin.png", Image.new("RGB", (300, 1)), "PNG"),
        "image_remote": "https://example.com/cat.png",
    }


def test_each_bad_image_is_a_reject_of_its_record_alone(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (30, 30)).save(folder / "fine.png")
    bad = bad_images(folder)
    turns = [{"from": "human", "value": "<image><image>Which?"}, {"from": "gpt", "value": "The first."}]
    records = [{"conversations": turns, "images": ["fine.png", name]} for name in bad.values()]
    records.append({"conversations": turns, "images": ["fine.png"]})  # one placeholder too many
    records.append({"conversations": turns, "images": ["fine.png", "fine.png"]})
    results = encoded(vision_config(tmp_path, "sharegpt", records))
    *refused, kept = results
    assert [(error.kind, error.field) for error in refused] == [
        *((kind, "images[1]") for kind in bad),
        ("image_count_mismatch", "images"),
    ]
    assert all(isinstance(error, RecordError) for error in refused)
    assert "absent.png" in refused[0].reason and "aspect ratio over 200" in refused[5].reason
    assert isinstance(kept, Tokenized) and len(kept.images) == 2


@pytest.mark.parametrize(
    ("policy", "kind"), [("escape", None), ("keep", "image_count_mismatch"), ("reject", "special_token_literal")]
)
def test_a_user_typing_the_placeholder_follows_the_special_tokens_policy(tmp_path, reference, policy, kind):
    (tmp_path / "data").mkdir()
    Image.new("RGB", (56, 56)).save(tmp_path / "data" / "a.png")
    typed = f"What does {PLACEHOLDER} mean?"
    records = [
        {
            "conversations": [{"from": "human", "value": f"<image>{typed}"}, {"from": "gpt", "value": "A."}],
            "images": ["a.png"],
        },
        {"conversations": [{"from": "human", "value": typed}, {"from": "gpt", "value": "A."}]},
    ]
    results = encoded(vision_config(tmp_path, "sharegpt", records, special_tokens=policy))
    image_token_id = reference.image_token_id
    for result, images in zip(results, (1, 0), strict=True):
        if kind is None:
            assert isinstance(result, Tokenized)
            assert sum(image.end - image.start for image in result.images) == np.count_nonzero(
                result.input_ids == image_token_id
            )
            assert len(result.images) == images and IMAGE_TOKEN in reference.tokenizer.decode(result.input_ids)
        else:
            assert isinstance(result, RecordError) and result.kind == kind, result


def test_an_image_file_is_read_once_per_work_item(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    Image.new("RGB", (60, 60)).save(tmp_path / "data" / "a.png")
    reads = []
    real = placing.read_image_facts
    monkeypatch.setattr(placing, "read_image_facts", lambda path: reads.append(path) or real(path))
    turns = [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "A."}]
    records = [{"conversations": turns, "images": [name]} for name in ["a.png", "a.png", "absent.png", "absent.png"]]
    results = encoded(vision_config(tmp_path, "sharegpt", records * 3))
    assert [getattr(result, "kind", "kept") for result in results] == [
        "kept",
        "kept",
        "image_missing",
        "image_missing",
    ] * 3
    assert reads.count(tmp_path / "data" / "a.png") == 1  # a missing file is looked for each time: no stat to key


def test_a_build_counts_each_bad_image_and_encodes_again_an_image_changed_since(tmp_path):
    from click.testing import CliRunner

    from packtool.cli import main

    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (30, 30)).save(folder / "fine.png")
    bad = bad_images(folder)
    turns = [{"from": "human", "value": "<image>Which?"}, {"from": "gpt", "value": "That one."}]
    records = [{"conversations": turns, "images": [name]} for name in ["fine.png", *bad.values()]]
    config = vision_config(tmp_path, "sharegpt", records)
    raw = {**json.loads((tmp_path / "config.yaml").read_text()), "on_error": "skip", "max_reject_share": 1.0}
    (tmp_path / "config.yaml").write_text(json.dumps(raw))
    build = CliRunner().invoke(main, ["build", config.config_file, "-q", "-j", "1"])
    assert build.exit_code == 0, build.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["accounting"]["source0"]["rejected"] == dict.fromkeys(bad, 1)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["location"]) for r in rejects] == [
        (kind, f"data/chat.jsonl:{line}") for line, kind in enumerate(bad, start=2)
    ]
    Image.new("RGB", (90, 30)).save(folder / "fine.png")  # the same name, another picture: another grid
    again = CliRunner().invoke(main, ["build", config.config_file, "-j", "1"])
    assert again.exit_code == 0 and "its image data/fine.png changed since it was encoded" in again.output
