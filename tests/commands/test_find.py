"""`packtool find` takes a sample id, a pack hash, a shard row or a source location to the packs and back to the
record, and says when the record changed since the build."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.cli import main
from packtool.commands.find import config_folder_from_tokenizer, find, folder_holding
from packtool.format import MANIFEST, read_manifest, write_manifest


def _find(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(main, ["find", *args])
    assert "Traceback" not in result.output
    assert result.exit_code == exit_code, result.output
    return result.output


def test_a_sample_id_goes_to_its_pack_and_back_to_its_line(quickstart_build):
    output = _find(str(quickstart_build), "qs-chat-00007")
    assert "qs-chat-00007 (sample id): 1 document(s)" in output
    assert "chat.jsonl:8 (source chat, sample qs-chat-00007): matches" in output  # id 00007 is the 8th line
    trace = json.loads(_find(str(quickstart_build), "qs-chat-00007", "--json"))
    [placement] = trace["placements"]
    back = json.loads(_find(str(quickstart_build), f"{placement['shard']}:{placement['row']}", "--json"))
    assert back["kind"] == "shard_row" and placement in back["placements"]
    by_hash = json.loads(_find(str(quickstart_build), placement["pack_hash"][:10], "--json"))
    assert by_hash["kind"] == "pack_hash" and placement in by_hash["placements"]
    by_location = json.loads(_find(str(quickstart_build), "quickstart/chat.jsonl:8", "--json"))
    assert by_location["kind"] == "location" and by_location["placements"] == [placement]
    assert by_location["origins"][0]["status"] == "matches"
    absolute = json.loads(_find(str(quickstart_build), f"{QUICKSTART / 'chat.jsonl'}:8", "--json"))
    assert absolute["placements"] == [placement]


def test_default_ids_round_trip(quickstart_build):
    """Alpaca rows have no id field: the default id (whatever its spelling) leads to a line and back."""
    import pyarrow.parquet as pq

    row = pq.read_table(quickstart_build / "shard-00000.parquet", columns=["sample_ids", "sources"]).to_pylist()
    sample_id = next(i for r in row for i, s in zip(r["sample_ids"], r["sources"]) if s == "instructions")
    trace = find(quickstart_build, sample_id)
    [placement] = trace.placements
    [origin] = trace.origins
    assert origin.status == "matches" and "alpaca.jsonl:" in origin.location
    assert find(quickstart_build, origin.location).placements == [placement]


def test_split_documents_are_named_as_pieces(quickstart_build):
    """Each piece of a split document names its number and where it starts in the document."""
    capacity = read_manifest(quickstart_build).capacity
    trace = find(quickstart_build, "qs-doc-0000")
    pieces = sorted(trace.placements, key=lambda p: p.piece_number)
    assert len(pieces) > 1
    assert [p.piece_number for p in pieces] == list(range(len(pieces)))  # every piece of this document trained
    assert [p.piece_offset for p in pieces] == [k * capacity for k in range(len(pieces))]
    assert [p.end - p.start for p in pieces[:-1]] == [capacity] * (len(pieces) - 1)
    assert pieces[1].piece == f"piece 1 from token {capacity} ({len(pieces)} pieces of it in this output)"
    assert len(trace.origins) == 1 and trace.origins[0].status == "matches"
    whole = find(quickstart_build, "qs-chat-00007").placements[0]
    assert whole.piece == "" and whole.piece_number == -1 and whole.piece_offset == 0
    text = _find(str(quickstart_build), "qs-doc-0000")
    assert f"piece 1 from token {capacity}" in text


def test_show_prints_the_document_like_inspect(quickstart_build):
    output = _find(str(quickstart_build), "qs-chat-00007", "--show", "--no-color")
    assert "── document" in output and "qs-chat-00007" in output
    assert any(line.endswith("*") for line in output.splitlines())
    report = json.loads(_find(str(quickstart_build), "qs-chat-00007", "--show", "--json"))
    [pack] = report["documents"]
    [document] = pack["documents"]
    assert document["sample_id"] == "qs-chat-00007" and len(document["tokens"]) == document["end"] - document["start"]


def test_a_changed_source_file_is_noticed(quickstart_build, tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(QUICKSTART, configs / "quickstart")
    shutil.copy(QUICKSTART.parent / "quickstart.yaml", configs / "quickstart.yaml")
    chat = configs / "quickstart" / "chat.jsonl"
    lines = chat.read_text().splitlines()
    record = json.loads(lines[7])
    record["messages"][-1]["content"] += " (edited)"
    lines[7] = json.dumps(record)
    chat.write_text("\n".join(lines) + "\n")
    config = str(configs / "quickstart.yaml")
    trace = json.loads(_find(str(quickstart_build), "qs-chat-00007", "--config", config, "--json"))
    assert trace["origins"][0]["status"] == "changed"
    assert "the file changed since the build" in trace["origins"][0]["detail"]
    trace = json.loads(_find(str(quickstart_build), "quickstart/chat.jsonl:8", "--config", config, "--json"))
    assert trace["placements"] == [] and trace["origins"][0]["status"] == "not_found"
    moved = [*lines[:2], lines[2], lines[2], *lines[3:]]  # every later record moves down a line
    chat.write_text("\n".join(moved) + "\n")
    trace = find(quickstart_build, "qs-chat-00005", config=config)
    assert trace.origins[0].status == "matches" and trace.origins[0].location.endswith("chat.jsonl:7")


def test_a_rejected_sample_is_found_with_its_reason(tmp_path, write_config, write_jsonl):
    data = write_jsonl(
        [
            {"id": "good", "text": "a plain document that trains"},
            {"id": "bad", "text": 5},
        ]
    )
    config = write_config(
        {
            "sources": [{"name": "t", "path": data.name, "format": "text", "fields": {"id": "id"}}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 64,
            "output": "out",
            "on_error": "skip",
        }
    )
    built = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert built.exit_code == 0, built.output
    out = tmp_path / "out"
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1
    output = _find(str(out), rejects[0]["id"])
    assert "0 document(s)" in output and f"not trained: {rejects[0]['id']}" in output
    # the config's folder is above OUT, where its relative source is: found without --config
    for config_given in ([], ["--config", str(config)]):
        by_location = json.loads(_find(str(out), f"{data}:2", "--json", *config_given))
        assert by_location["rejects"] == rejects and by_location["origins"][0]["status"] == "unreadable"
    assert find(out, "good", config=config).origins[0].status == "matches"


def test_a_rejected_record_is_not_said_to_be_in_the_output(tmp_path, write_config, write_jsonl):
    """A record the build rejected (too long), found by its location: it is the rejected one, in no shard; once
    another id is at that line, the file changed."""
    records = [{"id": "good", "text": "a plain document that trains"}, {"id": "long", "text": "word " * 80}]
    data = write_jsonl(records)
    config = write_config(
        {
            "sources": [{"name": "t", "path": data.name, "format": "text", "fields": {"id": "id"}}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 16,
            "truncation": {"strategy": "drop"},
            "output": "out",
            "on_error": "skip",
        }
    )
    built = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert built.exit_code == 0, built.output
    output = _find(str(tmp_path / "out"), f"{data}:2")
    assert "0 document(s)" in output and "not trained: long at data.jsonl:2: too_long" in output
    rejected = "matches: the record at this location now has the id the build rejected here (so it is in no shard)"
    assert rejected in output
    assert "one in the output" not in output
    write_jsonl([records[0], {**records[1], "id": "longer"}])
    trace = find(tmp_path / "out", f"{data}:2")
    assert [(o.status, o.detail) for o in trace.origins] == [
        (
            "changed",
            "the build rejected id 'long' here, the record at this location now has id 'longer': "
            "the file changed since the build",
        )
    ]


def test_a_config_of_absolute_paths_needs_no_folder(tmp_path, write_config, write_jsonl):
    """No relative path to anchor: find by location and by pack hash read the sources without --config."""
    data = write_jsonl([{"id": f"doc-{i}", "text": f"plain document number {i}"} for i in range(3)])
    config = write_config(
        {
            "sources": [{"name": "t", "path": str(data.resolve()), "format": "text", "fields": {"id": "id"}}],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 64,
            "output": str(tmp_path / "out"),
        }
    )
    built = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert built.exit_code == 0, built.output
    out = tmp_path / "out"
    by_location = json.loads(_find(str(out), f"{data}:2", "--json"))
    assert by_location["origins"][0]["status"] == "matches" and len(by_location["placements"]) == 1
    by_hash = _find(str(out), by_location["placements"][0]["pack_hash"][:12])
    assert "unknown" not in by_hash and "from ?" not in by_hash
    assert by_hash.count(": matches") == 3, by_hash


def test_relative_sources_beside_an_absolute_tokenizer_are_found_where_they_are(
    tmp_path, tmp_path_factory, write_config, write_jsonl, monkeypatch
):
    """An absolute tokenizer (or a hub id) tells nothing of the config's folder. Before, find then refused
    every FILE:LINE and printed "from ? ... unknown" once per document of a pack. Now, for an output whose
    manifest does not record the config's folder (an older build), the folder is the working one or one above
    OUT where the relative sources are; elsewhere one line says to pass --config."""
    data = write_jsonl([{"id": f"doc-{i}", "text": f"plain document number {i}"} for i in range(3)])
    beside = tmp_path_factory.mktemp("elsewhere") / "out"  # OUT not below the config's folder
    config = write_config(
        {
            "sources": [{"name": "t", "path": data.name, "format": "text", "fields": {"id": "id"}}],
            "tokenizer": str(QUICKSTART / "tokenizer" / "tokenizer.json"),
            "template": "model",
            "capacity": 64,
            "output": str(beside),
        }
    )
    built = CliRunner().invoke(main, ["build", str(config), "-q"])
    assert built.exit_code == 0, built.output
    _as_older_build(beside)
    pack = json.loads(_find(str(beside), "doc-1", "--json"))["placements"][0]["pack_hash"][:12]
    refused = _find(str(beside), pack)
    assert "from ?" not in refused and refused.count("not read: ") == 1, refused
    assert f"relative paths ({data.name!r}) start: they are not all in the working folder or a folder above " in refused
    assert "pass --config CONFIG" in _find(str(beside), f"{data}:2", exit_code=1)
    monkeypatch.chdir(tmp_path)  # where the user built it from
    for key in (f"{data.name}:2", f"{data}:2", pack):
        trace = json.loads(_find(str(beside), key, "--json"))
        assert trace["origins"] and {o["status"] for o in trace["origins"]} == {"matches"}, trace
    assert "from data.jsonl:2 (source t, sample doc-1): matches" in _find(str(beside), "doc-1")
    # OUT below the config's folder: found from any working folder
    inside = tmp_path / "out"
    assert CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(inside)]).exit_code == 0
    _as_older_build(inside)
    monkeypatch.chdir(tmp_path_factory.mktemp("anywhere"))
    assert json.loads(_find(str(inside), f"{data}:2", "--json"))["origins"][0]["status"] == "matches"


def _as_older_build(out: Path) -> None:
    """The manifest as a packtool that did not record `config_folder` wrote it (sealed again)."""
    raw = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    write_manifest(out, {k: v for k, v in raw.items() if k not in ("config_folder", "manifest_sha256")})


def test_the_recorded_config_folder_finds_relative_sources_from_anywhere(tmp_path, monkeypatch):
    """Relative sources, an absolute tokenizer (which tells nothing of the config's folder), OUT outside the
    config's folder tree and find run from a third folder: the manifest's config_folder is where the sources
    are, by its absolute path, and by its path relative to OUT once both folders moved together."""
    configs, out, anywhere = tmp_path / "a" / "configs", tmp_path / "b" / "out", tmp_path / "c"
    configs.mkdir(parents=True)
    anywhere.mkdir()
    rows = [{"id": f"doc-{i}", "text": f"plain document number {i}"} for i in range(3)]
    (configs / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    settings = {
        "sources": [{"name": "t", "path": "data.jsonl", "format": "text", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer" / "tokenizer.json"),
        "capacity": 64,
        "output": "../../b/out",
    }
    (configs / "config.yaml").write_text(json.dumps(settings), encoding="utf-8")
    built = CliRunner().invoke(main, ["build", str(configs / "config.yaml"), "-q"])
    assert built.exit_code == 0, built.output
    assert read_manifest(out).raw["config_folder"] == {"path": str(configs.resolve()), "relative": "../../a/configs"}
    monkeypatch.chdir(anywhere)
    by_location = json.loads(_find(str(out), f"{configs / 'data.jsonl'}:2", "--json"))
    assert [o["status"] for o in by_location["origins"]] == ["matches"] and len(by_location["placements"]) == 1
    pack = by_location["placements"][0]["pack_hash"][:12]
    assert _find(str(out), pack).count(": matches") == 3
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("a", "b"):
        shutil.move(tmp_path / name, moved / name)  # the recorded absolute path is gone; the relative one holds
    assert _find(str(moved / "b" / "out"), pack).count(": matches") == 3
    assert "matches" in _find(str(moved / "b" / "out"), f"{moved / 'a' / 'configs' / 'data.jsonl'}:2")


def test_the_recorded_config_folder_anchors_the_eval_sets_too(tmp_path, monkeypatch):
    """Absolute sources, a relative eval set, OUT moved away from its config (its recorded relative folder, `..`,
    now a folder without the eval set) and find run from a third folder: the config parses in the recorded
    absolute folder, where the eval set is, so the sources are read (they were `not read`: no file matches)."""
    configs, moved, anywhere = tmp_path / "a" / "configs", tmp_path / "d", tmp_path / "c"
    (configs / "evals").mkdir(parents=True)
    moved.mkdir()
    anywhere.mkdir()
    words = [" ".join(f"w{i}x{j}" for j in range(20)) for i in range(3)]
    rows = [{"id": f"doc-{i}", "text": text} for i, text in enumerate(words)]
    (configs / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    evals = [{"id": "ev-a", "question": "q", "answer": words[1]}]
    (configs / "evals" / "eval.jsonl").write_text(json.dumps(evals[0]) + "\n", encoding="utf-8")
    settings = {
        "sources": [{"name": "t", "path": str(configs / "data.jsonl"), "format": "text", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer" / "tokenizer.json"),
        "capacity": 64,
        "decontamination": {"against": ["evals/eval.jsonl"], "ngram": 8},
        "output": "out",
    }
    (configs / "config.yaml").write_text(json.dumps(settings), encoding="utf-8")
    built = CliRunner().invoke(main, ["build", str(configs / "config.yaml"), "-q"])
    assert built.exit_code == 0, built.output
    shutil.move(configs / "out", moved / "out")
    monkeypatch.chdir(anywhere)
    assert "doc-0 (sample id): 1 document(s)" in (trained := _find(str(moved / "out"), "doc-0"))
    assert "data.jsonl:1 (source t, sample doc-0): matches" in trained and "not read" not in trained
    contaminated = _find(str(moved / "out"), f"{configs / 'data.jsonl'}:2")  # the eval file named as the config does
    assert "contaminated (target overlaps eval evals/eval.jsonl:1 (id ev-a)" in contaminated
    assert "data.jsonl:2 (source t, sample doc-1): matches: the record at this location now has the id" in contaminated
    # the eval file deleted since: the recorded folder is named with what it lacks, not only "cannot tell"
    (configs / "evals" / "eval.jsonl").unlink()
    lost = _find(str(moved / "out"), f"{configs / 'data.jsonl'}:2", exit_code=1)
    assert f"('evals/eval.jsonl': no such file in {moved} or {configs} now; moved or deleted?)" in lost
    assert "pass --config CONFIG" in lost


def test_a_config_of_hub_ids_is_read_from_the_cache_wherever_it_was(tmp_path, tmp_path_factory, monkeypatch):
    """A dataset and a tokenizer named ORG/NAME are relative paths no folder holds: the hub cache does."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for kind, repo, files in (
        ("datasets", "org--docs", {"train.jsonl": "".join(f'{{"text": "document {i}"}}\n' for i in range(3))}),
        ("models", "org--tok", {n: (QUICKSTART / "tokenizer" / n).read_text() for n in ("tokenizer.json",)}),
    ):
        (cache / f"{kind}--{repo}" / "refs").mkdir(parents=True)
        (cache / f"{kind}--{repo}" / "refs" / "main").write_text("0" * 40)
        for name, text in files.items():
            (cache / f"{kind}--{repo}" / "snapshots" / ("0" * 40) / name).parent.mkdir(parents=True, exist_ok=True)
            (cache / f"{kind}--{repo}" / "snapshots" / ("0" * 40) / name).write_text(text)
    config = tmp_path / "config.yaml"
    config.write_text("sources: [{name: t, path: org/docs, format: text}]\ntokenizer: org/tok\ncapacity: 64\n")
    out = tmp_path_factory.mktemp("elsewhere") / "out"
    built = CliRunner().invoke(main, ["build", str(config), "-q", "-o", str(out)])
    assert built.exit_code == 0, built.output
    monkeypatch.chdir(tmp_path_factory.mktemp("anywhere"))
    trace = json.loads(_find(str(out), "t:org/docs/train.jsonl:2", "--json"))
    assert [o["status"] for o in trace["origins"]] == ["matches"], trace


