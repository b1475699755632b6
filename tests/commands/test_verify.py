"""`packtool verify` passes a real build and names the shard, row, field or file that a damaged or edited one breaks,
always as a report (exit 1), never a traceback."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from packtool.cli import main
from packtool.commands.verify import row_problems, verify
from packtool.format import pack_hash, read_manifest
from packtool.labels import IGNORE_INDEX
from packtool.seal import SEAL, manifest_digest, seal_manifest


@pytest.fixture(scope="module")
def sealed(quickstart_build, tmp_path_factory) -> Path:
    """The quickstart output with its manifest sealed as the builder seals it."""
    out = tmp_path_factory.mktemp("sealed") / "out"
    shutil.copytree(quickstart_build, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(seal_manifest(manifest), indent=2))
    return out


def _copy(sealed: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(sealed, copy)
    return copy


def _edit_manifest(folder: Path, change, *, reseal: bool) -> None:
    """Change the manifest; `reseal` mimics an edit that also redoes the seal, so only recomputation can catch it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    if reseal:
        manifest = seal_manifest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _verify(path: Path, *args: str):
    result = CliRunner().invoke(main, ["verify", str(path), *args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_a_fresh_build_verifies(quickstart_build, sealed):
    result = _verify(sealed)
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "warning" not in result.output
    assert verify(sealed).packs == read_manifest(sealed).raw["stats"]["packs"]
    unsealed = _verify(quickstart_build)  # before the builder seals: OK, with a warning saying what is not covered
    assert unsealed.exit_code == 0 and "OK" in unsealed.output


def test_the_seal_is_canonical():
    manifest = {"b": [1, 2.5, "é"], "a": {"y": None, "x": True}}
    sealed = seal_manifest(manifest)
    assert sealed[SEAL] == manifest_digest(json.loads(json.dumps(sealed, indent=3)))
    assert seal_manifest({**manifest, "a": {"y": None, "x": False}})[SEAL] != sealed[SEAL]


def test_json_output(sealed, tmp_path):
    report = json.loads(_verify(sealed, "--json").output)
    assert report["ok"] is True and report["shards"] == 3 and report["problems"] == []
    copy = _copy(sealed, tmp_path)
    _edit_manifest(copy, lambda m: m.update(seed=1), reseal=False)
    result = _verify(copy, "--json")
    assert result.exit_code == 1
    assert json.loads(result.output)["ok"] is False


def test_64_single_byte_flips_are_reported_not_raised(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    shard = copy / "shard-00002.parquet"
    original = shard.read_bytes()
    rng = random.Random(0)
    for _ in range(64):
        position = rng.randrange(len(original))
        damaged = bytearray(original)
        damaged[position] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(damaged))
        result = verify(shard)
        assert not result.ok, position
        assert any("shard-00002.parquet" in p for p in result.problems)
    shard.write_bytes(original)
    assert verify(shard).ok


def test_truncated_and_deleted_shards(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    shard = copy / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = _verify(copy)
    assert result.exit_code == 1
    assert "shard-00001.parquet: " in result.output and "(truncated or changed)" in result.output
    assert "cannot be read as Parquet" in result.output
    shard.unlink()
    result = _verify(copy)
    assert result.exit_code == 1
    assert "shard-00001.parquet: listed in the manifest but missing" in result.output


def test_invalid_manifest_json_and_wrong_types(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    manifest_path = copy / "manifest.json"
    manifest_path.write_text('{"capacity": 1024, "shards": [')
    result = _verify(copy)
    assert result.exit_code == 1 and "not valid JSON" in result.output
    manifest_path.write_text("[1, 2]")
    assert "must be a JSON object, got list" in _verify(copy).output
    good = json.loads((sealed / "manifest.json").read_text())
    for change, expected in [
        (lambda m: m.update(capacity="1024"), "'capacity' must be a positive integer"),
        (lambda m: m.update(shards={"file": "x"}), "'shards' must be a list"),
        (lambda m: m["shards"][0].update(rows="200"), "shards[0].rows must be a count"),
        (lambda m: m["shards"][1].update(sha256=None), "shards[1].sha256 must be a string"),
        (lambda m: m["accounting"]["chat"].update(kept=-1), "accounting.chat.kept must be a count"),
        (lambda m: m["accounting"]["chat"].update(rejected=[]), "accounting.chat.rejected must map reasons"),
        (lambda m: m.update(rejects="rejects.jsonl"), "'rejects' must be"),
        (lambda m: m.update(stats=3), "'stats' must be an object"),
    ]:
        manifest = json.loads(json.dumps(good))
        change(manifest)
        manifest_path.write_text(json.dumps(manifest))
        result = _verify(copy)
        assert result.exit_code == 1 and expected in result.output, (expected, result.output)


@pytest.mark.parametrize("name", ["/etc/passwd", "../shard-00000.parquet", "sub/shard-00000.parquet", ".."])
def test_paths_are_confined_to_the_folder(sealed, tmp_path, name):
    copy = _copy(sealed, tmp_path)
    _edit_manifest(copy, lambda m: m["shards"][0].update(file=name), reseal=True)
    result = _verify(copy)
    assert result.exit_code == 1
    assert "is not a file name inside the output folder" in result.output
    _edit_manifest(copy, lambda m: m["rejects"].update(file=name), reseal=True)
    assert "'rejects' must be" in _verify(copy).output


def test_unlisted_extra_and_removed_entries(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    shutil.copy(copy / "shard-00000.parquet", copy / "shard-00007.parquet")
    result = _verify(copy)
    assert result.exit_code == 1
    assert "shard-00007.parquet: present in" in result.output and "not listed in the manifest" in result.output
    (copy / "shard-00007.parquet").unlink()
    _edit_manifest(copy, lambda m: m["shards"].pop(), reseal=True)
    result = _verify(copy)
    assert "shard-00002.parquet: present in" in result.output
    assert "stats.packs" in result.output  # the stats block still counts the removed shard's packs


def _set(path: list, value):
    def change(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]])

    return change


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_set(["shards", 0, "rows"], lambda v: v + 1), "shard-00000.parquet: the manifest says rows 201, the shard"),
        (_set(["shards", 1, "tokens"], lambda v: v - 7), "the manifest says tokens"),
        (_set(["shards", 2, "targets"], lambda v: v + 1), "the manifest says targets"),
        (_set(["shards", 2, "bytes"], lambda v: v + 1), "bytes, the manifest says"),
        (_set(["shards", 0, "sha256"], lambda v: "0" * 64), "sha256 differs from the manifest"),
        (_set(["accounting", "chat", "read"], lambda v: v + 5), "read 1305 != kept + rejected + dropped 1300"),
        (_set(["accounting", "docs", "segments"], lambda v: v + 1), "segments 161, the shards hold 160"),
        (_set(["accounting", "docs", "kept"], lambda v: v - 10), "kept 140, but the shards hold 150 distinct"),
        (_set(["accounting", "chat", "rejected"], lambda v: {"bad_record": 2}), "rejected + dropped 2"),
        (_set(["rejects", "count"], lambda v: 3), "0 records, the manifest says rejects.count 3"),
        (_set(["stats", "tokens"], lambda v: v + 1), "stats.tokens is"),
        (_set(["stats", "sources", "chat", "targets"], lambda v: v + 1), "stats.sources is"),
    ],
)
def test_recomputable_edits_are_caught_even_when_resealed(sealed, tmp_path, change, expected):
    copy = _copy(sealed, tmp_path)
    _edit_manifest(copy, change, reseal=True)
    result = _verify(copy)
    assert result.exit_code == 1
    assert expected in result.output, result.output


