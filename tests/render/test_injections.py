"""What a template injects into every sample (render.injections): the model templates' own words, none from the
bundled templates, and the manifest's list."""

from __future__ import annotations

import pytest
from support import model_tokenizer, quickstart_model, shared

from packtool.chat_templates import load_template


@pytest.mark.parametrize(
    ("model", "injected"),
    [
        ("qwen2.5", ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant."]),
        ("qwen3", []),
        ("llama-3.2", ["Cutting Knowledge Date: December 2023", "Today Date: 26 Jul 2024"]),
        ("mistral-nemo", []),
        ("gemma-3", []),
        ("phi-3-mini", []),
    ],
)
def test_template_injections_of_the_model_templates(model, injected):
    from packtool.render import template_injections

    tokenizer = model_tokenizer(model)
    template = load_template("model", tokenizer.config, {"date_string": "26 Jul 2024"})
    assert template_injections(template, tokenizer) == injected


def test_bundled_templates_inject_nothing():
    from packtool.chat_templates import bundled_templates
    from packtool.render import template_injections

    tokenizer, _ = quickstart_model()
    for name in bundled_templates():
        assert template_injections(load_template(name, tokenizer.config), tokenizer) == [], name


def test_the_manifest_lists_what_the_template_injects(tmp_path, write_config, write_jsonl):
    from packtool.builder import build
    from packtool.config import load_config

    write_jsonl([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}])
    source = {"name": "s", "path": "data.jsonl", "format": "messages"}
    config = load_config(
        write_config(
            {"sources": [source], "tokenizer": str(shared("tokenizers", "qwen2.5")), "capacity": 256, "output": "out"}
        )
    )
    injects = build(config).manifest["template"]["injects"]
    assert injects == ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant."]
