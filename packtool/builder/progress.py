"""Progress of the build's phases: totals and ETA on stderr, or nothing (library use, `-q`, not a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


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
