"""A build against an eval set: the samples whose targets copy an eval answer are dropped as `contaminated`, named
with the eval record, counted per source and in the manifest (with the eval file's sha256), and verify agrees."""

from __future__ import annotations

import json
import random

import pytest
from support import QUICKSTART

from packtool.builder import build
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.format import read_manifest, sha256_file

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "ze", "po", "da", "fe"]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) for _ in range(words)).capitalize() + "."


def _data(tmp_path, write_jsonl):
    rng = random.Random(7)
    chats = [
        {
            "id": f"chat-{i}",
            "messages": [
                {"role": "user", "content": _sentence(rng, 12)},
                {"role": "assistant", "content": _sentence(rng, 30)},
            ],
        }
        for i in range(20)
    ]
    alpaca = [{"instruction": _sentence(rng, 10), "input": "", "output": _sentence(rng, 40)} for _ in range(20)]
    write_jsonl(chats, "chat.jsonl")
    write_jsonl(alpaca, "alpaca.jsonl")
    output = alpaca[11]["output"].split()[3:35]  # 32 words of an output, in 8-word lines, capitalized
    rewrapped = "\n".join(" ".join(output[i : i + 8]) for i in range(0, len(output), 8))
    evals = [
        {
            "id": "ev-a",
            "question": "Something else entirely, asked here.",
            "answer": chats[5]["messages"][1]["content"],
        },
        {"id": "ev-b", "question": "Another unrelated question.", "choices": ["x", rewrapped.upper()]},
        {"id": "ev-c", "question": chats[8]["messages"][0]["content"], "answer": "A"},  # a copied prompt: reported
    ]
    return write_jsonl(evals, "eval.jsonl")


def _config(tmp_path, write_config, **decontamination):
    raw = {
        "sources": [
            {"name": "chat", "path": "chat.jsonl", "format": "messages", "fields": {"id": "id"}},
            {"name": "instructions", "path": "alpaca.jsonl", "format": "alpaca"},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 512,
        "output": "out",
        "workers": 1,
        "executor": "serial",
        "decontamination": {"against": ["eval.jsonl"], **decontamination},
    }
    return load_config(write_config(raw))


@pytest.fixture
def built(tmp_path, write_config, write_jsonl):
    eval_file = _data(tmp_path, write_jsonl)
    config = _config(tmp_path, write_config)
    return build(config), eval_file, config


def test_a_copied_answer_and_a_rewrapped_output_drop_exactly_those_samples(built):
    result, eval_file, _ = built
    out = result.output
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [
        ("chat-5", "contaminated"),
        ("instructions:alpaca.jsonl:12", "contaminated"),
    ]
    assert rejects[0]["eval"]["record"] == "eval.jsonl:1 (id ev-a)" and rejects[0]["eval"]["part"] == "target"
    assert rejects[1]["eval"]["record"] == "eval.jsonl:2 (id ev-b)" and rejects[1]["eval"]["field"] == "choices[1]"
    assert "eval.jsonl:2 (id ev-b)" in rejects[1]["detail"] and len(rejects[1]["eval"]["overlap"].split()) == 13

    manifest = read_manifest(out).raw
    record = manifest["decontamination"]
    assert record["against"][0]["file"] == "eval.jsonl"
    assert record["against"][0]["sha256"] == sha256_file(eval_file)
    assert (record["contaminated"], record["reported"]) == (2, 1)  # chat-8's prompt is ev-c's question: reported
    assert record["sources"] == {
        "chat": {"contaminated": 1, "reported": 1},
        "instructions": {"contaminated": 1, "reported": 0},
    }
    assert manifest["accounting"]["chat"]["dropped"] == {"contaminated": 1}
    assert manifest["accounting"]["chat"]["contamination_reported"] == 1
    assert verify(out).ok


def test_a_changed_eval_file_checks_again_and_the_prompt_action_drops(tmp_path, write_config, built):
    _, eval_file, _ = built
    eval_file.write_text(eval_file.read_text().splitlines()[2] + "\n")  # only ev-c, the copied prompt
    again = build(_config(tmp_path, write_config, prompt_action="drop"))
    assert again.encode_reused == 0
    rejects = [json.loads(line) for line in (again.output / "rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["eval"]["part"], r["eval"]["rule"]) for r in rejects] == [("chat-8", "prompt", "exact")]
    assert read_manifest(again.output).raw["decontamination"]["against"][0]["sha256"] == sha256_file(eval_file)


def test_verify_names_a_record_that_disagrees_with_the_accounting(built):
    from packtool.format import write_manifest

    result, _, _ = built
    manifest = read_manifest(result.output).raw
    manifest["decontamination"]["sources"]["chat"]["contaminated"] = 0
    write_manifest(result.output, {k: v for k, v in manifest.items() if k != "manifest_sha256"})
    problems = verify(result.output).problems
    assert any("decontamination.sources.chat.contaminated" in p for p in problems), problems
