"""Reading one large JSON array: peak memory and time, packtool's block reader against reading it whole.

    python bench/json_array_bench.py                  # a 256 MB array, 3 alternating pairs
    python bench/json_array_bench.py --mb 1024 --pairs 5
    python bench/json_array_bench.py --whole-ref 1875464   # the reader of another commit as the whole-file row

The array is the alpaca demo sets of ../shared/data (en and zh) repeated, each row's instruction made
unique, to --mb megabytes: the shape of OpenHermes-2.5 or the alpaca-style dumps that ship as one JSON
array. Each row reads every record through `packtool.reading.raw_records` in a fresh process, so VmHWM
(the kernel's peak of the process's RSS) is that read's alone:

- `blocks`: this tree's reader (ARRAY_BLOCK bytes at a time);
- `whole`: the reader of --whole-ref (default: the commit before the block reader), which parsed the
  file's whole text at once;
- `datasets`: Hugging Face `datasets.load_dataset("json")` on the same file (the peer: TRL, axolotl and
  LLaMA-Factory load JSON data through it), into a fresh cache folder; skipped when not installed.

The rows alternate pair by pair; the table gives each run and the median of the pairs' ratios.

    python bench/json_array_bench.py --build --mb 32 --pairs 3

builds the array instead (Qwen2.5 of ../shared/data, capacity 2048, `-j 2`), with this tree (`ranges`: a
plain array of more than 4,096 elements splits into ranges that the workers share) against --whole-ref
checked out beside it (`one item`: the whole array one work item): a first build into an empty cache, then
the array written again with 1% more rows and built again; each build's shards are checked to be the same
files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "datasets"
SOURCES = ["llamafactory_alpaca_en_demo.json", "llamafactory_alpaca_zh_demo.json"]
BEFORE_BLOCKS = "b44e4b6"  # the last commit whose reader parsed a JSON array's whole text

READ = """
import importlib.util, json, resource, sys, time
path, module = sys.argv[1], sys.argv[2]
started, cpu = time.perf_counter(), time.process_time()
if module == "datasets":
    import datasets
    datasets.disable_progress_bars()
    rows = len(datasets.load_dataset("json", data_files=path, split="train", cache_dir=sys.argv[3]))
