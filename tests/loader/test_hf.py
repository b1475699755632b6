"""packtool.loader.hf: Trainer under DDP equals one process, resume continues the data order, TRL takes the packs.

A tiny random Llama (1 layer, hidden 32) for a few steps on the quickstart build; the DDP run is
`torchrun --nproc_per_node 2` with gloo on CPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _hf_worker  # noqa: E402

REPO = HERE.parents[1]


def run(build, tmp_path, name, *args):
    return _hf_worker.main([str(build), str(tmp_path / f"{name}.json"), "--output", str(tmp_path / name), *args])


@pytest.fixture(scope="module")
def reference(quickstart_build, tmp_path_factory):
    """One process, 4 micro-batches of one pack per step: the run every other one is compared with."""
    return run(quickstart_build, tmp_path_factory.mktemp("hf"), "single", "--steps", "3", "--accum", "4")


def flat(hashes):
    return [h for mb in hashes for h in mb]


def test_ddp_on_two_ranks_gives_the_single_process_loss(quickstart_build, reference, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += [str(HERE / "_hf_worker.py"), str(quickstart_build), str(out), "--output", str(tmp_path / "ddp")]
    cmd += ["--steps", "3", "--accum", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = json.loads(out.read_text())
    assert ddp["world"] == 2
    # Each step trains the same 4 packs (2 ranks x 2 micro-batches vs 1 x 4) with the window-wide token mean.
    for step in range(3):
        single = sorted(flat(reference["hashes"][0][4 * step : 4 * step + 4]))
        both = sorted(h for rank in ddp["hashes"] for h in flat(rank[2 * step : 2 * step + 2]))
        assert single == both
    assert ddp["losses"] == pytest.approx(reference["losses"], abs=1e-5)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_a_checkpoint_reads_the_same_next_packs(quickstart_build, tmp_path, workers):
    loader = ["--accum", "2", "--workers", str(workers)]
    full = run(quickstart_build, tmp_path, "full", "--steps", "4", *loader)
    run(quickstart_build, tmp_path, "split", "--steps", "2", "--save-steps", "2", *loader)
    saved = json.loads((tmp_path / "split" / "checkpoint-2" / "packtool_data.json").read_text())
    assert saved["position"] == 4 and saved["epoch"] == 0
    resumed = run(quickstart_build, tmp_path, "split", "--steps", "4", "--resume", *loader)
    assert len(flat(full["hashes"][0])) == 8 == len(set(flat(full["hashes"][0])))
    assert flat(resumed["hashes"][0]) == flat(full["hashes"][0])[4:]
    assert resumed["losses"][-1] == pytest.approx(full["losses"][-1], abs=1e-5)


def test_trl_sft_trainer_padding_free_takes_the_packs(quickstart_build, reference, tmp_path):
    pytest.importorskip("trl")
    sft = run(quickstart_build, tmp_path, "trl", "--steps", "3", "--accum", "4", "--trl")
    assert sft["hashes"] == reference["hashes"]
    # TRL's own padding-free collator rebuilt the same rows (labels, positions), so the same loss
    assert sft["losses"] == pytest.approx(reference["losses"], abs=1e-3)


def hybrid_trainer(build, tmp_path, *, trl: bool = False, **collator):
    """A PackedTrainer (or PackedSFTTrainer) for a tiny random Qwen3.5 text model (Gated DeltaNet + full)."""
    import transformers

    from packtool.loader.hf import PackedCollator, PackedTrainer, trainer_dataset
    from packtool.loader.probe import FAMILIES, build_tiny, family_config

    common = {"output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 1}
    common |= {"report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True, "logging_steps": 1}
    config = family_config(FAMILIES["qwen3_5"])
    args = transformers.TrainingArguments(**common)
    config.vocab_size = trainer_dataset(build, args).manifest.vocab_size
    model = build_tiny(config, "sdpa")
    if trl:
        import trl as trl_module

        from packtool.loader.hf import PackedSFTTrainer

        targs = trl_module.SFTConfig(
            **common, padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True}
        )
        packed = trainer_dataset(build, targs)
        # the manifest names the tokenizer relative to the output folder (docs/format.md), not to the working one
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(packed.path / (packed.manifest.tokenizer_file or "")), pad_token="<pad>"
        )
        return PackedSFTTrainer(model=model, args=targs, packed=packed, processing_class=tokenizer)
    collate = PackedCollator(model, **collator) if collator else None
    return PackedTrainer(model=model, args=args, train_dataset=trainer_dataset(build, args), data_collator=collate)


def test_trainers_refuse_a_hybrid_model_that_would_train_contaminated(quickstart_build, tmp_path):
    from packtool.errors import IsolationError

    with pytest.raises(
        IsolationError, match=r"^Qwen3_5ForCausalLM \(sdpa\): linear_attention layers refuse"
    ) as refused:
        hybrid_trainer(quickstart_build, tmp_path).train()
    # one error, no chained traceback; the way out as the trainer is written; skipping is not a fix
    message = str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__ and "\n" not in message
    fix = message.split("; fix: ", 1)[1]
    assert fix.startswith(
        "train one document per row: PackedTrainer(..., data_collator=PackedCollator(model, one_document_per_row=True))"
    )
    assert "(not here: this machine has no CUDA)" in fix  # the FLA kernels are CUDA only
    assert "skips this check and trains with documents that see each other" in message
    pytest.importorskip("trl")
    # TRL's padding-free collator adds its own boundaries, which the conv fallback refuses too
    with pytest.raises(IsolationError, match=r"^Qwen3_5ForCausalLM \(sdpa\): linear_attention layers") as refused:
        hybrid_trainer(quickstart_build, tmp_path, trl=True).train()
    message = str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__ and "\n" not in message
    assert (
        "fix: train one document per row on PackedTrainer(..., data_collator=PackedCollator(model, "
        "one_document_per_row=True)); TRL's padding-free collator always packs"
    ) in message


def test_one_document_per_row_trains_the_hybrid_model(quickstart_build, tmp_path, monkeypatch):
    trainer = hybrid_trainer(quickstart_build, tmp_path, one_document_per_row=True)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
    logged = next(log for log in trainer.state.log_history if "loss" in log)
    assert logged["padding_slots"] > 0 and logged["segments"] >= 1
    # the documented opt-out: the same refused trainer runs (contaminated) when the user says so
    monkeypatch.setenv("PACKTOOL_SKIP_ISOLATION_CHECK", "1")
    with pytest.raises(ValueError, match="flash-linear-attention"):
        hybrid_trainer(quickstart_build, tmp_path).train()  # the model's own refusal, no longer caught first


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_trainer_reads_each_epoch_in_its_own_order(make_build, tmp_path, drop_last):
    """num_train_epochs=3 reads epochs 0, 1, 2, each once. Before: with dataloader_drop_last the dropped
    tail kept the dataset in epoch 0, so epochs 2 and 3 were empty and training stopped after 7 steps."""
    import transformers

    from packtool.loader.dataset import PackedDataset
    from packtool.loader.hf import PackedTrainer, trainer_dataset

    path, _ = make_build(n_packs=15, capacity=64)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=3,
        per_device_train_batch_size=2,
        dataloader_drop_last=drop_last,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trained: list[list[str]] = []

    class Recording(PackedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            trained.append(list(self.last_pack_hashes))
            return loss

    dataset = trainer_dataset(path, args)
    Recording(model=_hf_worker.tiny_llama(128), args=args, train_dataset=dataset).train()
    per_epoch = 7 if drop_last else 8
    assert len(trained) == 3 * per_epoch
    for epoch in range(3):
        order = PackedDataset(path, seed=args.seed)
        order.set_epoch(epoch)
        expected = [pack.pack_hash for pack in order][: 14 if drop_last else 15]
        assert flat(trained[epoch * per_epoch : (epoch + 1) * per_epoch]) == expected
    assert dataset.state_dict()["epoch"] == 3


# One optimizer step of a PackedTrainer in a process of its own, so that its peak RSS is its own.
MEMORY_RUN = """
import json, resource, sys
import torch, transformers
from packtool.loader.hf import PackedTrainer, trainer_dataset
sys.path.insert(0, sys.argv[3])
from test_hf import tiny_qwen3

