"""Build configuration: YAML in, frozen dataclasses out, every problem reported at once.

    sources:                       # one or more named sources
      - name: chat
        path: data/chat-*.jsonl    # a file, a glob, or a list of them; relative to this file
        format: messages           # messages | sharegpt | alpaca | text | prompt_completion | preference | group
    tokenizer: tokenizer/          # tokenizer.json, or a folder with tokenizer.json + tokenizer_config.json
    template: model                # `model`, `model:NAME` (a named one), a bundled name, or a .jinja file
    capacity: 2048
    output: out/

Every key, its default and whether it is required: docs/config.md (tests/test_config_doc.py checks it against
`KEYS` and the parser). Problems are collected with their YAML path (`sources[1].format: ...`) and raised together as
one `ConfigError`, so a user fixes a config in one pass instead of one error per run.

The result is a tree of frozen sections shaped like the YAML and the manifest (`config.packing.strategy`,
`config.run.workers`, `source.plan.weight`); cache and plan keys hash whole sections (`KEYED_BY`).
"""

from __future__ import annotations

import datetime
import difflib
import glob
import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from packtool import hub
from packtool.checks import range_problem, seed_problem
from packtool.errors import ConfigError, HubError, PacktoolError
from packtool.format import IMAGE_STORAGE, MIX_UNITS, Interleaving
from packtool.packing import BALANCEABLE, PACKERS
from packtool.truncate import ITEM_TRUNCATION, STRATEGIES
from packtool.vision.placing import IMAGE_TOKENS
from packtool.vision.processors import PREPROCESSOR_CONFIG, load_processor
from packtool.workers import EXECUTORS, WORKERS_CHOICES, auto_workers, count_workers, usable_cores

if TYPE_CHECKING:
    from importlib.abc import Traversable

FORMATS = ("messages", "sharegpt", "alpaca", "text", "prompt_completion", "preference", "group")
# `template: model` is the model's own chat template; `model:NAME` one of its named templates (chat_templates).
MODEL_TEMPLATE = "model"
# Formats whose records are items of several segments that train together (packtool.adapters reads them).
ITEM_FORMATS = ("preference", "group")
# Names come from the registries, so a new strategy is a config choice the moment it exists.
TRUNCATION_STRATEGIES = tuple(STRATEGIES)
PACKING_STRATEGIES = (*PACKERS, "stream")
SPECIAL_TOKEN_POLICIES = ("escape", "keep", "reject")
ERROR_POLICIES = ("fail", "skip")
# `exact`: a record whose encoded tokens and targets equal an earlier one's is dropped as `duplicate`.
DEDUP_MODES = ("exact",)
RENDER_MODES = ("accelerated", "reference")

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
    "prompt_completion": {"prompt": "prompt", "completion": "completion", "tools": "tools", "id": None},
    # every shape of packtool.adapters.pair_shape; a column absent from a record is simply not that shape
    "preference": {
        "conversations": "conversations",
        "system": "system",
        "tools": "tools",
        "prompt": "prompt",
        "chosen": "chosen",
        "rejected": "rejected",
        "id": None,
    },
    "group": {
        "prompt": "prompt",
        "completions": "completions",
        "rewards": "rewards",
        "advantages": "advantages",
        "id": None,
    },
}

# Tokenizing takes ~150x the text in memory (the tokenizer's per-token offsets, strings and words):
# an 8 MiB text record peaked at 1.26 GB in a one-process build (44 s), a 200 MB one took 24 GB.
# 4 MiB (~1M tokens, the longest context trained today) keeps one worker near 600 MB; a larger
# record is rejected before it is parsed or tokenized.
DEFAULT_MAX_RECORD_BYTES = 4 << 20
MAX_RECORD_BYTES = 1 << 31  # str and JSON parsing of one line beyond this is not something a build should try


@dataclass(frozen=True, slots=True)
class TrainPolicy:
    """Which tokens of a conversation are targets."""

    roles: tuple[str, ...] = ("assistant",)
    turns: str = "all"  # all | last
    end_of_turn: bool = True  # train the template's end-of-turn marker (so the model learns to stop)
    tool_calls: bool = True


QUOTA_UNITS = ("target_tokens", "tokens")
QUOTA_MISS_POLICIES = ("warn", "fail")  # on_quota_miss; `build --strict` sets fail


@dataclass(frozen=True, slots=True)
class Quota:
    """Copies of a source's samples until it holds `amount` target tokens or tokens (met within one sample)."""

    unit: str  # target_tokens | tokens
    amount: int


DEFAULT_INTERLEAVE_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """What the plan reads of one source (`sources[]` weight, truncation, group, dedup, quota): in the plan key."""

    weight: float = 1.0
    truncation: str | None = None  # per-source override of the global strategy
    group: str | None = None  # packing group for group_by: source (defaults to the source name)
    dedup: str | None = None  # exact: drop repeats within this source (see BuildConfig.dedup for across sources)
    quota: Quota | None = None  # instead of weight: copies until the source holds this many (target) tokens


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """One `sources[]` entry. Its files are keyed by their content; `plan` is its plan section; every other
    field is what render and tokenize read, hashed whole into its encode keys (builder.cache.source_settings)."""

    name: str
    paths: tuple[str, ...]  # resolved, sorted file list
    patterns: tuple[str, ...]  # as written in the config
    format: str
    fields: dict[str, str | None]
    role_map: dict[str, str] = field(default_factory=dict)
    train: TrainPolicy = TrainPolicy()
    special_tokens: str = "escape"
    max_samples: int | None = None  # read only the first N records (all files in order)
    system: str | None = None  # the system prompt of a conversation that has none
    image_root: str | None = None  # the folder a record's relative image paths are in (None: its data file's)
    max_record_bytes: int = (
        DEFAULT_MAX_RECORD_BYTES  # the top-level setting, carried to the readers (set by parse_config)
    )
    # resolved path -> the path as written/globbed in the config (relative to its folder when it was
    # relative): the FILE of every location and default id, so ids do not depend on where the data sits
    labels: dict[str, str] = field(default_factory=dict)
    plan: SourcePlan = SourcePlan()


# The fields of a source that are its input files, not settings: each encode key holds a file's content and label.
SOURCE_FILES = ("paths", "patterns", "labels")


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    path: str  # the tokenizer.json file
    config_path: str | None  # tokenizer_config.json, when found next to it


@dataclass(frozen=True, slots=True)
class Encoding:
    """Top-level settings every source's render and tokenize read."""

    add_bos: bool | None = None  # None: the template decides; text documents get none
    add_eos: bool | None = None  # None: text documents end with EOS, chat follows the template
    # a larger record is rejected (record_too_large) before it is parsed or tokenized
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES


@dataclass(frozen=True, slots=True)
class Truncation:
    """`truncation:` (a strategy name, or this mapping); the manifest's `truncation`."""

    strategy: str = "right"
    fallback: str = "right"
    items: str = "left"  # preference/group items: drop | left | turns (the shared prompt is cut)


@dataclass(frozen=True, slots=True)
class Packing:
    """`packing:` (a strategy name, or this mapping); the manifest's `packing`."""

    strategy: str = "bfd"
    max_segments: int | None = None
    shuffle: bool = True
    group_by: str | None = None  # None | "source"
    balance_vision: bool = False  # with images: even out vision patches per pack (packing.plan_vision)


@dataclass(frozen=True, slots=True)
class Overflow:
    """`overflow:` (a mode, or this mapping)."""

    mode: str = "truncate"  # truncate | bucket
    capacity: int | None = None


@dataclass(frozen=True, slots=True)
class Mixing:
    """`mixing:`; the manifest's `mixing` adds each source's weight (and quota)."""

    by: str = "multiplier"  # multiplier | samples | tokens: how source weights are read
    interleave: Interleaving | None = None  # windows of packs that each hold the mix


