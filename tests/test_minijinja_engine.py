"""minijinja renders a template only where it prints jinja2's bytes, and every verdict stays jinja2's.

Each test runs a template with both engines (`PACKTOOL_JINJA2_ONLY=1` keeps jinja2 alone) and
compares: the real templates on every real dataset row, the limits, the template's own refusals,
and the shards a real Qwen3 reasoning build writes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from support import SHARED_DATA, routed, shared

import packtool.builder.stages
import packtool.chat_templates
import packtool.minijinja_engine
import packtool.render.marks
import packtool.render.skeletons
from packtool.builder import build
from packtool.chat_templates import JINJA2_ONLY, ChatTemplate, load_template
from packtool.config import TrainPolicy, load_config
from packtool.errors import RecordError
from packtool.records import Example, Message
from packtool.render import render_chat
from packtool.template_limits import MAX_TEMPLATE_CHARS
from packtool.template_ops import (
    COPYING_FILTERS,
    COPYING_METHODS,
    READINGS,
    SAME_SIZE_FILTERS,
    SAME_SIZE_METHODS,
    SCALAR_METHODS,
)

pytest.importorskip("minijinja")

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Looks inside the content (as Qwen3 does), so every sample is rendered, by minijinja where it qualifies.
INSPECTING = (
    "{% for tool in tools or [] %}{{ tool | tojson }}\n{% endfor %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content.startswith('boom') %}{{ raise_exception('no boom in message ' ~ loop.index0) }}{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def both(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ChatTemplate, ChatTemplate]:
    path = tmp_path / "t.jinja"
    path.write_text(source, encoding="utf-8")
    fast = load_template(str(path), {})
    monkeypatch.setenv(JINJA2_ONLY, "1")
    slow = load_template(str(path), {})
    monkeypatch.delenv(JINJA2_ONLY)
    return fast, slow


# A record with tools has no render recipe: a template that inspects content renders it with minijinja
# (where no slot skeleton takes it: see `unslotted`).
TOOLS = ({"type": "function", "function": {"name": "get_time", "parameters": {"properties": {"zone": {}}}}},)


@pytest.fixture
def unslotted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversations with tools as if no slot could hold what they bring (render._SlotWalk finds nothing):
    each is rendered, by minijinja where the template qualifies, as the shapes slots refuse are."""
    monkeypatch.setattr(packtool.render.skeletons._SlotWalk, "walk", lambda self, example: None)


def chat(*contents: str) -> Example:
    roles = ("user", "assistant")
    messages = tuple(Message(roles[i % 2], c) for i, c in enumerate(contents))
    return Example("t:0", "src", "hash", messages=messages, tools=TOOLS)


def outcome(example: Example, template: ChatTemplate) -> Any:
    try:
        return render_chat(example, template, TrainPolicy(), routed(template))
    except RecordError as error:
        return error.kind, error.reason


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (INSPECTING, None),
        (
            "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.content %}{% endfor %}"
            + CHATML,
            "a value grows with every loop iteration",
        ),
        ("{% macro twice(x) %}{{ x }}{{ x }}{% endmacro %}" + CHATML, "{% macro %}"),
        ("{{ 'ab' * 3 }}" + CHATML, "the expression Mul"),
        ("{% for i in range(2) %}-{% endfor %}" + CHATML, "the call range()"),
        ("{{ messages[0] | indent(4) }}" + CHATML, "the filter |indent"),
        (
            CHATML.replace("{{ message.content }}", "{% generation %}{{ message.content }}{% endgeneration %}"),
            "generation",
        ),
    ],
)
def test_a_template_qualifies_for_minijinja_or_says_why_not(source, reason, tmp_path, monkeypatch):
    fast, slow = both(source, tmp_path, monkeypatch)
    assert slow.fast is None and slow.engine == f"jinja2 ({JINJA2_ONLY}=1)"
    if reason is None:
        assert fast.fast is not None and fast.engine == "minijinja"
    else:
        assert fast.fast is None and fast.engine.startswith("jinja2 (minijinja") and reason in fast.engine


def test_a_rendered_pair_writes_each_value_to_json_once_per_form(tmp_path, monkeypatch, unslotted):
    # the marked and the plain render print the same tools: serialized once, with each filter
    # argument set apart, and nothing remembered from one pair to the next; the form without arguments
    # is the one the record's check wrote
    source = INSPECTING.replace("{{ tool | tojson }}", "{{ tool | tojson }}{{ tool | tojson(indent=2) }}")
    fast, slow = both(source, tmp_path, monkeypatch)
    assert fast.engine == "minijinja"
    written = []
    real = packtool.minijinja_engine._tojson

    def counted(value, **kwargs):
        written.append(kwargs)
        return real(value, **kwargs)

    monkeypatch.setattr(packtool.minijinja_engine, "_tojson", counted)
    monkeypatch.setattr(packtool.render.marks, "_tojson", counted)
    monkeypatch.setattr(packtool.render.skeletons, "_tojson", counted)
    example = chat("Hi", "Hello")
    first = outcome(example, fast)
    assert written == [{}, {"indent": 2}]
    assert outcome(example, fast) == first == outcome(example, slow)
    assert written[2:4] == [{}, {"indent": 2}]


