"""The README's Hugging Face Trainer and TRL block runs as written, on the quickstart build."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from support import QUICKSTART, REPO

from packtool.format import read_manifest

pytest.importorskip("torch", reason="the trainer block needs the loader extra (torch)")
pytest.importorskip("trl", reason="the trainer block runs TRL's SFTTrainer too (pip install trl)")


def _block(heading: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


def test_the_readme_trainer_block_trains_on_the_quickstart(quickstart_build, tmp_path):
    """Run from a folder laid out as the README's commands leave it: out/quickstart and configs/quickstart."""
    shutil.copytree(quickstart_build, tmp_path / "out" / "quickstart")
    shutil.copytree(QUICKSTART / "tokenizer", tmp_path / "configs" / "quickstart" / "tokenizer")
    script = tmp_path / "trainers.py"
    script.write_text(_block("### Hugging Face Trainer and TRL"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "hf").is_dir() and (tmp_path / "out" / "trl").is_dir()


# What the README's loop leaves to the reader: a model, its optimizer, micro-batches per step, a logger.
LOOP_PREAMBLE = """
import json
import torch
import transformers

torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2)).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accum, logged, checkpoint = 2, [], {}
log = logged.append
"""
LOOP_EPILOGUE = """
targets = sum(m["target_tokens"] for m in logged)
print(json.dumps({"windows": len(logged), "state": checkpoint["data"], "targets": targets}))
"""


def test_the_readme_loop_runs_three_epochs_as_written(tmp_path):
    """On the quickstart cut to its first 40 records a source (three epochs of the whole one take minutes)."""
    config = REPO / "configs" / "quickstart.yaml"
    build = [
        sys.executable,
        "-m",
        "packtool",
        "build",
        str(config),
        "-o",
        "out/quickstart",
        "--max-samples",
        "40",
        "-q",
    ]
    subprocess.run(build, cwd=tmp_path, check=True, capture_output=True)
    script = tmp_path / "loop.py"
    script.write_text(LOOP_PREAMBLE + _block("## A training loop") + LOOP_EPILOGUE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]  # no traceback at exit from the read-ahead threads
    result = json.loads(done.stdout.strip().splitlines()[-1])
    built = read_manifest(tmp_path / "out" / "quickstart")
    # three whole epochs (every pack's targets three times; one rank leaves none out), then the loop ends
    assert result["targets"] == 3 * built.raw["stats"]["targets"] and result["windows"] >= 3
    assert result["state"]["epoch"] == 2  # a state taken at an epoch's end names that epoch