@dataclass(frozen=True, slots=True)
class Validation:
    """`validation: {share: x}` or `{samples: n}` (at most one is set)."""

    share: float | None = None
    samples: int | None = None


@dataclass(frozen=True, slots=True)
class Shards:
    """`rows_per_shard` and `row_group_rows`: how the packs are cut into files and row groups."""

    rows_per_shard: int = 1000
    row_group_rows: int = 128


@dataclass(frozen=True, slots=True)
class Outcome:
    """Whether a build publishes what it wrote (`on_error`, `max_reject_share`, `on_quota_miss`), never what it
    writes."""

    on_error: str = "fail"
    max_reject_share: float = 0.5  # fail when a source loses more than this share of what it read
    on_quota_miss: str = "warn"  # a quota the shards fall short of: a warning line, or (fail) nothing published


@dataclass(frozen=True, slots=True)
class Card:
    """`card:`: what the dataset card (OUT/README.md, builder.card) says beyond the manifest: the Hub's metadata
    fields (license, pretty_name, language, tags, source_datasets) and a description. Only the card reads it."""

    license: str | None = None  # a Hub license id (apache-2.0, cc-by-4.0, other, ...)
    pretty_name: str | None = None  # the card's title
    description: str | None = None  # a paragraph (Markdown) under the title
    language: tuple[str, ...] = ()  # ISO 639-1 codes
    tags: tuple[str, ...] = ()
    source_datasets: tuple[str, ...] = ()  # Hub ids of the data the sources came from


@dataclass(frozen=True, slots=True)
class Run:
    """Where and how fast a build runs: never its bytes, so none of these is keyed or enters the manifest."""

    output: str
    # processes for render + encode (1 = in the build process); left out, `workers: auto`: the usable cores'
    workers: int = field(default_factory=lambda: auto_workers(usable_cores()))
    executor: str = "processes"  # processes | serial | ray: where work items run (never changes the bytes)
    ray_address: str | None = None  # an existing Ray cluster (executor: ray); None starts a local one
    cache: str | None = None  # token store folder; None = `.packtool-cache` beside the output
    render: str = "accelerated"  # accelerated | reference: the render routes (packtool.render); same bytes


# What a training sample's overlap with an eval set does: drop it (a reject, `contaminated`) or report it.
DECONTAMINATION_ACTIONS = ("drop", "report")


@dataclass(frozen=True, slots=True)
class Decontamination:
    """`decontamination:`: eval sets no trained text may overlap (packtool.decontamination matches them). Keyed by
    content: the eval files' sha256 and these settings enter every encode key (builder.stages.EvalSet.key)."""

    against: tuple[str, ...]  # the eval files, resolved (a glob, a datasets folder and a hub id expanded)
    labels: dict[str, str]  # resolved path -> the path as written: how findings name an eval file
    ngram: int = 13  # words per window of a long eval string
    min_line_words: int = 6  # a shorter eval string (an option, a one-line answer) matches whole from this many words
    action: str = "drop"  # an overlap in a sample's targets: drop | report
    prompt_action: str = "report"  # an overlap in its prompt only: drop | report
    fields: tuple[str, ...] = ()  # the eval records' top-level fields read; empty: every string field


def config_folder(config: BuildConfig) -> Path:
    """The folder of the config file: image references are relative to it (records.PlacedImage)."""
    return Path(config.config_file).resolve().parent


def missing_image_token(config: BuildConfig, family: str) -> ConfigError:
    """A processor whose image token the tokenizer lacks: every image record would be rejected for the same
    reason, so the first one stops the build with this one line instead (a text record needs no image token:
    a build without image records is not refused)."""
    return ConfigError(
        config.config_file,
        [
            f"processor: {config.processor} ({family}) puts each image in the text as {IMAGE_TOKENS[family]}, and the "
            f"tokenizer {config.tokenizer.path} has no such token; use the tokenizer of the processor's model"
        ],
    )


# The top-level config keys of the run section (each Run field has its key's name): left out of the manifest.
RUN_KEYS = tuple(f.name for f in fields(Run))


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """The config as sections. Keys hash whole parts (builder.cache.encode_key, builder.plan.plan_key),
    so a setting added to a section is keyed with it; which key hashes each part is `KEYED_BY`."""

    config_file: str
    sources: tuple[SourceConfig, ...]
    tokenizer: TokenizerConfig
    capacity: int
    run: Run
    template: str = MODEL_TEMPLATE  # model, model:NAME, a bundled name, or a .jinja file (resolved)
    processor: str | None = None  # the folder holding preprocessor_config.json: images' grids and token counts
    images: str = "reference"  # reference: shards name each image file; embed: shards hold its bytes too
    template_vars: dict[str, Any] = field(default_factory=dict)
    encoding: Encoding = Encoding()
    truncation: Truncation = Truncation()
    packing: Packing = Packing()
    overflow: Overflow = Overflow()
    mixing: Mixing = Mixing()
    validation: Validation = Validation()
    shards: Shards = Shards()
    seed: int = 0
    dedup: str | None = None  # exact: drop repeats across all sources (the first in source order is kept)
    outcome: Outcome = Outcome()
    decontamination: Decontamination | None = None
    card: Card = Card()
    raw: dict[str, Any] = field(default_factory=dict)  # the config as written, for the manifest

    @property
    def config_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.raw).encode()).hexdigest()


# Which key hashes each part of a BuildConfig, whole (tests/builder/test_keys.py fails for a part not named here):
#   content  every encode key, by the bytes it names: the tokenizer's files, the template's source and variables
#   encode   every encode key, as written
#   plan     the plan key, beside the encode keys it holds
#   none     the config's file and text, the outcome checks and the run: never the bytes
# `sources` is split by field: each source's files and settings in its encode keys, its `plan` section in the
# plan key. Pairs and groups are cut to fit one pack while encoding, so their encode keys add ITEM_FIT_PARTS.
KEYED_BY = {
    "tokenizer": "content",
    "template": "content",
    "template_vars": "content",
    "processor": "content",  # preprocessor_config.json (and processor_config.json) by their sha256
    "images": "plan",
    "encoding": "encode",
    "capacity": "plan",
    "truncation": "plan",
    "packing": "plan",
    "overflow": "plan",
    "mixing": "plan",
    "validation": "plan",
    "shards": "plan",
    "seed": "plan",
    "dedup": "plan",
    "sources": "encode+plan",
    "decontamination": "content",  # the eval files by their sha256 (builder.stages.EvalSet.key), and its settings
    "config_file": "none",
    "card": "none",  # the card's words: it is written from the manifest, after every shard
    "raw": "none",
    "outcome": "none",
    "run": "none",
}
ITEM_FIT_PARTS = ("capacity", "truncation")


def keyed_parts(config: BuildConfig, *keys: str) -> dict[str, Any]:
    """The parts of `config` that KEYED_BY gives to `keys` (content, encode, plan), each whole, as plain data."""
    return {name: section_data(getattr(config, name)) for name, key in KEYED_BY.items() if key in keys}


def item_fit_parts(config: BuildConfig) -> dict[str, Any]:
    """What pairs and groups are cut to while encoding (one pack): part of their encode keys."""
    return {name: section_data(getattr(config, name)) for name in ITEM_FIT_PARTS}


def source_encode_settings(source: SourceConfig) -> dict[str, Any]:
    """Everything render and tokenize read of one source: all its fields but its files and its plan section."""
    skipped = {*SOURCE_FILES, "plan"}
    return {f.name: section_data(getattr(source, f.name)) for f in fields(source) if f.name not in skipped}


