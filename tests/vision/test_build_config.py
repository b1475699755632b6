"""The build config's vision keys: `processor:` (or a tokenizer folder holding its processor) and
`sources[].image_root`, read and checked with the config, the processor's files in every encode key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import QUICKSTART

from packtool.builder import _encode_items
from packtool.builder.cache import TokenCache
from packtool.builder.stages import stages_for
from packtool.config import ConfigError, load_config, parse_config

QWEN2_VL = {"processor_class": "Qwen2VLProcessor", "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14}


def _processor(folder: Path, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(config or QWEN2_VL))
    return folder


def _raw(tmp_path: Path, **top) -> dict:
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    return {
        "sources": [{"path": "chat.jsonl", "format": "messages"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": "out",
        **top,
    }


def test_processor_is_a_folder_or_its_file(tmp_path):
    folder = _processor(tmp_path / "qwen2-vl")
    assert parse_config(_raw(tmp_path, processor="qwen2-vl"), base_dir=tmp_path).processor == str(folder)
    named = _raw(tmp_path, processor="qwen2-vl/preprocessor_config.json")
    assert parse_config(named, base_dir=tmp_path).processor == str(folder)
    assert parse_config(_raw(tmp_path), base_dir=tmp_path).processor is None  # the quickstart tokenizer has none


def test_a_tokenizer_folder_holding_a_processor_gives_it(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(QUICKSTART / "tokenizer", model)
    _processor(model)
    assert parse_config(_raw(tmp_path, tokenizer=str(model)), base_dir=tmp_path).processor == str(model)
    # one packtool cannot read leaves a text build alone; named with `processor:`, it is an error naming the file
    _processor(model, {"processor_class": "LlavaProcessor"})
    assert parse_config(_raw(tmp_path, tokenizer=str(model)), base_dir=tmp_path).processor is None
    with pytest.raises(ConfigError, match=r"processor: .*preprocessor_config.json: .*LlavaProcessor"):
        parse_config(_raw(tmp_path, tokenizer=str(model), processor=str(model)), base_dir=tmp_path)


@pytest.mark.parametrize(
    ("written", "config", "message"),
    [
        ("absent", None, r"processor: not found: .*absent"),
        ("empty", {}, r"processor: .*empty is not a preprocessor_config.json nor a folder holding one"),
        ("bad", {"processor_class": "Qwen2VLProcessor", "patch_size": -1}, r"processor: .*patch_size"),
    ],
)
def test_a_processor_that_cannot_be_read_is_one_config_error(tmp_path, written, config, message):
    if config == {}:
        (tmp_path / written).mkdir()
    elif config:
        _processor(tmp_path / written, config)
    with pytest.raises(ConfigError, match=message):
        parse_config(_raw(tmp_path, processor=written), base_dir=tmp_path)


def test_image_root_is_a_folder_of_a_source_with_images(tmp_path):
    (tmp_path / "pictures").mkdir()
    raw = _raw(tmp_path)
    raw["sources"][0]["image_root"] = "pictures"
    assert parse_config(raw, base_dir=tmp_path).sources[0].image_root == str(tmp_path / "pictures")
    raw["sources"][0]["image_root"] = "nowhere"
    with pytest.raises(ConfigError, match=r"sources\[0\]\.image_root: not a folder: .*nowhere"):
        parse_config(raw, base_dir=tmp_path)
    raw["sources"][0] |= {"image_root": "pictures", "format": "text"}
    with pytest.raises(ConfigError, match=r"sources\[0\]\.image_root: format: text has no images"):
        parse_config(raw, base_dir=tmp_path)


def test_the_processor_files_enter_the_encode_keys_by_content(tmp_path):
    """The same folder with another max_pixels gives other token counts: every encode key moves."""
    folder = _processor(tmp_path / "qwen2-vl")
    config = QUICKSTART.parent / "quickstart.yaml"

    def keys() -> list[str]:
        built = load_config(config, overrides=[f"processor={folder}"])
        return [item.key for item in _encode_items(built, stages_for(built), TokenCache(tmp_path / "cache"))]

    before = keys()
    _processor(folder, QWEN2_VL | {"max_pixels": 1003520})
    moved = keys()
    (folder / "processor_config.json").write_text('{"image_seq_len": 64}')
    assert len(set(before) | set(moved) | set(keys())) == 3 * len(before)
