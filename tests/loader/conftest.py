"""A build folder from synthetic packs, written by the project's own shard writer (packtool.shards).

Only the sample contents are synthetic: rows go through `OutputPack`, `write_shards` and
`write_json_atomic` exactly as `packtool build` writes them, and the manifest carries the
fields of `packtool.builder._manifest` that the loader reads.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

import packtool
from packtool.format import SCHEMA_VERSION
from packtool.labels import IGNORE_INDEX, cu_seqlens_from_lengths, labels_for
from packtool.records import ROLE_CODES
from packtool.shards import MANIFEST, REJECTS, OutputPack, conventions, write_json_atomic, write_shards


def _lengths(rng: np.random.Generator, capacity: int) -> list[int]:
    """1-4 documents of 2..capacity/2 tokens that fit in `capacity`."""
    lengths: list[int] = []
    room = capacity
    for _ in range(int(rng.integers(1, 5))):
        if room < 2:
            break
        n = int(rng.integers(2, min(room, capacity // 2) + 1))
        lengths.append(n)
        room -= n
    return lengths


def _row(ids: np.ndarray, labels: np.ndarray, cu: np.ndarray, doc_cu: np.ndarray, pack: int) -> OutputPack:
    n_docs = len(doc_cu) - 1
    return OutputPack(
        input_ids=ids,
        labels=labels,
        cu_seqlens=cu,
        doc_cu_seqlens=doc_cu,
        token_roles=np.full(len(ids), ROLE_CODES["text"], dtype=np.int8),
        sample_ids=[f"synthetic:{pack}-{i}" for i in range(n_docs)],
        sample_hashes=["0" * 32] * n_docs,
        sample_repeats=[0] * n_docs,
        sources=["synthetic"] * n_docs,
    )


def synthetic_packs(n_packs: int, capacity: int, seed: int = 0, vocab: int = 100, mode: str = "packed"):
    """Packs of 1-4 documents.

    packed: one attention segment per document, ~20% of tokens not targets, -100 at each start.
    stream: one attention segment per pack (`cu_seqlens` [0, len]), documents only in
    `doc_cu_seqlens`, every token a target but the first (as packtool.builder.emit writes them).
    """
    rng = np.random.default_rng(seed)
    packs = []
    for p in range(n_packs):
        doc_cu = cu_seqlens_from_lengths(_lengths(rng, capacity))
        ids = rng.integers(1, vocab, size=int(doc_cu[-1])).astype(np.int32)
        if mode == "stream":
            labels = ids.copy()
            labels[0] = IGNORE_INDEX
            cu = np.array([0, len(ids)], dtype=np.int32)
        else:
            cu = doc_cu
            labels = labels_for(ids, rng.random(len(ids)) >= 0.2, cu)
        packs.append(_row(ids, labels, cu, doc_cu, p))
    return packs


def write_build(
    out: Path,
    packs: list[OutputPack],
    *,
    capacity: int,
    packs_per_shard: int,
    row_group_size: int,
    mode: str = "packed",
) -> Path:
    metadata = {"packtool.version": packtool.__version__, "packtool.capacity": str(capacity), "packtool.mode": mode}
    shards = write_shards(packs, out, rows_per_shard=packs_per_shard, row_group_rows=row_group_size, metadata=metadata)
    (out / REJECTS).write_text("")
    stream = mode == "stream"
    manifest = {
        "packtool_version": packtool.__version__,
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "capacity": capacity,
        "seed": 0,
        "config": {},
        "config_hash": "",
        "tokenizer": {"file": None, "sha256": None, "vocab_size": 100, "pad_token_id": 0},
        "template": None,
        "conventions": conventions(stream),
        "role_codes": ROLE_CODES,
        "shards": [asdict(s) for s in shards],
        "rejects": {"file": REJECTS, "count": 0, "by_reason": {}},
    }
    write_json_atomic(out / MANIFEST, manifest)
    return out


@pytest.fixture
def build_writer():
    """`write_build` itself, for tests that write packs of their own (tests/loader/test_vision.py)."""
    return write_build


@pytest.fixture
def make_build(tmp_path):
    """make_build(n_packs=40, capacity=32, packs_per_shard=15, row_group_size=4) -> (path, packs).

    `alter(packs)` may change the packs in place before they are written (to build a broken shard).
    """

    def make(
        n_packs=40, capacity=32, packs_per_shard=15, row_group_size=4, seed=0, name="build", mode="packed", alter=None
    ):
        packs = synthetic_packs(n_packs, capacity, seed=seed, mode=mode)
        if alter is not None:
            alter(packs)
        path = write_build(
            tmp_path / name,
            packs,
            capacity=capacity,
            packs_per_shard=packs_per_shard,
            row_group_size=row_group_size,
            mode=mode,
        )
        return path, packs

    return make


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors: intra-op threads only add contention (a 6 ms step took 0.1-1 s with 2 threads on a busy box)."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def quickstart_build(tmp_path_factory):
    """`packtool build` of the shipped quickstart (522 packs, capacity 1024), once per session."""
    from click.testing import CliRunner
    from support import QUICKSTART

    from packtool.cli import main

    out = tmp_path_factory.mktemp("quickstart") / "out"
    result = CliRunner().invoke(main, ["build", str(QUICKSTART.parent / "quickstart.yaml"), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out
