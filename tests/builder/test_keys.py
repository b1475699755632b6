"""Every config setting is covered by a key, so a changed setting never reuses stale work.

    encode   the token cache key of every encode item (what render and tokenize read); the plan
             key holds the encode keys, so it moves too
    plan     the plan key alone (truncation, mixing, packing, shard layout: the bytes, not the samples)
    run      where and how a build runs, never its bytes: neither key moves

Each setting a config can hold (`packtool.config.KEYS`) has a row below with another valid value,
and the test proves the row: the value is set with `--set`, as a user would, and exactly the keys
the row names move. A setting added to the config without a row fails
`test_every_setting_has_a_row`: decide which key covers it, put it there, then add the row.

Keys hash whole parts of the config (`packtool.config.KEYED_BY`): a setting lands in a section, and
`test_a_setting_lands_only_in_parts_its_key_hashes` fails when it lands in a part no key hashes (or
in a part of another key than its row says); a new part of BuildConfig fails until KEYED_BY places it.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from support import QUICKSTART

from packtool.builder import _encode_items
from packtool.builder.cache import PACKAGE, TokenCache, code_fingerprint, package_sources, source_settings
from packtool.builder.plan import plan_key, plan_settings
from packtool.builder.stages import stages_for
from packtool.config import KEYED_BY, KEYS, SOURCE_FILES, BuildConfig, SourceConfig, load_config

CONFIG = QUICKSTART.parent / "quickstart.yaml"
DATA_PACKAGES = (
    "packtool.templates",
    "packtool.configs",
    "packtool.configs.quickstart",
    "packtool.configs.quickstart.tokenizer",
)
# setting -> (covering key, the value `--set` gives it); chat is the quickstart's messages source,
# docs its text source. Values naming a file are filled in by `_override`.
ROWS: dict[str, tuple[str, str]] = {
    "tokenizer": ("encode", "{tokenizer}"),
    "template": ("encode", "chatml"),
    "template_vars": ("encode", "{enable_thinking: false}"),
    "processor": ("encode", "{processor}"),  # by the content of its files (tests/vision/test_build_config.py)
    "add_bos": ("encode", "true"),
    "add_eos": ("encode", "false"),
    "max_record_bytes": ("encode", "65536"),  # which records are read at all
    "capacity": ("plan", "2048"),
    "truncation.strategy": ("plan", "left"),
    "truncation.fallback": ("plan", "drop"),
    "truncation.items": ("encode-items", "drop"),  # pairs and groups are cut while encoding
    "packing.strategy": ("plan", "ffd"),
    "packing.max_segments": ("plan", "4"),
    "packing.shuffle": ("plan", "false"),
    "packing.group_by": ("plan", "source"),
    "packing.balance_vision": ("plan", "true"),  # keyed even where no image is placed (a text build: the same shards)
    "overflow.mode": ("plan", "bucket"),
    "overflow.capacity": ("plan", "4096"),
    "mixing.by": ("plan", "tokens"),
    "mixing.interleave.window": ("plan", "8"),
    "mixing.interleave.tolerance": ("plan", "0.1"),
    "mixing.interleave.unit": ("plan", "samples"),
    "images": ("plan", "embed"),  # how shards hold the images: not what is encoded
    "seed": ("plan", "7"),
    "rows_per_shard": ("plan", "50"),
    "row_group_rows": ("plan", "16"),
    "dedup": ("plan", "exact"),
    "validation.share": ("plan", "0.1"),
    "validation.samples": ("plan", "3"),
    # the eval files by content and the settings (decontamination.EvalSet.key): which samples an encode keeps
    "decontamination.against": ("encode", str(QUICKSTART / "alpaca.jsonl")),
    "decontamination.ngram": ("encode", "10"),
    "decontamination.min_line_words": ("encode", "8"),
    "decontamination.action": ("encode", "report"),
    "decontamination.prompt_action": ("encode", "drop"),
    "decontamination.fields": ("encode", "[text]"),
    "output": ("run", "{tmp}/elsewhere"),
    "cache": ("run", "{tmp}/cache"),
    "workers": ("run", "2"),
    "executor": ("run", "serial"),
    "ray_address": ("run", "127.0.0.1:6379"),
    "render": ("run", "reference"),  # the render routes: every one gives the reference's bytes
    "on_error": ("run", "fail"),  # decides whether a build with rejects publishes, not what it writes
    "max_reject_share": ("run", "0.9"),  # a threshold on the outcome, like on_error
    "on_quota_miss": ("run", "fail"),  # whether a build short of a quota publishes, like on_error
    # the dataset card's words (OUT/README.md): written from the manifest after the shards, in no key
    "card.license": ("run", "mit"),
    "card.pretty_name": ("run", "Packs"),
    "card.description": ("run", "Words."),
    "card.language": ("run", "[en]"),
    "card.tags": ("run", "[sft]"),
    "card.source_datasets": ("run", "[org/data]"),
    "sources[].name": ("encode", "talk"),
    "sources[].path": ("encode", "{chat_copy}"),
    "sources[].format": ("encode", "sharegpt"),
    "sources[].fields": ("encode", "{messages: turns, id: id}"),
    "sources[].role_map": ("encode", "{bot: assistant}"),
    "sources[].train.roles": ("encode", "[assistant, user]"),
    "sources[].train.turns": ("encode", "last"),
    "sources[].train.end_of_turn": ("encode", "false"),
    "sources[].train.tool_calls": ("encode", "false"),
    "sources[].special_tokens": ("encode", "keep"),
    "sources[].max_samples": ("encode", "10"),
    "sources[].system": ("encode", "You are terse."),
    "sources[].image_root": ("encode", "{tmp}"),
    "sources[].weight": ("plan", "2"),
    "sources[].truncation": ("plan", "left"),
    "sources[].group": ("plan", "talk"),
    "sources[].dedup": ("plan", "exact"),
    "sources[].quota.target_tokens": ("plan", "1000"),
    "sources[].quota.tokens": ("plan", "1000"),
    # a hub dataset's split and revision choose which files `path` resolves to; the files' names and
    # sha256 are in the encode key (proven by sources[].path); a JSON Lines source refuses them
    "sources[].split": ("files", ""),
    "sources[].revision": ("files", ""),
}
MOVES = {"encode": (True, True), "plan": (False, True), "run": (False, False)}
# what a setting needs beside it, set on both sides of the comparison
NEEDS = {
    "ray_address": ["executor=ray"],
    "mixing.interleave.tolerance": ["mixing.interleave={window: 8}"],
    "mixing.interleave.unit": ["mixing.interleave={window: 8}"],
    "images": [f"processor={QUICKSTART.parent / 'quickstart_vision' / 'model'}"],  # embed needs a processor
    **{
        f"decontamination.{key}": [f"decontamination={{against: [{QUICKSTART / 'docs.jsonl'}]}}"]
        for key in ("against", "ngram", "min_line_words", "action", "prompt_action", "fields")
    },
}
BASE = ["packing={strategy: bfd}"]  # the quickstart's `packing: bfd`, written as a mapping to set its keys


def _settings() -> set[str]:
    """Every setting a config can hold; a mapping of settings (packing, sources[].train) is its keys."""
    return {
        name
        for group, keys in KEYS.items()
        for key in keys
        if (name := f"{group}.{key}" if group else key) not in KEYS and name != "sources"
    }


def test_every_setting_has_a_row():
    assert _settings() == set(ROWS)


def _override(setting: str, value: str, tmp_path: Path) -> str:
    if "{tokenizer}" in value:  # the same tokenizer in other bytes
        folder = tmp_path / "tokenizer"
        shutil.copytree(QUICKSTART / "tokenizer", folder)
        with (folder / "tokenizer.json").open("a") as handle:
            handle.write(" ")
        value = str(folder)
    if "{processor}" in value:  # a Qwen2-VL image processor
        folder = tmp_path / "processor"
        folder.mkdir()
        (folder / "preprocessor_config.json").write_text('{"processor_class": "Qwen2VLProcessor"}')
        value = str(folder)
    if "{chat_copy}" in value:  # the chat file less its last line
        copy = tmp_path / "chat.jsonl"
        copy.write_text("".join((QUICKSTART / "chat.jsonl").read_text().splitlines(keepends=True)[:-1]))
        value = str(copy)
    value = value.replace("{tmp}", str(tmp_path))
    key = setting.replace("sources[]", "sources.chat")
    if setting == "sources[].quota.tokens":
        return f"sources.chat.quota={{tokens: {value}}}"
    if setting == "sources[].quota.target_tokens":
        return f"sources.chat.quota={{target_tokens: {value}}}"
    return f"{key}={value}"


def _keys(config: BuildConfig, tmp_path: Path) -> tuple[list[str], str]:
    items = _encode_items(config, stages_for(config), TokenCache(tmp_path / "unused-cache"))
    keys = [item.key for item in items]
    return keys, plan_key(config, keys)


def _configs(setting: str, tmp_path: Path) -> tuple[BuildConfig, BuildConfig]:
    """The quickstart config, and the same with `setting` set to its row's value."""
    needs = [*BASE, *NEEDS.get(setting, [])]
    base = load_config(CONFIG, overrides=needs)
    return base, load_config(CONFIG, overrides=[*needs, _override(setting, ROWS[setting][1], tmp_path)])


