"""Tokenized samples spilled to disk between encode and emit, so a build's memory does not grow with the data.

    encode --append--> samples.arrow (Arrow IPC, record batches of BATCH_ROWS samples)
                       lengths, sources          stay in memory: all the planner needs
    emit   <--get(i)-- memory-mapped batches     a pack reads only its own samples' bytes

Sample i lives in batch i // BATCH_ROWS at row i % BATCH_ROWS; reading it slices numpy views of
the mapped buffers, so the operating system pages in what a pack touches and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from packtool.records import Tokenized

BATCH_ROWS = 4096  # samples per record batch: small enough to buffer, large enough to amortize headers

# large_list: a batch of BATCH_ROWS long samples can pass 2^31 tokens. Targets are uint8, not
# bool, so that reading a sample back is a zero-copy view (Arrow packs booleans into bits).
_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.large_list(pa.int32())),
        pa.field("targets", pa.large_list(pa.uint8())),
        pa.field("roles", pa.large_list(pa.int8())),
        pa.field("example_id", pa.string()),
        pa.field("sample_hash", pa.string()),
    ]
)


@dataclass(frozen=True, slots=True)
class StoredSample:
    """What emit needs of a sample (message structure is only needed before truncation)."""

    input_ids: np.ndarray
    targets: np.ndarray
    roles: np.ndarray
    example_id: str
    sample_hash: str
    source: str
    repeat: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


class SampleStore:
    """Append-only while encoding; `close()` hands back a reader over the memory-mapped file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, _SCHEMA)
        self._buffer: list[Tokenized] = []
        self._lengths: list[int] = []
        self._sources: list[str] = []

    def append(self, sample: Tokenized) -> int:
        self._buffer.append(sample)
        self._lengths.append(len(sample))
        self._sources.append(sample.source)
        if len(self._buffer) == BATCH_ROWS:
            self._flush()
        return len(self._lengths) - 1

    def _flush(self) -> None:
        if not self._buffer:
            return
        samples = self._buffer
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in samples], out=offsets[1:])
        self._writer.write_batch(
            pa.record_batch(
                [
                    _lists([s.input_ids for s in samples], offsets, pa.int32()),
                    _lists([s.targets.view(np.uint8) for s in samples], offsets, pa.uint8()),
                    _lists([s.roles for s in samples], offsets, pa.int8()),
                    pa.array([s.example_id for s in samples], pa.string()),
                    pa.array([s.sample_hash for s in samples], pa.string()),
                ],
                schema=_SCHEMA,
            )
        )
        self._buffer = []

    def close(self) -> SampleReader:
        self._flush()
        self._writer.close()
        self._sink.close()
        return SampleReader(self.path, np.asarray(self._lengths, dtype=np.int64), self._sources)


def _lists(arrays: list[np.ndarray], offsets: np.ndarray, dtype: pa.DataType) -> pa.Array:
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays), type=dtype))


class SampleReader:
    """Random access to stored samples by index, reading from a memory map."""

    def __init__(self, path: Path, lengths: np.ndarray, sources: list[str]):
        self.path = path
        self.lengths = lengths
        self.sources = sources
        self._map = pa.memory_map(str(path), "r")
        reader = pa.ipc.open_file(self._map)
        self._batches = [_Batch(reader.get_batch(i)) for i in range(reader.num_record_batches)]

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, index: int, repeat: int = 0) -> StoredSample:
        batch = self._batches[index // BATCH_ROWS]
        row = index % BATCH_ROWS
        start, end = batch.offsets[row], batch.offsets[row + 1]
        return StoredSample(
            input_ids=batch.input_ids[start:end],
            targets=batch.targets[start:end].view(bool),
            roles=batch.roles[start:end],
            example_id=batch.example_ids[row].as_py(),
            sample_hash=batch.sample_hashes[row].as_py(),
            source=self.sources[index],
            repeat=repeat,
        )

    def close(self) -> None:
        self._batches = []
        self._map.close()


class _Batch:
    """Numpy views of one mapped record batch (the three token columns share their offsets)."""

    def __init__(self, batch: pa.RecordBatch):
        self.offsets = batch.column(0).offsets.to_numpy()
        self.input_ids = batch.column(0).values.to_numpy()
        self.targets = batch.column(1).values.to_numpy()
        self.roles = batch.column(2).values.to_numpy()
        self.example_ids = batch.column(3)
        self.sample_hashes = batch.column(4)
