"""What packtool may touch: it writes and deletes only what it can prove it wrote, and trusts nothing it reads back.

Each test is a way someone sharing an output, staging or cache folder could lose files or poison a build:
the build refuses in one line with nothing touched, or it notices, redoes the work and says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import QUICKSTART, REPO
from test_phases import _chat_rows, _cli, _digest, _raw

from packtool.builder import build
from packtool.builder.owned import LOCK, MARKER, locked
from packtool.builder.publish import CARRY, Staging
from packtool.builder.store import rejects_path
from packtool.cli import main
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.errors import PacktoolError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def inputs(tmp_path, write_jsonl):
    write_jsonl(_chat_rows(20, "a"), "a.jsonl")
    write_jsonl(_chat_rows(15, "b"), "b.jsonl")
    return tmp_path


def _build(config: Path, *args: str):
    return CliRunner().invoke(main, ["build", str(config), "-q", *args])


def _tree(folder: Path) -> dict[str, str]:
    """Every file under a folder, links included (as where they point), with its content digest."""
    return {
        str(p.relative_to(folder)): (f"-> {os.readlink(p)}" if p.is_symlink() else _digest(p.parent)[p.name])
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def _refused(result, *words: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1, result.output
    assert all(word in result.output for word in words), result.output


# --- an OUT that overlaps what the build reads, or its cache --------------------------------------------


def test_an_output_that_is_the_input_folder_is_refused_and_the_input_kept(tmp_path, write_config, write_jsonl):
    """Main wrote its shard over the input `shard-00000.parquet` and exited 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    rows = _chat_rows(10, "a")
    pq.write_table(pa.Table.from_pylist(rows), data / "shard-00000.parquet")
    before = _tree(data)
    raw = {**_raw(), "sources": [{"name": "a", "path": "data/shard-00000.parquet", "format": "messages"}]}
    _refused(_build(write_config(raw), "-o", str(data)), "holds", "shard-00000.parquet")
    assert _tree(data) == before
    assert not (tmp_path / ".data.packtool-staging").exists()


@pytest.mark.parametrize(
    "case",
    ["parent_of_input", "output_is_cache", "cache_inside_output", "output_inside_cache", "config_inside", "tokenizer"],
)
def test_an_output_overlapping_inputs_or_cache_is_refused_with_nothing_touched(inputs, write_config, case):
    raw = _raw()
    out = inputs / "out"
    config = write_config(raw)
    if case == "parent_of_input":
        out = inputs
    elif case == "output_is_cache":
        raw["cache"] = str(out)
    elif case == "cache_inside_output":
        raw["cache"] = str(out / "cache")
    elif case == "output_inside_cache":
        raw["cache"] = str(inputs / "cache")
        out = inputs / "cache" / "out"
    elif case == "config_inside":
        out.mkdir()
        config = out / "config.yaml"
        config.write_text(
            json.dumps({**raw, "sources": [{**s, "path": str(inputs / s["path"])} for s in raw["sources"]]})
        )
    else:
        shutil.copytree(QUICKSTART / "tokenizer", out / "tok")
        raw["tokenizer"] = str(out / "tok")
    if case != "config_inside":
        config = write_config(raw)
    before = _tree(inputs)
    _refused(_build(config, "-o", str(out)), str(out), "overlap" if "cache" in case else "which the build reads")
    assert _tree(inputs) == before


def test_a_glob_that_would_read_the_output_is_refused_and_one_that_would_not_is_fine(
    tmp_path, write_config, write_jsonl
):
    (tmp_path / "data").mkdir()
    write_jsonl(_chat_rows(10, "a"), "data/a.jsonl")
    source = {"name": "a", "format": "messages", "fields": {"id": "id"}}
    recursive = write_config({**_raw(), "sources": [{**source, "path": "data/**/*.jsonl"}]})  # OUT/rejects.jsonl
    _refused(_build(recursive, "-o", str(tmp_path / "data" / "out")), "would read", "as input")
    plain = write_config({**_raw(), "sources": [{**source, "path": "data/*.jsonl"}]})
    assert _build(plain, "-o", str(tmp_path / "data" / "out")).exit_code == 0


