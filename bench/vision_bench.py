"""Vision-language build and loader against the peer path, rows alternated pair by pair (issue 40's Targets).

    python bench/vision_bench.py                          # 500, 1,000 and 2,000 samples, 3 rounds
    python bench/vision_bench.py --samples 250 --rounds 2  # a quick look
    python bench/vision_bench.py --alone 10000            # also packtool alone at 10,000 (its memory)
    python bench/vision_bench.py --samples 100 --rounds 1 --alone 2000,10000,20000 --rows-per-shard 100
    python bench/vision_bench.py --samples 100 --rounds 1 --loader-samples 2000   # the loader rows

Data: N one-turn chats, each about a picture of its own (a JPEG written here, smooth random colours,
one of four sizes from 112 x 112 to 280 x 196), a Qwen2.5-VL image processor (patch 14, merge 2,
max_pixels 256 x 28 x 28, a common training setting: no picture here is resized down) and the vision
quickstart's tokenizer and ChatML vision template (configs/quickstart_vision/model). Capacity 2048.

Build rows, each a fresh process, one core (the machine is shared):
- packtool: `packtool build --no-cache -j 1` through the CLI: read, render, each image's header and
  sha256, its plan, the expansion, mRoPE positions, packing (bfd), shards, verify-on-write, manifest;
- peer: what a TRL user writes today: `datasets.load_dataset("json")`, then `Dataset.map` (one process)
  calling the tokenizer's chat template and transformers' `Qwen2_5_VLProcessor` (text + the decoded,
  upright picture -> input_ids, pixel_values, image_grid_thw), then best-fit-decreasing packing over the
  lengths (TRL's `pack_dataset(strategy="bfd")` does the same, but refuses a pixel_values column: it packs
  only columns as long as input_ids) and `to_parquet` of each pack's ids, pixel values and grids.
  A fresh datasets cache per run (a warm one skips the map). The peer writes no mRoPE positions, checks
  nothing and stores every picture's pixels (~1,200 float32 per patch); packtool stores references.
Peak MB is the process's peak resident memory (`os.wait4`'s ru_maxrss, every process it waited for).
`x peer` = peer seconds / packtool seconds, the median of per-pair ratios (the two runs of a pair back to
back, which of them runs first alternating by round), `(pairs)` the lowest and highest of them.

Loader rows (in this process, on packtool's output at --loader-samples, by default the largest N): CPU seconds
(one thread) for `PackedDataset` iterated with no worker to give every pack's images (what each DataLoader
worker does: read the pack, read and hash each picture, decode it upright, Qwen2VLImageProcessorPil, check the
grid, place the positions), against the image processor alone on the same files in the same groups, each picture
decoded either as the loader decodes it (floor: open, load, exif_transpose in place) or by transformers'
`load_image` (what the processor path does to a file). The three rows rotate round by round; `loader / X` is
X's CPU seconds over the loader's within a round (above 1: the loader gives more images per CPU second), the
median over rounds with the lowest and highest.

Sizes here are small on purpose: the peer's peak memory grows with N (3.0 GB at 500 samples, 5.8 GB at 1,000,
10.1 GB at 2,000 on this machine), so 10,000 samples run with packtool alone (--alone 10000).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "configs" / "quickstart_vision" / "model"
CAPACITY = 2048
SIZES = ((112, 112), (224, 168), (224, 224), (280, 196))  # (width, height)
PREPROCESSOR = {
    "processor_class": "Qwen2_5_VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 256 * 28 * 28,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

PEER = r"""
import bisect, itertools, json, sys
import pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
import datasets
from PIL import Image, ImageOps
from transformers import AutoTokenizer
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin
model, data, out, cache, capacity = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])

class ImagesOnlyProcessor(Qwen2_5_VLProcessor):  # its video processor needs torchvision; images go the same way
    def __init__(self, image_processor, tokenizer):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer)

tokenizer = AutoTokenizer.from_pretrained(model)
processor = ImagesOnlyProcessor(Qwen2VLImageProcessorPil.from_pretrained(model), tokenizer)
rows = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)

def encode(row):
    text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    pictures = [ImageOps.exif_transpose(Image.open(path)) for path in row["images"]]
    got = processor(text=[text], images=pictures)
    grids = got["image_grid_thw"]
    return {"input_ids": got["input_ids"][0], "pixel_values": got["pixel_values"], "image_grid_thw": grids}

encoded = rows.map(encode, remove_columns=rows.column_names)
lengths = [len(ids) for ids in encoded["input_ids"]]

# Best fit decreasing (TRL's pack_dataset strategy="bfd"): longest first, each into the fullest pack it fits.
spaces, packs = [], []  # spaces sorted ascending, each (space left, pack index)
for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    at = bisect.bisect_left(spaces, (lengths[i], -1))
    if at < len(spaces):
        space, p = spaces.pop(at)
    else:
        space, p = capacity, len(packs)
        packs.append([])
    packs[p].append(i)
    if space - lengths[i] > 0:
        bisect.insort(spaces, (space - lengths[i], p))

