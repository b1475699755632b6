"""Loader throughput (verification on/off) and peak memory of the chunked vs full loss.

    .venv/bin/python bench/loader_bench.py                  # builds the quickstart into a temp folder
    .venv/bin/python bench/loader_bench.py OUT/ --epochs 10 # an existing build
    .venv/bin/python bench/loader_bench.py --skip-memory    # throughput only (the memory rows take ~1 min)

Throughput: tokens per second in one process, as packs (`iter(dataset)`) and as collated
micro-batches (`packed_batches`, token_budget 4096), each the median over epochs of that epoch's
rate (a shared machine's spikes move a median less than a total). "fresh" reads every epoch from a
new `PackedDataset` (so each epoch pays the manifest, the footers, the plan inputs and, with
verify, the sha256 of every shard); "same dataset" reads epochs 2.. of one dataset, as a training
run does (those costs paid once per process). The floor row is pyarrow alone decoding the same row
groups and columns. The loader reads the next row group on a thread while it batches the current
one, so the wall rate can exceed the CPU-second rate when a second core is free.

Memory: one subprocess per variant builds hidden [1, T, H] and an output weight [V, H] (fp32,
V = 151,936 as Qwen's vocabulary, T = 4096), then measures the resident memory the loss and its
backward add on top (`VmHWM` after resetting it through /proc/self/clear_refs; `ru_maxrss` growth
where that is not writable): `full` materialises the [T, V] logits for `token_loss_sum`,
`chunked` runs `chunked_token_loss_sum` (1024 rows of logits at a time).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_quickstart(folder: Path) -> Path:
    from click.testing import CliRunner

    from packtool.cli import main

    out = folder / "quickstart"
    result = CliRunner().invoke(main, ["build", str(REPO / "configs" / "quickstart.yaml"), "-o", str(out), "-q"])
    if result.exit_code:
        raise SystemExit(result.output)
    return out


def median_rates(epochs: Iterable[Callable[[], int]]) -> tuple[float, float]:
    """Median (tokens per wall second, tokens per CPU second) over epochs, each a call returning its tokens."""
    wall, cpu = [], []
    for epoch in epochs:
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens = epoch()
        wall.append(tokens / (time.perf_counter() - start))
        cpu.append(tokens / max(time.process_time() - start_cpu, 1e-9))
    return statistics.median(wall), statistics.median(cpu)


def read_rate(build: Path, epochs: int, verify: bool, batches: bool, fresh: bool) -> tuple[float, float]:
    """Median rates over `epochs` epochs: each from a new dataset (fresh), or epochs 2.. of one dataset."""
    from packtool.loader import PackedDataset, packed_batches

    def make() -> PackedDataset:
        return PackedDataset(build, verify=verify, token_budget=4096 if batches else None)

    kept = make()

    def epoch(number: int) -> int:
        ds = make() if fresh else kept
        ds.set_epoch(number)
        if batches:
            return sum(mb.n_tokens for mb in packed_batches(ds))
        return sum(len(pack) for pack in ds)

    if not fresh:
        epoch(0)  # the first epoch pays the footers, the plan inputs and the sha256
    first = 0 if fresh else 1
    return median_rates(functools.partial(epoch, e) for e in range(first, first + epochs))


def decode_floor(build: Path, epochs: int) -> tuple[float, float]:
    import pyarrow.parquet as pq

    from packtool.loader.contract import read_manifest

    columns = ["input_ids", "labels", "cu_seqlens", "attn_cost", "pack_hash"]

    def epoch() -> int:
        tokens = 0
        for shard in read_manifest(build).shards:
            parquet = pq.ParquetFile(shard.file)
            for group in range(parquet.num_row_groups):
                tokens += len(
                    parquet.read_row_group(group, columns=columns).column("input_ids").combine_chunks().values
                )
        return tokens

    return median_rates(epoch for _ in range(epochs))


def loss_child(variant: str, vocab: int, tokens: int, hidden: int) -> None:
    """Runs in its own process: prints {"peak_mb", "seconds"} for one loss variant.

    dpo-*: the micro-batch is T / 512 segments of 512 tokens, alternately chosen and rejected
    answers of T / 1024 pairs (the last 256 tokens of each the targets); the policy's log-probs
    with backward and the reference's under no_grad (its hidden states and weight are inputs).
    """
    import torch
    from pack_bench import PeakMemory

    from packtool.loader.loss import chunked_token_loss_sum, token_loss_sum
    from packtool.loader.preference import CHOSEN, REJECTED, chunked_segment_logprobs, dpo_loss, segment_logprobs

    torch.manual_seed(0)
    h = torch.randn(1, tokens, hidden, requires_grad=True)
    weight = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    labels[0, 0] = -100
    n_seg = tokens // 512
    cu = torch.arange(0, n_seg + 1) * 512
    for start in cu[:-1].tolist():
        labels[0, start : start + 256] = -100
    pairs = types.SimpleNamespace(labels=labels, cu_seqlens=cu)
    groups = torch.arange(n_seg) // 2
    kinds = torch.tensor([CHOSEN, REJECTED] * (n_seg // 2))
    ref_h, ref_weight = torch.randn(1, tokens, hidden), torch.randn(vocab, hidden) * 0.02
    start = time.perf_counter()
    with PeakMemory() as memory:
        if variant == "full":
            loss, n = token_loss_sum(h @ weight.T, labels)
            (loss / n).backward()
        elif variant == "chunked":
            loss, n = chunked_token_loss_sum(h, weight, labels)
            (loss / n).backward()
        elif variant == "dpo-full":
            policy = segment_logprobs(h @ weight.T, pairs)
            with torch.no_grad():
                reference = segment_logprobs(ref_h @ ref_weight.T, pairs)
            dpo_loss(policy.sums, reference.sums, groups, kinds).loss_sum.backward()
        else:
            policy = chunked_segment_logprobs(h, weight, pairs)
            with torch.no_grad():
                reference = chunked_segment_logprobs(ref_h, ref_weight, pairs)
            dpo_loss(policy.sums, reference.sums, groups, kinds).loss_sum.backward()
    print(json.dumps({"peak_mb": memory.mb, "method": memory.method, "seconds": time.perf_counter() - start}))


def measure_loss(variant: str, vocab: int, tokens: int, hidden: int) -> dict:
    cmd = [sys.executable, __file__, "--loss-child", variant, "--vocab", str(vocab), "--tokens", str(tokens)]
    cmd += ["--hidden", str(hidden)]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'bench'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def loop_child(build: str, loss: str, vocab: int, steps: int) -> None:
    """Runs in its own process: the README's training loop (token_budget 8192, accum 2, 2 workers) on a
    tiny random Llama with a `vocab`-sized vocabulary; prints the process's peak resident memory."""
    import torch
    from pack_bench import _status_kb

    sys.path.insert(0, str(REPO / "examples"))
    from train_plain import loss_sum, tiny_model

    from packtool.loader import PackedDataset, packed_batches, window_norm

    torch.manual_seed(0)
    model = tiny_model(vocab).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = PackedDataset(build, token_budget=8192, seed=0, num_workers=2)
    batches = packed_batches(dataset, epochs=math.inf)
    start = time.perf_counter()
    for _ in range(steps):
        window = [next(batches) for _ in range(2)]
        norm = window_norm(window)
        for mb in window:
            norm.loss_for_backward(loss_sum(model, mb, chunked=loss == "chunked")).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = _status_kb("VmHWM") / 1024
    print(json.dumps({"peak_mb": peak, "seconds": time.perf_counter() - start}))


