"""Token-store partitions and their rejects tables round-trip exactly; the mixing plan copies what the weight
says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.arrow import strings
from packtool.builder.mixing import repeat_plan
from packtool.builder.store import (
    BATCH_ROWS,
    PartitionReader,
    PartitionWriter,
    Reject,
    RejectsWriter,
    _n_targets,
    hex_prefixes,
    read_rejects,
    reject_ordinals,
)
from packtool.errors import BuildError
from packtool.records import Tokenized


def _sample(i: int, rng: np.random.Generator) -> Tokenized:
    n = int(rng.integers(1, 40))
    return Tokenized(
        example_id=f"src:{i}",
        source="a",
        sample_hash=f"{i:032x}",
        input_ids=rng.integers(0, 50_000, n).astype(np.int32),
        targets=rng.random(n) > 0.4,
        roles=rng.integers(0, 6, n).astype(np.int8),
        message_index=rng.integers(-1, 5, n).astype(np.int16),
        message_roles=("user", "assistant") if i % 2 else (),
        structured_messages=frozenset({1}) if i % 3 == 0 else frozenset(),
        straddled=i % 3,
    )


def test_partition_round_trips_across_batch_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    samples = [_sample(i, rng) for i in range(BATCH_ROWS + 7)]
    writer = PartitionWriter(tmp_path / "part.arrow", "a")
    appended = [
        writer.append(s, f"f.jsonl:{i + 1}", 2 * i, i % 5 == 0, reported=i % 7 == 0) for i, s in enumerate(samples)
    ]
    assert appended == list(range(len(samples)))
    writer.close()
    reader = PartitionReader(tmp_path / "part.arrow")
    assert reader.source == "a" and reader.rows == len(samples)
    assert reader.column("length").tolist() == [len(s) for s in samples]
    assert reader.column("n_targets").tolist() == [s.n_targets for s in samples]
    assert reader.column("ordinal").tolist() == [2 * i for i in range(len(samples))]
    assert reader.column("special_literal").astype(bool).tolist() == [i % 5 == 0 for i in range(len(samples))]
    # what the accounting sums within a source's max_samples: straddling targets, reported overlaps
    assert reader.column("straddled").tolist() == [s.straddled for s in samples]
    assert reader.column("reported").astype(bool).tolist() == [i % 7 == 0 for i in range(len(samples))]
    for i in (0, 1, BATCH_ROWS - 1, BATCH_ROWS, len(samples) - 1):
        got = reader.get(i, repeat=2)
        assert (got.input_ids == samples[i].input_ids).all() and got.input_ids.dtype == np.int32
        assert (got.targets == samples[i].targets).all() and got.targets.dtype == bool
        assert (got.roles == samples[i].roles).all()
        assert (got.example_id, got.sample_hash, got.source, got.repeat) == ("src:" + str(i), f"{i:032x}", "a", 2)
        whole = reader.tokenized(i)
        assert (whole.message_index == samples[i].message_index).all()
        assert whole.message_roles == samples[i].message_roles
        assert whole.structured_messages == samples[i].structured_messages
        assert reader.location(i) == f"f.jsonl:{i + 1}"
    reader.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.booleans(), max_size=6), max_size=8))
def test_batch_n_targets_match_each_sample(rows):
    """The columnar count equals Tokenized.n_targets row by row, empty rows (first, last, between) included."""
    targets = np.array([t for row in rows for t in row], dtype=np.uint8)
    offsets = np.cumsum([0] + [len(row) for row in rows])
    assert _n_targets(targets, offsets).tolist() == [sum(row[1:]) for row in rows]


def test_repeat_plan_worked_example():
    positions, repeats = repeat_plan(4, 1.5, seed=0)
    assert positions[:4].tolist() == [0, 1, 2, 3] and repeats.tolist() == [0, 0, 0, 0, 1, 1]
    assert len(set(positions[4:].tolist())) == 2


@settings(max_examples=60)
@given(st.integers(0, 50), st.floats(0.05, 4.0), st.integers(0, 2**32 - 1))
def test_repeat_plan_properties(n, multiplier, seed):
    positions, repeats = repeat_plan(n, multiplier, seed=seed)
    assert len(positions) == int(np.floor(multiplier)) * n + round((multiplier - np.floor(multiplier)) * n)
    pairs = list(zip(positions.tolist(), repeats.tolist()))
    assert len(set(pairs)) == len(pairs)  # every copy is a distinct (sample, repeat)
    assert all(0 <= p < n for p in positions.tolist())
    again = repeat_plan(n, multiplier, seed=seed)
    assert (again[0] == positions).all() and (again[1] == repeats).all()


def _rejects(n: int) -> list[Reject]:
    return [
        Reject(
            3 * i,
            f"a:{i}",
            f"a.jsonl:{3 * i + 1}",
            "bad_record" if i % 2 else "duplicate",
            f"détail {i}",
            message=f"a.jsonl:{3 * i + 1}: bad [bad_record]" if i % 2 else None,
            eval='{"file": "eval.jsonl", "overlap": "x"}' if i % 5 == 0 else None,
        )
        for i in range(n)
    ]


def test_a_rejects_table_round_trips_across_batch_boundaries_nulls_included(tmp_path):
    rejects = _rejects(BATCH_ROWS + 9)
    writer = RejectsWriter(tmp_path / "part.rejects.arrow")
    for reject in rejects:
        writer.append(reject)
    writer.close()
    assert list(read_rejects(writer.path)) == rejects
    assert list(read_rejects(writer.path, before=3 * BATCH_ROWS)) == rejects[:BATCH_ROWS]  # records before 3 x
    assert reject_ordinals(writer.path).tolist() == [r.ordinal for r in rejects]
    empty = RejectsWriter(tmp_path / "none.rejects.arrow")
    empty.close()
    assert list(read_rejects(empty.path)) == [] and len(reject_ordinals(empty.path)) == 0


def test_a_rejects_table_carried_over_is_the_table_written_whole(tmp_path):
    """A grown range copies its earlier entry's rejects, then appends its own: the bytes a whole encode writes."""
    rejects = _rejects(BATCH_ROWS + 9)
    first = RejectsWriter(tmp_path / "first.arrow")
    for reject in rejects[:100]:
        first.append(reject)
    first.close()
    grown, whole = RejectsWriter(tmp_path / "grown.arrow"), RejectsWriter(tmp_path / "whole.arrow")
    grown.extend(first.path)
    for reject in rejects[100:]:
        grown.append(reject)
    for reject in rejects:
        whole.append(reject)
    grown.close(), whole.close()
    assert grown.path.read_bytes() == whole.path.read_bytes()


