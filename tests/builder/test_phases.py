"""The build's phases end to end: same bytes on every executor, resume after kill -9, the token store
as a cache, and OUT holding one complete build whatever fails."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import QUICKSTART, REPO, ctrl_c_reaches_child, shared

from packtool.builder import build
from packtool.builder.publish import Staging, exchange
from packtool.cli import main
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.format import read_manifest

QUICKSTART_CONFIG = QUICKSTART.parent / "quickstart.yaml"
pytestmark = pytest.mark.timeout(300)


def _digest(folder: Path) -> dict[str, str]:
    """Every file under an output folder (overflow/ included) and its sha256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _cli(*args: str, kill: str | None = None) -> subprocess.CompletedProcess:
    """`python -m packtool ...` in a subprocess (so that it can be killed), serial, quiet unless asked."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("PACKTOOL_TEST_KILL", None)
    if kill:
        env["PACKTOOL_TEST_KILL"] = kill
    command = [sys.executable, "-m", "packtool", *args]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=240, check=False, preexec_fn=ctrl_c_reaches_child
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The quickstart built once, serial, without a cache: what every other build must equal byte for byte."""
    out = tmp_path_factory.mktemp("reference") / "out"
    config = load_config(QUICKSTART_CONFIG, output=str(out), workers="1")
    built = build(config, use_cache=False)
    assert built.encode_reused == 0 and built.shards == 3
    return out


@pytest.mark.parametrize("phase", ["encode:1", "plan:1", "emit:1"])
def test_a_killed_build_resumes_to_identical_bytes(reference, tmp_path, phase):
    out = tmp_path / "out"
    killed = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1", kill=phase)
    assert killed.returncode == -9, killed.stderr
    assert not out.exists()  # nothing was published
    resumed = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1")
    assert resumed.returncode == 0, resumed.stderr
    reused = {
        # the first file's records came from the cache; the others were never encoded, so never indexed
        "encode:1": ("records reused; re-encoded", "alpaca.jsonl is new to the cache", "emit: 0 of 3 shard(s) resumed"),
        "plan:1": ("records reused; emit: 0 of 3 shard(s) resumed",),
        "emit:1": ("records reused; emit: 1 of 3 shard(s) resumed",),
    }[phase]
    assert all(line in resumed.stdout for line in reused), resumed.stdout
    assert _digest(out) == _digest(reference)
    assert not (tmp_path / ".out.packtool-staging").exists()  # published: the staging folder is gone


def test_a_build_killed_while_publishing_leaves_a_complete_output(reference, tmp_path):
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1").returncode == 0
    smaller = ("--capacity", "512", "-j", "1")
    killed = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), *smaller, kill="publish:1")
    assert killed.returncode == -9
    assert verify(out).ok  # the new build is in place whole; the old one waits in the staging folder
    assert read_manifest(out).capacity == 512
    assert (tmp_path / ".out.packtool-staging").exists()
    rerun = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), *smaller)
    assert rerun.returncode == 0, rerun.stderr
    assert _cli("build", str(QUICKSTART_CONFIG), "-o", str(fresh), *smaller, "--no-cache").returncode == 0
    assert _digest(out) == _digest(fresh)  # the old build left in staging was not taken for finished shards
    assert not (tmp_path / ".out.packtool-staging").exists()


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "from-a").touch()
    (b / "from-b").touch()
    if not exchange(a, b):
        pytest.skip("this system has no atomic exchange; publish renames twice and prepare() recovers")
    assert [p.name for p in a.iterdir()] == ["from-b"] and [p.name for p in b.iterdir()] == ["from-a"]


