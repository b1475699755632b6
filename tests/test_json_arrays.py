"""A JSON array is read a block at a time: the same rows and rejects at every block size, and memory that
holds a row, not the file (it was read whole: a 2 GB array, OpenHermes-2.5's shape, held ~5x that)."""

from __future__ import annotations

import gzip
import json
import random
import tracemalloc

import pytest

from packtool import reading
from packtool.errors import RecordError
from packtool.reading import raw_records

BLOCKS = (1, 2, 3, 7, 64, 4096)
WHOLE = 1 << 24  # one block holds any test file: the array read whole, as before
LIMIT = 1 << 20

TEXTS = ["plain", "café", "你好", "😀 emoji", 'a "quote"', "back\\slash", "line\nbreak", "tab\t", ""]
ESCAPED = [r"\u00e9", r"\ud83d\ude00", r"\n", r"\"", r"\\", r"\/"]
DAMAGED = [r"\u0000", r"\ud800", r"\udc00x"]  # a NUL, lone surrogate halves: rejects of their own row


def _string(rng: random.Random) -> str:
    parts = [json.dumps(rng.choice(TEXTS), ensure_ascii=rng.random() < 0.5)[1:-1] for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.3:
        parts.append(rng.choice(ESCAPED))
    if rng.random() < 0.05:
        parts.append(rng.choice(DAMAGED))
    return '"' + "".join(parts) + '"'


def _value(rng: random.Random, depth: int = 0) -> str:
    kind = rng.random()
    if depth > 2 or kind < 0.4:
        return rng.choice(
            [_string(rng), str(rng.randint(-(10**12), 10**12)), "1.5e-3", "true", "false", "null", "-0.25", "NaN"]
            if rng.random() < 0.97
            else ["Infinity"]
        )
    if kind < 0.6:
        return "[" + ", ".join(_value(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"
    blank = rng.choice(["", " ", "\n", "\r\n  "])
    items = [f"{_string(rng)}:{blank}{_value(rng, depth + 1)}" for _ in range(rng.randint(0, 3))]
    return "{" + blank + f",{blank}".join(['"text": ' + _string(rng), *items]) + blank + "}"


def _array(rng: random.Random, rows: int) -> bytes:
    blank = rng.choice(["", " ", "\n", "\n  ", "\t"])
    values = [
        _value(rng) if rng.random() < 0.9 else rng.choice(["7", '"just a string"', "[1, 2]"]) for _ in range(rows)
    ]
    text = "[" + blank + f",{blank}".join(values) + blank + "]" + rng.choice(["", "\n", "  \n"])
    return text.encode()


def _damage(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data))
    return rng.choice(
        [
            lambda: data[:at],  # cut short
            lambda: data[:at] + b"\xff" + data[at:],  # a byte that is not UTF-8
            lambda: data[:at] + rng.choice([b",", b"}", b"]", b"x", b'"', b"[["]) + data[at:],
            lambda: data + b" trailing",  # extra data after the closing bracket
        ]
    )()


def _read(path, block: int, monkeypatch, start: int = 0, stop: int | None = None) -> list:
    """(N, record) or (N, kind, message, row) of every row, read ARRAY_BLOCK = `block` bytes at a time."""
    monkeypatch.setattr(reading, "ARRAY_BLOCK", block)
    rows = []
    for n, record in raw_records(str(path), "t.json", start, stop, LIMIT):
        if isinstance(record, RecordError):
            rows.append((n, record.kind, str(record), record.row))
        else:
            rows.append((n, record))
    return rows


@pytest.mark.parametrize("seed", range(40))
def test_every_block_size_reads_what_the_whole_text_reads(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    data = _array(rng, rng.randint(0, 12))
    if seed % 2:
        data = _damage(rng, data)
    path = tmp_path / "t.json"
    path.write_bytes((reading.BOM if seed % 5 == 0 else b"") + b"\n" * (seed % 3) + data)
    whole = _read(path, WHOLE, monkeypatch)
    for block in BLOCKS:
        assert _read(path, block, monkeypatch) == whole, (block, data)
    if not seed % 2:  # a sound array: json's own parse of the whole text, NaN and all
        parsed = json.loads(data, parse_constant=lambda name: name)
        kept = {n: record for n, record, *_ in whole if not isinstance(record, str)}
        assert all(kept[n] == parsed[n] for n in kept) and len(whole) == len(parsed), whole
    start, stop = 1, 3  # a range of rows reads the same rows at any block size
    ranged = _read(path, WHOLE, monkeypatch, start, stop)
    for block in (1, 7):
        assert _read(path, block, monkeypatch, start, stop) == ranged


@pytest.mark.parametrize("block", [1, 5, WHOLE])
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # where a parse error is, in the file's lines and columns, whichever block it was read in
        (b'[{"text": "fine"},\n  {"text": "cut', "not valid JSON: Unterminated string starting at line 2 column 12"),
        (b'[{"text": "a"}\n {"text": "b"}]', "not valid JSON: expected ',' or ']' after row 0"),
        (b'[{"text": "a"}] x', "not valid JSON: extra data after the closing ']'"),
        (b'[\n\n   {"text": "a"},\n   {"text" "b"}]', "not valid JSON: Expecting ':' delimiter at line 4 column 12"),
        (b'[{"text": "a"}, {"text": "caf\xe9"}]', "not valid UTF-8 (byte 0xe9 at offset 29)"),
    ],
)
def test_a_broken_array_is_named_where_the_whole_text_named_it(tmp_path, monkeypatch, block, data, expected):
    path = tmp_path / "t.json"
    path.write_bytes(data)
    unreadable = [row for row in _read(path, block, monkeypatch) if len(row) == 4 and row[1] == "unreadable_file"]
    assert len(unreadable) == 1 and expected in unreadable[0][2], unreadable


def test_a_file_that_is_not_utf8_or_is_cut_short_trains_none_of_its_rows(tmp_path, monkeypatch):
    """As when the array was read whole: the fault is found before any row is given out, at any block size."""
    rows = b"[" + b", ".join(b'{"text": "row %d"}' % i for i in range(200)) + b"]"
    late_byte = tmp_path / "late.json"
    late_byte.write_bytes(rows[:-40] + b"\xff" + rows[-40:])
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(rows)[:-30])
    for path in (late_byte, cut):
        for block in (64, WHOLE):
            read = _read(path, block, monkeypatch)
            assert [row[1] for row in read] == ["unreadable_file"], read


