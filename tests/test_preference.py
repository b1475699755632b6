"""Preference pairs and completion groups: parsing every shape, encoding with a shared prompt, joint truncation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import QUICKSTART, shared

from packtool.adapters import group_from_record, pair_from_record, pair_shape
from packtool.builder.answers import encode_answers
from packtool.chat_templates import load_template
from packtool.config import TokenizerConfig, TrainPolicy
from packtool.encode import load_tokenizer
from packtool.errors import RecordError
from packtool.records import CompletionGroup, Message, PreferencePair, Tokenized, prompt_length
from packtool.truncate import truncate_item


def tokenizer_and_template(folder):
    tokenizer = load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))
    return tokenizer, load_template("model", tokenizer.config)


@pytest.fixture(scope="module")
def quickstart():
    return tokenizer_and_template(QUICKSTART / "tokenizer")


@pytest.fixture(scope="module")
def qwen():
    return tokenizer_and_template(shared("tokenizers", "qwen2.5"))


def decode(tokenizer, ids) -> str:
    return tokenizer.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def answer_text(tokenizer, segment: Tokenized) -> str:
    return decode(tokenizer, segment.input_ids[segment.targets])


# -- parsing ----------------------------------------------------------------------------------

LLAMAFACTORY = {
    "conversations": [
        {"from": "human", "value": "Name a prime."},
        {"from": "gpt", "value": "7"},
        {"from": "human", "value": "Another?"},
    ],
    "system": "Be terse.",
    "chosen": {"from": "gpt", "value": "11"},
    "rejected": {"from": "gpt", "value": "12"},
}
TRL_CONVERSATIONAL = {
    "prompt": [{"role": "user", "content": "Sky colour?"}],
    "chosen": [{"role": "assistant", "content": "Blue."}],
    "rejected": [{"role": "assistant", "content": "Green."}],
}
TRL_IMPLICIT = {
    "chosen": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "rejected": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "5"},
    ],
}
STRINGS = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}


def pair(record, id="p:0"):
    return pair_from_record(record, sample_id=id, source="prefs", location=f"prefs.jsonl:{id}")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_real_llamafactory_dpo_row_parses(lang):
    rows = json.loads(shared("datasets", f"llamafactory_dpo_{lang}_demo.json").read_text(encoding="utf-8"))
    pairs = [pair(row, f"dpo:{i}") for i, row in enumerate(rows)]
    assert len(pairs) == len(rows) > 0
    for row, p in zip(rows, pairs, strict=True):
        assert pair_shape(row) == "llamafactory"
        assert [m.content for m in p.prompt] == [turn["value"] for turn in row["conversations"]]
        assert p.chosen == (Message("assistant", row["chosen"]["value"], train=True),)
        assert p.rejected == (Message("assistant", row["rejected"]["value"], train=True),)
        assert all(m.train is False for m in p.prompt)
    systems = sum(turn["from"] == "system" for row in rows for turn in row["conversations"])
    assert sum(m.role == "system" for p in pairs for m in p.prompt) == systems


def test_llamafactory_row_keeps_system_field_and_earlier_turns_as_context():
    p = pair(LLAMAFACTORY)
    assert [(m.role, m.content, m.train) for m in p.prompt] == [
        ("system", "Be terse.", False),
        ("user", "Name a prime.", False),
        ("assistant", "7", False),
        ("user", "Another?", False),
    ]
    assert (p.chosen[0].content, p.rejected[0].content) == ("11", "12")
    assert p.sample_hash and not p.is_text


def test_trl_conversational_and_strings():
    conversational = pair(TRL_CONVERSATIONAL)
    assert [m.content for m in conversational.prompt] == ["Sky colour?"]
    assert conversational.answers == (
        (Message("assistant", "Blue.", train=True),),
        (Message("assistant", "Green.", train=True),),
    )
    strings = pair(STRINGS)
    assert strings.is_text
    assert (strings.prompt[0].content, strings.chosen[0].content, strings.rejected[0].content) == (
        "The sky is",
        " blue.",
        " green.",
    )


def test_trl_implicit_prompt_is_the_longest_common_prefix():
    p = pair(TRL_IMPLICIT)
    assert pair_shape(TRL_IMPLICIT) == "trl_implicit"
    assert [m.content for m in p.prompt] == ["Hi", "Hello!", "2+2?"]
    assert (p.chosen[0].content, p.rejected[0].content) == ("4", "5")


def test_multi_message_answer_trains_assistant_messages_only():
    record = {
        "prompt": [{"role": "user", "content": "Weather in Paris?"}],
        "chosen": [
            {"role": "assistant", "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "18C and sunny."},
        ],
        "rejected": [{"role": "assistant", "content": "No idea."}],
    }
    p = pair(record)
    assert [(m.role, m.train) for m in p.chosen] == [("assistant", True), ("tool", False), ("assistant", True)]


@pytest.mark.parametrize(
    ("record", "field", "message"),
    [
        (
            {"conversations": [{"from": "human", "value": "x"}], "rejected": {"from": "gpt", "value": "y"}},
            "chosen",
            "missing",
        ),
        (
            {**LLAMAFACTORY, "rejected": {"from": "human", "value": "y"}},
            "rejected",
            "start and end with an assistant",
        ),
        ({**LLAMAFACTORY, "chosen": "11"}, "chosen", "turn object"),
        ({**LLAMAFACTORY, "chosen": {"from": "robot", "value": "1"}}, "chosen[0].from", "unknown speaker"),
        ({**TRL_CONVERSATIONAL, "chosen": [{"role": "wizard", "content": "x"}]}, "chosen[0].role", "unknown role"),
        ({**TRL_CONVERSATIONAL, "rejected": "Green."}, "rejected", "list of messages"),
        ({"chosen": TRL_IMPLICIT["chosen"], "rejected": TRL_IMPLICIT["chosen"]}, "rejected", "do not diverge"),
        ({"chosen": TRL_IMPLICIT["chosen"], "rejected": TRL_IMPLICIT["chosen"][:2]}, "rejected", "do not diverge"),
        ({**STRINGS, "rejected": ""}, "rejected", "empty string"),
        ({**STRINGS, "chosen": 3}, "chosen", "expected a string"),
        ({"text": "hello"}, "chosen", "not a preference record"),
    ],
)
def test_bad_preference_records_name_the_field(record, field, message):
    with pytest.raises(RecordError, match=message) as caught:
        pair(record)
    assert caught.value.field == field


def test_group_shapes_and_scores():
    group = group_from_record(
        {"prompt": "2+2=", "completions": ["4", "5", "four"], "rewards": [1, 0, 0.5]}, sample_id="g:0", source="rl"
    )
    assert isinstance(group, CompletionGroup) and group.is_text
    assert [c[0].content for c in group.completions] == ["4", "5", "four"]
    assert group.rewards == (1.0, 0.0, 0.5) and group.advantages is None
    chat = group_from_record(
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "completions": [{"role": "assistant", "content": "Hello"}, [{"role": "assistant", "content": "Hey"}]],
            "advantages": [0.5, -0.5],
        },
        sample_id="g:1",
        source="rl",
    )
    assert [c[0].content for c in chat.answers] == ["Hello", "Hey"] and chat.advantages == (0.5, -0.5)


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"prompt": "x", "completions": []}, "completions"),
        ({"prompt": "x", "completions": ["a", ""]}, "completions[1]"),
        ({"prompt": "x", "completions": ["a", "b"], "rewards": [1.0]}, "rewards"),
        ({"prompt": "x", "completions": ["a", "b"], "rewards": [1.0, "high"]}, "rewards[1]"),
        ({"prompt": "x", "completions": ["a", "b"], "advantages": [1.0, float("nan")]}, "advantages[1]"),
        (
            {"prompt": [{"role": "user", "content": "x"}], "completions": [[{"role": "user", "content": "y"}]]},
            "completions[0]",
        ),
        ({"completions": ["a"]}, "prompt"),
    ],
)
def test_bad_group_records_name_the_field(record, field):
    with pytest.raises(RecordError) as caught:
        group_from_record(record, sample_id="g", source="rl")
    assert caught.value.field == field


# -- encoding ---------------------------------------------------------------------------------


def test_quickstart_pair_targets_are_the_final_answer_only(quickstart):
    tokenizer, template = quickstart
    chosen, rejected = encode_answers(pair(LLAMAFACTORY), template, tokenizer)
    assert answer_text(tokenizer, chosen) == "11<|im_end|>"
    assert answer_text(tokenizer, rejected) == "12<|im_end|>"
    n = prompt_length(chosen)
    assert n == prompt_length(rejected)
    assert np.array_equal(chosen.input_ids[:n], rejected.input_ids[:n])
    # the earlier assistant turn "7" is in the prompt and is context
    assert "assistant\n7<|im_end|>" in decode(tokenizer, chosen.input_ids[:n])
    assert decode(tokenizer, chosen.input_ids[:n]).endswith("<|im_start|>assistant\n")


def test_train_policy_decides_the_end_marker_but_not_which_turns(quickstart):
    tokenizer, template = quickstart
    no_eot = encode_answers(pair(LLAMAFACTORY), template, tokenizer, TrainPolicy(end_of_turn=False))
    assert [answer_text(tokenizer, s) for s in no_eot] == ["11", "12"]
    # roles/turns policies cannot make a prompt turn a target: every message has an explicit flag
    user_policy = encode_answers(pair(LLAMAFACTORY), template, tokenizer, TrainPolicy(roles=("user", "assistant")))
    assert [answer_text(tokenizer, s) for s in user_policy] == ["11<|im_end|>", "12<|im_end|>"]


def test_string_pair_without_template_is_a_text_continuation(quickstart):
    tokenizer, _ = quickstart
    chosen, rejected = encode_answers(pair(STRINGS), None, tokenizer)
    assert answer_text(tokenizer, chosen) == " blue.<|im_end|>"
    assert answer_text(tokenizer, rejected) == " green.<|im_end|>"
    assert decode(tokenizer, chosen.input_ids) == "The sky is blue.<|im_end|>"
    no_eos = encode_answers(pair(STRINGS), None, tokenizer, TrainPolicy(end_of_turn=False))
    assert [answer_text(tokenizer, s) for s in no_eos] == [" blue.", " green."]
    with pytest.raises(RecordError, match="no chat template"):
        encode_answers(pair(TRL_CONVERSATIONAL), None, tokenizer)


def test_group_encodes_one_segment_per_completion(quickstart):
    tokenizer, template = quickstart
    group = group_from_record({"prompt": "2+2=", "completions": ["4", "5", "four"]}, sample_id="g:0", source="rl")
    segments = encode_answers(group, template, tokenizer)
    assert [answer_text(tokenizer, s) for s in segments] == ["4<|im_end|>", "5<|im_end|>", "four<|im_end|>"]
    assert len({s.input_ids[: prompt_length(s)].tobytes() for s in segments}) == 1


def test_empty_answer_is_a_record_error(quickstart):
    tokenizer, template = quickstart
    bad = PreferencePair(
        "p",
        "s",
        "h",
        (Message("user", "x", train=False),),
        (Message("assistant", " ", train=True),),
        (Message("assistant", "y", train=True),),
    )
    with pytest.raises(RecordError, match="empty"):
        encode_answers(bad, template, tokenizer)
    with pytest.raises(RecordError, match="empty prompt") as caught:
        PreferencePair("p", "s", "h", (), bad.rejected, bad.rejected)
    assert caught.value.field == "prompt"


def test_template_whose_prompt_depends_on_the_answer_is_rejected(quickstart, tmp_path):
    tokenizer, template = quickstart
    # prints the number of messages first: a 3-message answer changes the prompt's tokens
    path = tmp_path / "counting.jinja"
    path.write_text("{{ messages | length }}\n" + template.source, encoding="utf-8")
    counting = load_template(str(path), tokenizer.config)
    record = {
        "prompt": [{"role": "user", "content": "Weather?"}],
        "chosen": [
            {"role": "assistant", "tool_calls": [{"function": {"name": "weather", "arguments": {}}}]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "18C."},
        ],
        "rejected": [{"role": "assistant", "content": "No idea."}],
    }
    with pytest.raises(RecordError, match="tokenizes the prompt differently") as caught:
        encode_answers(pair(record), counting, tokenizer)
    assert (caught.value.kind, caught.value.sample_id) == ("prompt_mismatch", "p:0")
    chosen, _ = encode_answers(pair(record), template, tokenizer)  # the same pair under a prefix-stable template
    assert answer_text(tokenizer, chosen).endswith("18C.<|im_end|>")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_real_dpo_rows_with_qwen_chosen_targets_decode_to_the_chosen_answer(qwen, lang):
    tokenizer, template = qwen
    rows = json.loads(shared("datasets", f"llamafactory_dpo_{lang}_demo.json").read_text(encoding="utf-8"))
    for i in range(0, len(rows), 25):  # a spread of rows keeps the test fast; the bench encodes them all
        p = pair(rows[i], f"dpo:{i}")
        chosen, rejected = encode_answers(p, template, tokenizer)
        assert answer_text(tokenizer, chosen) == rows[i]["chosen"]["value"] + "<|im_end|>"
        assert answer_text(tokenizer, rejected) == rows[i]["rejected"]["value"] + "<|im_end|>"
        n = prompt_length(chosen)
        assert n == prompt_length(rejected) and np.array_equal(chosen.input_ids[:n], rejected.input_ids[:n])
        assert not chosen.targets[:n].any()
        assert decode(tokenizer, chosen.input_ids[:n]).endswith(
            rows[i]["conversations"][-1]["value"] + "<|im_end|>\n<|im_start|>assistant\n"
        )


# -- joint truncation ---------------------------------------------------------------------------


def synthetic_segment(n_prompt: int, n_answer: int, answer_token: int, id="item") -> Tokenized:
    ids = np.concatenate([np.arange(1, n_prompt + 1), np.full(n_answer, answer_token)]).astype(np.int32)
    targets = np.arange(n_prompt + n_answer) >= n_prompt
    return Tokenized(
        id, "s", "h", ids, targets, np.zeros(len(ids), np.int8), np.full(len(ids), -1, np.int16), ("user", "assistant")
    )


def test_left_cut_keeps_the_same_prompt_tail_in_both_segments():
    segments = [synthetic_segment(10, 3, 900), synthetic_segment(10, 5, 901)]
    result = truncate_item(segments, 20, "left")
    assert result.strategy == "left" and result.removed_prompt_tokens == 4 and result.drop_reason is None
    assert [s.input_ids.tolist() for s in result.segments] == [
        [5, 6, 7, 8, 9, 10, 900, 900, 900],
        [5, 6, 7, 8, 9, 10, 901, 901, 901, 901, 901],
    ]
    assert result.n_tokens == 20
    assert truncate_item(segments, 28).strategy == "none"


def test_item_that_cannot_fit_is_dropped_with_the_given_reason():
    segments = [synthetic_segment(10, 9, 900), synthetic_segment(10, 9, 901)]
    dropped = truncate_item(segments, 19, "left")  # answers alone take 18: no prompt token left
    assert dropped.segments == () and dropped.drop_reason == "pair_too_long"
    assert "38 tokens > capacity 19" in dropped.detail
    group = truncate_item([synthetic_segment(4, 2, 900 + i) for i in range(3)], 17, "drop", too_long="group_too_long")
    assert group.drop_reason == "group_too_long"


@given(
    n_prompt=st.integers(1, 40),
    answers=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    capacity=st.integers(2, 200),
)
def test_left_cut_property(n_prompt, answers, capacity):
    segments = [synthetic_segment(n_prompt, a, 1000 + k) for k, a in enumerate(answers)]
    result = truncate_item(segments, capacity, "left")
    if result.drop_reason:
        assert sum(answers) + len(answers) > capacity  # not even one prompt token each fits
        return
    assert result.n_tokens <= capacity
    kept = [s.input_ids[: prompt_length(s)].tolist() for s in result.segments]
    assert all(k == kept[0] for k in kept) and kept[0] == list(range(n_prompt - len(kept[0]) + 1, n_prompt + 1))
    for segment, original in zip(result.segments, segments, strict=True):
        assert segment.input_ids[segment.targets].tolist() == original.input_ids[original.targets].tolist()


def test_turns_cut_removes_whole_old_turns_from_both_segments(quickstart):
    tokenizer, template = quickstart
    record = {
        "conversations": [
            {"from": "human", "value": "First question, rather long " * 4},
            {"from": "gpt", "value": "First answer, also long " * 4},
            {"from": "human", "value": "Second?"},
        ],
        "system": "Be terse.",
        "chosen": {"from": "gpt", "value": "Yes."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    segments = encode_answers(pair(record), template, tokenizer)
    full = sum(len(s) for s in segments)
    result = truncate_item(segments, full - 10, "turns")
    assert result.strategy == "turns" and result.n_tokens <= full - 10
    texts = [decode(tokenizer, s.input_ids) for s in result.segments]
    kept = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nSecond?<|im_end|>\n<|im_start|>assistant\n"
    assert texts == [f"{kept}Yes.<|im_end|>\n", f"{kept}No.<|im_end|>\n"]
    assert truncate_item(segments, 40, "turns").drop_reason == "pair_too_long"
