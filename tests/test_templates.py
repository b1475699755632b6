"""The bundled templates (templates/*.jinja): each renders a chat, a chat with a system prompt and,
where it has tool syntax, a tool call + tool result, and its targets decode to exactly each
assistant turn's body + the template's end-of-turn marker.

    qwen, tool turn:  <|im_start|>assistant\\n<tool_call>\\n{"name": ...}\\n</tool_call><|im_end|>\\n
                                              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^   target

Runs on the quickstart tokenizer (configs/quickstart/tokenizer), where the other formats' markers
are plain text, and again on each format's real tokenizer from the shared data when it is there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from support import SHARED_DATA, routed

from packtool.builder import _encode_items
from packtool.builder.cache import TokenCache
from packtool.builder.stages import stages_for
from packtool.chat_templates import END_MARKERS, bundled_templates, load_template, template_for
from packtool.config import TokenizerConfig, TrainPolicy, load_config, parse_config
from packtool.encode import TextTokenizer, encode_batch, load_tokenizer
from packtool.errors import PacktoolError, RecordError
from packtool.records import ROLE_CODES, Example, Message, Tokenized
from packtool.render import render_chat, render_example

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
            render_chat(example, template, TrainPolicy(), routed(template))
        assert caught.value.kind == "template_error"
        return
    rendered = render_chat(example, template, TrainPolicy(), routed(template))
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
    rendered = render_chat(_example("tools"), template, TrainPolicy(turns="last"), routed(template))
    assert [m for _, _, m in rendered.target_ranges] == [3]
    rendered = render_chat(_example("tools"), template, TrainPolicy(tool_calls=False), routed(template))
    assert [m for _, _, m in rendered.target_ranges] == [3]


def test_mistral_prints_the_system_prompt_in_the_last_user_turn(quickstart: TextTokenizer) -> None:
    rendered = render_chat(_example("system"), load_template("mistral", quickstart.config), TrainPolicy())
    assert rendered.text.endswith("[INST]You are terse.\n\nAnother one?[/INST]Green.<|im_end|>")
    assert rendered.text.count("You are terse.") == 1


def test_plain_separator_is_a_template_variable(quickstart: TextTokenizer) -> None:
    template = load_template("plain", quickstart.config, {"separator": ""})
    chat = (Message("user", "The capital of France is"), Message("assistant", " Paris."))
    rendered = render_chat(Example("t:plain", "test", "0" * 32, chat), template, TrainPolicy(), routed(template))
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


# Which template a model folder renders with, found as transformers (>= 4.43) finds it: chat_template.jinja
# and additional_chat_templates/NAME.jinja over tokenizer_config.json's chat_template key (a string or a
# list of {name, template}); the tool_use template for records that bring tools.
#
#     folder                                         template: model renders       records with tools
#     key only                                       the key                       the key
#     chat_template.jinja + key                      chat_template.jinja           chat_template.jinja
#     key [{default}, {tool_use}]                    default                       tool_use
#     chat_template.jinja + additional_.../tool_use  chat_template.jinja           tool_use.jinja
QWEN = SHARED / "qwen2.5"
QWEN_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _qwen_key() -> str:
    if not (QWEN / "tokenizer_config.json").is_file():
        pytest.skip(f"no tokenizer at {QWEN}")
    return json.loads((QWEN / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


def _variant(prompt: str) -> str:
    """Qwen2.5's template with another default system prompt: a render shows which one was used."""
    return _qwen_key().replace(QWEN_PROMPT, prompt)


def _model_folder(tmp_path: Path, key: Any = None, files: dict[str, Any] | None = None) -> Path:
    """A copy of Qwen2.5's tokenizer folder whose chat_template key is `key` (None: Qwen's own, "": no key)
    and which also holds `files` (relative path -> text or bytes)."""
    _qwen_key()  # skips without the shared tokenizer
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    shutil.copy(QWEN / "tokenizer.json", folder)
    config = json.loads((QWEN / "tokenizer_config.json").read_text(encoding="utf-8"))
    if key == "":
        del config["chat_template"]
    elif key is not None:
        config["chat_template"] = key
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if callable(content):  # a special file: content makes it (os.mkfifo)
            content(folder / name)
        elif isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            (folder / name).write_text(content, encoding="utf-8")
    return folder


