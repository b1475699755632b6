"""`audit` answers pass/warn/fail/skip with evidence, and shows the first failing sample.

qwen2.5 + glaive tool data   -> every check passes (the template speaks tools, masks line up)
gemma-3 + glaive tool data   -> rows and multi_turn_tools fail: Gemma's template refuses tool turns
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import SHARED_DATA

from packtool.commands.audit import STATUSES, AuditReport, audit, format_audit
from packtool.config import BuildConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DATA = SHARED_DATA
GLAIVE = DATA / "datasets" / "llamafactory_glaive_toolcall_en_demo.json"

CHECKS = {
    "empty_system_message",
    "consecutive_same_role",
    "multi_turn_tools",
    "assistant_markers",
    "bos_eos",
    "control_token_literals",
    "tool_call_json",
    "truncation_structured",
    "zero_targets",
    "targets_match_content",
    "text_bos",
    "template_injections",
    "template_source",
}


def _config(model: str, **extra) -> BuildConfig:
    if not GLAIVE.is_file() or not (DATA / "tokenizers" / model).is_dir():
        pytest.skip(f"shared test data not found at {DATA}")
    raw = {
        "sources": [{"name": "glaive", "path": str(GLAIVE), "format": "sharegpt"}],
        "tokenizer": str(DATA / "tokenizers" / model),
        "template": "model",
        "capacity": 4096,
        "output": "unused",
        **extra,
    }
    return parse_config(raw, base_dir=Path("/"))


@pytest.fixture(scope="module")
def qwen_glaive() -> AuditReport:
    return audit(_config("qwen2.5"), rows=40)


@pytest.fixture(scope="module")
def gemma_glaive() -> AuditReport:
    return audit(_config("gemma-3"), rows=40)


def test_every_check_reports_a_status_and_evidence(qwen_glaive: AuditReport) -> None:
    names = {c.name for c in qwen_glaive.checks}
    assert names >= CHECKS | {"rows:glaive"}
    for check in qwen_glaive.checks:
        assert check.status in STATUSES
        assert check.evidence


def test_qwen_on_glaive_tool_data_is_clean(qwen_glaive: AuditReport) -> None:
    assert qwen_glaive.ok, format_audit(qwen_glaive)
    statuses = {c.name: c.status for c in qwen_glaive.checks}
    # Qwen's template adds its default system prompt to rows without one: listed, not an error
    assert statuses.pop("template_injections") == "warn"
    assert "You are Qwen, created by Alibaba Cloud" in qwen_glaive.by_name("template_injections").evidence
    assert statuses.pop("text_bos") == "skip"  # no text source
    assert set(statuses.values()) == {"pass"}, format_audit(qwen_glaive)
    assert qwen_glaive.first_failure is None
    assert "parse back to the same object" in qwen_glaive.by_name("tool_call_json").evidence
    assert "<|im_start|>assistant" in qwen_glaive.by_name("assistant_markers").evidence
    assert "whole or gone" in qwen_glaive.by_name("truncation_structured").evidence
    literals = qwen_glaive.by_name("control_token_literals").evidence
    assert "tool-call arguments and tool descriptions stays plain text" in literals
    assert format_audit(qwen_glaive).endswith("OK")


def test_gemma_on_tool_data_reports_the_failures(gemma_glaive: AuditReport) -> None:
    assert not gemma_glaive.ok
    failed = {c.name for c in gemma_glaive.checks if c.status == "fail"}
    assert failed == {"rows:glaive", "multi_turn_tools"}, format_audit(gemma_glaive)
    assert "Conversation roles must alternate" in gemma_glaive.by_name("rows:glaive").evidence
    # rows without tool turns render, but Gemma prints no tool definitions: counted, named
    assert "template_dropped_tools x" in gemma_glaive.by_name("rows:glaive").evidence
    assert "rejected" in gemma_glaive.by_name("rows:glaive").evidence
    # A template that cannot express tools leaves nothing to check there: skipped, not passed.
    assert gemma_glaive.by_name("tool_call_json").status == "skip"
    # Refusing consecutive user turns is the template's choice; the audited rows have none.
    assert gemma_glaive.by_name("consecutive_same_role").status == "warn"
    sample_id, check, shown = gemma_glaive.first_failure
    assert check == "rows:glaive" and sample_id.startswith("glaive:")
    assert "Conversation roles must alternate" in shown and "tool call" in shown
    text = format_audit(gemma_glaive)
    assert "FAIL  rows:glaive" in text and f"first failing sample: {sample_id}" in text


def test_a_failing_tokenized_sample_is_shown_token_by_token() -> None:
    """A source that trains no role: every row has zero targets, and the probe shows why, token by token."""
    config = _config("qwen2.5")
    raw = {**config.raw, "output": "unused", "sources": [{**config.raw["sources"][0], "train": {"roles": []}}]}
    report = audit(parse_config(raw, base_dir=Path("/")), rows=5)
    assert not report.ok
    assert report.by_name("zero_targets").status == "fail"
    assert report.by_name("assistant_markers").status == "fail"
    _, check, shown = report.first_failure
    assert check == "assistant_markers"
    assert "idx       id  piece" in shown  # the `packtool inspect` layout
    assert "<|im_start|>" in shown


def test_quickstart_config_audits_clean() -> None:
    path = ROOT / "configs" / "quickstart.yaml"
    if not path.is_file():
        pytest.skip("no quickstart config")
    report = audit(load_config(path), rows=30)
    assert report.ok, format_audit(report)
    assert {c.name for c in report.checks} >= {"rows:chat", "rows:instructions", "rows:docs"}


def test_rows_must_not_be_negative() -> None:
    from packtool.errors import PacktoolError

    with pytest.raises(PacktoolError, match="rows must be >= 0"):
        audit(_config("qwen2.5"), rows=-1)


C4 = DATA / "datasets" / "llamafactory_c4_demo.jsonl"


def _text_config(tmp_path: Path, add_bos_token: object, **extra) -> BuildConfig:
    """Llama 3.2 with its own tokenizer_config.json, except add_bos_token."""
    folder = DATA / "tokenizers" / "llama-3.2"
    if not C4.is_file() or not folder.is_dir():
        pytest.skip(f"shared test data not found at {DATA}")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["add_bos_token"] = add_bos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    (tmp_path / "tokenizer.json").symlink_to(folder / "tokenizer.json")
    raw = {
        "sources": [{"name": "c4", "path": str(C4), "format": "text"}],
        "tokenizer": str(tmp_path),
        "capacity": 4096,
        "output": "unused",
        **extra,
    }
    return parse_config(raw, base_dir=tmp_path)


def test_text_documents_carry_the_tokenizers_bos(tmp_path: Path) -> None:
    report = audit(_text_config(tmp_path, None), rows=5)
    assert report.by_name("text_bos").status == "pass", format_audit(report)
    assert "5 text documents start with BOS" in report.by_name("text_bos").evidence


def test_audit_fails_when_text_documents_disagree_with_the_tokenizer(tmp_path: Path) -> None:
    # tokenizer_config.json says no BOS while the post-processor adds one: documents would differ from tokenizer(text)
    report = audit(_text_config(tmp_path, False), rows=5)
    check = report.by_name("text_bos")
    assert check.status == "fail" and not report.ok
    assert "5 of 5 text documents lack the BOS that tokenizer(text) adds" in check.evidence
    # said on purpose in the build config: a warning that names the setting
    again = tmp_path / "again"
    again.mkdir()
    chosen = audit(_text_config(again, None, add_bos=False), rows=5).by_name("text_bos")
    assert chosen.status == "warn" and "add_bos: false" in chosen.evidence


def test_the_audit_names_the_template_file_and_the_key_it_passed_over(tmp_path: Path) -> None:
    """chat_template.jinja wins over tokenizer_config.json's chat_template, as in transformers; both named."""
    path = ROOT / "configs" / "quickstart.yaml"
    folder = tmp_path / "tokenizer"
    shutil.copytree(path.parent / "quickstart" / "tokenizer", folder)
    key = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    (folder / "chat_template.jinja").write_text(key.replace("# Tools", "# Functions"), encoding="utf-8")
    report = audit(load_config(path, overrides=[f"tokenizer={folder}"]), rows=3)
    check = report.by_name("template_source")
    assert check.status == "warn"
    assert check.evidence.startswith("model (chat_template.jinja; tokenizer_config.json's chat_template (default)")
    assert "WARN  template_source" in format_audit(report)
    (folder / "chat_template.jinja").write_text(key, encoding="utf-8")  # the same text: nothing passed over
    again = audit(load_config(path, overrides=[f"tokenizer={folder}"]), rows=3)
    assert (again.by_name("template_source").status, again.by_name("template_source").evidence) == (
        "pass",
        "model (chat_template.jinja)",
    )
