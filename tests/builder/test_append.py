"""Appendable builds: encode items are keyed by the content of their row range, so added data re-encodes
only itself, and the result equals a fresh build of the same data byte for byte."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import QUICKSTART

import packtool.builder.encode as encode_phase
import packtool.builder.store as store
import packtool.ranges as file_ranges
from packtool.builder import Built, build
from packtool.builder.cache import TokenCache, entry_digest
from packtool.builder.encode import CachedRanges
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.errors import PacktoolError
from packtool.reading import open_text

pytestmark = pytest.mark.timeout(300)

RANGE = 8  # rows per range here, so that a few dozen rows make several ranges


def _line(i: int) -> str:
    answer = " ".join(["answer"] * (3 + 5 * (i % 4)))
    messages = [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages}) + "\n"


def _write(path: Path, rows: range) -> None:
    path.write_text("".join(_line(i) for i in rows), encoding="utf-8")


def _build(
    folder: Path, output: str, *, use_cache: bool = True, path: str = "data/*.jsonl", **settings: object
) -> Built:
    raw = {
        "sources": [{"name": "chat", "path": path, "format": "messages"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 128,
        "output": output,
        "rows_per_shard": 4,
        **settings,
    }
    (folder / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return build(load_config(folder / "config.json", workers="1"), use_cache=use_cache)


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")}


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    _write(tmp_path / "data" / "a.jsonl", range(30))  # ranges 0-8, 8-16, 16-24, 24-30
    first = _build(tmp_path, "out")
    assert (first.encode_items, first.encode_reused, first.records.records) == (4, 0, 30)
    return tmp_path


def _same_as_fresh(folder: Path, path: str = "data/*.jsonl") -> None:
    _build(folder, "fresh", use_cache=False, path=path)
    assert _files(folder / "out") == _files(folder / "fresh")  # shards, manifest (plan_hash too), rejects


def test_appended_rows_reencode_only_the_last_range_and_the_new_ones(data):
    with (data / "data" / "a.jsonl").open("a", encoding="utf-8") as handle:
        handle.write("".join(_line(i) for i in range(30, 43)))  # the last range fills up (24-32), 32-40, 40-43 are new
    again = _build(data, "out")
    assert (again.encode_items, again.encode_reused) == (6, 3)
    # the grown range 24-32 takes its first six rows from its earlier entry: only the 13 new rows are encoded
    assert (again.records.records, again.records.records_reencoded) == (43, 2 + 8 + 3)
    assert again.records.why == ("data/a.jsonl grew by 13 rows",)
    assert again.records.describe() == "30 of 43 records reused; re-encoded 13 (data/a.jsonl grew by 13 rows)"
    _same_as_fresh(data)


def _append(file: Path, rows: range) -> None:
    with file.open("a", encoding="utf-8") as handle:
        handle.write("".join(_line(i) for i in rows))


def _entry(cache: Path, key: str) -> tuple[bytes, bytes, bytes]:
    folder = cache / "tokens" / key[:2]
    return tuple((folder / f"{key}{suffix}").read_bytes() for suffix in (".arrow", ".rejects.arrow", ".json"))


def _keys(cache: Path) -> set[str]:
    return {p.stem for p in (cache / "tokens").glob("*/*.json")}


def test_a_grown_range_writes_the_entry_a_whole_encode_writes(data):
    _append(data / "data" / "a.jsonl", range(30, 35))  # 24-30 grows to 24-32, then 32-35
    assert _build(data, "out").records.records_reencoded == 5
    _build(data, "apart", cache="apart-cache")  # a cache of its own: every range encoded whole
    assert len(_keys(data / "apart-cache")) == 5
    for key in _keys(data / "apart-cache"):  # partitions and sealed reports, byte for byte, 24-32 included
        assert _entry(data / ".packtool-cache", key) == _entry(data / "apart-cache", key)


def test_a_grown_range_of_groups_carries_their_roles_and_rewards(tmp_path, monkeypatch):
    """Group rows (consecutive segments of one record, with kind, completion, reward) are carried as written."""
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "a.jsonl"

    def group(i: int) -> str:
        rewards = {"rewards": [1.0, 0.5 * (i % 3)]} if i % 2 else {}
        return json.dumps({"prompt": f"{i}+{i}?", "completions": [str(2 * i), "no"], **rewards}) + "\n"

    def build_groups(output: str, cache: str) -> Built:
        raw = {
            "sources": [{"name": "rl", "path": "data/a.jsonl", "format": "group"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 128,
            "output": output,
            "cache": cache,
        }
        (tmp_path / "config.json").write_text(json.dumps(raw), encoding="utf-8")
        return build(load_config(tmp_path / "config.json", workers="1"))

    file.write_text("".join(group(i) for i in range(11)), encoding="utf-8")  # 0-8, 8-11
    build_groups("out", "cache")
    file.write_text("".join(group(i) for i in range(14)), encoding="utf-8")  # 8-14 starts with 8-11
    assert build_groups("out", "cache").records.records_reencoded == 3
    build_groups("apart", "apart-cache")
    for key in _keys(tmp_path / "apart-cache"):
        assert _entry(tmp_path / "cache", key) == _entry(tmp_path / "apart-cache", key)
    assert _files(tmp_path / "out") == _files(tmp_path / "apart")


def test_appending_twice_carries_the_grown_range_over_again(data):
    _append(data / "data" / "a.jsonl", range(30, 31))  # 24-31
    assert _build(data, "out").records.records_reencoded == 1
    _append(data / "data" / "a.jsonl", range(31, 34))  # 24-32 (one new row), 32-34
    again = _build(data, "out")
    assert (again.records.records_reencoded, again.records.why) == (3, ("data/a.jsonl grew by 3 rows",))
    _same_as_fresh(data)


def test_a_changed_row_in_the_grown_range_reencodes_it_whole(data):
    lines = (data / "data" / "a.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[25] = _line(99)  # in the last range, which also grows
    (data / "data" / "a.jsonl").write_text("".join(lines + [_line(i) for i in range(30, 33)]), encoding="utf-8")
    again = _build(data, "out")
    assert again.records.records_reencoded == 8 + 1  # 24-32 whole (its first bytes are not the entry's), 32-33
    _same_as_fresh(data)


def test_a_last_line_without_newline_is_not_carried_over(data):
    file = data / "data" / "a.jsonl"
    file.write_bytes(file.read_bytes().rstrip(b"\n"))
    assert _build(data, "out").records.records_reencoded == 6  # its bytes changed: the range is encoded again
    file.write_bytes(file.read_bytes() + b"\n" + _line(30).encode())  # the last line may have grown: not carried
    assert _build(data, "out").records.records_reencoded == 7
    _same_as_fresh(data)


def test_a_damaged_earlier_entry_is_not_carried_over(data):
    cache = data / ".packtool-cache"
    (last,) = [k for k in _keys(cache) if json.loads(_entry(cache, k)[2])["read"] == 6]  # rows 24-30
    partition = cache / "tokens" / last[:2] / f"{last}.arrow"
    partition.write_bytes(partition.read_bytes()[:-8] + bytes(8))  # its sha256 no longer matches its report
    _append(data / "data" / "a.jsonl", range(30, 32))
    again = _build(data, "out")
    assert again.records.records_reencoded == 8  # the whole grown range, 24-32
    _same_as_fresh(data)


def test_rejects_in_a_carried_range_keep_their_place(tmp_path, monkeypatch):
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "a.jsonl"
    bad = json.dumps({"messages": 5}) + "\n"  # not a list: a reject
    file.write_text(_line(0) + bad + "\n" + _line(3), encoding="utf-8")  # a blank line too
    assert _build(tmp_path, "out", on_error="skip").records.records == 3
    file.write_text(file.read_text(encoding="utf-8") + bad + _line(5), encoding="utf-8")
    with pytest.raises(PacktoolError, match=r"data/a.jsonl:2\b"):  # under fail, the carried bad record stops it
        _build(tmp_path, "failed", on_error="fail")
    again = _build(tmp_path, "out", on_error="skip")
    assert (again.records.records, again.records.records_reencoded) == (5, 2)
    _build(tmp_path, "fresh", use_cache=False, on_error="skip")
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")  # rejects.jsonl with its locations and order


def test_a_changed_row_reencodes_only_its_range(data):
    lines = (data / "data" / "a.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10] = _line(99)
    (data / "data" / "a.jsonl").write_text("".join(lines), encoding="utf-8")
    again = _build(data, "out")
    assert (again.encode_items, again.encode_reused, again.records.records_reencoded) == (4, 3, 8)
    assert again.records.why == ("data/a.jsonl changed in rows 9-16",)
    _same_as_fresh(data)


def test_a_new_file_reencodes_only_itself(data):
    _write(data / "data" / "b.jsonl", range(5))
    again = _build(data, "out")
    assert (again.encode_items, again.encode_reused, again.records.records_reencoded) == (5, 4, 5)
    assert again.records.why == ("data/b.jsonl is new to the cache",)
    _same_as_fresh(data)


def test_an_unchanged_rebuild_reencodes_nothing(data):
    again = _build(data, "out")
    assert (again.encode_reused, again.records.records_reencoded, again.records.why) == (4, 0, ())
    assert again.records.describe() == "30 of 30 records reused"


def test_ranges_hash_their_own_lines(data):
    file = data / "data" / "a.jsonl"
    ranges = file_ranges.row_ranges(str(file), None)
    lines = file.read_bytes().splitlines(keepends=True)
    expected = [hashlib.sha256(b"".join(lines[s : s + RANGE])).hexdigest() for s in (0, 8, 16, 24)]
    assert [(r.start, r.end, r.content, r.rows) for r in ranges] == [
        (0, 8, expected[0], 30),
        (8, 16, expected[1], 30),
        (16, 24, expected[2], 30),
        (24, None, expected[3], 30),
    ]
    # an unterminated last line still belongs to the last range, and a range of exactly RANGE lines closes
    file.write_bytes(b"".join(lines[:16]).rstrip(b"\n"))
    assert [(r.start, r.end, r.rows) for r in file_ranges.row_ranges(str(file), None)] == [(0, 8, 16), (8, None, 16)]


def _write_table(path: Path, rows: list[list[dict]], how: str) -> None:
    """The rows as Parquet or Arrow, laid out differently each time (row groups, batches, compression)."""
    table = pa.table({"messages": rows})
    if how == "parquet":
        pq.write_table(table, path, row_group_size=3 + len(rows) % 5, compression="zstd" if len(rows) % 2 else "snappy")
        return
    new = pa.ipc.new_stream if how == "arrow_stream" else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2 + len(rows) % 7):
            writer.write_batch(batch)


@pytest.mark.parametrize("how", ["parquet", "arrow_stream", "arrow_file"])
def test_a_table_written_again_with_more_rows_reencodes_only_its_new_ranges(tmp_path, monkeypatch, how):
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "a.table"

    def write_and_build(rows: list[list[dict]], output: str = "out", use_cache: bool = True) -> Built:
        _write_table(file, rows, how)
        config = {
            "sources": [{"name": "chat", "path": "data/a.table", "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 128,
            "output": output,
        }
        (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return build(load_config(tmp_path / "config.json", workers="1"), use_cache=use_cache)

    rows = [json.loads(_line(i))["messages"] for i in range(30)]
    assert write_and_build(rows[:20]).encode_items == 3  # 0-8, 8-16, 16-20
    # another layout, the same first 20 rows: 0-8 and 8-16 are reused, 16-24 starts with the rows of 16-20
    again = write_and_build(rows)
    assert (again.encode_items, again.encode_reused, again.records.records_reencoded) == (4, 2, 4 + 6)
    assert again.records.why == ("data/a.table grew by 10 rows",)
    write_and_build(rows, "fresh", use_cache=False)
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")

    def unhashed(*args: object) -> str:
        raise AssertionError("a table whose bytes are as at the last build is not hashed again")

    with monkeypatch.context() as patched:
        patched.setattr(file_ranges, "rows_digest", unhashed)  # its range hashes come from the cache
        unchanged = write_and_build(rows)  # the same bytes again
    assert unchanged.encode_reused == unchanged.encode_items == 4

    rows[10] = json.loads(_line(99))["messages"]  # a changed row: its range alone
    changed = write_and_build(rows)
    assert (changed.encode_reused, changed.records.records_reencoded) == (3, 8)
    assert changed.records.why == ("data/a.table changed in rows 9-16",)


def test_remembered_table_hashes_are_checked(tmp_path, monkeypatch):
    """A record of a table's range hashes is used only for the bytes it names and only as written."""
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    file, cache = tmp_path / "a.parquet", TokenCache(tmp_path / "cache")
    _write_table(file, [json.loads(_line(i))["messages"] for i in range(20)], "parquet")
    hashed = file_ranges.row_ranges(str(file), None)
    assert file_ranges.row_ranges(str(file), None, CachedRanges(cache)) == hashed  # hashed, then recorded
    (memo,) = (tmp_path / "cache" / "files").glob("*/*.json")
    recorded = json.loads(memo.read_text())
    memo.write_text(json.dumps({**recorded, "ranges": recorded["ranges"][:1]}))  # changed: its seal no longer holds
    assert file_ranges.row_ranges(str(file), None, CachedRanges(cache)) == hashed
    assert json.loads(memo.read_text()) == recorded  # recorded again as hashed


