"""A full disk mid-build: one line, exit 1, and the previous build in OUT untouched and verifiable.

Needs a real small filesystem: a tmpfs mounted for the test (CI runs as root, where permission
bits do not stop writes, so a full disk is the honest way to make a write fail)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_phases import _chat_rows, _digest, _raw

from packtool.cli import main
from packtool.commands.verify import verify

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_leaves_the_previous_build_verifiable(tmp_path, small_disk, write_config, write_jsonl):
    write_jsonl(_chat_rows(20, "a"), "a.jsonl")
    write_jsonl(_chat_rows(20, "b"), "b.jsonl")
    out = small_disk / "out"
    raw = {**_raw(), "cache": str(tmp_path / "cache")}
    config = write_config(raw)
    assert CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(out)]).exit_code == 0
    before = _digest(out)
    # fill the disk, then ask for a build several times larger than what is left
    free = 64 * 1024
    filler = small_disk / "filler"
    usage = subprocess.run(["df", "-B1", "--output=avail", str(small_disk)], capture_output=True, text=True)
    filler.write_bytes(b"\0" * (int(usage.stdout.split()[-1]) - free))
    write_jsonl(_chat_rows(600, "a"), "a.jsonl")
    result = CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "No space left on device" in result.output and result.output.count("\n") == 1
    assert _digest(out) == before
    assert verify(out).ok
    # with space again, the same command finishes
    filler.unlink()
    rerun = CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(out)])
    assert rerun.exit_code == 0, rerun.output
    assert verify(out).ok and _digest(out) != before


def test_a_full_cache_disk_leaves_no_temporary_in_the_cache(tmp_path, small_disk, write_config, write_jsonl):
    write_jsonl(_chat_rows(600, "a"), "a.jsonl")
    write_jsonl(_chat_rows(600, "b"), "b.jsonl")
    cache = small_disk / "cache"
    filler = small_disk / "filler"
    usage = subprocess.run(["df", "-B1", "--output=avail", str(small_disk)], capture_output=True, text=True)
    filler.write_bytes(b"\0" * (int(usage.stdout.split()[-1]) - 64 * 1024))
    config = write_config({**_raw(), "cache": str(cache)})
    result = CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "No space left on device" in result.output and "Traceback" not in result.output
    assert [p.name for p in cache.rglob("*") if ".tmp" in p.name] == []
    filler.unlink()
    rerun = CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(tmp_path / "out")])
    assert rerun.exit_code == 0, rerun.output
    assert verify(tmp_path / "out").ok
