"""Render cost per sample of this tree against an earlier revision's, on the same samples, in one run.

    python bench/render_since.py 299602c^                     # the tree before the render wing
    python bench/render_since.py REV --rounds 7 --models qwen3 --sets reasoning

REV is checked out (git archive) into a temporary folder. Each tree gets one long-lived worker process
(PYTHONPATH = that tree), which loads each template once and warms it by one untimed pass, so render
recipes and skeletons are learned as in a long build; the driver then asks the two workers for one
timed pass each, in alternating order round by round, and takes the ratio within each round (the
machine is shared and noisy). Timed: render_chat for every chat sample, as the encode stages call it
(rejected samples included: they cost a render too), with the template's default engine.
The table gives the median per-sample times and the median of the per-round ratios (this / REV).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from render_bench import MODELS, SETS

REPO = Path(__file__).resolve().parents[1]

# Runs inside each tree: the render entry's signature changed with the render wing (Accelerators), so
# the worker takes whichever the tree has. One JSON request per line in, one time per line out.
WORKER = r"""
import contextlib, gc, json, sys, time
sys.path.insert(0, sys.argv[1])
from render_bench import examples
from packtool.chat_templates import load_template
from packtool.config import TrainPolicy
from packtool.errors import RecordError
from packtool.render import render_chat
try:
    from packtool.render.accelerators import Accelerators
except ImportError:
    Accelerators = None
DATA = __import__("render_bench").DATA
policy, loaded, sets = TrainPolicy(), {}, {}

def run(samples, engine, repeats):
    template, accelerators = engine
    extra = () if accelerators is None else (accelerators,)
    start = time.perf_counter()
    for _ in range(repeats):
        for example in samples:
            with contextlib.suppress(RecordError):
                render_chat(example, template, policy, *extra)
    return (time.perf_counter() - start) / (repeats * len(samples)) * 1e6

for line in sys.stdin:
    model, name, per_pass = json.loads(line)
    if name not in sets:
        sets[name] = examples(name)
    samples = sets[name]
    if (model, name) not in loaded:
        # one row's template at a time: what earlier rows learned would only make later rows' collections slower
        loaded.clear()
        gc.collect()
        config = json.loads((DATA / "tokenizers" / model / "tokenizer_config.json").read_text(encoding="utf-8"))
        engine = (load_template("model", config), Accelerators() if Accelerators else None)
        run(samples, engine, 1)  # warm
        loaded[(model, name)] = engine
    repeats = max(1, -(-per_pass // len(samples)))
    print(run(samples, loaded[(model, name)], repeats), flush=True)
"""


class Worker:
    def __init__(self, tree: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tree / "bench")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        )

    def time(self, model: str, name: str, per_pass: int) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps([model, name, per_pass]) + "\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def checkout(revision: str, folder: Path) -> Path:
    archive = folder / "tree.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), revision], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "tree", filter="data")
    (folder / "shared").symlink_to(REPO.parent / "shared")  # where the tree's bench finds ../shared/data
    return folder / "tree"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revision")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--per-pass", type=int, default=1000, help="samples rendered per timed pass, at least")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        workers = {"this": Worker(REPO), args.revision: Worker(checkout(args.revision, Path(folder)))}
        print(f"{'model':<13} {'set':<10} {'this us':>8} {args.revision + ' us':>14} {'this / REV':>11}")
        ratios_all = []
        try:
            for model in args.models.split(","):
                for name in args.sets.split(","):
                    times: dict[str, list[float]] = {tree: [] for tree in workers}
                    ratios = []
                    for round_ in range(args.rounds):
                        order = list(workers) if round_ % 2 == 0 else list(reversed(workers))
                        for tree in order:
                            times[tree].append(workers[tree].time(model, name, args.per_pass))
                        ratios.append(times["this"][-1] / times[args.revision][-1])
                    ratios_all.append(statistics.median(ratios))
                    print(
                        f"{model:<13} {name:<10} {statistics.median(times['this']):>8.1f} "
                        f"{statistics.median(times[args.revision]):>14.1f} {ratios_all[-1]:>10.3f}x"
                    )
        finally:
            for worker in workers.values():
                worker.close()
        median, mean = statistics.median(ratios_all), statistics.mean(ratios_all)
        print(f"median of the rows' ratios: {median:.3f}x; mean {mean:.3f}x")


if __name__ == "__main__":
    main()