def test_a_line_over_max_record_bytes_keeps_the_numbers_of_the_ranges_after_it(data):
    """A line read in pieces (it is over max_record_bytes) counts as one line for the ranges that start past it."""
    lines = (data / "data" / "a.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[2] = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}) + "\n"  # 3 pieces of 1,025 bytes
    (data / "data" / "a.jsonl").write_text("".join(lines), encoding="utf-8")
    again = _build(data, "out", on_error="skip", max_record_bytes=1024)
    assert again.records.records == 30  # not 30 + 2 (each range after it started two lines early)
    rejects = [json.loads(line) for line in (data / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["location"], r["reason"]) for r in rejects] == [("data/a.jsonl:3", "record_too_large")]


# -- compressed JSON Lines: one range each, keyed by the decompressed text -----------------------------------

Compress = Callable[[bytes, int], bytes]
COMPRESSORS: dict[str, tuple[str, Compress]] = {
    "gzip": (".gz", lambda text, level: gzip.compress(text, compresslevel=level, mtime=level)),
    "zstd": (".zst", lambda text, level: zstandard.ZstdCompressor(level=level).compress(text)),
}


def _text(rows: range) -> bytes:
    return "".join(_line(i) for i in rows).encode()


@pytest.fixture(params=sorted(COMPRESSORS))
def packed(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Compress]:
    """30 rows in data/a.jsonl.gz (or .zst), built once: one encode item, whatever RANGE_ROWS."""
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    monkeypatch.setattr(store, "BATCH_ROWS", 4)  # a carried entry's full batches are copied whole (extend)
    suffix, compress = COMPRESSORS[request.param]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / f"a.jsonl{suffix}").write_bytes(compress(_text(range(30)), 3))
    first = _build(tmp_path, "out", path="data/a.jsonl.*")
    assert (first.encode_items, first.encode_reused, first.records.records) == (1, 0, 30)
    return tmp_path, compress


