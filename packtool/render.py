"""Render an Example with a chat template and track, for every character, whose it is and whether it is trained.

One render, two views. Each message's content (whitespace-trimmed core) is wrapped in a pair of
private-use sentinel characters that carry the message index, the template runs once with the
marked messages, the sentinels are cut out, and their positions become content spans. The
template also runs on the unmarked messages and the two texts must be byte-identical: a template
that rewrites content (strips, splits, reorders it) is caught here instead of yielding a
shifted mask.

    messages  = [user "Hi", assistant "Hello!"]
    marked    = <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
    text      = <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    targets   =                                                      ^^^^^^^^^^^^^^^^   (content + end marker)

An assistant target starts right after the assistant header the template prints for
`add_generation_prompt` (so tool calls and think blocks that follow the header are trained),
and ends after the first end-of-turn marker behind the content. Templates that carry
`{% generation %}` blocks define targets themselves, exactly as transformers'
`return_assistant_tokens_mask` reads them.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from packtool.config import BuildConfig, TrainPolicy
from packtool.errors import PacktoolError, RecordError
from packtool.records import Example, Message, Rendered, Span, literal_pattern

# Plane-16 private-use characters: never meaningful text, and removed before tokenization.
_MARK_BASE = 0x100000
_GEN_OPEN = chr(0x10FFF0)
_GEN_CLOSE = chr(0x10FFF1)
# Put in front of every special-token literal a record brings (a user typing `<|im_end|>`, a tool
# description spelling `<|im_start|>system`): its rendered position tells encode what to escape and
# tells the mask which end markers are data, not structure.
_LITERAL = chr(0x10FFF2)
_MAX_MESSAGES = (0x10FFF0 - _MARK_BASE) // 2
_MARKERS = re.compile("[\U00100000-\U0010ffff]")

# End-of-turn markers of the common chat formats; the template's eos_token is added to these.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")
# Fixed so that templates calling strftime_now (Llama 3.x prints "Today Date") render the same
# text on every run; override with template_vars.date (ISO) or date_string.
DEFAULT_DATE = "2026-01-01"


def open_mark(index: int) -> str:
    return chr(_MARK_BASE + 2 * index)


def close_mark(index: int) -> str:
    return chr(_MARK_BASE + 2 * index + 1)


class TemplateRaised(Exception):
    """A template called raise_exception: the template's own verdict on one sample."""


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` as transformers defines it; marks assistant output."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares tags as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        mark = nodes.Name("__packtool_mark", "load")
        return nodes.CallBlock(self.call_method("_wrap", [mark]), [], [], body).set_lineno(lineno)

    @staticmethod
    def _wrap(mark: Any, caller: Any) -> str:
        body = caller()
        return f"{_GEN_OPEN}{body}{_GEN_CLOSE}" if mark is True else body


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (jinja's built-in escapes <, >, & and breaks tool JSON).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in: untrusted templates cannot reach Python internals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    name: str
    source: str
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as strings
    variables: dict[str, Any] = field(default_factory=dict)
    compiled: Any = None
    generation_header: str | None = None
    has_generation_blocks: bool = False
    # The special tokens a record may spell (the tokenizer's, from tokenizer_config.json).
    literals: re.Pattern[str] | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def end_markers(self) -> tuple[str, ...]:
        eos = self.special_tokens.get("eos_token")
        return tuple(dict.fromkeys([*(m for m in [eos] if m), *END_MARKERS]))

    def render(
        self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = False, mark: bool = False
    ) -> str:
        try:
            return self.compiled.render(
                **self.special_tokens,
                **self.variables,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                __packtool_mark=mark,
            )
        except SecurityError as exc:
            raise PacktoolError(
                f"template {self.name!r} tried to reach Python internals and was stopped: {exc}"
            ) from None


def template_for(config: BuildConfig, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    """The configured template, or None when every source is plain text (no template is needed)."""
    if all(source.format == "text" for source in config.sources):
        return None
    return load_template(config.template, tokenizer_config, config.template_vars)


def bundled_templates() -> list[str]:
    folder = resources.files("packtool.templates")
    return sorted(p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja"))


def load_template(spec: str, tokenizer_config: dict[str, Any], variables: dict[str, Any] | None = None) -> ChatTemplate:
    """`spec` is `model` (the tokenizer's own chat_template), a bundled template name, or a .jinja path."""
    if spec == "model":
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # some configs hold several named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise PacktoolError(
                "template: model, but tokenizer_config.json has no chat_template; "
                f"use a bundled template ({', '.join(bundled_templates())}) or a .jinja file"
            )
        name = "model"
    elif spec.endswith(".jinja"):
        source, name = Path(spec).read_text(encoding="utf-8"), Path(spec).name
    else:
        path = resources.files("packtool.templates") / f"{spec}.jinja"
        if not path.is_file():
            raise PacktoolError(
                f"template: unknown bundled template {spec!r}; "
                f"choose one of {', '.join(bundled_templates())}, 'model' or a .jinja path"
            )
        source, name = path.read_text(encoding="utf-8"), spec
    env = make_environment()
    try:
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise PacktoolError(f"template {name!r} line {exc.lineno}: {exc.message}") from None

    variables = dict(variables or {})
    date = _dt.date.fromisoformat(str(variables.pop("date", DEFAULT_DATE)))
    compiled.globals["strftime_now"] = lambda fmt: date.strftime(fmt)
    specials = special_token_strings(tokenizer_config)
    added = tokenizer_config.get("added_tokens_decoder") or {}
    template = ChatTemplate(
        name=name,
        source=source,
        special_tokens=specials,
        variables=variables,
        compiled=compiled,
        has_generation_blocks="{% generation %}" in source or "{%- generation %}" in source,
        literals=literal_pattern(
            [
                *specials.values(),
                *(t.get("content", "") for t in added.values() if isinstance(t, dict) and t.get("special")),
            ]
        ),
    )
    return _with_generation_header(template)


def special_token_strings(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _with_generation_header(template: ChatTemplate) -> ChatTemplate:
    """Find what the template prints to open an assistant turn: the difference add_generation_prompt makes."""
    probe = [{"role": "user", "content": "x"}]
    try:
        closed = template.render(probe, None)
        opened = template.render(probe, None, add_generation_prompt=True)
    except (TemplateRaised, jinja2.TemplateError):
        return template
    if opened.startswith(closed) and len(opened) > len(closed):
        header = opened[len(closed) :]
        return replace(template, generation_header=header)
    return template


def trained_messages(messages: tuple[Message, ...], policy: TrainPolicy) -> list[bool]:
    """Which messages are targets: the role policy, `last` vs `all` turns, then the per-message override."""
    trained = [m.role in policy.roles and m.role != "tool" for m in messages]
    if not policy.tool_calls:
        trained = [t and not m.tool_calls for t, m in zip(trained, messages)]
    if policy.turns == "last":
        last = max((i for i, t in enumerate(trained) if t), default=None)
        trained = [i == last for i in range(len(messages))]
    return [m.train if m.train is not None and m.role != "tool" else t for t, m in zip(trained, messages)]


def render_text(example: Example, special_tokens: dict[str, str], *, add_bos: bool, add_eos: bool) -> Rendered:
    """A plain document: every character is a target; BOS/EOS strings are structure, not content."""
    document = example.text or ""
    bos = special_tokens.get("bos_token", "") if add_bos else ""
    eos = special_tokens.get("eos_token", "") if add_eos else ""
    text = f"{bos}{document}{eos}"
    content = (len(bos), len(bos) + len(document))
    return Rendered(
        example=example,
        text=text,
        spans=(Span(content[0], content[1], -1, "text", True),),
        content_ranges=(content,),
        target_ranges=((0, len(text), -1),),
    )


def render_chat(example: Example, template: ChatTemplate, policy: TrainPolicy) -> Rendered:
    """Render one conversation and derive its target character ranges. Raises RecordError for this sample only."""
    messages = example.messages
    if len(messages) > _MAX_MESSAGES:
        raise RecordError(f"{len(messages)} messages exceed the {_MAX_MESSAGES} packtool can track", kind="bad_record")
    literal_fields = _check_data_strings(example, template.literals)
    trained = trained_messages(messages, policy)
    for i, message in enumerate(messages):
        if trained[i] and message.role == "assistant" and not message.content.strip() and not message.tool_calls:
            # Nothing but an end marker to learn; templates without an assistant header could not
            # even place it. A data defect (seen in real alpaca sets), not a turn to train.
            raise RecordError(f"message {i} (assistant) is empty: nothing to train", kind="bad_record")
    plain = [m.as_template_dict() for m in messages]
    literals = template.literals if literal_fields else None
    marked = [_marked(m, i, literals) for i, m in enumerate(messages)]
    tools = list(example.tools) if example.tools else None
    try:
        text = template.render(plain, tools)
        marked_text = template.render(marked, _mark_literals(tools, literals), mark=True)
    except TemplateRaised as exc:
        raise RecordError(f"template refused the sample: {exc}", kind="template_error") from None
    except jinja2.TemplateError as exc:
        raise RecordError(f"template failed: {exc}", kind="template_error") from None

    clean, contents, generations, literal_at = _strip_markers(marked_text)
    if clean != text:
        raise RecordError(
            "the template rewrites message content (trims, splits or reorders it), so its mask "
            "cannot be derived safely",
            kind="mask_check",
        )
    for i, ranges in contents.items():
        expected = messages[i].content.strip()
        # A JSON-quoted copy is the same words: Llama 3.x prints tool results through `tojson`.
        quoted = json.dumps(expected, ensure_ascii=False)[1:-1]
        if any(text[start:end] not in (expected, quoted) for start, end in ranges):
            raise RecordError(
                f"the template changes the content of message {i} ({messages[i].role}) while "
                "printing it, so its targets would not be the data's words",
                kind="mask_check",
            )
    # A message whose content never reaches the text would be lost without a trace (Mistral-Nemo's
    # template prints the system prompt only when the conversation ends with a user turn; Phi-3's
    # drops tool results): reject the sample and name the message instead.
    for i, message in enumerate(messages):
        if message.content.strip() and i not in contents:
            raise RecordError(
                f"the template does not print the content of message {i} ({message.role}) as given "
                "(it drops or rewrites it), so training on this render would silently lose it",
                kind="template_error",
            )
    spans = tuple(
        Span(start, end, i, messages[i].role, False) for i, ranges in sorted(contents.items()) for start, end in ranges
    )
    literal_ranges = tuple(
        (at, found.end()) for at in literal_at if literals and (found := literals.match(text, at)) is not None
    )
    if template.has_generation_blocks:
        targets = _targets_from_generation_blocks(generations, contents, trained, [m.role for m in messages])
    else:
        targets = _targets_from_headers(text, messages, contents, trained, template, policy, literal_ranges)
    # Tool calls carry no sentinel, so a template that ignores them (Gemma 3, Phi-3) would train an
    # empty turn: each called function's name must appear inside its message's target.
    for start, end, i in targets:
        calls = messages[i].tool_calls if i >= 0 else ()
        if any(str(call.get("function", {}).get("name", "")) not in text[start:end] for call in calls):
            raise RecordError(
                f"the template does not print the tool calls of message {i} ({messages[i].role}), "
                "so its target would be an empty turn",
                kind="template_error",
            )
    return Rendered(
        example=example,
        text=text,
        spans=spans,
        content_ranges=tuple((s.start, s.end) for s in spans),
        target_ranges=tuple(targets),
        literal_ranges=literal_ranges,
        literal_fields=literal_fields,
    )


def data_strings(example: Example) -> Iterator[tuple[str, str]]:
    """(field, text) for every string a chat record brings into the render: contents, reasoning,
    names and ids, tool calls (name, argument keys and values) and tool definitions (every key and
    value: names, descriptions, parameter schemas)."""
    for i, message in enumerate(example.messages):
        where = f"messages[{i}]"
        yield f"{where}.content", message.content
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = getattr(message, key)
            if value is not None:
                yield f"{where}.{key}", value
        for j, call in enumerate(message.tool_calls):
            yield from _strings(call, f"{where}.tool_calls[{j}]")
    for j, tool in enumerate(example.tools or ()):
        yield from _strings(tool, f"tools[{j}]")


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, f"{where} key")
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for j, item in enumerate(value):
            yield from _strings(item, f"{where}[{j}]")


def _check_data_strings(example: Example, literals: re.Pattern[str] | None) -> tuple[str, ...]:
    """Reject private-use marker characters anywhere in the record; name the fields that spell a special token."""
    spelled = []
    for where, text in data_strings(example):
        if _MARKERS.search(text):
            raise RecordError("holds plane-16 private-use characters, which packtool reserves as markers", field=where)
        if literals is not None and literals.search(text):
            spelled.append(where)
    return tuple(spelled)


def _mark_literals(value: Any, literals: re.Pattern[str] | None) -> Any:
    """A copy with the literal sentinel in front of every special-token literal inside every string."""
    if literals is None or value is None:
        return value
    if isinstance(value, str):
        return literals.sub(lambda found: _LITERAL + found.group(), value)
    if isinstance(value, dict):
        return {_mark_literals(k, literals): _mark_literals(v, literals) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mark_literals(item, literals) for item in value]
    return value


def _marked(message: Message, index: int, literals: re.Pattern[str] | None = None) -> dict[str, Any]:
    """The message with its content core wrapped in sentinels; surrounding whitespace stays outside so
    templates that trim content still produce the same text. Special-token literals in any of its
    strings get the literal sentinel."""
    out = _mark_literals(message.as_template_dict(), literals)
    core = message.content.strip()
    if core:
        lead = message.content[: len(message.content) - len(message.content.lstrip())]
        trail = message.content[len(lead) + len(core) :]
        out["content"] = f"{lead}{open_mark(index)}{_mark_literals(core, literals)}{close_mark(index)}{trail}"
    return out


def _strip_markers(
    marked: str,
) -> tuple[str, dict[int, list[tuple[int, int]]], list[tuple[int, int]], list[int]]:
    """The text without sentinels, each message's content ranges, the generation blocks and where
    data literals start."""
    pieces: list[str] = []
    length = 0
    last = 0
    opened: dict[int, int] = {}
    contents: dict[int, list[tuple[int, int]]] = {}
    generations: list[tuple[int, int]] = []
    literal_at: list[int] = []
    gen_start: int | None = None
    for match in _MARKERS.finditer(marked):
        pieces.append(marked[last : match.start()])
        length += match.start() - last
        last = match.end()
        char = match.group()
        if char == _LITERAL:
            literal_at.append(length)
        elif char == _GEN_OPEN:
            gen_start = length
        elif char == _GEN_CLOSE:
            if gen_start is not None:
                generations.append((gen_start, length))
            gen_start = None
        else:
            index, is_close = divmod(ord(char) - _MARK_BASE, 2)
            if is_close:
                if index in opened:
                    contents.setdefault(index, []).append((opened.pop(index), length))
            else:
                opened[index] = length
    pieces.append(marked[last:])
    return "".join(pieces), contents, generations, literal_at


def _targets_from_generation_blocks(
    generations: list[tuple[int, int]],
    contents: dict[int, list[tuple[int, int]]],
    trained: list[bool],
    roles: list[str],
) -> list[tuple[int, int, int]]:
    targets = []
    for start, end in generations:
        owners = [i for i, ranges in contents.items() for s, e in ranges if start <= s and e <= end]
        if not owners:
            # A block without content (an assistant turn that only calls tools) belongs to the one
            # content-less assistant message between its printed neighbours; without this, such
            # blocks were trained even under `turns: last` or `tool_calls: false`.
            before = max((i for i, r in contents.items() if r[-1][1] <= start), default=-1)
            after = min((i for i, r in contents.items() if r[0][0] >= end), default=len(trained))
            owners = [i for i in range(before + 1, after) if roles[i] == "assistant" and i not in contents]
            if len(owners) != 1:
                owners = []
        if not owners or any(trained[i] for i in owners):
            targets.append((start, end, owners[0] if owners else -1))
    return targets


def _targets_from_headers(
    text: str,
    messages: tuple[Message, ...],
    contents: dict[int, list[tuple[int, int]]],
    trained: list[bool],
    template: ChatTemplate,
    policy: TrainPolicy,
    literal_ranges: tuple[tuple[int, int], ...] = (),
) -> list[tuple[int, int, int]]:
    """Targets from the assistant header and the first end-of-turn marker; markers and headers that a
    record spells (literal_ranges) are data, never structure."""
    starts = sorted((s, i) for i, ranges in contents.items() for s, _ in ranges)
    ends = sorted(e for ranges in contents.values() for _, e in ranges)
    targets = []
    for i, message in enumerate(messages):
        if not trained[i]:
            continue
        ranges = contents.get(i, [])
        if len(ranges) > 1:
            raise RecordError(
                f"the template prints message {i} ({message.role}) {len(ranges)} times; "
                "cannot tell which copy to train",
                kind="mask_check",
            )
        own = ranges[0] if ranges else None
        following = [s for s, j in starts if j > i and (own is None or s >= own[1])]
        upper = own[0] if own else min(following, default=len(text))
        lower = max((e for e in ends if e <= upper and (own is None or e != own[1])), default=0)
        if message.role == "assistant" and template.generation_header:
            header_at = _rfind_structure(text, template.generation_header, lower, upper, literal_ranges)
            start = header_at + len(template.generation_header) if header_at >= 0 else (own[0] if own else -1)
        else:
            start = own[0] if own else -1
            # Without a header, the content's own leading whitespace (kept outside the sentinels)
            # starts the target: BPE glues it to the next word (" Paris"), and a target starting
            # mid-token fails the encode check.
            lead = message.content[: len(message.content) - len(message.content.lstrip())]
            if own and lead and own[0] - len(lead) >= lower and text[own[0] - len(lead) : own[0]] == lead:
                start = own[0] - len(lead)
        if start < 0:
            raise RecordError(
                f"cannot locate message {i} ({message.role}) in the rendered text; the template "
                "drops it or prints it without an assistant header",
                kind="mask_check",
            )
        search_from = own[1] if own else start
        limit = min((s for s, j in starts if s >= search_from and j != i), default=len(text))
        end = _end_of_turn(
            text, search_from, limit, template.end_markers, include=policy.end_of_turn, skip=literal_ranges
        )
        if end is None:
            if not policy.end_of_turn and own:
                end = own[1]
            else:
                raise RecordError(
                    f"no end-of-turn marker ({', '.join(template.end_markers[:3])}, ...) after "
                    f"message {i} ({message.role})",
                    kind="mask_check",
                )
        targets.append((start, end, i))
    return targets


def _in_any(at: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(start <= at < end for start, end in ranges)


def _rfind_structure(text: str, needle: str, lower: int, upper: int, skip: tuple[tuple[int, int], ...]) -> int:
    at = text.rfind(needle, lower, upper)
    while at >= 0 and _in_any(at, skip):
        at = text.rfind(needle, lower, at)
    return at


def _end_of_turn(
    text: str,
    start: int,
    limit: int,
    markers: tuple[str, ...],
    *,
    include: bool,
    skip: tuple[tuple[int, int], ...] = (),
) -> int | None:
    found = []
    for marker in markers:
        at = text.find(marker, start, limit)
        while at >= 0 and _in_any(at, skip):
            at = text.find(marker, at + 1, limit)
        if at >= 0:
            found.append((at, marker))
    if not found:
        return None
    at, marker = min(found)
    return at + len(marker) if include else at


def render_example(
    example: Example,
    template: ChatTemplate | None,
    tokenizer_config: dict[str, Any],
    policy: TrainPolicy,
    *,
    add_bos: bool | None,
    add_eos: bool | None,
) -> Rendered:
    """A chat example through its template, a text example as a document (EOS-terminated unless add_eos is False)."""
    if example.is_text:
        specials = template.special_tokens if template else special_token_strings(tokenizer_config)
        return render_text(example, specials, add_bos=bool(add_bos), add_eos=add_eos is not False)
    if template is None:
        raise RecordError("no chat template is configured for a chat example", kind="template_error")
    return render_chat(example, template, policy)