def test_a_template_minijinja_prints_otherwise_on_a_probe_stays_on_jinja2(tmp_path, monkeypatch):
    # the two engines agree on every real template; a difference is simulated on the last probe render
    renders = []
    real = packtool.minijinja_engine.MiniTemplate.render

    def differing(self, messages, tools, *, add_generation_prompt=False):
        renders.append(add_generation_prompt)
        text = real(self, messages, tools, add_generation_prompt=add_generation_prompt)
        return text + " " if len(renders) == 12 else text

    monkeypatch.setattr(packtool.minijinja_engine.MiniTemplate, "render", differing)
    fast, _ = both(INSPECTING, tmp_path, monkeypatch)
    assert len(renders) == 12  # 3 probes, marked and plain, with and without the generation prompt
    assert fast.fast is None and fast.engine == "jinja2 (minijinja prints other text on a probe conversation)"


def test_without_minijinja_installed_jinja2_renders_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(packtool.minijinja_engine, "MINIJINJA_INSTALLED", False)
    monkeypatch.setattr(packtool.chat_templates, "MINIJINJA_INSTALLED", False)
    fast, _ = both(INSPECTING, tmp_path, monkeypatch)
    assert fast.fast is None and "pip install 'packtool[minijinja]'" in fast.engine


def test_the_templates_own_refusal_is_jinja2s_verdict(tmp_path, monkeypatch, unslotted):
    fast, slow = both(INSPECTING, tmp_path, monkeypatch)
    tried = _count_rendered(monkeypatch)
    example = chat("Hi", "boom, said the assistant")
    assert outcome(example, fast) == outcome(example, slow)
    assert outcome(example, fast) == ("template_error", "template refused the sample: no boom in message 1")
    fine = chat("Hi", "Hello")
    assert outcome(fine, fast) == outcome(fine, slow) == render_chat(fine, slow, TrainPolicy(), routed(slow))
    assert tried == [3, 1]  # minijinja declined the refused sample twice and rendered the fine one


def test_a_render_past_the_operation_limit_stops_with_jinja2s_message(tmp_path, monkeypatch):
    # every message visits every message: 1,500 messages are 2.25 M iterations, past minijinja's fuel
    # and past jinja2's 1 M operations
    source = "{% for a in messages %}{% for b in messages %}.{% endfor %}{% endfor %}" + INSPECTING
    fast, slow = both(source, tmp_path, monkeypatch)
    assert fast.engine == "minijinja"
    example = chat(*["Hi", "Hello"] * 750)
    tried = _count_rendered(monkeypatch)
    verdict = outcome(example, fast)
    assert verdict == outcome(example, slow)
    assert verdict[0] == "template_limit" and "1,000,000 operations" in verdict[1]
    assert tried == [1, 0]  # minijinja ran out of fuel; jinja2 decided


