"""`packtool decontaminate OUT --against EVAL`: a build made without decontamination, checked afterwards."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.builder import build
from packtool.cli import main
from packtool.config import load_config
from packtool.format import sha256_file

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "ze", "po"]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) for _ in range(words)).capitalize() + "."


@pytest.fixture
def out(tmp_path, write_config, write_jsonl):
    rng = random.Random(3)
    chats = [
        {
            "id": f"chat-{i}",
            "messages": [
                {"role": "user", "content": _sentence(rng, 12)},
                {"role": "assistant", "content": _sentence(rng, 30)},
            ],
        }
        for i in range(12)
    ]
    write_jsonl(chats, "chat.jsonl")
    answer = chats[4]["messages"][1]["content"].split()
    write_jsonl([{"id": "q1", "answer": "\n".join(" ".join(answer[i : i + 8]) for i in range(0, 30, 8))}], "hit.jsonl")
    write_jsonl([{"id": "q2", "question": chats[7]["messages"][0]["content"], "answer": "B"}], "prompt.jsonl")
    raw = {
        "sources": [{"name": "chat", "path": "chat.jsonl", "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        "workers": 1,
        "executor": "serial",
    }
    return build(load_config(write_config(raw))).output


def test_a_copied_answer_is_found_named_and_fails(out, tmp_path):
    report_path = tmp_path / "report.json"
    args = ["decontaminate", str(out), "--against", str(tmp_path / "hit.jsonl"), "-o", str(report_path), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    report = json.loads(report_path.read_text())
    assert report == json.loads(result.output)
    assert [(e["id"], e["eval"]["record"], e["eval"]["part"]) for e in report["contaminated"]] == [
        ("chat-4", f"{tmp_path / 'hit.jsonl'}:1 (id q1)", "target")
    ]
    assert report["decontamination"]["against"][0]["sha256"] == sha256_file(tmp_path / "hit.jsonl")
    assert report["documents"] == 12 and report["prompt_only"] == []


def test_a_prompt_overlap_is_listed_and_passes(out, tmp_path):
    result = CliRunner().invoke(main, ["decontaminate", str(out), "--against", str(tmp_path / "prompt.jsonl")])
    assert result.exit_code == 0, result.output
    assert "contaminated (in targets): 0" in result.output and "in prompts only: 1" in result.output
    assert "chat-7" in result.output


def test_a_missing_eval_file_is_one_line(out, tmp_path):
    result = CliRunner().invoke(main, ["decontaminate", str(out), "--against", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 1
    assert "decontamination.against: no file matches" in result.output and "Traceback" not in result.output
