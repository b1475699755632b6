"""The three commands end to end through click's CliRunner, on the shipped quickstart and on bad input."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support import QUICKSTART, REPO

from packtool.builder.executors import describe_workers
from packtool.cli import main
from packtool.format import read_manifest
from packtool.labels import IGNORE_INDEX
from packtool.minijinja_engine import MINIJINJA_INSTALLED
from packtool.workers import auto_workers, usable_cores


@pytest.fixture(scope="module")
def quickstart_build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qs") / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "token efficiency" in result.output
    # workers: auto (the default) says what it picked for this machine
    assert describe_workers(auto_workers(usable_cores())) in result.output
    # the summary names the engine that renders what no skeleton covers (ChatML qualifies for minijinja;
    # without the extra it never looks inside a content, so the summary does not ask for it)
    engine = "minijinja\n" if MINIJINJA_INSTALLED else "jinja2 (it does not inspect content)\n"
    assert f"template model (tokenizer_config.json) rendered by {engine}" in result.output
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*")) if p.is_file()}


def test_quickstart_build_writes_a_complete_self_describing_output(quickstart_build):
    read = read_manifest(quickstart_build)
    manifest = read.raw
    assert read.schema_version == 2 and not read.stream  # split truncation: pieces numbered
    assert manifest["conventions"]["ignore_index"] == IGNORE_INDEX
    assert manifest["template"]["name"] == "model" and len(manifest["tokenizer"]["sha256"]) == 64
    assert manifest["stats"]["token_efficiency"] > 0.95
    for shard in read.shards:
        assert hashlib.sha256(shard.file.read_bytes()).hexdigest() == shard.sha256
        assert pq.read_metadata(shard.file).num_rows == shard.rows
    # every read record is accounted for: kept, rejected or dropped
    for name, a in manifest["accounting"].items():
        assert a["read"] == a["kept"] + sum(a["rejected"].values()) + sum(a["dropped"].values()), name
    assert not list(quickstart_build.glob("*.tmp"))


def test_shards_keep_labels_inside_segments(quickstart_build):
    table = pq.read_table(quickstart_build / "shard-00000.parquet")
    capacity = read_manifest(quickstart_build).capacity
    for row in table.to_pylist():
        ids, labels = np.array(row["input_ids"]), np.array(row["labels"])
        cu = np.array(row["cu_seqlens"])
        assert len(ids) == len(labels) == cu[-1] <= capacity
        assert (labels[cu[:-1]] == IGNORE_INDEX).all()
        kept = labels != IGNORE_INDEX
        assert (labels[kept] == ids[kept]).all()
        assert row["n_targets"] == kept.sum() and row["attn_cost"] == int((np.diff(cu) ** 2).sum())
        assert len(row["sample_ids"]) == len(cu) - 1 == len(row["sources"]) == len(row["sample_hashes"])


def test_same_inputs_give_byte_identical_shards(quickstart_build, tmp_path):
    again = tmp_path / "again"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(again), "-q"])
    assert result.exit_code == 0, result.output
    first, second = _digest(quickstart_build), _digest(again)
    assert first.keys() == second.keys()
    for name in first:
        if name != "manifest.json":  # the manifest names the output's own path in nothing but config; compare below
            assert first[name] == second[name], name
    assert read_manifest(quickstart_build).raw == read_manifest(again).raw


def test_inspect_shows_each_token_with_its_label(quickstart_build):
    result = CliRunner().invoke(
        main, ["inspect", str(quickstart_build / "shard-00000.parquet"), "--row", "1", "--limit", "12", "--no-color"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("shard-00000.parquet row 1:")
    header = next(line for line in lines if line.split()[:3] == ["idx", "id", "piece"])
    assert header.split()[-4:] == ["seg", "pos", "attends", "label"]
    first_tokens = [line for line in lines if line.strip().startswith("0 ")]
    assert first_tokens and first_tokens[0].rstrip().endswith("·")  # a segment start is never a target
    assert any(line.endswith("*") for line in lines) or "targets" in lines[0]
    assert "text:" in result.output


def test_stats_json_and_text(quickstart_build):
    result = CliRunner().invoke(main, ["stats", str(quickstart_build), "--json"])
    assert result.exit_code == 0
    stats = json.loads(result.output)
    assert set(stats["sources"]) == {"chat", "instructions", "docs"}
    assert abs(sum(s["token_share"] for s in stats["sources"].values()) - 1) < 1e-3
    assert stats["accounting"]["docs"]["truncated"]["split"]["samples"] > 0
    single = CliRunner().invoke(main, ["stats", str(quickstart_build / "shard-00000.parquet")])
    assert single.exit_code == 0 and "token efficiency" in single.output


BAD_ROWS = [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}', None),
    ("{broken json", "parse_error"),
    ('{"conversation": []}', "bad_record"),
    ('{"messages": [{"role": "robot", "content": "beep"}]}', "bad_record"),
    ('{"messages": [{"role": "user", "content": ["not a part"]}]}', "bad_record"),
    ('{"messages": []}', "bad_record"),
]


def _bad_config(tmp_path: Path, write_config, on_error: str) -> Path:
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(row + "\n" for row, _ in BAD_ROWS))
    return write_config(
        {
            "sources": [{"name": "bad", "path": "bad.jsonl", "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 256,
            "output": "out",
            "on_error": on_error,
            "max_reject_share": 1.0,  # five of six rows are bad on purpose
        }
    )


def test_bad_input_fails_with_one_line_naming_file_line_and_field(tmp_path, write_config):
    result = CliRunner().invoke(main, ["build", str(_bad_config(tmp_path, write_config, "fail"))])
    assert result.exit_code == 1
    message = result.output.strip()
    assert message.startswith("Error: ") and "Traceback" not in message
    # the file as the config names it (relative to the config's folder), then the line
    assert "Error: bad.jsonl:2: not valid JSON" in message


def test_bad_input_is_skipped_into_rejects_and_counted(tmp_path, write_config):
    result = CliRunner().invoke(main, ["build", str(_bad_config(tmp_path, write_config, "skip")), "-q"])
    assert result.exit_code == 0, result.output
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == [kind for _, kind in BAD_ROWS if kind]
    assert rejects[1]["location"].endswith("bad.jsonl:3") and "messages" in rejects[1]["detail"]
    assert rejects[2]["location"].endswith("bad.jsonl:4") and "robot" in rejects[2]["detail"]
    stats = json.loads(CliRunner().invoke(main, ["stats", str(tmp_path / "out"), "--json"]).output)
    assert stats["accounting"]["bad"] == {
        "read": 6,
        "kept": 1,
        "overflow": 0,
        "rejected": {"bad_record": 4, "parse_error": 1},
        "dropped": {},
        "truncated": {},
        "special_token_literals": 0,
        "straddling_targets": 0,
        "segments": 1,
    }


def test_template_error_is_rejected_per_sample(tmp_path, write_config, write_jsonl):
    (tmp_path / "strict.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    write_jsonl(
        [
            {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "x"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok"}]},
        ]
    )
    config = write_config(
        {
            "sources": [{"name": "s", "path": "data.jsonl", "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "template": "strict.jinja",
            "capacity": 128,
            "output": "out",
            "on_error": "skip",
        }
    )
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert result.exit_code == 0, result.output
    (reject,) = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert reject["reason"] == "template_error" and "Conversations must start with a user" in reject["detail"]
    failing = CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(tmp_path / "o2")], obj=None)
    assert failing.exit_code == 0
    config.write_text(config.read_text().replace("on_error: skip", "on_error: fail"))
    failing = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert failing.exit_code == 1 and "Conversations must start with a user" in failing.output
    assert "data.jsonl:1" in failing.output


def test_config_problems_are_listed_together(tmp_path, write_config):
    config = write_config({"sources": [{"name": "s", "path": "none.jsonl", "format": "nope"}], "capacity": "x"})
    result = CliRunner().invoke(main, ["build", str(config)])
    assert result.exit_code == 1
    for expected in [
        "sources[0].format",
        "sources[0].path",
        "capacity: expected an integer",
        "tokenizer: is required",
        "output: is required",
    ]:
        assert expected in result.output


def test_every_command_is_documented_with_an_example():
    for name, command in main.commands.items():
        assert command.help and "Example:" in command.help, f"`packtool {name}` needs help text with an example"
    assert "Example:" in (main.help or "")


def test_every_option_is_in_the_readme_table():
    """The README's row of each command names each of its options; trace's loader settings are listed
    in docs/reproducibility.md (the row says `[loader settings]`). `--tokenizer` of inspect was missing."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    loader_settings = (REPO / "docs" / "reproducibility.md").read_text(encoding="utf-8")
    missing = []
    for name, command in main.commands.items():
        row = " ".join(line for line in readme.splitlines() if line.startswith(f"| `packtool {name}"))
        assert row, f"`packtool {name}` has no row in the README's command table"
        documented = row + (loader_settings if name == "trace" else "")
        for param in command.params:
            flags = [flag for flag in (*param.opts, *param.secondary_opts) if flag.startswith("-")]
            spelled = (re.search(rf"(?<![\w-]){flag}(?![\w-])", documented) for flag in flags)
            if flags and param.name != "help" and not any(spelled):
                missing.append(f"packtool {name} {flags[0]}")
    assert missing == []