def test_a_crash_between_the_two_renames_is_put_back_by_the_next_build(reference, tmp_path):
    """Where no exchange exists, OUT is renamed to previous/ first: the next build restores it."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    staging = Staging(out)
    staging.root.mkdir()
    os.replace(out, staging.previous)  # the first rename happened, the second did not
    staging.prepare()
    assert _digest(out) == _digest(reference) and verify(out).ok


def test_a_killed_rebuild_leaves_the_previous_build_in_place(reference, tmp_path):
    out = tmp_path / "out"
    assert _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1").returncode == 0
    before = _digest(out)
    killed = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1", "--capacity", "512", kill="emit:2")
    assert killed.returncode == -9
    assert _digest(out) == before == _digest(reference)
    assert verify(out).ok


@pytest.mark.parametrize("signal_name", ["TERM", "INT"])
def test_sigterm_and_ctrl_c_end_in_one_line_and_the_rerun_resumes(reference, tmp_path, signal_name):
    out = tmp_path / "out"
    stopped = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1", kill=f"emit:1:{signal_name}")
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr
    assert stopped.stderr.strip().splitlines() == [
        "Error: interrupted; the previous output is unchanged, rerun to resume"
    ]
    assert not out.exists()
    resumed = _cli("build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1")
    assert "emit: 1 of 3 shard(s) resumed" in resumed.stdout
    assert _digest(out) == _digest(reference)


def test_worker_processes_write_the_same_bytes(reference, tmp_path):
    config = load_config(QUICKSTART_CONFIG, output=str(tmp_path / "out"), workers="2")
    built = build(config, use_cache=False)
    assert _digest(tmp_path / "out") == _digest(reference)
    assert built.nodes == {"encode": {"local": 3}, "emit": {"local": 3}}  # off Ray, every item ran here


@pytest.fixture(scope="module")
def real_config(tmp_path_factory) -> Path:
    """Two real sources (tool calls in sharegpt, alpaca) with the Qwen2.5 tokenizer and its own template."""
    folder = tmp_path_factory.mktemp("real")
    raw = {
        "sources": [
            {
                "name": "glaive",
                "path": str(shared("datasets", "llamafactory_glaive_toolcall_en_demo.json")),
                "format": "sharegpt",
            },
            {"name": "alpaca", "path": str(shared("datasets", "llamafactory_alpaca_en_demo.json")), "format": "alpaca"},
        ],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "capacity": 1024,
        "truncation": {"strategy": "turns", "fallback": "right"},
        "output": "serial",
        "rows_per_shard": 100,
        "on_error": "skip",
        "max_reject_share": 1.0,
    }
    path = folder / "real.yaml"
    path.write_text(json.dumps(raw), encoding="utf-8")  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def real_reference(real_config) -> Path:
    """The two real sources built once, serial, without a cache."""
    serial = build(load_config(real_config, workers="1"), use_cache=False)
    assert serial.shards > 1 and serial.encode_items == 2
    return serial.output


def test_two_real_sources_give_the_same_bytes_serial_and_on_two_processes(real_config, real_reference, tmp_path):
    # beside the reference: the manifest records the config's folder relative to OUT
    parallel_out = Path(real_reference).parent / "parallel"
    parallel = build(load_config(real_config, output=str(parallel_out), workers="2"), use_cache=False)
    assert _digest(real_reference) == _digest(parallel_out)
    assert set(parallel.manifest["accounting"]) == {"glaive", "alpaca"}
    assert any("Qwen" in line for line in parallel.manifest["template"]["injects"])  # Qwen's default system prompt
    assert verify(parallel_out).ok


def test_a_plan_only_change_reencodes_nothing(tmp_path, write_config, write_jsonl):
    write_jsonl(_chat_rows(30, "a"), "a.jsonl")
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    config = load_config(write_config(_raw()))
    first = build(config)
    assert (first.encode_items, first.encode_reused) == (2, 0)
    changes = {
        "capacity": 96,
        "seed": 3,
        "shards": replace(config.shards, rows_per_shard=2),
        "truncation": replace(config.truncation, strategy="left"),
        "packing": replace(config.packing, group_by="source"),
    }
    for setting, value in changes.items():
        again = build(replace(config, **{setting: value}))
        assert again.encode_reused == again.encode_items == 2, setting
    # the same bytes as a build that encodes from scratch
    fresh = replace(config, capacity=96, run=replace(config.run, output=str(tmp_path / "fresh")))
    build(fresh, use_cache=False)
    build(replace(config, capacity=96))
    assert _digest(tmp_path / "out") == _digest(tmp_path / "fresh")


@pytest.mark.parametrize("set_by_caller", [None, "true"])
def test_a_serial_build_tokenizes_one_thread_per_call_and_leaves_the_caller_s_setting(
    tmp_path, write_config, write_jsonl, monkeypatch, set_by_caller
):
    """-j 1 runs in the caller's process: its encode threads already overlap tokenizing with
    rendering, so tokenizers' own pool is off while they run, and the caller's environment is
    as it was afterwards (their own setting is never overridden)."""
    from packtool.builder.stages import PARALLELISM, Stages

    if set_by_caller is None:
        monkeypatch.delenv(PARALLELISM, raising=False)
    else:
        monkeypatch.setenv(PARALLELISM, set_by_caller)
    seen = set()
    encode = Stages.encode

    def recording(self, prepared):
        seen.add(os.environ.get(PARALLELISM))
        return encode(self, prepared)

    monkeypatch.setattr(Stages, "encode", recording)
    write_jsonl(_chat_rows(30, "a"), "a.jsonl")
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    build(load_config(write_config(_raw())), use_cache=False)
    assert seen == {set_by_caller or "false"}
    assert os.environ.get(PARALLELISM) == set_by_caller


def test_one_thread_renders_and_the_encode_threads_tokenize(tmp_path, write_config, write_jsonl, monkeypatch):
    """-j 1: the thread that reads an item renders all of its chunks, in order (templates learn their
    skeletons on one thread), and the encode threads only tokenize and label them; the samples keep
    the input's order."""
    import threading

    from packtool.builder.stages import ENCODE_THREADS, Stages

    rendering, encoding = [], []
    render, encode = Stages.render, Stages.encode

    def render_recording(self, chunk, *rest):
        rendering.append((threading.current_thread().name, [item.id for item in chunk]))
        return render(self, chunk, *rest)

    def encode_recording(self, prepared):
        encoding.append(threading.current_thread().name)
        return encode(self, prepared)

    monkeypatch.setattr(Stages, "render", render_recording)
    monkeypatch.setattr(Stages, "encode", encode_recording)
    write_jsonl(_chat_rows(300, "a"), "a.jsonl")
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    built = build(load_config(write_config(_raw())), use_cache=False)
    assert {name for name, _ in rendering} == {threading.current_thread().name}
    assert [i for _, ids in rendering for i in ids] == [f"a{i}" for i in range(300)] + [f"b{i}" for i in range(20)]
    assert len(encoding) == len(rendering) >= 4 and all(name.startswith("packtool-encode") for name in encoding)
    accounting = built.manifest["accounting"]
    assert ENCODE_THREADS == 2 and (accounting["a"]["kept"], accounting["b"]["kept"]) == (300, 20)