def test_a_row_longer_than_many_blocks_is_read_whole(tmp_path, monkeypatch):
    long_text = "word " * 50_000 + "é" * 1_000
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": long_text}, {"text": "c"}], ensure_ascii=False))
    assert _read(path, 64, monkeypatch) == [(0, {"text": "a"}), (1, {"text": long_text}), (2, {"text": "c"})]


def test_reading_an_array_holds_a_block_not_the_file(tmp_path, monkeypatch):
    """Read whole, an array peaked at ~5x its size in this process (its bytes, its text, its rows); now the
    peak is the read buffers and a block's text, the same for a file four times larger."""
    row = {"conversations": [{"from": "human", "value": "question " * 40}, {"from": "gpt", "value": "answer " * 60}]}
    monkeypatch.setattr(reading, "ARRAY_BLOCK", 1 << 16)
    peaks, sizes = [], []
    for rows in (5_000, 20_000):
        path = tmp_path / f"{rows}.json"
        path.write_text(json.dumps([row] * rows))
        tracemalloc.start()
        try:
            count = sum(1 for _ in raw_records(str(path), "t.json", 0, None, LIMIT))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert count == rows
        sizes.append(path.stat().st_size)
    assert peaks[1] < 1.2 * peaks[0] and peaks[1] < sizes[1] / 4, (peaks, sizes)
