import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from packtool.arrow import (
    as_numpy,
    content_digest,
    list_parts,
    list_values,
    number_lists,
    numbers,
    offsets_of,
    string_lists,
    strings,
    true_counts,
)


@pytest.mark.parametrize(
    ("values", "dtype", "arrow_type"),
    [
        (np.array([3, -1, 7], dtype=np.int32), np.int32, pa.int32()),
        ([1, 2, 3], np.int64, pa.int64()),
        ([True, False, True], np.uint8, pa.uint8()),
        ([-1, 5], np.int16, pa.int16()),
        (np.zeros(0, dtype=np.int8), np.int8, pa.int8()),
    ],
)
def test_numbers_equal_pa_array(values, dtype, arrow_type):
    assert numbers(values, dtype).equals(pa.array(np.asarray(values, dtype=dtype), arrow_type))


def test_nan_stays_a_value_as_with_pa_array():
    built = numbers([math.nan, 1.5], np.float64)
    assert built.null_count == 0 and built.type == pa.float64()
    assert np.isnan(built.to_pylist()[0]) and built.to_pylist()[1] == 1.5


@pytest.mark.parametrize("values", [[], ["a", "", "héllo ✓", "<|im_end|>"], ["x" * 1000] * 3])
def test_strings_equal_pa_array(values):
    assert strings(values).equals(pa.array(values, pa.string()))


@pytest.mark.parametrize("rows", [[], [[]], [["a", "b"], [], ["ç"]]])
def test_string_lists_equal_pa_array(rows):
    assert string_lists(rows).equals(pa.array(rows, pa.list_(pa.string())))


@pytest.mark.parametrize("offsets", [np.int32, np.int64])
def test_number_lists_equal_pa_array(offsets):
    rows = [np.array([1, 2], dtype=np.int32), np.zeros(0, dtype=np.int32), [7]]
    kind = pa.list_ if offsets == np.int32 else pa.large_list
    expected = pa.array([[1, 2], [], [7]], kind(pa.int32()))
    assert number_lists(rows, np.int32, offsets).equals(expected)


def test_offsets_refuse_what_32_bits_cannot_address():
    class Huge:
        def __len__(self) -> int:
            return 2**31

    with pytest.raises(OverflowError, match="32-bit offsets"):
        offsets_of([Huge()])
    assert offsets_of([Huge()], np.int64)[-1] == 2**31


def test_list_parts_of_a_slice_and_of_chunks():
    array = pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32()))
    offsets, values = list_parts(array.slice(1))
    assert offsets.tolist() == [0, 1, 4] and values.tolist() == [3, 4, 5, 6]
    offsets, values = list_parts(pa.chunked_array([array.slice(0, 1), array.slice(2)]))
    assert offsets.tolist() == [0, 2, 5] and values.tolist() == [1, 2, 4, 5, 6]


@pytest.mark.parametrize("values", [[[1, 2], [3], [4, 5, 6]], [["a"], [], ["bc", "d"]]])
def test_list_values_equal_flatten(values):
    array = pa.array(values)
    for part in (array, array.slice(1), array.slice(1, 1), array.slice(3), array.slice(0, 0)):
        assert list_values(part).equals(part.flatten())


def test_list_values_count_only_the_rows_nulls():
    array = pa.array([["x"], [None], ["y"]])
    assert list_values(array).null_count == 1
    assert list_values(array.slice(2)).null_count == list_values(array.slice(0, 1)).null_count == 0


