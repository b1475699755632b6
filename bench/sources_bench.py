"""CPU per record of reading and normalizing sources (packtool.sources), by format and by part.

    python bench/sources_bench.py            # the real datasets in ../shared/data
    python bench/sources_bench.py --repeat 9

Process time, best of --repeat passes, so other processes on a shared machine do not count.
The alpaca en/zh and code_alpaca files are read as alpaca (JSON arrays) and, turned into
messages, as JSON Lines (the chat data of the throughput issue); glaive as sharegpt; c4 as text.
Parts: the JSON parse alone, the record hash alone, and the whole read (parse, checks,
normalization into Example, hash).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packtool.adapters import record_hash  # noqa: E402
from packtool.config import DEFAULT_FIELDS, DEFAULT_SHAREGPT_ROLES, SourceConfig  # noqa: E402
from packtool.sources import read_source  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "datasets"
ALPACA = ["llamafactory_alpaca_en_demo.json", "llamafactory_alpaca_zh_demo.json", "code_alpaca_2k.json"]


def _best(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeat):
        start = time.process_time()
        count = fn()
        best = min(best, time.process_time() - start)
    return best, count


def _source(fmt: str, *paths: Path) -> SourceConfig:
    roles = dict(DEFAULT_SHAREGPT_ROLES) if fmt == "sharegpt" else {}
    return SourceConfig("bench", tuple(map(str, paths)), (), fmt, dict(DEFAULT_FIELDS[fmt]), role_map=roles)


def _as_messages(folder: Path) -> Path:
    path = folder / "chat.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for name in ALPACA:
            for row in json.loads((DATA / name).read_text(encoding="utf-8")):
                prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
                turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
                out.write(json.dumps({"messages": turns}, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not DATA.is_dir():
        sys.exit(f"{DATA} not found")
    with tempfile.TemporaryDirectory() as tmp:
        chat = _as_messages(Path(tmp))
        cases = [
            ("alpaca (JSON arrays)", _source("alpaca", *(DATA / n for n in ALPACA))),
            ("messages (JSON Lines)", _source("messages", chat)),
            ("sharegpt glaive (JSON array)", _source("sharegpt", DATA / "llamafactory_glaive_toolcall_en_demo.json")),
            ("text c4 (JSON Lines)", _source("text", DATA / "llamafactory_c4_demo.jsonl")),
        ]
        print("| source | records | whole read us/record | JSON parse us | record hash us |")
        print("|---|---:|---:|---:|---:|")
        for name, source in cases:
            whole, count = _best(lambda s=source: sum(1 for _ in read_source(s)), args.repeat)
            records = _records(source)
            parse, _ = _best(lambda s=source: len(_records(s)), args.repeat)
            hashed, _ = _best(lambda r=records: len([record_hash(x) for x in r]), args.repeat)
            per = 1e6 / count
            print(f"| {name} | {count} | {whole * per:.1f} | {parse * per:.1f} | {hashed * per:.1f} |")


def _records(source: SourceConfig) -> list:
    records: list = []
    for path in source.paths:
        text = Path(path).read_text(encoding="utf-8")
        records += json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()]
    return records


if __name__ == "__main__":
    main()
