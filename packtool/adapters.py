"""Adapters: one raw record (a dict read from a source file) -> a `Parsed` record, per format.

Each adapter maps a record to an `Example` (messages, sharegpt, alpaca, text, prompt_completion)
or to an item of answers that train together (preference -> `PreferencePair`, group ->
`CompletionGroup`), or raises `RecordError` naming the field. The pair and group readers reuse the
message and ShareGPT adapters, so a turn inside a pair is read, and fails, as it would alone.
Earlier assistant turns inside an item's prompt are context, never targets: every message carries
an explicit `train` flag (False in the prompt, True on the answer's assistant messages), which the
renderer's per-message override honours whatever the source's train policy says about roles and
turns; the policy still decides whether the end-of-turn marker is a target.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from typing import Any

from packtool.config import DEFAULT_SHAREGPT_ROLES, SourceConfig, canonical_json
from packtool.errors import RecordError
from packtool.reading import each_indexed, embedded_json
from packtool.records import ROLES, CompletionGroup, Example, Message, Messages, PreferencePair
from packtool.vision.inputs import IMAGE_PARTS, PLACEHOLDER, message_images, placeholder_images, record_texts

# What one record becomes: a sample, or an item of several segments (format: preference | group).
Parsed = Example | PreferencePair | CompletionGroup
Adapter = Callable[[dict, SourceConfig, str, str], Parsed]

# Media a record can carry: LLaMA-Factory's `images` / `videos` lists, image parts (IMAGE_PARTS) and video
# parts. A record whose media are not built (videos; images without `processor:`, or in a format other than
# IMAGE_FORMATS) is an `images_not_supported` reject, never text with its pictures dropped and `<image>`
# trained as words (docs/vision.md).
VIDEO_PARTS = frozenset({"video", "video_url"})
# The formats whose records keep their images when the build has a processor.
IMAGE_FORMATS = frozenset({"messages", "sharegpt", "alpaca"})
NO_PROCESSOR = "images are built only with `processor:` set (the model's preprocessor_config.json, docs/vision.md)"
NO_VIDEOS = "packtool does not build videos yet (docs/vision.md)"
_NOT_BUILT = "{}: {}, so the record is left out, not trained as text"

# The shapes `pair_from_record` recognises, in the order it tries them (first match wins).
PAIR_SHAPES = ("llamafactory", "trl_conversational", "trl_implicit", "strings")


def record_hash(record: Any) -> str:
    """Content hash of the raw record: stable across key order and file format."""
    return hashlib.sha256(canonical_json(record).encode()).hexdigest()[:32]


def _get(record: dict, source: SourceConfig, key: str, kind: type | tuple[type, ...], *, required: bool) -> Any:
    column = source.fields.get(key)
    if column is None:
        return None
    value = record.get(column)
    if value is None or (value == "" and not required):
        if required:
            raise RecordError("missing", field=column)
        return None
    if not isinstance(value, kind):
        raise RecordError(f"expected {_kind(kind)}, got {type(value).__name__}", field=column)
    return value


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _tools(record: dict, source: SourceConfig) -> tuple[dict, ...] | None:
    """Tool definitions, given as a list or as a JSON string holding one (LLaMA-Factory style)."""
    value = _get(record, source, "tools", (list, str), required=False)
    if value is None:
        return None
    column = source.fields["tools"] or "tools"
    if isinstance(value, str):
        value = embedded_json(value, "tools string", column)
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise RecordError("expected a list of tool definitions", field=column)
    # Bare function schemas (LLaMA-Factory/glaive: {"name", "description", "parameters"}) get the
    # OpenAI wrapper that chat templates index into (`tool.function`); Mistral's fails without it.
    value = [{"type": "function", "function": t} if "function" not in t and "name" in t else t for t in value]
    return tuple(value) or None


def _arguments(value: Any, field_name: str) -> Any:
    """Tool-call arguments as an object: templates serialize them with tojson themselves."""
    if isinstance(value, str):
        return embedded_json(value, "tool-call arguments", field_name)
    return value


def _tool_call(call: Any, field_name: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise RecordError(f"expected a tool call object, got {type(call).__name__}", field=field_name)
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError("tool call has no function name", field=field_name)
    normalized: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments", {}), field_name)},
    }
    if call.get("id") is not None:
        normalized["id"] = str(call["id"])
    return normalized


def _content(value: Any) -> tuple[str, str | None, list[dict], tuple[int, ...]]:
    """Message content as (text, reasoning, tool calls, where its images sit in the text). Content parts are
    flattened in order; an image part leaves its place (the builder keeps it only with a processor)."""
    if value is None:
        return "", None, [], ()
    if isinstance(value, str):
        return value, None, [], ()
    if not isinstance(value, list):
        raise RecordError(f"content must be a string or a list of parts, got {type(value).__name__}", field=".content")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    image_at: list[int] = []
    length = 0
    for part in value:
        if not isinstance(part, dict):
            raise RecordError("content part is not an object", field=".content")
        kind = part.get("type", "text")
        text = part.get("text", part.get("value"))
        if kind == "text" and isinstance(text, str):
            texts.append(text)
            length += len(text)
        elif kind in ("reasoning", "thinking") and isinstance(text, str):
            reasoning.append(text)
        elif kind == "tool_call":
            calls.append(_tool_call(_arguments(text, ".content") if isinstance(text, str) else text, ".content"))
        elif kind in IMAGE_PARTS:
            image_at.append(length)
        elif kind in VIDEO_PARTS:
            raise RecordError(
                _NOT_BUILT.format(f"content part of type {kind!r}", NO_VIDEOS),
                kind="images_not_supported",
                field=".content",
            )
        else:
            raise RecordError(f"unsupported content part {kind!r}", field=".content")
    return "".join(texts), ("\n".join(reasoning) if reasoning else None), calls, tuple(image_at)


_ROLE_SET = frozenset(ROLES)


def refuse_media(record: dict, messages_column: str | None, why: str = NO_PROCESSOR) -> None:
    """A reject for a record that carries media this build does not build (`why` says which and why):
    `image_remote` (a URL) or `image_count_mismatch` (LLaMA-Factory's placeholders and `images` disagree)
    when the record says so itself, `images_not_supported` otherwise. No file is opened."""
    column = messages_column or "messages"
    refs = message_images(record.get(column), Path(), column, record.get("images"))
    if record.get("images") and not refs:
        refs = placeholder_images(record_texts(record), record["images"], Path())
    refuse_videos(record)
    if record.get("images"):
        count = len(record["images"]) if isinstance(record["images"], list) else 1
        raise RecordError(
            _NOT_BUILT.format(f"{count} item(s) in `images`", why), kind="images_not_supported", field="images"
        )
    if refs:
        raise RecordError(_NOT_BUILT.format("an image part", why), kind="images_not_supported", field=refs[0].field)


def refuse_videos(record: dict) -> None:
    """An `images_not_supported` reject for a record with a non-empty `videos` list (video parts: `_content`)."""
    videos = record.get("videos")
    if videos:
        count = len(videos) if isinstance(videos, list) else 1
        raise RecordError(
            _NOT_BUILT.format(f"{count} item(s) in `videos`", NO_VIDEOS), kind="images_not_supported", field="videos"
        )


def with_images(example: Example, record: dict, source: SourceConfig, base: Path) -> Example:
    """The example with the images its record names, relative paths resolved against `base`: its image content
    parts (placed by `_content`), or else LLaMA-Factory's `<image>` placeholders in the message texts, paired
    with the `images` list one for one and cut out, each image placed where its placeholder was.

        user "<image>What is it?", images ["cat.png"]  ->  user "What is it?" image_at (0,), images (cat.png,)
    """
    column = source.fields.get("messages") or "messages"
    if any(m.image_at for m in example.messages):
        return replace(example, images=message_images(record.get(column), base, column, record.get("images")))
    if not record.get("images"):
        return example
    refs = placeholder_images([m.content for m in example.messages], record["images"], base)
    return replace(example, messages=tuple(map(_placeholders_cut, example.messages)), images=refs)


def _placeholders_cut(message: Message) -> Message:
    pieces = message.content.split(PLACEHOLDER)
    if len(pieces) == 1:
        return message
    return replace(message, content="".join(pieces), image_at=tuple(accumulate(len(p) for p in pieces[:-1])))


def _message(raw: Any) -> Message:
    """One message; a RecordError's field is relative (`.role`), the caller puts the message's path in front."""
    if type(raw) is dict and len(raw) == 2:
        # Most messages are exactly {role, content: str}; they skip the checks for optional keys.
        role, content = raw.get("role"), raw.get("content")
        if type(content) is str and role in _ROLE_SET:
            return Message(role, content)
    if not isinstance(raw, dict):
        raise RecordError(f"message is not an object: {raw!r:.60}")
    role = raw.get("role")
    if role not in _ROLE_SET:
        raise RecordError(f"unknown role {role!r} (expected {', '.join(ROLES)})", field=".role")
    content, reasoning, part_calls, image_at = _content(raw.get("content"))
    calls_raw = raw.get("tool_calls") or []
    if not isinstance(calls_raw, list):
        raise RecordError("tool_calls must be a list", field=".tool_calls")
    calls = [_tool_call(c, ".tool_calls") for c in calls_raw] + part_calls
    if calls and role != "assistant":
        raise RecordError(f"only assistant messages make tool calls, not {role!r}", field=".tool_calls")
    reasoning = raw.get("reasoning_content", reasoning)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError("reasoning_content must be a string", field=".reasoning_content")
    train = raw.get("train", raw.get("weight"))
    if train is not None:
        if train not in (0, 1, True, False):
            raise RecordError(f"train/weight must be true/false or 0/1, got {train!r}", field=".train")
        train = bool(train)
    call_id, name = raw.get("tool_call_id"), raw.get("name")
    return Message(
        role=role,
        content=content,
        tool_calls=tuple(calls),
        tool_call_id=None if call_id is None else str(call_id),
        name=name if isinstance(name, str) else None,
        reasoning_content=reasoning,
        train=train,
        image_at=image_at,
    )


def _messages(raw_messages: list, column: str) -> tuple[Message, ...]:
    messages = _message_list(raw_messages, column)
    _check_conversation(messages, column)
    return tuple(messages)


def _message_list(raw_messages: list, column: str) -> list[Message]:
    return each_indexed(raw_messages, _message, column)


def _check_conversation(messages: list[Message], column: str) -> None:
    if not messages:
        raise RecordError("empty conversation", field=column)
    if messages[0].role == "system" and all(m.role == "system" for m in messages):
        raise RecordError("conversation has only system messages", field=column)


def from_messages(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    column = source.fields["messages"] or "messages"
    messages = _messages(_get(record, source, "messages", list, required=True), column or "messages")
    return Example(example_id, source.name, record_hash(record), messages, _tools(record, source), location=location)


def from_sharegpt(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    column = source.fields["conversations"] or "conversations"
    turns = _get(record, source, "conversations", list, required=True)
    messages: list[Message] = []
    system = _get(record, source, "system", str, required=False)
    if system:
        messages.append(Message("system", system))
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, dict):
            raise RecordError("turn is not an object", field=where)
        speaker, value = turn.get("from"), turn.get("value")
        role = source.role_map.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise RecordError(f"unknown speaker {speaker!r} (add it to role_map)", field=f"{where}.from")
        if not isinstance(value, str):
            raise RecordError(f"expected a string, got {type(value).__name__}", field=f"{where}.value")
        if role == "function_call":
            call = embedded_json(value, "function_call value", f"{where}.value")
            calls = call if isinstance(call, list) else [call]
            messages.append(Message("assistant", "", tool_calls=tuple(_tool_call(c, f"{where}.value") for c in calls)))
        else:
            messages.append(Message(role, value))
    _check_conversation(messages, column)
    return Example(
        example_id, source.name, record_hash(record), tuple(messages), _tools(record, source), location=location
    )


def from_alpaca(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    instruction = _get(record, source, "instruction", str, required=True)
    extra = _get(record, source, "input", str, required=False)
    output = _get(record, source, "output", str, required=True)
    system = _get(record, source, "system", str, required=False)
    history = _get(record, source, "history", list, required=False) or []
    messages = [Message("system", system)] if system else []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RecordError(
                "history entries must be [prompt, response] pairs", field=f"{source.fields['history']}[{i}]"
            )
        messages += [Message("user", pair[0]), Message("assistant", pair[1])]
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages += [Message("user", prompt), Message("assistant", output)]
    return Example(example_id, source.name, record_hash(record), tuple(messages), location=location)


def from_text(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    text = _get(record, source, "text", str, required=True)
    if not text:
        raise RecordError("empty text", field=source.fields["text"] or "text")
    return Example(example_id, source.name, record_hash(record), text=text, location=location)


def from_prompt_completion(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    """TRL's prompt-completion record: `prompt` and `completion`, both strings or both lists of messages.

    Only the completion is trained. Strings are a text document, as TRL tokenizes them: prompt text then
    completion text, no chat template, ending with EOS (as `format: text` does) which is trained with the
    completion. Messages go through the chat template; the completion's assistant messages are the targets
    (its tool results stay context), the prompt is context whatever `train.roles` says.
    """
    prompt = _get(record, source, "prompt", (str, list), required=True)
    completion = _get(record, source, "completion", (str, list), required=True)
    prompt_column, completion_column = source.fields["prompt"] or "prompt", source.fields["completion"] or "completion"
    if isinstance(prompt, str) != isinstance(completion, str):
        raise RecordError(
            f"prompt is {_kind(type(prompt))} but completion is {_kind(type(completion))}: both must be strings "
            "(plain text) or both lists of messages (a conversation)",
            field=completion_column,
        )
    if isinstance(prompt, str):
        if not completion:
            raise RecordError("empty completion: nothing to train", field=completion_column)
        return Example(
            example_id,
            source.name,
            record_hash(record),
            text=prompt + completion,
            context_chars=len(prompt),
            location=location,
        )
    context = _message_list(prompt, prompt_column)  # a prompt may be a system message alone
    answer = _message_list(completion, completion_column)
    if not any(m.role == "assistant" for m in answer):
        raise RecordError("the completion has no assistant message: nothing to train", field=completion_column)
    messages = tuple(replace(m, train=False) for m in context) + tuple(
        replace(m, train=m.role == "assistant") for m in answer
    )
    return Example(example_id, source.name, record_hash(record), messages, _tools(record, source), location=location)


def with_system(parsed: Parsed, system: str) -> Parsed:
    """The source's default system prompt put first when a conversation has no system message.

    It is context, never a target (the config wrote it, not the data), whatever `train.roles` says. Text
    documents (format: text, string prompt-completion and string pairs) have no conversation to add it to.
    """
    default = Message("system", system, train=False)
    if isinstance(parsed, Example):
        if parsed.is_text or any(m.role == "system" for m in parsed.messages):
            return parsed
        return replace(parsed, messages=(default, *parsed.messages))
    if parsed.is_text or any(m.role == "system" for m in parsed.prompt):
        return parsed
    return replace(parsed, prompt=(default, *parsed.prompt))


# -- preference pairs and completion groups --------------------------------------------------


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


def _canonical_columns(record: dict, source: SourceConfig) -> dict:
    """The record with its configured columns under the names the pair and group readers use (`fields` remaps them)."""
    renamed = {key: record[column] for key, column in source.fields.items() if column and column in record}
    return {**record, **renamed}


def from_preference(record: dict, source: SourceConfig, example_id: str, location: str) -> PreferencePair:
    return pair_from_record(
        _canonical_columns(record, source),
        sample_id=example_id,
        source=source.name,
        location=location,
        role_map=source.role_map or None,
    )


def from_group(record: dict, source: SourceConfig, example_id: str, location: str) -> CompletionGroup:
    return group_from_record(
        _canonical_columns(record, source), sample_id=example_id, source=source.name, location=location
    )


ADAPTERS: dict[str, Adapter] = {
    "messages": from_messages,
    "sharegpt": from_sharegpt,
    "alpaca": from_alpaca,
    "text": from_text,
    "prompt_completion": from_prompt_completion,
    "preference": from_preference,
    "group": from_group,
}
