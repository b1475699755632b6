"""Build throughput next to its floor and its peer, in one run on the same chat data.

    python bench/build_bench.py                  # real datasets in ../shared/data, Qwen2.5 tokenizer
    python bench/build_bench.py --min-tokens 3e6 --skip-peer
    python bench/build_bench.py --scale [OPTIONS]  # bench/scale_bench.py: phases, memory, executors at scale

Chat data: the alpaca en/zh and code_alpaca demo files turned into `messages` rows and replicated
until they hold at least --min-tokens tokens (1.5 M by default). Rows printed:

- floor: `tokenizers` encode_batch on the already-rendered texts, one thread
  (TOKENIZERS_PARALLELISM=false), in a fresh process;
- packtool `build --no-cache -j 1` and `-j 2` through the public CLI in a fresh process each (import,
  read, render, tokenize, check, plan, write: everything a user waits for), with the phase
  times the manifest reports when the build records them, and single-thread phase costs measured
  here (read, render, tokenize) to show where the time goes;
- the peer pipeline a user would otherwise run: transformers `apply_chat_template(tokenize=True)`
  through `datasets.map` with 2 processes, TRL `pack_dataset` (bfd), `to_parquet`, with a fresh
  datasets cache folder (else the second run skips tokenization);
- packtool-only rates on glaive tool calls and c4 text;
- `import packtool` and `packtool --help` time.

Times are wall-clock seconds of one run (--repeat N: medians); tokens are the rendered chat tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
DATASETS = DATA / "datasets"
TOKENIZER = DATA / "tokenizers" / "qwen2.5"
ALPACA = ("llamafactory_alpaca_en_demo.json", "llamafactory_alpaca_zh_demo.json", "code_alpaca_2k.json")
CAPACITY = 2048


def chat_rows() -> list[dict]:
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


def run(command: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return seconds, done.stdout


def median_run(command: list[str], repeat: int, env: dict[str, str] | None = None) -> tuple[float, str]:
    results = [run(command, env) for _ in range(repeat)]
    return statistics.median(s for s, _ in results), results[-1][1]


FLOOR = """
import json, sys, time
from tokenizers import Tokenizer
texts = json.load(open(sys.argv[2]))
tokenizer = Tokenizer.from_file(sys.argv[1])
start = time.perf_counter()
encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": sum(len(e.ids) for e in encodings)}))
"""

PEER = """
import json, sys, time
start = time.perf_counter()
import datasets
from transformers import AutoTokenizer
from trl.data_utils import pack_dataset
tokenizer_dir, data, out, cache, capacity = sys.argv[1:6]
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
rows = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
def tokenize(row):
    return {"input_ids": tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]}
tokenized = rows.map(tokenize, remove_columns=rows.column_names, num_proc=2)
packed = pack_dataset(tokenized, int(capacity), strategy="bfd")
packed.to_parquet(out)
print(json.dumps({"seconds": time.perf_counter() - start, "rows": len(packed)}))
"""

PHASES = """
import json, sys, time
from pathlib import Path
from packtool.config import load_config
from packtool.encode import encode_batch, load_tokenizer
from packtool.render import render_example, template_for
from packtool.sources import read_source
config = load_config(Path(sys.argv[1]))
tokenizer = load_tokenizer(config.tokenizer)
template = template_for(config, tokenizer.config)
source = config.sources[0]
t0 = time.perf_counter()
examples = [e for e in read_source(source) if not isinstance(e, Exception)]
t1 = time.perf_counter()
rendered = []
for e in examples:
    try:
        rendered.append(render_example(e, template, tokenizer.config, source.train, add_bos=None, add_eos=None))
    except Exception:
        pass