@pytest.mark.parametrize("setting", sorted(s for s, (covered, _) in ROWS.items() if covered in MOVES))
def test_a_setting_moves_exactly_the_key_that_covers_it(tmp_path, setting):
    covered = ROWS[setting][0]
    base, changed = _configs(setting, tmp_path)
    (encode_before, plan_before), (encode_after, plan_after) = _keys(base, tmp_path), _keys(changed, tmp_path)
    assert (encode_before != encode_after, plan_before != plan_after) == MOVES[covered]


def test_item_truncation_is_in_the_encode_key_of_pair_sources_only(tmp_path):
    """Pairs and groups are fitted to the capacity while encoding (a segment alone cannot be cut), so their
    encode keys hold the capacity and the whole truncation section; other sources' keys hold neither."""
    config = load_config(CONFIG)
    chat = config.sources[0]
    pairs = replace(chat, format="preference")
    dropped = load_config(CONFIG, overrides=[_override("truncation.items", "drop", tmp_path)])
    assert source_settings(pairs, config) != source_settings(pairs, dropped)
    assert source_settings(chat, config) == source_settings(chat, dropped)


def test_split_and_revision_only_choose_files():
    """They pick a hub dataset's files while the config is read and are kept nowhere else, so the
    files' names and sha256 in the encode key (sources[].path) cover them."""
    kept = {f.name for f in fields(SourceConfig)}
    assert {"split", "revision"} & kept == set() and {"paths", "labels"} <= kept


