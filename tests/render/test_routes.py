"""The render routes' one switch (render.routes, render.accelerators): `render: reference` or PACKTOOL_RENDER=reference
sends every conversation through the reference, and the routes each render took are counted."""

from __future__ import annotations

import pytest
from support import QUICKSTART, chat, quickstart_model

from packtool.config import ConfigError, TrainPolicy, parse_config
from packtool.render import render_chat
from packtool.render.accelerators import RENDER_ENV, accelerators_for


def test_render_reference_in_the_config_or_the_environment_turns_every_accelerator_off(monkeypatch):
    """`render: reference` (a run setting: the bytes are the same) and PACKTOOL_RENDER=reference give
    Accelerators that send each conversation through the reference, counted as such; the default
    learns a skeleton and its recipe and counts the routes it took."""
    raw = {"sources": [{"name": "chat", "path": str(QUICKSTART / "chat.jsonl"), "format": "messages"}]}
    raw |= {"tokenizer": str(QUICKSTART / "tokenizer"), "capacity": 1024, "output": "out"}
    assert parse_config(raw, base_dir=QUICKSTART).run.render == "accelerated"
    assert parse_config({**raw, "render": "reference"}, base_dir=QUICKSTART).run.render == "reference"
    with pytest.raises(ConfigError, match="render"):
        parse_config({**raw, "render": "fast"}, base_dir=QUICKSTART)
    _, template = quickstart_model()
    conversations = [chat(("user", f"Hi {n}"), ("assistant", f"Hello {n}")) for n in range(3)]
    reference = [render_chat(example, template, TrainPolicy()) for example in conversations]
    monkeypatch.setenv(RENDER_ENV, "reference")
    off = [accelerators_for("accelerated"), accelerators_for("reference")]
    monkeypatch.delenv(RENDER_ENV)
    off.append(accelerators_for("reference"))
    for accelerators in [*off, accelerators_for("accelerated")]:
        assert [render_chat(e, template, TrainPolicy(), accelerators) for e in conversations] == reference
    assert all(not a.on and a.routes == {"reference": 3} for a in off)
    assert accelerators.routes == {"jinja2": 1, "recipe": 2}
