"""Build configuration: YAML in, frozen dataclasses out, every problem reported at once.

    sources:                       # one or more named sources
      - name: chat
        path: data/chat-*.jsonl    # a file, a glob, or a list of them; relative to this file
        format: messages           # messages | sharegpt | alpaca | text
    tokenizer: tokenizer/          # tokenizer.json, or a folder with tokenizer.json + tokenizer_config.json
    template: model                # a bundled name, `model`, or a .jinja file
    capacity: 2048
    output: out/

Problems are collected with their YAML path (`sources[1].format: ...`) and raised together as
one `ConfigError`, so a user fixes a config in one pass instead of one error per run.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from packtool.errors import PacktoolError
from packtool.packing import PACKERS
from packtool.truncate import STRATEGIES

FORMATS = ("messages", "sharegpt", "alpaca", "text")
# Names come from the registries, so a new strategy is a config choice the moment it exists.
TRUNCATION_STRATEGIES = tuple(STRATEGIES)
PACKING_STRATEGIES = (*PACKERS, "stream")
SPECIAL_TOKEN_POLICIES = ("escape", "keep", "reject")
ERROR_POLICIES = ("fail", "skip")
EXECUTORS = ("processes", "serial", "ray")

# ShareGPT speaker names seen in the wild, mapped to OpenAI roles. `function_call` becomes an
# assistant tool call and `observation` a tool result (LLaMA-Factory's convention).
DEFAULT_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "function_call",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}

DEFAULT_FIELDS = {
    "messages": {"messages": "messages", "tools": "tools", "id": None},
    "sharegpt": {"conversations": "conversations", "system": "system", "tools": "tools", "id": None},
    "alpaca": {
        "instruction": "instruction",
        "input": "input",
        "output": "output",
        "system": "system",
        "history": "history",
        "id": None,
    },
    "text": {"text": "text", "id": None},
}


class ConfigError(PacktoolError):
    def __init__(self, path: str, problems: list[str]):
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{path}: {len(problems)} problem(s) in config:\n{listing}")


@dataclass(frozen=True, slots=True)
class TrainPolicy:
    """Which tokens of a conversation are targets."""

    roles: tuple[str, ...] = ("assistant",)
    turns: str = "all"  # all | last
    end_of_turn: bool = True  # train the template's end-of-turn marker (so the model learns to stop)
    tool_calls: bool = True


@dataclass(frozen=True, slots=True)
class SourceConfig:
    name: str
    paths: tuple[str, ...]  # resolved, sorted file list
    patterns: tuple[str, ...]  # as written in the config
    format: str
    fields: dict[str, str | None]
    weight: float = 1.0
    role_map: dict[str, str] = field(default_factory=dict)
    train: TrainPolicy = TrainPolicy()
    special_tokens: str = "escape"
    truncation: str | None = None  # per-source override of the global strategy
    group: str | None = None  # packing group for group_by: source (defaults to the source name)


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    path: str  # the tokenizer.json file
    config_path: str | None  # tokenizer_config.json, when found next to it


@dataclass(frozen=True, slots=True)
class BuildConfig:
    config_file: str
    sources: tuple[SourceConfig, ...]
    tokenizer: TokenizerConfig
    template: str
    capacity: int
    output: str
    template_vars: dict[str, Any] = field(default_factory=dict)
    truncation: str = "right"
    truncation_fallback: str = "right"
    packing: str = "bfd"
    max_segments: int | None = None
    shuffle_packs: bool = True
    group_by: str | None = None  # None | "source"
    overflow: str = "truncate"  # truncate | bucket
    overflow_capacity: int | None = None
    mix_by: str = "multiplier"  # multiplier | samples | tokens: how source weights are read
    seed: int = 0
    rows_per_shard: int = 1000
    row_group_rows: int = 128
    on_error: str = "fail"
    workers: int = 1  # processes for render + encode; 1 = in the build process
    cache: str | None = None  # token store folder; None: `.packtool-cache` beside the output
    executor: str = "processes"  # processes | serial | ray: where encode and emit work items run
    ray_address: str | None = None
    max_reject_share: float = 0.5  # a source losing more than this share of its records fails the build
    add_bos: bool | None = None  # None: the template decides; text documents get none
    add_eos: bool | None = None  # None: text documents end with EOS, chat follows the template
    raw: dict[str, Any] = field(default_factory=dict)  # the config as written, for the manifest

    @property
    def config_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.raw).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class _Problems:
    """Collects problems with their YAML path so all of them are reported together."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{where}: {message}")

    def take(
        self,
        mapping: dict,
        key: str,
        kind: type | tuple[type, ...],
        where: str,
        default: Any = None,
        *,
        required: bool = False,
        choices: tuple[str, ...] | None = None,
    ) -> Any:
        path = f"{where}.{key}" if where else key
        if key not in mapping or mapping[key] is None:
            if required:
                self.add(path, "is required")
            return default
        value = mapping[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (bool in kinds and not isinstance(value, bool)) or (bool not in kinds and isinstance(value, bool)):
            self.add(path, f"expected {_kind_name(kinds)}, got {value!r}")
            return default
        if float in kinds and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kinds):
            self.add(path, f"expected {_kind_name(kinds)}, got {type(value).__name__} {value!r}")
            return default
        if choices is not None and value not in choices:
            self.add(path, f"{value!r} is not one of {', '.join(choices)}")
            return default
        return value

    def unknown_keys(self, mapping: dict, allowed: set[str], where: str) -> None:
        for key in mapping:
            if key not in allowed:
                self.add(
                    f"{where}.{key}" if where else str(key), f"unknown key (allowed: {', '.join(sorted(allowed))})"
                )


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true/false",
        list: "a list",
        dict: "a mapping",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


