"""A processor whose image token the tokenizer lacks is one config error, not every image record rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import QUICKSTART

pytest.importorskip("PIL")

from packtool.cli import main

QWEN2_VL = {"processor_class": "Qwen2VLProcessor", "min_pixels": 3136, "max_pixels": 12544, "patch_size": 14}
TEXT = {"id": "text", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
PICTURE = {
    "id": "picture",
    "messages": [
        {"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A red square."},
    ],
}


def config(folder: Path, *records: dict) -> Path:
    from PIL import Image

    Image.new("RGB", (40, 40), (200, 0, 0)).save(folder / "red.png")
    (folder / "qwen2-vl").mkdir()
    (folder / "qwen2-vl" / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL))
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = folder / "config.json"
    settings = {
        "sources": [{"path": "chat.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),  # no <|image_pad|> in its vocabulary
        "template": str(QUICKSTART.parent / "quickstart_vision" / "model" / "chat_template.jinja"),  # content lists
        "processor": "qwen2-vl",
        "capacity": 256,
        "output": "out",
    }
    path.write_text(json.dumps(settings))
    return path


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_tokenizer_without_the_image_token_is_one_config_error(tmp_path, jobs):
    result = CliRunner().invoke(main, ["build", str(config(tmp_path, TEXT, PICTURE, TEXT)), "-q", "-j", jobs])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    [line] = result.output.strip().splitlines()
    assert "processor: " in line and "qwen2-vl (qwen2_vl)" in line and "<|image_pad|>" in line
    assert str(QUICKSTART / "tokenizer") in line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_build_without_image_records_does_not_need_the_token(tmp_path):
    result = CliRunner().invoke(main, ["build", str(config(tmp_path, TEXT)), "-q", "-j", "1"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "manifest.json").is_file()