else:
    spec = importlib.util.spec_from_file_location("reading_under_test", module)
    reading = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reading)
    rows = sum(1 for _ in reading.raw_records(path, "bench.json", 0, None, 1 << 30))
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
print(json.dumps({"rows": rows, "wall": time.perf_counter() - started, "cpu": time.process_time() - cpu, "hwm": hwm}))
"""


def write_array(path: Path, megabytes: int, rows_wanted: int | None = None) -> int:
    """The demo rows repeated to `megabytes` (or `rows_wanted` rows), each instruction numbered; the number of
    rows written. The same arguments write the same bytes."""
    rows = [row for name in SOURCES for row in json.loads((DATA / name).read_text(encoding="utf-8"))]
    target, written, count = megabytes << 20, 0, 0
    with path.open("w", encoding="utf-8") as out:
        out.write("[\n")
        while written < target if rows_wanted is None else count < rows_wanted:
            row = dict(rows[count % len(rows)])
            row["instruction"] = f"{count}: {row['instruction']}"
            text = ("" if not count else ",\n") + json.dumps(row, ensure_ascii=False)
            out.write(text)
            written += len(text.encode("utf-8"))
            count += 1
        out.write("\n]\n")
    return count


def run(path: Path, module: str, scratch: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", READ, str(path), module, str(scratch)], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise SystemExit(f"{module}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)


BUILD = """
import json, resource, subprocess, sys, time
import packtool
config, out, cache = sys.argv[1:4]
started = time.perf_counter()
command = ["build", config, "-o", out, "-q", "-j", "2", "--cache", cache]
subprocess.run([sys.executable, "-m", "packtool", *command], check=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
print(json.dumps({"wall": time.perf_counter() - started, "peak": peak, "package": packtool.__file__}))
"""


def run_builds(array: Path, megabytes: int, scratch: Path, whole_ref: str, pairs: int) -> None:
    """Build the array with this tree and with `whole_ref`, alternating: a first build into an empty cache, then
    a build after the array is written again with 1% more rows; print the table."""
    tree = scratch / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), whole_ref], check=True)
    try:
        config = scratch / "config.yaml"
        tokenizer = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2.5"
        config.write_text(
            json.dumps(
                {
                    "sources": [{"name": "alpaca", "path": str(array), "format": "alpaca"}],
                    "tokenizer": str(tokenizer),
                    "capacity": 2048,
                }
            )
        )
        trees = {"ranges": ROOT, "one item": tree}
        results: dict[str, list[dict]] = {name: [] for name in trees}
        shards: dict[str, set[str]] = {}
        rows = write_array(array, megabytes)
        grown = rows + rows // 100
        for pair in range(pairs):
            for name in list(trees) if pair % 2 == 0 else list(trees)[::-1]:
                cache, out = scratch / "cache", scratch / "out"
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                walls = {}
                for build, wanted in (("first", rows), ("grown", grown)):
                    write_array(array, megabytes, wanted)
                    done = subprocess.run(  # run from scratch: `-m` puts the working folder first on sys.path
                        [sys.executable, "-c", BUILD, str(config), str(out), str(cache)],
                        capture_output=True,
                        text=True,
                        env=env,
                        cwd=scratch,
                    )
                    if done.returncode:
                        raise SystemExit(f"{name}: {done.stderr.strip()[-2000:]}")
                    walls[build] = json.loads(done.stdout.splitlines()[-1])
                    if not walls[build]["package"].startswith(str(trees[name])):  # the tree meant, not another
                        raise SystemExit(f"{name} ran {walls[build]['package']}")
                results[name].append(
                    {
                        "first": walls["first"]["wall"],
                        "grown": walls["grown"]["wall"],
                        "peak": max(w["peak"] for w in walls.values()),
                    }
                )
                digests = {
                    f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}" for p in sorted(out.glob("*.parquet"))
                }
                if shards.setdefault(name, digests) != digests or shards[name] != shards[next(iter(shards))]:
                    raise SystemExit(f"{name}: its shards differ from the other build's")
                subprocess.run(["rm", "-rf", str(out), str(cache)], check=False)
        print(f"{rows:,} rows, then written again with {grown:,}; -j 2; the same shards from both\n")
        print("| build | first build s | after 1% more rows s | peak RSS MB | first vs ranges | again vs ranges |")
        print("|---|---|---|---|---|---|")
        for name, runs in results.items():
            first, again = (statistics.median(r[key] for r in runs) for key in ("first", "grown"))
            peak = statistics.median(r["peak"] for r in runs)
            ratios = [
                statistics.median(r[key] / b[key] for r, b in zip(runs, results["ranges"]))
                for key in ("first", "grown")
            ]
            print(f"| {name} | {first:.1f} | {again:.1f} | {peak:,.0f} | {ratios[0]:.2f}x | {ratios[1]:.2f}x |")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="the array's size in MB")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--whole-ref", default=BEFORE_BLOCKS, help="the commit whose reader is the `whole` row")
    parser.add_argument("--build", action="store_true", help="build the array with this tree and --whole-ref")
    args = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: the bench reads the alpaca demo sets there")
    try:
        import datasets  # noqa: F401

        peers = ["blocks", "whole", "datasets"]
    except ImportError:
        peers = ["blocks", "whole"]
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        whole = scratch / "reading_whole.py"
        whole.write_text(
            subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{args.whole_ref}:packtool/reading.py"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        modules = {"blocks": str(ROOT / "packtool" / "reading.py"), "whole": str(whole), "datasets": "datasets"}
        array = scratch / "array.json"
        if args.build:
            run_builds(array, args.mb, scratch, args.whole_ref, args.pairs)
            return
        rows = write_array(array, args.mb)
        size = array.stat().st_size
        print(f"{array.name}: {size / 1e6:,.0f} MB, {rows:,} rows; {args.pairs} alternating pairs\n")
        results: dict[str, list[dict]] = {peer: [] for peer in peers}
        for pair in range(args.pairs):
            for peer in peers if pair % 2 == 0 else peers[::-1]:
                cache = scratch / f"hf-cache-{pair}"
                result = run(array, modules[peer], cache)
                if result["rows"] != rows:
                    raise SystemExit(f"{peer} read {result['rows']:,} rows of {rows:,}")
                results[peer].append(result)
                subprocess.run(["rm", "-rf", str(cache)], check=False)
        print("| reader | wall s | CPU s | VmHWM MB | VmHWM / file | wall vs blocks | VmHWM vs blocks |")
        print("|---|---|---|---|---|---|---|")
        for peer in peers:
            runs = results[peer]
            wall = statistics.median(r["wall"] for r in runs)
            cpu = statistics.median(r["cpu"] for r in runs)
            hwm = statistics.median(r["hwm"] for r in runs)
            wall_ratio = statistics.median(r["wall"] / b["wall"] for r, b in zip(runs, results["blocks"]))
            hwm_ratio = statistics.median(r["hwm"] / b["hwm"] for r, b in zip(runs, results["blocks"]))
            print(
                f"| {peer} | {wall:.2f} | {cpu:.2f} | {hwm:,.0f} | {hwm * 2**20 / size:.2f} | "
                f"{wall_ratio:.2f}x | {hwm_ratio:.2f}x |"
            )


if __name__ == "__main__":
    main()