def test_a_config_folder_is_where_every_relative_source_is(tmp_path):
    (tmp_path / "a" / "data").mkdir(parents=True)
    (tmp_path / "a" / "data" / "x.jsonl").write_text("{}")
    (tmp_path / "b" / "data").mkdir(parents=True)
    (tmp_path / "b" / "data" / "y.jsonl").write_text("{}")
    candidates = [tmp_path / "b", tmp_path / "a", tmp_path]
    assert folder_holding(["data/x.jsonl"], candidates) == tmp_path / "a"
    assert folder_holding(["data/*.jsonl"], candidates) == tmp_path / "b"
    assert folder_holding(["data/x.jsonl", "data/y.jsonl"], candidates) is None  # never split over two folders
    assert folder_holding(["a/data/x.jsonl", "nobody/no-such-dataset"], candidates) is None  # not in the hub cache


def test_unknown_keys_are_one_line(quickstart_build):
    output = _find(str(quickstart_build), "no-such-sample", exit_code=1)
    assert output.count("\n") == 1 and "is no sample id, pack_hash prefix" in output
    assert "no shard shard-00009.parquet in this output" in _find(
        str(quickstart_build), "shard-00009.parquet:0", exit_code=1
    )
    assert "no pack at shard-00000.parquet row 9999" in _find(
        str(quickstart_build), "shard-00000.parquet:9999", exit_code=1
    )
    assert "names no record" in _find(str(quickstart_build), "quickstart/chat.jsonl:99999", exit_code=1)


