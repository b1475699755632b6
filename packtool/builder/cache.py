"""The token store as a cache: encoded partitions addressed by everything they depend on.

    CACHE/packtool-owned.json         marks the folder as a packtool cache (builder.owned); nothing else is touched
    CACHE/packtool.lock               shared by the builds using the cache, exclusive for `cache clear`
    CACHE/tokens/ab/abcdef....arrow          one encode work item's samples (Arrow IPC, see builder.store)
    CACHE/tokens/ab/abcdef....rejects.arrow  its records not stored, each with its reason (Arrow IPC, builder.store)
    CACHE/tokens/ab/abcdef....json           its report (counts by reason); written last, sealed:
                                             {..., "key", "partition_bytes", "partition_sha256", "rejects_bytes",
                                              "rejects_sha256", "entry_sha256"}
    CACHE/files/ab/abcdef....json     per input file, its ranges at the last build (builder.reencoded)

An entry's key hashes the content of its row range of the input file (the bytes of JSON Lines lines, the
values of Parquet and Arrow rows, the decompressed text of compressed JSON Lines; the whole file for JSON
arrays, see packtool.ranges.RowRange) and where
the range starts, the tokenizer and template by content, the source's
render/tokenize settings and packtool's code (every module, code_fingerprint), so a stale entry is
never looked up. Entries are write-once: written under a temporary name and renamed, report last, so
two builds sharing a cache write identical bytes to the same name and a reader sees an entry whole or not at all.

Nothing read back is trusted: before reuse, the report must name its own key and hash to its seal,
and the partition and its rejects table must have the bytes and sha256 the report recorded when they were
written. An entry
that fails (a changed byte, a zeroed or truncated file, an entry swapped with another) is encoded
again and reported, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import packtool
from packtool.builder.owned import fresh_temporary, is_marked, locked
from packtool.builder.store import rejects_path
from packtool.config import (
    ITEM_FORMATS,
    BuildConfig,
    SourceConfig,
    canonical_json,
    item_fit_parts,
    keyed_parts,
    source_encode_settings,
)
from packtool.decontamination import eval_set_key
from packtool.errors import OwnershipError
from packtool.format import sha256_file

CACHE_DIR = ".packtool-cache"
# The layout and report of an entry: part of every key, so entries of another layout are never looked up.
# 3: keyed by the content of the row range, not of the whole file; 4: settings hashed as whole config
# sections, Parquet and Arrow ranges keyed by their rows, and a report says what its content hash covered
# (builder.encode.carried_prefix); 5: a report records the lines or rows its partition was encoded from, which
# the read stops at (content_lines); 6: a partition holds each sample's images (builder.store.IMAGE_TYPE); 7: the
# rejects go to a table beside the partition, whose rows hold their straddling targets and reported overlaps
# (the report keeps counts only)
CACHE_VERSION = 7
CACHE_FOLDERS = ("tokens", "files")  # the entries; the per-file index of the last build (builder.reencoded)
CACHE_KIND = "token-cache"  # the kind in the folder's ownership marker (builder.owned)


def cache_root(config: BuildConfig) -> Path:
    """The configured cache folder, or `.packtool-cache` beside the output folder."""
    if config.run.cache:
        return Path(config.run.cache)
    return Path(config.run.output).resolve().parent / CACHE_DIR


@cache
def code_fingerprint() -> str:
    """The sha256 of the version and every module of the installed package, by path: a change to any code an
    encode may run invalidates every entry. The whole package, not a list of the modules that decide bytes:
    such a list missed format.py's role codes, and the encode imports most of the package anyway. Chat
    templates enter each key by their own content. Cached per process, as keys ask for it often: ~8 ms for
    ~1 MB of code on 2 busy cores."""
    digest = hashlib.sha256(packtool.__version__.encode())
    for path in package_sources():
        code = path.read_bytes()
        digest.update(canonical_json([path.relative_to(PACKAGE).as_posix(), len(code)]).encode())  # where one ends
        digest.update(code)
    return digest.hexdigest()


PACKAGE = Path(packtool.__file__).parent


# Package data, not code: a regular install ships them as packages (an __init__.py each) where the source
# tree has none, so counting them gave an installed packtool and its own source tree two fingerprints.
# Templates enter each key by their content; configs are inputs.
DATA_PACKAGES = ("templates", "configs")


def package_sources() -> list[Path]:
    """The package's Python sources, in a fixed order (byte-compiled files follow them)."""
    sources = (path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in DATA_PACKAGES)
    return sorted(sources, key=lambda path: path.relative_to(PACKAGE).as_posix())


def source_settings(source: SourceConfig, config: BuildConfig) -> dict[str, Any]:
    """What render and tokenize read for one source, in whole sections (config.KEYED_BY): the source's own
    settings and the config's encode parts; pairs and groups add what they are cut to (a segment alone cannot be cut);
    a build that decontaminates adds its eval sets' key.
    The tokenizer and template enter the key by their content (encode_key)."""
    fit = item_fit_parts(config) if source.format in ITEM_FORMATS else {}
    # the eval sets by content (decontamination: KEYED_BY content): a changed eval file checks every sample again
    evals = {"decontamination": eval_set_key(config.decontamination)[0]} if config.decontamination else {}
    return {"source": source_encode_settings(source), **keyed_parts(config, "encode"), **fit, **evals}


