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


@pytest.fixture(scope="session")
def quickstart_build(tmp_path_factory) -> Path:
    """One build of the bundled quickstart config, shared read-only by the tools tests (copy it to change it)."""
    from click.testing import CliRunner
    from support import QUICKSTART

    from packtool.cli import main

    out = tmp_path_factory.mktemp("quickstart") / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(out), "-q"])
    if result.exit_code != 0:
        raise RuntimeError(f"quickstart build failed: {result.output}")
    return out
