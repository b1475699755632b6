"""rejects.jsonl at scale (issue 43): each encode work item's rejects are a table beside its partition and the plan
streams them, merged with its own drops, into PLAN/rejects.jsonl. The lines below were written by the build before
that change (rejects held as a list of dicts): every kind of loss, in input order, keeps its bytes."""

from __future__ import annotations

import json

import pytest
from support import QUICKSTART

import packtool.builder.encode as encode_phase
from packtool.builder import build
from packtool.config import load_config
from packtool.errors import BuildError, PacktoolError

EVAL = "the quick brown fox jumps over the lazy dog near the river bank"
PARSE = "not valid JSON: Expecting property name enclosed in double quotes (column 2)"
NO_TARGET = "no token of this sample is a target (check the train policy and template)"
SPELLS = "messages[1].content spell(s) a special token (special_tokens: reject; escape keeps the text as plain text)"
OVERLAP = {"field": "text", "file": "eval.jsonl", "overlap": EVAL, "part": "target", "record": "eval.jsonl:1"}
EXPECTED = [
    {"detail": PARSE, "id": "a:a.jsonl:2", "location": "a.jsonl:2", "reason": "parse_error", "source": "a"},
    {"detail": NO_TARGET, "id": "a2", "location": "a.jsonl:3", "reason": "no_targets", "source": "a"},
    {
        "detail": "same tokens and targets as 'a0' (a.jsonl:1), which is kept",
        "duplicate_of": "a0",
        "id": "a3",
        "location": "a.jsonl:4",
        "reason": "duplicate",
        "source": "a",
    },
    {"detail": SPELLS, "id": "a4", "location": "a.jsonl:5", "reason": "special_token_literal", "source": "a"},
    {
        "detail": "324 tokens > capacity 128 (truncation: drop)",
        "id": "a5",
        "location": "a.jsonl:6",
        "reason": "too_long",
        "source": "a",
    },
    {
        "detail": f"target overlaps eval eval.jsonl:1 field 'text' (exact): '{EVAL}'",
        "eval": {**OVERLAP, "rule": "exact"},
        "id": "a6",
        "location": "a.jsonl:7",
        "reason": "contaminated",
        "source": "a",
    },
    {"detail": PARSE, "id": "a:a.jsonl:9", "location": "a.jsonl:9", "reason": "parse_error", "source": "a"},
    {"detail": PARSE, "id": "b:b.jsonl:2", "location": "b.jsonl:2", "reason": "parse_error", "source": "b"},
    {
        "detail": "same tokens and targets as 'a7' (a.jsonl:8), which is kept",
        "duplicate_of": "a7",
        "id": "b2",
        "location": "b.jsonl:3",
        "reason": "duplicate",
        "source": "b",
    },
    {"detail": NO_TARGET, "id": "b13", "location": "b.jsonl:4", "reason": "no_targets", "source": "b"},
]


def _chat(i: int, prefix: str = "a", system: str | None = "", user: str = "") -> dict:
    messages = [{"role": "user", "content": user or f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system or f"be brief {i}"})
    return {"id": f"{prefix}{i}", "messages": messages}


@pytest.fixture
def lossy(tmp_path, write_config, write_jsonl):
    """Source a loses a record each way there is (bad JSON, no target, a copy under dedup, a special-token literal,
    too long under truncation: drop, an eval overlap); source b, cut by max_samples 4 inside its one work item,
    a bad line, a copy of a's and a record without target within its budget, more past it."""
    write_jsonl(
        [
            _chat(0),
            "{not json",
            _chat(2, system=None),
            {**_chat(0), "id": "a3"},
            _chat(4, user="say <|im_start|>system"),
            _chat(5, system=" ".join(["long"] * 300)),
            _chat(6, system=EVAL),
            _chat(7),
            "{not json either",
            _chat(9),
        ],
        "a.jsonl",
    )
    write_jsonl(
        [
            _chat(10, "b"),
            "{broken",
            {**_chat(7), "id": "b2"},
            _chat(13, "b", system=None),
            "{past the budget",
            _chat(15, "b"),
        ],
        "b.jsonl",
    )
    write_jsonl([{"text": EVAL}], "eval.jsonl")
    source = {"format": "messages", "fields": {"id": "id"}, "train": {"roles": ["system"]}, "special_tokens": "reject"}
    raw = {
        "sources": [
            {"name": "a", "path": "a.jsonl", **source},
            {"name": "b", "path": "b.jsonl", "max_samples": 4, **source},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 128,
        "output": "out",
        "on_error": "skip",
        "dedup": "exact",
        "truncation": {"strategy": "drop"},
        "max_reject_share": 0.9,
        "decontamination": {"against": "eval.jsonl", "ngram": 8},
    }
    return write_config, raw


def test_every_loss_is_listed_in_input_order_with_the_bytes_of_before(tmp_path, lossy):
    write_config, raw = lossy
    built = build(load_config(write_config(raw)))
    lines = (tmp_path / "out" / "rejects.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == EXPECTED
    assert lines == [json.dumps(entry, ensure_ascii=False, sort_keys=True) for entry in EXPECTED]
    by_reason = {"contaminated": 1, "duplicate": 2, "no_targets": 2, "parse_error": 3, "special_token_literal": 1}
    assert built.manifest["rejects"] == {
        "file": "rejects.jsonl",
        "count": 10,
        "by_reason": {**by_reason, "too_long": 1},
    }
    a, b = built.manifest["accounting"]["a"], built.manifest["accounting"]["b"]
    assert (a["read"], a["kept"], a["rejected"], a["special_token_literals"]) == (10, 3, {"parse_error": 2}, 1)
    assert a["dropped"] == {
        "contaminated": 1,
        "duplicate": 1,
        "no_targets": 1,
        "special_token_literal": 1,
        "too_long": 1,
    }
    # b's work item cut at its 4th record: its rejects before it, counted from its table
    assert (b["read"], b["kept"], b["rejected"], b["dropped"]) == (
        4,
        1,
        {"parse_error": 1},
        {"duplicate": 1, "no_targets": 1},
    )
    preview = build(load_config(write_config(raw)), dry_run=True).manifest
    assert preview["rejects"] == {"count": 10, "by_reason": built.manifest["rejects"]["by_reason"]}


def test_a_failure_names_the_first_rejects_and_writes_them_all(tmp_path, lossy):
    write_config, raw = lossy
    with pytest.raises(BuildError) as failed:
        build(load_config(write_config({**raw, "max_reject_share": 0.3})))
    message = str(failed.value)
    assert f"first rejects:\n  a.jsonl:2: [parse_error] {PARSE}\n  a.jsonl:3: [no_targets] {NO_TARGET}" in message
    assert "... 7 more\nall 10 rejects:" in message
    written = tmp_path / ".out.packtool-rejects.jsonl"
    assert [json.loads(line) for line in written.read_text(encoding="utf-8").splitlines()] == EXPECTED


def test_on_error_fail_stops_at_the_first_bad_record_of_a_reused_entry(tmp_path, lossy, monkeypatch):
    """The entries written under skip are reused, nothing read again: the message comes from the entry's rejects
    table (its first row with one: a record dropped before it carries none)."""
    write_config, raw = lossy
    build(load_config(write_config(raw)))
    monkeypatch.setattr(encode_phase, "read_file", lambda *args, **kwargs: pytest.fail("a reused entry reads"))
    with pytest.raises(PacktoolError, match=r"^a\.jsonl:2: not valid JSON: .* \[parse_error\] \(on_error: skip sends"):
        build(load_config(write_config({**raw, "on_error": "fail"}), workers="1"))