# --- the user's files in OUT ------------------------------------------------------------------------------


def test_the_user_s_files_in_out_survive_every_rebuild_and_a_report_never_blocks_one(inputs, write_config):
    config = write_config(_raw())
    out = inputs / "out"
    assert _build(config).exit_code == 0
    assert CliRunner().invoke(main, ["report", str(out)]).exit_code == 0
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "eval.jsonl").write_text("{}\n")
    (out / "validation").mkdir()
    (out / "validation" / "my_eval.jsonl").write_text("{}\n")
    (out / "link").symlink_to(inputs / "a.jsonl")
    user = {
        k: v
        for k, v in _tree(out).items()
        if not k.startswith("shard-") and k not in ("manifest.json", "rejects.jsonl", "README.md")  # the build's
    }
    with_validation = write_config({**_raw(), "validation": {"samples": 5}, "capacity": 96})
    for rebuild in (config, with_validation, config):
        result = _build(rebuild)
        assert result.exit_code == 0, result.output
        assert {k: v for k, v in _tree(out).items() if k in user} == user  # the same bytes, links still links
        assert verify(out).ok
    assert (inputs / "a.jsonl").is_file()


def test_a_file_named_like_packtool_s_output_is_refused_by_name_with_nothing_touched(inputs, write_config):
    config = write_config(_raw())
    out = inputs / "out"
    assert _build(config).exit_code == 0
    shutil.copy(out / "shard-00000.parquet", out / "shard-00099.parquet")  # not in the manifest
    before = _tree(out)
    _refused(_build(config, "--capacity", "96"), "shard-00099.parquet", "packtool did not write")
    assert _tree(out) == before


def test_an_out_without_a_valid_manifest_proves_nothing_is_packtool_s(inputs, write_config):
    config = write_config(_raw())
    out = inputs / "out"
    assert _build(config).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"].append({"file": "notes.txt"})  # an edited manifest: its seal no longer matches
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    _refused(_build(config), "manifest.json")
    assert _tree(out) == before


def test_a_publish_killed_while_carrying_the_user_s_files_puts_them_back(inputs, write_config):
    out = inputs / "out"
    assert _build(write_config(_raw())).exit_code == 0
    (out / "notes.txt").write_text("mine")
    staging = Staging(out)
    staging.root.mkdir()
    (staging.root / MARKER).write_text(json.dumps({"packtool": "staging", "version": 1}))
    (staging.root / "out-k").mkdir()
    (staging.root / CARRY).write_text(json.dumps({"out": "out-k", "entries": ["notes.txt"]}))
    os.rename(out / "notes.txt", staging.root / "out-k" / "notes.txt")  # killed here, before the swap
    assert _build(write_config(_raw())).exit_code == 0
    assert (out / "notes.txt").read_text() == "mine" and verify(out).ok


# --- staging and cache folders that are not packtool's ----------------------------------------------------


@pytest.fixture
def victim(tmp_path) -> Path:
    """Someone's folder that a link points at: nothing in it may be written or deleted."""
    folder = tmp_path / "victim"
    (folder / "tokens").mkdir(parents=True)
    (folder / "tokens" / "precious.txt").write_text("keep")
    (folder / "plan-x").mkdir()
    (folder / "out-x").mkdir()
    return folder


@pytest.mark.parametrize("how", ["symlink", "foreign"])
def test_a_staging_path_that_is_a_link_or_not_packtool_s_is_refused(inputs, write_config, victim, how):
    staging = inputs / ".out.packtool-staging"
    if how == "symlink":
        staging.symlink_to(victim, target_is_directory=True)
    else:
        shutil.copytree(victim, staging)  # another user's (or an older packtool's) folder at the staging path
    before = _tree(victim), _tree(staging)
    _refused(_build(write_config(_raw())), str(staging))
    assert (_tree(victim), _tree(staging)) == before and not (inputs / "out").exists()