def test_python_dash_m_works():
    result = subprocess.run([sys.executable, "-m", "packtool", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "build" in result.stdout


def test_audit_command_on_the_quickstart():
    result = CliRunner().invoke(main, ["audit", str(QUICKSTART.parent / "quickstart.yaml"), "--rows", "10"])
    assert result.exit_code == 0, result.output
    assert "PASS  assistant_markers" in result.output and "OK" in result.output.splitlines()[-1]


def test_worker_processes_write_the_same_bytes(quickstart_build, tmp_path):
    parallel = tmp_path / "parallel"
    args = ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(parallel), "-q", "--workers", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert _digest(parallel) == _digest(quickstart_build)


# Started in every process (sitecustomize): records OPENBLAS_NUM_THREADS as it is when numpy is first imported.
NUMPY_IMPORT_WATCH = """
import os, sys

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            with open(os.environ["NUMPY_IMPORTS"], "a") as log:
                log.write(f"{os.getpid()} {os.environ.get('OPENBLAS_NUM_THREADS', '-')}\\n")
        return None

sys.meta_path.insert(0, Watch())
"""


@pytest.mark.parametrize(("users", "expected"), [(None, "1"), ("3", "3")])
def test_a_build_starts_numpy_with_one_blas_thread_unless_the_user_set_it(tmp_path, users, expected):
    """OpenBLAS's idle threads spin ~0.1 CPU-s per process at numpy's import, and a build makes no BLAS call."""
    (tmp_path / "watch").mkdir()
    (tmp_path / "watch" / "sitecustomize.py").write_text(NUMPY_IMPORT_WATCH)
    log = tmp_path / "numpy-imports.log"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    path = [str(tmp_path / "watch"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env |= {"PYTHONPATH": os.pathsep.join(path), "NUMPY_IMPORTS": str(log)}
    env |= {"OPENBLAS_NUM_THREADS": users} if users else {}
    out = tmp_path / "out"
    command = ["build", "quickstart", "-o", str(out), "-j", "2", "--executor", "processes", "--no-cache", "-q"]
    done = subprocess.run([sys.executable, "-m", "packtool", *command], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    seen = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for pid, _ in seen}) >= 2  # the build and at least one worker process
    assert {threads for _, threads in seen} == {expected}


# Started in every process (sitecustomize): marks the atexit handlers running and the teardown freeing a global.
EXIT_WATCH = """
import atexit, os

_marks = os.open(os.environ["EXIT_MARKS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

def _mark(what, write=os.write, marks=_marks):  # bound now: teardown clears module globals
    write(marks, what.encode() + b"\\n")

class Freed:
    def __del__(self, mark=_mark):
        mark("teardown")

held_until_teardown = Freed()
atexit.register(_mark, "atexit")
"""


def _packtool_process(tmp_path, *args, stdout=subprocess.PIPE):
    (tmp_path / "watch").mkdir(exist_ok=True)
    (tmp_path / "watch" / "sitecustomize.py").write_text(EXIT_WATCH)
    marks = tmp_path / "exit-marks"
    marks.unlink(missing_ok=True)
    path = [str(tmp_path / "watch"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "EXIT_MARKS": str(marks)}
    command = [sys.executable, "-m", "packtool", *args]
    done = subprocess.run(command, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
    return done, marks.read_text().split() if marks.exists() else []


def test_the_program_runs_atexit_handlers_and_skips_the_teardown(tmp_path):
    """A build's objects (tokenizer, templates) took ~0.07 s to free one by one after the output was complete."""
    out = tmp_path / "out"
    done, marks = _packtool_process(tmp_path, "build", "quickstart", "-o", str(out), "--no-cache")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f"packtool stats {out}\n")  # the summary's last line, flushed before the exit
    assert marks == ["atexit"]
    failed, marks = _packtool_process(tmp_path, "stats", str(tmp_path / "missing"))
    assert failed.returncode == 2 and "does not exist" in failed.stderr
    assert marks == ["atexit"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["stats", "inspect", "build"])
def test_output_that_cannot_be_written_is_one_line_and_exit_1(tmp_path, command, quickstart_build):
    args = {
        "stats": ["stats", str(quickstart_build)],
        "inspect": ["inspect", str(quickstart_build / "shard-00000.parquet"), "--limit", "5"],
        "build": ["build", "quickstart", "-o", str(tmp_path / "out"), "--no-cache"],
    }[command]
    with open("/dev/full", "w") as full:
        done, marks = _packtool_process(tmp_path, *args, stdout=full)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "Error: writing the output: No space left on device"
    assert "Traceback" not in done.stderr
    assert marks == ["atexit"]


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("bad_tokenizer", "cannot load tokenizer"),
        ("bad_template", "template 'broken.jinja' line 1"),
        ("no_chat_template", "has no chat_template"),
    ],
)
def test_setup_errors_are_one_line(tmp_path, write_config, write_jsonl, setup, expected):
    write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    template = "model"
    if setup == "bad_tokenizer":
        (tokenizer / "tokenizer.json").write_text("{not a tokenizer")
    else:
        (tokenizer / "tokenizer.json").write_text((QUICKSTART / "tokenizer" / "tokenizer.json").read_text())
        (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    if setup == "bad_template":
        (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
        template = "broken.jinja"
    config = write_config(
        {
            "sources": [{"name": "s", "path": "data.jsonl", "format": "messages"}],
            "tokenizer": "tok",
            "template": template,
            "capacity": 64,
            "output": "out",
        }
    )
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert expected in result.output and result.output.count("\n") == 1


def test_inspect_around_shows_the_edges_of_every_target_run(quickstart_build):
    args = ["inspect", str(quickstart_build / "shard-00000.parquet"), "--row", "0", "--around", "1", "--no-color"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line[:6].strip().isdigit() or line.strip() == "..."]
    assert any(line.strip() == "..." for line in rows)  # gaps between the shown edges
    marks = [line.endswith("*") for line in rows if line.strip() != "..."]
    assert any(a != b for a, b in itertools.pairwise(marks))  # a context -> target switch is shown


def test_cache_list_looks_where_builds_keep_their_cache(tmp_path, monkeypatch):
    """Before: `cache list` read ./.packtool-cache while `packtool build quickstart` filled out/.packtool-cache.

    The build also prints the stats headline once, not the whole block `packtool stats` prints next."""
    monkeypatch.chdir(tmp_path)
    built = CliRunner().invoke(main, ["build", "quickstart"])
    assert built.exit_code == 0, built.output
    assert built.output.count("token efficiency") == 1 and "attention accounting" not in built.output
    assert f"packtool stats {tmp_path / 'out' / 'quickstart'}" in built.output
    for args in ([], ["out/quickstart"]):
        listing = CliRunner().invoke(main, ["cache", "list", *args])
        assert listing.exit_code == 0, listing.output
        assert listing.output.strip().splitlines()[-1].startswith("3 entries")


def test_a_build_says_when_it_replaces_another_configs_build_and_counts_every_shard(tmp_path):
    """OUT held another config's build: replaced without a word before. A validation split's shard was
    counted in `emit: 0 of 2 shard(s) resumed` and not in `wrote 1 shard(s)`."""
    config = str(QUICKSTART.parent / "quickstart.yaml")
    out = str(tmp_path / "out")
    first = CliRunner().invoke(main, ["build", config, "-o", out, "--max-samples", "20"])
    assert first.exit_code == 0 and "held a build of another config" not in first.output, first.output
    shard = tmp_path / "out" / "shard-00000.parquet"
    written = shard.stat().st_mtime_ns
    again = CliRunner().invoke(main, ["build", config, "-o", out, "--max-samples", "20"])
    assert "held a build of another config" not in again.output  # the same config: nothing to say
    # the same build again: kept as it is, nothing written (it rewrote every shard and swapped them in)
    assert f"up to date: {out} already holds this build" in again.output and "wrote " not in again.output
    assert shard.stat().st_mtime_ns == written
    # a shard changed on disk is not trusted: the build is written again
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    repaired = CliRunner().invoke(main, ["build", config, "-o", out, "--max-samples", "20"])
    assert "wrote 1 shard(s)" in repaired.output and "up to date" not in repaired.output
    assert CliRunner().invoke(main, ["verify", out]).exit_code == 0
    other = CliRunner().invoke(main, ["build", config, "-o", out, "--max-samples", "20", "--capacity", "512"])
    assert other.exit_code == 0, other.output
    assert f"note: {out} held a build of another config (config_hash " in other.stderr
    split = ["build", config, "-o", out, "--max-samples", "20", "--set", "validation.share=0.3"]
    result = CliRunner().invoke(main, split)
    assert result.exit_code == 0, result.output
    assert "emit: 0 of 2 shard(s) resumed" in result.output
    assert "wrote 1 shard(s) (+ 1 in validation/) and manifest.json" in result.output


def _routes(output: str) -> dict[str, int]:
    line = next(line for line in output.splitlines() if line.startswith("render routes this run (samples): "))
    shown = line.split(": ", 1)[1].split(";")[0]
    return {} if shown == "none" else {r: int(n.replace(",", "")) for r, n in (p.split() for p in shown.split(" · "))}


def test_the_build_summary_says_how_many_samples_each_render_route_produced(tmp_path, monkeypatch):
    config, out = str(QUICKSTART.parent / "quickstart.yaml"), str(tmp_path / "out")
    fresh = CliRunner().invoke(main, ["build", config, "-o", out, "-j", "1"])
    assert fresh.exit_code == 0, fresh.output
    templated = sum(  # every sample of the two chat-template sources, each through one route
        entry["read"] for name, entry in read_manifest(Path(out)).raw["accounting"].items() if name != "docs"
    )
    routes = _routes(fresh.output)
    assert sum(routes.values()) == templated == 1600 and "reference" not in routes
    assert routes["recipe"] > 1000  # the quickstart's conversations share a few shapes
    cached = CliRunner().invoke(main, ["build", config, "-o", out, "-j", "1"])
    assert _routes(cached.output) == {}
    assert "3 of 3 encode item(s) came from the cache, not rendered" in cached.output
    monkeypatch.setenv("PACKTOOL_RENDER", "reference")
    reference = CliRunner().invoke(main, ["build", config, "-o", str(tmp_path / "ref"), "-j", "1", "--no-cache"])
    assert _routes(reference.output) == {"reference": 1600}


def test_the_build_summary_says_what_decontamination_found(tmp_path):
    answer = json.loads((QUICKSTART / "alpaca.jsonl").read_text(encoding="utf-8").splitlines()[3])["output"]
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"id": "e0", "answer": answer}) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(out), "-j", "1", "--set",
         f"decontamination={{against: [{evals}]}}"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = read_manifest(out).raw["decontamination"]
    assert record["contaminated"] >= 1
    assert (
        f"decontamination: {record['contaminated']:,} sample(s) contaminated (dropped, each in rejects.jsonl with "
        f"its eval record; action: drop), {record['reported']:,} overlap(s) in prompts only (prompt_action: report), "
        f"against 1 eval file(s) of {record['against'][0]['strings']} strings; every overlap: packtool decontaminate "
        f"{out} --against EVAL"
    ) in result.output