torch.set_num_threads(2)
common = dict(output_dir=sys.argv[2], max_steps=1, per_device_train_batch_size=2, learning_rate=0.0, logging_steps=1,
              report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
if sys.argv[4] == "trl":
    import trl
    from packtool.loader.hf import PackedSFTTrainer
    args = trl.SFTConfig(**common, padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True})
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=sys.argv[5], pad_token="<pad>")
    trainer = PackedSFTTrainer(model=tiny_qwen3(), args=args, packed=trainer_dataset(sys.argv[1], args),
                               processing_class=tokenizer)
else:
    args = transformers.TrainingArguments(**common)
    trainer = PackedTrainer(model=tiny_qwen3(), args=args, train_dataset=trainer_dataset(sys.argv[1], args))
trainer.train()
loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
print(json.dumps({"loss": loss, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "chunked": trainer.loss == "chunked"}))
"""
QWEN3_VOCAB = 151_936


def tiny_qwen3(vocab: int = QWEN3_VOCAB, **settings):
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=8192,
        **settings,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


@pytest.mark.parametrize("trainer", ["transformers", "trl"])
def test_the_trainer_loss_holds_no_logits_and_equals_the_plain_loop(make_build, tmp_path, trainer):
    """Qwen3's vocabulary on two packs of 4,096 tokens: the model's own loss held [8192, 151936] logits
    and their gradient (15 GB peak); the chunked loss stays under 4 GB with the plain loop's value."""
    import torch

    if trainer == "trl":
        pytest.importorskip("trl")

    from packtool.loader import PackedDataset, chunked_token_loss_sum
    from packtool.loader.collate import collate
    from packtool.loader.hf import model_inputs

    path, _ = make_build(n_packs=2, capacity=4096, packs_per_shard=2)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TRANSFORMERS_VERBOSITY": "error"}
    tokenizer = REPO / "configs" / "quickstart" / "tokenizer" / "tokenizer.json"  # TRL's collator reads its pad id
    command = [sys.executable, "-c", MEMORY_RUN, str(path), str(tmp_path / "run"), str(HERE), trainer, str(tokenizer)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["chunked"] and run["peak_rss"] < 4 * 2**30, run
    # the README's loop on the same two packs (one micro-batch), same weights
    model = tiny_qwen3()
    mb = collate(list(PackedDataset(path, shuffle=False)))
    with torch.no_grad():
        hidden = model.model(**model_inputs(mb, model)).last_hidden_state
        loss_sum, n_targets = chunked_token_loss_sum(hidden, model.lm_head.weight, mb.labels)
    assert run["loss"] == pytest.approx(float(loss_sum) / n_targets, abs=1e-5)


def test_a_model_whose_logits_are_more_than_its_head_gets_its_own_loss(make_build, tmp_path, caplog):
    """Soft-capped logits (Gemma-2's final_logit_softcapping) are not the output layer on the hidden
    states: train() compares the two losses once and keeps the model's own, saying so."""
    import torch
    import transformers

    from packtool.loader.hf import PackedTrainer, trainer_dataset

    path, _ = make_build(n_packs=4, capacity=64)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        per_device_train_batch_size=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    config = transformers.Gemma2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,
        use_cache=False,
    )
    config._attn_implementation = "eager"  # Gemma-2 has no sdpa
    torch.manual_seed(0)
    trainer = PackedTrainer(
        model=transformers.Gemma2ForCausalLM(config), args=args, train_dataset=trainer_dataset(path, args)
    )
    trainer.train()
    assert trainer.loss == "model"
    assert "its logits are more than its output layer on the last hidden states" in caplog.text
    plain = PackedTrainer(model=tiny_qwen3(128), args=args, train_dataset=trainer_dataset(path, args))
    plain.train()
    assert plain.loss == "chunked"
    with pytest.raises(Exception, match=r"loss='logits': one of 'chunked', 'model'"):
        PackedTrainer(model=tiny_qwen3(128), args=args, train_dataset=trainer_dataset(path, args), loss="logits")