@pytest.mark.parametrize("how", ["symlink", "foreign"])
def test_a_cache_path_that_is_a_link_or_not_packtool_s_is_refused(inputs, write_config, victim, how):
    cache = inputs / "cache"
    if how == "symlink":
        cache.symlink_to(victim, target_is_directory=True)  # a link to / would be the same
    else:
        shutil.copytree(victim, cache)
    before = _tree(victim), _tree(cache)
    _refused(_build(write_config({**_raw(), "cache": str(cache)})), str(cache))
    assert (_tree(victim), _tree(cache)) == before and not (inputs / "out").exists()


def test_a_cache_flag_naming_a_link_is_refused_as_the_config_key_is(inputs, write_config):
    """h37: --cache LINK was resolved on the command line, so the build wrote through a link `cache:` refuses."""
    config = write_config(_raw())
    assert _build(config).exit_code == 0
    link = inputs / "link"
    link.symlink_to(inputs / ".packtool-cache", target_is_directory=True)
    before = _tree(inputs / ".packtool-cache")
    _refused(_build(config, "--cache", str(link), "-o", str(inputs / "other")), f"{link} is a symbolic link")
    assert _tree(inputs / ".packtool-cache") == before and not (inputs / "other").exists()


@pytest.mark.parametrize("how", ["plain_folder", "symlink_to_a_cache"])
def test_cache_clear_refuses_a_folder_that_is_not_a_packtool_cache(inputs, write_config, victim, how):
    folder = victim
    if how == "symlink_to_a_cache":
        assert _build(write_config(_raw())).exit_code == 0
        folder = inputs / "link"
        folder.symlink_to(inputs / ".packtool-cache", target_is_directory=True)
    before = _tree(victim), _tree(inputs / ".packtool-cache") if how != "plain_folder" else {}
    result = CliRunner().invoke(main, ["cache", "clear", str(folder)])
    _refused(result, "not a packtool cache", "nothing was deleted")
    assert (_tree(victim), _tree(inputs / ".packtool-cache") if how != "plain_folder" else {}) == before


def test_cache_clear_waits_for_no_build_and_refuses_while_one_uses_the_cache(inputs, write_config):
    assert _build(write_config(_raw())).exit_code == 0
    cache = inputs / ".packtool-cache"
    before = _tree(cache)
    with locked(cache, "cache", shared=True):  # a build holds it
        _refused(CliRunner().invoke(main, ["cache", "clear", str(cache)]), "in use")
    assert _tree(cache) == before
    cleared = CliRunner().invoke(main, ["cache", "clear", str(cache)])
    assert cleared.exit_code == 0 and sorted(p.name for p in cache.iterdir()) == [MARKER, LOCK]


def test_a_second_build_of_the_same_out_is_refused_naming_the_first(inputs, write_config):
    out = inputs / "out"
    assert _build(write_config(_raw())).exit_code == 0
    before = _tree(out)
    with Staging(out).held():  # the first build, still running
        _refused(_build(write_config(_raw()), "--capacity", "96"), "in use by packtool process", str(os.getpid()))
    assert _tree(out) == before
    assert _build(write_config(_raw()), "--capacity", "96").exit_code == 0


# --- nothing read back is trusted ---------------------------------------------------------------------------


