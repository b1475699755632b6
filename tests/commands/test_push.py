"""`packtool push`: what the build wrote goes up in one commit, checked first; only the transport is replaced."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from packtool.cli import main

hub = pytest.importorskip("huggingface_hub")


class Transport:
    """Stands in for HfApi's three network calls; records what they were asked."""

    def __init__(self, remote: list[str] | None = None) -> None:
        self.remote = remote  # None: the repo does not exist yet
        self.commits: list[tuple[str, list, str]] = []
        self.created: list[tuple[str, bool]] = []

    def install(self, monkeypatch) -> Transport:
        transport = self

        def list_repo_files(api, repo, *, repo_type=None, revision=None, token=None):
            if transport.remote is None:
                missing = hub.errors.RepositoryNotFoundError
                raise missing.__new__(missing)  # its constructor wants the HTTP response
            return transport.remote

        def create_repo(api, repo, *, repo_type=None, private=None, exist_ok=False, **_):
            transport.created.append((repo, bool(private)))

        def create_commit(api, repo, operations, *, commit_message, repo_type=None, revision=None, **_):
            transport.commits.append((repo, list(operations), commit_message))
            return hub.CommitInfo(
                commit_url=f"https://huggingface.co/datasets/{repo}/commit/abc",
                commit_message=commit_message,
                commit_description="",
                oid="abc",
            )

        monkeypatch.setattr(hub.HfApi, "list_repo_files", list_repo_files)
        monkeypatch.setattr(hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(hub.HfApi, "create_commit", create_commit)
        return self


@pytest.fixture
def build_copy(quickstart_build, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(quickstart_build, out)
    (out / "report.html").write_text("<html>mine</html>")  # the user's: never uploaded
    return out


def _built(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "report.html")


def test_a_dry_run_lists_what_the_build_wrote_and_contacts_nothing(build_copy, monkeypatch):
    transport = Transport().install(monkeypatch)
    monkeypatch.setattr(hub.HfApi, "list_repo_files", lambda *a, **k: pytest.fail("the dry run contacted the Hub"))
    result = CliRunner().invoke(main, ["push", str(build_copy), "me/packs", "--dry-run"])
    assert result.exit_code == 0, result.output
    listed = [line.split("  ")[0] for line in result.output.splitlines()[:-1]]
    assert listed == _built(build_copy) and "README.md" in listed and "report.html" not in result.output
    assert "would go to dataset me/packs" in result.output and transport.commits == []


def test_a_push_uploads_the_build_in_one_commit(build_copy, monkeypatch):
    transport = Transport().install(monkeypatch)
    result = CliRunner().invoke(main, ["push", str(build_copy), "me/packs", "--private"])
    assert result.exit_code == 0, result.output
    ((repo, operations, message),) = transport.commits
    assert repo == "me/packs" and transport.created == [("me/packs", True)] and message.startswith("packtool ")
    assert sorted(op.path_in_repo for op in operations) == _built(build_copy)
    assert "uploaded to dataset me/packs: https://huggingface.co/datasets/me/packs/commit/abc" in result.output


def test_an_older_build_s_shard_in_the_repo_is_refused_before_anything_is_sent(build_copy, monkeypatch):
    transport = Transport(remote=["README.md", "shard-00000.parquet", "shard-00099.parquet", "notes.md"])
    transport.install(monkeypatch)
    result = CliRunner().invoke(main, ["push", str(build_copy), "me/packs"])
    assert result.exit_code == 1 and "me/packs holds shard-00099.parquet" in result.output
    assert transport.commits == [] and transport.created == []


def test_a_damaged_build_is_not_uploaded(build_copy, monkeypatch):
    transport = Transport().install(monkeypatch)
    card = build_copy / "README.md"
    card.write_text(card.read_text() + "edited\n")
    result = CliRunner().invoke(main, ["push", str(build_copy), "me/packs", "--dry-run"])
    assert result.exit_code == 1 and "not uploaded, `packtool verify` finds 1 problem(s)" in result.output
    assert "README.md" in result.output and transport.commits == []
