"""Compare packtool's planners with TRL's `pack_dataset(..., strategy="bfd")` on synthetic lengths.

    python bench/pack_bench.py            # N = 100k and 1M, capacity 2048 and 8192 (TRL at 1M: minutes, GBs)
    python bench/pack_bench.py --quick    # N = 100k only
    python bench/pack_bench.py --no-trl   # packtool only

Every row runs in a fresh subprocess so that its memory is its own. The child builds its input
first (the lengths; for TRL, a `datasets.Dataset` with an `input_ids` list column), then resets
the kernel's peak-RSS mark (`/proc/self/clear_refs`, Linux >= 4.0), packs, and reports
VmHWM - VmRSS-before: the peak resident memory packing added on top of its input, whatever
allocator made it (numpy, Arrow, Python objects). Without clear_refs it falls back to the growth
of `ru_maxrss`, which misses any peak lower than the imports' and says so. Our planners are timed
as the median of 3 calls; TRL once (it takes tens of seconds at 1M).

TRL's time includes gathering the token column into packed rows, which packtool does in a later
stage; ours is the plan alone. TRL packs inside `Dataset.map` batches (1,000 rows by default),
which is why its pack count sits above the global bound.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

DISTRIBUTIONS = ("sft", "uniform", "pretrain")
OUR_PACKERS = ("pad", "sequential", "bfd", "ffd", "histogram")
# TRL needs the tokens themselves; above this many the int32 column alone outgrows this machine
# (23 GB) once TRL copies it, so those rows are skipped with a note.
TRL_MAX_TOKENS = 1_200_000_000


def synthetic_lengths(distribution: str, n: int, capacity: int) -> np.ndarray:
    """Deterministic lengths in [1, capacity]."""
    rng = np.random.default_rng(1234)
    if distribution == "sft":
        # median 350 tokens, mean ~580, a tail past 4k: chat SFT data after tokenization.
        raw = rng.lognormal(np.log(350), 1.0, n) + 1
    elif distribution == "uniform":
        raw = rng.integers(1, capacity + 1, n)
    elif distribution == "pretrain":
        # documents around the window size, half of them longer and clipped to it.
        raw = rng.lognormal(np.log(capacity), 0.9, n) + 1
    else:
        raise ValueError(f"unknown distribution {distribution!r}")
    return np.clip(raw.astype(np.int64), 1, capacity)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak resident memory added while the block runs, in MB."""

    def __enter__(self) -> PeakMemory:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            self.method = "VmHWM"
            self.before = _status_kb("VmRSS")
        except OSError:
            self.method = "ru_maxrss"
            self.before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc) -> None:
        after = _status_kb("VmHWM") if self.method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.mb = max(0, after - self.before) / 1024


def run_ours(lengths: np.ndarray, capacity: int, packer: str) -> dict:
    from packtool.packing import plan_packs

    times = []
    with PeakMemory() as memory:
        for _ in range(3):
            start = time.perf_counter()
            plan = plan_packs(lengths, capacity, packer)
            times.append(time.perf_counter() - start)
    plan.validate(lengths, capacity)
    return {"packs": plan.n_packs, "seconds": statistics.median(times), "peak_mb": memory.mb, "memory": memory.method}


def trl_dataset(lengths: np.ndarray):
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    datasets.disable_progress_bars()
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    list_type = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    if list_type is pa.ListArray:
        offsets = offsets.astype(np.int32)
    # np.full touches every page, so the input is resident before the baseline is read.
    values = np.full(int(offsets[-1]), 7, dtype=np.int32)
    column = list_type.from_arrays(pa.array(offsets), pa.array(values))
    return datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})))


def run_trl(lengths: np.ndarray, capacity: int) -> dict:
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    dataset = trl_dataset(lengths)
    # Arrow's allocator keeps the pages freed while building the input; TRL would reuse them
    # and its own peak would not show.
    pa.default_memory_pool().release_unused()
    with PeakMemory() as memory:
        start = time.perf_counter()
        packed = pack_dataset(dataset, capacity, strategy="bfd")
        seconds = time.perf_counter() - start
    packed_samples = sum(len(row) for row in packed.with_format("arrow")["seq_lengths"].to_pylist())
    if packed_samples != lengths.size:
        raise RuntimeError(f"TRL packed {packed_samples} samples, expected {lengths.size}")
    return {"packs": len(packed), "seconds": seconds, "peak_mb": memory.mb, "memory": memory.method}


def child(spec: dict) -> dict:
    lengths = synthetic_lengths(spec["distribution"], spec["n"], spec["capacity"])
    if spec["packer"] == "trl-bfd":
        return run_trl(lengths, spec["capacity"])
    return run_ours(lengths, spec["capacity"], spec["packer"])


def trl_available() -> bool:
    try:
        import datasets  # noqa: F401
        import trl.data_utils  # noqa: F401
    except ImportError:
        return False
    return True


def measure(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only N = 100k")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL rows")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    notes = []
    methods: set[str] = set()
    use_trl = not args.no_trl and trl_available()
    if not args.no_trl and not use_trl:
        notes.append("TRL rows skipped: TRL is not installed (pip install trl datasets).")
    sizes = (100_000,) if args.quick else (100_000, 1_000_000)
    header = (
        "| distribution | N | capacity | packer | packs | efficiency | lower bound | % over bound "
        "| seconds | samples/s | peak MB |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for distribution in DISTRIBUTIONS:
        for n in sizes:
            for capacity in (2048, 8192):
                lengths = synthetic_lengths(distribution, n, capacity)
                total = int(lengths.sum())
                bound = -(-total // capacity)
                packers = list(OUR_PACKERS)
                if use_trl:
                    if total <= TRL_MAX_TOKENS:
                        packers.append("trl-bfd")
                    else:
                        notes.append(
                            f"trl-bfd skipped for {distribution} N={n:,} C={capacity}: {total / 1e9:.1f}G tokens "
                            f"({total * 4 / 2**30:.0f} GiB as int32) would not fit in memory with TRL's copies."
                        )
                for packer in packers:
                    spec = {"distribution": distribution, "n": n, "capacity": capacity, "packer": packer}
                    result = measure(spec)
                    if "error" in result:
                        notes.append(f"{packer} failed for {distribution} N={n:,} C={capacity}: {result['error']}")
                        continue
                    packs, seconds = result["packs"], result["seconds"]
                    methods.add(result["memory"])
                    cells = [
                        distribution,
                        f"{n:,}",
                        capacity,
                        packer,
                        f"{packs:,}",
                        f"{total / (packs * capacity):.4f}",
                        f"{bound:,}",
                        f"{100 * (packs / bound - 1):.3f}",
                        f"{seconds:.3f}",
                        f"{n / seconds:,.0f}",
                        f"{result['peak_mb']:.0f}",
                    ]
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    print()
    print(
        f"peak MB: resident memory packing added on top of its input, fresh subprocess per row ({', '.join(methods)}). "
        "packtool seconds: median of 3 calls (plan only); trl-bfd: one call (plan + token gather, 1,000-row batches)."
    )
    if "ru_maxrss" in methods:
        print(
            "note: /proc/self/clear_refs not writable: peak MB is ru_maxrss growth and misses peaks below the imports'."
        )
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
