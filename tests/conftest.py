"""Shared fixtures. Real tokenizers and datasets live in ../shared/data (never copied into the repo)."""

from __future__ import annotations

import json
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


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a YAML config (given as a dict) into tmp_path and return its path."""
    import yaml

    def write(config: dict, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    return write


@pytest.fixture
def write_jsonl(tmp_path: Path):
    def write(rows: list, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
        return path

    return write
