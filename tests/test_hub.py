"""Inputs Hugging Face users have: datasets folders and .arrow files, compressed JSON Lines, the local hub cache."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from support import QUICKSTART

from packtool.cli import main
from packtool.config import load_config
from packtool.format import read_manifest
from packtool.hub import hub_cache, snapshot

CHAT = [
    {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
    for i in range(6)
]


def _build(tmp_path: Path, source: dict, tokenizer: str | None = None, capacity: int = 256) -> dict:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "sources": [{"name": "chat", "format": "messages", **source}],
                "tokenizer": tokenizer or str(QUICKSTART / "tokenizer"),
                "capacity": capacity,
                "output": "out",
                "workers": 1,
            }
        )
    )
    result = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert result.exit_code == 0, result.output
    return read_manifest(tmp_path / "out").raw


def _sample_ids(tmp_path: Path) -> list[str]:
    rows = pq.read_table(tmp_path / "out" / "shard-00000.parquet", columns=["sample_ids"]).to_pylist()
    return sorted(s for row in rows for s in row["sample_ids"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A Dataset and a DatasetDict written by the datasets library itself."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path_factory.mktemp("saved")
    dataset = datasets.Dataset.from_list(CHAT)
    dataset.save_to_disk(str(folder / "one"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(2))}).save_to_disk(str(folder / "dict"))
    return folder


def test_save_to_disk_folder_builds(tmp_path, saved):
    shutil.copytree(saved / "one", tmp_path / "one")
    manifest = _build(tmp_path, {"path": "one"})
    assert manifest["accounting"]["chat"]["kept"] == 6
    # the .arrow file inside the folder is the FILE of each location; rows count from 0
    assert _sample_ids(tmp_path) == [f"chat:one/data-00000-of-00001.arrow:{i}" for i in range(6)]


def test_dataset_dict_split(tmp_path, saved):
    shutil.copytree(saved / "dict", tmp_path / "dict")
    assert _build(tmp_path, {"path": "dict"})["accounting"]["chat"]["kept"] == 6  # train by default
    assert _build(tmp_path, {"path": "dict", "split": "test"})["accounting"]["chat"]["kept"] == 2
    with pytest.raises(Exception, match=r"no split 'dev' in this DatasetDict \(splits: train, test\)"):
        load_config(_config_file(tmp_path, {"path": "dict", "split": "dev"}))


def _config_file(tmp_path: Path, source: dict, tokenizer: str | None = None) -> Path:
    path = tmp_path / "c.yaml"
    config = {
        "sources": [{"name": "chat", "format": "messages", **source}],
        "tokenizer": tokenizer or str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_bare_arrow_file_builds_without_the_datasets_library(tmp_path, saved, monkeypatch):
    shutil.copy(saved / "one" / "data-00000-of-00001.arrow", tmp_path / "train.arrow")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # reading must not need it
    manifest = _build(tmp_path, {"path": "train.arrow"})
    assert manifest["accounting"]["chat"]["kept"] == 6
    assert _sample_ids(tmp_path)[0] == "chat:train.arrow:0"


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".data"])
def test_compressed_json_lines_are_read_by_content(tmp_path, suffix):
    import zstandard

    raw = "".join(json.dumps(r) + "\n" for r in CHAT).encode()
    data = {".jsonl.gz": gzip.compress(raw), ".jsonl.zst": zstandard.ZstdCompressor().compress(raw)}
    (tmp_path / f"chat{suffix}").write_bytes(data.get(suffix, gzip.compress(raw)))  # .data: gzip by its bytes alone
    manifest = _build(tmp_path, {"path": f"chat{suffix}"})
    assert manifest["accounting"]["chat"]["kept"] == 6
    assert _sample_ids(tmp_path)[0] == f"chat:chat{suffix}:1"  # still JSON Lines: lines count from 1


def _cache_repo(cache: Path, kind: str, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
    """A repository laid out as huggingface_hub lays out its cache: blobs, a snapshot of links, a ref."""
    folder = cache / f"{kind}--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repr(sorted(files)).encode() + ref.encode()).hexdigest()
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * len(Path(name).parts) + "../blobs") / blob.name)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_cache_location_follows_huggingface_hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache() == tmp_path / "elsewhere"


def test_dataset_and_tokenizer_by_name_from_the_hub_cache(tmp_path, cache):
    train = "".join(json.dumps(r) + "\n" for r in CHAT).encode()
    files = {"data/train-00000-of-00001.jsonl": train, "data/test-00000-of-00001.jsonl": train[:200], "README.md": b"#"}
    _cache_repo(cache, "datasets", "org/chat", files)
    tokenizer = {
        name: (QUICKSTART / "tokenizer" / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")
    }
    _cache_repo(cache, "models", "org/tiny-tok", tokenizer)
    huggingface_hub = pytest.importorskip("huggingface_hub")
    # the layout is the one huggingface_hub itself reads
    assert {r.repo_id for r in huggingface_hub.scan_cache_dir(cache).repos} == {"org/chat", "org/tiny-tok"}

    manifest = _build(tmp_path, {"path": "org/chat"}, tokenizer="org/tiny-tok")
    assert manifest["accounting"]["chat"]["kept"] == 6  # the train split only
    assert _sample_ids(tmp_path)[0] == "chat:org/chat/data/train-00000-of-00001.jsonl:1"


def test_revision_picks_another_snapshot(tmp_path, cache):
    one = "".join(json.dumps(r) + "\n" for r in CHAT[:1]).encode()
    _cache_repo(cache, "datasets", "org/chat", {"train.jsonl": "".join(json.dumps(r) + "\n" for r in CHAT).encode()})
    commit = _cache_repo(cache, "datasets", "org/chat", {"v1/train.jsonl": one}, ref="v1")
    assert snapshot("org/chat", "datasets", "v1").name == commit
    assert _build(tmp_path, {"path": "org/chat", "revision": "v1"})["accounting"]["chat"]["kept"] == 1
    assert _build(tmp_path, {"path": "org/chat", "revision": commit})["accounting"]["chat"]["kept"] == 1
    assert _build(tmp_path, {"path": "org/chat"})["accounting"]["chat"]["kept"] == 6


def test_a_name_not_in_the_cache_is_one_line_saying_where_it_looked(tmp_path, cache):
    (cache / "datasets--org--chat" / "refs").mkdir(parents=True)
    for source, tokenizer, expected in [
        (
            {"path": "org/missing"},
            None,
            f"not in the local Hugging Face cache (looked for {cache}/datasets--org--missing",
        ),
        ({"path": "org/missing"}, None, "download it first: hf download --repo-type dataset org/missing)"),
        ({"path": "org/chat", "revision": "v9"}, None, "revision 'v9' is not in the local cache"),
        ({"path": "local.jsonl"}, "org/no-model", f"looked for {cache}/models--org--no-model"),
        ({"path": "local.jsonl"}, "org/no-model", "download it first: hf download org/no-model)"),
        # a deleted input whose path reads as ORG/NAME is a missing file, not a dataset to download
        ({"path": "data/gone.jsonl"}, None, "no file matches 'data/gone.jsonl' (relative to"),
        ({"path": "data/gone"}, None, "no file matches 'data/gone' (relative to"),
    ]:
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "local.jsonl").write_text(json.dumps(CHAT[0]) + "\n")
        result = CliRunner().invoke(main, ["build", str(_config_file(tmp_path, source, tokenizer))])
        assert result.exit_code == 1 and "Traceback" not in result.output
        (line,) = result.output.strip().splitlines()
        assert expected in line


def _token_rows(out: Path) -> list[tuple[str, list[int], list[int]]]:
    """(sample id, tokens, labels) of every segment, in id order: what a build trains, wherever it read it."""
    found = []
    for shard in read_manifest(out).shards:
        for row in pq.read_table(shard.file).to_pylist():
            bounds = row["cu_seqlens"]
            for k, sample_id in enumerate(row["sample_ids"]):
                span = slice(bounds[k], bounds[k + 1])
                found.append((sample_id, row["input_ids"][span], row["labels"][span]))
    return sorted(found)


def test_chat_with_tool_calls_saved_by_the_installed_datasets_builds_as_its_json_lines(tmp_path, cache):
    """datasets >= 4 stores messages whose keys differ (tool calls in some, not in others) as its Json feature,
    the `arrow.json` extension; every place it writes them builds to the tokens the JSON Lines give."""
    datasets = pytest.importorskip("datasets")
    lines = (QUICKSTART / "chat.jsonl").read_text().splitlines()[:200]
    records = [json.loads(line) for line in lines]
    assert any("tool_calls" in m for r in records for m in r["messages"])
    assert any(all("tool_calls" not in m for m in r["messages"]) for r in records)
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    loaded = datasets.load_dataset("json", data_files=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "hf"))
    loaded["train"].save_to_disk(str(tmp_path / "saved"))
    loaded["train"].to_parquet(str(tmp_path / "train.parquet"))
    _cache_repo(cache, "datasets", "org/chat", {"data/train.parquet": (tmp_path / "train.parquet").read_bytes()})
    (datasets_cache,) = (tmp_path / "hf").rglob("*-train.arrow")  # load_dataset's own cache file
    assert "Json" in str(loaded["train"].features["messages"])  # what made packtool reject every row

    def tokens(path: str) -> list:
        manifest = _build(tmp_path, {"path": path, "fields": {"id": "id"}}, capacity=2048)
        assert manifest["accounting"]["chat"]["read"] == 200 and manifest["rejects"]["count"] == 0
        return _token_rows(tmp_path / "out")

    expected = tokens("chat.jsonl")
    for path in ("saved", str(datasets_cache), "org/chat"):
        assert tokens(path) == expected, path