TOP_KEYS = {
    "sources",
    "tokenizer",
    "template",
    "template_vars",
    "capacity",
    "output",
    "truncation",
    "packing",
    "overflow",
    "mixing",
    "seed",
    "rows_per_shard",
    "row_group_rows",
    "on_error",
    "add_bos",
    "add_eos",
    "workers",
    "cache",
    "executor",
    "ray_address",
    "max_reject_share",
}
SOURCE_KEYS = {
    "name",
    "path",
    "format",
    "fields",
    "weight",
    "role_map",
    "train",
    "special_tokens",
    "truncation",
    "group",
}
TRAIN_KEYS = {"roles", "turns", "end_of_turn", "tool_calls"}


def load_config(
    path: str | Path, *, output: str | None = None, capacity: int | None = None, workers: str | None = None
) -> BuildConfig:
    """Read and validate a build config. `output`, `capacity` and `workers` override the file (command-line flags)."""
    path = Path(path)
    if not path.is_file():
        raise PacktoolError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PacktoolError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise PacktoolError(f"{path}: expected a mapping at the top level")
    if output is not None:
        raw["output"] = output
    if capacity is not None:
        raw["capacity"] = capacity
    if workers is not None:
        raw["workers"] = int(workers) if workers.isdigit() else workers
    return parse_config(raw, base_dir=path.resolve().parent, config_file=str(path))