def _partitions(root: Path) -> list[Path]:
    return sorted(p for p in (root / ".packtool-cache" / "tokens").glob("*/*.arrow") if ".rejects" not in p.suffixes)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        "changed_byte",
        "zeroed",
        "truncated",
        "zeroed_report",
        "swapped",
        "edited_report",
        "rejects_changed_byte",  # the entry's rejects table (KEY.rejects.arrow), sealed as its partition is
        "rejects_truncated",
        "rejects_missing",
    ],
)
def test_a_damaged_cache_entry_is_encoded_again_reported_and_never_used(inputs, write_config, damage):
    config = write_config(_raw())
    assert _build(config).exit_code == 0
    first, second = _partitions(inputs)
    rejects = rejects_path(first)
    if damage == "changed_byte":
        _flip_a_byte(first)
    elif damage == "rejects_changed_byte":
        _flip_a_byte(rejects)
    elif damage == "rejects_truncated":
        rejects.write_bytes(rejects.read_bytes()[:100])
    elif damage == "rejects_missing":
        rejects.unlink()
    elif damage == "zeroed":
        first.write_bytes(b"\0" * first.stat().st_size)
    elif damage == "truncated":
        first.write_bytes(first.read_bytes()[:100])
    elif damage == "zeroed_report":
        report = first.with_suffix(".json")
        report.write_bytes(b"\0" * report.stat().st_size)
    elif damage == "swapped":  # two valid entries, each under the other's name
        for suffix in (".arrow", ".json"):
            a, b = first.with_suffix(suffix), second.with_suffix(suffix)
            a.rename(a.with_name("swap")), b.rename(a), a.with_name("swap").rename(b)
    else:
        report = first.with_suffix(".json")
        entry = json.loads(report.read_text())
        entry["rejected"]["bad_record"] = 1
        report.write_text(json.dumps(entry))
    result = CliRunner().invoke(main, ["build", str(config), "--capacity", "96"])  # with its summary
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "warning: cache entry" in result.stderr and "written again" in result.stderr
    # the summary says why the file was encoded again: not a change of the input or the settings
    assert "had a cache entry changed on disk since written" in result.stdout, result.stdout
    assert "redone" not in result.stdout  # that clause counts staged shards, and none was changed
    fresh = build(load_config(config, output=str(inputs / "fresh"), capacity=96), use_cache=False)
    assert _digest(inputs / "out") == _digest(fresh.output) and verify(inputs / "out").ok
    again = _build(config, "--capacity", "96")
    assert again.exit_code == 0 and not again.stderr  # repaired for good


def test_a_staged_shard_changed_since_its_done_file_is_written_again(inputs, write_config):
    """Main published it, replacing the last good OUT with one that failed verify."""
    config = write_config(_raw())
    out = inputs / "out"
    assert _cli("build", str(config), "-q").returncode == 0
    killed = _cli("build", str(config), "-q", "--capacity", "96", kill="emit:3")
    assert killed.returncode == -9
    staging = Staging(out)
    staged = sorted(staging.root.glob("out-*/shard-*.parquet"))
    dones = sorted(staging.root.glob("done-*/*.json"))
    assert len(staged) == len(dones) == 3
    _flip_a_byte(staged[0])
    dones[1].write_bytes(b"\0" * 10)  # a done file zeroed: no traceback, the shard is written again
    (staged[0].parent / "shard-00042.parquet.tmp-1").write_bytes(b"stray")  # not this build's: not published
    resumed = _cli("build", str(config), "--capacity", "96")
    assert resumed.returncode == 0, resumed.stderr
    assert "emit: 1 of" in resumed.stdout and "2 changed on disk since written, redone" in resumed.stdout
    assert resumed.stderr.count("warning: staged shard") == 2
    build(load_config(config, output=str(inputs / "fresh"), capacity=96), use_cache=False)
    assert _digest(out) == _digest(inputs / "fresh") and verify(out).ok


def test_library_refusals_are_packtool_errors(inputs, write_config):
    config = load_config(write_config(_raw()))
    with pytest.raises(PacktoolError, match="filesystem root"):
        build(replace(config, run=replace(config.run, output="/")))


@pytest.mark.parametrize("damage", ["arrays", "plan_json"])
def test_a_staged_plan_changed_since_it_was_written_is_computed_again(inputs, write_config, damage):
    config = write_config(_raw())
    out = inputs / "out"
    killed = _cli("build", str(config), "-q", kill="emit:1")
    assert killed.returncode == -9
    (plan,) = Staging(out).root.glob("plan-*")
    if damage == "arrays":
        _flip_a_byte(plan / "plan.npz")
    else:
        meta = json.loads((plan / "plan.json").read_text())
        meta["partitions"][0][1] = str(inputs / "elsewhere.arrow")  # emit would read another partition
        (plan / "plan.json").write_text(json.dumps(meta))
    resumed = _cli("build", str(config))
    assert resumed.returncode == 0, resumed.stderr
    assert "warning: staged plan" in resumed.stderr and "emit: 0 of" in resumed.stdout
    build(load_config(config, output=str(inputs / "fresh")), use_cache=False)
    assert _digest(out) == _digest(inputs / "fresh") and verify(out).ok