def _compressed(folder: Path) -> Path:
    (file,) = (folder / "data").glob("a.jsonl.*")
    return file


@pytest.mark.parametrize("how", ["concatenated", "recompressed"])
def test_a_compressed_file_that_grew_reencodes_only_its_new_rows(packed, how):
    folder, compress = packed
    file = _compressed(folder)
    if how == "concatenated":  # cat more.jsonl.gz >> a.jsonl.gz: a second gzip member or zstd frame
        file.write_bytes(file.read_bytes() + compress(_text(range(30, 43)), 3))
    else:  # written again whole, at another level
        file.write_bytes(compress(_text(range(43)), 9))
    again = _build(folder, "out", path="data/a.jsonl.*")
    assert (again.encode_items, again.encode_reused) == (1, 0)
    assert (again.records.records, again.records.records_reencoded) == (43, 13)
    assert again.records.why == (f"data/{file.name} grew by 13 rows",)
    _same_as_fresh(folder, "data/a.jsonl.*")
    _build(folder, "apart", cache="apart-cache", path="data/a.jsonl.*")  # encoded whole: the same entry
    (key,) = _keys(folder / "apart-cache")
    assert _entry(folder / ".packtool-cache", key) == _entry(folder / "apart-cache", key)


def test_a_recompressed_file_with_the_same_lines_reencodes_nothing(packed, monkeypatch):
    folder, compress = packed
    file = _compressed(folder)
    file.write_bytes(compress(_text(range(30)), 9))  # other bytes (level, and gzip's header time), the same text
    again = _build(folder, "out", path="data/a.jsonl.*")
    assert (again.encode_reused, again.records.records_reencoded, again.records.why) == (1, 0, ())

    def undecompressed(*args: object) -> object:
        raise AssertionError("a compressed file whose bytes are as at the last build is not decompressed again")

    monkeypatch.setattr(file_ranges, "open_text", undecompressed)  # its range comes from the cache
    assert _build(folder, "out", path="data/a.jsonl.*").encode_reused == 1