def test_build_and_stats_never_import_pyarrow_compute(tmp_path):
    """pyarrow.compute costs ~45 ms to import; a build of JSON Lines and its summary need none of it."""
    script = (
        "import sys; from packtool.cli import main; sys.argv = sys.argv[1:]\n"
        "try: main()\n"
        "except SystemExit as exit: assert not exit.code, exit.code\n"
        "assert 'pyarrow.compute' not in sys.modules, 'pyarrow.compute imported'\n"
    )
    out = tmp_path / "out"
    for command in (["build", "quickstart", "-o", str(out), "-j", "1", "--no-cache", "-q"], ["stats", str(out)]):
        done = subprocess.run([sys.executable, "-c", script, "packtool", *command], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_as_numpy_is_a_view_of_the_arrow_buffer():
    array = pa.array(np.arange(10, dtype=np.int64)).slice(3, 4)
    view = as_numpy(array)
    assert view.tolist() == [3, 4, 5, 6] and not view.flags.owndata


# A `pandas` that only records who imported it: pyarrow treats its ImportError as pandas being absent.
FAKE_PANDAS = """
import os, sys
with open(os.environ["PANDAS_IMPORTED"], "a") as log:
    log.write(" ".join(sys.argv) + "\\n")
raise ImportError("pandas is not wanted here")
"""


def test_build_and_commands_never_import_pandas(tmp_path):
    """pyarrow imports pandas, when installed, for pa.array, pa.table and to_numpy (0.5-0.7 s per process):
    the build, its worker processes and the reading commands build and read arrays from buffers."""
    fake = tmp_path / "fake" / "pandas"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_PANDAS)
    log = tmp_path / "pandas-imports.log"
    path = [str(fake.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PANDAS_IMPORTED": str(log)}
    out = tmp_path / "out"

    def packtool(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "packtool", *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr

    packtool("build", "quickstart", "-o", str(out), "-j", "2", "--executor", "processes", "--no-cache", "-q")
    for command in (
        ["stats", str(out)],
        ["verify", str(out)],
        ["inspect", str(out), "--row", "1", "--limit", "3"],
        ["find", str(out), "shard-00000.parquet:2"],
        ["report", str(out), "-o", str(tmp_path / "r.html")],
    ):
        packtool(*command)
    assert (out / "manifest.json").is_file()
    assert not log.exists(), log.read_text()
    # the trap works: a process that asks for pandas is recorded
    subprocess.run([sys.executable, "-c", "import pyarrow as pa; pa.array([1])"], env=env, check=True)
    assert log.exists()


def _digest(array: pa.Array) -> str:
    digest = hashlib.sha256()
    content_digest(array, digest)
    return digest.hexdigest()


MESSAGES = [
    [{"role": "user", "content": "hi", "n": 3}, {"role": "assistant", "content": None, "n": None}],
    None,
    [],
    [{"role": "user", "content": "é\u00a0x", "n": -1}],
]


def test_content_digest_depends_on_values_not_layout():
    whole = pa.array(MESSAGES * 3)
    assert _digest(whole.slice(4, 4)) == _digest(pa.array(MESSAGES))  # a slice: offsets not from 0
    large = pa.array(MESSAGES, pa.large_list(whole.type.value_type))  # wider offsets, same values
    assert _digest(large) == _digest(pa.array(MESSAGES))
    words = pa.array(["a", None, "bc", "a"])
    assert _digest(words.dictionary_encode()) == _digest(words)
    # a null slot's bytes are undefined in Arrow: garbage there changes nothing
    clean = pa.array([1, None, 3], pa.int64())
    garbage = pa.Array.from_buffers(
        pa.int64(), 3, [clean.buffers()[0], pa.py_buffer(np.array([1, 99, 3], np.int64).tobytes())], null_count=1
    )
    assert _digest(garbage) == _digest(clean)
    text = pa.Array.from_buffers(  # a null string that spans bytes
        pa.string(),
        2,
        [clean.buffers()[0], pa.py_buffer(np.array([0, 1, 4], np.int32).tobytes()), pa.py_buffer(b"axyz")],
        null_count=1,
    )
    assert _digest(text) == _digest(pa.array(["a", None]))


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (pa.array(["ab", "c"]), pa.array(["a", "bc"])),  # same bytes, other split
        (pa.array(["a", None]), pa.array(["a", ""])),
        (pa.array(["a"]), pa.array([b"a"])),  # str and bytes read differently
        (pa.array([1, 0]), pa.array([1, None])),
        (pa.array([True, False]), pa.array([True, None])),
        (pa.array([[1], [2, 3]]), pa.array([[1, 2], [3]])),
        (pa.array([{"a": 1}]), pa.array([{"b": 1}])),  # a field's name
        (pa.array([{"a": None}, None]), pa.array([{"a": None}, {"a": None}])),
        (pa.array([1.5]), pa.array([1.25])),
    ],
)
def test_content_digest_tells_different_values_apart(one, other):
    assert _digest(one) != _digest(other)


def test_content_digest_names_a_fields_metadata():
    """reading parses a field marked as arrow.json by its metadata: a mark is part of the content."""
    marked = pa.field("x", pa.string(), metadata={b"ARROW:extension:name": b"arrow.json"})
    kind = pa.struct([marked])
    plain = pa.array([{"x": "1"}], pa.struct([pa.field("x", pa.string())]))
    assert _digest(pa.array([{"x": "1"}], kind)) != _digest(plain)


@pytest.mark.parametrize("seed", range(6))
def test_true_counts_counts_each_range_as_a_slice_sum_would(seed):
    """Empty ranges, ranges at either end, ranges that overlap or repeat, an all-false mask."""
    rng = np.random.default_rng(seed)
    mask = rng.random(int(rng.integers(0, 300))) < (0.0 if seed == 0 else rng.random())
    starts = rng.integers(0, len(mask) + 1, 40)
    ends = np.minimum(starts + rng.integers(0, 50, 40), len(mask))
    counts = true_counts(mask, starts, ends)
    assert counts.tolist() == [int(mask[a:b].sum()) for a, b in zip(starts, ends)]