def test_two_builds_of_one_out_at_once_the_second_is_refused_and_the_first_finishes(inputs, write_config):
    """Main: both failed. The first build stops itself (SIGSTOP) while it holds OUT, mid-emit."""
    config = write_config(_raw())
    env = {**os.environ, "PYTHONPATH": str(REPO), "PACKTOOL_TEST_KILL": "emit:1:STOP"}
    first = subprocess.Popen([sys.executable, "-m", "packtool", "build", str(config), "-q"], env=env)
    try:
        for _ in range(600):  # until it has stopped itself
            status = Path(f"/proc/{first.pid}/stat").read_text().split()[2]
            if status == "T":
                break
            assert first.poll() is None
            time.sleep(0.1)
        second = _build(config, "--capacity", "96")
        _refused(second, f"in use by packtool process {first.pid}")
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=240) == 0
    assert verify(inputs / "out").ok


def test_cache_clear_of_a_cache_whose_tokens_folder_is_a_link_removes_only_the_link(inputs, write_config, victim):
    assert _build(write_config(_raw())).exit_code == 0
    cache = inputs / ".packtool-cache"
    shutil.rmtree(cache / "tokens")
    (cache / "tokens").symlink_to(victim / "tokens", target_is_directory=True)
    before = _tree(victim)
    assert CliRunner().invoke(main, ["cache", "clear", str(cache)]).exit_code == 0
    assert _tree(victim) == before and not os.path.lexists(cache / "tokens")


def test_a_lock_path_that_is_a_link_is_one_line(inputs, write_config, victim):
    assert _build(write_config(_raw())).exit_code == 0
    cache = inputs / ".packtool-cache"
    (cache / LOCK).unlink()
    (cache / LOCK).symlink_to(victim / "tokens" / "precious.txt")
    _refused(CliRunner().invoke(main, ["cache", "clear", str(cache)]), "cannot lock")
    assert (victim / "tokens" / "precious.txt").read_text() == "keep"


def test_an_unreadable_carry_journal_is_refused_and_the_files_stay_where_they_are(inputs, write_config):
    out = inputs / "out"
    assert _build(write_config(_raw())).exit_code == 0
    staging = Staging(out)
    staging.root.mkdir()
    (staging.root / MARKER).write_text(json.dumps({"packtool": "staging", "version": 1}))
    (staging.root / "out-k").mkdir()
    (staging.root / "out-k" / "notes.txt").write_text("mine")
    (staging.root / CARRY).write_bytes(b"\0" * 8)
    _refused(_build(write_config(_raw())), "move them back")
    assert (staging.root / "out-k" / "notes.txt").read_text() == "mine"


def test_an_out_whose_entries_cannot_be_moved_is_one_line_and_keeps_every_file(inputs, write_config, monkeypatch):
    """A read-only OUT (root ignores permission bits, so the refusal is simulated): the second of two files fails."""
    out = inputs / "out"
    assert _build(write_config(_raw())).exit_code == 0
    (out / "a-notes.txt").write_text("mine")
    (out / "b-notes.txt").write_text("mine too")
    before = _tree(out)
    rename = os.rename

    def read_only(src, dst):
        if Path(src).name == "b-notes.txt" and Path(src).parent == out:
            raise PermissionError(13, "Permission denied", str(src))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", read_only)
    _refused(_build(write_config(_raw()), "--capacity", "96"), "Permission denied", "still holds the previous build")
    assert _tree(out) == before and verify(out).ok


def test_a_user_file_put_in_a_listed_shard_s_place_is_not_taken_for_packtool_s(inputs, write_config):
    config = write_config(_raw())
    out = inputs / "out"
    assert _build(config).exit_code == 0
    (out / "shard-00001.parquet").write_bytes(b"my own table, not the one the manifest lists")
    before = _tree(out)
    _refused(_build(config, "--capacity", "96"), "shard-00001.parquet", "packtool did not write")
    assert _tree(out) == before
