"""Paths shared by the tests. Real tokenizers and datasets live in ../shared/data (never copied into the repo)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
QUICKSTART = REPO / "configs" / "quickstart"


def shared(*parts: str) -> Path:
    """A path inside ../shared/data; the test is skipped when the folder is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


def ctrl_c_reaches_child() -> None:
    """`preexec_fn` for a subprocess a test interrupts with SIGINT, as Ctrl-C in a terminal would.

    A shell runs a background job (`.ci/run &`, nohup) with SIGINT ignored and children inherit
    that, so Python would not install its KeyboardInterrupt handler and the signal would be lost;
    the child gets the default back here, before it starts Python.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