def test_a_changed_line_reencodes_the_compressed_file(packed):
    folder, compress = packed
    file = _compressed(folder)
    file.write_bytes(compress(_text(range(29)) + _line(99).encode(), 3))
    again = _build(folder, "out", path="data/a.jsonl.*")
    assert (again.encode_reused, again.records.records_reencoded) == (0, 30)
    assert again.records.why == (f"data/{file.name} changed in rows 1-30",)
    _same_as_fresh(folder, "data/a.jsonl.*")


def _outcome(folder: Path, output: str, **settings: object) -> str:
    """The one-line error of a build of data/a.jsonl.*, or the hashes of what it wrote."""
    try:
        _build(folder, output, path="data/a.jsonl.*", **settings)
    except PacktoolError as error:
        return str(error)
    return json.dumps(_files(folder / output))


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_compressed_tail_is_reported_and_never_carried(packed, damage):
    folder, compress = packed
    file = _compressed(folder)
    before, member = file.read_bytes(), compress(_text(range(30, 43)), 3)
    damaged = bytearray(member)
    if damage == "corrupt":
        damaged[len(damaged) // 2] ^= 0xFF  # gzip: a bad CRC or deflate block; zstd: corrupted data
    else:
        del damaged[len(damaged) // 2 :]  # an append cut short
    file.write_bytes(before + bytes(damaged))
    reported = _outcome(folder, "out")
    assert reported == _outcome(folder, "fresh", use_cache=False)  # as a build without the cache reads it
    assert re.search(rf"data/{file.name}:\d+\b.*damaged after line \d+", reported)
    skipped = _build(folder, "out", path="data/a.jsonl.*", on_error="skip")
    assert skipped.records.records_reencoded == skipped.records.records  # keyed by its bytes: no carried rows
    file.write_bytes(before + member)  # repaired: the broken read's entry is not carried over either
    again = _build(folder, "out", path="data/a.jsonl.*", on_error="skip")
    assert (again.records.records, again.records.records_reencoded) == (43, 43)
    _build(folder, "fresh", use_cache=False, path="data/a.jsonl.*", on_error="skip")
    assert _files(folder / "out") == _files(folder / "fresh")


def test_a_long_line_before_a_carried_compressed_prefix_keeps_the_line_numbers(packed):
    folder, compress = packed
    file = _compressed(folder)
    long = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}) + "\n"  # read in 3 pieces
    text = _text(range(2)) + long.encode() + _text(range(3, 30))
    file.write_bytes(compress(text, 3))
    assert _build(folder, "out", path="data/a.jsonl.*", on_error="skip", max_record_bytes=1024).records.records == 30
    file.write_bytes(compress(text + _text(range(30, 33)), 3))
    again = _build(folder, "out", path="data/a.jsonl.*", on_error="skip", max_record_bytes=1024)
    assert (again.records.records, again.records.records_reencoded) == (33, 3)  # lines 31-33, not 29-33
    _build(folder, "fresh", use_cache=False, path="data/a.jsonl.*", on_error="skip", max_record_bytes=1024)
    assert _files(folder / "out") == _files(folder / "fresh")