@pytest.mark.parametrize(
    "change",
    [
        _set(["capacity"], lambda v: v * 2),
        _set(["seed"], lambda v: v + 1),
        _set(["conventions", "positions"], lambda v: "continuous"),
        _set(["config", "seed"], lambda v: 3),
        lambda m: m["accounting"]["chat"].update(read=m["accounting"]["chat"]["read"] + 5, kept=1305),
    ],
)
def test_edits_only_the_seal_can_see_are_caught(sealed, tmp_path, change):
    copy = _copy(sealed, tmp_path)
    _edit_manifest(copy, change, reseal=False)
    result = _verify(copy)
    assert result.exit_code == 1
    assert "manifest_sha256 does not match the manifest's content" in result.output


def test_rejects_file_must_match(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    line = {"id": "x", "source": "chat", "location": "chat.jsonl:1", "reason": "bad_record", "detail": "d"}
    (copy / "rejects.jsonl").write_text(json.dumps(line) + "\n")
    result = _verify(copy)
    assert "1 records, the manifest says rejects.count 0" in result.output
    assert "rejected + dropped 0, rejects.jsonl holds 1 records of it" in result.output
    (copy / "rejects.jsonl").write_text("{not json\n")
    assert "rejects.jsonl:1: not a reject record" in _verify(copy).output


def test_a_lone_shard_is_checked_against_its_folder(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    assert _verify(copy / "shard-00001.parquet").exit_code == 0
    _edit_manifest(copy, _set(["shards", 1, "rows"], lambda v: v + 1), reseal=True)
    assert "the manifest says rows 201" in _verify(copy / "shard-00001.parquet").output
    (copy / "manifest.json").unlink()  # an unfinished build: shards written, manifest not yet
    result = _verify(copy / "shard-00001.parquet")
    assert result.exit_code == 1
    assert f"shard-00001.parquet: no manifest.json beside it in {copy.resolve()}: an unfinished build" in result.output
    # named from its own folder, the report names the shard, not "."
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(copy)
        lonely = _verify(Path("shard-00001.parquet")).output
    assert lonely.startswith("shard-00001.parquet: 0 shard(s), 0 pack(s) checked: 1 problem(s)"), lonely
    stray = tmp_path / "stray.parquet"
    shutil.copy(sealed / "shard-00000.parquet", stray)
    shutil.copy(sealed / "manifest.json", tmp_path / "manifest.json")
    assert "stray.parquet: not listed in" in _verify(stray).output


def test_a_label_moved_across_a_boundary_is_caught(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    shard = copy / "shard-00000.parquet"
    rows = pq.read_table(shard).to_pylist()
    start = rows[3]["cu_seqlens"][1]  # the next segment's first token becomes a target: the EOS -> next sample pair
    rows[3]["labels"][start] = rows[3]["input_ids"][start]
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(shard)), shard)
    result = _verify(copy)
    assert result.exit_code == 1
    assert "shard-00000.parquet: " in result.output and "(truncated or changed)" in result.output
    assert "shard-00000.parquet row 3: a segment start carries a label" in result.output
    assert "pack_hash is" in result.output


def test_row_problems_on_hand_made_rows():
    good = {
        "input_ids": [5, 6, 2, 7, 2],
        "labels": [IGNORE_INDEX, 6, 2, IGNORE_INDEX, 2],
        "cu_seqlens": [0, 3, 5],
        "doc_cu_seqlens": [0, 3, 5],
        "token_roles": [3, 3, 3, 3, 3],
        "sample_ids": ["a", "b"],
        "sample_hashes": ["x", "y"],
        "sample_repeats": [0, 0],
        "sources": ["s", "s"],
        "n_tokens": 5,
        "n_targets": 3,
        "attn_cost": 13,
    }
    good["pack_hash"] = pack_hash(good["input_ids"], good["labels"], good["cu_seqlens"])
    assert row_problems(good, capacity=8) == []
    assert row_problems(good, capacity=4) == ["5 tokens > capacity 4"]
    shifted = {**good, "labels": [6, 2, IGNORE_INDEX, 2, IGNORE_INDEX]}
    assert any("differs from its token" in p for p in row_problems(shifted, capacity=8))
    broken = {**good, "cu_seqlens": [0, 3, 3, 5]}
    assert row_problems(broken, capacity=8)[0].startswith("cu_seqlens")
    assert row_problems({**good, "sources": ["s", None]}, capacity=8)[0].startswith("null values in sources")
    short = {**good, "token_roles": [3, 3, 3]}  # every per-token column (format.TOKEN_COLUMNS) is as long as input_ids
    assert row_problems(short, capacity=8) == ["5 labels and 3 token_roles for 5 tokens"]


def test_the_overflow_bucket_is_verified_with_the_output(tmp_path):
    import yaml
    from support import QUICKSTART

    config = yaml.safe_load((QUICKSTART.parent / "quickstart.yaml").read_text())
    for source in config["sources"]:
        source["path"] = str(QUICKSTART.parent / source["path"])
        source.pop("truncation", None)
    config.update(tokenizer=str(QUICKSTART / "tokenizer"), capacity=256, overflow={"mode": "bucket", "capacity": 4096})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    build = CliRunner().invoke(main, ["build", str(tmp_path / "c.yaml"), "-o", str(out), "-q"])
    assert build.exit_code == 0, build.output
    assert (out / "overflow" / "manifest.json").is_file()
    assert _verify(out).exit_code == 0
    bucket_shard = out / "overflow" / "shard-00000.parquet"
    bucket_shard.write_bytes(bucket_shard.read_bytes()[:-100])
    result = _verify(out)
    assert result.exit_code == 1 and "(truncated or changed)" in result.output
    bucket_shard.unlink()
    result = _verify(out)
    assert "listed in the manifest but missing" in result.output


def test_a_validation_split_is_verified_as_its_own_output(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    shutil.copytree(sealed, copy / "validation")
    _edit_manifest(copy, lambda m: m.update(validation={"folder": "validation", "packs": 1}), reseal=True)
    assert _verify(copy).exit_code == 0  # its documents do not count against the main accounting
    (copy / "validation" / "shard-00001.parquet").unlink()
    result = _verify(copy)
    assert result.exit_code == 1 and "shard-00001.parquet: listed in the manifest but missing" in result.output
    _edit_manifest(copy, lambda m: m.update(validation={"folder": "../elsewhere"}), reseal=True)
    assert "validation.folder '../elsewhere' is not a folder name inside the output" in _verify(copy).output


def test_64_single_byte_flips_of_the_manifest_are_reported_not_raised(sealed, tmp_path):
    copy = _copy(sealed, tmp_path)
    path = copy / "manifest.json"
    original = path.read_bytes()
    rng = random.Random(1)
    for _ in range(64):
        damaged = bytearray(original)
        damaged[rng.randrange(len(original))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        result = verify(copy)  # any exception fails the test
        assert not result.ok
    manifest = json.loads(original)
    manifest["shards"].append(dict(manifest["shards"][0]))
    path.write_text(json.dumps(manifest))
    assert "shards lists 'shard-00000.parquet' more than once" in _verify(copy).output


def test_row_problems_on_hand_made_v2_piece_columns():
    v2 = {
        "input_ids": [5, 6, 2, 7, 2],
        "labels": [IGNORE_INDEX, 6, 2, IGNORE_INDEX, 2],
        "cu_seqlens": [0, 3, 5],
        "doc_cu_seqlens": [0, 3, 5],
        "token_roles": [3, 3, 3, 3, 3],
        "sample_ids": ["a", "b"],
        "sample_hashes": ["x", "y"],
        "sample_repeats": [0, 0],
        "sources": ["s", "s"],
        "n_tokens": 5,
        "n_targets": 3,
        "attn_cost": 13,
        "segment_groups": [-1, -1],
        "segment_kinds": [0, 0],
        "completion_index": [-1, -1],
        "segment_rewards": [float("nan")] * 2,
        "segment_advantages": [float("nan")] * 2,
        "segment_pieces": [-1, 3],  # a whole sample, then piece 3 of a split one
        "segment_piece_offsets": [0, 6144],
    }
    v2["pack_hash"] = pack_hash(v2["input_ids"], v2["labels"], v2["cu_seqlens"])
    assert row_problems(v2, capacity=8) == []
    for broken in (
        {"segment_pieces": [-1]},
        {"segment_pieces": [-2, 3]},
        {"segment_piece_offsets": [5, 6144]},
        {"segment_piece_offsets": [0, -1]},
    ):
        problems = row_problems({**v2, **broken}, capacity=8)
        assert len(problems) == 1 and "segment_piece" in problems[0], (broken, problems)


def test_a_record_the_input_holds_twice_under_one_id_is_a_warning_not_a_problem(tmp_path):
    """Only an id made from the row's location proves one row trained twice (tests/builder/test_append.py);
    a record given twice with its own id is the input's, and dedup: exact is the choice that drops it."""
    from support import QUICKSTART

    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    lines = [
        {"id": "q1", "messages": messages},
        {"id": "q2", "messages": [*messages[:1], messages[1] | {"content": "5"}]},
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in [*lines, lines[0]]))
    source = {"name": "chat", "path": "a.jsonl", "format": "messages", "fields": {"messages": "messages", "id": "id"}}
    config = {"sources": [source], "capacity": 64}
    (tmp_path / "c.json").write_text(json.dumps({**config, "tokenizer": str(QUICKSTART / "tokenizer")}))
    built = CliRunner().invoke(main, ["build", str(tmp_path / "c.json"), "-o", str(tmp_path / "out"), "-q"])
    assert built.exit_code == 0, built.output
    result = _verify(tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "1 sample copies appear twice under one id and content: the input holds those records twice" in result.output
