"""packtool.loader.probe and `packtool audit --probe`: every family of docs/isolation.md's table on the CPU backends.

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
from packtool.loader.probe import (  # noqa: E402
    CPU_BACKENDS,
    DOC_LENGTHS,
    FAMILIES,
    build_tiny,
    check_isolation,
    family_config,
    family_table,
    format_probe,
    packed_row,
    probe,
    run_checks,
    shrink,
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


def test_the_default_probe_shows_the_one_document_per_row_way_out():
    """Qwen3.5 on CPU: model_inputs is refused (no FLA kernels here). Before, ERROR rows and "a
    combination lets documents leak", though nothing leaked and one document per row passes."""
    result = CliRunner().invoke(main, ["audit", "--probe", "qwen3_5", "--backend", "sdpa"])
    assert result.exit_code == 1
    assert re.search(r"^sdpa +model_inputs .* ERROR: linear_attention layers refuse", result.output, re.M)
    assert re.search(r"^sdpa +one_document_per_row .* PASS$", result.output, re.M), result.output
    last = result.output.strip().splitlines()[-2:]
    assert last[0] == "FAILED: sdpa x model_inputs refuse the packed inputs"
    assert last[1].startswith(
        "one document per row passes: train with PackedCollator(model, one_document_per_row=True)"
    )


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
    build_tiny(family_config(FAMILIES["qwen3"]), "sdpa", dtype=torch.float32).save_pretrained(folder)
    result = CliRunner().invoke(main, ["audit", "--probe", str(folder), "--weights", "--backend", "eager"])
    assert result.exit_code == 0, result.output
    assert "(real weights, float32)" in result.output


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("model.safetensors", r"model: its weights could not be read \(SafetensorError"),
        ("pytorch_model.bin", r"model: its weights could not be read \(UnpicklingError"),
        (None, r"--weights .*config\.json: a file; give the model folder that holds it and the weights"),
    ],
)
def test_weights_that_cannot_be_read_are_one_line(tmp_path, weights, message):
    """h37: a weights file cut short, or config.json given to --weights (read as the weights), was a traceback."""
    config = write_config(tmp_path / "model", "llama")
    if weights is not None:
        (config.parent / weights).write_bytes(b"garbage")
    model = str(config.parent if weights else config)
    result = CliRunner().invoke(main, ["audit", "--probe", model, "--weights", "--backend", "eager"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert re.search(message, result.output) and len(result.output.strip().splitlines()) == 1


def test_an_unknown_model_is_one_line():
    result = CliRunner().invoke(main, ["audit", "--probe", "no-such-org/no-such-model"])
    assert result.exit_code == 1
    assert "not a family (llama" in result.output and "Traceback" not in result.output
    with pytest.raises(ProbeError, match="--feed nope: unknown"):
        probe("llama", feeds=("nope",))
    usage = CliRunner().invoke(main, ["audit"])
    assert usage.exit_code == 2 and "give a CONFIG to audit, or --probe MODEL" in usage.output


@pytest.mark.parametrize("name", ["Eager", "nonsense", "paged|nonsense", "flash_attention"])
def test_a_backend_transformers_does_not_know_is_one_line_before_any_model_is_built(name):
    """`--backend sdpa --backend Eager` ran sdpa, skipped the misspelt one and passed with exit 0."""
    result = CliRunner().invoke(main, ["audit", "--probe", "llama", "--backend", "sdpa", "--backend", name])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"Error: --backend {name}: not an attention implementation transformers knows;")
    assert "eager, " in result.output and "sdpa" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["eager", "paged|eager", "flash_attention_2"])
def test_a_backend_transformers_knows_is_probed_or_skipped_with_its_reason(name):
    row = probe("llama", backends=(name,)).rows[0]
    assert row.backend == name
    if name == "eager":
        assert row.status == "pass"
    elif name == "paged|eager":  # runs, and leaks: paged attention serves generation from its cache, not training
        assert row.status == "leak"
    elif not torch.cuda.is_available():
        assert row.status == "skip" and "cannot build" in row.detail, row


def test_half_precision_allows_rounding_steps_but_not_leaks():
    from packtool.loader.probe import _moved

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
    with pytest.raises(IsolationError, match=r"the feed leaves the KV cache on .*fix: pass use_cache=False") as caught:
        check_isolation(model, feed=lambda mb, m: {"input_ids": mb.input_ids, "position_ids": mb.position_ids})
    assert "another attention backend" not in str(caught.value)  # sdpa is not the cause
    assert check_isolation(model) <= 1e-6  # model_inputs says use_cache=False


# ---- issue 37: verdicts, shrinking, layer kinds, advice, limits, what was probed ----


