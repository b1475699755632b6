"""Paths shared by the tests. Real tokenizers and datasets live in ../shared/data (never copied into the repo)."""

from __future__ import annotations

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
