"""Every inspecting command speaks JSON for machines (`--json`), and shell completion is documented."""

from __future__ import annotations

import json

from click.testing import CliRunner
from support import QUICKSTART, REPO

from packtool.cli import main


def _json(*args: str, exit_code: int = 0) -> dict:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == exit_code, result.output
    return json.loads(result.output)


def test_audit_json():
    report = _json("audit", str(QUICKSTART.parent / "quickstart.yaml"), "--rows", "5")
    assert report["ok"] is True and report["rows"] == 5
    assert report["checks"] and all({"name", "status", "evidence"} <= check.keys() for check in report["checks"])
    assert {check["status"] for check in report["checks"]} <= {"pass", "warn", "fail", "skip"}


def test_verify_inspect_find_stats_json(quickstart_build):
    assert _json("verify", str(quickstart_build))["ok"] is True
    assert _json("inspect", str(quickstart_build), "--limit", "1")["packs"][0]["row"] == 0
    assert _json("find", str(quickstart_build), "qs-chat-00001")["placements"]
    assert _json("stats", str(quickstart_build))["packs"] > 0


def test_the_inspecting_commands_are_in_the_readme_and_completion_is_documented():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for command in ("inspect", "stats", "verify", "find", "report", "audit"):
        assert command in main.commands and f"packtool {command}" in readme, command
    assert "_PACKTOOL_COMPLETE=bash_source packtool" in readme
    assert "_PACKTOOL_COMPLETE=zsh_source packtool" in readme
