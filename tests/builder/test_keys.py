"""Every config setting is covered by a key, so a changed setting never reuses stale work.

    encode   the token cache key of every encode item (what render and tokenize read); the plan
             key holds the encode keys, so it moves too
    plan     the plan key alone (truncation, mixing, packing, shard layout: the bytes, not the samples)
    run      where and how a build runs, never its bytes: neither key moves

Each setting a config can hold (`packtool.config.KEYS`) has a row below with another valid value,
and the test proves the row: the value is set with `--set`, as a user would, and exactly the keys
the row names move. A setting added to the config without a row fails
`test_every_setting_has_a_row`: decide which key covers it, put it there, then add the row.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import QUICKSTART

from packtool.builder import _encode_items
from packtool.builder.cache import TokenCache
from packtool.builder.encode import stages_for
from packtool.builder.plan import plan_key
from packtool.config import KEYS, BuildConfig, load_config

CONFIG = QUICKSTART.parent / "quickstart.yaml"
# setting -> (covering key, the value `--set` gives it); chat is the quickstart's messages source,
# docs its text source. Values naming a file are filled in by `_override`.
ROWS: dict[str, tuple[str, str]] = {
    "tokenizer": ("encode", "{tokenizer}"),
    "template": ("encode", "chatml"),
    "template_vars": ("encode", "{enable_thinking: false}"),
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
    "overflow.mode": ("plan", "bucket"),
    "overflow.capacity": ("plan", "4096"),
    "mixing.by": ("plan", "tokens"),
    "mixing.interleave.window": ("plan", "8"),
    "mixing.interleave.tolerance": ("plan", "0.1"),
    "mixing.interleave.unit": ("plan", "samples"),
    "seed": ("plan", "7"),
    "rows_per_shard": ("plan", "50"),
    "row_group_rows": ("plan", "16"),
    "dedup": ("plan", "exact"),
    "validation.share": ("plan", "0.1"),
    "validation.samples": ("plan", "3"),
    "output": ("run", "{tmp}/elsewhere"),
    "cache": ("run", "{tmp}/cache"),
    "workers": ("run", "2"),
    "executor": ("run", "serial"),
    "ray_address": ("run", "127.0.0.1:6379"),
    "on_error": ("run", "fail"),  # decides whether a build with rejects publishes, not what it writes
    "max_reject_share": ("run", "0.9"),  # a threshold on the outcome, like on_error
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


@pytest.mark.parametrize("setting", sorted(s for s, (covered, _) in ROWS.items() if covered in MOVES))
def test_a_setting_moves_exactly_the_key_that_covers_it(tmp_path, setting):
    covered, value = ROWS[setting]
    needs = [*BASE, *NEEDS.get(setting, [])]
    base = load_config(CONFIG, overrides=needs)
    changed = load_config(CONFIG, overrides=[*needs, _override(setting, value, tmp_path)])
    (encode_before, plan_before), (encode_after, plan_after) = _keys(base, tmp_path), _keys(changed, tmp_path)
    assert (encode_before != encode_after, plan_before != plan_after) == MOVES[covered]


def test_item_truncation_is_in_the_encode_key_of_pair_sources_only(tmp_path):
    """Pairs and groups are fitted to the capacity while encoding (a segment alone cannot be cut)."""
    from packtool.builder.cache import source_settings

    config = load_config(CONFIG)
    chat = config.sources[0]
    pairs = type(chat)(**{**{f: getattr(chat, f) for f in chat.__slots__}, "format": "preference"})
    dropped = load_config(CONFIG, overrides=[_override("truncation.items", "drop", tmp_path)])
    assert source_settings(pairs, config) != source_settings(pairs, dropped)
    assert source_settings(chat, config) == source_settings(chat, dropped)


def test_split_and_revision_only_choose_files():
    """They pick a hub dataset's files while the config is read and are kept nowhere else, so the
    files' names and sha256 in the encode key (sources[].path) cover them."""
    from dataclasses import fields

    from packtool.config import SourceConfig

    kept = {f.name for f in fields(SourceConfig)}
    assert {"split", "revision"} & kept == set() and {"paths", "labels"} <= kept