def _zstd_files(text: bytes) -> dict[str, tuple[bytes, bytes]]:
    """Ways of writing zstd: name -> (the file's bytes, the text they hold)."""
    streamed = io.BytesIO()
    with zstandard.ZstdCompressor(write_content_size=False).stream_writer(streamed, closefd=False) as writer:
        for at in range(0, len(text), 7777):
            writer.write(text[at : at + 7777])
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"notes"
    one = zstandard.ZstdCompressor().compress(text)
    return {
        "one frame": (one, text),
        "checksum": (zstandard.ZstdCompressor(write_checksum=True, level=19).compress(text), text),
        "streamed, no content size": (streamed.getvalue(), text),
        "frames joined with cat": (one + zstandard.ZstdCompressor(threads=2).compress(text) + one, text * 3),
        "a skippable frame first": (skippable + one, text),
        "an RLE block": (zstandard.ZstdCompressor().compress(b"\n" * 300_000), b"\n" * 300_000),
        "an empty frame": (zstandard.ZstdCompressor().compress(b""), b""),
    }


def test_a_zstd_file_is_read_whole_and_one_cut_short_is_reported(tmp_path):
    """The frames are walked by their headers at the end of the text: every way of writing zstd reads whole,
    and a file cut anywhere inside a frame raises what the read reports (the stream reader alone ends quietly)."""
    file = tmp_path / "a.jsonl.zst"
    for data, text in _zstd_files(_text(range(3000))).values():
        file.write_bytes(data)
        with open_text(str(file), "zstd") as handle:
            assert handle.read() == text
        for cut in sorted({1, 4, len(data) // 2, len(data) - 5}):
            file.write_bytes(data[: len(data) - cut])
            with pytest.raises(zstandard.ZstdError), open_text(str(file), "zstd") as handle:
                handle.read()


def _after_hashing(monkeypatch: pytest.MonkeyPatch, file: Path, then: Callable[[], None]) -> None:
    """`then` runs once the build has hashed `file`'s ranges and before any is encoded: what a writer still
    writing the file while a build runs does."""
    import packtool.builder as builder

    hashed = builder.row_ranges

    def then_write(path: str, *args: Any) -> list[file_ranges.RowRange]:
        ranges = hashed(path, *args)
        if Path(path) == file:
            then()
        return ranges

    monkeypatch.setattr(builder, "row_ranges", then_write)


def test_rows_appended_while_a_build_runs_are_left_to_the_next_and_never_trained_twice(data, monkeypatch):
    file = data / "data" / "a.jsonl"
    _append(file, range(30, 33))  # 24-32, 32-33
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: _append(file, range(33, 37)))
        during = _build(data, "out")
    # the build encodes what it hashed, 33 rows, and says the file grew; the four appended are the next build's
    assert (during.records.records, during.records.records_reencoded, during.records.left) == (33, 3, ("data/a.jsonl",))
    assert during.records.describe().endswith(
        "data/a.jsonl grew during the build: rows appended after the plan are the next build's"
    )
    after = _build(data, "out")
    assert (after.records.records, after.records.records_reencoded, after.records.why) == (
        37,
        4,
        ("data/a.jsonl grew by 4 rows",),
    )
    _same_as_fresh(data)  # no row twice: the shards a fresh build of the 37 rows writes


def test_a_half_written_line_appended_while_a_build_runs_is_not_read(data, monkeypatch):
    file = data / "data" / "a.jsonl"
    _append(file, range(30, 32))  # 24-32: encoded by the build below
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: file.write_bytes(file.read_bytes() + _line(32).encode()[:20]))
        during = _build(data, "out")
    # read, the cut line would be a 33rd record, a parse error
    rejects = during.manifest["rejects"]["count"]
    assert (during.records.records, rejects, during.records.left) == (32, 0, ("data/a.jsonl",))
    file.write_bytes(file.read_bytes() + _line(32).encode()[20:])  # the writer ends its line
    assert _build(data, "out").records.records_reencoded == 1
    _same_as_fresh(data)


def test_a_reused_last_range_says_its_file_grew_during_the_build(data, monkeypatch):
    file = data / "data" / "a.jsonl"
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: _append(file, range(30, 32)))
        during = _build(data, "out")
    assert (during.encode_reused, during.records.records, during.records.left) == (4, 30, ("data/a.jsonl",))


def test_a_line_rewritten_while_a_build_runs_stops_it_with_one_line(data, monkeypatch):
    file = data / "data" / "a.jsonl"
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10] = _line(99)  # rows 9-16 are encoded again, from bytes that are no longer those hashed
    changed = "".join(lines)
    lines[10] = _line(98)
    with monkeypatch.context() as race:
        file.write_text(changed, encoding="utf-8")
        _after_hashing(race, file, lambda: file.write_text("".join(lines), encoding="utf-8"))
        with pytest.raises(
            PacktoolError, match=r"a\.jsonl: lines 9-16 changed while the build read them .*run the build again"
        ):
            _build(data, "out")
    again = _build(data, "out")  # nothing was kept of the failed encode: the rerun encodes the file as it is
    assert again.records.why == ("data/a.jsonl changed in rows 9-16",)
    _same_as_fresh(data)


