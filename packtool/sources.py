"""Read source files and turn each row into a canonical `Example`.

Readers yield `(location, row_number, raw_record)`; adapters map one raw record to an
`Example` or raise `RecordError` naming the field. The pipeline applies the error policy, so a
bad row is never silently lost: it fails the build or lands in rejects.jsonl with its reason.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from packtool.config import SourceConfig, canonical_json
from packtool.errors import RecordError
from packtool.records import ROLES, Example, Message

RawRow = tuple[str, int, Any]  # (file, row number as a person counts it, parsed record or the exception)


def read_rows(path: str) -> Iterator[RawRow]:
    """Rows of one file. JSONL rows are numbered by line (1-based), JSON arrays and Parquet by index (0-based).

    A JSONL line that does not parse is yielded as the `RecordError` itself, so the caller decides
    (fail or skip) without the reader stopping.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        table = pq.ParquetFile(path)
        row = 0
        for batch in table.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield path, row, record
                row += 1
    elif suffix == ".json":
        try:
            records = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            yield (
                path,
                exc.lineno,
                RecordError(f"not valid JSON: {exc.msg}", kind="parse_error", file=path, row=exc.lineno),
            )
            return
        if not isinstance(records, list):
            yield path, 0, RecordError("expected a JSON array of records", file=path)
            return
        for row, record in enumerate(records):
            yield path, row, record
    else:
        with open(path, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield path, line_number, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield (
                        path,
                        line_number,
                        RecordError(f"not valid JSON: {exc.msg}", kind="parse_error", file=path, row=line_number),
                    )


def record_hash(record: Any) -> str:
    """Content hash of the raw record: stable across key order and file format."""
    return hashlib.sha256(canonical_json(record).encode()).hexdigest()[:32]


def source_files(source: SourceConfig) -> list[str]:
    """The files of a source: its globs expanded and sorted (one build work item each)."""
    return list(source.paths)


def read_source(source: SourceConfig) -> Iterator[Example | RecordError]:
    """Every row of a source as an Example, or the RecordError explaining why it cannot be one."""
    for path in source_files(source):
        yield from read_file(source, path)


def read_file(
    source: SourceConfig, file: str, start: int = 0, stop: int | None = None
) -> Iterator[Example | RecordError]:
    """Records start..stop of one file (in file order) as Examples or RecordErrors; ids need this file alone."""
    adapter = ADAPTERS[source.format]
    for index, (path, row, record) in enumerate(read_rows(file)):
        if index < start:
            continue
        if stop is not None and index >= stop:
            return
        default_id = f"{source.name}:{path}:{row}"
        if isinstance(record, RecordError):
            record.sample_id = default_id
            yield record
            continue
        try:
            if not isinstance(record, dict):
                raise RecordError(f"expected a JSON object, got {type(record).__name__}")
            yield adapter(record, source, _example_id(record, source, default_id), f"{path}:{row}")
        except RecordError as error:
            error.file, error.row = path, row
            error.sample_id = default_id
            yield error


def _example_id(record: dict, source: SourceConfig, default: str) -> str:
    id_field = source.fields.get("id")
    if id_field and record.get(id_field) is not None:
        return str(record[id_field])
    return default


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
    return " or ".join({str: "a string", list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


def _tools(record: dict, source: SourceConfig) -> tuple[dict, ...] | None:
    """Tool definitions, given as a list or as a JSON string holding one (LLaMA-Factory style)."""
    value = _get(record, source, "tools", (list, str), required=False)
    if value is None:
        return None
    column = source.fields["tools"]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RecordError(f"tools string is not valid JSON: {exc.msg}", field=column) from None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise RecordError("expected a list of tool definitions", field=column)
    # Bare function schemas (LLaMA-Factory/glaive: {"name", "description", "parameters"}) get the
    # OpenAI wrapper that chat templates index into (`tool.function`); Mistral's fails without it.
    value = [{"type": "function", "function": t} if "function" not in t and "name" in t else t for t in value]
    return tuple(value) or None


def _arguments(value: Any, field_name: str) -> Any:
    """Tool-call arguments as an object: templates serialize them with tojson themselves."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise RecordError("tool-call arguments are not valid JSON", field=field_name) from None
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


def _content(value: Any, field_name: str) -> tuple[str, str | None, list[dict]]:
    """Message content as (text, reasoning, tool calls). Content parts are flattened in order."""
    if value is None:
        return "", None, []
    if isinstance(value, str):
        return value, None, []
    if not isinstance(value, list):
        raise RecordError(f"content must be a string or a list of parts, got {type(value).__name__}", field=field_name)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for part in value:
        if not isinstance(part, dict):
            raise RecordError("content part is not an object", field=field_name)
        kind = part.get("type", "text")
        text = part.get("text", part.get("value"))
        if kind == "text" and isinstance(text, str):
            texts.append(text)
        elif kind in ("reasoning", "thinking") and isinstance(text, str):
            reasoning.append(text)
        elif kind == "tool_call":
            call = json.loads(text) if isinstance(text, str) else text
            calls.append(_tool_call(call, field_name))
        else:
            raise RecordError(f"unsupported content part {kind!r}", field=field_name)
    return "".join(texts), ("\n".join(reasoning) if reasoning else None), calls


def _message(raw: Any, field_name: str) -> Message:
    if not isinstance(raw, dict):
        raise RecordError(f"message is not an object: {raw!r:.60}", field=field_name)
    role = raw.get("role")
    if role not in ROLES:
        raise RecordError(f"unknown role {role!r} (expected {', '.join(ROLES)})", field=f"{field_name}.role")
    content, reasoning, part_calls = _content(raw.get("content"), f"{field_name}.content")
    calls_raw = raw.get("tool_calls") or []
    if not isinstance(calls_raw, list):
        raise RecordError("tool_calls must be a list", field=f"{field_name}.tool_calls")
    calls = [_tool_call(c, f"{field_name}.tool_calls") for c in calls_raw] + part_calls
    if calls and role != "assistant":
        raise RecordError(f"only assistant messages make tool calls, not {role!r}", field=f"{field_name}.tool_calls")
    reasoning = raw.get("reasoning_content", reasoning)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError("reasoning_content must be a string", field=f"{field_name}.reasoning_content")
    train = raw.get("train", raw.get("weight"))
    if train is not None:
        if train not in (0, 1, True, False):
            raise RecordError(f"train/weight must be true/false or 0/1, got {train!r}", field=f"{field_name}.train")
        train = bool(train)
    return Message(
        role=role,
        content=content,
        tool_calls=tuple(calls),
        tool_call_id=None if raw.get("tool_call_id") is None else str(raw["tool_call_id"]),
        name=raw.get("name") if isinstance(raw.get("name"), str) else None,
        reasoning_content=reasoning,
        train=train,
    )


def _check_conversation(messages: list[Message], field_name: str) -> None:
    if not messages:
        raise RecordError("empty conversation", field=field_name)
    if not any(m.role != "system" for m in messages):
        raise RecordError("conversation has only system messages", field=field_name)


def from_messages(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    column = source.fields["messages"]
    raw_messages = _get(record, source, "messages", list, required=True)
    messages = [_message(m, f"{column}[{i}]") for i, m in enumerate(raw_messages)]
    _check_conversation(messages, column)
    return Example(
        example_id, source.name, record_hash(record), tuple(messages), _tools(record, source), location=location
    )


def from_sharegpt(record: dict, source: SourceConfig, example_id: str, location: str) -> Example:
    column = source.fields["conversations"]
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
            try:
                call = json.loads(value)
            except json.JSONDecodeError:
                raise RecordError("function_call value is not valid JSON", field=f"{where}.value") from None
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
        raise RecordError("empty text", field=source.fields["text"])
    return Example(example_id, source.name, record_hash(record), text=text, location=location)


ADAPTERS: dict[str, Callable[[dict, SourceConfig, str, str], Example]] = {
    "messages": from_messages,
    "sharegpt": from_sharegpt,
    "alpaca": from_alpaca,
    "text": from_text,
}
