"""`packtool push OUT REPO`: upload a build to a Hugging Face dataset repo, as one commit.

    what goes up     exactly what the build wrote (builder.publish.built_entries): README.md (the card), the
                     manifests, rejects.jsonl and every listed shard, in OUT, overflow/ and validation/; none of
                     the user's files (a report, notes)
    checked first    `verify`: every byte against the sealed manifests; a damaged build is not uploaded
    refused          a file in the repo named like a build's output (a shard, a manifest) that this build does not
                     write: `datasets` would read an older build's shard as part of this one
    --dry-run        the files and their bytes, after the same checks; the repo is not contacted

Only `HfApi.list_repo_files`, `create_repo` and `create_commit` reach the network (tests replace them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packtool.builder.publish import built_entries, looks_built
from packtool.commands.verify import verify
from packtool.errors import PacktoolError
from packtool.format import read_manifest

__all__ = ["Push", "format_push", "push"]


@dataclass(frozen=True, slots=True)
class Push:
    """What was (or, in a dry run, would be) uploaded: repo paths and their bytes, and the commit made."""

    repo: str
    files: tuple[tuple[str, int], ...]
    dry_run: bool
    commit: str | None = None  # the commit's URL


def push(
    output: str | Path, repo: str, *, dry_run: bool = False, private: bool = False, revision: str | None = None
) -> Push:
    """Upload the build in `output` to the dataset repo `repo` (created when missing), or say what would go up."""
    output = Path(output)
    checked = verify(output)
    if not checked.ok:
        raise PacktoolError(
            f"{output}: not uploaded, `packtool verify` finds {len(checked.problems)} problem(s), the first: "
            f"{checked.problems[0]}"
        )
    names = sorted(built_entries(output))
    files = tuple((name, (output / name).stat().st_size) for name in names)
    if dry_run:
        return Push(repo, files, dry_run=True)
    api, hub = _hub()
    try:
        stale = [name for name in _repo_files(api, hub, repo, revision) if looks_built(name) and name not in names]
        if stale:
            raise PacktoolError(
                f"{repo} holds {', '.join(stale[:5])}, which this build does not write; `datasets` would read it "
                "as part of the build: delete it from the repo, or push to another one"
            )
        api.create_repo(repo, repo_type="dataset", private=private, exist_ok=True)
        operations = [hub.CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(output / name)) for name in names]
        manifest = read_manifest(output).raw
        info = api.create_commit(
            repo,
            operations,
            commit_message=f"packtool {manifest.get('packtool_version')}: build {str(manifest.get('plan_hash'))[:12]}",
            repo_type="dataset",
            revision=revision,
        )
    except (OSError, ValueError) as error:  # huggingface_hub's HTTP errors are OSErrors; a bad repo id a ValueError
        raise PacktoolError(f"{repo}: the upload failed ({type(error).__name__}: {error})") from None
    return Push(repo, files, dry_run=False, commit=str(getattr(info, "commit_url", info)))


def _hub() -> tuple[Any, Any]:
    try:
        import huggingface_hub
    except ImportError:
        raise PacktoolError(
            'packtool push needs huggingface_hub: pip install "packtool[hub]" (or pip install huggingface_hub)'
        ) from None
    return huggingface_hub.HfApi(), huggingface_hub


def _repo_files(api: Any, hub: Any, repo: str, revision: str | None) -> list[str]:
    """The repo's files; none for a repo that does not exist yet (create_repo makes it)."""
    try:
        return list(api.list_repo_files(repo, repo_type="dataset", revision=revision))
    except hub.errors.RepositoryNotFoundError:
        return []


def format_push(result: Push) -> str:
    total = sum(size for _, size in result.files)
    lines = [f"{name}  {size:,} bytes" for name, size in result.files]
    if result.dry_run:
        lines.append(f"dry run: {len(result.files)} file(s), {total:,} bytes would go to dataset {result.repo}")
    else:
        lines.append(f"{len(result.files)} file(s), {total:,} bytes uploaded to dataset {result.repo}: {result.commit}")
    return "\n".join(lines)