@pytest.mark.parametrize(
    ("named", "file", "expected"),
    [
        ("quickstart/tokenizer", "/a/configs/quickstart/tokenizer/tokenizer.json", "/a/configs"),
        ("tok/tokenizer.json", "/b/tok/tokenizer.json", "/b"),
        ("../tok", "/b/tok/tokenizer.json", None),
        ("/abs/tok", "/abs/tok/tokenizer.json", None),
        ("other", "/b/tok/tokenizer.json", None),
        ("quickstart/tokenizer", "../../configs/quickstart/tokenizer/tokenizer.json", "/a/configs"),  # from /a/out/qs
    ],
)
def test_config_folder_from_the_tokenizer(named, file, expected):
    manifest = {"config": {"tokenizer": named}, "tokenizer": {"file": file}}
    assert config_folder_from_tokenizer(manifest, Path("/a/out/qs")) == (Path(expected) if expected else None)


def test_the_manifest_names_the_tokenizer_relative_to_its_folder(quickstart_build):
    """docs/format.md: the tokenizer is named relative to OUT, not by a machine path (it held the absolute path)."""
    manifest = read_manifest(quickstart_build)
    file = Path(manifest.tokenizer_file or "")
    assert not file.is_absolute()
    assert (quickstart_build / file).resolve() == (QUICKSTART / "tokenizer" / "tokenizer.json").resolve()
    assert config_folder_from_tokenizer(manifest.raw, quickstart_build) == QUICKSTART.parent