def measure_loop(build: Path, loss: str, vocab: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, str(build), "--loop-child", loss, "--vocab", str(vocab), "--steps", str(steps)]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'bench'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", help="a build folder (default: the quickstart, built here)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of the README loop rows")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--loss-child", choices=LOSS_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--loop-child", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loss_child:
        loss_child(args.loss_child, args.vocab, args.tokens, args.hidden)
        return
    if args.loop_child:
        loop_child(args.build, args.loop_child, args.vocab, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(args.build) if args.build else build_quickstart(Path(tmp))
        if not args.skip_memory:
            print(f"| README loop, V={args.vocab:,}, quickstart, {args.steps} steps | peak RSS MB | seconds |")
            print("|---|---|---|")
            for loss in ("full", "chunked"):
                got = measure_loop(build, loss, args.vocab, args.steps)
                print(f"| {loss} | {got['peak_mb']:.0f} | {got['seconds']:.1f} |")
        if not args.skip_throughput:
            throughput(build, args.epochs)
    if args.skip_memory:
        return
    print(f"\n| loss, V={args.vocab:,}, T={args.tokens}, H={args.hidden} | peak MB added | seconds |\n|---|---|---|")
    for variant in LOSS_VARIANTS:
        got = measure_loss(variant, args.vocab, args.tokens, args.hidden)
        print(f"| {variant} ({got['method']}) | {got['peak_mb']:.0f} | {got['seconds']:.1f} |")


LOSS_VARIANTS = ("full", "chunked", "dpo-full", "dpo-chunked")


def throughput(build: Path, epochs: int) -> None:
    read_rate(build, 1, True, True, True)  # warm the imports and the page cache
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print("| read | verify | dataset | M tokens/s (wall) | M tokens per CPU-second |\n|---|---|---|---|---|")
    wall, cpu = decode_floor(build, epochs)
    print(f"| pyarrow decode floor (same columns) | - | - | {wall / 1e6:.1f} | {cpu / 1e6:.1f} |")
    for batches in (False, True):
        for fresh in (True, False):
            for verify in (True, False):
                wall, cpu = read_rate(build, epochs, verify, batches, fresh)
                what = "micro-batches (budget 4096)" if batches else "packs"
                how = "fresh" if fresh else "same"
                print(f"| {what} | {'on' if verify else 'off'} | {how} | {wall / 1e6:.1f} | {cpu / 1e6:.1f} |")


if __name__ == "__main__":
    main()
