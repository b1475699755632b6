"""`packtool canary`: a fixed canary set printed token by token, a tiny overfit through packtool's training path,
and generated turns that end where the template ends them (or one line naming why not)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from support import QUICKSTART

from packtool.canaries import CanarySet
from packtool.cli import main
from packtool.commands.canary import (
    KINDS,
    SELECTED_NOW,
    CanaryReport,
    Turn,
    _check_turn,
    canary_set,
    format_canary,
    select_canaries,
)
from packtool.seal import seal_manifest

pytest.importorskip("transformers")  # the overfit; selection needs neither

# A conversation of each kind a small build can hold; the answers are short so that 3 steps train them.
CHATS = [
    {"id": "hello", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
    {
        "id": "grüße",
        "messages": [
            {"role": "user", "content": "Say hello in Japanese."},
            {"role": "assistant", "content": "こんにちは"},
        ],
    },
]


def _canary(*args: str) -> tuple[int, str]:
    """Exit code and stdout (transformers draws its loading bar on stderr)."""
    result = CliRunner().invoke(main, ["canary", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout


def _build(folder, train: dict, output: str = "out") -> str:
    import yaml

    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS), encoding="utf-8")
    # an absolute path: the build's config folder is then not needed to read the records again (find, canary)
    source = {"name": "chat", "path": str(folder / "chat.jsonl"), "format": "messages", "fields": {"id": "id"}}
    source["train"] = train
    config = {
        "sources": [source],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "template": "model",
        "capacity": 128,
        "output": output,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = CliRunner().invoke(main, ["build", str(folder / "config.yaml"), "-q"])
    assert result.exit_code == 0, result.output
    return str(folder / output)


@pytest.fixture(scope="module")
def small_build(tmp_path_factory) -> str:
    """Two short ChatML conversations (one of them Unicode), their end-of-turn marker trained."""
    return _build(tmp_path_factory.mktemp("canary"), {})


@pytest.fixture(scope="module")
def untrained_end(tmp_path_factory) -> str:
    """The same conversations from a source that never trains its end-of-turn marker (train.end_of_turn: false)."""
    return _build(tmp_path_factory.mktemp("canary"), {"end_of_turn": False})


def test_the_quickstart_canary_set_holds_every_kind_and_is_the_same_every_time(quickstart_build):
    chosen, recorded = canary_set(quickstart_build)
    assert recorded  # the build wrote it into the manifest, and selecting again chooses the same
    assert select_canaries(quickstart_build) == chosen
    assert [c.kind for c in chosen.canaries] == list(KINDS)
    assert set(chosen.missing) == {"preference_pair", "completion_group"}  # a plain build: named, not failed
    packed = chosen.canaries[-1]
    assert packed.documents is None and len(packed.sample_ids) >= 2


def test_the_quickstart_canaries_overfit_and_every_turn_ends(quickstart_build):
    """The done-when case of issue 39 on the whole quickstart set (~15 s of CPU: the suite's two processes
    keep it within CI's budget)."""
    code, output = _canary(str(quickstart_build), "--model", "llama")
    assert code == 0, output
    for kind in KINDS:
        assert f"== {kind}: " in output
    assert "fed model_inputs" in output and "generation ok: code canary" in output


def test_a_small_build_overfits_and_every_turn_ends(small_build):
    code, output = _canary(small_build, "--model", "llama", "--steps", "40")
    assert code == 0, output
    assert "== unicode: grüße" in output and "missing: short_text: " in output
    assert "label" in output and "<|im_end|>" in output and "*" in output  # inspect's token table
    assert "fed model_inputs" in output and "loss by step: 1: 8." in output
    assert "generation ok: unicode canary grüße: " in output and "ends with '<|im_end|>'" in output
    assert "missing: empty_field: no kept record with an empty message" in output  # its records were read
    assert output.rstrip().endswith("every generated turn ends where the template ends it")


def _manifest(output) -> dict:
    return json.loads((Path(output) / "manifest.json").read_text(encoding="utf-8"))


def _edited(output: str, folder: Path, change) -> Path:
    """A copy of `output` whose manifest `change` edited, resealed (only recomputation can catch the edit)."""
    copy = folder / "edited"
    shutil.copytree(output, copy)
    manifest = _manifest(copy)
    change(manifest)
    (copy / "manifest.json").write_text(json.dumps(seal_manifest(manifest)), encoding="utf-8")
    return copy


def test_a_rebuild_from_the_cache_records_the_same_canaries(small_build):
    """A second build of the same config (its encode read from the token cache) records the same set."""
    again = _build(Path(small_build).parent, {}, output="again")
    assert _manifest(again)["canaries"] == _manifest(small_build)["canaries"]
    assert [c["kind"] for c in _manifest(again)["canaries"]["set"]] == ["unicode", "packed_row"]


def test_verify_names_a_recorded_canary_the_shards_do_not_hold(small_build, tmp_path):
    def wrong_id(manifest):
        manifest["canaries"]["set"][0]["sample_ids"] = ["nobody"]

    result = CliRunner().invoke(main, ["verify", str(_edited(small_build, tmp_path, wrong_id))])
    assert result.exit_code == 1
    assert "canaries.set[0] (unicode): sample ids ['nobody'], but shard-00000.parquet row 0 holds" in result.output


def test_an_output_without_a_recorded_set_selects_it_now_and_says_so(small_build, tmp_path):
    older = _edited(small_build, tmp_path, lambda manifest: manifest.pop("canaries"))
    chosen, recorded = canary_set(older)
    assert not recorded
    assert chosen == CanarySet.from_dict(_manifest(small_build)["canaries"], older)
    report = CanaryReport(str(older), "llama", chosen.canaries, chosen.missing, losses=(8.0, 0.1), recorded=False)
    assert format_canary(report).splitlines()[1] == f"notice: {SELECTED_NOW}"


def test_a_preference_build_records_its_first_pair_whole(tmp_path):
    """Pair records are read again beside the shards (for the empty field): the pair is chosen whole, not as samples."""
    pairs = [
        {
            "id": f"p{i}",
            "prompt": [{"role": "user", "content": f"{i} + 1?"}],
            "chosen": [{"role": "assistant", "content": f"{i + 1}."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
        for i in range(2)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs), encoding="utf-8")
    source = {"name": "pairs", "path": str(tmp_path / "pairs.jsonl"), "format": "preference", "fields": {"id": "id"}}
    config = {"sources": [source], "tokenizer": str(QUICKSTART / "tokenizer"), "template": "model", "capacity": 128}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    result = CliRunner().invoke(main, ["build", str(tmp_path / "config.json"), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    (pair,) = [c for c in canary_set(tmp_path / "out")[0].canaries if c.kind == "preference_pair"]
    assert len(pair.sample_ids) == 2 and len(pair.documents) == 2


def test_an_end_of_turn_never_trained_fails_naming_the_cause(untrained_end):
    code, output = _canary(untrained_end, "--model", "qwen3", "--steps", "3", "--json")
    report = json.loads(output)
    assert code == 1 and not report["ok"]
    assert report["feed"] == "model_inputs" and report["notices"] == []  # the isolation guard passed first
    assert "empty_field" in report["missing"] and "unicode" not in report["missing"]
    lines = [line for line in report["failures"] if "does not end" in line]
    assert lines and "the end-of-turn marker is never a target (train.end_of_turn: false" in lines[0]


def test_an_eos_that_misses_the_end_of_turn_token_is_named(untrained_end, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "eos_token_id": 2,
    }
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}), encoding="utf-8")
    code, output = _canary(untrained_end, "--model", str(model), "--steps", "2")
    assert code == 1
    named = [line for line in output.splitlines() if line.startswith("FAILED: eos [0]")]
    assert named and str(model / "generation_config.json") in named[0]
    assert "end-of-turn token '<|im_end|>' (id 2)" in named[0]


def test_real_weights_train_and_their_generation_config_decides_the_stop(small_build, tmp_path):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=4096,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")  # + generation_config.json, eos 2
    code, output = _canary(small_build, "--model", str(tmp_path / "model"), "--weights", "--steps", "40", "--json")
    report = json.loads(output)
    assert code == 0, report["failures"]
    assert "real weights" in report["description"] and report["eos"] == [2]
    assert report["eos_from"] == str(tmp_path / "model" / "generation_config.json")
    assert len(report["losses"]) == 40 and report["factor"] >= 10


def test_a_hybrid_model_trains_one_document_per_row_with_a_notice(untrained_end):
    """Qwen3.5's Gated DeltaNet refuses packed rows on CPU: the guard says so and the overfit falls back."""
    code, output = _canary(untrained_end, "--model", "qwen3_5", "--steps", "2")
    assert code == 1  # the untrained end of turn
    assert "fed one_document_per_row" in output
    notice = next(line for line in output.splitlines() if line.startswith("notice: "))
    assert "one document per row" in notice and "linear_attention" in notice


def test_bad_arguments_are_one_line(untrained_end):
    for args, expected in (
        (["--model", "no-such-family"], "--probe no-such-family: not a family"),
        (["--steps", "0"], "--steps 0: give 1 or more"),
    ):
        result = CliRunner().invoke(main, ["canary", untrained_end, *args])
        assert result.exit_code == 1 and result.output.startswith("Error: "), result.output
        assert expected in result.output and len(result.output.strip().splitlines()) == 1


def test_a_trained_prompt_that_is_not_the_generation_prompt_is_named():
    """Serving renders add_generation_prompt; a template that prints more there (an empty think block) than the
    trained prompt holds would be served another prompt than it was trained on."""
    from tokenizers import Tokenizer

    decoder = Tokenizer.from_file(str(QUICKSTART / "tokenizer" / "tokenizer.json"))
    prompt = np.asarray(decoder.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n").ids)
    answer = tuple(decoder.encode("Hello.").ids)
    turn = Turn("code", "s1", prompt, answer, end_of_turn=2, end_trained=True)
    assert _check_turn(turn, [*answer, 2], decoder, "<|im_start|>assistant\n").failures == ()
    (line,) = _check_turn(turn, [*answer, 2], decoder, "<|im_start|>assistant\n<think>\n\n</think>\n\n").failures
    assert "does not end with the template's generation prompt '<|im_start|>assistant⏎<think>⏎⏎</think>⏎⏎'" in line