def _packtool_and_transformers(folder: Path, spec: str, chat: str) -> tuple[str, str]:
    """The chat rendered by packtool (the build's render_example) and by apply_chat_template on the folder."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tokenizer = load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))
    template = load_template(spec, tokenizer.config, folder=folder)
    example = _example(chat)
    ours = render_example(example, template, tokenizer.config, TrainPolicy(), add_bos=None, add_eos=None).text
    named = {"chat_template": spec.removeprefix("model:")} if spec != "model" else {}
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        [m.as_template_dict() for m in example.messages],
        tools=list(example.tools or []) or None,
        tokenize=False,
        **named,
    )
    return ours, theirs


# case -> (key, files, the default system prompt a chat without tools gets, the one a chat with tools gets)
FOLDERS: dict[str, tuple[Any, dict[str, str | bytes], str, str]] = {
    "jinja_over_key": (None, {"chat_template.jinja": "{jinja}"}, "From the jinja file.", "From the jinja file."),
    # a BOM stays a character (transformers opens the file with encoding="utf-8") and is printed
    "jinja_bom": (None, {"chat_template.jinja": "{jinja_bom}"}, "From the jinja file.", "From the jinja file."),
    # a later entry of a name wins, as transformers builds its dict
    "named_list_twice": (
        [{"name": "default", "template": "{key}"}, {"name": "default", "template": "{jinja}"}],
        {},
        "From the jinja file.",
        "From the jinja file.",
    ),
    "jinja_crlf": (
        None,
        {"chat_template.jinja": "{jinja_crlf}"},
        "From the jinja file.",
        "From the jinja file.",
    ),
    "named_list": (
        [{"name": "default", "template": "{jinja}"}, {"name": "tool_use", "template": "{tool_use}"}],
        {},
        "From the jinja file.",
        "For tools.",
    ),
    "jinja_and_additional": (
        None,
        {"chat_template.jinja": "{jinja}", "additional_chat_templates/tool_use.jinja": "{tool_use}"},
        "From the jinja file.",
        "For tools.",
    ),
    # any file wins over the whole key: the key's tool_use is gone
    "jinja_over_named_list": (
        [{"name": "default", "template": "{key}"}, {"name": "tool_use", "template": "{tool_use}"}],
        {"chat_template.jinja": "{jinja}"},
        "From the jinja file.",
        "From the jinja file.",
    ),
    # additional_chat_templates/default.jinja replaces chat_template.jinja
    "additional_default": (
        None,
        {"chat_template.jinja": "{key}", "additional_chat_templates/default.jinja": "{jinja}"},
        "From the jinja file.",
        "From the jinja file.",
    ),
}


def _filled(value: Any) -> Any:
    sources = {
        "{key}": _qwen_key(),
        "{jinja}": _variant("From the jinja file."),
        "{jinja_crlf}": _variant("From the jinja file.").replace("\n", "\r\n").encode(),
        "{jinja_bom}": "\ufeff" + _variant("From the jinja file."),
        "{tool_use}": _variant("For tools."),
    }
    if isinstance(value, str):
        return sources.get(value, value)
    if isinstance(value, list):
        return [{**entry, **{k: _filled(v) for k, v in entry.items() if k == "template"}} for entry in value]
    return {name: _filled(content) for name, content in value.items()} if isinstance(value, dict) else value


@pytest.mark.parametrize("case", sorted(FOLDERS))
def test_model_folder_templates_render_as_transformers_renders_them(case: str, tmp_path: Path) -> None:
    key, files, plain_prompt, tools_prompt = FOLDERS[case]
    folder = _model_folder(tmp_path, _filled(key), _filled(files))
    for chat, prompt in (("two_turn", plain_prompt), ("tools", tools_prompt)):
        ours, theirs = _packtool_and_transformers(folder, "model", chat)
        assert ours == theirs, f"{case} {chat}"
        assert prompt in ours and QWEN_PROMPT not in ours, f"{case} {chat}: rendered with the wrong template"


def test_a_named_template_is_picked_by_name(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, files=_filled(FOLDERS["jinja_and_additional"][1]))
    for chat in ("two_turn", "tools"):
        ours, theirs = _packtool_and_transformers(folder, "model:tool_use", chat)
        assert ours == theirs and "For tools." in ours, chat
    template = load_template("model:tool_use", {}, folder=folder)
    assert (template.file, template.named, template.for_tools) == (
        "additional_chat_templates/tool_use.jinja",
        "tool_use",
        None,
    )


def test_the_template_used_and_the_one_passed_over_are_named(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, files=_filled(FOLDERS["jinja_and_additional"][1]))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = load_template("model", config, folder=folder)
    assert (template.file, template.named) == ("chat_template.jinja", "default")
    assert template.for_tools is not None and template.for_tools.file == "additional_chat_templates/tool_use.jinja"
    assert template.described == (
        "model (chat_template.jinja; records with tools: additional_chat_templates/tool_use.jinja (tool_use); "
        "tokenizer_config.json's chat_template (default) differs and is not used: transformers reads "
        "additional_chat_templates/tool_use.jinja, chat_template.jinja instead)"
    )
    # the same file as the key: nothing to say; a lone template has no name
    same = _model_folder(tmp_path / "same", files={"chat_template.jinja": _qwen_key()})
    lone = load_template("model", config, folder=same)
    assert (lone.file, lone.named, lone.passed_over) == ("chat_template.jinja", None, None)


# case -> (key, files, spec, the error)
BROKEN: dict[str, tuple[Any, dict[str, Any], str, str]] = {
    "empty_jinja": (
        None,
        {"chat_template.jinja": ""},
        "model",
        r"template chat_template.jinja is empty: every sample would render as nothing",
    ),
    "blank_named": (None, {"additional_chat_templates/rag.jinja": " \n"}, "model:rag", r"rag.jinja \(rag\) is empty"),
    "not_utf8": (None, {"chat_template.jinja": b"\xe9{{ x }}"}, "model", r"chat_template.jinja: not UTF-8 \(byte 0"),
    "jinja_is_a_folder": (None, {"chat_template.jinja/x": "x"}, "model", r"chat_template.jinja: not a regular file"),
    "jinja_is_a_pipe": (None, {"chat_template.jinja": os.mkfifo}, "model", r"chat_template.jinja: not a regular file"),
    "list_without_default": (
        [{"name": "rag", "template": "R"}, {"name": "tool_use", "template": "T"}],
        {},
        "model",
        r"templates are rag \(tokenizer_config.json\), tool_use \(tokenizer_config.json\) and none is named "
        r"'default'.*template: model:NAME",
    ),
    # transformers reads the files alone: the key's default is gone, and so is the default
    "additional_only": (
        None,
        {"additional_chat_templates/tool_use.jinja": "T"},
        "model",
        r"templates are tool_use \(additional_chat_templates/tool_use.jinja\) and none is named 'default'",
    ),
    "missing_name": (None, {}, "model:tool_use", r"no template named 'tool_use'; it has default \(tokenizer_config"),
    "entry_without_template": (
        [{"name": "default"}],
        {},
        "model",
        r"chat_template\[0\] must be \{name, template\}, both strings",
    ),
    "processor_template_only": (
        "",
        {"chat_template.json": '{"chat_template": "P"}'},
        "model",
        r"has no chat_template .*chat_template.json is a processor's template, which AutoTokenizer does not read",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_model_template_is_one_line(case: str, tmp_path: Path) -> None:
    key, files, spec, error = BROKEN[case]
    folder = _model_folder(tmp_path, _filled(key), files)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    with pytest.raises(PacktoolError, match=error) as caught:
        load_template(spec, config, folder=folder)
    assert "\n" not in str(caught.value)


def test_model_colon_without_a_name_is_a_config_error(tmp_path: Path) -> None:
    raw = {"sources": [], "tokenizer": str(QUICKSTART), "template": "model:", "capacity": 64, "output": "out"}
    with pytest.raises(PacktoolError, match=r"template: 'model:' names no template; write model:NAME"):
        parse_config(raw, base_dir=tmp_path)


def test_only_chat_template_jinja_changing_moves_the_encode_keys(tmp_path: Path) -> None:
    key = json.loads((QUICKSTART / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    # the key's text read from the file instead, then that file edited; a copy of the folder as it was
    jinja = {"plain": None, "copy": None, "from_file": key, "edited": key.replace("# Tools", "# Functions")}
    keys = {}
    for name, text in jinja.items():
        folder = tmp_path / name  # one folder each: a process keeps the Stages of a config it has seen
        shutil.copytree(QUICKSTART, folder)
        if text is not None:
            (folder / "chat_template.jinja").write_text(text, encoding="utf-8")
        config = load_config(ROOT / "configs" / "quickstart.yaml", overrides=[f"tokenizer={folder}"])
        items = _encode_items(config, stages_for(config), TokenCache(tmp_path / "cache"))
        keys[name] = {item.key for item in items if item.source != "docs"}  # text documents use no template
    assert keys["plain"] == keys["copy"] and len(keys["plain"]) > 1
    assert not keys["plain"] & keys["from_file"] and not keys["from_file"] & keys["edited"]


def test_a_prompt_completion_source_finds_the_template_in_chat_template_jinja(tmp_path: Path, write_jsonl) -> None:
    """A folder whose only template is chat_template.jinja has a template: message-list records use it."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(QUICKSTART, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    write_jsonl([{"prompt": "2+2?", "completion": "4"}])
    raw = {"sources": [{"name": "pc", "path": "data.jsonl", "format": "prompt_completion"}], "tokenizer": str(folder)}
    built = parse_config({**raw, "capacity": 64, "output": "out"}, base_dir=tmp_path)
    template = template_for(built, load_tokenizer(built.tokenizer).config)
    assert template is not None and template.file == "chat_template.jinja"


