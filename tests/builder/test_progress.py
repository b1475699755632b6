"""Progress in a job log: a line per phase start and end, and done/total, rate and ETA at most every
10 s between them; a real build written to a file shows its phases."""

from __future__ import annotations

import io
import re
import subprocess
import sys

from support import QUICKSTART

from packtool.builder.progress import LogProgress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[str]:
    """The lines without their wall-clock stamp (HH:MM:SS)."""
    lines = stream.getvalue().splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in lines), lines
    return [line[9:] for line in lines]


def test_a_phase_writes_its_start_its_end_and_a_line_at_most_every_ten_seconds():
    clock, stream = _Clock(), io.StringIO()
    log = LogProgress(stream, every=10, clock=clock)
    with log.phase("encode", 4_000_000, "B") as bar:
        for _ in range(40):  # 100 kB every second
            clock.now += 1
            bar.update(100_000)
    assert _lines(stream) == [
        "encode: started, 4.0 MB",
        "encode: 1.0 MB of 4.0 MB (25%), 100.0 kB/s, about 30 s left",
        "encode: 2.0 MB of 4.0 MB (50%), 100.0 kB/s, about 20 s left",
        "encode: 3.0 MB of 4.0 MB (75%), 100.0 kB/s, about 10 s left",
        "encode: done, 4.0 MB in 40 s",
    ]


def test_counted_units_long_phases_and_steps():
    clock, stream = _Clock(), io.StringIO()
    log = LogProgress(stream, every=10, clock=clock)
    log.step("loading tokenizer tok.json")
    with log.phase("emit", 3, "shards") as bar:
        clock.now += 1800
        bar.update(1)
        clock.now += 5_400
        bar.update(2)
    assert _lines(stream) == [
        "loading tokenizer tok.json",
        "emit: started, 3 shards",
        "emit: 1 shards of 3 shards (33%), 0.0 shards/s, about 1 h 00 min left",
        "emit: done, 3 shards in 2 h 00 min",
    ]


def test_a_build_logging_to_a_file_shows_its_phases(tmp_path):
    """stderr is a file, as under nohup or SLURM: no bar, but a line for each phase."""
    log = tmp_path / "build.log"
    config = QUICKSTART.parent / "quickstart.yaml"
    command = [sys.executable, "-m", "packtool", "build", str(config), "-o", str(tmp_path / "out")]
    with log.open("w") as stderr:
        done = subprocess.run([*command, "--max-samples", "40"], stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert done.returncode == 0, log.read_text()
    phases = [line[9:] for line in log.read_text().splitlines()]
    assert phases[0].startswith("loading tokenizer ")
    for name in ("encode", "plan", "emit"):
        assert any(line.startswith(f"{name}: started, ") for line in phases), phases
        assert any(line.startswith(f"{name}: done, ") for line in phases), phases
    assert "\r" not in log.read_text()  # no bar redrawn into the log
    assert "wrote 1 shard(s)" in done.stdout
