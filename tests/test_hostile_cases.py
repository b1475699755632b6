"""Issue 37's hostile-user run: what a careless or hostile user tried on the build that crosses several wings.

Each case is a build a correct tool must either refuse in one line (exit 1, nothing published) or finish
with a `warning:` line that says what OUT lacks; none may exit 0 in silence. Cases that belong to one
module live beside its tests (probe, ownership, states)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.builder.mixing import unsampled_sources
from packtool.cli import main


def _chat(words: str) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": words}]}


@pytest.fixture
def two_sources(tmp_path, write_config, write_jsonl):
    """Sources a and b of four small chats each; settings change the config's top level or a source's."""
    write_jsonl([_chat(f"a {i}") for i in range(4)], "a.jsonl")
    write_jsonl([_chat(f"b {i}") for i in range(4)], "b.jsonl")

    def config(b: dict | None = None, **settings) -> str:
        raw = {
            "sources": [
                {"name": "a", "path": "a.jsonl", "format": "messages"},
                {"name": "b", "path": "b.jsonl", "format": "messages", **(b or {})},
            ],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 64,
            "output": str(tmp_path / "out"),
            "workers": 1,
            **settings,
        }
        return str(write_config(raw))

    return config


def _build(config: str, *args: str):
    return CliRunner().invoke(main, ["build", config, "-q", "--no-cache", *args])


def test_a_weight_that_draws_no_sample_is_a_warning(two_sources, tmp_path):
    """weight 1e-300 x 4 samples rounds to none: b was left out of OUT with exit 0 and no word."""
    result = _build(two_sources({"weight": 1e-300}))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "warning: source 'b' kept 4 records and none reached a pack (at weight 1e-300 it draws no sample, or the "
        "validation split holds them all); raise its weight: see packtool stats"
    ]
    accounting = json.loads((tmp_path / "out" / "manifest.json").read_text())["accounting"]
    assert accounting["b"]["kept"] == 4 and accounting["b"]["segments"] == 0
    assert "warning" not in _build(two_sources({"weight": 0.5})).output  # two of four drawn: nothing to say


def test_unsampled_sources_names_only_sources_that_kept_records_and_train_none():
    accounting = {"a": {"kept": 4, "segments": 4}, "b": {"kept": 4, "segments": 0}, "c": {"kept": 0, "segments": 0}}
    lines = unsampled_sources({"a": 1.0, "b": 1e-9, "c": 1.0}, accounting)
    assert len(lines) == 1 and lines[0].startswith("source 'b' kept 4 records and none reached a pack (at weight 1e-09")


def test_a_validation_split_holding_every_record_fails_and_publishes_nothing(two_sources, tmp_path):
    """validation.samples past the records held every one out: 0 packs to train, exit 0."""
    result = _build(two_sources(validation={"samples": 100_000}))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: no pack to train: the validation split (samples: 100,000) holds every")
    assert not (tmp_path / "out").exists()
    assert _build(two_sources(validation={"samples": 1})).exit_code == 0


@pytest.mark.parametrize("filter_", ["dedup", "decontamination"])
def test_a_quota_on_a_source_its_filter_empties_is_a_warning_and_fails_strict(two_sources, tmp_path, filter_):
    """b's records all repeat a's (dropped by dedup), or all overlap the eval set (dropped by decontamination):
    its quota is realized 0, which must be said, and --strict must fail."""
    settings: dict = {"max_reject_share": 1.0}
    if filter_ == "dedup":
        (tmp_path / "b.jsonl").write_text((tmp_path / "a.jsonl").read_text())
        settings["dedup"] = "exact"
    else:
        (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": f"b {i}"}) + "\n" for i in range(4)))
        settings["decontamination"] = {"against": str(tmp_path / "eval.jsonl"), "ngram": 2, "min_line_words": 2}
    config = two_sources({"quota": {"target_tokens": 1_000}}, **settings)
    result = _build(config)
    assert result.exit_code == 0, result.output
    assert "warning: quota 'b' missed: realized 0 of 1,000 target_tokens" in result.output
    strict = _build(config, "--strict")
    assert strict.exit_code == 1 and "Traceback" not in strict.output


def test_cache_list_counts_damaged_entries_and_refuses_a_folder_that_is_no_cache(two_sources, tmp_path, monkeypatch):
    """A report edited to `"samples": "many"` was a traceback; one cut short, or a list, was left out of the
    listing without a word; a folder that is no cache listed as an empty one."""
    cache = tmp_path / "cache"
    assert CliRunner().invoke(main, ["build", two_sources(), "-q", "--cache", str(cache)]).exit_code == 0
    reports = sorted((cache / "tokens").glob("*/*.json"))
    reports[0].write_text('{"samples": "many"}')
    reports[1].write_text("[1]")
    listing = CliRunner().invoke(main, ["cache", "list", str(cache)])
    assert listing.exit_code == 0 and "Traceback" not in listing.output, listing.output
    lines = listing.output.splitlines()
    assert sum("damaged: a build encodes it again" in line for line in lines) == 2
    assert lines[-1].startswith("2 entries,") and lines[-1].endswith("(2 damaged: a build encodes them again)")
    (tmp_path / "mine").mkdir()
    refused = CliRunner().invoke(main, ["cache", "list", str(tmp_path / "mine")])
    assert refused.exit_code == 1 and "is not a packtool cache" in refused.output
    # a folder that is not there: "0 entries, 0 bytes" with exit 0 before, while the cache lay elsewhere
    monkeypatch.chdir(tmp_path)  # the default, out/.packtool-cache, is not there
    for args in ([str(tmp_path / "nowhere")], []):
        missing = CliRunner().invoke(main, ["cache", "list", *args])
        assert missing.exit_code == 1 and "no cache at" in missing.output and "entries" not in missing.output


def test_a_dry_run_says_what_the_build_would_warn_of_or_fail_on(two_sources, write_jsonl):
    """A dry run whose build would miss a quota whole, or leave a source out, exited 0 and said nothing."""
    write_jsonl([{"text": "not a conversation"}] * 3, "b.jsonl")
    config = two_sources({"quota": {"target_tokens": 1_000}}, on_error="skip", max_reject_share=1.0)
    dry = _build(config, "--dry-run")
    assert dry.exit_code == 0 and "warning: quota 'b' missed: realized 0 of 1,000 target_tokens" in dry.output
    failed = _build(config, "--dry-run", "--set", "on_quota_miss=fail")
    assert failed.exit_code == 1 and failed.output.startswith("Error: quota 'b' missed: realized 0 of 1,000")
    unsampled = _build(two_sources({"path": "a.jsonl", "weight": 1e-300}), "--dry-run")
    assert unsampled.exit_code == 0 and "warning: source 'b' kept 4 records and none reached a pack" in unsampled.output


def test_a_dry_run_judges_quotas_on_what_the_plan_gives_out(two_sources, write_jsonl):
    """Every record of b kept but over capacity, so the overflow bucket holds them all and OUT none: the build
    warned (or failed) of the quota while the dry run, which counted the bucket's segments as b's, said nothing.
    Judged on the plan's amounts in OUT, the dry run says the build's own line; a quota met says nothing."""
    write_jsonl([_chat("word " * 200)] * 3, "b.jsonl")
    config = two_sources({"quota": {"target_tokens": 1_000}}, overflow="bucket")
    line = (
        "warning: quota 'b' missed: realized 0 of 1,000 target_tokens (short by 1,000; a quota is met within one "
        "sample); the source holds none in OUT: see packtool stats; --strict makes this an error"
    )
    dry = _build(config, "--dry-run")
    assert dry.exit_code == 0 and line in dry.output.splitlines() and "no shard was written" in dry.output
    failed = _build(config, "--dry-run", "--set", "on_quota_miss=fail")
    assert failed.exit_code == 1 and failed.output.startswith("Error: quota 'b' missed: realized 0 of 1,000")
    built = _build(config)
    assert built.exit_code == 0 and built.output.splitlines() == [line]  # the build's line, word for word
    met = _build(two_sources({"quota": {"target_tokens": 1_000}}), "--dry-run")
    assert met.exit_code == 0 and "warning" not in met.output