def parse_config(raw: dict[str, Any], *, base_dir: Path, config_file: str = "<config>") -> BuildConfig:
    p = _Problems()
    p.unknown_keys(raw, TOP_KEYS, "")

    sources_raw = p.take(raw, "sources", list, "", [], required=True)
    sources = tuple(s for i, item in enumerate(sources_raw) if (s := _parse_source(item, i, base_dir, p)))
    names = [s.name for s in sources]
    for name in {n for n in names if names.count(n) > 1}:
        p.add("sources", f"source name {name!r} is used more than once")

    tokenizer = _parse_tokenizer(p.take(raw, "tokenizer", str, "", required=True), base_dir, p)
    template = p.take(raw, "template", str, "", "model")
    if template.endswith(".jinja"):
        template_path = _resolve(base_dir, template)
        if not template_path.is_file():
            p.add("template", f"file not found: {template_path}")
        template = str(template_path)
    template_vars = p.take(raw, "template_vars", dict, "", {})

    capacity = p.take(raw, "capacity", int, "", 0, required=True)
    if isinstance(raw.get("capacity"), int) and capacity < 2:
        p.add("capacity", f"must be at least 2 tokens, got {capacity}")
    output_raw = p.take(raw, "output", str, "", None, required=True)

    truncation_raw = raw.get("truncation", "right")
    truncation, fallback = "right", "right"
    if isinstance(truncation_raw, str):
        truncation = p.take(raw, "truncation", str, "", "right", choices=TRUNCATION_STRATEGIES)
    elif isinstance(truncation_raw, dict):
        p.unknown_keys(truncation_raw, {"strategy", "fallback"}, "truncation")
        truncation = p.take(truncation_raw, "strategy", str, "truncation", "right", choices=TRUNCATION_STRATEGIES)
        fallback = p.take(truncation_raw, "fallback", str, "truncation", "right", choices=TRUNCATION_STRATEGIES)
    else:
        p.add("truncation", f"expected a strategy name or a mapping, got {truncation_raw!r}")

    packing_raw = raw.get("packing", "bfd")
    packing, max_segments, shuffle, group_by = "bfd", None, True, None
    if isinstance(packing_raw, str):
        packing = p.take(raw, "packing", str, "", "bfd", choices=PACKING_STRATEGIES)
    elif isinstance(packing_raw, dict):
        p.unknown_keys(packing_raw, {"strategy", "max_segments", "shuffle", "group_by"}, "packing")
        packing = p.take(packing_raw, "strategy", str, "packing", "bfd", choices=PACKING_STRATEGIES)
        max_segments = p.take(packing_raw, "max_segments", int, "packing", None)
        shuffle = p.take(packing_raw, "shuffle", bool, "packing", True)
        group_by = p.take(packing_raw, "group_by", str, "packing", None, choices=("source",))
    else:
        p.add("packing", f"expected a strategy name or a mapping, got {packing_raw!r}")

    overflow_raw = raw.get("overflow", "truncate")
    overflow, overflow_capacity = "truncate", None
    if isinstance(overflow_raw, str):
        overflow = p.take(raw, "overflow", str, "", "truncate", choices=("truncate", "bucket"))
    elif isinstance(overflow_raw, dict):
        p.unknown_keys(overflow_raw, {"mode", "capacity"}, "overflow")
        overflow = p.take(overflow_raw, "mode", str, "overflow", "truncate", choices=("truncate", "bucket"))
        overflow_capacity = p.take(overflow_raw, "capacity", int, "overflow", None)
    else:
        p.add("overflow", f"expected 'truncate', 'bucket' or a mapping, got {overflow_raw!r}")
    if overflow == "bucket" and isinstance(capacity, int):
        if overflow_capacity is None:
            overflow_capacity = 4 * capacity
        elif overflow_capacity <= capacity:
            p.add("overflow.capacity", f"must exceed capacity {capacity}, got {overflow_capacity}")

    mixing_raw = p.take(raw, "mixing", dict, "", {})
    p.unknown_keys(mixing_raw, {"by"}, "mixing")
    mix_by = p.take(mixing_raw, "by", str, "mixing", "multiplier", choices=("multiplier", "samples", "tokens"))

    config = BuildConfig(
        config_file=config_file,
        sources=sources,
        tokenizer=tokenizer,
        template=template,
        template_vars=template_vars,
        capacity=capacity or 0,
        output=str(_resolve(base_dir, output_raw)) if output_raw else "",
        truncation=truncation,
        truncation_fallback=fallback,
        packing=packing,
        max_segments=max_segments,
        shuffle_packs=shuffle,
        group_by=group_by,
        overflow=overflow,
        overflow_capacity=overflow_capacity,
        mix_by=mix_by,
        seed=p.take(raw, "seed", int, "", 0),
        rows_per_shard=p.take(raw, "rows_per_shard", int, "", 1000),
        row_group_rows=p.take(raw, "row_group_rows", int, "", 128),
        on_error=p.take(raw, "on_error", str, "", "fail", choices=ERROR_POLICIES),
        workers=_workers(p.take(raw, "workers", (int, str), "", 1), p),
        cache=str(_resolve(base_dir, cache_raw)) if (cache_raw := p.take(raw, "cache", str, "", None)) else None,
        executor=p.take(raw, "executor", str, "", "processes", choices=EXECUTORS),
        ray_address=p.take(raw, "ray_address", str, "", None),
        max_reject_share=_share(p.take(raw, "max_reject_share", float, "", 0.5), "max_reject_share", p),
        add_bos=p.take(raw, "add_bos", bool, "", None),
        add_eos=p.take(raw, "add_eos", bool, "", None),
        # where and how fast a build runs does not change what it writes: neither enters the manifest
        raw={k: v for k, v in raw.items() if k not in ("output", "workers", "cache", "executor", "ray_address")},
    )
    if config.truncation == "turns" and config.truncation_fallback == "turns":
        p.add("truncation.fallback", "'turns' cannot be its own fallback")
    if config.packing == "stream" and config.overflow == "bucket":
        p.add("overflow", "stream mode cuts documents into windows itself; an overflow bucket does not apply")
    if config.packing == "stream" and any(s.format != "text" for s in sources):
        p.add("packing", "'stream' (documents visible to each other) is only for format: text sources")
    if p.items:
        raise ConfigError(config_file, p.items)
    return config


def _workers(value: int | str, p: _Problems) -> int:
    """An integer >= 1, or `auto` for one process per CPU core."""
    if value == "auto":
        return os.cpu_count() or 1
    if isinstance(value, str) or value < 1:
        p.add("workers", f"expected a positive integer or 'auto', got {value!r}")
        return 1
    return value


def _share(value: float, where: str, p: _Problems) -> float:
    if not 0.0 <= value <= 1.0:
        p.add(where, f"expected a share between 0 and 1, got {value}")
    return value


def _resolve(base_dir: Path, value: str) -> Path:
    candidate = Path(value).expanduser()
    return candidate if candidate.is_absolute() else base_dir / candidate


