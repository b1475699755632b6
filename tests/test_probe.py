"""packtool.probe and `packtool audit --probe`: every family of docs/isolation.md's table on the CPU backends.

Tiny random models (hidden 64, 2 layers, float32): one family probe costs about a second here.
"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from support import REPO

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtool.cli import main  # noqa: E402
from packtool.errors import IsolationError, ProbeError  # noqa: E402
from packtool.loader.boundaries import FEEDS as FEED_REGISTRY  # noqa: E402
from packtool.loader.boundaries import model_inputs, position_ids_only  # noqa: E402
from packtool.probe import (  # noqa: E402
    CPU_BACKENDS,
    DOC_LENGTHS,
    FAMILIES,
    build_tiny,
    check_isolation,
    family_config,
    family_table,
    packed_row,
    probe,
    run_checks,
    synthetic_docs,
)

FEEDS = ("model_inputs", "position_ids", "one_document_per_row")


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("key", list(FAMILIES))
def test_every_family_gives_the_documented_verdict_on_every_cpu_backend(key):
    family = FAMILIES[key]
    report = probe(key, feeds=FEEDS)
    ran = [row for row in report.rows if row.status != "skip"]
    assert {row.backend for row in ran} >= {"eager"}
    expected = {
        "model_inputs": family.cpu_verdict_for(transformers.__version__),
        "position_ids": family.positions_verdict,
    }
    for row in ran:
        assert row.status == expected.get(row.feed, "pass"), (row.backend, row.feed, row.detail)
        if row.status == "pass":
            assert all(check.ok and check.worst <= 1e-4 for check in row.checks)
    # the skipped combinations say why (Mamba-2 has no sdpa path)
    assert all(row.detail.startswith("cannot build") for row in report.rows if row.status == "skip")
    assert report.ok == all(expected.get(row.feed, "pass") == "pass" for row in ran)


def test_a_hybrid_fed_position_ids_only_is_a_named_leak_in_its_linear_layer():
    report = probe("qwen3_5", feeds=("position_ids",))
    for row in report.rows:
        assert row.status == "leak"
        assert row.detail.startswith("layer 0 (linear_attention) carries one document into the next")
        assert "flash-linear-attention" in row.detail and "one_document_per_row=True" in row.detail
        perturbation = next(c for c in row.checks if c.check == "perturbation")
        assert perturbation.worst > 1e-2  # far above float32 noise (1e-7)


def flat_causal(mb, model):
    """A planted leak: an all-ones 2D mask, which HF turns into one causal mask over the whole row."""
    return {**model_inputs(mb, model), "attention_mask": torch.ones_like(mb.input_ids)}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_probe_catches_an_all_causal_mask(backend, monkeypatch):
    monkeypatch.setitem(FEED_REGISTRY, "flat_causal", flat_causal)
    model = build_tiny(family_config(FAMILIES["llama"]), backend)
    row = run_checks(model, packed_row(synthetic_docs(DOC_LENGTHS, 128)), "flat_causal")
    assert row.status == "leak"
    assert row.detail.startswith("layer 0 (full_attention)")
    assert {c.check for c in row.checks if not c.ok} == {"packed_vs_alone", "perturbation", "gradients", "loss"}


def test_check_isolation_passes_llama_and_stops_qwen35_with_one_line(monkeypatch):
    llama = build_tiny(family_config(FAMILIES["llama"]), "sdpa").train()
    assert check_isolation(llama) <= 1e-6
    assert llama.training  # the guard restores the mode it found
    qwen = build_tiny(family_config(FAMILIES["qwen3_5"]), "sdpa")
    with pytest.raises(IsolationError) as caught:
        check_isolation(qwen)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("Qwen3_5ForCausalLM (sdpa): linear_attention layers refuse the packed inputs")
    assert "PACKTOOL_SKIP_ISOLATION_CHECK=1" in message
    with pytest.raises(IsolationError, match=r"layer 0 \(linear_attention\).*one_document_per_row=True"):
        check_isolation(qwen, feed=position_ids_only)
    monkeypatch.setenv("PACKTOOL_SKIP_ISOLATION_CHECK", "1")
    assert check_isolation(qwen) is None


def test_docs_table_is_the_code_table():
    text = (REPO / "docs" / "isolation.md").read_text()
    documented = re.search(r"<!-- family-table:start -->\n(.*?)\n<!-- family-table:end -->", text, re.S)
    assert documented is not None
    assert documented.group(1) == family_table()


def test_cli_probe_passes_llama_and_names_the_qwen35_leak():
    runner = CliRunner()
    ok = runner.invoke(main, ["audit", "--probe", "llama"])
    assert ok.exit_code == 0, ok.output
    assert "ok: packed documents stay apart" in ok.output
    assert re.search(r"^sdpa +model_inputs .* PASS$", ok.output, re.M)
    leak = runner.invoke(main, ["audit", "--probe", "qwen3_5", "--feed", "position_ids", "--json"])
    assert leak.exit_code == 1
    report = json.loads(leak.output)
    assert report["ok"] is False and report["architecture"] == "Qwen3_5ForCausalLM"
    assert {row["status"] for row in report["rows"]} == {"leak"}
    assert all("linear_attention" in row["detail"] for row in report["rows"])


def test_cli_probe_reads_a_config_json_and_real_documents(tmp_path, quickstart_build):
    folder = tmp_path / "model"
    family_config(FAMILIES["gemma3"]).save_pretrained(folder)
    result = CliRunner().invoke(
        main, ["audit", "--probe", str(folder / "config.json"), "--data", str(quickstart_build), "--backend", "sdpa"]
    )
    assert result.exit_code == 0, result.output
    assert "Gemma3ForCausalLM" in result.output and "sliding_attention, full_attention" in result.output


def test_cli_probe_with_real_weights_from_a_folder(tmp_path):
    folder = tmp_path / "model"
    build_tiny(family_config(FAMILIES["qwen3"]), "sdpa").save_pretrained(folder)
    result = CliRunner().invoke(main, ["audit", "--probe", str(folder), "--weights", "--backend", "eager"])
    assert result.exit_code == 0, result.output
    assert "(real weights, float32)" in result.output


def test_an_unknown_model_is_one_line():
    result = CliRunner().invoke(main, ["audit", "--probe", "no-such-org/no-such-model"])
    assert result.exit_code == 1
    assert "not a family (llama" in result.output and "Traceback" not in result.output
    with pytest.raises(ProbeError, match="--feed nope: unknown"):
        probe("llama", feeds=("nope",))
    usage = CliRunner().invoke(main, ["audit"])
    assert usage.exit_code == 2 and "give a CONFIG to audit, or --probe MODEL" in usage.output


def test_half_precision_allows_rounding_steps_but_not_leaks():
    from packtool.probe import _moved

    logits = torch.tensor([10.0, -3.0, 0.5], dtype=torch.bfloat16)
    one_step = logits.clone()
    one_step[0] = 10.0625  # the next bfloat16 after 10
    assert _moved(logits.float(), one_step.float(), torch.bfloat16) == (pytest.approx(0.0625), False)
    leaked = logits.float() + torch.tensor([0.0, 0.0, 0.5])
    assert _moved(logits.float(), leaked, torch.bfloat16)[1]
    assert _moved(logits.float(), logits.float() + 1e-3, torch.float32)[1]  # float32: 1e-4 absolute


def test_check_isolation_leaves_sharded_models_to_the_probe(caplog):
    model = build_tiny(family_config(FAMILIES["llama"]), "sdpa")
    model.lm_head.weight = torch.nn.Parameter(torch.empty(0))  # what a ZeRO-3 shard looks like before gathering
    assert check_isolation(model) is None
    assert "sharded parameters" in caplog.text


def test_check_isolation_catches_a_feed_that_leaves_the_kv_cache_on():
    """A model whose config says use_cache=True (most checkpoints) builds a cache, and with it no block mask."""
    config = family_config(FAMILIES["llama"])
    config.use_cache = True
    model = build_tiny(config, "sdpa").train()
    with pytest.raises(IsolationError, match=r"layer 0 \(full_attention\)"):
        check_isolation(model, feed=lambda mb, m: {"input_ids": mb.input_ids, "position_ids": mb.position_ids})
    assert check_isolation(model) <= 1e-6  # model_inputs says use_cache=False
