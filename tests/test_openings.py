"""Known openings (packtool.openings): the template's opening tokenized once, never a token changed."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_samples, rendered_batch, shared

import packtool.encode
import packtool.openings
from packtool.chat_templates import load_template
from packtool.config import DEFAULT_FIELDS, DEFAULT_SHAREGPT_ROLES, SourceConfig, TokenizerConfig, TrainPolicy
from packtool.encode import encode_batch, load_tokenizer
from packtool.openings import KnownOpenings, cut_tokens
from packtool.records import Example, Message
from packtool.render import render_chat
from packtool.sources import read_source

MODELS = ("qwen2.5", "qwen3", "llama-3.2", "mistral-nemo", "gemma-3", "phi-3-mini")


def _tokenizer(model: str):
    folder = shared("tokenizers", model)
    return load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))


def _chat(*turns: tuple[str, str]) -> Example:
    return Example("ex:0", "src", "hash", messages=tuple(Message(role, content) for role, content in turns))


def _real_examples() -> list[Example]:
    """Alpaca in two languages as chats, and glaive tool calls (tool lists printed in the system turn)."""
    examples = []
    for name in ("llamafactory_alpaca_zh_demo.json", "llamafactory_alpaca_en_demo.json"):
        for record in json.loads(shared("datasets", name).read_text(encoding="utf-8"))[:60]:
            prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
            examples.append(_chat(("user", prompt), ("assistant", record["output"])))
    glaive = str(shared("datasets", "llamafactory_glaive_toolcall_en_demo.json"))
    fields, roles = DEFAULT_FIELDS["sharegpt"], dict(DEFAULT_SHAREGPT_ROLES)
    source = SourceConfig("glaive", (glaive,), (), "sharegpt", fields, roles, max_samples=80)
    tools = [e for e in read_source(source) if isinstance(e, Example)]
    assert len(tools) == 80
    return examples + tools


@pytest.mark.parametrize("model", MODELS)
def test_known_openings_give_the_tokens_a_whole_encode_gives(model, monkeypatch):
    """Real samples encoded with known openings and again each as one whole text: the same tokens,
    targets, roles, message indices and mask-check rejections. Qwen2.5's default system prompt and
    Llama 3.2's dated system header are openings; a glaive tool list printed by several records is
    one too; Phi-3 (a first piece treated apart) uses none."""
    tokenizer = _tokenizer(model)
    template = load_template("model", tokenizer.config)
    batch = rendered_batch(_real_examples(), template)
    assert len(batch) > 140
    opened = encode_batch(batch, tokenizer)
    known = list(tokenizer.openings._known.values())
    monkeypatch.setattr(packtool.encode, "_opening", lambda rendered, tokenizer: None)
    assert_same_samples(opened, encode_batch(batch, tokenizer))
    openings = {o.text for o in known}
    if model == "qwen2.5":
        assert any("You are Qwen, created by Alibaba Cloud." in text for text in openings)
        assert any("<tools>" in text for text in openings)  # a tool list that several records print
    if model == "llama-3.2":
        assert any("Cutting Knowledge Date" in text for text in openings)
    if model == "phi-3-mini":
        assert tokenizer.openings._cut is None
    ends = tuple(cut_tokens(tokenizer.tokenizer))
    for opening in known:  # text before the first target, ending with a cut token
        assert len(opening.starts) >= packtool.openings.MIN_TOKENS and opening.text.endswith(ends)
        for rendered, _ in batch:
            if rendered.text.startswith(opening.text):
                assert all(len(opening.text) <= start for start, _, _ in rendered.target_ranges)


def test_a_cut_token_strips_nothing_after_it_and_is_part_of_no_longer_token():
    """Phi-3's turn tokens swallow the next newline (rstrip): no opening ends with one."""
    phi = cut_tokens(_tokenizer("phi-3-mini").tokenizer)
    assert "<|end|>" not in phi and "<|user|>" not in phi and "<|assistant|>" not in phi
    qwen = _tokenizer("qwen2.5").tokenizer
    assert {"<|im_start|>", "<|im_end|>", "<tool_call>"} <= set(cut_tokens(qwen))
    qwen.add_special_tokens(["<|im_start|>x"])  # <|im_start|> now starts a longer added token
    assert "<|im_start|>" not in cut_tokens(qwen)


def test_an_opening_that_changes_a_token_is_refused(monkeypatch):
    """Phi-3 pre-tokenizes a text's first piece apart ("▁" in front of it). Forced on anyway, the proof
    finds that the rest tokenized alone is not what it is after the opening, and refuses it for good."""
    monkeypatch.setattr(packtool.openings, "MIN_TOKENS", 1)
    tokenizer = _tokenizer("phi-3-mini")
    openings = KnownOpenings(tokenizer.tokenizer, enabled=True)
    text = "<s>Hello there"
    assert openings.find(text, [len(text)]) is None  # seen once
    assert openings.find(text, [len(text)]) is None  # seen twice: proven, and refused
    assert openings._refused == {"<s>"} and openings._known == {} and openings._tokens == {"<s>": False}