def _parse_source(item: Any, index: int, base_dir: Path, p: _Problems) -> SourceConfig | None:
    where = f"sources[{index}]"
    if not isinstance(item, dict):
        p.add(where, f"expected a mapping, got {item!r}")
        return None
    p.unknown_keys(item, SOURCE_KEYS, where)
    name = p.take(item, "name", str, where, f"source{index}")
    fmt = p.take(item, "format", str, where, None, required=True, choices=FORMATS)
    patterns_raw = item.get("path")
    if isinstance(patterns_raw, str):
        patterns: tuple[str, ...] = (patterns_raw,)
    elif isinstance(patterns_raw, list) and patterns_raw and all(isinstance(x, str) for x in patterns_raw):
        patterns = tuple(patterns_raw)
    else:
        p.add(f"{where}.path", "is required: a file, a glob, or a list of them")
        patterns = ()
    paths: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(_resolve(base_dir, pattern)), recursive=True))
        if not matched:
            p.add(f"{where}.path", f"no file matches {pattern!r} (relative to {base_dir})")
        paths.extend(matched)

    fields_raw = p.take(item, "fields", dict, where, {})
    mapping = dict(DEFAULT_FIELDS.get(fmt or "", {}))
    for key, value in fields_raw.items():
        if key not in mapping:
            p.add(f"{where}.fields.{key}", f"unknown field for format {fmt!r} (allowed: {', '.join(mapping)})")
        elif value is not None and not isinstance(value, str):
            p.add(f"{where}.fields.{key}", f"expected a column name, got {value!r}")
        else:
            mapping[key] = value

    role_map = dict(DEFAULT_SHAREGPT_ROLES) if fmt == "sharegpt" else {}
    for key, value in p.take(item, "role_map", dict, where, {}).items():
        if value not in ("system", "user", "assistant", "tool", "function_call"):
            p.add(f"{where}.role_map.{key}", f"maps to unknown role {value!r}")
        role_map[str(key)] = value

    train_raw = p.take(item, "train", dict, where, {})
    p.unknown_keys(train_raw, TRAIN_KEYS, f"{where}.train")
    roles = tuple(p.take(train_raw, "roles", list, f"{where}.train", ["assistant"]))
    for role in roles:
        if role == "tool":
            p.add(f"{where}.train.roles", "tool results are never trained (they are the environment's words)")
        elif role not in ("system", "user", "assistant"):
            p.add(f"{where}.train.roles", f"unknown role {role!r}")
    train = TrainPolicy(
        roles=roles,
        turns=p.take(train_raw, "turns", str, f"{where}.train", "all", choices=("all", "last")),
        end_of_turn=p.take(train_raw, "end_of_turn", bool, f"{where}.train", True),
        tool_calls=p.take(train_raw, "tool_calls", bool, f"{where}.train", True),
    )
    weight = p.take(item, "weight", float, where, 1.0)
    if weight is not None and weight <= 0:
        p.add(f"{where}.weight", f"must be positive, got {weight}")
    return SourceConfig(
        name=name,
        paths=tuple(paths),
        patterns=patterns,
        format=fmt or "messages",
        fields=mapping,
        weight=weight,
        role_map=role_map,
        train=train,
        special_tokens=p.take(item, "special_tokens", str, where, "escape", choices=SPECIAL_TOKEN_POLICIES),
        truncation=p.take(item, "truncation", str, where, None, choices=TRUNCATION_STRATEGIES),
        group=p.take(item, "group", str, where, None),
    )


def _parse_tokenizer(value: str | None, base_dir: Path, p: _Problems) -> TokenizerConfig:
    if value is None:
        return TokenizerConfig(path="", config_path=None)
    target = _resolve(base_dir, value)
    if target.is_dir():
        tokenizer_file = target / "tokenizer.json"
        if not tokenizer_file.is_file():
            p.add("tokenizer", f"folder {target} has no tokenizer.json")
        config_file = target / "tokenizer_config.json"
        return TokenizerConfig(str(tokenizer_file), str(config_file) if config_file.is_file() else None)
    if not target.is_file():
        p.add("tokenizer", f"not found: {target}")
        return TokenizerConfig(str(target), None)
    sibling = target.parent / "tokenizer_config.json"
    return TokenizerConfig(str(target), str(sibling) if sibling.is_file() else None)


def bundled_configs() -> list[str]:
    folder = resources.files("packtool.configs")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(value: str | Path) -> Path:
    """A config file path, or the name of a config shipped with packtool (`quickstart`)."""
    path = Path(value)
    if path.is_file() or path.suffix in (".yaml", ".yml"):
        return path
    bundled = resources.files("packtool.configs") / f"{value}.yaml"
    if bundled.is_file():
        return Path(str(bundled))
    raise PacktoolError(f"{value}: no such config file, and not a bundled config ({', '.join(bundled_configs())})")
