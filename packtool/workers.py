"""How many work items a build runs at once, and where: the names the config check, `build --help` and
builder.executors share. Neither changes a byte of the output. Imported by the CLI at start, so it imports nothing.
"""

from __future__ import annotations

import os
from typing import Any

# Usable cores from which `workers: auto` starts worker processes. Below, one process is cheaper: its
# encode threads run the tokenizer (which releases the GIL) beside the Python on the other core, and
# worker processes only add their start and a second copy of the work's Python (alpaca x1 with
# Qwen2.5 on 2 cores, bench/build_bench.py: -j 2 spent 1.5x the CPU-seconds of -j 1 for 0.9x the time).
AUTO_PROCESS_CORES = 3
# What `workers` takes, in the words the config check, the executors and `build --help` all use.
WORKERS_CHOICES = "a positive integer or 'auto'"
WORKERS_AUTO = f"auto: 1 process on fewer than {AUTO_PROCESS_CORES} usable cores, else one per core"
# Where work items run (builder.executors makes each); never changes the bytes.
EXECUTORS = ("processes", "serial", "ray")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_workers(cores: int) -> int:
    """What `workers: auto` runs on `cores` usable cores: one process on a small machine, else a
    worker process per core."""
    return cores if cores >= AUTO_PROCESS_CORES else 1


def count_workers(value: Any) -> int | None:
    """`workers` as a count: an integer >= 1 as is, `auto` by auto_workers of the usable cores; None when invalid."""
    if value == "auto":
        return auto_workers(usable_cores())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value
