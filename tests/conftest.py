"""Fixtures shared by the tests (paths and helpers live in support.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

# Timing deadlines flake on a loaded 2-core machine; CI also fixes the examples so a red run reproduces.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


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
