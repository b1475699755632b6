"""Truncation strategies on hand-worked rows, properties over random conversations, real tool-calling rows.

Token ids in the built samples are their positions, so the ids a strategy keeps say exactly
which tokens survived.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import shard_rows, shared

from packtool.builder import build
from packtool.config import load_config
from packtool.labels import IGNORE_INDEX
from packtool.records import ROLE_CODES, Tokenized
from packtool.truncate import STRATEGIES, Truncation, check_strategy, truncate

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def conversation(
    messages: list[tuple[str, int, bool]],
    *,
    preamble: int = 1,
    sep: int = 1,
    structured: set[int] | None = None,
    example_id: str = "conv",
) -> Tokenized:
    """A Tokenized chat: `preamble` template tokens, then each message's `n_tokens` content tokens,
    with `sep` template tokens (message_index -1) between consecutive messages.

    `trained` makes every content token of that message a target. Tool messages are structured
    unless `structured` names the structured message indices.
    """
    index: list[int] = [-1] * preamble
    roles: list[int] = [ROLE_CODES["template"]] * preamble
    targets: list[bool] = [False] * preamble
    for m, (role, n_tokens, trained) in enumerate(messages):
        if m:
            index += [-1] * sep
            roles += [ROLE_CODES["template"]] * sep
            targets += [False] * sep
        index += [m] * n_tokens
        roles += [ROLE_CODES[role]] * n_tokens
        targets += [trained] * n_tokens
    if structured is None:
        structured = {m for m, (role, _, _) in enumerate(messages) if role == "tool"}
    return Tokenized(
        example_id=example_id,
        source="test",
        sample_hash="0" * 32,
        input_ids=np.arange(len(index), dtype=np.int32),
        targets=np.array(targets, dtype=bool),
        roles=np.array(roles, dtype=np.int8),
        message_index=np.array(index, dtype=np.int16),
        message_roles=tuple(role for role, _, _ in messages),
        structured_messages=frozenset(structured),
    )


def text(n_tokens: int, *, targets: list[bool] | None = None, example_id: str = "doc") -> Tokenized:
    """A plain-text Tokenized of `n_tokens`, every token a target unless `targets` says otherwise."""
    flags = np.ones(n_tokens, dtype=bool) if targets is None else np.array(targets, dtype=bool)
    return Tokenized(
        example_id=example_id,
        source="test",
        sample_hash="0" * 32,
        input_ids=np.arange(n_tokens, dtype=np.int32),
        targets=flags,
        roles=np.full(n_tokens, ROLE_CODES["text"], dtype=np.int8),
        message_index=np.full(n_tokens, -1, dtype=np.int16),
    )


def ids(result: Truncation) -> list[list[int]]:
    return [sample.input_ids.tolist() for sample in result.samples]


# The module docstring's example: P s0 h u0 u1 h a0* a1* h u2 h a2* a3* (13 tokens).
DOC_EXAMPLE = [
    ("system", 1, False),
    ("user", 2, False),
    ("assistant", 2, True),
    ("user", 1, False),
    ("assistant", 2, True),
]


# -- each strategy on hand-worked rows -------------------------------------------------------


def test_a_sample_that_fits_comes_back_unchanged():
    sample = conversation(DOC_EXAMPLE)
    result = truncate(sample, 13, "drop")
    assert result.samples == (sample,)
    assert (result.strategy, result.removed_tokens, result.removed_targets, result.drop_reason) == ("none", 0, 0, None)


def test_drop_rejects_with_the_numbers():
    sample = conversation(DOC_EXAMPLE)
    result = truncate(sample, 8, "drop")
    assert result.samples == ()
    assert (result.strategy, result.drop_reason) == ("drop", "too_long")
    assert (result.removed_tokens, result.removed_targets) == (13, 4)
    assert result.detail == "sample 'conv': 13 tokens > capacity 8; set truncation.strategy or raise capacity"


@pytest.mark.parametrize(
    ("strategy", "kept"),
    [
        ("right", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("left", [5, 6, 7, 8, 9, 10, 11, 12]),
        ("middle", [0, 1, 2, 3, 9, 10, 11, 12]),
        ("turns", [0, 1, 2, 9, 10, 11, 12]),
    ],
)
def test_docstring_example(strategy, kept):
    result = truncate(conversation(DOC_EXAMPLE), 8, strategy)
    assert ids(result) == [kept]
    assert result.strategy == strategy
    assert result.removed_tokens == 13 - len(kept)
    assert result.removed_targets == 4 - int(result.samples[0].targets.sum())


def test_right_and_left_slice_plain_text():
    sample = text(10)
    assert ids(truncate(sample, 4, "right")) == [[0, 1, 2, 3]]
    left = truncate(sample, 4, "left")
    assert ids(left) == [[6, 7, 8, 9]]
    # Token 6 is still flagged a target; the label builder drops it as a segment start.
    assert left.samples[0].targets.tolist() == [True] * 4
    assert (left.removed_tokens, left.removed_targets) == (6, 6)


@pytest.mark.parametrize(("capacity", "kept"), [(5, [0, 1, 2, 8, 9]), (4, [0, 1, 8, 9])])
def test_middle_gives_the_head_the_odd_token(capacity, kept):
    assert ids(truncate(text(10), capacity, "middle")) == [kept]


def test_window_is_seeded_by_seed_and_id():
    sample = text(100)
    first = truncate(sample, 10, "window", seed=3)
    assert ids(first) == ids(truncate(sample, 10, "window", seed=3))
    (window,) = ids(first)
    assert window == list(range(window[0], window[0] + 10))
    starts = {
        truncate(text(100, example_id=f"doc{i}"), 10, "window", seed=s).samples[0].input_ids[0]
        for i in range(8)
        for s in range(4)
    }
    assert len(starts) > 10, "windows should move with the id and the seed"
    # Every start is reachable, the last one included.
    edges = {int(truncate(text(5, example_id=f"doc{i}"), 4, "window").samples[0].input_ids[0]) for i in range(32)}
    assert edges == {0, 1}


def test_split_keeps_every_token_in_consecutive_pieces():
    result = truncate(text(10), 4, "split")
    assert ids(result) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (result.strategy, result.removed_tokens, result.removed_targets) == ("split", 0, 0)
    assert all(piece.example_id == "doc" for piece in result.samples)


def test_split_removes_a_last_piece_of_one_token():
    # A one-token piece is only a segment start: no label, so it is removed and counted.
    result = truncate(text(9), 4, "split")
    assert ids(result) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (result.removed_tokens, result.removed_targets, result.drop_reason) == (1, 1, None)


@pytest.mark.parametrize("strategy", ["window", "split"])
def test_plain_text_strategies_reject_a_conversation(strategy):
    result = truncate(conversation(DOC_EXAMPLE), 8, strategy)
    assert (result.samples, result.drop_reason, result.removed_tokens) == ((), "too_long", 13)
    assert f"strategy '{strategy}' applies to plain text" in result.detail


# -- turns ---------------------------------------------------------------------------------


LONG_CHAT = [
    ("system", 3, False),  # 0: positions 1..3
    ("user", 4, False),  # 1: 5..8     turn 0
    ("assistant", 4, True),  # 2: 10..13
    ("user", 4, False),  # 3: 15..18   turn 1
    ("assistant", 4, True),  # 4: 20..23
    ("user", 4, False),  # 5: 25..28   turn 2
    ("assistant", 4, True),  # 6: 30..33
    ("user", 2, False),  # 7: 35..36   turn 3 (final trained)
    ("assistant", 3, True),  # 8: 38..40
]


def test_turns_removes_the_oldest_turns_first_and_only_as_many_as_needed():
    sample = conversation(LONG_CHAT)
    assert len(sample) == 41
    result = truncate(sample, 31, "turns")
    # Turn 0 is [5, 15): removing it leaves 31.
    assert ids(result) == [[0, 1, 2, 3, 4, *range(15, 41)]]
    assert result.strategy == "turns"
    assert (result.removed_tokens, result.removed_targets) == (10, 4)
    two = truncate(sample, 30, "turns")
    assert ids(two) == [[0, 1, 2, 3, 4, *range(25, 41)]]


def test_turns_keeps_system_preamble_and_final_trained_turn_whole():
    sample = conversation(LONG_CHAT, preamble=2, sep=2)
    result = truncate(sample, 25, "turns")
    (kept,) = result.samples
    index = sample.message_index
    kept_messages = set(kept.message_index.tolist()) - {-1}
    assert kept_messages == {0, 7, 8}
    for m in kept_messages:
        assert (kept.message_index == m).sum() == (index == m).sum(), f"message {m} was cut"
    assert kept.input_ids[:2].tolist() == [0, 1], "the preamble stays"
    assert result.strategy == "turns"


def test_turns_keeps_an_untrained_tail_after_the_final_trained_turn():
    chat = [*DOC_EXAMPLE, ("user", 1, False)]  # a last user message nobody answered
    result = truncate(conversation(chat), 9, "turns")
    assert ids(result) == [[0, 1, 2, 9, 10, 11, 12, 13, 14]]


def test_turns_falls_back_when_the_final_turn_alone_is_too_long():
    sample = conversation(LONG_CHAT)
    result = truncate(sample, 10, "turns", fallback="right")
    # Old turns go first (leaving 0..4 + 35..40), then the fallback keeps the first 10.
    assert ids(result) == [[0, 1, 2, 3, 4, 35, 36, 37, 38, 39]]
    assert result.strategy == "turns+right"
    left = truncate(sample, 10, "turns", fallback="left")
    assert ids(left) == [[1, 2, 3, 4, 35, 36, 37, 38, 39, 40]]
    assert left.strategy == "turns+left"


def test_turns_fallback_never_cuts_inside_a_tool_result():
    chat = [
        ("user", 3, False),  # 0: 1..3
        ("assistant", 4, True),  # 1: 5..8    tool call, structured
        ("tool", 10, False),  # 2: 10..19   tool result, structured
        ("assistant", 3, True),  # 3: 21..23
    ]
    sample = conversation(chat, structured={1, 2})
    result = truncate(sample, 15, "turns", fallback="right")
    # No earlier turn exists; `right` would cut at 15, inside the tool result: cut before it.
    assert ids(result) == [list(range(10))]
    assert result.strategy == "right"
    assert (result.removed_tokens, result.removed_targets) == (14, 3)


def test_turns_fallback_drop_and_plain_text():
    result = truncate(conversation(LONG_CHAT), 10, "turns", fallback="drop")
    assert (result.strategy, result.drop_reason, result.removed_tokens) == ("turns+drop", "too_long", 41)
    assert result.detail == (
        "sample 'conv': 41 tokens > capacity 10; 11 after removing old turns, "
        "then 11 tokens > capacity 10; set truncation.strategy or raise capacity"
    )
    plain = truncate(text(10), 4, "turns", fallback="left")
    assert (ids(plain), plain.strategy) == ([[6, 7, 8, 9]], "left")


def test_turns_with_a_user_first_conversation_keeps_the_headers_well_formed():
    # message 0 is a user message: the preamble ends with its header. Removing turn 0 must leave
    # that header in front of the next kept user message, not in front of an empty message.
    chat = [("user", 2, False), ("assistant", 2, True), ("user", 2, False), ("assistant", 2, True)]
    sample = conversation(chat, preamble=3, sep=2)
    result = truncate(sample, 10, "turns")
    (kept,) = result.samples
    assert kept.message_index.tolist() == [-1, -1, -1, 2, 2, -1, -1, 3, 3]


# -- structured messages under right / left / middle ----------------------------------------


TOOL_CHAT = [
    ("system", 2, False),  # 0: 1..2
    ("user", 2, False),  # 1: 4..5
    ("assistant", 3, True),  # 2: 7..9     tool call
    ("tool", 6, False),  # 3: 11..16   tool result
    ("assistant", 4, True),  # 4: 18..21
]


@pytest.mark.parametrize(
    ("strategy", "capacity", "kept"),
    [
        ("right", 14, list(range(11))),  # would cut inside 11..16: stop before 11
        ("left", 8, list(range(17, 22))),  # would start inside 11..16: start after 16
        ("middle", 16, [*range(7), *range(17, 22)]),  # head would end inside 7..9, tail start inside 11..16
    ],
)
def test_a_cut_never_lands_inside_a_structured_message(strategy, capacity, kept):
    sample = conversation(TOOL_CHAT, structured={2, 3})
    assert len(sample) == 22
    assert ids(truncate(sample, capacity, strategy)) == [kept]


# -- zero targets --------------------------------------------------------------------------


def test_a_cut_that_leaves_no_target_drops_the_sample():
    sample = conversation([("user", 6, False), ("assistant", 3, True), ("user", 6, False)])
    result = truncate(sample, 7, "left")
    assert (result.samples, result.drop_reason, result.strategy) == ((), "no_targets", "left")
    assert (result.removed_tokens, result.removed_targets) == (18, 3)
    assert result.detail == "sample 'conv': no target token left after 'left' kept 7 of 18"


def test_a_sample_without_targets_is_dropped_even_when_it_fits():
    # The only target is the first token, which as a segment start is never a label.
    result = truncate(text(4, targets=[True, False, False, False]), 8, "right")
    assert (result.samples, result.strategy, result.drop_reason) == ((), "none", "no_targets")
    assert (result.removed_tokens, result.removed_targets) == (4, 1)


def test_truncation_checks_its_own_invariant():
    with pytest.raises(ValueError, match="a drop reason is set exactly when no sample remains"):
        Truncation(samples=(), strategy="right", removed_tokens=3, removed_targets=0)


# -- bad arguments -------------------------------------------------------------------------


def test_an_unknown_strategy_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown truncation strategy 'tail'; expected one of drop, right, left"):
        truncate(text(4), 2, "tail")
    with pytest.raises(ValueError, match="unknown truncation fallback 'nope'"):
        check_strategy("turns", "nope")


def test_turns_cannot_be_its_own_fallback():
    with pytest.raises(
        ValueError, match=r"fallback 'turns' is not allowed.*choose one of drop, right, left, middle, window"
    ):
        truncate(text(4), 2, "turns", fallback="turns")


@pytest.mark.parametrize("capacity", [0, 1, -5, 2.5, True])
def test_capacity_must_hold_a_label(capacity):
    with pytest.raises(ValueError, match=r"capacity .* must be an integer >= 2"):
        truncate(text(4), capacity, "right")


# -- properties ----------------------------------------------------------------------------


@st.composite
def chats(draw) -> Tokenized:
    """Turns of a user message then assistant/tool messages; most assistant messages trained."""
    messages = []
    if draw(st.booleans()):
        messages.append(("system", draw(st.integers(0, 5)), False))
    for _ in range(draw(st.integers(1, 5))):
        messages.append(("user", draw(st.integers(0, 6)), False))
        for role in draw(st.lists(st.sampled_from(["assistant", "assistant", "tool"]), min_size=1, max_size=3)):
            trained = role == "assistant" and draw(st.integers(0, 3)) > 0
            messages.append((role, draw(st.integers(0, 8)), trained))
    calls = {m for m, (role, _, _) in enumerate(messages) if role == "assistant" and draw(st.booleans())}
    tools = {m for m, (role, _, _) in enumerate(messages) if role == "tool"}
    return conversation(
        messages, preamble=draw(st.integers(0, 3)), sep=draw(st.integers(0, 2)), structured=calls | tools
    )


@st.composite
def texts(draw) -> Tokenized:
    flags = draw(st.lists(st.booleans(), min_size=0, max_size=60))
    return text(len(flags), targets=flags, example_id=draw(st.text(max_size=5)))


def runs(positions: list[int]) -> int:
    """How many contiguous runs the kept positions form."""
    return sum(1 for i, p in enumerate(positions) if i == 0 or p != positions[i - 1] + 1)


@st.composite
def samples_and_args(draw) -> tuple[Tokenized, int, str, str, int]:
    sample = draw(st.one_of(chats(), texts()))
    # Mostly capacities below the length, where strategies have work to do.
    capacity = draw(st.integers(2, max(2, len(sample) + 2)))
    strategy = draw(st.sampled_from(sorted(STRATEGIES)))
    fallback = draw(st.sampled_from(sorted(set(STRATEGIES) - {"turns"})))
    return sample, capacity, strategy, fallback, draw(st.integers(0, 2**32))


@settings(max_examples=400, deadline=None)
@given(samples_and_args())
def test_properties(args):
    sample, capacity, strategy, fallback, seed = args
    result = truncate(sample, capacity, strategy, fallback=fallback, seed=seed)
    original = sample.input_ids.tolist()

    # Counts add up: every token and every target flag is either kept or counted as removed.
    assert result.removed_tokens + result.kept_tokens == len(sample)
    kept_flags = sum(int(piece.targets.sum()) for piece in result.samples)
    assert result.removed_targets + kept_flags == int(sample.targets.sum())
    assert (result.drop_reason is None) == bool(result.samples)

    for piece in result.samples:
        kept = piece.input_ids.tolist()
        assert len(kept) <= capacity
        assert piece.n_targets > 0
        # A subsequence of the input: ids are positions, so they must increase.
        assert all(b > a for a, b in itertools.pairwise(kept)) and set(kept) <= set(original)
        # Per-token facts travel with their token.
        assert np.array_equal(piece.targets, sample.targets[kept])
        assert np.array_equal(piece.message_index, sample.message_index[kept])
        # Structured messages are kept whole or not at all, whatever the strategy.
        for m in sample.structured_messages:
            assert (piece.message_index == m).sum() in (0, (sample.message_index == m).sum())

    # Each kept part says where it starts in the original (ids are positions) and which piece it is.
    assert [int(piece.input_ids[0]) for piece in result.samples] == list(result.offsets)
    if result.strategy.endswith("split"):
        assert list(result.numbers) == [offset // capacity for offset in result.offsets]
    else:
        assert set(result.numbers) <= {0}

    applied = result.strategy
    if applied in ("right", "left", "window", "split"):
        assert all(runs(piece.input_ids.tolist()) == 1 for piece in result.samples)
    if applied == "middle" or applied == "turns":
        assert all(runs(piece.input_ids.tolist()) <= 2 for piece in result.samples)
    if applied == "right":
        assert all(piece.input_ids[0] == 0 for piece in result.samples)
    if applied == "left":
        assert all(piece.input_ids[-1] == len(sample) - 1 for piece in result.samples)
    if applied == "turns":
        # Whole messages only.
        (piece,) = result.samples
        for m in set(piece.message_index.tolist()) - {-1}:
            assert (piece.message_index == m).sum() == (sample.message_index == m).sum()
    if applied == "split":
        assert all(piece.input_ids[0] % capacity == 0 for piece in result.samples)
        assert len(result.samples) <= math.ceil(len(sample) / capacity)
        dropped = [p for p in range(len(sample)) if p not in {i for s in result.samples for i in s.input_ids.tolist()}]
        assert len(dropped) == result.removed_tokens

    again = truncate(sample, capacity, strategy, fallback=fallback, seed=seed)
    assert ids(again) == ids(result) and again.strategy == result.strategy and again.detail == result.detail


@settings(max_examples=200, deadline=None)
@given(chats(), st.integers(2, 70))
def test_turns_never_loses_the_final_trained_message(sample, capacity):
    result = truncate(sample, capacity, "turns", fallback="drop")
    if result.strategy not in ("turns", "none") or not result.samples:
        return
    (piece,) = result.samples
    trained = set(sample.message_index[sample.targets].tolist()) - {-1}
    if trained:
        last = max(trained)
        assert (piece.message_index == last).sum() == (sample.message_index == last).sum()
    # The template text before the first message stays.
    own = np.flatnonzero(sample.message_index >= 0)
    preamble = int(own[0]) if len(own) else len(sample)
    assert piece.input_ids[:preamble].tolist() == list(range(preamble))


# -- a real tool-calling conversation ------------------------------------------------------

CHATML_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def _glaive_row_tokenized() -> tuple[Tokenized, Any]:
    if not DATA.is_dir():
        pytest.skip(f"{DATA} is absent (the shared real-data folder)")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(DATA / "tokenizers" / "qwen2.5" / "tokenizer.json"))
    rows = json.loads((DATA / "datasets" / "llamafactory_glaive_toolcall_en_demo.json").read_text())
    row = next(r for r in rows if len(r["conversations"]) >= 6)

    parts: list[tuple[list[int], int, bool]] = []  # (ids, message_index, target)

    def add(piece: str, message: int, target: bool) -> None:
        parts.append((tok.encode(piece, add_special_tokens=False).ids, message, target))

    # The template's own default system block, as Qwen2.5 writes when the data has none.
    add("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", -1, False)
    roles, structured = [], set()
    for m, turn in enumerate(row["conversations"]):
        role = CHATML_ROLES[turn["from"]]
        roles.append(role)
        if turn["from"] in ("function_call", "observation"):
            structured.add(m)
        trained = role == "assistant"
        add(f"<|im_start|>{role}\n", -1, False)
        add(turn["value"], m, trained)
        # The end-of-turn marker is trained with the answer (the model must learn to stop), so it
        # belongs to the message; for other roles it is template text.
        add("<|im_end|>", m if trained else -1, trained)
        add("\n", -1, False)
    input_ids = [i for piece, _, _ in parts for i in piece]
    index = [m for piece, m, _ in parts for _ in piece]
    targets = [t for piece, _, t in parts for _ in piece]
    code = {-1: ROLE_CODES["template"]} | {m: ROLE_CODES[r] for m, r in enumerate(roles)}
    sample = Tokenized(
        example_id="glaive:0",
        source="glaive",
        sample_hash="0" * 32,
        input_ids=np.array(input_ids, dtype=np.int32),
        targets=np.array(targets, dtype=bool),
        roles=np.array([code[m] for m in index], dtype=np.int8),
        message_index=np.array(index, dtype=np.int16),
        message_roles=tuple(roles),
        structured_messages=frozenset(structured),
    )
    return sample, tok


def test_turns_on_a_real_tool_calling_row():
    sample, tok = _glaive_row_tokenized()
    assert len(sample.message_roles) >= 6 and sample.structured_messages
    index = sample.message_index
    users = [m for m, role in enumerate(sample.message_roles) if role == "user"]
    final_user = users[-1]
    first_final = int(np.flatnonzero(index == final_user)[0])
    preamble = int(np.flatnonzero(index >= 0)[0])
    # Room for the template preamble and the final turn only: every earlier turn must go.
    capacity = preamble + len(sample) - first_final
    result = truncate(sample, capacity, "turns")
    assert result.strategy == "turns"
    (kept,) = result.samples
    assert len(kept) == capacity
    full = tok.decode(sample.input_ids.tolist(), skip_special_tokens=False)
    short = tok.decode(kept.input_ids.tolist(), skip_special_tokens=False)
    system_block = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert short.startswith(system_block + "<|im_start|>user\n")
    # Well formed: the header before the first user message now introduces the final user turn.
    assert short == system_block + full[full.rindex("<|im_start|>user\n") :]
    assert short.count("<|im_start|>") == short.count("<|im_end|>") == 3
    # Every message kept is whole, and the final answer is trained.
    for m in set(kept.message_index.tolist()) - {-1}:
        assert (kept.message_index == m).sum() == (index == m).sum()
    assert kept.n_targets == int(sample.targets[index == len(sample.message_roles) - 1].sum())
    # One token less and the final turn no longer fits: the fallback runs, and no tool message
    # is cut (here there is none left, so the answer is cut on the right).
    smaller = truncate(sample, capacity - 1, "turns", fallback="right")
    assert smaller.strategy == "turns+right" and len(smaller.samples[0]) == capacity - 1


def test_right_on_a_real_row_stops_before_a_tool_result():
    sample, tok = _glaive_row_tokenized()
    index = sample.message_index
    tool = next(m for m, role in enumerate(sample.message_roles) if role == "tool")
    first, last = np.flatnonzero(index == tool)[[0, -1]]
    middle_of_tool = int(first + last) // 2
    result = truncate(sample, middle_of_tool, "right")
    (kept,) = result.samples
    assert len(kept) == first
    assert (kept.message_index == tool).sum() == 0
    assert tok.decode(kept.input_ids.tolist(), skip_special_tokens=False).endswith("<|im_start|>tool\n")
    # With turns first, the same capacity removes old turns and keeps the tool result whole.
    turns = truncate(sample, middle_of_tool, "turns", fallback="right")
    for piece in turns.samples:
        assert (piece.message_index == tool).sum() in (0, (index == tool).sum())


def test_turns_truncation_on_real_tool_calling_rows(tmp_path, write_config):
    data = shared("datasets", "llamafactory_glaive_toolcall_en_demo.json")
    tokenizer = shared("tokenizers", "qwen2.5")
    config = load_config(
        write_config(
            {
                "sources": [{"name": "glaive", "path": str(data), "format": "sharegpt"}],
                "tokenizer": str(tokenizer),
                "capacity": 512,
                "output": "out",
                "on_error": "skip",
                "truncation": {"strategy": "turns", "fallback": "right"},
                "packing": {"strategy": "bfd", "group_by": "source"},
            }
        )
    )
    manifest = build(config).manifest
    glaive = manifest["accounting"]["glaive"]
    assert glaive["read"] == 300
    assert glaive["read"] == glaive["kept"] + sum(glaive["rejected"].values()) + sum(glaive["dropped"].values())
    assert any(k.startswith("turns") for k in glaive["truncated"])
    for row in shard_rows(Path(config.run.output)):
        labels, cu = np.array(row["labels"]), np.array(row["cu_seqlens"])
        assert (labels[cu[:-1]] == IGNORE_INDEX).all() and row["n_tokens"] <= 512