def test_the_chunked_loss_trains_as_the_model_s_own(quickstart_build, tmp_path):
    """The trainers' loss beside its reference, transformers' own: three steps of two accumulated
    micro-batches (the window's targets over num_items_in_batch) log the same losses and leave the
    same weights with loss="chunked" as with loss="model"."""
    import torch
    import transformers

    from packtool.format import read_manifest
    from packtool.loader.hf import PackedTrainer, trainer_dataset

    runs = {}
    for loss in ("chunked", "model"):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / loss),
            max_steps=3,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            optim="sgd",  # Adam's g / sqrt(v) turns float noise on a near-zero gradient into a whole step
            learning_rate=1.0,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )
        model = tiny_qwen3(read_manifest(quickstart_build).vocab_size)
        dataset = trainer_dataset(quickstart_build, args)
        trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
        trainer.train()
        assert trainer.loss == loss
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        runs[loss] = (losses, {k: v.detach().clone() for k, v in model.named_parameters()})
    assert len(runs["chunked"][0]) == 3
    assert runs["chunked"][0] == pytest.approx(runs["model"][0], abs=1e-5)
    for name, weight in runs["model"][1].items():
        torch.testing.assert_close(runs["chunked"][1][name], weight, rtol=1e-4, atol=1e-5, msg=name)
