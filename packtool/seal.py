"""The manifest's self-hash: `manifest_sha256` covers every field, so facts that cannot be recomputed from
the shards (config, seed, capacity, conventions) are still checked by `packtool verify`.

    sealed = seal_manifest(manifest)          the builder, as the last step before writing manifest.json
    sealed[SEAL] == manifest_digest(sealed)   verify: true until anyone edits a field

The digest is the sha256 of the canonical JSON (sorted keys, no whitespace, UTF-8) of the manifest
without the `manifest_sha256` field, so it survives a round trip through `json.dumps`/`json.loads`
with any indentation. This module imports nothing from packtool, so the writer and verify both can.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SEAL = "manifest_sha256"


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def manifest_digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != SEAL})).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with `manifest_sha256` added (a copy; the argument is not changed)."""
    return {**manifest, SEAL: manifest_digest(manifest)}