def test_documents_in_the_overflow_bucket_are_found(tmp_path):
    import yaml

    config = yaml.safe_load((QUICKSTART.parent / "quickstart.yaml").read_text())
    for source in config["sources"]:
        source["path"] = str(QUICKSTART.parent / source["path"])
        source.pop("truncation", None)
    config.update(tokenizer=str(QUICKSTART / "tokenizer"), capacity=256, overflow={"mode": "bucket", "capacity": 4096})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["build", str(tmp_path / "c.yaml"), "-o", str(out), "-q"]).exit_code == 0
    trace = find(out, "qs-doc-0000", config=tmp_path / "c.yaml")  # 1000+ tokens: too long for 256, in the bucket
    [placement] = trace.placements
    assert placement.shard == "overflow/shard-00000.parquet"
    back = find(out, f"{placement.shard}:{placement.row}", config=tmp_path / "c.yaml")
    assert back.kind == "shard_row" and placement in back.placements
    assert trace.origins[0].status == "matches"


def test_a_record_read_by_two_sources_is_a_duplicate_not_pieces(tmp_path):
    """Before: a v1 output named the two copies "one of 2 pieces (split)", as if the sample had been cut."""
    rows = (QUICKSTART / "chat.jsonl").read_text().splitlines()[:3]
    (tmp_path / "chat.jsonl").write_text("\n".join(rows) + "\n")
    config = tmp_path / "twice.yaml"
    config.write_text(
        "sources:\n"
        + "".join(f"  - {{name: {name}, path: chat.jsonl, format: messages, fields: {{id: id}}}}\n" for name in "ab")
        + f"tokenizer: {QUICKSTART / 'tokenizer'}\ntemplate: model\ncapacity: 1024\n"
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(config), "-o", str(out), "-q", "--no-cache"])
    assert result.exit_code == 0, result.output
    sample_id = json.loads(rows[0])["id"]
    output = _find(str(out), sample_id)
    assert "pieces (split)" not in output
    assert "(source a, " in output and "the same record also in source b (a duplicate, not a piece)" in output
    assert "(source b, " in output and "the same record also in source a (a duplicate, not a piece)" in output
