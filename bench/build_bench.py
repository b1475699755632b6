"""Where a build's time goes, next to the floor: the same texts through `tokenizers.encode_batch` alone.

    python bench/build_bench.py                 # real datasets in ../shared/data, Qwen2.5 tokenizer
    python bench/build_bench.py --repeat 3      # medians of 3

The tokenizer is the floor of any build; everything packtool adds (rendering with span tracking,
the mask self-check, truncation, global planning, Parquet writing) is reported on top of it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from packtool.build import build
from packtool.config import parse_config
from packtool.encode import load_tokenizer
from packtool.render import load_template, render_chat, render_text
from packtool.sources import read_source

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def config(output: Path):
    datasets = DATA / "datasets"
    raw = {
        "sources": [
            {"name": "alpaca_en", "path": str(datasets / "llamafactory_alpaca_en_demo.json"), "format": "alpaca"},
            {"name": "alpaca_zh", "path": str(datasets / "llamafactory_alpaca_zh_demo.json"), "format": "alpaca"},
            {"name": "code", "path": str(datasets / "code_alpaca_2k.json"), "format": "alpaca"},
            {
                "name": "glaive",
                "path": str(datasets / "llamafactory_glaive_toolcall_en_demo.json"),
                "format": "sharegpt",
            },
            {"name": "c4", "path": str(datasets / "llamafactory_c4_demo.jsonl"), "format": "text"},
        ],
        "tokenizer": str(DATA / "tokenizers" / "qwen2.5"),
        "capacity": 4096,
        "output": str(output),
        "on_error": "skip",
    }
    return parse_config(raw, base_dir=Path.cwd())


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="processes for the parallel build row")
    args = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this bench runs on the shared real datasets")
    with tempfile.TemporaryDirectory() as tmp:
        settings = config(Path(tmp) / "out")
        tokenizer = load_tokenizer(settings.tokenizer)
        template = load_template("model", tokenizer.config)
        examples = [e for s in settings.sources for e in read_source(s) if not isinstance(e, Exception)]

        def render_all():
            out = []
            for e in examples:
                try:
                    out.append(
                        render_text(e, template.special_tokens, add_bos=False, add_eos=True)
                        if e.is_text
                        else render_chat(e, template, settings.sources[0].train)
                    )
                except Exception:
                    continue
            return out

        render_s, rendered = timed(render_all, args.repeat)
        texts = [r.text for r in rendered]
        floor_s, encodings = timed(
            lambda: tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False), args.repeat
        )
        tokens = sum(len(e.ids) for e in encodings)
        build_s, manifest = timed(lambda: build(settings, use_cache=False).manifest, args.repeat)
        parallel = replace(settings, workers=args.workers)
        parallel_s, _ = timed(lambda: build(parallel, use_cache=False), args.repeat)

    rows = [
        ("tokenizers.encode_batch alone (floor)", floor_s),
        ("render with span tracking", render_s),
        ("packtool build, end to end", build_s),
        (f"packtool build, end to end, {args.workers} workers", parallel_s),
    ]
    print(
        f"{len(examples):,} samples, {tokens:,} tokens, Qwen2.5 tokenizer, capacity 4096, "
        f"{manifest['stats']['packs']:,} packs, efficiency {manifest['stats']['token_efficiency']:.4f}"
    )
    print(f"{'stage':<40} {'seconds':>8} {'M tokens/s':>11} {'x floor':>8}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds:>8.2f} {tokens / seconds / 1e6:>11.3f} {seconds / floor_s:>8.2f}")


if __name__ == "__main__":
    main()