def test_an_opening_holding_record_data_is_never_proven_and_what_is_remembered_stays_bounded(monkeypatch):
    """Tool lists that differ per record make every candidate new: none is proven (a candidate is tried
    on its second sighting), and candidates seen once are forgotten together past MAX_REMEMBERED. One
    that comes back within that many is proven; past MAX_REMEMBERED proven or refused, none is tried."""
    monkeypatch.setattr(packtool.openings, "MAX_REMEMBERED", 16)
    tokenizer = _tokenizer("qwen2.5")
    openings = KnownOpenings(tokenizer.tokenizer, enabled=True)
    head = "<|im_start|>system\nYou may call these tools: {}<|im_end|>\n<|im_start|>"

    def text(i: int) -> str:
        return head.format(f"tool_{i}") + "user\nHi"

    for i in range(40):
        assert openings.find(text(i), [len(text(i)) - 2]) is None
        assert len(openings._seen) <= 16
    assert openings._known == {} and openings._refused == set()
    assert openings.find(text(39), [len(text(39)) - 2]).text == head.format("tool_39")  # came back
    for i in range(40, 80):  # each seen twice in a row: proven until 16 are known or refused
        openings.find(text(i), [len(text(i)) - 2])
        openings.find(text(i), [len(text(i)) - 2])
    assert len(openings._known) == 16 and openings.find(text(79), [len(text(79)) - 2]) is None


def test_the_longest_candidate_seen_twice_is_proven_and_none_ends_after_the_last_stop():
    tokenizer = _tokenizer("qwen2.5")
    openings = KnownOpenings(tokenizer.tokenizer, enabled=True)
    template = "<|im_start|>system\n"
    system = template + "You are a careful assistant who answers briefly.<|im_end|>\n<|im_start|>"
    text = system + "user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
    stops = [len(template), len(system) + 5]  # the system prompt's content, the user's
    assert openings.find(text, stops) is None
    opening = openings.find(text, stops)
    assert opening is not None and opening.text == system
    ids = tokenizer.tokenizer.encode(system, add_special_tokens=False).ids
    assert opening.ids.tolist() == ids and len(opening.starts) == len(ids)
    assert openings.find(text, [len(system) - 1]) is None  # only a shorter candidate would do
    assert openings.find("<|im_start|>user\nHi", [12]) is None
    assert openings.find(system + "user\nAnother question", [len(system) + 5]) is opening


def test_a_system_prompt_shared_by_records_is_an_opening(monkeypatch):
    """`sources[].system` (or a dataset's own fixed system message) gives every conversation the same
    system turn: the opening takes it in, and the tokens are those of the whole text."""
    tokenizer = _tokenizer("qwen2.5")
    template = load_template("model", tokenizer.config)
    system = "You are a terse assistant. Answer in one sentence, and never in lists."
    questions = ["What is 2 + 2?", " Leading space?", "\nNewline first", "你好吗", "<|im_end|> typed"]
    batch = [
        (render_chat(_chat(("system", system), ("user", q), ("assistant", "Yes.")), template, TrainPolicy()), "keep")
        for q in questions * 2
    ]
    opened = encode_batch(batch, tokenizer)
    assert [system in o.text for o in tokenizer.openings._known.values()] == [True]
    monkeypatch.setattr(packtool.encode, "_opening", lambda rendered, tokenizer: None)
    assert_same_samples(opened, encode_batch(batch, tokenizer))


WORDS = st.text(alphabet=st.sampled_from(list('ab \n\t.<|>é中😀{}"\\▁Ġ')), max_size=12)
TURN = st.tuples(st.sampled_from(["user", "assistant"]), st.sampled_from(["", " ", "\n", "  \n"]), WORDS)
_TOKENIZERS: dict[str, Any] = {}


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=40, deadline=None)
@given(
    system=st.one_of(st.none(), WORDS),
    conversations=st.lists(st.lists(TURN, min_size=1, max_size=3), min_size=1, max_size=4),
    policy=st.sampled_from(["keep", "escape"]),
)
def test_openings_never_change_a_token(model, system, conversations, policy):
    """Conversations with or without a shared system prompt (contents of spaces, newlines, control-token
    pieces, Ġ and ▁, CJK, an emoji), each encoded twice so that its openings are proven: the samples
    are those of the same batch encoded with openings off."""
    if model not in _TOKENIZERS:
        _TOKENIZERS[model] = _tokenizer(model)
    tokenizer = _TOKENIZERS[model]
    template = load_template("model", tokenizer.config)
    head = (("system", system),) if system is not None else ()
    examples = [
        _chat(*head, *((role, f"{pad}{words}{pad[::-1]}") for role, pad, words in turns)) for turns in conversations
    ]
    batch = rendered_batch(examples * 2, template, policy)
    closed = dataclasses.replace(tokenizer)  # the same tokenizer, with openings of its own: off
    closed.__dict__["openings"] = KnownOpenings(tokenizer.tokenizer, enabled=False)
    assert_same_samples(encode_batch(batch, tokenizer), encode_batch(batch, closed))