def test_a_changed_file_is_the_only_one_reencoded(tmp_path, write_config, write_jsonl):
    write_jsonl(_chat_rows(30, "a"), "part-1.jsonl")
    write_jsonl(_chat_rows(20, "b"), "part-2.jsonl")
    raw = _raw()
    raw["sources"] = [{"name": "s", "path": "part-*.jsonl", "format": "messages", "fields": {"id": "id"}}]
    config = load_config(write_config(raw))
    build(config)
    write_jsonl(_chat_rows(21, "b"), "part-2.jsonl")  # one more record: new content, new key
    again = build(config)
    assert (again.encode_items, again.encode_reused) == (2, 1)
    assert again.manifest["accounting"]["s"]["read"] == 51
    listing = CliRunner().invoke(main, ["cache", "list", str(tmp_path / ".packtool-cache")])
    assert listing.exit_code == 0 and "3 entries" in listing.output  # the stale entry is listed, never read
    cleared = CliRunner().invoke(main, ["cache", "clear", str(tmp_path / ".packtool-cache")])
    assert cleared.exit_code == 0 and "bytes freed" in cleared.output
    assert build(config).encode_reused == 0


@pytest.mark.parametrize("fault", ["bad_row_under_fail", "bad_template", "too_many_rejects", "empty_output"])
def test_a_failed_rebuild_leaves_the_previous_build_verifiable(tmp_path, write_config, write_jsonl, fault):
    write_jsonl(_chat_rows(30, "a"), "a.jsonl")
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    config_path = write_config(_raw())
    assert CliRunner().invoke(main, ["build", str(config_path), "-q"]).exit_code == 0
    out = tmp_path / "out"
    before = _digest(out)
    raw = _raw()
    expected = ""
    if fault == "bad_row_under_fail":
        write_jsonl([*_chat_rows(30, "a"), "{broken json"], "a.jsonl")
        expected = "a.jsonl:31"
    elif fault == "bad_template":
        (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
        raw["template"] = "broken.jinja"
        expected = "broken.jinja"
    elif fault == "too_many_rejects":
        write_jsonl([*_chat_rows(1, "b"), *["{broken json"] * 3], "b.jsonl")
        raw["on_error"] = "skip"
        expected = "source 'b' lost 3 of 4 records"
    else:
        write_jsonl(["{broken json"] * 2, "a.jsonl")
        write_jsonl(["{broken json"], "b.jsonl")
        raw.update(on_error="skip", max_reject_share=1.0)
        expected = "no pack to write"
    result = CliRunner().invoke(main, ["build", str(write_config(raw)), "-q"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert expected in result.output and result.output.startswith("Error: ")
    assert _digest(out) == before  # no partial file in OUT, nothing replaced
    assert verify(out).ok


def test_strict_fails_on_any_lost_record_and_one_line_per_source(tmp_path, write_config, write_jsonl):
    write_jsonl([*_chat_rows(5, "a"), "{broken json"], "a.jsonl")
    write_jsonl([*_chat_rows(5, "b"), "{broken json"], "b.jsonl")
    raw = {**_raw(), "on_error": "skip"}
    assert CliRunner().invoke(main, ["build", str(write_config(raw)), "-q"]).exit_code == 0
    strict = CliRunner().invoke(
        main, ["build", str(write_config(raw)), "-q", "-o", str(tmp_path / "strict"), "--strict"]
    )
    assert strict.exit_code == 1
    assert "source 'a' lost 1 of 6 records" in strict.output and "source 'b' lost 1 of 6 records" in strict.output
    assert not (tmp_path / "strict").exists()


def test_an_unwritable_output_is_one_line(tmp_path, write_config, write_jsonl):
    write_jsonl(_chat_rows(3, "a"), "a.jsonl")
    write_jsonl(_chat_rows(3, "b"), "b.jsonl")
    (tmp_path / "a-file").write_text("not a folder")
    result = CliRunner().invoke(
        main, ["build", str(write_config(_raw())), "-q", "-o", str(tmp_path / "a-file" / "out")]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "a-file" in result.output and result.output.count("\n") == 1


def test_an_output_with_foreign_files_is_not_replaced(tmp_path, write_config, write_jsonl):
    write_jsonl(_chat_rows(3, "a"), "a.jsonl")
    write_jsonl(_chat_rows(3, "b"), "b.jsonl")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["build", str(write_config(_raw())), "-q"])
    assert result.exit_code == 1 and "notes.txt" in result.output
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("split", [{"share": 0.25}, {"samples": 7}])
def test_validation_split_by_content(tmp_path, write_config, write_jsonl, split):
    rows = _chat_rows(40, "a")
    write_jsonl([*rows, *rows[:10]], "a.jsonl")  # ten records twice: a copy must never straddle the split
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    built = build(load_config(write_config({**_raw(), "validation": split})))
    out = tmp_path / "out"

    def hashes(folder: Path) -> list[str]:
        import pyarrow.parquet as pq

        return [
            h
            for f in sorted(folder.glob("shard-*.parquet"))
            for r in pq.read_table(f).to_pylist()
            for h in r["sample_hashes"]
        ]

    train, held = hashes(out), hashes(out / "validation")
    assert held and not set(train) & set(held)
    assert len(train) + len(held) == 70 and built.manifest["validation"]["segments"] == len(held)
    if "samples" in split:
        assert len(held) >= 7
    else:
        assert 5 <= len(held) <= 30
    assert verify(out).ok


def test_dry_run_previews_the_build_and_writes_no_shard(reference, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART_CONFIG), "-o", str(out), "-j", "1", "--dry-run"])
    assert result.exit_code == 0, result.output
    stats = read_manifest(reference).raw["stats"]
    assert f"OUT: {stats['packs']:,} packs of 1,024 in 3 shard(s)" in result.output
    assert f"{stats['tokens']:,} tokens, token efficiency {stats['token_efficiency']:.4f}" in result.output
    assert "dry run: no shard was written" in result.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".packtool-cache"]


