"""Build at scale: phase times, memory, executors, repacking from the token cache, planning 10M lengths.

    python bench/build_bench.py --scale              # the same as: python bench/scale_bench.py
    python bench/scale_bench.py --mb 200 --memory-mb 50,500 --skip-ray
    python bench/scale_bench.py --only samples --samples-workers 1,2   # issue 43's targets: 20k, 200k, 1M
    python bench/scale_bench.py --only samples --samples 20000,10000000 --samples-workers 2   # its opt-in 10M row
    python bench/scale_bench.py --only plan-memory --plan-samples 20000,200000   # the plan phase alone, traced
    python bench/scale_bench.py --only ray-driver --ray-samples 20000,200000    # the Ray driver, two loopback nodes

Input: a synthetic chat set written here (seeded, so every run reads the same bytes): JSON Lines
files of FILE_MB each, `messages` rows of 1-3 user/assistant turns (a system prompt in one row of
five), words drawn from a made-up vocabulary, turn lengths log-normal so that a few conversations
pass the capacity and get truncated. Tokenizer: Qwen2.5 with its own template when ../shared/data
has it, else the quickstart's. Every build runs in a fresh child process through `packtool.build`
(no cache unless stated) and is timed by phase:

    setup    config, tokenizer and template load, input listing and hashing, executor start
    encode   read -> render -> tokenize -> check -> token store, all encode work items
    plan     truncation, mixing and global packing over the store's length columns
    emit     all shards written from the store
    publish  rejects, manifests, the stats read back from the shards, the swap into OUT

Memory is sampled every SAMPLE_S from /proc/PID/status of the build process (the "driver") and of
every process below it: RssAnon (anonymous: Python objects, numpy arrays, tokenizer) and RssFile
(file-backed pages mapped and resident: the memory-mapped token store, shared libraries). Peaks
are the largest sample; VmHWM (the kernel's exact peak of the driver's whole RSS) is printed beside
them as a check on the sampling. RssFile is page cache the kernel reclaims at will, so it is
reported apart from RssAnon, which is what a build really holds. The ray-driver part also samples
the processes of the loopback Ray cluster it starts, which are this process's children, not the build's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2.5"
QUICKSTART = ROOT / "configs" / "quickstart"
CAPACITY = 2048
FILE_MB = 16  # one input file: many files, each split into row-range work items, as a large dataset comes
SAMPLE_S = 0.05
PHASES = ("setup", "encode", "plan", "emit", "publish")

# Runs one build in a fresh process and prints what it measured as JSON. The progress object is the
# build's own phase hook, so the timings need nothing from the manifest (whose bytes must not
# depend on the machine).
CHILD = """
import json, sys, time
from contextlib import contextmanager
start = time.perf_counter()
from packtool.builder import build
from packtool.builder.progress import Progress
from packtool.config import load_config

def rss_mb(key="RssAnon"):
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status[key].split()[0]) / 1024

class Timed(Progress):
    def __init__(self):
        self.spans = {}
        self.anon = {}  # RssAnon of this process as each phase ends
        self.file = {}  # and its RssFile (mapped files: the token store's pages, shared libraries)
        self.traces = {}  # with PACKTOOL_TRACE set: tracemalloc's current, peak and top sites as each phase ends
    @contextmanager
    def phase(self, name, total, unit):
        begin = time.perf_counter()
        with Progress.phase(self, name, total, unit) as bar:
            yield bar
        self.spans[name] = (begin - start, time.perf_counter() - start)
        self.anon[name] = rss_mb()
        self.file[name] = rss_mb("RssFile")
        if traced:
            self.trace(name)
    def trace(self, name):
        import tracemalloc
        current, peak = tracemalloc.get_traced_memory()  # before the snapshot, whose own objects are traced
        by_line = tracemalloc.take_snapshot().statistics("lineno")
        frames = [(s.traceback[0], s.size) for s in by_line[:60]]
        sites = {f"{f.filename.split('packtool/')[-1]}:{f.lineno}": size for f, size in frames}
        del by_line
        self.traces[name] = {"current": current, "peak": peak, "sites": sites}
        tracemalloc.reset_peak()

