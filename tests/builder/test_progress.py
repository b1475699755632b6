"""Progress in a job log: a line per phase start and end, and done/total, rate and ETA at most every
10 s between them; a real build written to a file shows its phases."""

from __future__ import annotations

import io
import re
import time

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
    log = LogProgress(stream, every=10, clock=clock, quiet_for=0, timer=False)
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
    log = LogProgress(stream, every=10, clock=clock, quiet_for=0, timer=False)
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


def test_a_quick_build_writes_no_line_and_a_longer_one_writes_what_was_held_back():
    clock, stream = _Clock(), io.StringIO()
    quick = LogProgress(stream, every=10, clock=clock, quiet_for=10, timer=False)
    quick.step("loading tokenizer tok.json")
    with quick.phase("plan", 1, "plan") as bar:
        clock.now += 9
        bar.update(1)
    assert stream.getvalue() == ""  # the summary follows at once; an error stays one line
    with quick.phase("emit", 2, "shards") as bar:
        clock.now += 2
        bar.update(1)
        bar.update(1)
    assert _lines(stream) == [
        "loading tokenizer tok.json",
        "plan: started, 1 plan",
        "plan: done, 1 plan in 9 s",
        "emit: started, 2 shards",
        "emit: done, 2 shards in 2 s",
    ]


def test_a_phase_whose_work_has_not_ended_still_writes_its_line():
    """Lines came only when a work item ended: a build of one large JSON array (one item) wrote nothing
    until it was done. The timer thread writes the due line; before any work ends it says how long so far."""
    stream = io.StringIO()
    log = LogProgress(stream, every=0.2, quiet_for=0)
    with log.phase("encode", 3_000, "B") as bar:
        time.sleep(0.7)  # one work item, running
        bar.update(1_000)
        time.sleep(0.5)
    lines = _lines(stream)
    assert lines[0] == "encode: started, 3.0 kB" and lines[-1].startswith("encode: done, 1.0 kB in ")
    running = lines[1:-1]
    assert len(running) >= 2, lines
    assert re.fullmatch(r"encode: 0 B of 3\.0 kB \(0%\), \d+ s so far", running[0]), running
    assert re.fullmatch(r"encode: 1\.0 kB of 3\.0 kB \(33%\), .*B/s, about \d+ s left", running[-1]), running


def test_a_build_logging_to_a_file_shows_its_phases(tmp_path, monkeypatch):
    """stderr is not a terminal, as under nohup or SLURM: no bar, but a line for each phase (the
    quickstart cut to 40 records builds within the quiet first seconds, which are set to none here)."""
    from click.testing import CliRunner

    from packtool.builder import progress
    from packtool.cli import main

    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    config = QUICKSTART.parent / "quickstart.yaml"
    result = CliRunner().invoke(main, ["build", str(config), "-o", str(tmp_path / "out"), "--max-samples", "40"])
    assert result.exit_code == 0, result.output
    phases = [line[9:] for line in result.stderr.splitlines()]
    assert phases[0].startswith("loading tokenizer ")
    for name in ("encode", "plan", "emit"):
        assert any(line.startswith(f"{name}: started, ") for line in phases), phases
        assert any(line.startswith(f"{name}: done, ") for line in phases), phases
    assert "\r" not in result.stderr  # no bar redrawn into the log
    assert "wrote 1 shard(s)" in result.stdout
