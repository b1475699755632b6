"""Build throughput next to its floor and its peer, rows alternated pair by pair on the same data.

    python bench/build_bench.py                       # three real sets, 3 rounds
    python bench/build_bench.py --rounds 5 --sets alpaca --skip-peer
    python bench/build_bench.py --scale [OPTIONS]     # bench/scale_bench.py: phases, memory, executors at scale

The machine this runs on is shared and noisy, so no row is timed alone: each round runs every row
of a set once (`-j 1`, `-j 2`, the peer; each round starts one row later, so every row takes every
place in turn), each next to a floor run of its own (the floor first in even rounds, second in odd
ones), and `x floor` is taken within that pair, between two runs back to back that saw the same
machine. The table prints the median of those per-pair ratios, never a ratio of medians.

Sets (real files in ../shared/data, replicated to at least --min-tokens rendered tokens each):
- alpaca: the alpaca en/zh and code_alpaca demos as `messages`, Qwen2.5 and its own template;
- reasoning: reason_tool_use_demo_50 (content parts with reasoning and tool calls), Qwen3's
  template, which inspects message content (no skeleton reuse: every conversation is rendered);
- glaive: glaive tool calls (sharegpt with `tools`), Qwen2.5;
- alpaca-qwen3 (only when named in --sets): the alpaca rows with Qwen3's template, which looks
  inside every content (its skeletons are keyed by the answers to its questions).

Rows:
- floor: `tokenizers` encode_batch on exactly the texts packtool renders, one thread
  (TOKENIZERS_PARALLELISM=false), in a fresh process, timed around the encode call alone (wall and
  CPU); its CPU time is the tokenizer's own cost;
- packtool `build --no-cache -j 1` and `-j 2` through the public CLI in a fresh process each:
  everything a user waits for (import, read, render, tokenize, check, plan, write), with packtool's
  bytecode compiled once before the rounds, as an installed package has it;
- with `--baseline DIR`, `-j 1` again from the packtool package in DIR
  (`git archive REV packtool | tar -x -C DIR`): a change's before and after in the same rounds;
- peer (alpaca only, where users' own pipelines look like this): transformers
  `apply_chat_template(tokenize=True)` through `datasets.map` with 2 processes, TRL `pack_dataset`
  (bfd) and `to_parquet`, with a fresh datasets cache per run (a warm one skips tokenization).

Columns: wall seconds and CPU-seconds (user + system of the process and every child it waited
for) as medians over rounds; `x floor` = floor seconds / row seconds, the median of per-pair ratios,
with `(pairs)` the lowest and highest of them (how far one pair's machine moved it); `x peer` = peer
seconds / row seconds, the median of per-round ratios; `overhead` = row CPU-s / floor CPU-s - 1, the
CPU a build spends on top of the tokenizer (median of per-pair ratios). A last line per set gives the render
cost per sample (single thread, in process), the number issue 22 tracks for templates that inspect
content.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
DATASETS = DATA / "datasets"
TOKENIZERS = DATA / "tokenizers"
CAPACITY = 2048
ALPACA = ("llamafactory_alpaca_en_demo.json", "llamafactory_alpaca_zh_demo.json", "code_alpaca_2k.json")


@dataclass(frozen=True)
class BenchSet:
    name: str
    tokenizer: str
    fmt: str
    rows: list[dict]
    peer: bool


def alpaca_rows() -> list[dict]:
    """Alpaca rows as `messages` (prompt = instruction, blank line, input), as users convert them."""
    rows = []
    for name in ALPACA:
        for record in json.loads((DATASETS / name).read_text(encoding="utf-8")):
            prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
            if record.get("output", "").strip():
                rows.append(
                    {
                        "messages": [
                            {"role": "user", "content": prompt},
                            {"role": "assistant", "content": record["output"]},
                        ]
                    }
                )
    return rows


def bench_sets() -> dict[str, BenchSet]:
    reasoning = DATASETS / "llamafactory_reason_tool_use_demo_50.jsonl"
    glaive = DATASETS / "llamafactory_glaive_toolcall_en_demo.json"
    return {
        "alpaca": BenchSet("alpaca", "qwen2.5", "messages", alpaca_rows(), peer=True),
        "reasoning": BenchSet(
            "reasoning",
            "qwen3",
            "messages",
            [json.loads(line) for line in reasoning.read_text().splitlines()],
            peer=False,
        ),
        "glaive": BenchSet("glaive", "qwen2.5", "sharegpt", json.loads(glaive.read_text(encoding="utf-8")), peer=False),
        # not in the default run: the alpaca rows under a template that looks inside every content
        "alpaca-qwen3": BenchSet("alpaca-qwen3", "qwen3", "messages", alpaca_rows(), peer=False),
    }


# The texts packtool renders for a config (kept samples only), and the render cost per sample.
RENDER = """
import json, sys, time
from pathlib import Path
from packtool.config import load_config
from packtool.encode import load_tokenizer
from packtool.chat_templates import template_for
from packtool.render import render_example
from packtool.render.accelerators import accelerators_for
from packtool.sources import read_source
config = load_config(Path(sys.argv[1]))
accelerators = accelerators_for(config.run.render)  # as the encode stages hold them
tokenizer = load_tokenizer(config.tokenizer)
template = template_for(config, tokenizer.config)
source = config.sources[0]
examples = [e for e in read_source(source) if not isinstance(e, Exception)]
texts = []
start = time.perf_counter()
for example in examples:
    try:
        rendered = render_example(
            example, template, tokenizer.config, source.train, add_bos=None, add_eos=None, accelerators=accelerators
        )
        texts.append(rendered.text)
    except Exception:
        pass
