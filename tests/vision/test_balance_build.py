"""`packing.balance_vision`: a build whose records carry different numbers of images spreads the vision patches
evenly across its packs (issue 40 item 6) at the token efficiency docs/config.md states; a text build's shards
are byte for byte the same whatever it says."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import QUICKSTART, REPO

from packtool.builder import build
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.errors import ConfigError
from packtool.format import read_manifest

MODEL = REPO / "configs" / "quickstart_vision" / "model"  # Qwen2-VL's processor: 4 to 16 image tokens a picture
CAPACITY = 512  # 2 to 20 documents a pack: room to place pictures by patches
WORDS = ["the", "red", "square", "sits", "beside", "a", "blue", "circle", "under", "green", "and", "stripes"]


def pictures_folder(folder: Path) -> list[str]:
    """Pictures of 4, 8, 12 and 16 image tokens (sides in multiples of 28 pixels between min and max pixels)."""
    from PIL import Image

    (folder / "images").mkdir()
    names = []
    for width, height in [(56, 56), (112, 56), (84, 112), (112, 112)]:
        name = f"images/{width}x{height}.png"
        Image.new("RGB", (width, height), (width, height, 90)).save(folder / name)
        names.append(name)
    return names


def mixed_records(folder: Path, n: int = 300) -> Path:
    """Chats with 0 to 4 pictures each, most with none or one, and 3 to 60 words of text."""
    names = pictures_folder(folder)
    rng = random.Random(46)
    lines = []
    for i in range(n):
        count = rng.choice([0, 0, 0, 1, 1, 2, 4])
        parts = [{"type": "image", "image": rng.choice(names)} for _ in range(count)]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        messages = [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 20)))},
        ]
        lines.append(json.dumps({"id": f"r{i}", "messages": messages}))
    path = folder / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def vision_build(folder: Path, balance: bool) -> Path:
    config = {
        "sources": [{"name": "chat", "path": str(folder / "chat.jsonl"), "format": "messages", "fields": {"id": "id"}}],
        "tokenizer": str(MODEL),
        "template": "model",
        "capacity": CAPACITY,
        "packing": {"strategy": "bfd", "balance_vision": balance},
        "executor": "serial",
        "output": f"out-{balance}",
    }
    path = folder / f"config-{balance}.json"
    path.write_text(json.dumps(config))
    build(load_config(path), use_cache=False)
    return folder / f"out-{balance}"


def pack_amounts(out: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens of each pack, vision patches of each pack, pictures in all)."""
    rows = [row for entry in read_manifest(out).shards for row in pq.read_table(entry.file).to_pylist()]
    tokens = np.array([len(row["input_ids"]) for row in rows])
    patches = np.array([int(np.prod(np.reshape(row["image_grids"], (-1, 3)), axis=1).sum()) for row in rows])
    return tokens, patches, sum(len(row["image_refs"]) for row in rows)


def test_balance_vision_evens_out_the_patches_per_pack(tmp_path):
    pytest.importorskip("PIL")
    mixed_records(tmp_path)
    unbalanced = vision_build(tmp_path, False)
    tokens_before, before, pictures = pack_amounts(unbalanced)
    balanced = vision_build(tmp_path, True)
    assert verify(balanced).ok
    # the manifest says whether packing balanced vision work (it held only the config copy's say)
    assert [read_manifest(out).raw["packing"]["balance_vision"] for out in (unbalanced, balanced)] == [False, True]
    tokens_after, after, pictures_after = pack_amounts(balanced)
    assert pictures_after == pictures > 0 and tokens_after.sum() == tokens_before.sum()  # every document kept
    cv_before, cv_after = before.std() / before.mean(), after.std() / after.mean()
    assert cv_after < 0.05 < 0.4 < cv_before, (cv_before, cv_after)  # measured: 0.51 -> 0.03
    assert after.max() < 0.6 * before.max()  # the heaviest pack: 448 -> 224 patches
    assert len(tokens_after) == len(tokens_before)  # the same token efficiency: bfd's 64 packs


def shard_digests(out: Path) -> list[str]:
    return [hashlib.sha256(Path(entry.file).read_bytes()).hexdigest() for entry in read_manifest(out).shards]


def test_a_text_build_is_the_same_whatever_balance_vision_says(tmp_path):
    outs = []
    for balance in (False, True):
        config = {
            "sources": [{"name": "chat", "path": str(QUICKSTART / "chat.jsonl"), "format": "messages"}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 512,
            "packing": {"strategy": "bfd", "balance_vision": balance},
            "executor": "serial",
            "output": f"out-{balance}",
        }
        path = tmp_path / f"config-{balance}.json"
        path.write_text(json.dumps(config))
        build(load_config(path), use_cache=False)
        outs.append(shard_digests(tmp_path / f"out-{balance}"))
        # nothing to balance, so nothing recorded: a text build's manifest reads as it did before the setting
        assert "balance_vision" not in read_manifest(tmp_path / f"out-{balance}").raw["packing"]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("strategy", ["sequential", "pad", "stream"])
def test_balance_vision_with_a_strategy_that_keeps_its_own_order_is_refused(tmp_path, strategy):
    path = tmp_path / "config.json"
    source = {"name": "chat", "path": str(QUICKSTART / "chat.jsonl"), "format": "messages"}
    settings = {"strategy": strategy, "balance_vision": True}
    path.write_text(json.dumps({"sources": [source], "tokenizer": str(QUICKSTART / "tokenizer"), "capacity": 512}))
    path.write_text(json.dumps({**json.loads(path.read_text()), "packing": settings, "output": "out"}))
    with pytest.raises(ConfigError, match=f"packing.balance_vision.*{strategy} keeps its own order"):
        load_config(path)
