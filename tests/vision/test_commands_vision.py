"""audit, find and canary read a vision build's records as the build read them: with their images (a config with
an image processor), never as `images_not_supported` rejects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import REPO

pytest.importorskip("PIL")

from packtool.builder import build
from packtool.commands.audit import audit
from packtool.commands.canary import select_canaries
from packtool.commands.find import find
from packtool.config import load_config
from packtool.format import read_manifest

MODEL = REPO / "configs" / "quickstart_vision" / "model"  # its tokenizer has <|image_pad|>; a Qwen2-VL processor


def user(*parts: str | dict) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}


PICTURE = {"type": "image", "image": "red.png"}
RECORDS = [
    {"id": "question", "messages": [user(PICTURE, "What is it?"), {"role": "assistant", "content": "A red square."}]},
    # a picture alone is no empty message: not the empty_field canary, though its text is ""
    {"id": "picture-only", "messages": [user(PICTURE), {"role": "assistant", "content": "Red."}]},
    {
        "id": "empty-system",
        "messages": [
            {"role": "system", "content": ""},
            user(PICTURE, "Its colour, in one long sentence please?"),
            {"role": "assistant", "content": "It is a strong, warm red all over."},
        ],
    },
    {"id": "text", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
]


@pytest.fixture(scope="module")
def vision_build(tmp_path_factory) -> tuple[Path, Path]:
    from PIL import Image

    folder = tmp_path_factory.mktemp("vision-commands")
    Image.new("RGB", (40, 40), (200, 0, 0)).save(folder / "red.png")
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    config = folder / "config.json"
    settings = {
        "sources": [{"name": "chats", "path": "chat.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(MODEL),
        "template": "model",
        "capacity": 256,
        "output": "out",
        "executor": "serial",
    }
    config.write_text(json.dumps(settings))
    built = build(load_config(config), use_cache=False)
    assert built.manifest["accounting"]["chats"]["kept"] == len(RECORDS)
    return config, folder / "out"


def test_audit_renders_image_records_with_their_images(vision_build):
    config, _ = vision_build
    report = audit(load_config(config), rows=10)
    rows = next(check for check in report.checks if check.name == "rows:chats")
    assert (rows.status, rows.evidence) == ("pass", f"{len(RECORDS)} rows render and tokenize")
    assert "images_not_supported" not in json.dumps([c.evidence for c in report.checks])


def test_audit_reports_a_bad_image_as_the_build_rejects_it(vision_build, tmp_path):
    config, _ = vision_build
    broken = tmp_path / "config.json"
    (tmp_path / "chat.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    (tmp_path / "red.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    broken.write_text(json.dumps(json.loads(config.read_text()) | {"output": str(tmp_path / "out")}))
    rows = next(check for check in audit(load_config(broken), rows=10).checks if check.name == "rows:chats")
    assert rows.status != "pass" and "image_corrupt" in rows.evidence


def test_find_traces_an_image_sample_to_its_record(vision_build):
    _, out = vision_build
    for sample_id in ("question", "picture-only"):
        trace = find(out, sample_id)
        assert [(o.sample_id, o.status) for o in trace.origins] == [(sample_id, "matches")]
    by_line = find(out, "chat.jsonl:2")  # FILE:LINE, read back from the source
    assert {p.sample_id for p in by_line.placements} == {"picture-only"}


def test_canaries_read_image_records_as_the_build_did(vision_build):
    _, out = vision_build
    chosen = select_canaries(out)
    assert chosen.as_dict() == read_manifest(out).raw["canaries"]  # the command chooses what the build recorded
    [empty] = [c for c in chosen.canaries if c.kind == "empty_field"]
    assert empty.sample_ids == ("empty-system",)
