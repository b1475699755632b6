"""Appendable builds: a first build of N x the quickstart data, then a rebuild after appending rows.

    python bench/append_bench.py                      # 20 x quickstart, append 1% of the rows to chat.jsonl
    python bench/append_bench.py --range-rows 256     # smaller ranges: less of the last one is redone
    python bench/append_bench.py --parquet            # chat as Parquet, written again with the rows appended
    python bench/append_bench.py --compress gzip      # chat.jsonl.gz (or zstd), the rows appended as a new member

Each quickstart file is written N times over into one file of a temp folder (chat.jsonl: 1,300 x N
lines), the first build runs with a fresh cache, then 1% of all rows (copies of chat's first lines)
are appended to chat.jsonl and the same build runs again. Both run in this process, `-j 1`, so that
--range-rows (RANGE_ROWS, set on the module) holds in the encode. The rebuild encodes the appended
rows only (the last range of chat.jsonl starts from its earlier entry); plan and emit run whole, as
the plan is global. With --parquet, chat's rows are a Parquet file, written again whole with the rows
appended (another row-group layout than the first). With --compress, chat's lines are gzip- or
zstd-compressed and the rows are appended as another gzip member or zstd frame (`cat more.gz >> chat.jsonl.gz`);
the bench also times what keying the file costs: decompressing and hashing its text, against reading its
bytes when the cache remembers its range.
The last row checks that the rebuild's output equals a fresh --no-cache build byte for byte.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml
import zstandard

import packtool.ranges as file_ranges
from packtool.builder import Built, build
from packtool.builder.cache import CACHE_DIR, TokenCache
from packtool.builder.encode import CachedRanges
from packtool.config import load_config

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _config(folder: Path, output: str, chat: str) -> Path:
    raw = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    for source in raw["sources"]:
        source["path"] = Path(source["path"]).name
        source["path"] = chat if source["path"] == "chat.jsonl" else source["path"]
    raw["tokenizer"] = str(QUICKSTART.parent / raw["tokenizer"])
    raw["output"] = output
    path = folder / f"{output}.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def _write_parquet(path: Path, lines: str, row_group_size: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in lines.splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


COMPRESSORS = {
    "gzip": (".gz", lambda text: gzip.compress(text, compresslevel=6)),
    "zstd": (".zst", lambda text: zstandard.ZstdCompressor(level=3).compress(text)),
}


def _keying_seconds(file: Path, cache: TokenCache, rounds: int = 5) -> tuple[float, float]:
    """Median seconds of row_ranges on a compressed file: decompressing and hashing its text, and with its
    range remembered in the cache (reading its bytes)."""
    hashed, remembered = [], []
    for _ in range(rounds):  # interleaved, pair by pair: the machine's load moves
        begun = time.perf_counter()
        file_ranges.row_ranges(str(file), None)
        hashed.append(time.perf_counter() - begun)
        begun = time.perf_counter()
        file_ranges.row_ranges(str(file), None, CachedRanges(cache))
        remembered.append(time.perf_counter() - begun)
    return sorted(hashed)[rounds // 2], sorted(remembered)[rounds // 2]


def _timed(config: Path, *, use_cache: bool = True) -> tuple[float, Built]:
    begun = time.perf_counter()
    built = build(load_config(config, workers="1"), use_cache=use_cache)
    return time.perf_counter() - begun, built


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--share", type=float, default=0.01, help="rows appended, as a share of all rows")
    parser.add_argument("--range-rows", type=int, default=file_ranges.RANGE_ROWS)
    parser.add_argument("--parquet", action="store_true", help="chat's rows as Parquet, written again when grown")
    parser.add_argument("--compress", choices=sorted(COMPRESSORS), help="chat's lines compressed, grown by a member")
    args = parser.parse_args()
    file_ranges.RANGE_ROWS = args.range_rows
    with tempfile.TemporaryDirectory(prefix="append-bench-") as tmp:
        folder = Path(tmp)
        rows = 0
        for source in yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))["sources"]:
            text = (QUICKSTART.parent / source["path"]).read_text(encoding="utf-8")
            (folder / Path(source["path"]).name).write_text(text * args.copies, encoding="utf-8")
            rows += text.count("\n") * args.copies
        suffix, compress = COMPRESSORS[args.compress] if args.compress else ("", None)
        chat = folder / ("chat.parquet" if args.parquet else f"chat.jsonl{suffix}")
        if args.parquet:
            _write_parquet(chat, (folder / "chat.jsonl").read_text(encoding="utf-8"), row_group_size=10_000)
        if compress is not None:
            chat.write_bytes(compress((folder / "chat.jsonl").read_bytes()))
            (folder / "chat.jsonl").unlink()  # not an input: the config names chat.jsonl.gz
        first_s, first = _timed(_config(folder, "out", chat.name))
        added = round(rows * args.share)
        head = (QUICKSTART.parent / "quickstart" / "chat.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
        appended = "".join(head[i % len(head)] for i in range(added))
        if compress is not None:  # cat more.jsonl.gz >> chat.jsonl.gz
            with chat.open("ab") as handle:
                handle.write(compress(appended.encode()))
        else:
            with (folder / "chat.jsonl").open("a", encoding="utf-8") as handle:
                handle.write(appended)
        if args.parquet:  # written again whole, in other row groups
            _write_parquet(chat, (folder / "chat.jsonl").read_text(encoding="utf-8"), row_group_size=8_192)
        again_s, again = _timed(_config(folder, "out", chat.name))
        keying = _keying_seconds(chat, TokenCache(folder / CACHE_DIR)) if compress is not None else None
        _timed(_config(folder, "fresh", chat.name), use_cache=False)
        same = _digest(folder / "out") == _digest(folder / "fresh")

    print(f"{args.copies} x quickstart ({rows:,} rows), RANGE_ROWS {args.range_rows:,}, +{added:,} rows to {chat.name}")
    print(f"{'build':<22} {'seconds':>8} {'records':>9} {'re-encoded':>11} {'share':>7}")
    for name, seconds, built in (("first (fresh cache)", first_s, first), ("after append", again_s, again)):
        r = built.records
        share = r.records_reencoded / r.records
        print(f"{name:<22} {seconds:>8.2f} {r.records:>9,} {r.records_reencoded:>11,} {share:>7.1%}")
    print(f"speedup {first_s / again_s:.1f}x; {again.records.describe()}")
    if keying is not None:
        print(f"keying {chat.name}: decompress and hash {keying[0]:.3f} s, remembered {keying[1]:.3f} s")
    print(f"rebuild equals a fresh --no-cache build byte for byte: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