config_path, output, workers, use_cache, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
import os
traced = bool(os.environ.get("PACKTOOL_TRACE"))
timed = Timed()
if traced:  # the driver's own allocations by site (file:line) as each phase ends, and each phase's peak
    import packtool.builder as builder_module
    import tracemalloc
    tracemalloc.start()
    write_outputs = builder_module.write_outputs
    def publish_traced(*args):
        manifest = write_outputs(*args)
        timed.trace("publish")  # rejects, manifests and stats written, the plan still held
        return manifest
    builder_module.write_outputs = publish_traced
config = load_config(config_path, output=output, workers=workers, overrides=overrides)
built = build(config, progress=timed, use_cache=use_cache == "cache")
end = time.perf_counter() - start
spans = timed.spans
phases = {
    "setup": spans["encode"][0],
    "encode": spans["encode"][1] - spans["encode"][0],
    "plan": spans["plan"][1] - spans["plan"][0],
    "emit": spans["emit"][1] - spans["emit"][0],
    "publish": end - spans["emit"][1],
}
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({
    "seconds": end,
    "phases": phases,
    "tokens": built.manifest["stats"]["tokens"],
    "samples": sum(a["read"] for a in built.manifest["accounting"].values()),
    "packs": built.manifest["stats"]["packs"],
    "encode_items": built.encode_items,
    "encode_reused": built.encode_reused,
    "shards": built.shards,
    "nodes": built.nodes,
    "vm_hwm_mb": int(status["VmHWM"].split()[0]) / 1024,
    "anon_after_mb": {**timed.anon, "publish": rss_mb()},
    "file_after_mb": {**timed.file, "publish": rss_mb("RssFile")},
    "traces": timed.traces,
}))
"""


# -- the synthetic chat set --------------------------------------------------------------------------


def vocabulary(rng: np.random.Generator, size: int = 4000) -> np.ndarray:
    """Made-up words of 1-4 syllables: text a BPE splits into a few tokens a word, like prose."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    counts = rng.integers(1, 5, size)
    return np.array(["".join(rng.choice(syllables, n)) for n in counts])


def chat_rows(rng: np.random.Generator, words: np.ndarray, n: int, scale: float = 1.0) -> list[str]:
    """n JSON lines of `messages` conversations; `scale` multiplies every turn's mean length."""

    def text(mean_words: float) -> str:
        count = max(1, int(rng.lognormal(np.log(mean_words * scale), 0.8)))
        return " ".join(words[rng.integers(0, len(words), count)]) + "."

    lines = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(15)}] if rng.random() < 0.2 else []
        for _ in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": text(30)})
            messages.append({"role": "assistant", "content": text(110)})
        lines.append(json.dumps({"messages": messages}))
    return lines


def write_chat_set(folder: Path, megabytes: float, seed: int = 0, scale: float = 1.0) -> list[Path]:
    """FILE_MB files of JSON Lines (the last one smaller) adding up to `megabytes` MB."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = vocabulary(rng)
    files, left = [], int(megabytes * 1e6)
    while left > 0:
        path = folder / f"chat-{len(files):05d}.jsonl"
        budget, size = min(left, FILE_MB * 10**6), 0
        with open(path, "w", encoding="utf-8") as handle:
            while size < budget:
                block = "".join(line + "\n" for line in chat_rows(rng, words, 200, scale))
                handle.write(block)
                size += len(block.encode())
        files.append(path)
        left -= size
    return files


def write_config(folder: Path, data: Path, name: str = "chat") -> Path:
    tokenizer = QWEN if QWEN.is_dir() else QUICKSTART / "tokenizer"
    config = folder / f"{name}.json"  # JSON is YAML
    raw = {
        "sources": [{"name": name, "path": str(data / "*.jsonl"), "format": "messages"}],
        "tokenizer": str(tokenizer),
        "template": "model",
        "capacity": CAPACITY,
        "truncation": {"strategy": "turns", "fallback": "right"},
        "output": str(folder / "out"),
        "on_error": "skip",
    }
    config.write_text(json.dumps(raw), encoding="utf-8")
    return config


# -- one build in a child process, its memory sampled from outside ------------------------------------


def _status(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of one process in kB (empty once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("RssAnon", "RssFile") if key in fields}


def _command(pid: int) -> str:
    """The program a process runs: its command line's first word, or the script a Python runs ("" once gone)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return next((word for word in words if word.endswith(".py")), words[0])