def test_every_part_of_the_config_is_placed_under_a_key():
    """A part added to BuildConfig fails here until config.KEYED_BY says which key hashes it (or that none does)."""
    assert {f.name for f in fields(BuildConfig)} == set(KEYED_BY)
    assert set(KEYED_BY.values()) == {"content", "encode", "plan", "encode+plan", "none"}


# which parts of a config each row's key hashes (a source's fields by name: `sources[].NAME`)
ENCODE_SOURCE_FIELDS = {f"sources[].{f.name}" for f in fields(SourceConfig) if f.name != "plan"}
HASHED = {
    "encode": {p for p, k in KEYED_BY.items() if k in ("content", "encode")} | ENCODE_SOURCE_FIELDS,
    "encode-items": {"truncation"},  # a plan part that pairs' and groups' encode keys hold too
    "plan": {p for p, k in KEYED_BY.items() if k == "plan"} | {"sources[].plan"},
    "run": {p for p, k in KEYED_BY.items() if k == "none"},
}


def _changed_parts(base: BuildConfig, changed: BuildConfig) -> set[str]:
    """The parts of the config (a source's fields as `sources[].NAME`) that differ; raw is the text as written."""
    parts = {f.name for f in fields(BuildConfig) if f.name not in ("sources", "raw")}
    found = {name for name in parts if getattr(base, name) != getattr(changed, name)}
    for before, after in zip(base.sources, changed.sources, strict=True):
        differ = [f.name for f in fields(SourceConfig) if getattr(before, f.name) != getattr(after, f.name)]
        found |= {f"sources[].{name}" for name in differ}
    return found


@pytest.mark.parametrize("setting", sorted(s for s, (covered, _) in ROWS.items() if covered in HASHED))
def test_a_setting_lands_only_in_parts_its_key_hashes(tmp_path, setting):
    """A setting that lands in a part no key hashes (KEYED_BY: none) is allowed only as a run setting."""
    covered = ROWS[setting][0]
    parts = _changed_parts(*_configs(setting, tmp_path))
    assert parts, f"{setting} changed no part of the config"
    assert parts <= HASHED[covered], f"{setting} lands in {sorted(parts - HASHED[covered])}, not hashed by {covered}"


def _other(value: Any) -> Any:
    """A value unlike `value`, of no particular type: keys hash a section's data, whatever it holds."""
    return ("changed", value)