@pytest.mark.parametrize("how", ["parquet", "arrow_stream", "arrow_file"])
def test_a_table_written_again_while_a_build_runs_is_read_as_hashed(tmp_path, monkeypatch, how):
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "a.table"
    rows = [json.loads(_line(i))["messages"] for i in range(30)]

    def build_table(output: str = "out", use_cache: bool = True) -> Built:
        config = {
            "sources": [{"name": "chat", "path": "data/a.table", "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 128,
            "output": output,
        }
        (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return build(load_config(tmp_path / "config.json", workers="1"), use_cache=use_cache)

    _write_table(file, rows[:20], how)  # 0-8, 8-16, 16-20
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: _write_table(file, rows, how))
        during = build_table()
    assert (during.records.records, during.records.left) == (20, ("data/a.table",))
    after = build_table()
    assert (after.records.records, after.records.records_reencoded) == (30, 10)
    build_table("fresh", use_cache=False)
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


def test_rows_appended_to_a_compressed_file_while_a_build_runs_are_the_next_builds(packed, monkeypatch):
    folder, compress = packed
    file = _compressed(folder)
    file.write_bytes(file.read_bytes() + compress(_text(range(30, 32)), 3))
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: file.write_bytes(file.read_bytes() + compress(_text(range(32, 34)), 3)))
        during = _build(folder, "out", path="data/a.jsonl.*")
    assert (during.records.records, during.records.left) == (32, (f"data/{file.name}",))
    after = _build(folder, "out", path="data/a.jsonl.*")
    assert (after.records.records, after.records.records_reencoded) == (34, 2)
    _same_as_fresh(folder, "data/a.jsonl.*")


def _reseal(report_path: Path, **changes: object) -> None:
    """A report edited and sealed again: its seal is a checksum anyone can recompute, not a signature."""
    report = {**json.loads(report_path.read_text()), **changes}
    report.pop("entry_sha256")
    report_path.write_text(json.dumps({**report, "entry_sha256": entry_digest(report)}))


def _last_entry(cache: Path, rows: int) -> str:
    (key,) = [k for k in _keys(cache) if json.loads(_entry(cache, k)[2])["read"] == rows]
    return key


def test_an_entry_whose_recorded_lines_were_edited_is_reported_and_never_carried(data):
    cache = data / ".packtool-cache"
    last = _last_entry(cache, 6)  # rows 24-30
    _reseal(cache / "tokens" / last[:2] / f"{last}.json", content_lines=5)
    _append(data / "data" / "a.jsonl", range(30, 32))
    again = _build(data, "out")
    assert again.records.records_reencoded == 8  # the whole grown range, 24-32
    partition = cache / "tokens" / last[:2] / f"{last}.arrow"
    assert again.repaired == (f"cache entry {partition}: it was encoded from 5 lines or rows, not the 6 it hashed",)
    _same_as_fresh(data)


def test_an_entry_holding_rows_past_its_recorded_lines_is_reported_and_never_carried(data):
    """What a build before the read stopped at the hashed bytes left behind: rows 24-30 keyed, 24-34 stored."""
    cache = data / ".packtool-cache"
    last = _last_entry(cache, 6)
    file = data / "data" / "a.jsonl"
    _append(file, range(30, 34))
    _build(data, "more", cache="more-cache")  # 0-8, 8-16 and 16-24 as in the first cache; 24-32, 32-34
    (longer,) = [
        k
        for k in _keys(data / "more-cache") - _keys(cache)
        if json.loads(_entry(data / "more-cache", k)[2])["read"] == 8
    ]
    partition, report = (cache / "tokens" / last[:2] / f"{last}{suffix}" for suffix in (".arrow", ".json"))
    partition.write_bytes(_entry(data / "more-cache", longer)[0])
    _reseal(
        report,
        read=8,
        samples=json.loads(_entry(data / "more-cache", longer)[2])["samples"],
        partition_bytes=partition.stat().st_size,
        partition_sha256=hashlib.sha256(partition.read_bytes()).hexdigest(),
    )
    again = _build(data, "out")
    assert again.repaired == (
        f"cache entry {partition}: it holds records from outside the 6 lines or rows it was written for",
    )
    assert (again.records.records, again.records.records_reencoded) == (34, 10)
    _same_as_fresh(data)


def test_verify_names_a_row_trained_twice(data, monkeypatch):
    """The race above with the read unbounded and the carried entry unchecked, as before: the output trains
    rows 33-36 twice, and verify names them."""
    unbounded = encode_phase.read_file
    monkeypatch.setattr(
        encode_phase,
        "read_file",
        lambda source, file, start, end, span, **kw: unbounded(source, file, start, end, **kw),
    )
    monkeypatch.setattr(encode_phase, "_changed_while_read", lambda item, span: None)
    monkeypatch.setattr(encode_phase, "_holds", lambda *args: None)
    file = data / "data" / "a.jsonl"
    _append(file, range(30, 33))
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: _append(file, range(33, 37)))
        _build(data, "out")
    assert _build(data, "out").records.records == 41  # 37 rows
    found = verify(data / "out")
    assert len([p for p in found.problems if "one input row trained twice" in p]) == 4, found.problems
    _build(data, "fresh", use_cache=False)
    assert verify(data / "fresh").ok


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        ({"read": 7}, "it stores or rejects 6 records, not the 7 its report says it read"),
        ({"read": 5}, "it stores or rejects 6 records, not the 5 its report says it read"),
        ({"read": "6"}, "its report's count of records read is '6', not a number"),
    ],
)
def test_an_entry_whose_record_count_was_edited_is_reported_and_never_carried(data, edit, why):
    """A report's seal is a checksum anyone can recompute: what it says is checked against the partition."""
    cache = data / ".packtool-cache"
    last = _last_entry(cache, 6)
    _reseal(cache / "tokens" / last[:2] / f"{last}.json", **edit)
    _append(data / "data" / "a.jsonl", range(30, 32))
    again = _build(data, "out")
    assert again.repaired == (f"cache entry {cache / 'tokens' / last[:2] / last}.arrow: {why}",)
    assert again.records.records_reencoded == 8
    _same_as_fresh(data)