# Each pack's rows gathered in Arrow (as TRL's packing works on the Arrow table), then written.
table = encoded.with_format("arrow")[:]
columns = {}
for name in ("input_ids", "pixel_values", "image_grid_thw"):
    pieces = [pc.list_flatten(table.column(name).take(members)) for members in packs]
    offsets = pa.array([0, *itertools.accumulate(len(piece) for piece in pieces)], pa.int32())
    columns[name] = pa.ListArray.from_arrays(offsets, pa.concat_arrays([p.combine_chunks() for p in pieces]))
pq.write_table(pa.table(columns), out)
print(json.dumps({"packs": len(packs), "tokens": sum(lengths)}))
"""


def make_pictures(folder: Path, n: int) -> list[str]:
    """n JPEGs of smooth random colours (a 6 x 6 grid of colours blown up), paths relative to `folder`."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(n):
        width, height = SIZES[i % len(SIZES)]
        name = f"images/{i}.jpg"
        colours = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
        colours.resize((width, height), Image.Resampling.BILINEAR).save(folder / name, quality=90)
        names.append(name)
    return names


def make_model(folder: Path) -> Path:
    model = folder / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(MODEL / name, model / name)
    (model / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2), encoding="utf-8")
    return model


def make_set(
    folder: Path, model: Path, pictures: list[str], n: int, rows_per_shard: int | None = None
) -> tuple[Path, Path]:
    """The first n samples: packtool's config and the peer's data file (absolute picture paths)."""
    records, peer = [], []
    for i, name in enumerate(pictures[:n]):
        question = [{"type": "image", "image": name}, {"type": "text", "text": f"What colours are in picture {i}?"}]
        answer = f"Picture {i} shows a smooth blend of colours, brightest at its corner {i % 4}."
        records.append(
            {
                "id": f"s{i}",
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            }
        )
        peer.append(
            {
                "messages": [{"role": "user", "content": [{"type": "image"}, question[1]]}, records[-1]["messages"][1]],
                "images": [str(folder / name)],
            }
        )
    data = folder / f"chats-{n}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (folder / f"peer-{n}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in peer), encoding="utf-8")
    config = folder / f"build-{n}.json"  # JSON is YAML
    settings = {
        "sources": [{"name": "chats", "path": data.name, "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(model),
        "template": "model",
        "capacity": CAPACITY,
        "packing": "bfd",
        "output": f"out-{n}",
    }
    if rows_per_shard:
        settings["rows_per_shard"] = rows_per_shard
    config.write_text(json.dumps(settings), encoding="utf-8")
    return config, folder / f"peer-{n}.jsonl"


def run(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds, peak resident MB and stdout of one fresh process (and those it waited for)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, env={**os.environ, **env}, cwd=cwd)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        stdout.seek(0)
        stderr.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{stdout.read().decode()}\n{stderr.read().decode()}")
        cpu = usage.ru_utime + usage.ru_stime
        return seconds, cpu, usage.ru_maxrss / 1024, stdout.read().decode()


def build_rows(folder: Path, model: Path, pictures: list[str], sizes: list[int], rounds: int) -> list[dict]:
    sets = {n: make_set(folder, model, pictures, n) for n in sizes}
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    results = []
    for n in sizes:
        config, peer_data = sets[n]
        runs: dict[str, list[tuple[float, float, float]]] = {"packtool": [], "peer": []}
        for round_ in range(rounds):
            order = ["packtool", "peer"] if round_ % 2 == 0 else ["peer", "packtool"]
            for row in order:
                if row == "packtool":
                    shutil.rmtree(folder / f"out-{n}", ignore_errors=True)
                    command = [sys.executable, "-m", "packtool", "build", config.name, "-q", "--no-cache", "-j", "1"]
                    runs[row].append(run(command, env, folder)[:3])
                else:
                    cache = folder / "hf-cache"
                    shutil.rmtree(cache, ignore_errors=True)
                    peer_out = folder / "peer.parquet"
                    command = [sys.executable, "-c", PEER, str(model), str(peer_data), str(peer_out), str(cache)]
                    peer_env = {**env, "HF_DATASETS_CACHE": str(cache)}
                    runs[row].append(run([*command, str(CAPACITY)], peer_env, folder)[:3])
                    peer_bytes = peer_out.stat().st_size
                    shutil.rmtree(cache, ignore_errors=True)
                    peer_out.unlink()
                seconds, cpu, peak = runs[row][-1]
                print(f"  n={n} round {round_} {row}: {seconds:.1f} s, {cpu:.1f} CPU-s, {peak:.0f} MB", file=sys.stderr)
        out = folder / f"out-{n}"
        out_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        pairs = list(zip(runs["packtool"], runs["peer"], strict=True))
        results.append(
            {
                "n": n,
                "runs": runs,
                "wall": [peer[0] / ours[0] for ours, peer in pairs],
                "cpu": [peer[1] / ours[1] for ours, peer in pairs],
                "out_mb": out_bytes / 2**20,
                "peer_mb": peer_bytes / 2**20,
            }
        )
    return results


def median(runs: list[tuple[float, float, float]], field: int) -> float:
    return statistics.median(run[field] for run in runs)


def alone_row(folder: Path, model: Path, pictures: list[str], n: int, rows_per_shard: int | None = None) -> dict:
    config, _ = make_set(folder, model, pictures, n, rows_per_shard)
    env = {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "packtool", "build", config.name, "-q", "--no-cache", "-j", "1"]
    seconds, cpu, peak, _ = run(command, env, folder)
    return {"n": n, "seconds": seconds, "cpu": cpu, "peak": peak}


def loader_rows(out: Path, rounds: int) -> dict:
    """CPU seconds to preprocess every image of `out`: PackedDataset with no worker, and the image processor alone
    on the same files in the same groups, decoded as the loader decodes them (floor) or by transformers'
    load_image (as the processor path loads a file); rows rotated round by round, each ratio within a round."""
    import pyarrow.parquet as pq
    import torch
    from PIL import Image, ImageOps
    from transformers.image_utils import load_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from packtool.loader import PackedDataset

    torch.set_num_threads(1)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    root = Path(manifest["vision"]["root"])
    groups = [
        [root / ref for ref in refs]
        for shard in sorted(out.glob("**/*.parquet"))
        for refs in pq.read_table(shard, columns=["image_refs"]).column("image_refs").to_pylist()
    ]
    n_images = sum(len(g) for g in groups)
    processor = Qwen2VLImageProcessorPil.from_pretrained(out / "processor")

    def upright(file: Path) -> Image.Image:
        picture = Image.open(file)
        picture.load()
        ImageOps.exif_transpose(picture, in_place=True)
        return picture

    def alone(decode) -> float:
        start = time.process_time()
        for files in groups:
            processor(images=[decode(file) for file in files], return_tensors="pt")
        return time.process_time() - start

    def loader() -> float:
        start = time.process_time()
        seen = sum(len(p.images.image_grid_thw) if p.images else 0 for p in PackedDataset(out, shuffle=False))
        seconds = time.process_time() - start
        if seen != n_images:
            raise SystemExit(f"the loader gave {seen} images, the shards hold {n_images}")
        return seconds

    rows = {
        "loader": loader,
        "floor": lambda: alone(upright),
        "load_image": lambda: alone(lambda f: load_image(str(f))),
    }
    for row in rows.values():  # warm: the files in the page cache, the imports and first calls done
        row()
    times: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for round_ in range(rounds):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            times[name].append(rows[name]())
    ratios = {name: [t / ours for t, ours in zip(times[name], times["loader"], strict=True)] for name in names[1:]}
    return {"images": n_images, "times": times, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="500,1000,2000", help="comma-separated sample counts (build rows)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--alone", default="", help="also build these sample counts (comma-separated), packtool alone")
    parser.add_argument(
        "--rows-per-shard", type=int, default=0, help="the alone rows' shard size (default 1000: one shard here)"
    )
    parser.add_argument("--loader-rounds", type=int, default=6)
    parser.add_argument("--loader-samples", type=int, default=0, help="the loader rows' set (default: the largest)")
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.samples.split(","))
    alone = [int(n) for n in args.alone.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as name:
        folder = Path(name)
        model = make_model(folder)
        pictures = make_pictures(folder, max([*sizes, *alone, args.loader_samples]))
        results = build_rows(folder, model, pictures, sizes, args.rounds)
        print(
            "| samples | packtool s (CPU-s) | peer s (CPU-s) | x peer, CPU (pairs) | x peer, wall | peak MB | peer MB |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in results:
            ours, peer = r["runs"]["packtool"], r["runs"]["peer"]
            print(
                f"| {r['n']:,} | {median(ours, 0):.1f} ({median(ours, 1):.1f})"
                f" | {median(peer, 0):.1f} ({median(peer, 1):.1f})"
                f" | {statistics.median(r['cpu']):.1f} ({min(r['cpu']):.1f}-{max(r['cpu']):.1f})"
                f" | {statistics.median(r['wall']):.1f} | {median(ours, 2):.0f} | {median(peer, 2):.0f} |"
            )
        for n in alone:
            r = alone_row(folder, model, pictures, n, args.rows_per_shard or None)
            print(f"| {r['n']:,} | {r['seconds']:.1f} ({r['cpu']:.1f}) | - | - | - | {r['peak']:.0f} | - |")
        sizes_out = ", ".join(f"{r['n']:,}: {r['out_mb']:.2f} MB vs {r['peer_mb']:.0f} MB" for r in results)
        print(f"\noutput size, packtool vs peer: {sizes_out}")
        loader_set = args.loader_samples or sizes[-1]
        if loader_set not in sizes:
            alone_row(folder, model, pictures, loader_set)
        loaded = loader_rows(folder / f"out-{loader_set}", args.loader_rounds)
        per_second = {name: loaded["images"] / statistics.median(t) for name, t in loaded["times"].items()}
        print()
        print(
            "| images | loader images per CPU-s | alone, floor | loader / floor (rounds)"
            " | alone, load_image | loader / load_image (rounds) |"
        )
        print("|---|---|---|---|---|---|")
        cells = [
            f"{per_second[name]:.0f} | {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"
            for name, r in loaded["ratios"].items()
        ]
        print(f"| {loaded['images']:,} | {per_second['loader']:.0f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