def test_a_sample_too_large_for_minijinjas_size_bound_is_rendered_by_jinja2(tmp_path, monkeypatch, unslotted):
    fast, slow = both(INSPECTING, tmp_path, monkeypatch)
    assert fast.fast is not None
    # within jinja2's limit, past what minijinja may build for this template (its growth bound)
    long = "x" * (MAX_TEMPLATE_CHARS // fast.fast.growth)
    example = chat("Hi", long)
    tried = _count_rendered(monkeypatch)
    rendered = outcome(example, fast)
    assert rendered == outcome(example, slow)
    assert long in rendered.text
    assert tried == [1, 0]  # declined before rendering: growth x size is past MAX_TEMPLATE_CHARS
    # past jinja2's own limit: the same one-line reason either way
    over = chat("Hi " * (MAX_TEMPLATE_CHARS // 3), "Hello")
    assert outcome(over, fast) == outcome(over, slow)
    assert outcome(over, fast)[0] == "template_limit"


MODELS = ("qwen2.5", "qwen3", "llama-3.2", "mistral-nemo", "gemma-3", "phi-3-mini")


@pytest.mark.parametrize("model", MODELS)
def test_real_templates_render_every_real_row_the_same_with_either_engine(model, monkeypatch, unslotted):
    from test_parity import DATASETS, dataset_examples

    tokenizer_config = json.loads(shared("tokenizers", model, "tokenizer_config.json").read_text(encoding="utf-8"))
    fast = load_template("model", tokenizer_config, {"date": "2026-01-01"})
    monkeypatch.setenv(JINJA2_ONLY, "1")
    slow = load_template("model", tokenizer_config, {"date": "2026-01-01"})
    assert fast.fast is not None and slow.fast is None
    assert fast.engine == "minijinja"
    by_minijinja = _count_rendered(monkeypatch)
    compared = 0
    for file, fmt, limit in DATASETS:
        for example in dataset_examples(file, fmt, limit):
            if isinstance(example, Example) and not example.is_text:
                assert outcome(example, fast) == outcome(example, slow), (file, example.id)
                compared += 1
    assert compared > 5000
    # every row with tools, calls or reasoning goes to minijinja (441 of them), which renders all but those
    # the template raises on (Mistral-Nemo's call ids, Gemma 3's role order: 98 and 107 rendered), left to jinja2
    assert by_minijinja[0] > 400 and by_minijinja[1] > 90


def _count_rendered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[samples given to minijinja, samples it rendered (their marked and plain texts)]."""
    counts = [0, 0]
    real = packtool.minijinja_engine.MiniTemplate.render_pair

    def counting(self, *args, **kwargs):
        texts = real(self, *args, **kwargs)
        counts[0] += 1
        counts[1] += texts is not None
        return texts

    monkeypatch.setattr(packtool.minijinja_engine.MiniTemplate, "render_pair", counting)
    return counts


def test_build_and_audit_say_which_engine_renders_the_template(tmp_path, write_config, write_jsonl, monkeypatch):
    from click.testing import CliRunner
    from support import QUICKSTART

    from packtool.cli import main

    template = tmp_path / "inspecting.jinja"
    template.write_text(INSPECTING, encoding="utf-8")
    rows = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello"}]}
        for i in range(3)
    ]
    config = write_config(
        {
            "sources": [{"name": "chat", "path": str(write_jsonl(rows)), "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "template": str(template),
            "capacity": 256,
            "output": str(tmp_path / "out"),
            "cache": str(tmp_path / "cache"),
        }
    )
    monkeypatch.setattr(packtool.builder.stages, "_STAGES", {})
    built = CliRunner().invoke(main, ["build", str(config)])
    assert built.exit_code == 0, built.output
    assert "template inspecting.jinja rendered by minijinja\n" in built.output
    audited = CliRunner().invoke(main, ["audit", str(config)])
    assert "template inspecting.jinja (rendered by minijinja)" in audited.output
    monkeypatch.setenv(JINJA2_ONLY, "1")
    audited = CliRunner().invoke(main, ["audit", str(config)])
    assert f"template inspecting.jinja (rendered by jinja2 ({JINJA2_ONLY}=1))" in audited.output


def _shard_digests(output: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(output.rglob("*")) if p.is_file()}


def test_a_real_qwen3_reasoning_build_writes_the_same_bytes_with_either_engine(tmp_path, write_config, monkeypatch):
    if not (SHARED_DATA / "tokenizers").is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    digests = []
    for engine in ("minijinja", "jinja2"):
        if engine == "jinja2":
            monkeypatch.setenv(JINJA2_ONLY, "1")
        monkeypatch.setattr(packtool.builder.stages, "_STAGES", {})  # load the template again, under this engine
        config = load_config(
            write_config(
                {
                    "sources": [
                        {
                            "name": "reasoning",
                            "path": str(shared("datasets", "llamafactory_reason_tool_use_demo_50.jsonl")),
                            "format": "messages",
                        },
                        {
                            "name": "alpaca",
                            "path": str(shared("datasets", "llamafactory_alpaca_en_demo.json")),
                            "format": "alpaca",
                        },
                    ],
                    "tokenizer": str(shared("tokenizers", "qwen3")),
                    "capacity": 4096,
                    "output": str(tmp_path / engine),
                    "cache": str(tmp_path / f"cache-{engine}"),
                    "on_error": "skip",
                    "workers": 1,
                },
                name=f"{engine}.yaml",
            )
        )
        assert packtool.builder.stages.stages_for(config).template.engine.startswith(engine)
        build(config)
        digests.append(_shard_digests(tmp_path / engine))
    assert digests[0] == digests[1]
    assert any(name.endswith(".parquet") for name in digests[0])


def test_one_allow_list_serves_both_engines() -> None:
    """What the jinja2 sandbox lets a content through as a copy, minijinja bounds as the same size, and a
    question the sandbox records of a content is a scalar to minijinja: both read packtool.template_ops."""
    assert COPYING_METHODS <= SAME_SIZE_METHODS
    assert COPYING_FILTERS - {"tojson"} <= SAME_SIZE_FILTERS
    assert {name for name in READINGS if not name.startswith("__")} <= SCALAR_METHODS
