"""The token store as a cache: encoded partitions addressed by everything they depend on.

    CACHE/tokens/ab/abcdef....arrow   one encode work item's samples (Arrow IPC, see build.encode)
    CACHE/tokens/ab/abcdef....json    its report (counts by reason, rejects); written last

An entry's key hashes the input file's bytes, the tokenizer and template by content, the source's
render/tokenize settings and the code that encodes, so a stale entry is never looked up. Entries
are write-once: written under a temporary name and renamed, report last, so two builds sharing a
cache write identical bytes to the same name and a reader sees an entry whole or not at all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import packtool
from packtool.config import ITEM_FORMATS, BuildConfig, SourceConfig, canonical_json

CACHE_DIR = ".packtool-cache"
# The modules whose code decides a partition's bytes: a change to any of them invalidates every entry.
ENCODING_MODULES = (
    "packtool.sources",
    "packtool.render",
    "packtool.encode",
    "packtool.records",
    "packtool.build.encode",
)


def cache_root(config: BuildConfig) -> Path:
    """The configured cache folder, or `.packtool-cache` beside the output folder."""
    if config.cache:
        return Path(config.cache)
    return Path(config.output).resolve().parent / CACHE_DIR


@cache
def code_fingerprint() -> str:
    digest = hashlib.sha256(packtool.__version__.encode())
    for name in ENCODING_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"cannot find the source of {name} to fingerprint it")
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def source_settings(source: SourceConfig, config: BuildConfig) -> dict[str, Any]:
    """What render and tokenize read from the config for one source (nothing the plan decides)."""
    return {
        "name": source.name,
        "format": source.format,
        "fields": source.fields,
        "role_map": source.role_map,
        "train": [source.train.roles, source.train.turns, source.train.end_of_turn, source.train.tool_calls],
        "special_tokens": source.special_tokens,
        "max_record_bytes": source.max_record_bytes,  # which records are read at all
        "add_bos": config.add_bos,
        "add_eos": config.add_eos,
        # pairs and groups are cut jointly while encoding (a segment alone cannot be cut), so the fit is encode's
        **({"items": [config.capacity, config.item_truncation]} if source.format in ITEM_FORMATS else {}),
    }


def encode_key(*, file_hash: str, file: str, tokenizer_hash: str, template_hash: str, settings: dict[str, Any]) -> str:
    """The cache key of one encode work item. `file` (as the config names it) is in it: locations and ids say it."""
    facts = {
        "file": file,
        "file_sha256": file_hash,
        "tokenizer": tokenizer_hash,
        "template": template_hash,
        "settings": settings,
        "code": code_fingerprint(),
    }
    return hashlib.sha256(canonical_json(facts).encode()).hexdigest()


@dataclass(frozen=True)
class TokenCache:
    root: Path

    def partition(self, key: str) -> Path:
        return self.root / "tokens" / key[:2] / f"{key}.arrow"

    def report(self, key: str) -> Path:
        return self.root / "tokens" / key[:2] / f"{key}.json"

    def load_report(self, key: str) -> dict[str, Any] | None:
        """The report of a complete entry, or None (missing, or unreadable: then it is redone)."""
        try:
            report = json.loads(self.report(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return report if self.partition(key).is_file() else None

    def temporary(self, final: Path) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")

    def entries(self) -> list[dict[str, Any]]:
        """Every complete entry: key, source, file, samples and bytes on disk."""
        found = []
        for report_path in sorted((self.root / "tokens").glob("*/*.json")):
            key = report_path.stem
            report = self.load_report(key)
            if report is None:
                continue
            size = report_path.stat().st_size + self.partition(key).stat().st_size
            found.append(
                {
                    "key": key,
                    "source": report["source"],
                    "file": report["file"],
                    "samples": report["samples"],
                    "bytes": size,
                }
            )
        return found

    def clear(self) -> int:
        """Remove every entry; the bytes freed."""
        freed = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
        shutil.rmtree(self.root / "tokens", ignore_errors=True)
        return freed


def publish_file(temporary: Path, final: Path) -> None:
    """Rename into place; the same key always holds the same bytes, so a concurrent winner is fine."""
    os.replace(temporary, final)
