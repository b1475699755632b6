"""Token-store partitions round-trip samples exactly; the mixing plan copies what the weight says."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.builder.mixing import repeat_plan
from packtool.builder.store import BATCH_ROWS, PartitionReader, PartitionWriter, _n_targets
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
    )


def test_partition_round_trips_across_batch_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    samples = [_sample(i, rng) for i in range(BATCH_ROWS + 7)]
    writer = PartitionWriter(tmp_path / "part.arrow", "a")
    assert [writer.append(s, f"f.jsonl:{i + 1}", 2 * i, i % 5 == 0) for i, s in enumerate(samples)] == list(
        range(len(samples))
    )
    writer.close()
    reader = PartitionReader(tmp_path / "part.arrow")
    assert reader.source == "a" and reader.rows == len(samples)
    assert reader.column("length").tolist() == [len(s) for s in samples]
    assert reader.column("n_targets").tolist() == [s.n_targets for s in samples]
    assert reader.column("ordinal").tolist() == [2 * i for i in range(len(samples))]
    assert reader.column("special_literal").astype(bool).tolist() == [i % 5 == 0 for i in range(len(samples))]
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