def test_a_smaller_rebuild_leaves_nothing_stale(tmp_path, write_config, write_jsonl):
    rows = _chat_rows(20, "a")
    rows[0]["messages"][1]["content"] = " ".join(["long"] * 300)
    write_jsonl(rows, "a.jsonl")
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    raw = {**_raw(), "overflow": {"mode": "bucket", "capacity": 1024}}
    bucket = build(load_config(write_config(raw)))
    assert (tmp_path / "out" / "overflow" / "manifest.json").is_file() and bucket.manifest["overflow"]["segments"] >= 1
    plain = build(load_config(write_config({**_raw(), "rows_per_shard": 1000})))
    assert sorted(_digest(tmp_path / "out")) == ["README.md", "manifest.json", "rejects.jsonl", "shard-00000.parquet"]
    assert len(plain.manifest["shards"]) == 1 and verify(tmp_path / "out").ok


def test_the_library_front_door():
    import packtool

    assert callable(packtool.build) and packtool.load_config is load_config


@pytest.mark.ray
@pytest.mark.timeout(240, method="thread")  # a misconfigured Ray hangs instead of failing
@pytest.mark.parametrize("cluster", ["ray_local", "ray_two_nodes"], ids=["one-node", "two-loopback-nodes"])
def test_ray_writes_the_same_bytes_and_runs_work_items_on_every_node(
    reference, real_config, real_reference, request, cluster
):
    ray = request.getfixturevalue(cluster)
    node_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(node_ids) == (1 if cluster == "ray_local" else 2)
    for config, expected in ((QUICKSTART_CONFIG, reference), (real_config, real_reference)):
        out = Path(expected).parent / f"ray-{cluster}"  # beside it: the manifest records the config folder from OUT
        built = build(load_config(config, output=str(out), overrides=["executor=ray"]), use_cache=False)
        assert _digest(out) == _digest(expected)
        # every node ran encode and emit items of this build, and every item ran once
        assert set(built.nodes["encode"]) == set(built.nodes["emit"]) == node_ids
        assert sum(built.nodes["encode"].values()) == built.encode_items
        assert sum(built.nodes["emit"].values()) == built.shards