def encode_key(
    *, content: str, start: int, file: str, tokenizer_hash: str, template_hash: str, settings: dict[str, Any]
) -> str:
    """The cache key of one encode work item: its range's content and first line or row, and the file as the
    config names it (ids are FILE:LINE, so content and position decide the samples). The range's end is not
    in it: a last range that later gets full, or is followed by appended ones, keeps its key."""
    facts = {
        "file": file,
        "content_sha256": content,
        "start": start,
        "tokenizer": tokenizer_hash,
        "template": template_hash,
        "settings": settings,
        "code": code_fingerprint(),
        "cache_version": CACHE_VERSION,
    }
    return hashlib.sha256(canonical_json(facts).encode()).hexdigest()


@dataclass(frozen=True)
class TokenCache:
    root: Path

    def partition(self, key: str) -> Path:
        return self.root / "tokens" / key[:2] / f"{key}.arrow"

    def report(self, key: str) -> Path:
        return self.root / "tokens" / key[:2] / f"{key}.json"

    def rejects(self, key: str) -> Path:
        return rejects_path(self.partition(key))

    def load_report(self, key: str) -> dict[str, Any] | None:
        """The report of a complete entry, or None (missing or unreadable); not checked (see `check`)."""
        try:
            report = json.loads(self.report(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) and self.partition(key).is_file() else None

    def check(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        """(report, None): the entry is as it was written; (None, why): it is not; (None, None): there is none."""
        report_path, partition = self.report(key), self.partition(key)
        if not report_path.exists() and not partition.exists():
            return None, None
        report = self.load_report(key)
        if report is None:
            return None, f"cache entry {report_path}: unreadable or without its partition"
        if report.get("key") != key or report.get("entry_sha256") != entry_digest(report):
            return None, f"cache entry {report_path}: its report is not the one written for this key"
        for path, name in ((partition, "partition"), (rejects_path(partition), "rejects")):
            if not path.is_file():
                return None, f"cache entry {path}: missing"
            size = path.stat().st_size
            if size != report.get(f"{name}_bytes") or sha256_file(path) != report.get(f"{name}_sha256"):
                return None, f"cache entry {path}: its bytes changed since it was written ({size:,} bytes)"
        return report, None

    def temporary(self, final: Path) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        return fresh_temporary(final)

    def write_sealed(self, path: Path, record: dict[str, Any]) -> None:
        """A small record of the cache (a file's ranges, the last build's index), sealed and renamed into place."""
        temporary = self.temporary(path)
        try:
            temporary.write_text(json.dumps({**record, "entry_sha256": entry_digest(record)}), encoding="utf-8")
            publish_file(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    @staticmethod
    def read_sealed(path: Path) -> dict[str, Any] | None:
        """A record `write_sealed` wrote, as it was written; None when it is missing, unreadable or changed."""
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("entry_sha256") == entry_digest(record) else None

    def entries(self) -> list[dict[str, Any]]:
        """Every entry on disk: key, source, file, samples and bytes; `damaged` when its report is unreadable, its
        partition missing or the report not sealed for its key (a build encodes it again; `clear` removes it).
        Partitions are not hashed, so a listing stays quick on a large cache."""
        found = []
        tokens = self.root / "tokens"
        for key in sorted({p.name.partition(".")[0] for p in tokens.glob("*/*") if p.suffix in (".json", ".arrow")}):
            report = self.load_report(key)
            files = (self.report(key), self.partition(key), self.rejects(key))
            size = sum(p.stat().st_size for p in files if p.is_file())
            if report is None or report.get("key") != key or report.get("entry_sha256") != entry_digest(report):
                found.append({"key": key, "bytes": size, "damaged": True})
                continue
            found.append(
                {
                    "key": key,
                    "source": report.get("source"),
                    "file": report.get("file"),
                    "samples": report.get("samples"),
                    "bytes": size,
                    "damaged": False,
                }
            )
        return found

    def clear(self) -> int:
        """Remove every entry of a folder marked as a packtool cache, while no build uses it; the bytes freed."""
        if self.root.is_symlink() or not is_marked(self.root, CACHE_KIND):
            raise OwnershipError(
                f"{self.root} is not a packtool cache (no packtool-owned.json marking it as one); nothing was "
                "deleted. Give the folder a build used as --cache (default: .packtool-cache beside its output)"
            )
        freed = 0
        with locked(self.root, f"cache {self.root}"):
            for folder in (self.root / name for name in CACHE_FOLDERS):
                if folder.is_symlink():  # not a folder packtool made: the link goes, what it points at stays
                    folder.unlink()
                    continue
                freed += sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
                shutil.rmtree(folder, ignore_errors=True)
        return freed


def entry_digest(report: dict[str, Any]) -> str:
    """The seal of a report: the sha256 of everything in it but the seal itself."""
    return hashlib.sha256(canonical_json({k: v for k, v in report.items() if k != "entry_sha256"}).encode()).hexdigest()


def seal_report(report: dict[str, Any], key: str, partition: Path, rejects: Path) -> dict[str, Any]:
    """The report to store beside a partition and its rejects table just written: its key, each file's size and
    hash, sealed."""
    sealed = {
        **report,
        "key": key,
        "partition_bytes": partition.stat().st_size,
        "partition_sha256": sha256_file(partition),
        "rejects_bytes": rejects.stat().st_size,
        "rejects_sha256": sha256_file(rejects),
    }
    return {**sealed, "entry_sha256": entry_digest(sealed)}


def publish_file(temporary: Path, final: Path) -> None:
    """Rename into place; the same key always holds the same bytes, so a concurrent winner is fine."""
    os.replace(temporary, final)
