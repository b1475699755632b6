"""Packing efficiency of preference pairs (placed whole) next to plain SFT packing of the chosen conversations.

    python bench/pairs_bench.py                        # the two LLaMA-Factory DPO demo files, Qwen2.5's template
    python bench/pairs_bench.py --capacity 1024 4096   # other pack sizes
    python bench/pairs_bench.py --data FILE.json ...   # any preference files pair_from_record reads

Every row is parsed (`adapters.pair_from_record`), encoded as two segments that share the
prompt (`builder.answers.encode_answers`), fitted with the joint left cut of the prompt
(`truncate.truncate_item`; dropped as `pair_too_long` when the answers alone do not fit) and
planned with `packing_items.plan_items` (bfd). The rows printed:

    pairs, packed          each pair one unit of two segments, several pairs per row
    pairs, one per row     a pair alone in a row of `capacity` tokens (what a trainer without pair packing pads to)
    SFT chosen, packed     the chosen conversations alone as plain samples (left-cut to capacity), bfd

`efficiency` is tokens / (rows * capacity); `bound` is ceil(tokens / capacity). The last column
is what a shared-prompt layout (the prompt stored once per pair, issue 13 item 7) would save.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from packtool.adapters import pair_from_record
from packtool.builder.answers import encode_answers
from packtool.chat_templates import load_template
from packtool.config import TokenizerConfig
from packtool.encode import load_tokenizer
from packtool.packing import lower_bound, plan_packs
from packtool.packing_items import plan_items
from packtool.records import prompt_length
from packtool.truncate import truncate_item

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_DATA = [
    SHARED / "datasets" / "llamafactory_dpo_en_demo.json",
    SHARED / "datasets" / "llamafactory_dpo_zh_demo.json",
]


def encoded_pairs(files: list[Path], tokenizer_folder: Path) -> list[tuple]:
    tokenizer = load_tokenizer(
        TokenizerConfig(str(tokenizer_folder / "tokenizer.json"), str(tokenizer_folder / "tokenizer_config.json"))
    )
    template = load_template("model", tokenizer.config)
    pairs = []
    for file in files:
        for i, row in enumerate(json.loads(file.read_text(encoding="utf-8"))):
            pair = pair_from_record(row, sample_id=f"{file.name}:{i}", source=file.stem)
            pairs.append(encode_answers(pair, template, tokenizer))
    return pairs


def rows_for(pairs: list[tuple], capacity: int) -> list[tuple[str, int, int, int, str]]:
    """(layout, tokens, rows, bound, note) at one capacity."""
    fitted = [truncate_item(segments, capacity, "left") for segments in pairs]
    kept = [f.segments for f in fitted if f.drop_reason is None]
    dropped = len(fitted) - len(kept)
    cut = sum(f.strategy == "left" for f in fitted)
    seg_lengths = np.array([len(s) for segments in kept for s in segments], dtype=np.int64)
    offsets = np.arange(0, 2 * len(kept) + 1, 2, dtype=np.int64)
    plan = plan_items(seg_lengths, offsets, capacity)
    tokens = int(seg_lengths.sum())
    note = f"{cut} prompts cut, {dropped} pairs dropped"
    out = [
        ("pairs, packed", tokens, plan.items.n_packs, lower_bound(seg_lengths, capacity), note),
        ("pairs, one per row", tokens, len(kept), lower_bound(seg_lengths, capacity), note),
    ]
    chosen = np.minimum([len(segments[0]) for segments in pairs], capacity)
    sft = plan_packs(chosen, capacity)
    out.append(("SFT chosen, packed", int(chosen.sum()), sft.n_packs, lower_bound(chosen, capacity), ""))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "qwen2.5")
    parser.add_argument("--capacity", nargs="+", type=int, default=[2048, 4096, 8192])
    args = parser.parse_args()
    started = time.perf_counter()
    pairs = encoded_pairs(args.data, args.tokenizer)
    seconds = time.perf_counter() - started
    prompts = np.array([prompt_length(segments[0]) for segments in pairs])
    totals = np.array([sum(len(s) for s in segments) for segments in pairs])
    print(
        f"{len(pairs)} pairs from {', '.join(p.name for p in args.data)} encoded in {seconds:.1f} s; "
        f"pair length p50 {int(np.median(totals))}, max {int(totals.max())}; "
        f"prompt p50 {int(np.median(prompts))} tokens\n"
    )
    print("| capacity | layout | tokens | rows | bound | efficiency | note |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for capacity in args.capacity:
        for layout, tokens, rows, bound, note in rows_for(pairs, capacity):
            print(
                f"| {capacity} | {layout} | {tokens:,} | {rows} | {bound} | {tokens / (rows * capacity):.3f} | {note} |"
            )
    print(
        f"\nshared prompt (stored once per pair): saves {int(prompts.sum()):,} of {int(totals.sum()):,} tokens "
        f"({prompts.sum() / totals.sum():.1%}) before any cut"
    )


if __name__ == "__main__":
    main()