def _descendants(root: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found.extend(frontier)
    return found


def measured_build(
    config: Path,
    output: Path,
    workers: str,
    *,
    cache: bool = False,
    overrides=(),
    traced: bool = False,
    beside: int | None = None,
) -> dict:
    """Run one build in a child process; its JSON report plus the sampled memory peaks in MB.

    `beside`: a process whose descendants outside the build's tree are sampled too (this one, for the Ray
    cluster it started); the peak RssAnon and RssFile of each, by pid, come back in report["beside_mb"], the
    command each ran when first seen (a Ray worker's names its task) in report["beside_commands"], and every
    sample's RssAnon (kB) by pid, with its seconds since the child started, in report["beside_series"]."""
    command = [sys.executable, "-c", CHILD, str(config), str(output), workers, "cache" if cache else "no-cache"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env["PACKTOOL_TRACE"] = "1" if traced else ""
    env.pop("RAY_ADDRESS", None)  # Ray rows start their own one-machine cluster and stop it, or name one
    child = subprocess.Popen([*command, *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    started = time.perf_counter()
    peak = {"driver_anon": 0, "driver_file": 0, "all_anon": 0}
    peak_beside: dict[int, dict[str, int]] = {}
    commands: dict[int, str] = {}
    series: list[tuple[float, dict[int, int]]] = []
    tree: list[int] = []
    others_beside: list[int] = []
    ticks = 0
    while child.poll() is None:
        if ticks % 10 == 0:  # the process tree changes rarely; scanning /proc is the costly part
            tree = _descendants(child.pid)
            outside = {child.pid, *tree}
            others_beside = [pid for pid in _descendants(beside) if pid not in outside] if beside else []
        driver = _status(child.pid)
        others = [_status(pid) for pid in tree]
        peak["driver_anon"] = max(peak["driver_anon"], driver.get("RssAnon", 0))
        peak["driver_file"] = max(peak["driver_file"], driver.get("RssFile", 0))
        total = driver.get("RssAnon", 0) + sum(s.get("RssAnon", 0) for s in others)
        peak["all_anon"] = max(peak["all_anon"], total)
        anon_beside = {}
        for pid in others_beside:
            if pid not in commands:
                commands[pid] = _command(pid)
            status = _status(pid)
            seen = peak_beside.setdefault(pid, {"RssAnon": 0, "RssFile": 0})
            for key, kb in status.items():
                seen[key] = max(seen[key], kb)
            anon_beside[pid] = status.get("RssAnon", 0)
        if anon_beside:
            series.append((time.perf_counter() - started, anon_beside))
        ticks += 1
        time.sleep(SAMPLE_S)
    out, err = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"build of {config} failed ({child.returncode}):\n{err[-3000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    report["memory_mb"] = {key: value / 1024 for key, value in peak.items()}
    report["beside_mb"] = {pid: {key: kb / 1024 for key, kb in seen.items()} for pid, seen in peak_beside.items()}
    report["beside_commands"] = commands
    report["beside_series"] = series
    return report


# -- the parts of the benchmark --------------------------------------------------------------------------


def executors_table(config: Path, folder: Path, skip_ray: bool) -> list[tuple[str, dict]]:
    runs = [("serial (-j 1)", "1", ()), ("processes -j 2", "2", ())]
    if not skip_ray:
        runs.append(("ray, one local node, 2 CPUs", "2", ("executor=ray",)))
    rows = []
    for name, workers, overrides in runs:
        rows.append((name, measured_build(config, folder / "out", workers, overrides=overrides)))
    return rows


def print_builds(title: str, rows: list[tuple[str, dict]]) -> None:
    print(title)
    header = f"{'build':<30}" + "".join(f"{p:>8}" for p in PHASES)
    header += f"{'total s':>9}{'k tok/s':>9}{'anon MB':>9}{'file MB':>9}{'tree anon':>10}{'VmHWM':>7}"
    print(header)
    for name, r in rows:
        m = r["memory_mb"]
        line = f"{name:<30}" + "".join(f"{r['phases'][p]:>8.2f}" for p in PHASES)
        line += f"{r['seconds']:>9.1f}{r['tokens'] / r['seconds'] / 1e3:>9.0f}"
        line += f"{m['driver_anon']:>9.0f}{m['driver_file']:>9.0f}{m['all_anon']:>10.0f}{r['vm_hwm_mb']:>7.0f}"
        print(line)


def plan_10m(count: int = 10_000_000) -> tuple[float, float]:
    """Seconds for the plan's packing (plan_packs, bfd, shuffled) of `count` synthetic lengths, and its efficiency."""
    sys.path.insert(0, str(ROOT))
    from packtool.packing import efficiency, plan_packs

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(400), 0.9, count), 1, CAPACITY).astype(np.int64)
    start = time.perf_counter()
    plan = plan_packs(lengths, CAPACITY, "bfd", seed=0)
    seconds = time.perf_counter() - start
    return seconds, efficiency(lengths, plan, CAPACITY)


def plan_memory(folder: Path, count: int, partitions: int = 4) -> tuple[int, int]:
    """make_plan alone over `count` stored samples (synthetic token-store partitions of one source, 20-400 tokens a
    sample, every token a target), traced: the bytes it holds once it returns and its peak. No tokenizer: the
    plan's costs are per sample, so the store's rows need not be real chats."""
    sys.path.insert(0, str(ROOT))
    import tracemalloc

    from packtool.builder.plan import make_plan
    from packtool.builder.plan_files import Partition
    from packtool.builder.store import PartitionWriter
    from packtool.config import load_config
    from packtool.records import Tokenized

    folder.mkdir(parents=True)
    (folder / "a.jsonl").write_text("")
    raw = {"sources": [{"name": "a", "path": "a.jsonl", "format": "messages"}], "capacity": CAPACITY}
    (folder / "config.yaml").write_text(
        json.dumps({**raw, "tokenizer": str(QUICKSTART / "tokenizer"), "output": "out"})
    )
    rng = np.random.default_rng(0)
    stored = []
    for p in range(partitions):
        writer, rows = PartitionWriter(folder / f"part-{p}.arrow", "a"), count // partitions
        for i, n in enumerate(rng.integers(20, 400, rows).tolist()):
            ids = np.arange(n, dtype=np.int32)
            sample = Tokenized(
                f"a:{p}:{i}",
                "a",
                f"{i:064x}",
                ids,
                np.ones(n, bool),
                np.zeros(n, np.int8),
                np.zeros(n, np.int16),
                ("user", "assistant"),
            )
            writer.append(sample, f"a.jsonl:{i + 1}", i)
        writer.close()
        report = {"read": rows, "rejected": {}, "dropped": {}, "special_token_literals": 0, "straddling_targets": []}
        stored.append(Partition(f"key-{p}", str(writer.path), "a", {**report, "rejects": []}))
    config = load_config(folder / "config.yaml", workers="1")
    tracemalloc.start()
    try:
        plan = make_plan(config, stored, folder / "plan", "key")
        held, peak = tracemalloc.get_traced_memory()
        del plan
    finally:
        tracemalloc.stop()
    shutil.rmtree(folder)
    return held, peak


def replicated_quickstart(folder: Path, copies: int = 20) -> Path:
    """The quickstart with every source file `copies` times over (ids made unique per copy)."""
    import yaml

    raw = yaml.safe_load((QUICKSTART.parent / "quickstart.yaml").read_text(encoding="utf-8"))
    data = folder / "quickstart"
    data.mkdir(parents=True)
    for source in raw["sources"]:
        original = QUICKSTART.parent / source["path"]
        rows = [json.loads(line) for line in original.read_text(encoding="utf-8").splitlines() if line.strip()]
        with open(data / original.name, "w", encoding="utf-8") as handle:
            for copy in range(copies):
                for row in rows:
                    if isinstance(row, dict) and "id" in row:
                        row = {**row, "id": f"{row['id']}-{copy}"}
                    handle.write(json.dumps(row) + "\n")
        source["path"] = str(data / original.name)
    raw["tokenizer"] = str(QUICKSTART / "tokenizer")
    raw["output"] = str(folder / "out")
    config = folder / "quickstart-x20.json"
    config.write_text(json.dumps(raw), encoding="utf-8")
    return config


def repack(folder: Path) -> tuple[dict, dict]:
    """A first build with the cache, then the same build with only the capacity changed (1024 -> 2048)."""
    config = replicated_quickstart(folder)
    first = measured_build(config, folder / "out", "1", cache=True)
    again = measured_build(config, folder / "out", "1", cache=True, overrides=("capacity=2048",))
    return first, again


def memory_flatness(folder: Path, sizes: list[float]) -> list[tuple[str, dict]]:
    rows = []
    for megabytes in sizes:
        data = folder / f"chat-{megabytes:g}mb"
        files = write_chat_set(data, megabytes)
        config = write_config(folder, data, f"chat{megabytes:g}")
        on_disk = sum(f.stat().st_size for f in files) / 1e6
        rows.append((f"{on_disk:.0f} MB input, serial", measured_build(config, folder / "out", "1")))
        shutil.rmtree(folder / "out", ignore_errors=True)
        shutil.rmtree(data)
    return rows


TRACE_SCALE = 0.1  # short turns (~167 tokens a sample with Qwen2.5's default system prompt): per sample, not per token
TRACED_PHASES = ("encode", "plan", "emit", "publish")


@contextmanager
def short_chats(folder: Path, count: int) -> Iterator[Path]:
    """The config of a build of about `count` short conversations (the trace's), its data removed on leaving."""
    data = folder / f"chat-{count}"
    write_chat_set(data, count * 415 / 1e6, scale=TRACE_SCALE)  # ~415 bytes a row at this scale
    try:
        yield write_config(folder, data, f"chat{count}")
    finally:
        shutil.rmtree(data)


def traced_builds(folder: Path, samples: list[int], workers: str) -> list[dict]:
    """Builds of about `samples` short conversations with tracemalloc in the driver (the build process)."""
    rows = []
    for count in samples:
        with short_chats(folder, count) as config:
            rows.append(measured_build(config, folder / "out", workers, traced=True))
            shutil.rmtree(folder / "out", ignore_errors=True)
    return rows


def print_per_sample(small: dict, large: dict, top: int = 8) -> None:
    """Per phase: tracemalloc's current and peak bytes per sample (the large build minus the small, over the
    samples between them), the driver's RssAnon per sample (what tracemalloc does not see: Arrow's pool, the
    tokenizer's Rust heap), then the sites that grow most, by file:line."""
    between = large["samples"] - small["samples"]
    print(f"bytes per sample held by the driver ({small['samples']:,} -> {large['samples']:,} samples, tracemalloc)")
    print(f"{'phase':<9}{'held B/sample':>15}{'peak B/sample':>15}{'RssAnon B/sample':>18}   largest sites (B/sample)")
    for phase in TRACED_PHASES:
        a, b = small["traces"][phase], large["traces"][phase]
        held = (b["current"] - a["current"]) / between
        peak = (b["peak"] - a["peak"]) / between
        anon = (large["anon_after_mb"][phase] - small["anon_after_mb"][phase]) * 2**20 / between
        growth = {site: (size - a["sites"].get(site, 0)) / between for site, size in b["sites"].items()}
        sites = sorted(growth.items(), key=lambda kv: -kv[1])[:top]
        largest = ", ".join(f"{s} {v:.0f}" for s, v in sites if v >= 1)
        print(f"{phase:<9}{held:>15.0f}{peak:>15.0f}{anon:>18.0f}   {largest}")


def sample_builds(folder: Path, samples: list[int], workers: list[str]) -> list[tuple[str, dict]]:
    """Untraced builds of about `samples` short conversations (the trace's), each count at every `workers`."""
    rows = []
    for count in samples:
        with short_chats(folder, count) as config:
            for j in workers:
                rows.append((f"{count:,} short samples, -j {j}", measured_build(config, folder / "out", j)))
                shutil.rmtree(folder / "out", ignore_errors=True)
    return rows


def print_samples(rows: list[tuple[str, dict]], workers: list[str]) -> None:
    """The builds, then per row its driver's RssAnon and RssFile as each phase ends and, against the smallest build
    at the same -j, the driver's peak RssAnon per sample above it and the tokens per second as a share of its."""
    print_builds("builds of short synthetic chats (turns a tenth of the scale bench's), no cache", rows)
    for index, (name, r) in enumerate(rows):
        base = rows[index % len(workers)][1]
        after = ", ".join(f"{phase} {mb:.0f}" for phase, mb in r["anon_after_mb"].items())
        tokens = r["tokens"] / r["samples"]
        mapped = ", ".join(f"{phase} {mb:.0f}" for phase, mb in r["file_after_mb"].items())
        line = (
            f"  {name}: {tokens:.0f} tokens a sample; driver RssAnon (MB) as each phase ends: {after}; RssFile {mapped}"
        )
        if r is not base:
            more = r["samples"] - base["samples"]
            per_sample = (r["memory_mb"]["driver_anon"] - base["memory_mb"]["driver_anon"]) * 2**20 / more
            speed = (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"])
            line += f"; peak {per_sample:.0f} B a sample above the {base['samples']:,}, tokens/s {speed:.2f}x its"
        print(line)


# Each node of the loopback cluster as the tests' (tests/conftest.py): one CPU, a small object store (items and
# results are small; nothing else goes through it).
RAY_NODE = {"num_cpus": 1, "object_store_memory": 128 * 1024**2}


@contextmanager
def loopback_cluster(nodes: int = 2) -> Iterator[Any]:
    """A Ray cluster of `nodes` one-CPU nodes on 127.0.0.1, its processes children of this one, shut down on
    leaving however the block ends (through its own object: `ray stop` would stop every Ray on the machine)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read at import: every node on 127.0.0.1
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**RAY_NODE, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**RAY_NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def ray_role(command: str) -> str:
    """What a process of the cluster is, by its command: a worker (`ray::` and the task it runs, or IDLE; before
    it names itself, default_worker.py), or the
    program of a service (raylet, gcs_server, and Ray's Python services: dashboard.py, agent.py (the dashboard's
    agent on each node), main.py (the runtime-env agent), monitor.py (the autoscaler's), log_monitor.py)."""
    program = Path(command).name
    return "workers" if command.startswith("ray::") or program in ("setup_worker.py", "default_worker.py") else program


def shard_hashes(output: Path) -> list[str]:
    manifest = json.loads((output / "manifest.json").read_text(encoding="utf-8"))
    return [shard["sha256"] for shard in manifest["shards"]]


def ray_driver_builds(folder: Path, samples: list[int], reference: str | None) -> list[tuple[str, dict]]:
    """Builds of about `samples` short conversations with executor ray, each joining a loopback two-node cluster
    that this process started (the build process is the driver; the cluster's processes are sampled beside it).
    With `reference` (a -j), the same build runs again on local processes and the shards' hashes are compared."""
    rows = []
    with loopback_cluster() as cluster:
        for count in samples:
            with short_chats(folder, count) as config:
                overrides = ("executor=ray", f"ray_address={cluster.address}")
                report = measured_build(config, folder / "out", "2", overrides=overrides, beside=os.getpid())
                if reference is not None:
                    ray_shards = shard_hashes(folder / "out")
                    measured_build(config, folder / "reference", reference)  # not OUT: that build is up to date
                    same = ray_shards == shard_hashes(folder / "reference")
                    shutil.rmtree(folder / "reference")
                    report["reference"] = f"; shards {'byte-identical to' if same else 'DIFFER from'} -j {reference}'s"
                shutil.rmtree(folder / "out", ignore_errors=True)
            rows.append((f"{count:,} short samples, ray 2 nodes", report))
    return rows


def print_ray_driver(rows: list[tuple[str, dict]]) -> None:
    """The Ray builds as print_samples prints builds, then per build the peaks of the cluster's processes by role:
    not the driver's memory, but what the nodes held (a node is a whole machine in a real cluster)."""
    print_samples(rows, ["ray"])
    for name, r in rows:
        by_role: dict[str, list[dict[str, float]]] = {}
        for pid, peak in r["beside_mb"].items():
            by_role.setdefault(ray_role(r["beside_commands"][pid]), []).append(peak)
        parts = []
        for role, peaks in sorted(by_role.items()):
            anon = [p["RssAnon"] for p in peaks]
            summed = f" ({sum(anon):.0f} summed)" if len(peaks) > 1 else ""
            parts.append(f"{role} x{len(peaks)} {max(anon):.0f}{summed}")
        nodes = {phase: sorted(ran.values()) for phase, ran in r["nodes"].items()}
        print(f"  {name}: items per node {nodes}{r.get('reference', '')}")
        print(f"    Ray's processes, peak RssAnon MB (the largest of each kind): {', '.join(parts)}")
        workers = {pid for pid, command in r["beside_commands"].items() if ray_role(command) == "workers"}
        by_phase = ", ".join(
            f"{phase} {largest:.0f} / {together:.0f}" if together else f"{phase} -"  # - : too short to be sampled
            for phase, (largest, together) in worker_peaks(r, workers).items()
        )
        print(f"    workers' RssAnon MB by phase, the largest worker / all together: {by_phase}")


def worker_peaks(report: dict, workers: set[int]) -> dict[str, tuple[float, float]]:
    """Per build phase, the peak RssAnon (MB) of the largest of `workers` and of all of them together. A sample's
    seconds count from the child's start, its phases' from its first line: the interpreter's start (a fraction of
    a second) moves each boundary that much, against phases of seconds to minutes."""
    ends = dict(zip(PHASES, np.cumsum([report["phases"][phase] for phase in PHASES]).tolist(), strict=True))
    peaks = {phase: (0.0, 0.0) for phase in PHASES}
    for seconds, anon in report["beside_series"]:
        phase = next((p for p in PHASES if seconds <= ends[p]), PHASES[-1])
        ours = [kb / 1024 for pid, kb in anon.items() if pid in workers]
        largest, together = peaks[phase]
        peaks[phase] = (max(largest, max(ours, default=0.0)), max(together, sum(ours)))
    return peaks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=60, help="size of the synthetic chat set for the executors table")
    parser.add_argument(
        "--memory-mb", default="50,500", help="input sizes (MB, comma-separated) of the memory flatness builds"
    )
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument(
        "--only",
        choices=["executors", "plan", "repack", "memory", "trace", "samples", "plan-memory", "ray-driver"],
        action="append",
        help="run only these parts",
    )
    parser.add_argument("--trace-workers", default="2", help="-j of the traced builds")
    parser.add_argument(
        "--trace-samples", default="20000,200000", help="sample counts (comma-separated) of the traced builds"
    )
    parser.add_argument(
        "--samples",
        default="20000,200000,1000000",
        help="sample counts (comma-separated) of the untraced short builds; 10000000 is the opt-in row (~4 GB input)",
    )
    parser.add_argument("--samples-workers", default="1,2", help="the -j values (comma-separated) of each count")
    parser.add_argument(
        "--plan-samples", default="20000,200000", help="stored sample counts (comma-separated) of plan-memory"
    )
    parser.add_argument(
        "--ray-samples", default="20000,200000", help="sample counts (comma-separated) of the ray-driver builds"
    )
    parser.add_argument(
        "--ray-reference",
        default="2",
        help="the -j of a local build of each ray-driver count whose shards must be the Ray build's ('none': skip)",
    )
    args = parser.parse_args(argv)
    # trace, samples, plan-memory, ray-driver: when asked
    parts = set(args.only or ["executors", "plan", "repack", "memory"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    tokenizer = "Qwen2.5" if QWEN.is_dir() else "the quickstart's"
    print(
        f"{cores} cores, load average {os.getloadavg()[0]:.1f} at the start; {tokenizer} tokenizer, capacity {CAPACITY}"
    )
    with tempfile.TemporaryDirectory(prefix="packtool-scale-") as tmp:
        folder = Path(tmp)
        if "executors" in parts:
            files = write_chat_set(folder / "chat", args.mb)
            on_disk = sum(f.stat().st_size for f in files) / 1e6
            rows = executors_table(write_config(folder, folder / "chat"), folder, args.skip_ray)
            first = rows[0][1]
            print()
            print_builds(
                f"synthetic chat: {on_disk:.0f} MB in {len(files)} files, {first['samples']:,} conversations, "
                f"{first['tokens']:,} tokens written in {first['packs']:,} packs; no cache; seconds by phase, "
                "peak MB (driver RssAnon, driver RssFile, RssAnon of the driver and all its descendants, VmHWM)",
                rows,
            )
            for name, r in rows:
                nodes = {phase: {node[:8]: n for node, n in ran.items()} for phase, ran in r["nodes"].items()}
                print(f"  {name}: {r['encode_items']} encode items, {r['shards']} shards, items per node {nodes}")
            shutil.rmtree(folder / "chat")
            shutil.rmtree(folder / "out", ignore_errors=True)
        if "plan" in parts:
            seconds, packed = plan_10m()
            print(
                f"\nplan: bfd packing of 10,000,000 synthetic lengths (log-normal, median 400) into {CAPACITY}: "
                f"{seconds:.1f} s, token efficiency {packed:.4f}"
            )
        if "repack" in parts:
            first, again = repack(folder / "repack")
            print(f"\nrepack, quickstart x20 ({first['samples']:,} records), -j 1, with the token cache:")
            print_builds("", [("first build, capacity 1024", first), ("capacity-only change, 2048", again)])
            print(
                f"  capacity-only rebuild: {first['seconds'] / again['seconds']:.1f}x faster "
                f"({again['encode_reused']} of {again['encode_items']} encode items reused)"
            )
        if "trace" in parts:
            counts = [int(n) for n in args.trace_samples.split(",")]
            traced = traced_builds(folder / "trace", counts, args.trace_workers)
            print()
            for r in traced:
                print(
                    f"  {r['samples']:,} samples, -j {args.trace_workers}: {r['seconds']:.1f} s traced, "
                    f"{r['packs']:,} packs, driver peak RssAnon {r['memory_mb']['driver_anon']:.0f} MB"
                )
            print_per_sample(traced[0], traced[-1])
        if "plan-memory" in parts:
            counts = [int(n) for n in args.plan_samples.split(",")]
            plan_memory(folder / "plan-warm", 1000)  # first-time costs (imports, caches) out of the smallest count
            traced_plans = [plan_memory(folder / f"plan-{n}", n) for n in counts]
            held, peak = (
                (large - small) / (counts[-1] - counts[0]) for small, large in zip(traced_plans[0], traced_plans[-1])
            )
            print(
                f"\nplan phase alone (make_plan, tracemalloc), {counts[0]:,} -> {counts[-1]:,} stored samples: "
                f"holds {held:.0f} B a sample, peaks at {peak:.0f}"
            )
        if "samples" in parts:
            workers = args.samples_workers.split(",")
            rows = sample_builds(folder / "samples", [int(n) for n in args.samples.split(",")], workers)
            print()
            print_samples(rows, workers)
        if "ray-driver" in parts:
            reference = None if args.ray_reference == "none" else args.ray_reference
            rows = ray_driver_builds(folder / "ray", [int(n) for n in args.ray_samples.split(",")], reference)
            print()
            print_ray_driver(rows)
        if "memory" in parts:
            sizes = [float(s) for s in args.memory_mb.split(",")]
            rows = memory_flatness(folder / "memory", sizes)
            print()
            print_builds("memory flatness: the same synthetic chat set at growing sizes, serial, no cache", rows)
            for name, r in rows:
                after = ", ".join(f"{phase} {mb:.0f}" for phase, mb in r["anon_after_mb"].items())
                print(f"  {name}: driver RssAnon (MB) as each phase ends: {after}")
            small, large = rows[0][1]["memory_mb"], rows[-1][1]["memory_mb"]
            print(
                f"  driver RssAnon {large['driver_anon'] / small['driver_anon']:.2f}x, RssFile "
                f"{large['driver_file'] / small['driver_file']:.2f}x for {sizes[-1] / sizes[0]:g}x the input"
            )


if __name__ == "__main__":
    main()
