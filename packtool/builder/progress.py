"""Progress of the build's phases on stderr: tqdm bars on a terminal, timestamped lines in a job log
(nohup, SLURM, CI), or nothing (library use, `-q`).

A job log cannot redraw a bar, so `LogProgress` writes one line when a phase starts, one every
`every` seconds while it runs (from a timer thread, so a phase whose one work item takes an hour,
such as one large JSON array, still shows it is running), and one when it ends:

    12:00:01 encode: started, 1.2 GB
    12:00:11 encode: 310.4 MB of 1.2 GB (25%), 31.0 MB/s, about 29 s left
    12:00:21 encode: 310.4 MB of 1.2 GB (25%), 15.5 MB/s, about 58 s left
    12:00:41 encode: done, 1.2 GB in 40 s

Before anything is done a phase's line says how long it has run (`encode: 0 B of 1.2 GB (0%), 10 s
so far`).

A build done within its first `QUIET_SECONDS` writes none of them: its summary follows at once, and
an error stays the one line it is. A longer one writes the lines held back so far, with the times
they happened, at its first update after that.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Protocol


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...


class Progress:
    """Silent: what `packtool.build` reports when nobody watches."""

    @contextmanager
    def phase(self, name: str, total: int, unit: str) -> Iterator[Bar]:
        yield _Silent()

    def step(self, message: str) -> None:
        """A short step without a measurable total (loading the tokenizer)."""


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


class BarProgress(Progress):
    """One tqdm bar per phase on stderr."""

    @contextmanager
    def phase(self, name: str, total: int, unit: str) -> Iterator[Bar]:
        from tqdm import tqdm

        scale = unit == "B"
        with tqdm(total=total, desc=name, unit=unit, unit_scale=scale, file=sys.stderr, leave=True) as bar:
            yield bar

    def step(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)


QUIET_SECONDS = 10.0


class LogProgress(Progress):
    """Lines for a log that is read later: a phase's start and end, and done/total, rate and ETA at
    most every `every` seconds between them (10 s: a day-long build writes ~9,000 lines, an hour's
    job log stays readable)."""

    def __init__(
        self,
        stream: IO[str] | None = None,
        every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        quiet_for: float | None = None,
        timer: bool = True,
    ) -> None:
        self.stream, self.every, self.clock, self.timer = stream, every, clock, timer
        self.speaks_at = clock() + (QUIET_SECONDS if quiet_for is None else quiet_for)
        self.held: list[str] | None = []  # None once the lines go out as they come
        self.lock = threading.Lock()  # the timer thread writes too

    def write(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        with self.lock:
            if self.held is not None and self.clock() < self.speaks_at:
                self.held.append(line)
                return
            stream = self.stream or sys.stderr
            print("\n".join([*(self.held or ()), line]), file=stream, flush=True)
            self.held = None

    def step(self, message: str) -> None:
        self.write(message)

    @contextmanager
    def phase(self, name: str, total: int, unit: str) -> Iterator[Bar]:
        line = _PhaseLine(self, name, total, unit)
        self.write(f"{name}: started, {_amount(total, unit)}")
        ended = threading.Event()
        timer = threading.Thread(target=line.tick, args=(ended,), name=f"progress-{name}", daemon=True)
        if self.timer:
            timer.start()
        try:
            yield line
        finally:
            ended.set()
            if self.timer:
                timer.join()
        self.write(f"{name}: done, {_amount(line.done, unit)} in {_duration(self.clock() - line.started)}")


class _PhaseLine:
    def __init__(self, log: LogProgress, name: str, total: int, unit: str) -> None:
        self.log, self.name, self.total, self.unit = log, name, total, unit
        self.done = 0
        self.started = self.last = log.clock()
        self.lock = threading.Lock()  # one line per interval, whichever thread finds it due

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done < self.total:  # the phase's end has a line of its own
            self.report()

    def tick(self, ended: threading.Event) -> None:
        """The timer thread: a line when one is due, though no work item ended since the last."""
        while not ended.wait(self.log.every / 10):
            self.report()

    def report(self) -> None:
        with self.lock:
            now = self.log.clock()
            if now - self.last < self.log.every:
                return
            self.last = now
        elapsed = now - self.started
        done = self.done
        rate = done / elapsed if elapsed > 0 else 0.0
        share = f" ({100 * done // self.total}%)" if self.total else ""
        if rate > 0:
            pace = f"{_amount(rate, self.unit)}/s, about {_duration((self.total - done) / rate)} left"
        else:
            pace = f"{_duration(elapsed)} so far"
        self.log.write(f"{self.name}: {_amount(done, self.unit)} of {_amount(self.total, self.unit)}{share}, {pace}")


def _amount(value: float, unit: str) -> str:
    """Bytes in B/kB/MB/GB (powers of 1000, as tqdm's bars show them); other units as counts."""
    if unit != "B":
        return f"{value:,.0f} {unit}" if value == int(value) else f"{value:,.1f} {unit}"
    for prefix in ("", "k", "M", "G"):
        if value < 1000:
            return f"{value:.0f} {prefix}B" if not prefix else f"{value:.1f} {prefix}B"
        value /= 1000
    return f"{value:.1f} TB"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