t2 = time.perf_counter()
encode_batch([(r, source.special_tokens) for r in rendered], tokenizer)
t3 = time.perf_counter()
print(json.dumps({"read": t1 - t0, "render": t2 - t1, "tokenize + check": t3 - t2}))
"""


def write_config(folder: Path, name: str, path: Path, fmt: str) -> Path:
    config = folder / f"{name}.json"  # JSON is YAML: no yaml dependency here
    config.write_text(
        json.dumps(
            {
                "sources": [{"name": name, "path": str(path), "format": fmt}],
                "tokenizer": str(TOKENIZER),
                "capacity": CAPACITY,
                "output": str(folder / f"out-{name}"),
                "on_error": "skip",
            }
        ),
        encoding="utf-8",
    )
    return config


def packtool(config: Path, workers: int, repeat: int) -> tuple[float, dict]:
    seconds, _ = median_run(
        # --no-cache: every run does the whole work (a cached rerun re-tokenizes nothing)
        [sys.executable, "-m", "packtool", "build", str(config), "-j", str(workers), "-q", "--no-cache"],
        repeat,
        {"PYTHONPATH": str(ROOT)},
    )
    manifest = json.loads((Path(json.loads(config.read_text())["output"]) / "manifest.json").read_text())
    return seconds, manifest


def main() -> None:
    if "--scale" in sys.argv[1:]:  # the scale benchmark has its own module and options
        from scale_bench import main as scale_main

        return scale_main([arg for arg in sys.argv[1:] if arg != "--scale"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--min-tokens", type=float, default=1.5e6)
    parser.add_argument("--skip-peer", action="store_true", help="leave out the transformers/TRL pipeline")
    args = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this bench runs on the shared real datasets")
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer

    from packtool.encode import load_tokenizer
    from packtool.render import load_template, render_chat
    from packtool.sources import from_messages

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = chat_rows()
        tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
        sample = [r["messages"][0]["content"] + r["messages"][1]["content"] for r in rows]
        per_pass = sum(len(e.ids) for e in tokenizer.encode_batch(sample, add_special_tokens=False))
        copies = max(1, int(-(-args.min_tokens // per_pass)))
        data = folder / "chat.jsonl"
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for _ in range(copies) for r in rows))

        # the rendered texts the floor tokenizes: exactly what packtool renders
        from packtool.config import load_config

        chat_config = write_config(folder, "chat", data, "messages")
        settings = load_config(chat_config)
        text_tokenizer = load_tokenizer(settings.tokenizer)
        template = load_template("model", text_tokenizer.config)
        source = settings.sources[0]
        texts = [render_chat(from_messages(r, source, "x", "x"), template, source.train).text for r in rows] * copies
        (folder / "texts.json").write_text(json.dumps(texts))
        floors = [
            json.loads(
                run(
                    [sys.executable, "-c", FLOOR, str(TOKENIZER / "tokenizer.json"), str(folder / "texts.json")],
                    {"TOKENIZERS_PARALLELISM": "false"},
                )[1]
            )
            for _ in range(args.repeat)
        ]
        floor = {**floors[0], "seconds": statistics.median(f["seconds"] for f in floors)}
        tokens = floor["tokens"]

        results: list[tuple[str, float, dict | None]] = []
        for workers in (1, 2):
            seconds, manifest = packtool(chat_config, workers, args.repeat)
            results.append((f"packtool build -j {workers}", seconds, manifest))
        _, out = run([sys.executable, "-c", PHASES, str(chat_config)], {"PYTHONPATH": str(ROOT)})
        phases = json.loads(out)

        peer = None
        if not args.skip_peer:
            times = []
            for attempt in range(args.repeat):
                cache = folder / f"hf-cache-{attempt}"  # fresh: a warm cache skips the tokenization
                _, out = run(
                    [
                        sys.executable,
                        "-c",
                        PEER,
                        str(TOKENIZER),
                        str(data),
                        str(folder / "peer.parquet"),
                        str(cache),
                        str(CAPACITY),
                    ],
                    {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)},
                )
                times.append(json.loads(out)["seconds"])
            peer = statistics.median(times)

        others = []
        glaive = write_config(folder, "glaive", DATASETS / "llamafactory_glaive_toolcall_en_demo.json", "sharegpt")
        c4 = write_config(folder, "c4", DATASETS / "llamafactory_c4_demo.jsonl", "text")
        for name, config in (("glaive tool calls", glaive), ("c4 text", c4)):
            seconds, manifest = packtool(config, 1, args.repeat)
            others.append((name, seconds, manifest["stats"]["tokens"]))

        import_s, _ = median_run([sys.executable, "-c", "import packtool"], 3, {"PYTHONPATH": str(ROOT)})
        help_s, _ = median_run([sys.executable, "-m", "packtool", "--help"], 3, {"PYTHONPATH": str(ROOT)})
        python_s, _ = median_run([sys.executable, "-c", "pass"], 3)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    floor_rate = tokens / floor["seconds"]
    print(
        f"chat data: {len(rows):,} alpaca rows x {copies} = {len(texts):,} samples, {tokens:,} tokens "
        f"(Qwen2.5, its own template, capacity {CAPACITY}); {cores} cores"
    )
    print(f"{'pipeline':<44} {'seconds':>8} {'k tokens/s':>11} {'x floor':>8} {'x peer':>7}")

    def line(name: str, seconds: float) -> None:
        rate = tokens / seconds
        versus = f"{peer / seconds:>7.2f}" if peer else f"{'-':>7}"
        print(f"{name:<44} {seconds:>8.2f} {rate / 1e3:>11.0f} {rate / floor_rate:>8.2f} {versus}")

    line("tokenizers encode_batch, 1 thread (floor)", floor["seconds"])
    for name, seconds, _ in results:
        line(name + " (CLI, whole build)", seconds)
    if peer:
        line("transformers + datasets.map(2) + TRL bfd", peer)
    print("single-thread phase costs of the same chat build: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    for name, _, manifest in results:
        timings = (manifest or {}).get("timings")
        if timings:
            print(f"{name} phases (manifest): " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
    for name, seconds, count in others:
        print(
            f"packtool build -j 1, {name}: {count:,} tokens in {seconds:.2f} s = {count / seconds / 1e3:.0f} k tokens/s"
        )
    print(
        f"import packtool {max(import_s - python_s, 0):.3f} s, packtool --help {max(help_s - python_s, 0):.3f} s "
        f"(over a bare interpreter start of {python_s:.3f} s)"
    )
    print(
        "expected scaling: build rate(-j N) ~ min(N, cores) x floor x (-j 1 rate / floor), until reading and "
        "writing (one process) dominate; here -j 2 / -j 1 = "
        f"{results[0][1] / results[1][1]:.2f}"
    )


if __name__ == "__main__":
    main()