def field_default(section: type, name: str) -> Any:
    """The default a section's dataclass states for `name`, for a section that cannot be made without its
    required fields: the parser takes every default from a dataclass, where each is written once."""
    (declared,) = [f for f in fields(section) if f.name == name]
    return declared.default_factory() if callable(declared.default_factory) else declared.default


def section_data(value: Any) -> Any:
    """A section (or any config value) as plain JSON-ready data, to hash."""
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


# One encoder for every call: json.dumps with options builds a new one each time (a cost per record).
# default=str: Parquet and Arrow rows may hold timestamps or bytes, which JSON has no type for.
_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def canonical_json(value: Any) -> str:
    return _CANONICAL.encode(value)


SCIENTIFIC_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_number(value: Any) -> str:
    """A hint for a number in scientific notation that YAML 1.1 reads as text: it wants a dot and a signed
    exponent, so `1e13` is the string '1e13' (1.0e+13, or the digits, is the number)."""
    if isinstance(value, str) and SCIENTIFIC_TEXT.fullmatch(value.strip()):
        return f" (YAML reads {value.strip()} as text: write the digits, or a dot and a signed exponent as in 1.0e+13)"
    return ""


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
            self.add(path, f"expected {_kind_name(kinds)}, got {type(value).__name__} {value!r}{_yaml_number(value)}")
            return default
        if choices is not None and value not in choices:
            self.add(
                path, f"{value!r} is not one of {', '.join(choices)}{_did_you_mean(value, choices, VALUE_ALIASES)}"
            )
            return default
        return value

    def number(self, where: str, value: Any, low: float, high: float, why: str) -> None:
        """A problem when `value` (already type-checked) lies outside [low, high]; `why` says what the limit guards."""
        if isinstance(value, (int, float)):
            self.check(where, range_problem(value, low, high, why))

    def check(self, where: str, problem: str | None) -> None:
        """A shared checker's answer (packtool.checks): a problem unless it is None."""
        if problem is not None:
            self.add(where, problem)

    def unknown_keys(self, mapping: dict, allowed: set[str], where: str, peers: dict[str, str] | None = None) -> None:
        for key in mapping:
            if key in allowed:
                continue
            hint = _did_you_mean(str(key), sorted(allowed), peers or {})
            self.add(
                f"{where}.{key}" if where else str(key),
                f"unknown key{hint or ' (allowed: ' + ', '.join(sorted(allowed)) + ')'}",
            )


def _did_you_mean(value: Any, choices: Any, aliases: dict[str, str]) -> str:
    """`; did you mean 'capacity'?` for a misspelling or a name another trainer uses; '' when nothing is close."""
    if not isinstance(value, str):
        return ""
    if value in aliases:
        return f"; packtool calls this {aliases[value]}"
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


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
    "processor",
    "images",
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
    "executor",
    "ray_address",
    "cache",
    "render",
    "max_reject_share",
    "on_quota_miss",
    "max_record_bytes",
    "validation",
    "dedup",
    "decontamination",
    "card",
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
    "max_samples",
    "quota",
    "split",
    "revision",
    "system",
    "dedup",
    "image_root",
}
TRAIN_KEYS = {"roles", "turns", "end_of_turn", "tool_calls"}
# The keys of the settings that may be written as a mapping (docs/config.md lists them all; a test checks it).
TRUNCATION_KEYS = {"strategy", "fallback", "items"}
PACKING_KEYS = {"strategy", "max_segments", "shuffle", "group_by", "balance_vision"}
OVERFLOW_KEYS = {"mode", "capacity"}
OVERFLOW_MODES = ("truncate", "bucket")
MIXING_KEYS = {"by", "interleave"}
INTERLEAVE_KEYS = {"window", "tolerance", "unit"}
VALIDATION_KEYS = {"share", "samples"}
DECONTAMINATION_KEYS = {"against", "ngram", "min_line_words", "action", "prompt_action", "fields"}
CARD_TEXTS = ("license", "pretty_name", "description")
CARD_LISTS = ("language", "tags", "source_datasets")
CARD_KEYS = {*CARD_TEXTS, *CARD_LISTS}
# Every mapping of the config and the keys it takes, by its path as docs/config.md writes it.
KEYS = {
    "": TOP_KEYS,
    "truncation": TRUNCATION_KEYS,
    "packing": PACKING_KEYS,
    "overflow": OVERFLOW_KEYS,
    "mixing": MIXING_KEYS,
    "mixing.interleave": INTERLEAVE_KEYS,
    "validation": VALIDATION_KEYS,
    "decontamination": DECONTAMINATION_KEYS,
    "card": CARD_KEYS,
    "sources[]": SOURCE_KEYS,
    "sources[].train": TRAIN_KEYS,
    "sources[].quota": set(QUOTA_UNITS),
}
# Settings users bring from TRL, axolotl and LLaMA-Factory, and where packtool keeps each.
_TRAIN_INPUTS = "sources[].train.roles: [user, assistant]"
PEER_KEYS = {
    **dict.fromkeys(
        ("max_length", "max_seq_length", "sequence_len", "cutoff_len", "max_seq_len", "seq_length", "block_size"),
        "'capacity'",
    ),
    "train_on_inputs": _TRAIN_INPUTS,
    "train_on_prompt": _TRAIN_INPUTS,
    "train_on_eos": "sources[].train.end_of_turn",
    "mask_history": "sources[].train.turns: last",
    "roles_to_train": "sources[].train.roles",
    "assistant_only_loss": "sources[].train.roles (assistant only is the default)",
    "completion_only_loss": "sources[].train.roles (assistant only is the default)",
    **dict.fromkeys(("val_size", "val_set_size", "eval_size", "test_size"), "validation: {share: x} or {samples: n}"),
    "max_samples": "sources[].max_samples (or --max-samples N on the command line)",
    **dict.fromkeys(("sample_packing", "neat_packing", "padding_free"), "'packing' (documents never see each other)"),
    **dict.fromkeys(("dataset", "datasets", "data_files"), "'sources'"),
    **dict.fromkeys(("output_dir", "dataset_prepared_path"), "'output'"),
    **dict.fromkeys(("num_proc", "dataset_num_proc", "preprocessing_num_workers"), "'workers'"),
    **dict.fromkeys(("tokenizer_name", "tokenizer_name_or_path", "model_name_or_path", "base_model"), "'tokenizer'"),
    "chat_template": "'template'",
    "split": "sources[].split",
    **dict.fromkeys(("default_system", "default_system_message", "system_prompt"), "sources[].system"),
    **dict.fromkeys(("dataset_exact_deduplication", "deduplicate", "dedupe"), "dedup: exact"),
}
SOURCE_PEER_KEYS = {
    **dict.fromkeys(("type", "formatting", "ds_type"), "'format'"),
    **dict.fromkeys(("data_files", "file_name", "path_or_name"), "'path'"),
    **dict.fromkeys(("columns", "field_messages"), "'fields'"),
    "tags": "'role_map'",
    "roles_to_train": "train.roles",
    **dict.fromkeys(("max_length", "sequence_len", "cutoff_len"), "the top-level 'capacity'"),
    **dict.fromkeys(("default_system", "default_system_message", "system_prompt"), "'system'"),
    **dict.fromkeys(("deduplicate", "dedupe"), "dedup: exact"),
}
# Values other tools use for a packtool choice (format names above all).
VALUE_ALIASES = {
    "share_gpt": "'sharegpt'",
    "openai": "'messages'",
    "chat_template": "'messages'",
    "conversation": "'messages'",
    "completion": "'text' (axolotl's completion: every token trained) or 'prompt_completion' (TRL's prompt + "
    "completion columns: only the completion trained)",
    "pretrain": "'text'",
    "instruction": "'alpaca'",
}
# The longest context models train on today is ~1M tokens; several int32 arrays of `capacity`
# are allocated per pack, so a typo like 2**31 would ask for gigabytes after the whole encode.
MAX_CAPACITY = 1_048_576