seconds = time.perf_counter() - start
Path(sys.argv[2]).write_text(json.dumps(texts))
print(json.dumps({"us_per_sample": seconds / max(len(examples), 1) * 1e6, "samples": len(examples)}))
"""

# The floor times the encode call alone (not the interpreter start or the tokenizer load, which a
# build pays too): the strictest floor there is.
FLOOR = """
import json, sys, time
from tokenizers import Tokenizer
texts = json.load(open(sys.argv[2]))
tokenizer = Tokenizer.from_file(sys.argv[1])
wall, cpu = time.perf_counter(), time.process_time()
encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"tokens": sum(len(e.ids) for e in encodings), "seconds": wall, "cpu": cpu}))
"""

PEER = """
import json, sys
import datasets
from transformers import AutoTokenizer
from trl.data_utils import pack_dataset
tokenizer_dir, data, out, cache, capacity = sys.argv[1:6]
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
rows = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
def tokenize(row):
    return {"input_ids": tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]}
tokenized = rows.map(tokenize, remove_columns=rows.column_names, num_proc=2)
pack_dataset(tokenized, int(capacity), strategy="bfd").to_parquet(out)
"""


@dataclass
class Row:
    """One row of a set's table: its command per round and what each round measured."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    fresh_cache: bool = False  # the peer: a new datasets cache folder for every run
    reports_own_time: bool = False  # the floor: its stdout holds the seconds and CPU of the encode call
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    floor_seconds: list[float] = field(default_factory=list)  # the floor run next to each of this row's runs
    floor_cpu: list[float] = field(default_factory=list)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str]:
    """Wall seconds, CPU-seconds (the process and every child it waited for) and stdout of one run.

    `cwd` is the bench's work folder: `python -m` and `-c` put the working directory first on sys.path,
    so run from the repository they import its `packtool` whatever PYTHONPATH says (a baseline row
    run from there timed the current code)."""
    cpu = children_cpu()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, cwd=cwd, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return seconds, children_cpu() - cpu, done.stdout


def write_config(folder: Path, bench: BenchSet, data: Path) -> Path:
    config = folder / f"{bench.name}.json"  # JSON is YAML: no yaml dependency here
    settings = {
        "sources": [{"name": bench.name, "path": str(data), "format": bench.fmt}],
        "tokenizer": str(TOKENIZERS / bench.tokenizer),
        "capacity": CAPACITY,
        "output": str(folder / f"out-{bench.name}"),
        "on_error": "skip",
    }
    config.write_text(json.dumps(settings), encoding="utf-8")
    return config


