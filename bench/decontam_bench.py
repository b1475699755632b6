"""Decontamination throughput: packtool's EvalIndex against a Python set of word tuples, and against an earlier
revision's EvalIndex, in the same run.

The peer is packtool.decontamination.ReferenceIndex: word n-grams as tuples in Python sets, the way
datatrove's NGramsDecont* and NeMo Curator's TaskDecontamination hold them (plus the short-item and exact
rules, so both give the same answer: the table says whether they did). With --since REV, REV's
packtool/decontamination.py (git show) is loaded beside this tree's and timed too. All index the same
synthetic eval set and check the same synthetic training samples (a prompt piece and a target piece each,
Zipf words from a 50k vocabulary, 1 in 200 samples copying an eval window), one core, in batches of 512
samples (the encode stage's chunk). Rows alternate (this tree, REV, peer), ROUNDS times; each speed is
samples per CPU second of this process (time.process_time: on a shared machine, wall time counts the
other processes' turns too) with the wall-clock speed beside it; ratios are the median of the per-round
ratios.

    .venv/bin/python bench/decontam_bench.py                        # 1M windows (all), then 10M (not the peer)
    .venv/bin/python bench/decontam_bench.py --since 073e313^       # and the EvalIndex before that commit
    .venv/bin/python bench/decontam_bench.py --ngrams 200000        # one size
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from dataclasses import astuple
from pathlib import Path
from types import ModuleType

import numpy as np

from packtool.decontamination import EvalIndex, EvalItem, ReferenceIndex

VOCABULARY = 50_000
BATCH = 512
ROUNDS = 5
REPO = Path(__file__).resolve().parents[1]


def _vocabulary(rng: np.random.Generator) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(VOCABULARY)]


def _text(rng: np.random.Generator, vocab: list[str], n: int) -> list[str]:
    return [vocab[i] for i in np.minimum(rng.zipf(1.2, n), VOCABULARY) - 1]


def eval_set(rng: np.random.Generator, vocab: list[str], ngrams: int) -> list[tuple[EvalItem, str]]:
    """Eval records of 100-word answers (Zipf words) and four 4-8-word options (words drawn evenly: a run of 6
    Zipf words, "the of the and of a", would match training text by chance): ~ngrams windows of 13 words."""
    items = []
    records = max(1, ngrams // 88)
    for r in range(records):
        items.append((EvalItem("eval.jsonl", f"eval.jsonl:{r + 1}", "answer"), " ".join(_text(rng, vocab, 100))))
        for o in range(4):
            option = " ".join(vocab[i] for i in rng.integers(0, VOCABULARY, int(rng.integers(4, 9))))
            items.append((EvalItem("eval.jsonl", f"eval.jsonl:{r + 1}", f"options[{o}]"), option))
    return items


def samples(rng: np.random.Generator, vocab: list[str], n: int, evals: list[tuple[EvalItem, str]]):
    """Samples of a 60-word prompt and a 150-word answer, in 12-word lines; 1 in 200 answers holds an eval window."""
    out = []
    for s in range(n):
        answer = _text(rng, vocab, 150)
        if s % 200 == 0:
            answer[50:63] = evals[(s // 200 * 5) % len(evals)][1].split()[:13]
        lines = "\n".join(" ".join(answer[i : i + 12]) for i in range(0, len(answer), 12))
        out.append(([" ".join(_text(rng, vocab, 60)).capitalize() + "?"], [lines]))
    return out


def throughput(index, batch_samples) -> tuple[float, float, int]:
    """(samples per CPU second, samples per wall second, samples found)."""
    cpu, wall = time.process_time(), time.perf_counter()
    found = 0
    for i in range(0, len(batch_samples), BATCH):
        found += sum(f is not None for f in index.check(batch_samples[i : i + BATCH]))
    return len(batch_samples) / (time.process_time() - cpu), len(batch_samples) / (time.perf_counter() - wall), found


def module_at(rev: str) -> ModuleType:
    """REV's packtool/decontamination.py as a module of its own (it imports this tree's packtool for the rest)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:packtool/decontamination.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    spec = importlib.util.spec_from_loader(f"decontamination_at_{rev}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:packtool/decontamination.py", "exec"), module.__dict__)
    return module


def run(ngrams: int, n_samples: int, peer: bool, since: str | None) -> None:
    rng = np.random.default_rng(0)
    vocab = _vocabulary(rng)
    evals = eval_set(rng, vocab, ngrams)
    rows: list[tuple[str, object]] = []
    start = time.perf_counter()
    rows.append(("packtool", EvalIndex.build(evals, 13, 6)))
    print(f"\nindex: {ngrams:,} windows asked, {EvalIndex.__name__} built in {time.perf_counter() - start:.1f} s")
    if since is not None:
        old = module_at(since)
        start = time.perf_counter()
        rows.append((since, old.EvalIndex.build([(old.EvalItem(*astuple(i)), t) for i, t in evals], 13, 6)))
        print(f"{since} index built in {time.perf_counter() - start:.1f} s")
    if peer:
        start = time.perf_counter()
        rows.append(("peer", ReferenceIndex(evals, 13, 6)))
        print(f"peer index (Python sets): built in {time.perf_counter() - start:.1f} s")
    batch_samples = samples(rng, vocab, n_samples, evals)
    print(f"{n_samples:,} samples of 210 words (a 60-word prompt, a 150-word answer in 12-word lines), one core\n")
    names = [name for name, _ in rows]
    print("| round | " + " | ".join(f"{n} samples/s (CPU; wall)" for n in names) + " | found |")
    print("|---|" + "---:|" * len(names) + "---:|")
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(ROUNDS):
        cells, found = [], []
        for name, index in rows:
            cpu, wall, hits = throughput(index, batch_samples)
            speeds[name].append(cpu)
            cells.append(f"{cpu:,.0f}; {wall:,.0f}")
            found.append(str(hits))
        print(f"| {r} | " + " | ".join(cells) + f" | {' / '.join(found)} |", flush=True)
    ours = speeds["packtool"]
    print(f"\nmedian packtool: {statistics.median(ours):,.0f} samples per CPU second (one core)")
    for name in names[1:]:
        ratio = statistics.median(a / b for a, b in zip(ours, speeds[name], strict=True))
        print(f"packtool / {name}: median of per-round ratios {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ngrams", type=int, default=None, help="one index size (the peer too)")
    parser.add_argument("--samples", type=int, default=20_480)
    parser.add_argument("--since", default=None, help="also time REV's EvalIndex (a git revision)")
    args = parser.parse_args()
    if args.ngrams is not None:
        run(args.ngrams, args.samples, peer=True, since=args.since)
        return
    run(1_000_000, args.samples, peer=True, since=args.since)
    run(10_000_000, args.samples, peer=False, since=args.since)  # the peer's sets of 10M 13-tuples need ~10 GB


if __name__ == "__main__":
    main()
