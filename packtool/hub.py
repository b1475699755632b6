"""Data and tokenizers where Hugging Face users keep them: the local hub cache and `save_to_disk` folders.

Offline only: nothing here downloads. The hub cache is laid out by `huggingface_hub`:

    $HF_HUB_CACHE (else $HF_HOME/hub, else ~/.cache/huggingface/hub)
      datasets--ORG--NAME/                 models--ORG--NAME/ for tokenizers
        refs/main                          a file holding the commit hash of that revision
        snapshots/<commit>/data/train-00000-of-00001.parquet   (links into blobs/)

A `datasets` `save_to_disk` folder is either one split (`state.json` lists its `.arrow` files)
or a DatasetDict (`dataset_dict.json` lists the splits, one such folder each).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from packtool.errors import HubError

# ORG/NAME as the Hub spells repository ids (an optional @revision is split off first).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
# Files a dataset snapshot may hold records in; READMEs, scripts and metadata are not data.
DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".jsonl.gz", ".jsonl.zst", ".json.gz")


def hub_cache() -> Path:
    """Where huggingface_hub keeps its cache: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def is_repo_id(value: str) -> bool:
    """True for `ORG/NAME` (optionally `@revision`): worth a look in the cache when no local path matches."""
    return _REPO_ID.fullmatch(value.split("@", 1)[0]) is not None


def _repo_folder(repo_id: str, kind: str) -> Path:
    return hub_cache() / f"{kind}--{repo_id.split('@', 1)[0].replace('/', '--')}"


def in_cache(repo_id: str, kind: str) -> bool:
    """Whether the local cache holds any revision of the repository."""
    return _repo_folder(repo_id, kind).is_dir()


def snapshot(repo_id: str, kind: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of a dataset (`kind="datasets"`) or model (`"models"`) repository.

    `revision` is a branch or tag with a file under refs/, or a full commit hash; None means `main`.
    """
    if "@" in repo_id and revision is None:
        repo_id, revision = repo_id.split("@", 1)
    folder = _repo_folder(repo_id, kind)
    if not folder.is_dir():
        raise HubError(
            f"{repo_id}: not a local path and not in the local Hugging Face cache (looked for {folder}; "
            f"set HF_HUB_CACHE or HF_HOME, or download it first: "
            f"hf download {'--repo-type dataset ' if kind == 'datasets' else ''}{repo_id})"
        )
    revision = revision or "main"
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    target = folder / "snapshots" / commit
    if not target.is_dir():
        cached = sorted(p.name for p in (folder / "refs").glob("*")) + sorted(
            p.name for p in (folder / "snapshots").glob("*")
        )
        listing = ", ".join(cached) or "none"
        raise HubError(f"{repo_id}: revision {revision!r} is not in the local cache {folder} (cached: {listing})")
    return target


def saved_dataset_files(folder: Path, split: str | None) -> list[Path] | None:
    """The `.arrow` files of a `save_to_disk` folder, for `split` (default train) of a DatasetDict.

    None when the folder is not a saved dataset.
    """
    splits_file = folder / "dataset_dict.json"
    if splits_file.is_file():
        splits = _json(splits_file).get("splits", [])
        chosen = split or "train"
        if chosen not in splits:
            raise HubError(
                f"{folder}: no split {chosen!r} in this DatasetDict (splits: {', '.join(splits)}); set split"
            )
        folder = folder / chosen
    elif split is not None and (folder / split / "state.json").is_file():
        folder = folder / split
    state = folder / "state.json"
    if not state.is_file():
        return None
    entries = _json(state).get("_data_files", [])
    files = [folder / entry["filename"] for entry in entries if isinstance(entry, dict) and "filename" in entry]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise HubError(f"{state}: lists data files that are not there: {', '.join(missing) or 'none listed'}")
    return files


def dataset_repo_files(root: Path, split: str | None) -> list[Path]:
    """The data files of a cached dataset snapshot, for one split when its files are named by split.

    Hub datasets name files by split (`data/train-00000-of-00002.parquet`, `train.jsonl`,
    `train/part-0.jsonl`); with no file of the split (default train) and no split asked for,
    every data file is read.
    """
    saved = saved_dataset_files(root, split)
    if saved is not None:
        return saved
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(DATA_SUFFIXES))
    chosen = split or "train"
    of_split = [p for p in files if _in_split(p.relative_to(root), chosen)]
    if of_split:
        return of_split
    if split is not None or not files:
        found = ", ".join(str(p.relative_to(root)) for p in files[:5]) or "no data files"
        raise HubError(f"{root}: no data files for split {chosen!r} (found: {found})")
    return files


def _in_split(relative: Path, split: str) -> bool:
    name = relative.name.split(".", 1)[0]
    return split in relative.parts[:-1] or name == split or name.startswith((f"{split}-", f"{split}_"))


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HubError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise HubError(f"{path}: expected a JSON object")
    return value
