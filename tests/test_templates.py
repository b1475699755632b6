"""The bundled templates (templates/*.jinja): each renders a chat, a chat with a system prompt and,
where it has tool syntax, a tool call + tool result, and its targets decode to exactly each
assistant turn's body + the template's end-of-turn marker.

    qwen, tool turn:  <|im_start|>assistant\\n<tool_call>\\n{"name": ...}\\n</tool_call><|im_end|>\\n
                                              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^   target

Runs on the quickstart tokenizer (configs/quickstart/tokenizer), where the other formats' markers
are plain text, and again on each format's real tokenizer from the shared data when it is there.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from pathlib import Path

import pytest
from support import SHARED_DATA

from packtool.chat_templates import END_MARKERS, bundled_templates, load_template
from packtool.config import TokenizerConfig, TrainPolicy
from packtool.encode import TextTokenizer, encode_batch, load_tokenizer
from packtool.errors import RecordError
from packtool.records import ROLE_CODES, Example, Message, Tokenized
from packtool.render import render_chat

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart" / "tokenizer"
SHARED = SHARED_DATA / "tokenizers"

TEMPLATES = ("alpaca", "chatml", "gemma", "llama3", "mistral", "phi3", "plain", "qwen")
WITH_TOOLS = ("qwen", "llama3", "mistral")
# The marker each template closes an assistant turn with; None: the tokenizer's eos_token.
END = {
    "chatml": "<|im_end|>",
    "qwen": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "gemma": "<end_of_turn>",
    "phi3": "<|end|>",
    "mistral": None,
    "alpaca": None,
    "plain": None,
}
# What add_generation_prompt appends, which is also the assistant header targets start after.
HEADER = {
    "chatml": "<|im_start|>assistant\n",
    "qwen": "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>model\n",
    "phi3": "<|assistant|>\n",
    "alpaca": "### Response:\n",
    "mistral": None,  # no header: the template marks its targets with {% generation %}
    "plain": None,
}
# The real tokenizer each format belongs to (shared test data), for a second run.
NATIVE = {
    "chatml": "qwen2.5",
    "qwen": "qwen2.5",
    "llama3": "llama-3.2",
    "mistral": "mistral-nemo",
    "gemma": "gemma-3",
    "phi3": "phi-3-mini",
    "alpaca": "qwen2.5",
    "plain": "qwen2.5",
}

CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
)
CHATS = {
    "two_turn": (Message("user", "Hi there"), Message("assistant", "Hello, how can I help?")),
    "system": (
        Message("system", "You are terse."),
        Message("user", "Name a colour."),
        Message("assistant", "Blue."),
        Message("user", "Another one?"),
        Message("assistant", "Green."),
    ),
    "tools": (
        Message("user", "Weather in Oslo?"),
        Message("assistant", "", tool_calls=(CALL,)),
        Message("tool", '{"temp_c": 3}', tool_call_id="a1b2c3d4e"),
        Message("assistant", "It is 3 degrees."),
    ),
}
# How each tool-calling template writes CALL: the exact trained body of the tool-call turn.
CALL_TEXT = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]',
}


@cache
def _tokenizer(folder: Path) -> TextTokenizer:
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {folder}")
    return load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))


@pytest.fixture(scope="module")
def quickstart() -> TextTokenizer:
    return _tokenizer(QUICKSTART)


def _example(chat: str) -> Example:
    return Example(f"t:{chat}", "test", "0" * 32, CHATS[chat], TOOLS if chat == "tools" else None)


def _targets_by_message(result: Tokenized, tokenizer: TextTokenizer) -> dict[int, str]:
    out = {}
    for i in sorted(set(result.message_index[result.targets].tolist())):
        ids = result.input_ids[result.targets & (result.message_index == i)].tolist()
        out[i] = tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    return out


def _expected_targets(name: str, chat: str, eos: str) -> dict[int, str]:
    end = END[name] or eos
    return {
        i: (CALL_TEXT[name] if m.tool_calls else m.content) + end
        for i, m in enumerate(CHATS[chat])
        if m.role == "assistant"
    }


def test_every_template_is_bundled() -> None:
    assert tuple(bundled_templates()) == TEMPLATES


@pytest.mark.parametrize("name", TEMPLATES)
def test_header_comment_documents_the_template(name: str) -> None:
    source = (resources.files("packtool.templates") / f"{name}.jinja").read_text(encoding="utf-8")
    header = source[: source.index("-#}")]
    assert source.startswith("{#-")
    for field in ("roles:", "trained:", "end of turn:", "bos_token:", "generation:"):
        assert field in header, f"{name}.jinja header lacks {field!r}"


@pytest.mark.parametrize("name", TEMPLATES)
def test_generation_header_is_the_assistant_header(name: str, quickstart: TextTokenizer) -> None:
    template = load_template(name, quickstart.config)
    assert template.generation_header == HEADER[name]
    end = END[name] or quickstart.config["eos_token"]
    assert end in template.end_markers and (end in END_MARKERS or end == quickstart.config["eos_token"])


def _check(name: str, chat: str, tokenizer: TextTokenizer) -> None:
    template = load_template(name, tokenizer.config)
    example = _example(chat)
    if chat == "tools" and name not in WITH_TOOLS:
        with pytest.raises(RecordError, match=rf"{name}: message \d+ .*tool") as caught:
            render_chat(example, template, TrainPolicy())
        assert caught.value.kind == "template_error"
        return
    rendered = render_chat(example, template, TrainPolicy())
    (result,) = encode_batch([(rendered, "escape")], tokenizer)
    assert isinstance(result, Tokenized), result
    eos = tokenizer.config.get("eos_token") or ""
    got = {i: text.strip() for i, text in _targets_by_message(result, tokenizer).items()}
    assert got == {i: text.strip() for i, text in _expected_targets(name, chat, eos).items()}
    assert set(result.roles[result.targets].tolist()) == {ROLE_CODES["assistant"]}
    if name in ("chatml", "qwen") and chat != "tools":  # ChatML + ChatML tokenizer: exact round trip
        assert tokenizer.tokenizer.decode(result.input_ids.tolist(), skip_special_tokens=False) == rendered.text


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_targets_on_the_quickstart_tokenizer(name: str, chat: str, quickstart: TextTokenizer) -> None:
    _check(name, chat, quickstart)


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_targets_on_the_native_tokenizer(name: str, chat: str) -> None:
    _check(name, chat, _tokenizer(SHARED / NATIVE[name]))


@pytest.mark.parametrize("name", TEMPLATES)
def test_add_generation_prompt_opens_an_assistant_turn(name: str, quickstart: TextTokenizer) -> None:
    template = load_template(name, quickstart.config)
    messages = [m.as_template_dict() for m in CHATS["system"][:2]]
    closed = template.render(messages, None)
    opened = template.render(messages, None, add_generation_prompt=True)
    assert opened == closed + (HEADER[name] or "")


@pytest.mark.parametrize("name", ["llama3", "mistral", "gemma"])
def test_templates_that_print_bos_print_it_once(name: str) -> None:
    tokenizer = _tokenizer(SHARED / NATIVE[name])
    rendered = render_chat(_example("two_turn"), load_template(name, tokenizer.config), TrainPolicy())
    (result,) = encode_batch([(rendered, "escape")], tokenizer)
    assert result.input_ids[0] == tokenizer.bos_id
    assert int((result.input_ids == tokenizer.bos_id).sum()) == 1


@pytest.mark.parametrize("name", TEMPLATES)
def test_late_system_message_is_refused(name: str, quickstart: TextTokenizer) -> None:
    if name == "plain":
        pytest.skip("plain prints a system message wherever it is")
    chat = (Message("user", "Hi"), Message("system", "Be terse."), Message("assistant", "Hello"))
    with pytest.raises(RecordError, match=re.escape(f"{name}: a system message is only allowed first")):
        render_chat(Example("t:late", "test", "0" * 32, chat), load_template(name, quickstart.config), TrainPolicy())


def test_mistral_trains_only_the_turns_the_policy_names(quickstart: TextTokenizer) -> None:
    """Generation blocks of tool-call-only turns belong to their message, so `turns: last` skips them."""
    template = load_template("mistral", quickstart.config)
    rendered = render_chat(_example("tools"), template, TrainPolicy(turns="last"))
    assert [m for _, _, m in rendered.target_ranges] == [3]
    rendered = render_chat(_example("tools"), template, TrainPolicy(tool_calls=False))
    assert [m for _, _, m in rendered.target_ranges] == [3]


def test_mistral_prints_the_system_prompt_in_the_last_user_turn(quickstart: TextTokenizer) -> None:
    rendered = render_chat(_example("system"), load_template("mistral", quickstart.config), TrainPolicy())
    assert rendered.text.endswith("[INST]You are terse.\n\nAnother one?[/INST]Green.<|im_end|>")
    assert rendered.text.count("You are terse.") == 1


def test_plain_separator_is_a_template_variable(quickstart: TextTokenizer) -> None:
    template = load_template("plain", quickstart.config, {"separator": ""})
    chat = (Message("user", "The capital of France is"), Message("assistant", " Paris."))
    rendered = render_chat(Example("t:plain", "test", "0" * 32, chat), template, TrainPolicy())
    assert rendered.text == "The capital of France is Paris.<|im_end|>"
    ((start, end, _),) = rendered.target_ranges
    # The completion's own leading space trains with it: BPE glues it to the word (" Paris").
    assert rendered.text[start:end] == " Paris.<|im_end|>"
    (result,) = encode_batch([(rendered, "escape")], quickstart)
    assert isinstance(result, Tokenized), result
    target_ids = result.input_ids[result.targets].tolist()
    assert quickstart.tokenizer.decode(target_ids, skip_special_tokens=False) == " Paris.<|im_end|>"


@pytest.mark.parametrize(
    ("check", "engine"),
    [
        ("", "jinja2 (it does not inspect content)"),
        ("{% if message.content.startswith('x') %}!{% endif %}", "jinja2 (minijinja: minijinja is not installed"),
    ],
)
def test_without_minijinja_the_engine_names_the_extra_only_where_it_would_pay(tmp_path, monkeypatch, check, engine):
    """A template that never looks inside a content gains nothing from minijinja: its summary line does not
    send the user to install it; one that looks (as Qwen3's does) does."""
    import packtool.chat_templates
    import packtool.minijinja_engine

    for module in (packtool.chat_templates, packtool.minijinja_engine):
        monkeypatch.setattr(module, "MINIJINJA_INSTALLED", False)
    monkeypatch.delenv(packtool.chat_templates.JINJA2_ONLY, raising=False)
    path = tmp_path / "chat.jinja"
    path.write_text(
        "{% for message in messages %}<|im_start|>{{ message.role }}\n" + check + "{{ message.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert load_template(str(path), {}).engine.startswith(engine)