def _chat_rows(n: int, prefix: str) -> list[dict]:
    return [
        {
            "id": f"{prefix}{i}",
            "messages": [
                {"role": "user", "content": f"{prefix} question {i}?"},
                {"role": "assistant", "content": " ".join(["answer"] * (10 + 7 * (i % 9)))},
            ],
        }
        for i in range(n)
    ]


def _raw() -> dict:
    return {
        "sources": [
            {"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}},
            {"name": "b", "path": "b.jsonl", "format": "messages", "fields": {"id": "id"}},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 128,
        "output": "out",
        "rows_per_shard": 5,
        "workers": 1,
    }


def test_raising_max_record_bytes_reencodes_and_keeps_the_record(tmp_path, write_config, write_jsonl):
    """Which records are read at all is an encode setting: a cached partition that passed over a
    record must not stand in for one that reads it."""
    write_jsonl([{"text": "short"}, {"text": "word " * 1000}], "docs.jsonl")
    raw = {
        "sources": [{"name": "docs", "path": "docs.jsonl", "format": "text"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 128,
        "output": "out",
        "workers": 1,
        "on_error": "skip",
        "max_reject_share": 1.0,
        "max_record_bytes": 1024,
    }
    first = build(load_config(write_config(raw)))
    assert first.manifest["accounting"]["docs"]["rejected"] == {"record_too_large": 1}
    again = build(load_config(write_config({**raw, "max_record_bytes": 8192})))
    assert again.encode_reused == 0
    assert again.manifest["accounting"]["docs"]["rejected"] == {}
    assert again.manifest["accounting"]["docs"]["kept"] == 2


def test_an_items_chunks_start_small_and_double_up_to_the_batch():
    from packtool.builder.stages import FIRST_CHUNK, _chunks

    records = list(range(2000))
    chunks = list(_chunks(iter(records), 512))
    assert FIRST_CHUNK == 64 and [len(c) for c in chunks] == [64, 128, 256, 512, 512, 512, 16]
    assert [r for c in chunks for r in c] == records
    assert [len(c) for c in _chunks(iter(records[:10]), 4)] == [4, 4, 2]
