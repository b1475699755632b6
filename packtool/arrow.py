"""Arrow arrays from numpy and Python lists, and numpy views of Arrow arrays, without pandas.

pyarrow's `pa.array`, `pa.table`, `pa.scalar` and `Array.to_numpy` look for pandas first and import
it when it is installed (as it is beside transformers and datasets): 0.5-0.7 s of a build process,
of each worker process and of each DataLoader worker, for nothing. These helpers go through
buffers instead and give arrays equal to what `pa.array` gives (tested), so no byte of a shard or
partition changes.

    strings(["ab", "c"])                 offsets [0 2 3]  data b"abc"
    lists(offsets_of([[1, 2], []]), numbers(np.array([1, 2], np.int32)))   [[1, 2], []]
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

import numpy as np
import pyarrow as pa

_NUMPY_OF = {
    pa.int8(): np.int8,
    pa.uint8(): np.uint8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.float64(): np.float64,
}
_ARROW_OF = {np.dtype(dtype): arrow for arrow, dtype in _NUMPY_OF.items()}
_INT32_MAX = np.iinfo(np.int32).max


def numbers(values: np.ndarray | Sequence[float], dtype: type | None = None) -> pa.Array:
    """A numeric array without nulls (NaN stays a value, as with `pa.array`)."""
    array = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(_ARROW_OF[array.dtype], len(array), [None, pa.py_buffer(array)])


def offsets_of(rows: Sequence[Sized], dtype: type = np.int32) -> np.ndarray:
    """Where each row starts in the rows laid end to end, and where the last one ends."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in rows], out=offsets[1:])
    return _narrowed(offsets, dtype)


def strings(values: Sequence[str]) -> pa.Array:
    encoded = [value.encode("utf-8") for value in values]
    offsets = offsets_of(encoded)
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


def lists(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    """A list array (a large one for int64 offsets) over `values`."""
    kind = pa.LargeListArray if offsets.dtype == np.int64 else pa.ListArray
    return kind.from_arrays(numbers(offsets), values)


def string_lists(rows: Sequence[Sequence[str]]) -> pa.Array:
    return lists(offsets_of(rows), strings([value for row in rows for value in row]))


def number_lists(rows: Sequence[np.ndarray | Sequence[float]], dtype: type, offsets: type = np.int32) -> pa.Array:
    flat = np.concatenate([np.asarray(row, dtype=dtype) for row in rows]) if rows else np.zeros(0, dtype=dtype)
    return lists(offsets_of(rows, offsets), numbers(flat, dtype))


def as_numpy(array: pa.Array) -> np.ndarray:
    """A fixed-width array without nulls as a zero-copy numpy view."""
    dtype = _NUMPY_OF.get(array.type)
    if dtype is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=array.offset + len(array))[array.offset :]


def list_parts(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (offsets from 0, values) numpy views: row i is values[offsets[i]:offsets[i + 1]]."""
    if isinstance(column, pa.ChunkedArray):
        # A row group decodes to one chunk; combine_chunks would copy it.
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    offsets = as_numpy(column.offsets)
    values = as_numpy(column.values)
    if len(offsets) and offsets[0]:  # a slice of a longer array
        values, offsets = values[offsets[0] : offsets[-1]], offsets - offsets[0]
    return offsets, values


def _narrowed(offsets: np.ndarray, dtype: type) -> np.ndarray:
    if dtype == np.int32 and len(offsets) and offsets[-1] > _INT32_MAX:
        raise OverflowError(f"{offsets[-1]:,} values do not fit the 32-bit offsets of one Arrow list or string column")
    return offsets.astype(dtype, copy=False)