def write_config(folder, family_type, **settings):
    """A config.json built from transformers' own config class (no hub access)."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    raw = {**AutoConfig.for_model(family_type).to_dict(), **settings}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder / "config.json"


def test_a_model_no_backend_runs_is_could_not_run_not_a_leak():
    report = probe("mamba", backends=("sdpa",))  # Mamba has no sdpa path: nothing ran
    assert report.verdict == "could not run" and not report.ok
    text = format_probe(report)
    assert "FAILED" not in text
    assert text.splitlines()[-1].startswith("could not run: no backend ran mamba (sdpa: cannot build: ValueError")
    result = CliRunner().invoke(main, ["audit", "--probe", "mamba", "--backend", "sdpa", "--json"])
    assert result.exit_code == 1 and json.loads(result.output)["verdict"] == "could not run"


def test_shrinking_keeps_every_per_layer_list_consistent():
    from transformers import AutoConfig

    tiny = shrink(AutoConfig.for_model("gemma3n_text").to_dict())  # 35 layers, 15 of them sharing caches
    n = tiny["num_hidden_layers"]
    assert len(tiny["layer_types"]) == len(tiny["activation_sparsity_pattern"]) == n
    assert 0 < tiny["num_kv_shared_layers"] < n
    deepseek = shrink(AutoConfig.for_model("deepseek_v3").to_dict())
    assert deepseek["first_k_dense_replace"] == 1 and deepseek["num_hidden_layers"] == 2  # one dense, one MoE
    assert deepseek["qk_rope_head_dim"] == deepseek["head_dim"]  # MLA's rotary half is the rotated head
    jamba = shrink(AutoConfig.for_model("jamba").to_dict())
    assert (jamba["num_hidden_layers"], jamba["attn_layer_period"], jamba["attn_layer_offset"]) == (3, 3, 2)


def test_layer_kinds_come_from_what_the_model_runs():
    from packtool.loader.boundaries import layer_kinds, model_layer_kinds

    nemotron = build_tiny(family_config(FAMILIES["nemotron_h"]), "eager")
    assert layer_kinds(nemotron.config)[0] == "linear_attention"  # what its config calls its Mamba-2 layers
    assert model_layer_kinds(nemotron)[0] == "mamba"
    inputs = model_inputs(packed_row(synthetic_docs((3, 4), 128)), nemotron)
    assert "seq_idx" in inputs and "cu_seq_lens_q" not in inputs
    rwkv = build_tiny(family_config(FAMILIES["rwkv"]), "eager")
    assert set(model_layer_kinds(rwkv)) == {"rwkv"}


def test_advice_names_only_what_the_model_and_layer_can_use():
    from packtool.loader.probe import fix_for

    for key in ("bloom", "mpt", "rwkv"):  # no sdpa, no flash: the fallback alone
        model = build_tiny(family_config(FAMILIES[key]), "eager")
        kind = model_layer_kinds_of(model)
        assert fix_for(kind, "model_inputs", model).startswith("train one document per row"), key
        assert "sdpa" not in fix_for(kind, "model_inputs", model)
    lfm2 = build_tiny(family_config(FAMILIES["lfm2"]), "sdpa")
    assert "sdpa" not in fix_for("full_attention", "model_inputs", lfm2)  # already on it
    assert "flash_attention_2" in fix_for("full_attention", "model_inputs", lfm2)
    for key, kind in (("minimax", "lightning_attention"), ("recurrent_gemma", "rg_lru")):
        advice = fix_for(kind, "model_inputs", build_tiny(family_config(FAMILIES[key]), "eager"))
        assert "flash-linear-attention" not in advice and "causal-conv1d" not in advice
        assert advice.startswith("train one document per row") and f"{kind} layers read no document boundary" in advice


def model_layer_kinds_of(model):
    from packtool.loader.boundaries import model_layer_kinds

    return model_layer_kinds(model)[0]


def test_a_small_leak_of_a_small_model_is_caught(tmp_path):
    """LFM2 initialised at 0.01: its conv layer moves other documents by ~3e-5 relative (float64 noise 1e-16)."""
    config = write_config(
        tmp_path / "lfm2",
        "lfm2",
        initializer_range=0.01,
        layer_types=["conv", "full_attention"],
        full_attn_idxs=[1],
        num_hidden_layers=2,
    )
    row = probe(str(config), backends=("sdpa",), feeds=("position_ids",)).rows[0]
    assert row.status == "leak", row
    assert row.detail.startswith("layer 0 (conv) carries one document into the next; fix: ")
    assert "install causal-conv1d" in row.detail  # on CUDA first; here after one document per row
    perturbation = next(c for c in row.checks if c.check == "perturbation")
    assert 1e-9 < perturbation.worst < 1e-4  # under the old fixed 1e-4, far over float64's noise


def test_what_was_probed_is_said_in_one_line(tmp_path):
    custom = write_config(tmp_path / "custom", "llama", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    result = CliRunner().invoke(main, ["audit", "--probe", str(custom), "--backend", "sdpa", "--json"])
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert len(notes) == 1 and "custom code not run" in notes[0] and "'llama'" in notes[0]
    unknown = write_config(
        tmp_path / "unknown", "llama", model_type="xyzzy", auto_map={"AutoConfig": "configuration_x.XConfig"}
    )
    result = CliRunner().invoke(main, ["audit", "--probe", str(unknown), "--json"], input="y\n")
    assert result.exit_code == 1
    assert "Do you wish" not in result.output and "Traceback" not in result.output
    assert result.output.startswith(f"Error: {unknown}: model_type 'xyzzy' could not be read by transformers")
    assert "auto_map names custom code, which packtool does not run" in result.output


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_hidden_layers": "two"}, r"config\.json: field 'num_hidden_layers': .*expected int, got str"),
        ({"num_hidden_layers": 0}, r"config\.json: num_hidden_layers 0: a model without layers"),
        ({"layer_types": ["full_attention"] * 3}, r"config\.json: ValueError: `num_hidden_layers` \(32\) must be"),
        # h37: minutes spent reading a billion layer kinds, then a ZeroDivisionError traceback from transformers
        ({"num_hidden_layers": 10**9}, r"config\.json: num_hidden_layers 1,000,000,000: more layers than any model"),
        ({"num_attention_heads": 0}, r"config\.json: transformers' llama config refuses its values \(ZeroDivision"),
    ],
)
def test_a_bad_config_field_is_one_line_naming_file_and_field(tmp_path, settings, message):
    config = write_config(tmp_path / "m", "llama", **settings)
    result = CliRunner().invoke(main, ["audit", "--probe", str(config)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert re.match(f"Error: {re.escape(str(config))}: " + message.split(r"config\.json: ", 1)[1], result.output)
    assert len(result.output.strip().splitlines()) == 1


def test_a_model_whose_logits_are_nan_alone_could_not_run_and_is_no_leak(tmp_path):
    """h37: rope_theta NaN made every logit NaN, and NaN against NaN read as a leak on every backend."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "rope_theta": NaN}')
    report = probe(str(config), backends=("eager",))
    assert report.verdict == "could not run" and "not finite with each document alone" in report.rows[0].detail


