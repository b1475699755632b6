"""Preference pairs and completion groups: records whose answers must train together.

A `PreferencePair` is one prompt with a chosen and a rejected answer; a `CompletionGroup` is one
prompt with k completions (and optional rewards or advantages). Each becomes one *item* of
several segments that share the same prompt tokens and differ only in their answer:

    pair "p7":   prompt = [system, user "2+2?"]   chosen = [assistant "4"]   rejected = [assistant "5"]

    segment 0 (chosen)     P P P P P P h  4* E*        P: prompt tokens, h: the assistant header,
    segment 1 (rejected)   P P P P P P h  5* E*        *: targets (the answer and its end marker)

Three stages, each a pure function the build wraps:

    parse:     raw record -> PreferencePair | CompletionGroup      (`pair_from_record`, `group_from_record`)
    encode:    item -> one Tokenized per answer                    (`encode_answers`, via render_example + encode_batch)
    truncate:  segments -> segments that fit one pack, or a drop   (`truncate_item`)

Earlier assistant turns inside the prompt are context, never targets: every message carries an
explicit `train` flag (False in the prompt, True on the answer's assistant messages), which the
renderer's per-message override honours whatever the source's train policy says about roles and
turns; the policy still decides whether the end-of-turn marker is a target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from packtool.config import DEFAULT_SHAREGPT_ROLES, ITEM_TRUNCATION, SourceConfig, TrainPolicy
from packtool.encode import TextTokenizer, encode_batch
from packtool.errors import RecordError
from packtool.records import Example, Message, Rendered, Tokenized
from packtool.render import ChatTemplate, render_example
from packtool.sources import from_messages, from_sharegpt, record_hash

# The shapes `pair_from_record` recognises, in the order it tries them (first match wins).
PAIR_SHAPES = ("llamafactory", "trl_conversational", "trl_implicit", "strings")

Messages = tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """One prompt and two answers. `is_text`: the record gave plain strings, not messages.

    Plain strings are held as one user and one assistant message, so a chat template renders
    them; without a template they are a text continuation (`encode_answers`).
    """

    id: str
    source: str
    sample_hash: str
    prompt: Messages
    chosen: Messages
    rejected: Messages
    tools: tuple[dict[str, Any], ...] | None = None
    location: str = ""
    is_text: bool = False

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        for name in ("chosen", "rejected"):
            _check_answer(getattr(self, name), name)

    @property
    def answers(self) -> tuple[Messages, Messages]:
        return (self.chosen, self.rejected)


@dataclass(frozen=True, slots=True)
class CompletionGroup:
    """One prompt and k completions; `rewards` / `advantages` hold one float per completion when given."""

    id: str
    source: str
    sample_hash: str
    prompt: Messages
    completions: tuple[Messages, ...]
    rewards: tuple[float, ...] | None = None
    advantages: tuple[float, ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    location: str = ""
    is_text: bool = False

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        if not self.completions:
            raise RecordError("a group needs at least one completion", field="completions")
        for i, completion in enumerate(self.completions):
            _check_answer(completion, f"completions[{i}]")
        for name in ("rewards", "advantages"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.completions):
                raise RecordError(f"{len(values)} values for {len(self.completions)} completions", field=name)

    @property
    def answers(self) -> tuple[Messages, ...]:
        return self.completions


def _check_prompt(prompt: Messages) -> None:
    if not prompt:
        raise RecordError("empty prompt: the answers need something to answer", field="prompt")


def _check_answer(answer: Messages, field: str) -> None:
    # The answer opens with the assistant turn that the prompt's generation header introduces,
    # and ends with one: a segment must finish on something the model learns to say.
    if not answer:
        raise RecordError("empty answer", field=field)
    if answer[0].role != "assistant" or answer[-1].role != "assistant":
        roles = ", ".join(m.role for m in answer)
        raise RecordError(f"an answer must start and end with an assistant message, got [{roles}]", field=field)


# -- parse ------------------------------------------------------------------------------------


def pair_shape(record: dict) -> str:
    """Which preference shape a record has, from its keys (see PAIR_SHAPES)."""
    if "conversations" in record:
        return "llamafactory"
    if isinstance(record.get("prompt"), list):
        return "trl_conversational"
    if isinstance(record.get("prompt"), str):
        return "strings"
    if "chosen" in record or "rejected" in record:
        return "trl_implicit"
    raise RecordError(
        "not a preference record: expected `conversations` + `chosen`/`rejected` (LLaMA-Factory), "
        "`prompt` + `chosen`/`rejected` (TRL, messages or strings), or `chosen`/`rejected` conversations",
        field="chosen",
    )


def pair_from_record(
    record: dict,
    *,
    sample_id: str,
    source: str,
    location: str = "",
    role_map: dict[str, str] | None = None,
) -> PreferencePair:
    """Parse one preference record of any shape in PAIR_SHAPES. Raises RecordError naming the field.

    `role_map` maps ShareGPT speakers (`human`, `gpt`, ...) to roles; the ShareGPT defaults when None.
    """
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    shape = pair_shape(record)
    roles = DEFAULT_SHAREGPT_ROLES if role_map is None else role_map
    tools = None
    is_text = False
    if shape == "llamafactory":
        prompt_example = _sharegpt(record, "conversations", roles, sample_id, location, with_extras=True)
        prompt, tools = prompt_example.messages, prompt_example.tools
        chosen = _sharegpt_answer(record, "chosen", roles, sample_id, location)
        rejected = _sharegpt_answer(record, "rejected", roles, sample_id, location)
    elif shape == "trl_conversational":
        prompt_example = _openai(record, "prompt", sample_id, location, with_tools=True)
        prompt, tools = prompt_example.messages, prompt_example.tools
        chosen = _openai(record, "chosen", sample_id, location).messages
        rejected = _openai(record, "rejected", sample_id, location).messages
    elif shape == "trl_implicit":
        chosen_full = _openai(record, "chosen", sample_id, location, with_tools=True)
        rejected_full = _openai(record, "rejected", sample_id, location).messages
        tools = chosen_full.tools
        prompt, chosen, rejected = split_common_prefix(chosen_full.messages, rejected_full)
    else:
        prompt = (Message("user", _string(record, "prompt")),)
        chosen = (Message("assistant", _string(record, "chosen")),)
        rejected = (Message("assistant", _string(record, "rejected")),)
        is_text = True
    return PreferencePair(
        id=sample_id,
        source=source,
        sample_hash=record_hash(record),
        prompt=_as_context(prompt),
        chosen=_as_answer(chosen),
        rejected=_as_answer(rejected),
        tools=tools,
        location=location,
        is_text=is_text,
    )


def group_from_record(record: dict, *, sample_id: str, source: str, location: str = "") -> CompletionGroup:
    """Parse `{prompt, completions, rewards?, advantages?}`.

    `prompt` is a string or a list of messages; each completion is a string, one assistant
    message object, or a list of messages.
    """
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    is_text = isinstance(record.get("prompt"), str)
    if is_text:
        prompt: Messages = (Message("user", _string(record, "prompt")),)
        tools = None
    else:
        prompt_example = _openai(record, "prompt", sample_id, location, with_tools=True)
        prompt, tools = prompt_example.messages, prompt_example.tools
    raw = record.get("completions")
    if not isinstance(raw, list) or not raw:
        raise RecordError("expected a non-empty list of completions", field="completions")
    completions: list[Messages] = []
    for i, item in enumerate(raw):
        where = f"completions[{i}]"
        if isinstance(item, str):
            if not item:
                raise RecordError("empty completion", field=where)
            completions.append((Message("assistant", item),))
        else:
            item = [item] if isinstance(item, dict) else item
            completions.append(_openai({where: item}, where, sample_id, location).messages)
    if is_text and any(len(c) != 1 or c[0].tool_calls for c in completions):
        raise RecordError("a string prompt takes string completions", field="completions")
    return CompletionGroup(
        id=sample_id,
        source=source,
        sample_hash=record_hash(record),
        prompt=_as_context(prompt),
        completions=tuple(_as_answer(c) for c in completions),
        rewards=_floats(record, "rewards", len(completions)),
        advantages=_floats(record, "advantages", len(completions)),
        tools=tools,
        location=location,
        is_text=is_text,
    )


def split_common_prefix(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages]:
    """TRL's implicit prompt: the longest common message prefix, and what follows it in each.

    [u, a1, u2, a2] vs [u, a1, u2, b2] -> prompt [u, a1, u2], chosen [a2], rejected [b2]
    """
    common = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        common += 1
    if common == len(chosen) or common == len(rejected):
        raise RecordError(
            "chosen and rejected do not diverge: one is a prefix of the other, so there is no pair of answers",
            field="rejected",
        )
    if common == 0:
        raise RecordError("chosen and rejected share no prompt: their first messages differ", field="chosen")
    return chosen[:common], chosen[common:], rejected[common:]


def _as_context(messages: Messages) -> Messages:
    return tuple(replace(m, train=False) for m in messages)


def _as_answer(messages: Messages) -> Messages:
    # Tool results inside an answer stay context: the renderer never trains the tool role.
    return tuple(replace(m, train=m.role == "assistant") for m in messages)


def _sharegpt(
    record: dict, column: str, roles: dict[str, str], sample_id: str, location: str, *, with_extras: bool = False
):
    """The ShareGPT turns in `record[column]`, read by the sharegpt source adapter (same roles, same errors)."""
    fields: dict[str, str | None] = {
        "conversations": column,
        **({"system": "system", "tools": "tools"} if with_extras else {}),
    }
    source = SourceConfig(name="", paths=(), patterns=(), format="sharegpt", fields=fields, role_map=roles)
    return from_sharegpt(record, source, sample_id, location)


def _sharegpt_answer(record: dict, column: str, roles: dict[str, str], sample_id: str, location: str) -> Messages:
    # LLaMA-Factory writes the answer as one turn object; a list of turns is accepted as well.
    value = record.get(column)
    if value is None:
        raise RecordError("missing", field=column)
    if not isinstance(value, (dict, list)):
        raise RecordError(f"expected a turn object or a list of turns, got {type(value).__name__}", field=column)
    return _sharegpt(
        {column: [value] if isinstance(value, dict) else value}, column, roles, sample_id, location
    ).messages


def _openai(record: dict, column: str, sample_id: str, location: str, *, with_tools: bool = False) -> Example:
    fields: dict[str, str | None] = {"messages": column, **({"tools": "tools"} if with_tools else {})}
    source = SourceConfig(name="", paths=(), patterns=(), format="messages", fields=fields)
    if column not in record or record[column] is None:
        raise RecordError("missing", field=column)
    if not isinstance(record[column], list):
        raise RecordError(f"expected a list of messages, got {type(record[column]).__name__}", field=column)
    return from_messages(record, source, sample_id, location)


def _string(record: dict, column: str) -> str:
    value = record.get(column)
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise RecordError(f"expected a string, got {got}", field=column)
    if not value.strip():
        raise RecordError("empty string", field=column)
    return value


def _floats(record: dict, column: str, n: int) -> tuple[float, ...] | None:
    value = record.get(column)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise RecordError(f"expected a list of {n} numbers (one per completion)", field=column)
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise RecordError(f"expected a finite number, got {x!r}", field=f"{column}[{i}]")
        out.append(float(x))
    return tuple(out)


# -- encode -----------------------------------------------------------------------------------


def encode_answers(
    item: PreferencePair | CompletionGroup,
    template: ChatTemplate | None,
    tokenizer: TextTokenizer,
    policy: TrainPolicy = TrainPolicy(),
    *,
    special_tokens: str = "escape",
    add_bos: bool | None = None,
    add_eos: bool | None = None,
) -> tuple[Tokenized, ...]:
    """One Tokenized per answer (chosen, rejected; or each completion), all with the same prompt tokens.

    Each answer is rendered as prompt + answer by `render_example` and tokenized by
    `encode_batch`; the targets are the answer's assistant content and, when
    `policy.end_of_turn`, its end marker. Raises RecordError when a render fails or when the
    renders do not agree on the prompt tokens (a template whose prompt text depends on the
    answer would break the shared prompt cut).

    Plain-string items without a template are text continuations: `prompt + answer` as a
    document whose targets start at the answer.
    """
    if template is None and not item.is_text:
        raise RecordError("no chat template is configured for a chat preference record", kind="template_error")
    try:
        rendered = [
            _render_answer(item, answer, template, tokenizer, policy, add_bos, add_eos) for answer in item.answers
        ]
    except RecordError as error:
        error.sample_id = error.sample_id or item.id
        raise
    encoded = encode_batch(
        [(r, special_tokens) for r in rendered],
        tokenizer,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
    )
    segments = []
    for result in encoded:
        if isinstance(result, RecordError):
            raise result
        segments.append(result)
    _check_shared_prompt(segments, item.id)
    return tuple(segments)


def _render_answer(
    item: PreferencePair | CompletionGroup,
    answer: Messages,
    template: ChatTemplate | None,
    tokenizer: TextTokenizer,
    policy: TrainPolicy,
    add_bos: bool | None,
    add_eos: bool | None,
) -> Rendered:
    example = answer_example(item, answer, chat=template is not None)
    rendered = render_example(example, template, tokenizer.config, policy, add_bos=add_bos, add_eos=add_eos)
    if template is not None:
        return rendered
    prompt = item.prompt[0].content
    # render_text trains every character; a continuation trains the answer (and EOS as its end marker).
    (content_start, content_end) = rendered.content_ranges[0]
    end = len(rendered.text) if policy.end_of_turn else content_end
    return replace(rendered, target_ranges=((content_start + len(prompt), end, -1),))


def answer_example(item: PreferencePair | CompletionGroup, answer: Messages, *, chat: bool = True) -> Example:
    """One answer with its prompt as an ordinary sample: a conversation, or (no template) one text document."""
    if chat:
        messages = item.prompt + answer
        return Example(
            item.id, item.source, item.sample_hash, messages=messages, tools=item.tools, location=item.location
        )
    text = item.prompt[0].content + answer[0].content
    return Example(item.id, item.source, item.sample_hash, text=text, location=item.location)


def prompt_length(segment: Tokenized) -> int:
    """Tokens before the first target: the prompt, including the assistant header that opens the answer."""
    where = np.flatnonzero(segment.targets)
    return int(where[0]) if where.size else len(segment)


def _check_shared_prompt(segments: Sequence[Tokenized], item_id: str) -> None:
    first = segments[0]
    n = prompt_length(first)
    for k, other in enumerate(segments[1:], start=1):
        if prompt_length(other) != n or not np.array_equal(first.input_ids[:n], other.input_ids[:n]):
            raise RecordError(
                f"answer {k} tokenizes the prompt differently from answer 0 (the template or the tokenizer "
                "merges prompt and answer), so the answers cannot share one prompt cut",
                kind="prompt_mismatch",
                sample_id=item_id,
            )
        if other.n_targets == 0:
            raise RecordError(f"answer {k} has no target token", kind="no_targets", sample_id=item_id)
    if first.n_targets == 0:
        raise RecordError("answer 0 has no target token", kind="no_targets", sample_id=item_id)


# -- joint truncation ---------------------------------------------------------------------------

# How a shared prompt may be shortened (config.ITEM_TRUNCATION). The answers are never cut: a preference
# between two half answers, or a reward for a completion the model no longer sees, is not the same signal.


@dataclass(frozen=True, slots=True)
class ItemTruncation:
    """What fitting one item into a pack produced.

    `segments` are the item's segments with the same prompt cut (empty when dropped);
    `removed_prompt_tokens` is the cut per segment, so the item lost
    `removed_prompt_tokens * len(segments)` tokens and no target.
    """

    segments: tuple[Tokenized, ...]
    strategy: str  # "none" when it fit, else the strategy that cut or dropped it
    removed_prompt_tokens: int
    drop_reason: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if (self.drop_reason is None) != bool(self.segments):
            raise ValueError("a drop reason is set exactly when no segment remains")

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


def truncate_item(
    segments: Sequence[Tokenized], capacity: int, strategy: str = "left", *, too_long: str = "pair_too_long"
) -> ItemTruncation:
    """Fit all segments of one item into one pack of `capacity` tokens by cutting their shared prompt.

    Worked example: two segments with a 10-token prompt and answers of 3 and 5 tokens make
    13 + 15 = 28 tokens; at capacity 20 each copy of the prompt must lose 4 tokens.

        left    keep the last 6 prompt tokens in both segments          6+3 + 6+5 = 20
        turns   remove the oldest whole turns of the prompt, from one user message's own tokens
                to a later user message's (as truncate's `turns` does), as few as free 4 tokens;
                drop when even keeping only the last user turn is too long
        drop    drop the item

    The same prompt tokens go in every segment, so the segments still share one prompt. The
    prompt keeps at least one token (the header that opens the answer). `left` may cut through a
    tool call in the prompt, unlike SFT truncation: prompt tokens are context only, so no broken
    syntax is ever a target. `too_long` is the drop reason (`pair_too_long`, `group_too_long`).
    """
    if strategy not in ITEM_TRUNCATION:
        raise ValueError(f"unknown item truncation {strategy!r}; expected one of {', '.join(ITEM_TRUNCATION)}")
    segments = tuple(segments)
    total = sum(len(s) for s in segments)
    if total <= capacity:
        return ItemTruncation(segments, "none", 0)
    k = len(segments)
    n_prompt = prompt_length(segments[0])
    answers = total - k * n_prompt
    room = (capacity - answers) // k  # prompt tokens each segment may keep
    keep = _prompt_keep(segments[0], n_prompt, room, strategy) if room >= 1 else None
    if keep is None:
        detail = (
            f"item {segments[0].example_id!r}: {k} segments, {total} tokens > capacity {capacity} "
            f"(answers {answers} together, prompt {n_prompt} in each); truncation '{strategy}'"
        )
        return ItemTruncation((), strategy, 0, drop_reason=too_long, detail=detail)
    cut = tuple(s.sliced(np.concatenate([keep, np.ones(len(s) - n_prompt, dtype=bool)])) for s in segments)
    return ItemTruncation(cut, strategy, n_prompt - int(keep.sum()))


def _prompt_keep(segment: Tokenized, n_prompt: int, room: int, strategy: str) -> np.ndarray | None:
    """Which of the first `n_prompt` tokens stay (at most `room` of them), or None when the strategy cannot."""
    keep = np.ones(n_prompt, dtype=bool)
    if strategy == "left":
        keep[: n_prompt - room] = False
        return keep
    if strategy != "turns":
        return None
    index = segment.message_index[:n_prompt].astype(np.int64)
    own = index[index >= 0]
    if np.any(own[1:] < own[:-1]):
        return None  # a template that interleaves messages: no turn is a contiguous range
    latest = np.maximum.accumulate(index)
    present = set(own.tolist())
    users = [m for m, role in enumerate(segment.message_roles) if role == "user" and m in present]
    bounds = [int(np.searchsorted(latest, m, side="left")) for m in users]
    excess = n_prompt - room
    removed = next((r for r in range(1, len(bounds)) if bounds[r] - bounds[0] >= excess), None)
    if removed is None:
        return None
    keep[bounds[0] : bounds[removed]] = False
    return keep
