"""The README's Hugging Face Trainer and TRL block runs as written, on the quickstart build (its training loop
and every other Python block of README.md and docs/ run in tests/test_docs_code.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from support import QUICKSTART

pytest.importorskip("torch", reason="the trainer block needs the loader extra (torch)")
pytest.importorskip("trl", reason="the trainer block runs TRL's SFTTrainer too (pip install trl)")

from test_docs_code import python_blocks


def test_the_readme_trainer_block_trains_on_the_quickstart(quickstart_build, tmp_path):
    """Run from a folder laid out as the README's commands leave it: out/quickstart and configs/quickstart."""
    shutil.copytree(quickstart_build, tmp_path / "out" / "quickstart")
    shutil.copytree(QUICKSTART / "tokenizer", tmp_path / "configs" / "quickstart" / "tokenizer")
    script = tmp_path / "trainers.py"
    (block,) = [b.code for b in python_blocks() if b.key == "README.md: Hugging Face Trainer and TRL"]
    script.write_text(block)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "hf").is_dir() and (tmp_path / "out" / "trl").is_dir()