def load_config(
    path: str | Path,
    *,
    output: str | None = None,
    capacity: int | None = None,
    workers: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    max_samples: int | None = None,
) -> BuildConfig:
    """Read and validate a build config.

    Command-line settings override the file: `output`, `capacity`, `workers`, `max_samples` (every
    source) and `overrides` (`--set key.sub=value`, see `apply_overrides`); all are validated like the file.
    An `output` given here starts at the working folder, as on the command line (the file's own
    `output` starts at the file's folder).
    """
    path = Path(path)
    if not path.is_file():
        raise PacktoolError(f"{path}: config file not found")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise PacktoolError(
            f"{path}: {path.stat().st_size:,} bytes, over the {MAX_CONFIG_BYTES:,} a build config may have "
            "(a config is a few KB; is this a data file?)"
        )
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise PacktoolError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise PacktoolError(f"{path}: YAML nested too deeply to read (over ~1000 levels)") from None
    if not isinstance(raw, dict):
        raise PacktoolError(f"{path}: expected a mapping at the top level")
    _check_expansion(raw, str(path))
    raw = apply_overrides(_plain(raw), overrides)
    if output is not None:
        raw["output"] = str(Path(output).resolve())
    if capacity is not None:
        raw["capacity"] = capacity
    if workers is not None:
        raw["workers"] = int(workers) if workers.isdigit() else workers
    if max_samples is not None and isinstance(raw.get("sources"), list):
        for item in raw["sources"]:
            if isinstance(item, dict):
                item["max_samples"] = max_samples
    return parse_config(raw, base_dir=path.resolve().parent, config_file=str(path))


# Anchors and aliases are allowed (a `train:` block shared by sources), but an alias is a reference:
# nine aliases of nine aliases of ... ("billion laughs") is a few lines that expand to 9**9 values
# once the config is copied, hashed or written to the manifest. A real config has tens of values.
MAX_CONFIG_VALUES = 100_000
# The YAML parser reads ~1 MB a second: a 10 MB string in a config took 10 s before any check.
MAX_CONFIG_BYTES = 1 << 20


def _check_expansion(raw: Any, where: str) -> None:
    """Raise when the config, with every alias written out, holds more than MAX_CONFIG_VALUES values
    or refers to itself. Each distinct mapping or list is counted once, so this takes linear time."""
    sizes: dict[int, int] = {}  # id of a mapping or list -> its expanded size; -1 while it is being counted

    def expanded(value: Any, depth: int) -> int:
        if not isinstance(value, dict | list):
            return 1
        known = sizes.get(id(value))
        if known == -1:
            raise PacktoolError(f"{where}: an alias refers to a mapping or list that holds it; write the values out")
        if known is not None:
            return known
        if depth > 200:
            raise PacktoolError(f"{where}: nested deeper than 200 levels; a build config has a few")
        sizes[id(value)] = -1
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for item in items:
            total += expanded(item, depth + 1)
            if total > MAX_CONFIG_VALUES:
                raise PacktoolError(
                    f"{where}: expands to more than {MAX_CONFIG_VALUES:,} values once its aliases are written "
                    "out (aliases of aliases, an alias bomb?); use fewer aliases or write the values out"
                )
        sizes[id(value)] = total
        return total

    expanded(raw, 0)