def test_a_syntax_error_in_a_model_template_file_names_the_file(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, files={"additional_chat_templates/rag.jinja": "{% for m in messages %}"})
    with pytest.raises(PacktoolError, match=r"^template additional_chat_templates/rag.jinja \(rag\) line 1: "):
        load_template("model:rag", {}, folder=folder)


def test_a_template_file_edited_between_two_builds_in_one_process_is_read_again(tmp_path):
    """A notebook builds, edits the model folder's chat_template.jinja, builds again: the second build
    rendered with the first template (the process kept its Stages by the config alone), and its
    manifest and cache key named the old one."""
    import hashlib

    from packtool.builder import build

    model = tmp_path / "model"
    shutil.copytree(QUICKSTART, model)
    chatml = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    (model / "chat_template.jinja").write_text(chatml)
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    raw = {
        "sources": [{"name": "chat", "path": "chat.jsonl", "format": "messages"}],
        "tokenizer": "model",
        "capacity": 128,
        "output": "out",
    }
    first = build(parse_config(raw, base_dir=tmp_path)).manifest["template"]
    edited = "SYSTEM NOTE\n" + chatml
    (model / "chat_template.jinja").write_text(edited)
    second = build(parse_config(raw, base_dir=tmp_path)).manifest["template"]
    assert first["sha256"] == hashlib.sha256(chatml.encode()).hexdigest()
    assert second["sha256"] == hashlib.sha256(edited.encode()).hexdigest()