def prepare(
    bench: BenchSet, folder: Path, min_tokens: float, skip_peer: bool, baseline: Path | None
) -> tuple[list[Row], dict]:
    """The replicated data, the texts the floor tokenizes, and the rows of this set."""
    one = folder / f"{bench.name}-once.jsonl"
    one.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in bench.rows), encoding="utf-8")
    env = {"PYTHONPATH": str(ROOT)}
    texts = folder / f"{bench.name}-texts.json"
    tokenizer_file = str(TOKENIZERS / bench.tokenizer / "tokenizer.json")
    _, _, out = measure([sys.executable, "-c", RENDER, str(write_config(folder, bench, one)), str(texts)], env, folder)
    _, _, counted = measure([sys.executable, "-c", FLOOR, tokenizer_file, str(texts)], {}, folder)
    copies = max(1, int(-(-min_tokens // json.loads(counted)["tokens"])))

    data = folder / f"{bench.name}.jsonl"
    data.write_text(one.read_text(encoding="utf-8") * copies, encoding="utf-8")
    config = write_config(folder, bench, data)
    _, _, out = measure([sys.executable, "-c", RENDER, str(config), str(texts)], env, folder)
    info = {**json.loads(out), "copies": copies}
    _, _, counted = measure([sys.executable, "-c", FLOOR, tokenizer_file, str(texts)], {}, folder)
    info["tokens"] = json.loads(counted)["tokens"]

    build = [sys.executable, "-m", "packtool", "build", str(config), "-q", "--no-cache"]
    # Bytecode as an installed package has it: where PYTHONDONTWRITEBYTECODE is set (as in CI images) every
    # build would compile packtool's modules again (~0.1 s a run); the floor compiles nothing.
    compiled = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(folder / "pycache")}
    rows = [
        Row(
            "tokenizer, 1 thread (floor)",
            [sys.executable, "-c", FLOOR, tokenizer_file, str(texts)],
            {"TOKENIZERS_PARALLELISM": "false"},
            reports_own_time=True,
        ),
        Row("packtool build -j 1", [*build, "-j", "1"], {**env, **compiled}),
        Row("packtool build -j 2", [*build, "-j", "2"], {**env, **compiled}),
    ]
    if baseline is not None:
        rows.append(
            Row("packtool build -j 1, baseline", [*build, "-j", "1"], {"PYTHONPATH": str(baseline), **compiled})
        )
    for row in rows[1:]:  # compile each packtool once before the rounds, and check which one each row runs
        importing = "import packtool, packtool.cli, packtool.builder; print(packtool.__file__)"
        _, _, imported = measure([sys.executable, "-c", importing], row.env, folder)
        expected = Path(row.env["PYTHONPATH"]).resolve()
        if not Path(imported.strip()).resolve().is_relative_to(expected):
            raise SystemExit(f"{row.name}: imports {imported.strip()}, not the packtool in {expected}")
    if bench.peer and not skip_peer:
        peer = [sys.executable, "-c", PEER, str(TOKENIZERS / bench.tokenizer), str(data), str(folder / "peer.parquet")]
        rows.append(Row("transformers + datasets.map(2) + TRL bfd", peer, {"HF_HUB_OFFLINE": "1"}, fresh_cache=True))
    return rows, info


def run_rounds(rows: list[Row], rounds: int, folder: Path) -> None:
    """Each round runs every row once, starting one row later than the round before (a row's place in the
    round biased its time: two identical `-j 1` builds, fixed order, differed by 7-13% in three runs), and
    each row next to a floor run of its own, the floor first in even rounds and second in odd ones: the
    machine's load moves within seconds, so a ratio is taken between two runs back to back."""
    floor, others = rows[0], rows[1:]
    for round_ in range(rounds):
        start = round_ % len(others)
        for row in others[start:] + others[:start]:
            pair = [floor, row] if round_ % 2 == 0 else [row, floor]
            for run in pair:
                seconds, cpu = _run(run, folder, round_)
                run.seconds.append(seconds)
                run.cpu.append(cpu)
                if run is floor:
                    row.floor_seconds.append(seconds)
                    row.floor_cpu.append(cpu)


def _run(row: Row, folder: Path, round_: int) -> tuple[float, float]:
    command, env = row.command, row.env
    if row.fresh_cache:
        cache = folder / f"hf-cache-{round_}"
        command, env = [*command, str(cache), str(CAPACITY)], {**env, "HF_DATASETS_CACHE": str(cache)}
    seconds, cpu, out = measure(command, env, folder)
    if row.reports_own_time:
        own = json.loads(out)
        seconds, cpu = own["seconds"], own["cpu"]
    return seconds, cpu


def per_round(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def print_table(bench: BenchSet, rows: list[Row], info: dict) -> None:
    floor = rows[0]
    peer = next((row for row in rows if row.fresh_cache), None)
    print(
        f"\n{bench.name}: {len(bench.rows):,} rows x {info['copies']} = {info['samples']:,} samples, "
        f"{info['tokens']:,} tokens ({bench.tokenizer}, capacity {CAPACITY}), {len(rows[1].seconds)} rounds"
    )
    print(
        f"{'row':<42} {'seconds':>8} {'CPU-s':>7} {'M tok/s':>8} {'x floor':>8} {'(pairs)':>11} {'x peer':>7} "
        f"{'overhead':>9}"
    )
    for row in rows:
        seconds, cpu = statistics.median(row.seconds), statistics.median(row.cpu)
        # the floor's runs are the pairs' floors: against the peer, those of the peer's own pairs
        own = peer.floor_seconds if row is floor and peer else row.seconds
        versus_peer = f"{per_round(peer.seconds, own):>7.2f}" if peer else f"{'-':>7}"
        if row is floor:
            print(
                f"{row.name:<42} {seconds:>8.2f} {cpu:>7.2f} {info['tokens'] / seconds / 1e6:>8.2f} {1:>8.2f}"
                f" {'-':>11} {versus_peer} {'-':>9}"
            )
            continue
        # the spread of the per-pair ratios: how far one pair's machine moved the median
        ratios = [f / r for f, r in zip(row.floor_seconds, row.seconds)]
        print(
            f"{row.name:<42} {seconds:>8.2f} {cpu:>7.2f} {info['tokens'] / seconds / 1e6:>8.2f} "
            f"{statistics.median(ratios):>8.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>11} {versus_peer} "
            f"{per_round(row.cpu, row.floor_cpu) - 1:>9.2f}"
        )
    print(f"render (packtool, 1 thread, in process): {info['us_per_sample']:.0f} us per sample")


def main() -> None:
    if "--scale" in sys.argv[1:]:  # the scale benchmark has its own module and options
        from scale_bench import main as scale_main

        return scale_main([arg for arg in sys.argv[1:] if arg != "--scale"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of alternated rows (ratios are medians over them)"
    )
    parser.add_argument("--min-tokens", type=float, default=1.5e6, help="rendered tokens per set, at least")
    parser.add_argument(
        "--sets", default="alpaca,reasoning,glaive", help="comma-separated: alpaca, reasoning, glaive, alpaca-qwen3"
    )
    parser.add_argument("--skip-peer", action="store_true", help="leave out the transformers/TRL pipeline")
    parser.add_argument(
        "--baseline", type=Path, help="a folder holding another packtool package: its -j 1 runs in the same rounds"
    )
    args = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this bench runs on the shared real datasets")
    sets = bench_sets()
    chosen = [name.strip() for name in args.sets.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in sets]
    if unknown:
        raise SystemExit(f"unknown set(s) {unknown}; choose from {sorted(sets)}")
    if args.baseline is not None and not (args.baseline / "packtool" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: no packtool/__init__.py there")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} cores; x floor and overhead: medians of per-pair ratios (each row beside a floor run of its own)")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            folder = Path(tmp) / name
            folder.mkdir()
            rows, info = prepare(sets[name], folder, args.min_tokens, args.skip_peer, args.baseline)
            run_rounds(rows, args.rounds, folder)
            print_table(sets[name], rows, info)
            print(f"load average after {name}: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
