"""Decontamination throughput: packtool's EvalIndex against a Python set of word tuples, in the same run.

The peer is packtool.decontamination.ReferenceIndex: word n-grams as tuples in Python sets, the way
datatrove's NGramsDecont* and NeMo Curator's TaskDecontamination hold them (plus the short-item and exact
rules, so both give the same answer: the table says whether they did). Both index the same synthetic eval
set and check the same synthetic training samples (a prompt piece and a target piece each, Zipf words
from a 50k vocabulary, 1 in 200 samples copying an eval window), one core, in batches of 512 samples (the
encode stage's chunk). Rows alternate packtool / peer, ROUNDS times; the ratio is the median of the
per-round ratios.

    .venv/bin/python bench/decontam_bench.py                  # index of 1M windows (both), then 10M (packtool)
    .venv/bin/python bench/decontam_bench.py --ngrams 200000  # one size, both
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from packtool.decontamination import EvalIndex, EvalItem, ReferenceIndex

VOCABULARY = 50_000
BATCH = 512
ROUNDS = 3


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


def throughput(index, batch_samples) -> tuple[float, int]:
    start = time.perf_counter()
    found = 0
    for i in range(0, len(batch_samples), BATCH):
        found += sum(f is not None for f in index.check(batch_samples[i : i + BATCH]))
    return len(batch_samples) / (time.perf_counter() - start), found


def run(ngrams: int, n_samples: int, peer: bool) -> None:
    rng = np.random.default_rng(0)
    vocab = _vocabulary(rng)
    evals = eval_set(rng, vocab, ngrams)
    start = time.perf_counter()
    fast = EvalIndex.build(evals, 13, 6)
    built = time.perf_counter() - start
    print(f"\nindex: {len(fast.grams):,} windows, {len(fast.short_hashes):,} short items; built in {built:.1f} s")
    reference = None
    if peer:
        start = time.perf_counter()
        reference = ReferenceIndex(evals, 13, 6)
        print(f"peer index (Python sets): built in {time.perf_counter() - start:.1f} s")
    batch_samples = samples(rng, vocab, n_samples, evals)
    print(f"{n_samples:,} samples of 210 words (a 60-word prompt, a 150-word answer in 12-word lines), one core\n")
    print("| round | packtool samples/s | peer samples/s | ratio | found (packtool / peer) |")
    print("|---|---:|---:|---:|---:|")
    ratios, speeds = [], []
    for r in range(ROUNDS):
        speed, found = throughput(fast, batch_samples)
        speeds.append(speed)
        if reference is None:
            print(f"| {r} | {speed:,.0f} | - | - | {found} / - |")
            continue
        peer_speed, peer_found = throughput(reference, batch_samples)
        ratios.append(speed / peer_speed)
        print(f"| {r} | {speed:,.0f} | {peer_speed:,.0f} | {speed / peer_speed:.1f}x | {found} / {peer_found} |")
    median = f", median ratio {statistics.median(ratios):.1f}x" if ratios else ""
    print(f"\nmedian packtool: {statistics.median(speeds):,.0f} samples/s per core{median}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ngrams", type=int, default=None, help="one index size (both implementations)")
    parser.add_argument("--samples", type=int, default=20_480)
    args = parser.parse_args()
    if args.ngrams is not None:
        run(args.ngrams, args.samples, peer=True)
        return
    run(1_000_000, args.samples, peer=True)
    run(10_000_000, args.samples, peer=False)  # the peer's sets of 10M 13-tuples need ~10 GB


if __name__ == "__main__":
    main()
