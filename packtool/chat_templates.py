"""Chat templates: load one (the model's own, a bundled one or a .jinja file), compile it in the
sandbox, and run it on a conversation; plus the tokenizer's special-token strings it is given.

The model's own templates are found as transformers (>= 4.43) finds them (`model_templates`):

    chat_template.jinja                    -> "default"     any of these files: tokenizer_config.json's
    additional_chat_templates/NAME.jinja   -> NAME          chat_template key is not read at all
    tokenizer_config.json chat_template    -> "default" (a string) or each {name, template} of a list

With an image processor (`processor:`), `template: model` is the template transformers' processor renders with
(`processor.apply_chat_template`, `processor_templates`): processor_config.json's chat_template key, else
chat_template.json, else the files above, in the processor's folder.

The bundled .jinja files ship as the package data folder `packtool.templates`, hence this module's name.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import SecurityError

from packtool.config import MODEL_TEMPLATE, BuildConfig, bundled_folder, canonical_json
from packtool.errors import PacktoolError, TemplateRaised
from packtool.minijinja_engine import MINIJINJA_INSTALLED, MiniTemplate, NotQualified, qualify
from packtool.records import literal_pattern
from packtool.sandbox import make_environment
from packtool.template_limits import BUDGET, Budget, TemplateLimit
from packtool.template_tracking import Tracked, marked_content
from packtool.vision.processors import read_json_object

# End-of-turn markers of the common chat formats; the template's eos_token is added to these.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")
# Fixed so that templates calling strftime_now (Llama 3.x prints "Today Date") render the same
# text on every run; override with template_vars.date (ISO) or date_string.
DEFAULT_DATE = "2026-01-01"
# Where transformers (utils/hub.py) looks for a model folder's templates before tokenizer_config.json.
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# A processor's template (AutoProcessor); AutoTokenizer, and so apply_chat_template, never reads it.
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
PROCESSOR_CONFIG_FILE = "processor_config.json"  # its chat_template key comes before every template file
# The name transformers gives a lone template, and the one it renders a conversation with tools with.
DEFAULT_NAME, TOOL_USE_NAME = "default", "tool_use"
# Set to 1 to render every template with jinja2 alone (shard bytes are the same either way; the
# tests build both ways, and a worker process inherits the choice).
JINJA2_ONLY = "PACKTOOL_JINJA2_ONLY"


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
    # The same template compiled by minijinja where it prints jinja2's bytes (packtool.minijinja_engine),
    # which engine renders samples that need a render, and why, for the build summary and the audit.
    fast: MiniTemplate | None = field(default=None, compare=False, repr=False)
    engine: str = "jinja2"
    # A model's own template: the file it was read from, relative to the model folder (chat_template.jinja,
    # additional_chat_templates/NAME.jinja or tokenizer_config.json), and its name among several (None: one).
    file: str | None = None
    named: str | None = None
    # The model's tool_use template, which transformers renders a conversation that brings tools with
    # when `template: model` names no template (tokenizer.get_chat_template); see `serving`.
    for_tools: ChatTemplate | None = field(default=None, compare=False, repr=False)
    # What the model folder held that this template was chosen over, for the build summary and the audit.
    passed_over: str | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def key(self) -> str:
        """What the cache and plan keys know the template by: its source, the file and name it was read
        from, and the template records with tools render with."""
        tools = self.for_tools.key if self.for_tools is not None else None
        return hashlib.sha256(canonical_json([self.source, self.file, self.named, tools]).encode()).hexdigest()

    @property
    def described(self) -> str:
        """The template as the build summary and the audit name it: `model (chat_template.jinja)`, with the
        template records with tools use and what it was chosen over, when there is either."""
        details = [self.file] if self.file else []
        if self.for_tools is not None:
            details.append(f"records with tools: {self.for_tools.file} ({self.for_tools.named})")
        details += [self.passed_over] if self.passed_over else []
        return self.name + (f" ({'; '.join(details)})" if details else "")

    def serving(self, tools: Any) -> ChatTemplate:
        """The template transformers renders a conversation with: the model's tool_use template when the
        conversation brings tools and `template: model` picked the default (get_chat_template)."""
        return self.for_tools if tools and self.for_tools is not None else self

    @property
    def end_markers(self) -> tuple[str, ...]:
        return _end_markers(self.special_tokens.get("eos_token"), self.source)

    def render(
        self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = False, mark: bool = False
    ) -> str:
        """The rendered text. Raises TemplateRaised (the template's raise_exception), TemplateLimit,
        jinja2.TemplateError (any other failure of the template on these messages) or PacktoolError
        (a sandbox escape: the template itself is hostile)."""
        return self.render_tracked(messages, tools, add_generation_prompt=add_generation_prompt, mark=mark)[0]

    def render_tracked(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        *,
        add_generation_prompt: bool = False,
        mark: bool = False,
        prints_from: int = 0,
    ) -> tuple[str, Budget]:
        """render(), and what the render spent: whether the template inspected a marked (Tracked)
        content string, the largest size it built. `prints_from`: the first sentinel index free for
        what tojson prints of a JsonSlot (see sandbox.Budget)."""
        budget = Budget(prints_from=prints_from)
        budget.contents = {id(m["content"]): i for i, m in enumerate(messages) if isinstance(m.get("content"), Tracked)}
        token = BUDGET.set(budget)
        try:
            text = self.compiled.render(
                **self.special_tokens,
                **self.variables,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                __packtool_mark=mark,
            )
            return str.__str__(text), budget
        except SecurityError as exc:
            raise PacktoolError(
                f"template {self.name!r} tried to reach Python internals and was stopped: {exc}"
            ) from None
        except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
            raise
        except RecursionError:
            raise TemplateLimit("recursion deeper than Python allows (nested data or a recursive loop)") from None
        except MemoryError:
            raise TemplateLimit("the render ran out of memory") from None
        except Exception as exc:  # the template's own code failing on this sample (1/0, 'a' + 1, a bad key)
            raise jinja2.TemplateRuntimeError(f"{type(exc).__name__}: {exc}") from None
        finally:
            BUDGET.reset(token)


@functools.cache
def _end_markers(eos: str | None, source: str) -> tuple[str, ...]:
    """The end-of-sequence token and the END_MARKERS the template's text spells. A marker the template
    never prints ends none of its turns: in a record it is words (Qwen's template and a tool call whose
    code prints `</s>` ended the turn's target inside the call)."""
    return tuple(dict.fromkeys([*(m for m in [eos] if m), *(m for m in END_MARKERS if m in source)]))


def template_for(config: BuildConfig, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    """The configured template, or None when every source is plain text (no template is needed)."""
    formats = {source.format for source in config.sources}
    if formats <= {"text"}:
        return None
    folder = Path(config.tokenizer.path).parent
    processor = Path(config.processor) if config.processor else None
    if (
        formats <= {"text", "prompt_completion"}
        and config.template == MODEL_TEMPLATE
        and not model_templates(folder, tokenizer_config)[0]
        and not (processor and processor_templates(processor))
    ):
        # TRL's string prompt-completion is plain text, often for a base model whose tokenizer has no chat
        # template; a message-list record of such a source is then rejected on its own (template_error)
        return None
    return load_template(config.template, tokenizer_config, config.template_vars, folder=folder, processor=processor)


def bundled_templates() -> list[str]:
    folder = bundled_folder("templates")
    return sorted(p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja"))


@dataclass(frozen=True, slots=True)
class ModelTemplate:
    """One of a model's own templates: its name, the file it is read from (relative to the model folder)."""

    named: str
    file: str
    source: str

    @property
    def shown(self) -> str:
        """`additional_chat_templates/tool_use.jinja (tool_use)`; a lone template by its file alone."""
        return self.file + (f" ({self.named})" if self.named else "")


def model_templates(folder: Path | None, tokenizer_config: dict[str, Any]) -> tuple[dict[str, ModelTemplate], str]:
    """The model's templates by name as transformers 5 loads them (tokenization_utils_base._from_pretrained),
    and a sentence on what that passed over (empty when nothing).

    Any file wins: chat_template.jinja is "default" and additional_chat_templates/NAME.jinja is NAME (a
    default.jinja there replaces chat_template.jinja), and tokenizer_config.json's chat_template is then not
    read, whatever it holds. Without files the key is the template ("default") or a list of {name, template}.
    `folder` None: the key alone (a tokenizer_config dict with no folder behind it)."""
    files: dict[str, ModelTemplate] = {}
    if folder is not None:
        paths = [folder / TEMPLATE_FILE] if (folder / TEMPLATE_FILE).exists() else []
        paths += sorted((folder / TEMPLATE_DIR).glob("*.jinja")) if (folder / TEMPLATE_DIR).is_dir() else []
        for path in paths:
            named = DEFAULT_NAME if path.name == TEMPLATE_FILE else path.name.removesuffix(".jinja")
            files[named] = ModelTemplate(named, path.relative_to(folder).as_posix(), _read_template_file(path))
    keyed = _keyed_templates(tokenizer_config.get("chat_template"))
    passed_over = []
    if files and keyed and {n: t.source for n, t in keyed.items()} != {n: t.source for n, t in files.items()}:
        passed_over.append(
            f"tokenizer_config.json's chat_template ({', '.join(sorted(keyed))}) differs and is not used: "
            f"transformers reads {', '.join(sorted(t.file for t in files.values()))} instead"
        )
    if folder is not None and (folder / PROCESSOR_TEMPLATE_FILE).is_file():
        passed_over.append(f"{PROCESSOR_TEMPLATE_FILE} is a processor's template, which AutoTokenizer does not read")
    return files or keyed, "; ".join(passed_over)


def processor_templates(folder: Path) -> dict[str, ModelTemplate]:
    """The templates transformers' processor renders with, by name, as ProcessorMixin.get_processor_dict
    (transformers 5.25) reads them from its folder: processor_config.json's chat_template key wins; else the
    legacy chat_template.json's chat_template ("default"); else chat_template.jinja and
    additional_chat_templates/ as the tokenizer reads them. Empty: the processor has none (packtool then takes
    the tokenizer's, where transformers' processor would refuse to render)."""
    settings = folder / PROCESSOR_CONFIG_FILE
    keyed = (read_json_object(settings) if settings.is_file() else {}).get("chat_template")
    if isinstance(keyed, dict):  # {name: template}, as a processor saves several
        return {name: ModelTemplate(name, PROCESSOR_CONFIG_FILE, source) for name, source in keyed.items()}
    if keyed is not None:
        return {n: replace(t, file=PROCESSOR_CONFIG_FILE) for n, t in _keyed_templates(keyed).items()}
    legacy = folder / PROCESSOR_TEMPLATE_FILE
    if legacy.is_file():
        if (folder / TEMPLATE_DIR).is_dir() and any((folder / TEMPLATE_DIR).glob("*.jinja")):
            raise PacktoolError(
                f"{folder}: {PROCESSOR_TEMPLATE_FILE} beside {TEMPLATE_DIR}/, which transformers' processor refuses "
                f"to load; replace {PROCESSOR_TEMPLATE_FILE} with {TEMPLATE_FILE}"
            )
        source = read_json_object(legacy).get("chat_template")
        if not isinstance(source, str):
            raise PacktoolError(f"{legacy}: its chat_template must be a string (the template), got {source!r:.80}")
        return {DEFAULT_NAME: ModelTemplate(DEFAULT_NAME, PROCESSOR_TEMPLATE_FILE, source)}
    return model_templates(folder, {})[0]


def _read_template_file(path: Path) -> str:
    """A template file's text as transformers reads it: UTF-8, universal newlines (CRLF becomes LF)."""
    if not path.is_file():  # a folder fails to open, and a named pipe would wait for a writer forever
        raise PacktoolError(f"{path}: not a regular file, so not a chat template; remove it or put the template there")
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PacktoolError(
            f"{path}: not UTF-8 (byte {exc.start}: {exc.reason}); transformers cannot load it either: save it as UTF-8"
        ) from None
    except OSError as exc:
        raise PacktoolError(f"{path}: cannot read the chat template: {exc.strerror or exc}") from None
    return source


def _keyed_templates(value: Any) -> dict[str, ModelTemplate]:
    """tokenizer_config.json's chat_template: one template, or a list of {name, template} (a later name wins)."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_NAME: ModelTemplate(DEFAULT_NAME, "tokenizer_config.json", value)}
    if not isinstance(value, list):
        raise PacktoolError(
            f"tokenizer_config.json: chat_template must be a string or a list of named templates, "
            f"got {type(value).__name__}"
        )
    out = {}
    for i, entry in enumerate(value):
        if not (
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
        ):
            raise PacktoolError(
                f"tokenizer_config.json: chat_template[{i}] must be {{name, template}}, both strings, "
                f"got {entry!r:.80}; transformers cannot load it either"
            )
        out[entry["name"]] = ModelTemplate(entry["name"], "tokenizer_config.json", entry["template"])
    return out


def _processor_passed_over(tokenizer: dict[str, ModelTemplate], processor: dict[str, ModelTemplate]) -> str:
    """What the processor's templates leave out of the tokenizer's ("" when they are the same)."""
    if not tokenizer or {n: t.source for n, t in tokenizer.items()} == {n: t.source for n, t in processor.items()}:
        return ""
    unused, used = (", ".join(sorted({t.file for t in templates.values()})) for templates in (tokenizer, processor))
    return f"the tokenizer's {unused} differs and is not used: the processor renders with {used}"


def _model_choice(spec: str, templates: dict[str, ModelTemplate]) -> tuple[ModelTemplate, ModelTemplate | None]:
    """The template `template: model` or `model:NAME` renders with, and the tool_use template records with
    tools render with (only for `model`, as apply_chat_template without a chat_template argument)."""
    available = ", ".join(f"{named} ({templates[named].file})" for named in sorted(templates))
    if spec == MODEL_TEMPLATE:
        if DEFAULT_NAME not in templates:
            raise PacktoolError(
                f"template: model, but the model's templates are {available} and none is named {DEFAULT_NAME!r} "
                "(transformers refuses a conversation without tools then); pick one with template: model:NAME"
            )
        default, tools = templates[DEFAULT_NAME], templates.get(TOOL_USE_NAME)
        return default, tools if tools is not None and tools.source != default.source else None
    named = spec.removeprefix(f"{MODEL_TEMPLATE}:")
    if named not in templates:
        raise PacktoolError(f"template: {spec}, but the model has no template named {named!r}; it has {available}")
    return templates[named], None


def load_template(
    spec: str,
    tokenizer_config: dict[str, Any],
    variables: dict[str, Any] | None = None,
    *,
    folder: Path | None = None,
    processor: Path | None = None,
) -> ChatTemplate:
    """`spec` is `model` (the model's own template, found as transformers finds it in `folder` and
    tokenizer_config: see model_templates; with an image `processor` folder, as its processor finds it there:
    processor_templates), `model:NAME` (one of its named templates), a bundled template name, or a .jinja
    path."""
    if spec == MODEL_TEMPLATE or spec.startswith(f"{MODEL_TEMPLATE}:"):
        templates, passed_over = model_templates(folder, tokenizer_config)
        if processor is not None and (rendered := processor_templates(processor)):
            passed_over = _processor_passed_over(templates, rendered) or passed_over
            templates = rendered
        if not templates:
            raise PacktoolError(
                f"template: {spec}, but the model has no chat_template (no {TEMPLATE_FILE}, no {TEMPLATE_DIR}/, "
                "no chat_template key in tokenizer_config.json"
                + (f"; {passed_over}" if passed_over else "")
                + f"); use a bundled template ({', '.join(bundled_templates())}) or a .jinja file"
            )
        chosen, tools = _model_choice(spec, templates)
        if set(templates) == {DEFAULT_NAME}:  # a lone default has no name (transformers keeps it as a string)
            chosen = replace(chosen, named="")
        template = _compile(spec, chosen.source, tokenizer_config, variables, chosen, passed_over or None)
        if tools is None:
            return template
        used = _compile(f"{MODEL_TEMPLATE}:{TOOL_USE_NAME}", tools.source, tokenizer_config, variables, tools, None)
        return replace(template, for_tools=used)
    if spec.endswith(".jinja"):
        return _compile(Path(spec).name, _read_template_file(Path(spec)), tokenizer_config, variables)
    path = bundled_folder("templates") / f"{spec}.jinja"
    if not path.is_file():
        raise PacktoolError(
            f"template: unknown bundled template {spec!r}; "
            f"choose one of {', '.join(bundled_templates())}, 'model', 'model:NAME' or a .jinja path"
        )
    return _compile(spec, path.read_text(encoding="utf-8"), tokenizer_config, variables)


def _compile(
    name: str,
    source: str,
    tokenizer_config: dict[str, Any],
    variables: dict[str, Any] | None,
    origin: ModelTemplate | None = None,
    passed_over: str | None = None,
) -> ChatTemplate:
    where = origin.shown if origin is not None else repr(name)  # a model's template by its file
    if not source.strip():
        raise PacktoolError(
            f"template {where} is empty: every sample would render as nothing (as transformers renders it); "
            "fill it or delete it"
        )
    env = make_environment()
    try:
        tree = env.parse(source)
        _refuse_other_files(tree, where)
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise PacktoolError(f"template {where} line {exc.lineno}: {exc.message}") from None

    variables = dict(variables or {})
    date = _dt.date.fromisoformat(str(variables.pop("date", DEFAULT_DATE)))
    compiled.globals["strftime_now"] = strftime_now = lambda fmt: date.strftime(fmt)
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
        file=origin.file if origin is not None else None,
        named=(origin.named or None) if origin is not None else None,
        passed_over=passed_over,
    )
    template = _with_generation_header(template)
    return _with_minijinja(template, tree, strftime_now, env.globals["raise_exception"])


def _refuse_other_files(tree: nodes.Template, where: str) -> None:
    """A chat template travels inside tokenizer_config.json alone: it may not pull in other files."""
    tags = {
        nodes.Include: "include",
        nodes.Import: "import",
        nodes.FromImport: "from ... import",
        nodes.Extends: "extends",
    }
    for node in tree.find_all(tuple(tags)):
        raise PacktoolError(
            f"template {where} line {node.lineno}: {{% {tags[type(node)]} %}} is not supported; "
            "a chat template must be one self-contained file (paste the other template in)"
        )


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
    except TemplateLimit as exc:
        raise PacktoolError(
            f"template {template.name!r} exceeds a template limit on a one-message conversation: {exc}"
        ) from None
    except (TemplateRaised, jinja2.TemplateError):
        return template
    if opened.startswith(closed) and len(opened) > len(closed):
        header = opened[len(closed) :]
        return replace(template, generation_header=header)
    return template


# Conversations both engines must print byte for byte before minijinja renders a template: roles,
# system prompts, whitespace around contents, reasoning in both spellings, tools, calls and results.
_PROBES: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " What is 2+2?\n"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "Three and three."},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temp": 21}', "name": "get_weather", "tool_call_id": "call0"},
            {"role": "assistant", "content": "21 degrees."},
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    ),
)


def _marked_probe(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe as render_chat marks it: each content core between its message's sentinels."""
    return [{**m, "content": marked_content(m["content"], i) or m["content"]} for i, m in enumerate(messages)]


def _probe_renders(template: ChatTemplate) -> Iterator[tuple[list[dict], list[dict] | None, bool, str | None, bool]]:
    """jinja2's text of every probe, marked and plain, with and without the generation prompt (None where the
    template refuses it), and whether that render inspected a content."""
    for messages, tools in _PROBES:
        for conversation in (messages, _marked_probe(messages)):
            for prompt in (False, True):
                try:
                    text, spent = template.render_tracked(conversation, tools, add_generation_prompt=prompt)
                except (TemplateRaised, TemplateLimit, jinja2.TemplateError, PacktoolError):
                    yield conversation, tools, prompt, None, False
                    continue
                yield conversation, tools, prompt, text, spent.inspected


def _with_minijinja(
    template: ChatTemplate, tree: nodes.Template, strftime_now: Any, raise_exception: Any
) -> ChatTemplate:
    """The template with minijinja as its engine when it qualifies (packtool.minijinja_engine) and
    prints exactly jinja2's text on every probe, marked and plain, with and without the generation
    prompt; where jinja2 refuses a probe, minijinja must refuse it too (and jinja2 then decides)."""
    if os.environ.get(JINJA2_ONLY) == "1":
        return replace(template, engine=f"jinja2 ({JINJA2_ONLY}=1)")
    if template.has_generation_blocks:
        return replace(template, engine="jinja2 (minijinja: {% generation %} blocks are packtool's own tag)")
    try:
        fast = qualify(
            template.source, tree, {**template.special_tokens, **template.variables}, strftime_now, raise_exception
        )
    except NotQualified as exc:
        if not MINIJINJA_INSTALLED and not any(inspected for *_, inspected in _probe_renders(template)):
            # plain chat renders once per shape here: the extra would speed up only conversations with
            # tools, tool calls or reasoning, so the summary does not send every user to install it
            return replace(template, engine="jinja2 (it does not inspect content)")
        return replace(template, engine=f"jinja2 (minijinja: {exc})")
    for conversation, tools, prompt, expected, _ in _probe_renders(template):
        if fast.render(conversation, tools, add_generation_prompt=prompt) != expected:
            return replace(template, engine="jinja2 (minijinja prints other text on a probe conversation)")
    # minijinja renders the conversations no skeleton covers (render_chat); jinja2 teaches the skeletons
    return replace(template, fast=fast, engine="minijinja")
