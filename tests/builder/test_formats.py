"""What newcomers from TRL, axolotl and LLaMA-Factory reach for: prompt-completion records, a default system
prompt, exact de-duplication, and a failed build that shows its rejects."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.builder import build, failed_rejects_path
from packtool.builder.cache import source_settings
from packtool.builder.plan import plan_settings
from packtool.cli import main
from packtool.commands.verify import verify
from packtool.config import load_config
from packtool.encode import load_tokenizer
from packtool.format import read_manifest
from packtool.labels import IGNORE_INDEX

pytestmark = pytest.mark.timeout(300)


def _chat(i: int, prefix: str = "") -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"{prefix}question {i}?"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }


def _raw(*sources: dict, **extra) -> dict:
    return {
        "sources": list(sources),
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        "workers": 1,
        **extra,
    }


def _segments(out: Path) -> dict[str, tuple[str, str]]:
    """sample id -> (its text, its trained text), decoded from the shards."""
    tokenizer = load_tokenizer(load_config(out.parent / "config.yaml").tokenizer).tokenizer
    found = {}
    for shard in read_manifest(out).shards:
        for row in pq.read_table(shard.file).to_pylist():
            bounds = row["cu_seqlens"]
            for k, sample_id in enumerate(row["sample_ids"]):
                ids = row["input_ids"][bounds[k] : bounds[k + 1]]
                labels = row["labels"][bounds[k] : bounds[k + 1]]
                trained = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
                found[sample_id] = (
                    tokenizer.decode(ids, skip_special_tokens=False),
                    tokenizer.decode(trained, skip_special_tokens=False),
                )
    return found


def test_prompt_completion_trains_only_the_completion(tmp_path, write_config, write_jsonl):
    write_jsonl(
        [
            {"id": "s", "prompt": "The sky is", "completion": " blue."},
            {
                "id": "m",
                "prompt": [{"role": "system", "content": "Terse."}, {"role": "user", "content": "2+2?"}],
                "completion": [{"role": "assistant", "content": "4"}],
            },
            {
                "id": "n",
                "prompt": [{"role": "user", "content": "3+3?"}],
                "completion": [{"role": "assistant", "content": "6"}],
            },
        ]
    )
    # the prompt and the default system prompt stay context even when the policy trains every role
    source = {"name": "pc", "path": "data.jsonl", "format": "prompt_completion", "fields": {"id": "id"}}
    train = {"roles": ["system", "user", "assistant"]}
    build(load_config(write_config({**_raw({**source, "train": train, "system": "Default."})})))
    segments = _segments(tmp_path / "out")
    assert segments["s"] == ("The sky is blue.<|im_end|>", " blue.<|im_end|>")  # as format: text ends: with EOS
    text, trained = segments["m"]
    assert text.startswith("<|im_start|>system\nTerse.<|im_end|>") and trained == "4<|im_end|>"
    text, trained = segments["n"]
    assert text.startswith("<|im_start|>system\nDefault.<|im_end|>") and trained == "6<|im_end|>"


def test_a_default_system_prompt_is_applied_counted_in_the_config_and_keys_the_cache(
    tmp_path, write_config, write_jsonl
):
    write_jsonl([_chat(0), {"messages": [{"role": "system", "content": "Own."}, *_chat(1)["messages"]]}])
    source = {"name": "chat", "path": "data.jsonl", "format": "messages"}
    first = build(load_config(write_config(_raw({**source, "system": "Be brief."}))))
    texts = [text for text, _ in _segments(tmp_path / "out").values()]
    assert sorted(t.split("<|im_end|>")[0] for t in texts) == [
        "<|im_start|>system\nBe brief.",
        "<|im_start|>system\nOwn.",
    ]
    assert first.manifest["config"]["sources"][0]["system"] == "Be brief."
    kind = load_config(write_config(_raw({**source, "system": "Be kind."})))
    assert source_settings(kind.sources[0], kind)["source"]["system"] == "Be kind."
    assert build(kind).encode_reused == 0  # a changed system prompt re-encodes


@pytest.mark.parametrize("scope", ["source", "all"])
def test_exact_dedup_keeps_the_first_in_source_order_and_counts_the_rest(tmp_path, write_config, write_jsonl, scope):
    # a0 == a2 within source a; b0 repeats a1 under another id (the id is not content)
    write_jsonl([{"id": "a0", **_chat(0)}, {"id": "a1", **_chat(1)}, {"id": "a2", **_chat(0)}], "a.jsonl")
    write_jsonl([{"id": "b0", **_chat(1)}, {"id": "b1", **_chat(2)}], "b.jsonl")
    sources = [
        {"name": name, "path": f"{name}.jsonl", "format": "messages", "fields": {"id": "id"}} for name in ("a", "b")
    ]
    if scope == "source":
        for s in sources:
            s["dedup"] = "exact"
        raw = _raw(*sources)
    else:
        raw = _raw(*sources, dedup="exact")
    built = build(load_config(write_config(raw)))
    accounting = built.manifest["accounting"]
    assert accounting["a"]["dropped"] == {"duplicate": 1} and accounting["a"]["kept"] == 2
    assert accounting["b"]["dropped"] == ({"duplicate": 1} if scope == "all" else {})
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    expected = [("a2", "a0")] + ([("b0", "a1")] if scope == "all" else [])
    assert [(r["id"], r["duplicate_of"]) for r in rejects] == expected
    assert all(r["reason"] == "duplicate" and r["detail"].startswith("same tokens") for r in rejects)
    assert sorted(_segments(tmp_path / "out")) == sorted({"a0", "a1", "b1"} | ({"b0"} if scope == "source" else set()))
    assert verify(tmp_path / "out").ok  # read == kept + rejected + dropped, rejects.jsonl agrees
    assert "dropped.duplicate=1" in CliRunner().invoke(main, ["stats", str(tmp_path / "out")]).output


def test_dedup_is_a_plan_setting_that_reencodes_nothing(tmp_path, write_config, write_jsonl):
    write_jsonl([_chat(0), _chat(0)])
    source = {"name": "chat", "path": "data.jsonl", "format": "messages"}
    plain = load_config(write_config(_raw(source)))
    build(plain)
    deduped = load_config(write_config(_raw({**source, "dedup": "exact"})))
    assert plan_settings(deduped) != plan_settings(plain)
    assert plan_settings(load_config(write_config(_raw(source, dedup="exact")))) != plan_settings(plain)
    assert source_settings(deduped.sources[0], deduped) == source_settings(plain.sources[0], plain)
    again = build(deduped)
    assert again.encode_reused == again.encode_items and again.manifest["accounting"]["chat"]["kept"] == 1


def test_a_build_failing_on_rejects_names_the_first_three_and_keeps_them_all(tmp_path, write_config, write_jsonl):
    write_jsonl([_chat(0), *[{"messages": [{"role": "robot", "content": "x"}]}] * 5])
    raw = _raw({"name": "chat", "path": "data.jsonl", "format": "messages"}, on_error="skip")
    result = CliRunner().invoke(main, ["build", str(write_config(raw)), "-q"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "source 'chat' lost 5 of 6 records" in result.output
    for line in (2, 3, 4):
        assert f"data.jsonl:{line}: [bad_record] field 'messages[0].role': unknown role 'robot'" in result.output
    assert "data.jsonl:5:" not in result.output and "... 2 more" in result.output
    path = failed_rejects_path(tmp_path / "out")
    assert str(path) in result.output and not (tmp_path / "out").exists()
    assert len(path.read_text().splitlines()) == 5
    # the next build that passes this check removes the stale file
    write_jsonl([_chat(0)])
    assert CliRunner().invoke(main, ["build", str(write_config(raw)), "-q"]).exit_code == 0
    assert not path.exists()


def test_string_prompt_completion_needs_no_chat_template(tmp_path, write_config, write_jsonl):
    """A base model's tokenizer has no chat_template; TRL trains its string prompt-completion data all the same."""
    tokenizer = tmp_path / "base"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_bytes((QUICKSTART / "tokenizer" / "tokenizer.json").read_bytes())
    settings = json.loads((QUICKSTART / "tokenizer" / "tokenizer_config.json").read_text())
    settings.pop("chat_template")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    chat = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}
    write_jsonl([{"prompt": "Once", "completion": " upon a time"}, chat])
    raw = _raw({"name": "pc", "path": "data.jsonl", "format": "prompt_completion"}, on_error="skip")
    built = build(load_config(write_config({**raw, "tokenizer": str(tokenizer)})))
    assert built.manifest["accounting"]["pc"]["kept"] == 1
    assert built.manifest["accounting"]["pc"]["rejected"] == {"template_error": 1}
    ((text, trained),) = _segments(tmp_path / "out").values()
    assert trained == " upon a time" + settings["eos_token"] and text == "Once" + trained


def test_a_repeated_pair_is_dropped_whole(tmp_path, write_config, write_jsonl):
    def pair(i: int) -> dict:
        return {
            "prompt": [{"role": "user", "content": f"question {i}?"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        }

    write_jsonl([pair(0), pair(1), pair(0)])
    source = {"name": "pairs", "path": "data.jsonl", "format": "preference", "dedup": "exact"}
    accounting = build(load_config(write_config(_raw(source)))).manifest["accounting"]["pairs"]
    assert accounting["kept"] == 2 and accounting["dropped"] == {"duplicate": 1}
    assert accounting["segments"] == 4  # both sides of each kept pair, none of the repeat
    assert verify(tmp_path / "out").ok