def _plain(value: Any) -> Any:
    """YAML dates and times as ISO strings: the config is hashed and written to the manifest as JSON."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """A copy of `raw` with `key.sub=value` settings applied (the `--set` option).

    Values are read as YAML scalars (`capacity=4096` is an integer, `on_error=skip` a string,
    `add_bos=null` unsets). `sources.NAME.field=value` addresses a source by its name:

        apply_overrides({"capacity": 2048, "sources": [{"name": "chat", "weight": 1}]},
                        ["capacity=4096", "sources.chat.weight=2", "packing.shuffle=false"])
        -> {"capacity": 4096, "sources": [{"name": "chat", "weight": 2}], "packing": {"shuffle": False}}
    """
    result = json.loads(json.dumps(raw, default=str))  # a deep copy; values are plain YAML data
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise PacktoolError(f"--set {override!r}: expected KEY=VALUE, e.g. capacity=4096 or sources.chat.weight=2")
        try:
            parsed = yaml.safe_load(text) if text.strip() else None
            _check_expansion(parsed, f"--set {override!r}")
            value = _plain(parsed)
        except (yaml.YAMLError, RecursionError):
            raise PacktoolError(f"--set {key}: value {text!r} is not a valid YAML value") from None
        *parents, last = key.split(".")
        node: Any = result
        walked: list[str] = []
        for part in parents:
            node = _child(node, part, key, walked)
            walked.append(part)
        if not isinstance(node, dict):
            raise PacktoolError(f"--set {key}: {'.'.join(walked)} is {node!r}, not a mapping")
        node[last] = value
    return result


def _child(node: Any, part: str, key: str, walked: list[str]) -> Any:
    """The mapping under `part` (created when absent); in `sources`, a source is found by its name."""
    if isinstance(node, list):
        names = [item.get("name") for item in node if isinstance(item, dict)]
        for item in node:
            if isinstance(item, dict) and item.get("name") == part:
                return item
        if part.isdigit() and int(part) < len(node):
            return node[int(part)]
        raise PacktoolError(f"--set {key}: no source named {part!r} (sources: {', '.join(map(str, names)) or 'none'})")
    if not isinstance(node, dict):
        raise PacktoolError(f"--set {key}: {'.'.join(walked)} is {node!r}, not a mapping")
    child = node.get(part)
    if child is None:
        child = node[part] = {}
    elif not isinstance(child, (dict, list)):
        where = ".".join([*walked, part])
        raise PacktoolError(
            f"--set {key}: {where} is {child!r}, not a mapping; set {where}=VALUE or write it as a mapping in the file"
        )
    return child


def parse_config(raw: dict[str, Any], *, base_dir: Path, config_file: str = "<config>") -> BuildConfig:
    """The config as sections, each parsed by its own function; every problem is collected, then raised at once.

    Sections are taken in the order their problems have always been listed in (the outcome and run keys
    interleave), and a key's default is its dataclass field's."""
    p = _Problems()
    outcome, run, encoding = Outcome(), Run(output=""), Encoding()  # the defaults
    p.unknown_keys(raw, TOP_KEYS, "", PEER_KEYS)
    sources = _parse_sources(raw, base_dir, p)
    tokenizer = _parse_tokenizer(p.take(raw, "tokenizer", str, "", required=True), base_dir, p)
    template = _parse_template(raw, base_dir, p)
    processor_raw = p.take(raw, "processor", str, "", field_default(BuildConfig, "processor"))
    processor = _parse_processor(processor_raw, tokenizer, base_dir, p)
    images = p.take(raw, "images", str, "", field_default(BuildConfig, "images"), choices=IMAGE_STORAGE)
    template_vars = _template_vars(
        p.take(raw, "template_vars", dict, "", field_default(BuildConfig, "template_vars")), p
    )
    capacity = p.take(raw, "capacity", int, "", None, required=True)
    p.number("capacity", capacity, 2, MAX_CAPACITY, "tokens per pack")
    output = _parse_output(raw, base_dir, p)
    truncation = _parse_truncation(raw, p)
    packing = _parse_packing(raw, p)
    overflow = _parse_overflow(raw, capacity, p)
    mixing_raw = p.take(raw, "mixing", dict, "", {})
    p.unknown_keys(mixing_raw, MIXING_KEYS, "mixing")
    mix_by = p.take(mixing_raw, "by", str, "mixing", Mixing().by, choices=("multiplier", "samples", "tokens"))
    seed = p.take(raw, "seed", int, "", field_default(BuildConfig, "seed"))
    p.check("seed", seed_problem(seed))
    shards = _parse_shards(raw, p)

    # taken in the order the problems have always been reported in
    max_reject_share = p.take(raw, "max_reject_share", float, "", outcome.max_reject_share)
    p.number("max_reject_share", max_reject_share, 0.0, 1.0, "the share of a source's records it may lose")
    on_quota_miss = p.take(raw, "on_quota_miss", str, "", outcome.on_quota_miss, choices=QUOTA_MISS_POLICIES)
    executor = p.take(raw, "executor", str, "", run.executor, choices=EXECUTORS)
    ray_address = p.take(raw, "ray_address", str, "", run.ray_address)
    if ray_address is not None and executor != "ray" and raw.get("executor", executor) == executor:
        p.add("ray_address", f"only used with executor: ray (executor is {executor!r})")
    cache_raw = p.take(raw, "cache", str, "", run.cache)
    render = p.take(raw, "render", str, "", run.render, choices=RENDER_MODES)
    max_record_bytes = p.take(raw, "max_record_bytes", int, "", encoding.max_record_bytes)
    p.number("max_record_bytes", max_record_bytes, 1024, MAX_RECORD_BYTES, "bytes of one record as stored")
    sources = tuple(replace(source, max_record_bytes=max_record_bytes) for source in sources)
    validation = _validation(raw.get("validation"), p)
    on_error = p.take(raw, "on_error", str, "", outcome.on_error, choices=ERROR_POLICIES)
    workers = _workers(p.take(raw, "workers", (int, str), "", run.workers), p)
    dedup = p.take(raw, "dedup", str, "", field_default(BuildConfig, "dedup"), choices=DEDUP_MODES)
    add_bos = p.take(raw, "add_bos", bool, "", encoding.add_bos)
    add_eos = p.take(raw, "add_eos", bool, "", encoding.add_eos)
    card = _parse_card(raw, p)

    config = BuildConfig(
        config_file=config_file,
        sources=sources,
        tokenizer=tokenizer,
        template=template,
        processor=processor,
        images=images,
        capacity=capacity or 0,
        run=Run(
            output=output,
            workers=workers,
            executor=executor,
            ray_address=ray_address,
            cache=str(_resolve(base_dir, cache_raw)) if cache_raw else None,
            render=render,
        ),
        template_vars=template_vars,
        encoding=Encoding(add_bos, add_eos, max_record_bytes),
        truncation=truncation,
        packing=packing,
        overflow=overflow,
        mixing=Mixing(mix_by, _interleave(mixing_raw, mix_by, sources, p)),
        validation=validation,
        shards=shards,
        seed=seed,
        dedup=dedup,
        outcome=Outcome(on_error, max_reject_share, on_quota_miss),
        decontamination=_parse_decontamination(raw, base_dir, p),
        card=card,
        # where and how fast a build runs does not change what it writes: none of it enters the manifest
        raw={k: v for k, v in raw.items() if k not in RUN_KEYS},
    )
    _check_together(config, p)
    if p.items:
        raise ConfigError(config_file, p.items)
    return config


def _parse_sources(raw: dict[str, Any], base_dir: Path, p: _Problems) -> tuple[SourceConfig, ...]:
    sources_raw = p.take(raw, "sources", list, "", [], required=True)
    sources = tuple(s for i, item in enumerate(sources_raw) if (s := _parse_source(item, i, base_dir, p)))
    names = [s.name for s in sources]
    for name in {n for n in names if names.count(n) > 1}:
        p.add("sources", f"source name {name!r} is used more than once")
    return sources


def _parse_template(raw: dict[str, Any], base_dir: Path, p: _Problems) -> str:
    """`template`: model, model:NAME, a bundled name, or a .jinja file (resolved against the config's folder)."""
    template = p.take(raw, "template", str, "", field_default(BuildConfig, "template"))
    named = template.startswith(f"{MODEL_TEMPLATE}:")
    if named and not template.removeprefix(f"{MODEL_TEMPLATE}:").strip():
        p.add("template", f"{template!r} names no template; write model:NAME (e.g. model:tool_use) or model")
    elif not named and template.endswith(".jinja"):
        template_path = _resolve(base_dir, template)
        if not template_path.is_file():
            p.add("template", f"file not found: {template_path}")
        template = str(template_path)
    return template


def _parse_output(raw: dict[str, Any], base_dir: Path, p: _Problems) -> str:
    output_raw = p.take(raw, "output", str, "", None, required=True)
    output = str(_resolve(base_dir, output_raw)) if output_raw else ""
    if output:
        _check_output(Path(output), p)
    return output


def _parse_truncation(raw: dict[str, Any], p: _Problems) -> Truncation:
    """`truncation`: a strategy name, or {strategy, fallback, items}."""
    default = Truncation()
    value = raw.get("truncation", default.strategy)
    if isinstance(value, str):
        return Truncation(p.take(raw, "truncation", str, "", default.strategy, choices=TRUNCATION_STRATEGIES))
    if not isinstance(value, dict):
        p.add("truncation", f"expected a strategy name or a mapping, got {value!r}")
        return default
    p.unknown_keys(value, TRUNCATION_KEYS, "truncation")
    items = p.take(value, "items", str, "truncation", default.items, choices=ITEM_TRUNCATION)
    strategy = p.take(value, "strategy", str, "truncation", default.strategy, choices=TRUNCATION_STRATEGIES)
    fallback = p.take(value, "fallback", str, "truncation", default.fallback, choices=TRUNCATION_STRATEGIES)
    if fallback == "turns":
        p.add("truncation.fallback", "'turns' cannot be a fallback: it runs when removing whole turns was not enough")
    return Truncation(strategy, fallback, items)


def _parse_packing(raw: dict[str, Any], p: _Problems) -> Packing:
    """`packing`: a strategy name, or {strategy, max_segments, shuffle, group_by, balance_vision}."""
    default = Packing()
    value = raw.get("packing", default.strategy)
    if isinstance(value, str):
        return Packing(p.take(raw, "packing", str, "", default.strategy, choices=PACKING_STRATEGIES))
    if isinstance(value, bool):
        p.add(
            "packing",
            f"expected a strategy name ({', '.join(PACKING_STRATEGIES)}), got {value!r}; "
            "packtool always packs, choose how (bfd is the default)",
        )
        return default
    if not isinstance(value, dict):
        p.add("packing", f"expected a strategy name or a mapping, got {value!r}")
        return default
    p.unknown_keys(value, PACKING_KEYS, "packing")
    strategy = p.take(value, "strategy", str, "packing", default.strategy, choices=PACKING_STRATEGIES)
    max_segments = p.take(value, "max_segments", int, "packing", default.max_segments)
    p.number("packing.max_segments", max_segments, 1, MAX_CAPACITY, "documents per pack; null for no limit")
    shuffle = p.take(value, "shuffle", bool, "packing", default.shuffle)
    group_by = p.take(value, "group_by", str, "packing", default.group_by, choices=("source",))
    balance_vision = p.take(value, "balance_vision", bool, "packing", default.balance_vision)
    if balance_vision and strategy not in BALANCEABLE:
        p.add(
            "packing.balance_vision",
            f"balances the packs that bfd, ffd or histogram fill; {strategy} keeps its own order (set it to false)",
        )
    return Packing(strategy, max_segments, shuffle, group_by, balance_vision)


def _parse_overflow(raw: dict[str, Any], capacity: int | None, p: _Problems) -> Overflow:
    """`overflow`: a mode, or {mode, capacity}; a bucket's capacity defaults to 4x the packs' and must exceed it."""
    default = Overflow()
    value = raw.get("overflow", default.mode)
    mode, overflow_capacity = default.mode, default.capacity
    if isinstance(value, str):
        mode = p.take(raw, "overflow", str, "", default.mode, choices=OVERFLOW_MODES)
    elif isinstance(value, dict):
        p.unknown_keys(value, OVERFLOW_KEYS, "overflow")
        mode = p.take(value, "mode", str, "overflow", default.mode, choices=OVERFLOW_MODES)
        overflow_capacity = p.take(value, "capacity", int, "overflow", default.capacity)
        p.number("overflow.capacity", overflow_capacity, 2, 4 * MAX_CAPACITY, "tokens per overflow pack")
    else:
        p.add("overflow", f"expected 'truncate', 'bucket' or a mapping, got {value!r}")
    if mode == "bucket" and isinstance(capacity, int):
        if overflow_capacity is None:
            overflow_capacity = 4 * capacity
        elif overflow_capacity <= capacity:
            p.add("overflow.capacity", f"must exceed capacity {capacity}, got {overflow_capacity}")
    return Overflow(mode, overflow_capacity)


def _parse_shards(raw: dict[str, Any], p: _Problems) -> Shards:
    default = Shards()
    rows_per_shard = p.take(raw, "rows_per_shard", int, "", default.rows_per_shard)
    p.number("rows_per_shard", rows_per_shard, 1, 10_000_000, "packs per shard file")
    row_group_rows = p.take(raw, "row_group_rows", int, "", default.row_group_rows)
    p.number("row_group_rows", row_group_rows, 1, 10_000_000, "packs per Parquet row group, the unit a loader reads")
    return Shards(rows_per_shard, row_group_rows)


def _check_together(config: BuildConfig, p: _Problems) -> None:
    """Settings of different sections that cannot go together."""
    if config.packing.strategy == "stream" and config.overflow.mode == "bucket":
        p.add("overflow", "stream mode cuts documents into windows itself; an overflow bucket does not apply")
    if config.packing.strategy == "stream" and any(s.format != "text" for s in config.sources):
        p.add("packing", "'stream' (documents visible to each other) is only for format: text sources")
    if config.mixing.interleave is not None:
        _check_interleave(config, config.mixing.interleave.window, p)
    if config.images == "embed" and config.processor is None and config.raw.get("processor") is None:
        p.add(
            "images",
            "embed stores the images of a build with an image processor, and this config names none "
            "(processor:, or a tokenizer folder holding preprocessor_config.json)",
        )


def _template_vars(values: dict, p: _Problems) -> dict[str, Any]:
    for key in values:
        if not isinstance(key, str) or not key.isidentifier():
            p.add(f"template_vars.{key}", "must be a name a template can use (letters, digits, _)")
    date = values.get("date")
    if date is not None:
        try:
            datetime.date.fromisoformat(str(date))
        except ValueError:
            p.add("template_vars.date", f"expected an ISO date like 2026-01-01, got {date!r}")
    if values.get("date_string") is not None and not isinstance(values["date_string"], str):
        p.add("template_vars.date_string", f"expected a string, got {values['date_string']!r}")
    return values


def _interleave(mixing: dict, mix_by: str, sources: tuple[SourceConfig, ...], p: _Problems) -> Interleaving | None:
    """`mixing.interleave: {window: K, tolerance: 0.05, unit: tokens}`; the unit defaults to the one the mix is
    stated in: mixing.by samples or tokens, else the quotas' one unit, else tokens."""
    raw = p.take(mixing, "interleave", dict, "mixing", None)
    if raw is None:
        return None
    p.unknown_keys(raw, INTERLEAVE_KEYS, "mixing.interleave")
    window = p.take(raw, "window", int, "mixing.interleave", None, required=True)
    p.number("mixing.interleave.window", window, 1, 10_000_000, "packs per window")
    tolerance = p.take(raw, "tolerance", float, "mixing.interleave", DEFAULT_INTERLEAVE_TOLERANCE)
    p.number("mixing.interleave.tolerance", tolerance, 0.0, 1.0, "the largest gap between a window's share and the mix")
    quota_units = {s.plan.quota.unit for s in sources if s.plan.quota is not None}
    stated = mix_by if mix_by != "multiplier" else next(iter(quota_units)) if len(quota_units) == 1 else "tokens"
    unit = p.take(raw, "unit", str, "mixing.interleave", stated, choices=MIX_UNITS)
    return Interleaving(window, tolerance, unit) if window is not None and window >= 1 else None


def _check_interleave(config: BuildConfig, window: int, p: _Problems) -> None:
    """What interleaving needs: packs it may reorder, and row groups the loader can shuffle whole windows inside."""
    if config.packing.strategy in ("stream", "sequential"):
        p.add(
            "mixing.interleave",
            f"packing {config.packing.strategy!r} keeps its own pack order; use bfd, ffd or histogram",
        )
    items = [s.name for s in config.sources if s.format in ITEM_FORMATS]
    if items:
        p.add("mixing.interleave", f"not available with pair or group sources ({', '.join(items)})")
    for key, rows in (
        ("row_group_rows", config.shards.row_group_rows),
        ("rows_per_shard", config.shards.rows_per_shard),
    ):
        if rows % window:
            fit = max(window, rows // window * window)
            p.add(
                "mixing.interleave.window",
                f"{window} must divide {key} {rows} (the loader shuffles whole windows inside a row group); "
                f"set {key}: {fit}",
            )


def _validation(value: Any, p: _Problems) -> Validation:
    """`validation: {share: 0.01}` or `{samples: 500}`: exactly one of the two."""
    if value is None:
        return Validation()
    if not isinstance(value, dict) or len(value) != 1 or not set(value) <= VALIDATION_KEYS:
        p.add("validation", f"expected {{share: 0.01}} or {{samples: 500}}, got {value!r}")
        return Validation()
    default = Validation()
    share = p.take(value, "share", float, "validation", default.share)
    p.number("validation.share", share, 1e-9, 0.5, "the share of records held out; above half is not a validation set")
    samples = p.take(value, "samples", int, "validation", default.samples)
    p.number("validation.samples", samples, 1, 10**12, "records held out")
    return Validation(share, samples)


def _parse_card(raw: dict[str, Any], p: _Problems) -> Card:
    """`card: {license, pretty_name, description, language, tags, source_datasets}`: texts and lists of texts."""
    default = Card()
    value = p.take(raw, "card", dict, "", {})
    p.unknown_keys(value, CARD_KEYS, "card")
    texts = {key: p.take(value, key, str, "card", getattr(default, key)) for key in CARD_TEXTS}
    lists: dict[str, tuple[str, ...]] = {}
    for key in CARD_LISTS:
        items = p.take(value, key, list, "card", list(getattr(default, key)))
        lists[key] = tuple(item for item in items if isinstance(item, str) and item.strip())
        if len(lists[key]) != len(items):
            p.add(f"card.{key}", f"expected a list of non-empty strings, got {items!r}")
    return Card(
        license=texts["license"],
        pretty_name=texts["pretty_name"],
        description=texts["description"],
        language=lists["language"],
        tags=lists["tags"],
        source_datasets=lists["source_datasets"],
    )


def _parse_decontamination(raw: dict[str, Any], base_dir: Path, p: _Problems) -> Decontamination | None:
    """`decontamination: {against: [EVAL, ...], ngram, min_line_words, action, prompt_action, fields}`; EVAL is any
    input a source reads (a file, a glob, a datasets folder, ORG/NAME in the local hub cache)."""
    value = p.take(raw, "decontamination", dict, "", None)
    if value is None:
        return None
    where = "decontamination"
    p.unknown_keys(value, DECONTAMINATION_KEYS, where)
    against = value.get("against")
    patterns = (against,) if isinstance(against, str) else against
    if not isinstance(patterns, list | tuple) or not patterns or not all(isinstance(x, str) for x in patterns):
        p.add(f"{where}.against", "is required: an eval file, a glob, or a list of them")
        patterns = ()
    files = _expand(tuple(patterns), base_dir, where, p, None, None, key="against")
    default = Decontamination((), {})
    ngram = p.take(value, "ngram", int, where, default.ngram)
    p.number(f"{where}.ngram", ngram, 2, 64, "words per window")
    # Left out, it follows a smaller ngram down: a 4-word window cannot ask for 6-word lines.
    min_words = p.take(value, "min_line_words", int, where, min(default.min_line_words, ngram))
    p.number(f"{where}.min_line_words", min_words, 1, ngram, f"words of a short eval string, up to ngram ({ngram})")
    action = p.take(value, "action", str, where, default.action, choices=DECONTAMINATION_ACTIONS)
    prompt_action = p.take(value, "prompt_action", str, where, default.prompt_action, choices=DECONTAMINATION_ACTIONS)
    names = p.take(value, "fields", list, where, list(default.fields))
    if not all(isinstance(name, str) and name for name in names):
        p.add(f"{where}.fields", f"expected a list of field names, got {names!r}")
        names = []
    return Decontamination(tuple(files), files, ngram, min_words, action, prompt_action, tuple(names))


def decontamination_settings(against: list[str], base_dir: Path, **settings: Any) -> Decontamination:
    """A `decontamination:` section given on the command line (`packtool decontaminate`), checked as in a config."""
    p = _Problems()
    section = _parse_decontamination({"decontamination": {"against": against, **settings}}, base_dir, p)
    if p.items or section is None:
        raise ConfigError("the command line", p.items)
    return section


def _check_output(output: Path, p: _Problems) -> None:
    """An output must be a folder, or a path where one can be made (not a file, not under a file)."""
    if output.exists() and not output.is_dir():
        p.add("output", f"{output} is a file, not a folder; choose a folder path")
        return
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                p.add("output", f"{output} is under {parent}, which is a file, not a folder")
            return


def _workers(value: int | str, p: _Problems) -> int:
    workers = count_workers(value)
    if workers is None:
        p.add("workers", f"expected {WORKERS_CHOICES}, got {value!r}")
        return 1
    return workers


def _resolve(base_dir: Path, value: str) -> Path:
    candidate = Path(value).expanduser()
    return candidate if candidate.is_absolute() else base_dir / candidate


def _expand(
    patterns: tuple[str, ...],
    base_dir: Path,
    where: str,
    p: _Problems,
    split: str | None,
    revision: str | None,
    *,
    key: str = "path",
) -> dict[str, str]:
    """Resolved file -> its label: the path as globbed, relative to the config's folder when the pattern was.

    A `save_to_disk` folder stands for its .arrow files (of `split`); a pattern that matches
    nothing here but reads `ORG/NAME` is a dataset in the local Hugging Face cache (label `ORG/NAME/file`).
    """
    files: dict[str, str] = {}
    prefix = str(base_dir).rstrip(os.sep) + os.sep
    for pattern in patterns:
        matched = sorted(glob.glob(str(_resolve(base_dir, pattern)), recursive=True))
        relative = not Path(pattern).expanduser().is_absolute()
        try:
            if not matched and hub.is_repo_id(pattern):
                if _reads_as_a_local_file(base_dir, pattern) and not hub.in_cache(pattern, "datasets"):
                    p.add(f"{where}.{key}", f"no file matches {pattern!r} (relative to {base_dir})")
                    continue
                root = hub.snapshot(pattern, "datasets", revision)
                name = pattern.split("@", 1)[0]
                for file in hub.dataset_repo_files(root, split):
                    files.setdefault(str(file), f"{name}/{file.relative_to(root).as_posix()}")
                continue
            if not matched:
                p.add(f"{where}.{key}", f"no file matches {pattern!r} (relative to {base_dir})")
            for path in matched:
                label = path[len(prefix) :] if relative and path.startswith(prefix) else path
                if not Path(path).is_dir():
                    files.setdefault(path, label)
                    continue
                saved = hub.saved_dataset_files(Path(path), split)
                if saved is None:
                    p.add(
                        f"{where}.{key}",
                        f"{path} is a folder but not a saved dataset; give its files (e.g. {label}/*.jsonl)",
                    )
                    continue
                for file in saved:
                    files.setdefault(str(file), f"{label}/{file.relative_to(path).as_posix()}")
        except HubError as exc:
            p.add(f"{where}.{key}", str(exc))
    return files


def _reads_as_a_local_file(base_dir: Path, pattern: str) -> bool:
    """`ap/docs.jsonl` reads as ORG/NAME too: a data file's suffix, or a folder `ap` here, says it is a path."""
    return pattern.endswith(hub.DATA_SUFFIXES) or _resolve(base_dir, pattern).parent.is_dir()


def _parse_source(item: Any, index: int, base_dir: Path, p: _Problems) -> SourceConfig | None:
    where = f"sources[{index}]"
    if not isinstance(item, dict):
        p.add(where, f"expected a mapping, got {item!r}")
        return None
    p.unknown_keys(item, SOURCE_KEYS, where, SOURCE_PEER_KEYS)
    name = p.take(item, "name", str, where, f"source{index}")
    if ":" in name:
        p.add(f"{where}.name", f"{name!r}: a source name cannot contain ':' (it separates the parts of sample ids)")
    fmt = p.take(item, "format", str, where, None, required=True, choices=FORMATS)
    patterns_raw = item.get("path")
    if isinstance(patterns_raw, str):
        patterns: tuple[str, ...] = (patterns_raw,)
    elif isinstance(patterns_raw, list) and patterns_raw and all(isinstance(x, str) for x in patterns_raw):
        patterns = tuple(patterns_raw)
    else:
        p.add(f"{where}.path", "is required: a file, a glob, or a list of them")
        patterns = ()
    split = p.take(item, "split", str, where, None)
    files = _expand(patterns, base_dir, where, p, split, p.take(item, "revision", str, where, None))
    max_samples = p.take(item, "max_samples", int, where, field_default(SourceConfig, "max_samples"))
    p.number(f"{where}.max_samples", max_samples, 1, 10**15, "records read from this source; null reads all")

    fields_raw = p.take(item, "fields", dict, where, {})
    mapping = dict(DEFAULT_FIELDS.get(fmt or "", {}))
    for key, value in fields_raw.items():
        if key not in mapping:
            hint = _did_you_mean(str(key), list(mapping), {})
            p.add(f"{where}.fields.{key}", f"unknown field for format {fmt!r}{hint} (allowed: {', '.join(mapping)})")
        elif value is not None and not isinstance(value, str):
            p.add(f"{where}.fields.{key}", f"expected a column name, got {value!r}")
        else:
            mapping[key] = value

    role_map = dict(DEFAULT_SHAREGPT_ROLES) if fmt in ("sharegpt", "preference") else {}
    for key, value in p.take(item, "role_map", dict, where, {}).items():
        if value not in ("system", "user", "assistant", "tool", "function_call"):
            p.add(f"{where}.role_map.{key}", f"maps to unknown role {value!r}")
        role_map[str(key)] = value

    train_raw = p.take(item, "train", dict, where, {})
    p.unknown_keys(train_raw, TRAIN_KEYS, f"{where}.train")
    policy = TrainPolicy()
    roles = p.take(train_raw, "roles", list, f"{where}.train", list(policy.roles))
    for role in roles:
        if role == "tool":
            p.add(f"{where}.train.roles", "tool results are never trained (they are the environment's words)")
        elif role not in ("system", "user", "assistant"):
            p.add(f"{where}.train.roles", f"unknown role {role!r}")
    train = TrainPolicy(
        roles=tuple(roles),
        turns=p.take(train_raw, "turns", str, f"{where}.train", policy.turns, choices=("all", "last")),
        end_of_turn=p.take(train_raw, "end_of_turn", bool, f"{where}.train", policy.end_of_turn),
        tool_calls=p.take(train_raw, "tool_calls", bool, f"{where}.train", policy.tool_calls),
    )
    plan = SourcePlan()
    weight = p.take(item, "weight", float, where, plan.weight)
    if weight is not None and not (math.isfinite(weight) and weight > 0):
        p.add(f"{where}.weight", f"must be a positive finite number, got {weight}")
    system = p.take(item, "system", str, where, field_default(SourceConfig, "system"))
    if system is not None and fmt == "text":
        p.add(f"{where}.system", "format: text has no conversation to put a system prompt in; remove it")
    quota = _parse_quota(item, where, p)
    image_root_raw = p.take(item, "image_root", str, where, field_default(SourceConfig, "image_root"))
    image_root = _parse_image_root(image_root_raw, fmt, base_dir, where, p)
    # taken in the order the problems have always been reported in
    special_tokens = field_default(SourceConfig, "special_tokens")
    special_tokens = p.take(item, "special_tokens", str, where, special_tokens, choices=SPECIAL_TOKEN_POLICIES)
    truncation = p.take(item, "truncation", str, where, plan.truncation, choices=TRUNCATION_STRATEGIES)
    group = p.take(item, "group", str, where, plan.group)
    dedup = p.take(item, "dedup", str, where, plan.dedup, choices=DEDUP_MODES)
    return SourceConfig(
        name=name,
        paths=tuple(files),
        patterns=patterns,
        format=fmt or "messages",
        fields=mapping,
        role_map=role_map,
        train=train,
        special_tokens=special_tokens,
        max_samples=max_samples,
        system=system,
        image_root=image_root,
        labels=files,
        plan=SourcePlan(weight, truncation, group, dedup, quota),
    )


def _parse_quota(item: dict, where: str, p: _Problems) -> Quota | None:
    """`quota: {target_tokens: 2_000_000}` (or `tokens:`): one unit, a positive integer, no weight beside it."""
    raw = p.take(item, "quota", dict, where, None)
    if raw is None:
        return None
    p.unknown_keys(raw, set(QUOTA_UNITS), f"{where}.quota")
    units = [unit for unit in QUOTA_UNITS if unit in raw]
    if len(units) != 1:
        p.add(f"{where}.quota", f"give exactly one of {', '.join(QUOTA_UNITS)}, e.g. quota: {{target_tokens: 2000000}}")
        return None
    amount = p.take(raw, units[0], int, f"{where}.quota", None, required=True)
    p.number(f"{where}.quota.{units[0]}", amount, 1, 10**15, "tokens this source contributes")
    if "weight" in item:
        p.add(f"{where}.weight", "a source with a quota takes as many copies as the quota needs; remove weight")
    return Quota(units[0], amount) if isinstance(amount, int) and amount >= 1 else None


def _parse_tokenizer(value: str | None, base_dir: Path, p: _Problems) -> TokenizerConfig:
    """A tokenizer.json, a folder holding one, or a model id (`ORG/NAME[@revision]`) in the local hub cache."""
    if value is None:
        return TokenizerConfig(path="", config_path=None)
    target = _resolve(base_dir, value)
    if not target.exists() and hub.is_repo_id(value):
        try:
            target = hub.snapshot(value, "models")
        except HubError as exc:
            p.add("tokenizer", f"not found: {target}; {exc}")
            return TokenizerConfig(str(target), None)
    if target.is_dir():
        tokenizer_file = target / "tokenizer.json"
        if not tokenizer_file.is_file():
            p.add("tokenizer", f"folder {target} has no tokenizer.json")
        config_file = target / "tokenizer_config.json"
        config_path = str(config_file) if config_file.is_file() else None
    elif target.is_file() and target.name != "tokenizer.json" and (target.parent / "tokenizer.json").is_file():
        # tokenizer_config.json, config.json, a template: the folder was meant
        p.add("tokenizer", f"{target} is not a tokenizer.json; give its folder {target.parent} or its tokenizer.json")
        return TokenizerConfig(str(target), None)
    elif target.is_file():
        tokenizer_file = target
        sibling = target.parent / "tokenizer_config.json"
        config_path = str(sibling) if sibling.is_file() else None
    else:
        p.add("tokenizer", f"not found: {target}")
        return TokenizerConfig(str(target), None)
    if config_path:
        _check_tokenizer_config(Path(config_path), p)
    return TokenizerConfig(str(tokenizer_file), config_path)


def _parse_processor(value: str | None, tokenizer: TokenizerConfig, base_dir: Path, p: _Problems) -> str | None:
    """`processor`: a folder holding preprocessor_config.json, or that file, read and checked now; absent, the
    tokenizer's folder when it holds one packtool reads. A tokenizer folder whose processor packtool does not
    read (another family, a malformed file) leaves it unset rather than refusing a text build: its records with
    images are rejected, and `processor:` naming the folder says why."""
    if value is None:
        folder = Path(tokenizer.path).parent
        if not tokenizer.path or not (folder / PREPROCESSOR_CONFIG).is_file():
            return None
        try:
            load_processor(folder)
        except ConfigError:
            return None
        return str(folder)
    target = _resolve(base_dir, value)
    folder = target.parent if target.name == PREPROCESSOR_CONFIG else target
    if not target.exists():
        p.add("processor", f"not found: {target}")
        return None
    if not (folder / PREPROCESSOR_CONFIG).is_file():
        p.add("processor", f"{target} is not a preprocessor_config.json nor a folder holding one")
        return None
    try:
        load_processor(folder)
    except ConfigError as error:
        p.add("processor", str(error))
        return None
    return str(folder)


def _parse_image_root(value: str | None, fmt: str | None, base_dir: Path, where: str, p: _Problems) -> str | None:
    """`image_root`: the folder a source's relative image paths are resolved against (by default the data file's)."""
    if value is None:
        return None
    folder = _resolve(base_dir, value)
    if fmt == "text":
        p.add(f"{where}.image_root", "format: text has no images; remove it")
    elif not folder.is_dir():
        p.add(f"{where}.image_root", f"not a folder: {folder}")
    return str(folder)


def _check_tokenizer_config(path: Path, p: _Problems) -> None:
    """tokenizer_config.json is read after the config; a broken one must fail here, before any work."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        p.add("tokenizer", f"{path} is not valid JSON: {exc}")
        return
    if not isinstance(value, dict):
        p.add("tokenizer", f"{path}: expected a JSON object, got {type(value).__name__}")
    elif value.get("chat_template") is not None and not isinstance(value["chat_template"], (str, list)):
        p.add("tokenizer", f"{path}: chat_template must be a string or a list of named templates")


def bundled_folder(kind: str) -> Traversable:
    """Where the configs or templates shipped with packtool are: inside the installed package, or at
    the top of a source checkout that runs without an install (PYTHONPATH=. python -m packtool)."""
    try:
        return resources.files(f"packtool.{kind}")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent / kind
        if checkout.is_dir():
            return checkout
        raise PacktoolError(f"packtool's bundled {kind} are missing: reinstall packtool (pip install .)") from None


def bundled_configs() -> list[str]:
    folder = bundled_folder("configs")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(value: str | Path) -> Path:
    """A config file path, or the name of a config shipped with packtool (`quickstart`)."""
    path = Path(value)
    if path.is_file() or path.suffix in (".yaml", ".yml"):
        return path
    bundled = bundled_folder("configs") / f"{value}.yaml"
    if bundled.is_file():
        return Path(str(bundled))
    raise PacktoolError(f"{value}: no such config file, and not a bundled config ({', '.join(bundled_configs())})")
