from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
from dataclasses import MISSING, fields, replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import QUICKSTART

import packtool.config
from packtool.cli import main
from packtool.config import (
    BuildConfig,
    ConfigError,
    Encoding,
    Mixing,
    Outcome,
    Overflow,
    Packing,
    Run,
    Shards,
    SourceConfig,
    Truncation,
    Validation,
    apply_overrides,
    field_default,
    load_config,
    resolve_config_path,
)
from packtool.errors import PacktoolError
from packtool.format import read_manifest


def _base(tmp_path: Path) -> dict:
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    return {
        "sources": [{"name": "docs", "path": "data.jsonl", "format": "text"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": "out",
    }


def test_a_section_left_out_takes_its_dataclass_defaults(tmp_path, write_config):
    """Defaults are stated once, in the section dataclasses: the parser takes them from there."""
    config = load_config(write_config(_base(tmp_path)))
    sections = (Encoding, Truncation, Packing, Overflow, Mixing, Validation, Shards, Outcome)
    names = ("encoding", "truncation", "packing", "overflow", "mixing", "validation", "shards", "outcome")
    assert [getattr(config, name) for name in names] == [section() for section in sections]
    assert replace(config.run, output="") == Run(output="")  # workers: auto, the machine's cores, in Run too
    named = {"truncation": "left", "packing": "ffd", "overflow": "bucket"}  # a name alone keeps the other defaults
    config = load_config(write_config({**_base(tmp_path), **named}))
    assert (config.truncation, config.packing) == (Truncation("left"), Packing("ffd"))
    assert config.overflow == Overflow("bucket", 4 * config.capacity)


def _stated_defaults(section: type) -> dict:
    """Every field of a section dataclass that states a default, and that default."""
    stated = [f.name for f in fields(section) if f.default is not MISSING or f.default_factory is not MISSING]
    return {name: field_default(section, name) for name in stated}


def test_a_config_of_the_required_keys_alone_holds_every_stated_default(tmp_path, write_config):
    """Walks every field that states a default, of the config, its run and a source (nested sections compare
    whole): a key left out is exactly its dataclass's default. Not walked: what the parser always fills in
    (the config as written, a source's files)."""
    config = load_config(write_config(_base(tmp_path)))
    filled_in = {"raw", "labels"}
    for section, parsed in ((BuildConfig, config), (Run, config.run), (SourceConfig, config.sources[0])):
        for name, default in _stated_defaults(section).items():
            if name not in filled_in:
                assert getattr(parsed, name) == default, f"{section.__name__}.{name}"


# Where a literal fallback of a taken key is no second statement of a field's default: a required key has
# none, a mapping's keys take their own, and `split` and `revision` choose a source's files (no field holds them).
_NO_FIELD_DEFAULT = ("split", "revision")


def test_no_parser_writes_a_default_of_its_own():
    """A default is written once, in its section's dataclass: a literal fallback where the parser takes a key
    (`_Problems.take`, its fifth argument, None when left out) is a second statement of it that can drift."""
    written = []
    for node in ast.walk(ast.parse(inspect.getsource(packtool.config))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "take"):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        key, kind = node.args[1], node.args[2]
        default = node.args[4] if len(node.args) > 4 else keywords.get("default", ast.Constant(None))
        mapping = isinstance(kind, ast.Name) and kind.id == "dict"
        unfielded = isinstance(key, ast.Constant) and key.value in _NO_FIELD_DEFAULT
        literal = isinstance(default, ast.Constant | ast.List | ast.Tuple | ast.Dict | ast.Set)
        if literal and not (mapping or unfielded or "required" in keywords):
            written.append(f"config.py:{node.lineno}: {ast.unparse(node)}")
    assert written == [], "defaults written in the parser, not taken from the section's dataclass"


def test_loads_typed_settings_and_resolves_relative_paths(tmp_path, write_config):
    config = load_config(write_config(_base(tmp_path)))
    assert config.capacity == 64
    assert config.sources[0].paths == (str(tmp_path / "data.jsonl"),)
    assert config.run.output == str(tmp_path / "out")
    assert config.tokenizer.path.endswith("tokenizer.json")
    assert config.tokenizer.config_path and config.tokenizer.config_path.endswith("tokenizer_config.json")
    assert (
        config.packing.strategy == "bfd" and config.truncation.strategy == "right" and config.outcome.on_error == "fail"
    )


def test_every_problem_is_reported_at_once_with_its_yaml_path(tmp_path, write_config):
    raw = _base(tmp_path)
    raw["capacty"] = 10
    raw["capacity"] = "big"
    raw["sources"].append({"name": "chat", "path": "missing-*.jsonl", "format": "chatml", "weight": -1})
    raw["sources"][0]["fields"] = {"body": "text"}
    raw["tokenizer"] = "nowhere/tokenizer.json"
    raw["packing"] = {"strategy": "magic"}
    with pytest.raises(ConfigError) as info:
        load_config(write_config(raw))
    message = str(info.value)
    for expected in [
        "capacty: unknown key",
        "capacity: expected an integer",
        "sources[1].path: no file matches 'missing-*.jsonl'",
        "sources[1].format: 'chatml' is not one of",
        "sources[1].weight: must be a positive finite number",
        "sources[0].fields.body: unknown field",
        "tokenizer: not found",
        "packing.strategy: 'magic' is not one of",
    ]:
        assert expected in message
    assert len(info.value.problems) == 8


@pytest.mark.parametrize("file", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_tokenizer_pointing_at_another_file_of_its_folder_names_the_way_out(tmp_path, write_config, file):
    """A JSON parse error of tokenizer_config.json (read as a tokenizer) told nothing; the folder was meant."""
    folder = tmp_path / "tok"
    shutil.copytree(QUICKSTART / "tokenizer", folder)
    (folder / file).write_text((folder / file).read_text() if (folder / file).is_file() else "{}")
    raw = {**_base(tmp_path), "tokenizer": str(folder / file)}
    with pytest.raises(
        ConfigError, match=rf"tokenizer: {folder / file} is not a tokenizer.json; give its folder {folder} "
    ):
        load_config(write_config(raw))
    assert load_config(write_config({**raw, "tokenizer": str(folder)})).tokenizer.path == str(folder / "tokenizer.json")


def test_command_line_overrides(tmp_path, write_config):
    config = load_config(write_config(_base(tmp_path)), output=str(tmp_path / "elsewhere"), capacity=128)
    assert config.capacity == 128
    assert config.run.output == str(tmp_path / "elsewhere")


def test_stream_mode_is_only_for_text(tmp_path, write_config):
    raw = _base(tmp_path)
    (tmp_path / "chat.jsonl").write_text('{"messages": []}\n')
    raw["sources"].append({"name": "chat", "path": "chat.jsonl", "format": "messages"})
    raw["packing"] = "stream"
    with pytest.raises(ConfigError, match="only for format: text"):
        load_config(write_config(raw))


def test_tool_results_are_never_trained(tmp_path, write_config):
    raw = _base(tmp_path)
    raw["sources"][0]["train"] = {"roles": ["assistant", "tool"]}
    with pytest.raises(ConfigError, match="tool results are never trained"):
        load_config(write_config(raw))


def test_bundled_config_by_name_and_missing_file():
    assert resolve_config_path("quickstart").name == "quickstart.yaml"
    with pytest.raises(PacktoolError, match="not a bundled config"):
        resolve_config_path("nope")
    with pytest.raises(PacktoolError, match="config file not found"):
        load_config("nope.yaml")


SOURCE_TREE = """
import sys
sys.modules["packtool.configs"] = sys.modules["packtool.templates"] = None  # as in a checkout: no package data
from packtool.config import resolve_config_path
from packtool.chat_templates import bundled_templates, load_template
print(resolve_config_path("quickstart"))
print(" ".join(bundled_templates()), load_template("chatml", {}).name)
"""


def test_a_source_checkout_without_an_install_finds_the_bundled_files():
    """`PYTHONPATH=. python -m packtool build quickstart` from a clone: configs/ and templates/ sit at the
    top of the repository, not inside the package (a traceback before)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", SOURCE_TREE], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    config, templates = done.stdout.splitlines()
    assert Path(config) == root / "configs" / "quickstart.yaml"
    assert "chatml" in templates.split()[:-1] and templates.split()[-1] == "chatml"


def test_missing_bundled_files_are_one_line(monkeypatch):
    import packtool.config as config

    def no_package(name: str):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(config.resources, "files", no_package)
    monkeypatch.setattr(config, "__file__", "/nowhere/packtool/config.py")
    with pytest.raises(PacktoolError, match="bundled configs are missing: reinstall packtool"):
        resolve_config_path("quickstart")


def test_build_phase_keys_are_typed_and_validated(tmp_path, write_config):
    raw = _base(tmp_path)
    config = load_config(write_config(raw))
    assert config.run.executor == "processes" and config.run.cache is None and config.outcome.max_reject_share == 0.5
    assert config.run.workers >= 1 and config.validation.share is None and config.validation.samples is None
    raw |= {"executor": "ray", "ray_address": "127.0.0.1:6379", "cache": "tokens", "max_reject_share": 0}
    raw |= {"validation": {"samples": 50}, "workers": 3}
    raw["sources"][0]["max_samples"] = 10
    config = load_config(write_config(raw))
    assert (config.run.executor, config.run.ray_address, config.run.cache) == (
        "ray",
        "127.0.0.1:6379",
        str(tmp_path / "tokens"),
    )
    assert config.outcome.max_reject_share == 0.0 and config.validation.samples == 50 and config.run.workers == 3
    assert config.sources[0].max_samples == 10
    # where a build runs never changes what it writes, so it stays out of the hashed config
    assert not {"executor", "ray_address", "cache", "workers"} & set(config.raw)
    raw |= {"executor": "slurm", "max_reject_share": 1.5, "validation": {"share": 0.1, "samples": 3}}
    raw["sources"][0]["max_samples"] = 0
    with pytest.raises(ConfigError) as info:
        load_config(write_config(raw))
    assert [p.split(":")[0] for p in info.value.problems] == [
        "sources[0].max_samples",
        "max_reject_share",
        "executor",
        "validation",
    ]


def test_overrides_set_nested_keys_and_sources_by_name():
    raw = {"capacity": 2048, "packing": {"strategy": "bfd"}, "sources": [{"name": "chat", "weight": 1}]}
    out = apply_overrides(
        raw,
        ["capacity=4096", "sources.chat.weight=2.5", "packing.shuffle=false", "on_error=skip", "seed=", "x.y=[1, 2]"],
    )
    assert out == {
        "capacity": 4096,
        "packing": {"strategy": "bfd", "shuffle": False},
        "sources": [{"name": "chat", "weight": 2.5}],
        "on_error": "skip",
        "seed": None,
        "x": {"y": [1, 2]},
    }
    assert raw["capacity"] == 2048  # the input is not modified
    for bad, message in [
        ("capacity", "expected KEY=VALUE"),
        ("sources.nope.weight=2", "--set sources.nope.weight: no source named 'nope' (sources: chat)"),
        ("capacity.max=3", "--set capacity.max: capacity is 2048, not a mapping"),
        ("packing=[", "--set packing: value '[' is not a valid YAML value"),
    ]:
        with pytest.raises(PacktoolError, match=re.escape(message)):
            apply_overrides(raw, [bad])


def test_overrides_and_max_samples_are_validated_like_the_file(tmp_path, write_config):
    path = write_config(_base(tmp_path))
    config = load_config(path, overrides=["capacity=128", "sources.docs.weight=3"], max_samples=5)
    assert config.capacity == 128 and config.sources[0].plan.weight == 3.0 and config.sources[0].max_samples == 5
    with pytest.raises(ConfigError, match=r"capacity: must be between 2 and 1,048,576"):
        load_config(path, overrides=["capacity=0"])
    with pytest.raises(ConfigError, match=r"sources\[0\].wieght: unknown key; did you mean 'weight'\?"):
        load_config(path, overrides=["sources.docs.wieght=2"])


@pytest.mark.parametrize(
    ("setting", "hinted"), [("capacity=1e3", True), ("sources.docs.weight=2e-1", True), ("seed=nan", False)]
)
def test_scientific_notation_yaml_reads_as_text_says_so(tmp_path, write_config, setting, hinted):
    """h37: `quota: {target_tokens: 1e13}` was "expected an integer, got str '1e13'", for a number as written."""
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(_base(tmp_path)), overrides=[setting])
    assert ("as text: write the digits, or a dot and a signed exponent as in 1.0e+13" in str(refused.value)) == hinted


def test_build_takes_set_and_max_samples_on_the_command_line(tmp_path, write_config):
    raw = _base(tmp_path) | {"workers": 1}
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(9)))
    path = write_config(raw)
    args = ["build", str(path), "-q", "--max-samples", "4", "--set", "sources.docs.weight=2", "--set", "seed=7"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "out").raw
    assert manifest["accounting"]["docs"]["read"] == 4 and manifest["accounting"]["docs"]["segments"] == 8
    assert manifest["seed"] == 7 and manifest["config"]["sources"][0]["max_samples"] == 4
    bad = CliRunner().invoke(main, ["build", str(path), "--set", "sources.doc.weight=2"])
    assert (
        bad.exit_code == 1
        and bad.output.strip() == "Error: --set sources.doc.weight: no source named 'doc' (sources: docs)"
    )
    audit = CliRunner().invoke(main, ["audit", str(path), "--rows", "2", "--set", "capacity=1"])
    assert audit.exit_code == 1 and "capacity: must be between 2" in audit.output


def test_preference_and_group_formats_with_item_truncation(tmp_path, write_config):
    raw = _base(tmp_path)
    (tmp_path / "pairs.jsonl").write_text('{"q": "2+2?", "good": "4", "bad": "5"}\n')
    raw["sources"] = [
        {
            "name": "dpo",
            "path": "pairs.jsonl",
            "format": "preference",
            "fields": {"prompt": "q", "chosen": "good", "rejected": "bad"},
        },
        {"name": "rl", "path": "pairs.jsonl", "format": "group"},
    ]
    raw["truncation"] = {"strategy": "right", "items": "turns"}
    config = load_config(write_config(raw))
    assert config.truncation.items == "turns"
    assert config.sources[0].fields["prompt"] == "q" and config.sources[1].fields["completions"] == "completions"
    assert config.sources[0].role_map["gpt"] == "assistant"  # LLaMA-Factory rows speak ShareGPT
    assert load_config(write_config(_base(tmp_path))).truncation.items == "left"
    raw["truncation"] = {"items": "middle"}
    raw["sources"][1]["fields"] = {"chosen": "x"}
    with pytest.raises(ConfigError) as info:
        load_config(write_config(raw))
    assert "truncation.items: 'middle' is not one of" in str(info.value)
    assert "sources[1].fields.chosen: unknown field for format 'group'" in str(info.value)


def test_preference_records_are_read_as_pairs_with_remapped_columns(tmp_path, write_config):
    from packtool.errors import RecordError
    from packtool.records import PreferencePair
    from packtool.sources import read_source

    raw = _base(tmp_path)
    (tmp_path / "pairs.jsonl").write_text('{"q": "2+2?", "good": "4", "bad": "5"}\n{"q": "x"}\n')
    raw["sources"] = [
        {
            "name": "dpo",
            "path": "pairs.jsonl",
            "format": "preference",
            "fields": {"prompt": "q", "chosen": "good", "rejected": "bad"},
        }
    ]
    pair, bad = list(read_source(load_config(write_config(raw)).sources[0]))
    assert isinstance(pair, PreferencePair) and pair.id == "dpo:pairs.jsonl:1"
    assert pair.chosen[0].content == "4" and pair.rejected[0].content == "5"
    assert isinstance(bad, RecordError) and bad.row == 2 and bad.sample_id == "dpo:pairs.jsonl:2"


def test_system_dedup_and_prompt_completion_are_validated(tmp_path, write_config):
    raw = _base(tmp_path)
    raw["sources"][0].update(system="Be brief.", dedup="fuzzy")
    raw["sources"].append({"name": "pc", "path": "data.jsonl", "format": "completion", "system": 3})
    raw["dedup"] = True
    raw["dataset_exact_deduplication"] = True
    with pytest.raises(ConfigError) as info:
        load_config(write_config(raw))
    message = str(info.value)
    for expected in [
        "sources[0].system: format: text has no conversation to put a system prompt in",
        "sources[0].dedup: 'fuzzy' is not one of exact",
        "sources[1].format: 'completion' is not one of",
        "packtool calls this 'text' (axolotl's completion: every token trained) or 'prompt_completion'",
        "sources[1].system: expected a string",
        "dedup: expected a string, got True",
        "dataset_exact_deduplication: unknown key; packtool calls this dedup: exact",
    ]:
        assert expected in message
    raw = _base(tmp_path)
    raw["sources"][0].update(format="prompt_completion", system="Be brief.", dedup="exact")
    config = load_config(write_config({**raw, "dedup": "exact"}))
    source = config.sources[0]
    assert source.system == "Be brief." and source.plan.dedup == "exact" and config.dedup == "exact"
    assert config.sources[0].fields == {"prompt": "prompt", "completion": "completion", "tools": "tools", "id": None}


# --- YAML aliases: allowed, bounded -----------------------------------------------------------


def _config_text(tmp_path: Path, extra: str) -> Path:
    """The base config as YAML with `extra` lines appended (anchors and aliases need real YAML, not JSON)."""
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_base(tmp_path)) + extra)
    return path


def _alias_bomb(levels: int = 9) -> str:
    """Nine aliases of nine aliases ... ("billion laughs"): 10 lines that expand to 9**9 strings."""
    lines = ['x0: &x0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(10)
def test_a_yaml_alias_bomb_is_one_line_without_being_expanded(tmp_path):
    """Written out, the bomb is 9**9 strings (minutes and gigabytes): the timeout only stops a hang."""
    path = _config_text(tmp_path, "template_vars:\n" + "".join(f"  {line}\n" for line in _alias_bomb().splitlines()))
    with pytest.raises(PacktoolError, match=r"expands to more than 100,000 values once its aliases are written out"):
        load_config(path)
    # the same through the CLI: one line, exit 1
    result = CliRunner().invoke(main, ["build", str(path), "-q"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.timeout(10)
def test_an_alias_bomb_in_a_set_value_is_refused():
    levels = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    levels += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    with pytest.raises(PacktoolError, match=r"--set .*expands to more than 100,000 values"):
        apply_overrides({}, [f"template_vars.x=[{', '.join(levels)}]"])
    assert (
        apply_overrides({}, [f"template_vars.x=[{', '.join(levels[:3])}]"])["template_vars"]["x"][2][8][8][8] == "lol"
    )


@pytest.mark.timeout(10)
def test_self_referencing_and_deeply_nested_yaml_are_one_line(tmp_path):
    with pytest.raises(PacktoolError, match="an alias refers to a mapping or list that holds it"):
        load_config(_config_text(tmp_path, "template_vars:\n  x: &loop\n    - *loop\n"))
    with pytest.raises(PacktoolError, match="nested"):
        load_config(_config_text(tmp_path, "template_vars:\n  x: " + "[" * 5000 + "]" * 5000 + "\n"))
    with pytest.raises(PacktoolError, match="nested deeper than 200 levels"):
        load_config(_config_text(tmp_path, "template_vars:\n  x: " + "[" * 300 + "]" * 300 + "\n"))


def test_sensible_anchors_and_aliases_are_read(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "more.jsonl").write_text('{"text": "more"}\n')
    path = tmp_path / "config.yaml"
    path.write_text(
        "sources:\n"
        "  - &docs {name: docs, path: data.jsonl, format: text, weight: 2}\n"
        "  - {<<: *docs, name: more, path: more.jsonl}\n"
        f"tokenizer: {QUICKSTART / 'tokenizer'}\ncapacity: 64\noutput: out\n"
    )
    config = load_config(path)
    assert [(s.name, s.plan.weight) for s in config.sources] == [("docs", 2.0), ("more", 2.0)]


def test_max_record_bytes_has_a_documented_default_and_reaches_the_readers(tmp_path, write_config):
    from packtool.config import DEFAULT_MAX_RECORD_BYTES

    config = load_config(write_config(_base(tmp_path)))
    assert config.encoding.max_record_bytes == DEFAULT_MAX_RECORD_BYTES == 4 << 20
    assert config.sources[0].max_record_bytes == DEFAULT_MAX_RECORD_BYTES
    assert f"max_record_bytes: {DEFAULT_MAX_RECORD_BYTES}" in Path("docs/config.md").read_text()
    raw = {**_base(tmp_path), "max_record_bytes": 4096}
    assert load_config(write_config(raw)).sources[0].max_record_bytes == 4096


@pytest.mark.timeout(10)
def test_a_config_of_megabytes_is_one_line_before_it_is_parsed(tmp_path):
    path = _config_text(tmp_path, f"template_vars:\n  prompt: {'a' * (2 << 20)}\n")  # YAML took 10 s for 10 MB
    with pytest.raises(PacktoolError, match=r"bytes, over the 1,048,576 a build config may have"):
        load_config(path)
