"""OUT/README.md, the dataset card: valid front matter that `datasets` reads (train, validation, overflow apart, row
counts of the manifest), a body taken from the manifest, and a file packtool owns only while it is as written."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from support import QUICKSTART

from packtool.builder import build
from packtool.builder.card import DECONTAMINATION_MARK, card_text, features
from packtool.commands.verify import verify
from packtool.config import Card, ConfigError, load_config
from packtool.errors import OwnershipError
from packtool.format import CARD, read_manifest

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _config(tmp_path: Path, **extra) -> dict:
    """Forty short documents and four long ones (over capacity: the overflow bucket), a fifth held out."""
    short = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + i % 5)) for i in range(40)]
    long = [" ".join(WORDS[(i * j) % len(WORDS)] for j in range(90)) for i in range(1, 5)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(f'{{"text": "{text}"}}\n' for text in short + long), encoding="utf-8")
    return {
        "sources": [{"name": "docs", "path": str(data), "format": "text"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": str(tmp_path / "out"),
        "rows_per_shard": 4,
        "validation": {"share": 0.2},
        "overflow": {"mode": "bucket", "capacity": 256},
        "card": {"license": "apache-2.0", "pretty_name": "Tiny docs", "tags": ["packed"], "description": "Test data."},
        **extra,
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("card")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path)), encoding="utf-8")
    build(load_config(config), use_cache=False)
    return tmp_path / "out"


def _front_matter(text: str) -> dict:
    match = re.fullmatch(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert match, "the card starts with YAML front matter between --- lines"
    return yaml.safe_load(match.group(1))


def test_the_card_is_recorded_in_the_manifest_and_verified(built):
    manifest = read_manifest(built)
    assert manifest.raw["card"]["file"] == CARD and (built / CARD).stat().st_size == manifest.raw["card"]["bytes"]
    assert sorted(p.name for p in built.iterdir()) == [
        CARD,
        "manifest.json",
        "overflow",
        "rejects.jsonl",
        *sorted(p.name for p in built.glob("shard-*.parquet")),
        "validation",
    ]
    assert not (built / "validation" / CARD).exists()  # one card, for the whole build
    assert verify(built).ok


def test_the_front_matter_points_datasets_at_each_split(built):
    front = _front_matter((built / CARD).read_text(encoding="utf-8"))
    assert (front["license"], front["pretty_name"], front["tags"]) == ("apache-2.0", "Tiny docs", ["packed"])
    assert front["configs"] == [
        {
            "config_name": "default",
            "data_files": [
                {"split": "train", "path": "shard-*.parquet"},
                {"split": "validation", "path": "validation/shard-*.parquet"},
            ],
        },
        {"config_name": "overflow", "data_files": [{"split": "train", "path": "overflow/shard-*.parquet"}]},
    ]
    schema = pq.read_schema(next(built.glob("shard-*.parquet")))
    assert all(info["features"] == features(schema) for info in front["dataset_info"])


def test_datasets_loads_train_and_validation_apart_and_overflow_as_its_own_config(built, tmp_path):
    datasets = pytest.importorskip("datasets")
    manifest = read_manifest(built).raw
    rows = {
        "train": manifest["stats"]["packs"],
        "validation": read_manifest(built / "validation").raw["stats"]["packs"],
    }
    loaded = datasets.load_dataset(str(built), cache_dir=str(tmp_path / "cache"))
    assert {split: loaded[split].num_rows for split in loaded} == rows
    overflow = datasets.load_dataset(str(built), "overflow", cache_dir=str(tmp_path / "cache"))
    assert {split: overflow[split].num_rows for split in overflow} == {"train": manifest["overflow"]["packs"]}
    first = loaded["train"][0]
    assert first["n_tokens"] == len(first["input_ids"]) and first["cu_seqlens"][-1] == first["n_tokens"]
    schema = pq.read_schema(next(built.glob("shard-*.parquet")))
    assert loaded["train"].features.arrow_schema.types == schema.types  # the card's features are the shards'


def test_the_parquet_builder_reads_the_splits_apart_given_the_cards_data_files(built, tmp_path):
    """`load_dataset("parquet", data_dir=OUT)` never reads the card: its default patterns take validation/**, the
    manifest.json there included, and fail on it. The card's data_files, given to it, read each split apart."""
    datasets = pytest.importorskip("datasets")
    front = _front_matter((built / CARD).read_text(encoding="utf-8"))
    default = next(c for c in front["configs"] if c["config_name"] == "default")
    data_files = {f["split"]: f["path"] for f in default["data_files"]}
    loaded = datasets.load_dataset("parquet", data_dir=str(built), data_files=data_files, cache_dir=str(tmp_path))
    assert {split: loaded[split].num_rows for split in loaded} == {
        "train": read_manifest(built).raw["stats"]["packs"],
        "validation": read_manifest(built / "validation").raw["stats"]["packs"],
    }


def test_the_hub_reads_the_card_metadata(built):
    hub = pytest.importorskip("huggingface_hub")
    data = hub.DatasetCard((built / CARD).read_text(encoding="utf-8")).data
    assert data.license == "apache-2.0" and [c["config_name"] for c in data.configs] == ["default", "overflow"]


def test_the_body_says_what_the_manifest_says(built):
    text = (built / CARD).read_text(encoding="utf-8")
    manifest = read_manifest(built).raw
    body = text.split("\n---\n", 1)[1]
    assert body.lstrip().startswith("# Tiny docs\n\nTest data.")
    assert f"| default | train | `./` | {manifest['stats']['packs']:,} | {manifest['stats']['tokens']:,} |" in body
    assert f"{manifest['stats']['token_efficiency']:.4f}" in body
    assert f"| `docs` | `text` | `{manifest['config']['sources'][0]['path']}` | 44 |" in body
    assert manifest["tokenizer"]["sha256"] in body and "bfd" in body
    assert DECONTAMINATION_MARK in body and "no decontamination" in body
    assert 'load_dataset("PATH", "overflow")' in body and 'PackedDataset("PATH/validation"' in body
    _tables_are_whole(body)


def _tables_are_whole(body: str) -> None:
    """Every row of a Markdown table has its header's cells (an unescaped | in a value would add one)."""
    for table in re.findall(r"(?:^\|.*\|\n)+", body, re.M):
        rows = [re.split(r"(?<!\\)\|", row)[1:-1] for row in table.splitlines()]
        assert len({len(row) for row in rows}) == 1, table


def test_a_decontamination_record_is_summarized_in_its_place(built):
    manifest = read_manifest(built).raw
    record = {
        "action": "drop",
        "ngram": 13,
        "against": [{"file": "evals/gsm|8k.jsonl", "sha256": "ab" * 32, "records": 1319}],
        "fields": ["question", "answer"],
        "sources": {"docs": {"contaminated": 2, "reported": 0}},
    }
    parts = {"validation": read_manifest(built / "validation").raw, "overflow": read_manifest(built / "overflow").raw}
    text = card_text(Card(), {**manifest, "decontamination": record}, parts)
    section = text.split(DECONTAMINATION_MARK, 1)[1].split("## Reading", 1)[0]
    assert (
        "- action: `drop`" in section and "- ngram: `13`" in section and '- fields: `["question", "answer"]`' in section
    )
    assert "| file | records | sha256 |" in section and "`evals/gsm\\|8k.jsonl`" in section
    assert "| name | contaminated | reported |" in section and "| `docs` | `2` | `0` |" in section
    _tables_are_whole(text)
    assert card_text(Card(), manifest, parts) == card_text(Card(), manifest, parts)  # no clock, no machine path


def test_an_edited_card_fails_verify_and_is_never_overwritten(built, tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**_config(tmp_path), "output": str(out)}), encoding="utf-8")
    build(load_config(config), use_cache=False)
    card = out / CARD
    card.write_text(card.read_text(encoding="utf-8") + "\nMy notes.\n", encoding="utf-8")
    problems = verify(out).problems
    assert len(problems) == 1 and "README.md" in problems[0] and "edited after the build" in problems[0]
    with pytest.raises(OwnershipError, match=r"README\.md"):
        build(load_config(config), use_cache=False)
    assert card.read_text(encoding="utf-8").endswith("My notes.\n")  # the user's words stay
    card.unlink()
    assert "missing" in verify(out).problems[0]
    rebuilt = build(load_config(config), use_cache=False)  # the card it lacked is written again
    assert not rebuilt.up_to_date and verify(out).ok


def test_card_settings_are_checked_with_the_config(tmp_path):
    raw = _config(tmp_path, card={"licence": "mit", "tags": ["ok", 3], "pretty_name": ["no"]})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    message = str(raised.value)
    assert "card.licence: unknown key; did you mean 'license'?" in message
    assert "card.tags: expected a list of non-empty strings" in message and "card.pretty_name: expected" in message
