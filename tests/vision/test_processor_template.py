"""`template: model` in a build with an image processor is the template transformers' processor renders with
(processor.apply_chat_template), held to transformers' own ProcessorMixin.get_processor_dict on each layout of a
vision-language model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import REPO

from packtool.chat_templates import load_template, template_for
from packtool.config import load_config
from packtool.errors import PacktoolError

transformers = pytest.importorskip("transformers")
from transformers.processing_utils import ProcessorMixin  # noqa: E402

MODEL = REPO / "configs" / "quickstart_vision" / "model"
TOKENIZER_KEY = "{% for m in messages %}tokenizer_config {{ m.content }}{% endfor %}"
JINJA = "{% for m in messages %}jinja {{ m.content }}{% endfor %}"
LEGACY = "{% for m in messages %}chat_template.json {{ m.content }}{% endfor %}"
KEYED = "{% for m in messages %}processor_config {{ m.content }}{% endfor %}"
TOOLS = "{% for m in messages %}tools {{ m.content }}{% endfor %}"

# layout name -> the files written beside the tokenizer and preprocessor_config.json, and the file packtool names
LAYOUTS = {
    "legacy_json": ({"chat_template.json": json.dumps({"chat_template": LEGACY})}, "chat_template.json"),
    "legacy_json_beside_jinja": (
        {"chat_template.json": json.dumps({"chat_template": LEGACY}), "chat_template.jinja": JINJA},
        "chat_template.json",
    ),
    "processor_config_key": (
        {"processor_config.json": json.dumps({"chat_template": KEYED}), "chat_template.jinja": JINJA},
        "processor_config.json",
    ),
    "processor_config_names": (
        {"processor_config.json": json.dumps({"chat_template": {"default": KEYED, "tool_use": TOOLS}})},
        "processor_config.json",
    ),
    "jinja": ({"chat_template.jinja": JINJA}, "chat_template.jinja"),
    "jinja_and_named": (
        {"chat_template.jinja": JINJA, "additional_chat_templates/tool_use.jinja": TOOLS},
        "chat_template.jinja",
    ),
}


def model_folder(tmp_path: Path, files: dict[str, str]) -> Path:
    """A vision-language model folder whose tokenizer_config.json carries a template of its own."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "preprocessor_config.json"):
        shutil.copy(MODEL / name, folder / name)
    settings = json.loads((MODEL / "tokenizer_config.json").read_text()) | {"chat_template": TOKENIZER_KEY}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    for name, text in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    return folder


def processor_renders_with(folder: Path) -> tuple[str, str | None]:
    """transformers' choice: the template processor.apply_chat_template renders with (and the tool_use one)."""
    templates = ProcessorMixin.get_processor_dict(str(folder))[0].get("chat_template")
    if isinstance(templates, dict):
        return templates["default"], templates.get("tool_use")
    return templates, None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_template_model_is_the_processors_template(tmp_path, layout):
    files, named_file = LAYOUTS[layout]
    folder = model_folder(tmp_path, files)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = load_template("model", tokenizer_config, folder=folder, processor=folder)
    default, tools = processor_renders_with(folder)
    assert template.source == default and template.file == named_file
    assert (template.for_tools.source if template.for_tools else None) == tools
    # what is not used is named: the tokenizer's choice, or (both reading chat_template.jinja) its config's key
    assert "differs and is not used" in (template.passed_over or "")


def test_the_manifest_and_audit_name_the_processors_file(tmp_path):
    folder = model_folder(tmp_path, LAYOUTS["legacy_json"][0])
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"sources": [{"path": "chat.jsonl", "format": "messages"}], "tokenizer": str(folder), "capacity": 64}
        )
        + "\n"
    )
    loaded = load_config(config, output=str(tmp_path / "out"))
    assert loaded.processor == str(folder)  # the tokenizer folder's preprocessor_config.json
    template = template_for(loaded, json.loads((folder / "tokenizer_config.json").read_text()))
    assert template is not None and (template.file, template.source) == ("chat_template.json", LEGACY)


def test_a_processor_folder_without_a_template_leaves_the_tokenizers(tmp_path):
    """A processor folder of preprocessor_config.json alone: the tokenizer's template (transformers' processor
    would have none to render with)."""
    folder = model_folder(tmp_path, {"chat_template.jinja": JINJA})
    processor = tmp_path / "processor"
    processor.mkdir()
    shutil.copy(MODEL / "preprocessor_config.json", processor)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = load_template("model", tokenizer_config, folder=folder, processor=processor)
    assert (template.source, template.file) == (JINJA, "chat_template.jinja")


def test_a_legacy_json_beside_named_templates_is_refused_as_transformers_refuses_it(tmp_path):
    folder = model_folder(
        tmp_path,
        {
            "chat_template.json": json.dumps({"chat_template": LEGACY}),
            "additional_chat_templates/tool_use.jinja": TOOLS,
        },
    )
    with pytest.raises(ValueError, match="conflicting files"):
        ProcessorMixin.get_processor_dict(str(folder))
    with pytest.raises(PacktoolError, match=r"chat_template\.json beside additional_chat_templates/"):
        load_template("model", {}, folder=folder, processor=folder)
