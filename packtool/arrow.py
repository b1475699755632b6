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

import json
from collections.abc import Sequence, Sized
from typing import Any

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


def true_counts(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many of mask[starts[i]:ends[i]] are true, for each i (int64).

    Where the true values are, then how many lie before each bound: for 1.5 M labels 1.2 ms, where a
    running count over every position took 6-22 ms (a fresh int64 array as long as the mask).
    """
    at = np.flatnonzero(mask)
    return np.searchsorted(at, ends) - np.searchsorted(at, starts)


def strings(values: Sequence[str]) -> pa.Array:
    return binaries([value.encode("utf-8") for value in values], pa.string())


def binaries(values: Sequence[bytes], kind: pa.DataType | None = None) -> pa.Array:
    """A binary array (or a string one, for `kind` pa.string() and UTF-8 values) without nulls."""
    offsets = offsets_of(values)
    return pa.Array.from_buffers(
        kind or pa.binary(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))]
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


def list_values(array: pa.ListArray | pa.LargeListArray) -> pa.Array:
    """The values the rows of a list array hold, in order: `flatten()` without pyarrow.compute, which
    flatten and combine_chunks import (~45 ms of a process that reads a shard)."""
    offsets = array.offsets
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    return array.values.slice(start, end - start)


def int32_offsets(offsets: np.ndarray) -> np.ndarray:
    """List offsets as the 32 bits of a list column (not a large one), refusing what they cannot address."""
    return _narrowed(np.asarray(offsets, dtype=np.int64), np.int32)


def _narrowed(offsets: np.ndarray, dtype: type) -> np.ndarray:
    if dtype == np.int32 and len(offsets) and offsets[-1] > _INT32_MAX:
        raise OverflowError(f"{offsets[-1]:,} values do not fit the 32-bit offsets of one Arrow list or string column")
    return offsets.astype(dtype, copy=False)


def content_digest(array: pa.Array, digest: Any, field: pa.Field | None = None) -> None:
    """Feed `digest` (a hashlib object) with the values `array` holds and nothing of how they are laid out.

    Equal values give equal bytes whatever the chunking, slicing, dictionary encoding or bytes left in
    null slots (which Arrow leaves undefined); different values or types never do. Per array:

        type (_label)  length  validity bits, then by type:
        fixed width     the values, null slots as zeros
        string, binary  the lengths (null: 0), the bytes of the values that are not null
        list            the lengths (null: 0), then the items of the lists that are not null
        struct          each field by name (and metadata), with the struct's nulls as its own
        other           the values as JSON text (exact, at Python's pace)
    Read from the buffers, not through to_numpy or scalars (see the module docstring). `field`: the
    column's, whose name and metadata come first.
    """
    if field is not None:
        digest.update(f"column {_named(field)}\n".encode())
    kind = array.type
    if isinstance(kind, pa.BaseExtensionType):
        digest.update(f"extension {kind.extension_name}\n".encode())
        content_digest(array.storage, digest)
        return
    if pa.types.is_dictionary(kind):
        content_digest(array.dictionary_decode(), digest)
        return
    n, buffers = len(array), array.buffers()
    valid = _bits(buffers[0], array.offset, n) if buffers[0] is not None and array.null_count else np.ones(n, bool)
    label = _label(kind)
    digest.update(f"{label} {n}\n".encode() + np.packbits(valid).tobytes())
    if pa.types.is_struct(kind):
        for i, child in enumerate(array.flatten()):  # flatten: a null struct's fields are null
            digest.update(f"field {_named(kind.field(i))}\n".encode())
            content_digest(child, digest)
    elif pa.types.is_null(kind):
        return
    elif pa.types.is_boolean(kind):
        digest.update(np.packbits(_bits(buffers[1], array.offset, n) & valid).tobytes())
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        import pyarrow.compute as pc

        if pa.types.is_fixed_size_list(kind):
            lengths = np.full(n, kind.list_size, dtype=np.int64) * valid
        else:
            lengths = np.diff(_offsets(array, buffers[1])) * valid
        digest.update(lengths.tobytes())
        content_digest(pc.list_flatten(array), digest)  # the items of the lists that are not null, in order
    elif _is_binary(kind):
        offsets = _offsets(array, buffers[1])
        spans = np.diff(offsets)
        digest.update((spans * valid).tobytes())
        data = memoryview(buffers[2] or b"")
        if not spans[~valid].any():
            digest.update(data[offsets[0] : offsets[-1]] if n else b"")
        else:  # null slots that span bytes: only the values count
            digest.update(b"".join(data[offsets[i] : offsets[i + 1]] for i in np.flatnonzero(valid)))
    elif (pa.types.is_primitive(kind) and kind.bit_width % 8 == 0) or pa.types.is_fixed_size_binary(kind):
        width = kind.byte_width
        values = np.frombuffer(buffers[1], dtype=np.uint8)[array.offset * width : (array.offset + n) * width]
        values = values.reshape(n, width).copy()
        values[~valid] = 0
        digest.update(values.tobytes())
    else:  # views, maps, unions: exact through Python values
        digest.update(json.dumps(array.to_pylist(), ensure_ascii=False, default=repr).encode())


def _label(kind: pa.DataType) -> str:
    """The type as far as the values go: not its children (hashed on their own), nor its offsets' width,
    nor a list's item name (`item`, or Parquet's `element`)."""
    if pa.types.is_struct(kind):
        return "struct"
    if pa.types.is_fixed_size_list(kind):
        return f"fixed_size_list {kind.list_size} {_named(kind.value_field, name=False)}"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list {_named(kind.value_field, name=False)}"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "binary"
    return str(kind)


def _named(field: pa.Field, *, name: bool = True) -> str:
    """A field's name and metadata (which may say how its cells are read: the arrow.json extension)."""
    metadata = sorted((field.metadata or {}).items())
    return f"{field.name if name else ''} {metadata}"


def _bits(buffer: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """Arrow's little-endian bit buffer as booleans, positions offset..offset+n."""
    return np.unpackbits(np.frombuffer(buffer, dtype=np.uint8), bitorder="little")[offset : offset + n].astype(bool)


def _offsets(array: pa.Array, buffer: pa.Buffer) -> np.ndarray:
    wide = pa.types.is_large_list(array.type) or pa.types.is_large_string(array.type)
    wide = wide or pa.types.is_large_binary(array.type)
    offsets = np.frombuffer(buffer, dtype=np.int64 if wide else np.int32)
    return offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)


def _is_binary(kind: pa.DataType) -> bool:
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or (pa.types.is_large_binary(kind))
    )