def test_a_file_cut_short_while_a_build_runs_leaves_no_entry_behind(data, monkeypatch):
    """Rows 16-30 hashed, then the file cut to 20 lines: an entry of the 4 rows read under the key of the 8
    hashed would be found again once the file is whole, and those rows lost for good."""
    file = data / "data" / "a.jsonl"
    lines = file.read_bytes().splitlines(keepends=True)
    lines[17] = _line(97).encode()  # 16-24 changed: encoded by the build below
    file.write_bytes(b"".join(lines))
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: file.write_bytes(b"".join(lines[:20])))
        with pytest.raises(PacktoolError, match=r"a\.jsonl: lines 17-24 changed while the build read them"):
            _build(data, "out")
    file.write_bytes(b"".join(lines))  # whole again
    again = _build(data, "out")
    assert (again.records.records, again.records.records_reencoded) == (30, 8)
    _same_as_fresh(data)


def test_a_table_whose_rows_change_while_a_build_runs_stops_it_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "a.parquet"
    rows = [json.loads(_line(i))["messages"] for i in range(20)]  # 0-8, 8-16, 16-20
    _write_table(file, rows, "parquet")
    changed = [*rows[:18], json.loads(_line(99))["messages"], *rows[19:]]
    config = {
        "sources": [{"name": "chat", "path": "data/a.parquet", "format": "messages"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 128,
        "output": "out",
    }
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    _after_hashing(monkeypatch, file, lambda: _write_table(file, changed, "parquet"))
    with pytest.raises(PacktoolError, match=r"a\.parquet: rows 17-20 changed while the build read them"):
        build(load_config(tmp_path / "config.json", workers="1"))
    assert len(_keys(tmp_path / ".packtool-cache")) == 2  # 0-8 and 8-16, as hashed; none under 16-20's key


@pytest.mark.parametrize(
    ("target", "on_error"), [("grown_copy", "fail"), ("other_rows", "fail"), ("other_rows", "skip")]
)
def test_an_input_replaced_by_a_link_while_a_build_runs(data, monkeypatch, target, on_error):
    """h37: the input swapped for a link to another file after its ranges were hashed. A copy holding the
    same rows and more is a file that grew (the new rows are the next build's); a file of other rows is a
    change under the build, one line (under on_error: fail its lines cut at the old offsets were named as a
    parse error instead). Either way no row is trained twice and the next build is a fresh one."""
    file = data / "data" / "a.jsonl"
    _append(file, range(30, 33))  # the last range, 24-33, is encoded by the build below
    elsewhere = data / "elsewhere.jsonl"
    _write(elsewhere, range(37) if target == "grown_copy" else range(100, 133))

    def swap() -> None:
        file.unlink()
        file.symlink_to(elsewhere)

    with monkeypatch.context() as race:
        _after_hashing(race, file, swap)
        if target == "grown_copy":
            assert _build(data, "out", on_error=on_error).records.left == ("data/a.jsonl",)
        else:
            with pytest.raises(PacktoolError, match=r"a\.jsonl: lines 25( on|-32) changed while the build read them"):
                _build(data, "out", on_error=on_error)
    _build(data, "out")
    _same_as_fresh(data)


@pytest.mark.parametrize("kind", ["json_array", "max_samples"])
def test_a_file_keyed_by_its_bytes_that_changes_while_a_build_runs_stops_it(tmp_path, monkeypatch, kind):
    """A JSON array, or any file of a source with max_samples, is one range keyed by the whole file's sha256.
    A row appended after the plan hashed it was encoded under the key of the bytes before and trained, while
    the manifest named those earlier bytes."""
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / ("a.json" if kind == "json_array" else "a.jsonl")
    rows = [json.loads(_line(i)) for i in range(10)]

    def write(records: list[dict]) -> None:
        lines = "".join(json.dumps(record) + "\n" for record in records)
        file.write_text(json.dumps(records) if kind == "json_array" else lines, encoding="utf-8")

    write(rows)
    source = {"name": "chat", "path": f"data/{file.name}", "format": "messages"}
    if kind == "max_samples":
        source["max_samples"] = 100
    config = {"sources": [source], "tokenizer": str(QUICKSTART / "tokenizer"), "capacity": 128, "output": "out"}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: write([*rows, json.loads(_line(99))]))
        with pytest.raises(PacktoolError, match=rf"{file.name}: its bytes changed while the build read it .*run the"):
            build(load_config(tmp_path / "config.json", workers="1"))
    assert not _keys(tmp_path / ".packtool-cache")  # nothing under the key of the bytes hashed
    again = build(load_config(tmp_path / "config.json", workers="1"))
    assert again.records.records == 11


# --- a JSON array splits into ranges of its elements ---------------------------------------------------------


def _array_rows(rows: range) -> list[Any]:
    """Chats, with a reject of each kind a JSON array's element can be every seventh row."""
    out: list[Any] = []
    for i in rows:
        record: Any = json.loads(_line(i))
        if i % 7 == 3:
            record = [1, 2] if i % 2 else "not an object"
        elif i % 7 == 5:
            record["messages"][0]["content"] = "bin\u0000ary"
        out.append(record)
    return out


def _write_array(path: Path, rows: range, *, indent: int | None = 2, bom: bool = False) -> None:
    text = json.dumps(_array_rows(rows), indent=indent, ensure_ascii=False)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8") + b"\n")


@pytest.fixture
def array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    (tmp_path / "data").mkdir()
    _write_array(tmp_path / "data" / "a.json", range(30), bom=True)  # ranges 0-8, 8-16, 16-24, 24-30
    return tmp_path


def _array_outputs(folder: Path) -> dict[str, str]:
    """The shards and rejects: the manifest's plan_hash holds the encode keys, which the split changes."""
    return {name: digest for name, digest in _files(folder).items() if name != "manifest.json"}


def test_a_json_array_splits_into_ranges_that_build_what_it_builds_whole(array, monkeypatch):
    """A JSON array was one work item: one worker read and encoded all of it, however many there were."""
    split = _build(array, "out", path="data/a.json", on_error="skip", max_reject_share=1.0)
    assert (split.encode_items, split.records.records) == (4, 30)
    assert split.manifest["rejects"]["by_reason"] == {"bad_record": 8}
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", 4096)
    whole = _build(array, "whole", use_cache=False, path="data/a.json", on_error="skip", max_reject_share=1.0)
    assert whole.encode_items == 1
    assert _array_outputs(array / "out") == _array_outputs(array / "whole")
    assert (array / "out" / "rejects.jsonl").read_bytes().count(b'"location": "data/a.json:') == 8


def test_a_json_array_written_again_with_more_rows_reencodes_its_last_range_and_the_new_ones(array, monkeypatch):
    settings = {"path": "data/a.json", "on_error": "skip", "max_reject_share": 1.0}
    scans = []
    found = file_ranges.json_array_starts
    monkeypatch.setattr(file_ranges, "json_array_starts", lambda *args: scans.append(args) or found(*args))
    _build(array, "out", **settings)
    assert _build(array, "out", **settings).records.records_reencoded == 0  # the same bytes: ranges remembered
    assert len(scans) == 1
    _write_array(array / "data" / "a.json", range(37), bom=True)  # the "]" moves: 24-32 changed, 32-37 new
    again = _build(array, "out", **settings)
    assert (again.encode_items, again.encode_reused, again.records.records) == (5, 3, 37)
    assert again.records.records_reencoded == 13  # the last range is encoded whole: an array is not appended to
    assert len(scans) == 2
    _build(array, "fresh", use_cache=False, **settings)
    assert _files(array / "out") == _files(array / "fresh")


def test_an_element_of_a_json_array_changed_while_a_build_runs_stops_it(array, monkeypatch):
    file = array / "data" / "a.json"
    changed = _array_rows(range(30))
    changed[10] = json.loads(_line(99))  # in range 8-16, the same size: only its bytes tell
    changed[10]["messages"][0]["content"] = changed[10]["messages"][0]["content"][: len("question 10?")]
    with monkeypatch.context() as race:
        _after_hashing(race, file, lambda: file.write_bytes(b"\xef\xbb\xbf" + json.dumps(changed, indent=2).encode()))
        with pytest.raises(PacktoolError, match=r"a\.json: rows 9-16 changed while the build read them"):
            _build(array, "out", path="data/a.json", on_error="skip", max_reject_share=1.0)
    assert len(_keys(array / ".packtool-cache")) == 1  # 0-8, as hashed; the build stopped at 8-16, storing nothing


@pytest.mark.parametrize("case", ["small", "broken", "gzip"])
def test_a_json_array_that_cannot_split_is_one_range_keyed_by_its_bytes(tmp_path, monkeypatch, case):
    """RANGE_ROWS elements or fewer, an array that does not parse to its end, or a compressed one (read from its
    first byte whatever the range): one work item, as before, whose read reports what is wrong."""
    monkeypatch.setattr(file_ranges, "RANGE_ROWS", RANGE)
    file = tmp_path / "a.json"
    _write_array(file, range(RANGE if case == "small" else 30))
    if case == "broken":
        file.write_bytes(file.read_bytes().rstrip()[:-1] + b"}, x]")
    elif case == "gzip":
        file.write_bytes(gzip.compress(file.read_bytes()))
    (range_,) = file_ranges.row_ranges(str(file), None)
    assert (range_.start, range_.end, range_.unit) == (0, None, None)
    assert range_.content == hashlib.sha256(file.read_bytes()).hexdigest()