def test_hostile_configs_are_one_line_or_a_note(tmp_path):
    broken = tmp_path / "broken" / "config.json"
    broken.parent.mkdir()
    broken.write_text("{not json")
    result = CliRunner().invoke(main, ["audit", "--probe", str(broken)])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {broken}: not a JSON config")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProbeError, match=r"empty: a folder without config\.json"):
        probe(str(tmp_path / "empty"))
    with pytest.raises(ProbeError, match=r"missing\.json: no such file"):
        probe(str(tmp_path / "missing.json"))
    listed = tmp_path / "listed" / "config.json"
    listed.parent.mkdir()
    listed.write_text("[1, 2]")
    with pytest.raises(ProbeError, match=r"a JSON list, not a config object"):
        probe(str(listed))
    quantized = write_config(tmp_path / "q", "llama", quantization_config={"quant_method": "bitsandbytes"})
    assert probe(str(quantized), backends=("sdpa",)).notes == (
        "quantization_config (bitsandbytes) not applied: the tiny copy runs unquantized weights",
    )
    bert = write_config(tmp_path / "bert", "bert")
    report = probe(str(bert), backends=("sdpa",))
    assert report.architecture == "BertLMHeadModel" and "is an encoder (masked LM)" in report.notes[0]
    with pytest.raises(ProbeError, match=r"vocab_size 1: the probe needs at least 5 token ids"):
        check_isolation(SimpleModel(vocab_size=1))


class SimpleModel(torch.nn.Module):
    """Just enough of a model for check_isolation to build its row from the vocabulary size."""

    def __init__(self, vocab_size):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = transformers.LlamaConfig(vocab_size=vocab_size, num_hidden_layers=1)


def test_an_uncached_hub_id_names_the_command_huggingface_hub_ships(monkeypatch, tmp_path):
    """The installed huggingface_hub ships `hf`, not `huggingface-cli`; the rest of packtool says `hf download`."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(main, ["audit", "--probe", "nobody-here/no-such-model"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "hf download nobody-here/no-such-model config.json" in result.output
    assert "huggingface-cli" not in result.output