def test_the_validation_key_is_read_from_the_hash_bytes_as_int_reads_it(tmp_path):
    """hex_prefixes (numpy over the string buffer) against the Python it replaced, int(h[:16], 16), on a slice."""
    rng = np.random.default_rng(3)
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)).hex() for _ in range(300)]
    hashes[7] = "f" * 64  # the largest key
    hashes[8] = "0" * 64
    hashes[9] = "ABCDEF0123456789" + "0" * 48  # int() reads upper case too
    column = strings(hashes).slice(5, 290)
    expected = np.array([int(h[:16], 16) for h in hashes[5:295]], dtype=np.uint64)
    found = hex_prefixes(column, tmp_path)
    assert found.dtype == np.uint64 and (found == expected).all()
    assert len(hex_prefixes(strings([]), tmp_path)) == 0
    with pytest.raises(BuildError, match="not hexadecimal"):
        hex_prefixes(strings(["g" * 64]), tmp_path)
    with pytest.raises(BuildError, match="shorter than 16"):
        hex_prefixes(strings(["abc"]), tmp_path)


def test_a_partition_reads_its_hash_numbers_batch_by_batch(tmp_path):
    rng = np.random.default_rng(1)
    samples = [_sample(i, rng) for i in range(BATCH_ROWS + 3)]
    writer = PartitionWriter(tmp_path / "part.arrow", "a")
    for i, sample in enumerate(samples):
        writer.append(sample, f"f.jsonl:{i + 1}", i)
    writer.close()
    reader = PartitionReader(tmp_path / "part.arrow")
    expected = [int(h[:16], 16) for h in reader.batch_column("sample_hash")]
    assert reader.hash_numbers().tolist() == expected
    reader.close()