@pytest.mark.parametrize("part", sorted(p for p, k in KEYED_BY.items() if k == "plan"))
def test_every_field_of_a_plan_section_moves_the_plan_key(part):
    """Whole sections are hashed: a field added to one later is in the key without a word here."""
    config = load_config(CONFIG)
    section = getattr(config, part)
    variants = (
        [replace(section, **{f.name: _other(getattr(section, f.name))}) for f in fields(section)]
        if is_dataclass(section)
        else [_other(section)]
    )
    for variant in variants:
        assert plan_settings(replace(config, **{part: variant})) != plan_settings(config), (part, variant)
    source = config.sources[0]
    for f in fields(source.plan):
        moved = replace(source, plan=replace(source.plan, **{f.name: _other(getattr(source.plan, f.name))}))
        assert plan_settings(replace(config, sources=(moved, *config.sources[1:]))) != plan_settings(config), f.name


def test_every_encode_setting_moves_the_encode_key():
    """Each field of a source (but its files and plan section) and of the encoding section is hashed."""
    config = load_config(CONFIG)
    source = config.sources[0]
    for f in fields(source):
        if f.name in (*SOURCE_FILES, "plan"):
            continue
        moved = replace(source, **{f.name: _other(getattr(source, f.name))})
        assert source_settings(moved, config) != source_settings(source, config), f.name
    for f in fields(config.encoding):
        encoding = replace(config.encoding, **{f.name: _other(getattr(config.encoding, f.name))})
        assert source_settings(source, replace(config, encoding=encoding)) != source_settings(source, config), f.name


# -- the code: every module of the package, not a list kept by hand -----------------------------------------


def test_a_change_to_any_module_of_the_package_moves_every_encode_key(monkeypatch):
    """format.py's role codes decide stored bytes and were on no list; now no module can be left off one."""
    sources = package_sources()
    assert PACKAGE / "format.py" in sources and PACKAGE / "builder" / "encode.py" in sources
    code = {p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in ("templates", "configs")}
    assert code == set(sources)  # every module but the data packages' docstring-only __init__.py files
    base = code_fingerprint.__wrapped__()
    read = Path.read_bytes
    for changed in sources:
        with monkeypatch.context() as patched:
            patched.setattr(Path, "read_bytes", lambda path, one=changed: read(path) + b"\n" * (path == one))
            assert code_fingerprint.__wrapped__() != base, changed


def test_code_moved_between_modules_moves_the_key(monkeypatch):
    """The same bytes split otherwise between two modules are other code: each module is hashed with its path
    and length."""
    first, second = package_sources()[:2]
    base, read = code_fingerprint.__wrapped__(), Path.read_bytes
    moved = {first: read(first) + read(second)[:1], second: read(second)[1:]}
    monkeypatch.setattr(Path, "read_bytes", lambda path: moved.get(path) or read(path))
    assert code_fingerprint.__wrapped__() != base


def test_every_module_an_encode_imports_is_fingerprinted(tmp_path):
    config = load_config(CONFIG, output=str(tmp_path / "out"))
    _encode_items(config, stages_for(config), TokenCache(tmp_path / "cache"))
    imported = {m.__file__ for name, m in sys.modules.items() if name.split(".")[0] == "packtool" and m.__file__}
    # the folders of templates and configs hold only a docstring as code; a template enters a key by its content
    data = {name for name in DATA_PACKAGES if name in sys.modules}
    assert imported - {sys.modules[name].__file__ for name in data} <= {str(p) for p in package_sources()}


def test_an_installed_packtool_and_its_source_tree_have_one_fingerprint(tmp_path):
    """A regular install ships templates/ and configs/ as packages (an __init__.py each) where the source
    tree has none: counted, they gave a build run from the tree (PYTHONPATH, as tests and bench run it) and
    one run from the install two plan hashes, so two manifests for the same bytes."""
    import shutil
    import subprocess

    tree = tmp_path / "packtool"
    shutil.copytree(PACKAGE, tree, ignore=shutil.ignore_patterns("__pycache__", "templates", "configs"))
    installed = tmp_path / "installed"
    shutil.copytree(tree, installed / "packtool")
    for data in ("templates", "configs", "configs/quickstart"):
        (installed / "packtool" / data).mkdir(exist_ok=True)
        (installed / "packtool" / data / "__init__.py").write_text('"""Package data."""\n')
    fingerprint = "from packtool.builder.cache import PACKAGE, code_fingerprint; print(PACKAGE, code_fingerprint())"
    prints = [
        subprocess.run(
            [sys.executable, "-c", fingerprint],
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        ).stdout.split()
        for root in (tmp_path, installed)
    ]
    assert [package for package, _ in prints] == [str(tree), str(installed / "packtool")]  # each its own
    assert prints[0][1] == prints[1][1]
