"""Render cost per sample, jinja2 against minijinja, for the 6 real chat templates.

    python bench/render_bench.py                 # 5 rounds, every model, three sets
    python bench/render_bench.py --rounds 3 --models qwen3 --sets reasoning

Each template is loaded twice, once per engine (PACKTOOL_JINJA2_ONLY=1 keeps jinja2 alone), and
warmed by one untimed pass, so render recipes are learned as in a long build. A round then times
one pass over a set with each engine, in alternating order (a pass renders the set over and over
to --per-pass samples, so a small set is not timed in milliseconds); the table gives the median of the
per-sample times and the median of the per-round ratios (the machine is shared and noisy: a ratio
is only taken between two passes of one round). Timed: render_chat for every chat sample, as the
encode stages call it, each engine with Accelerators of its own (rejected samples included: they
cost a render too).

Sets (real files in ../shared/data): `reasoning` reason_tool_use_demo_50 (reasoning, tool calls,
content parts), `glaive` glaive tool calls en (sharegpt with tools), `alpaca` alpaca en demo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

from packtool.chat_templates import JINJA2_ONLY, ChatTemplate, load_template
from packtool.config import TrainPolicy, parse_config
from packtool.errors import RecordError
from packtool.records import Example
from packtool.render import render_chat
from packtool.render.accelerators import Accelerators
from packtool.sources import read_source

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MODELS = ("qwen3", "qwen2.5", "llama-3.2", "mistral-nemo", "gemma-3", "phi-3-mini")
SETS = {
    "reasoning": ("llamafactory_reason_tool_use_demo_50.jsonl", "messages"),
    "glaive": ("llamafactory_glaive_toolcall_en_demo.json", "sharegpt"),
    "alpaca": ("llamafactory_alpaca_en_demo.json", "alpaca"),
}


def examples(name: str) -> list[Example]:
    file, fmt = SETS[name]
    config = parse_config(
        {
            "sources": [{"name": name, "path": str(DATA / "datasets" / file), "format": fmt}],
            "tokenizer": str(DATA / "tokenizers" / "qwen2.5"),
            "capacity": 1 << 20,
            "output": "unused",
        },
        base_dir=Path("/"),
    )
    return [e for e in read_source(config.sources[0]) if isinstance(e, Example) and not e.is_text]


def templates(model: str) -> dict[str, tuple[ChatTemplate, Accelerators]]:
    config = json.loads((DATA / "tokenizers" / model / "tokenizer_config.json").read_text(encoding="utf-8"))
    fast = load_template("model", config)
    os.environ[JINJA2_ONLY] = "1"
    try:
        slow = load_template("model", config)
    finally:
        del os.environ[JINJA2_ONLY]
    return {"jinja2": (slow, Accelerators()), "minijinja": (fast, Accelerators())}


def render_pass(samples: list[Example], engine: tuple[ChatTemplate, Accelerators], per_pass: int = 0) -> float:
    """Microseconds per sample for one pass over the samples, repeated to at least per_pass renders."""
    policy = TrainPolicy()
    template, accelerators = engine
    repeats = max(1, -(-per_pass // len(samples)))
    start = time.perf_counter()
    for _ in range(repeats):
        for example in samples:
            with contextlib.suppress(RecordError):
                render_chat(example, template, policy, accelerators)
    return (time.perf_counter() - start) / (repeats * len(samples)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--per-pass", type=int, default=1000, help="samples rendered per timed pass, at least")
    args = parser.parse_args()
    data = {name: examples(name) for name in args.sets.split(",")}
    print(f"{'model':<13} {'set':<10} {'samples':>7} {'jinja2 us':>10} {'minijinja us':>13} {'speed-up':>9}  engine")
    for model in args.models.split(","):
        engines = templates(model)
        for name, samples in data.items():
            for engine in engines.values():
                render_pass(samples, engine)  # warm: recipes learned, caches filled
            times: dict[str, list[float]] = {"jinja2": [], "minijinja": []}
            ratios = []
            for round_ in range(args.rounds):
                order = ("jinja2", "minijinja") if round_ % 2 == 0 else ("minijinja", "jinja2")
                for engine in order:
                    times[engine].append(render_pass(samples, engines[engine], args.per_pass))
                ratios.append(times["jinja2"][-1] / times["minijinja"][-1])
            print(
                f"{model:<13} {name:<10} {len(samples):>7} {statistics.median(times['jinja2']):>10.1f} "
                f"{statistics.median(times['minijinja']):>13.1f} {statistics.median(ratios):>8.2f}x  "
                f"{engines['minijinja'][0].engine}"
            )


if __name__ == "__main__":
    main()
