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
    from packtool.probe import FAMILIES, build_tiny, family_config

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

    with pytest.raises(IsolationError, match=r"^Qwen3_5ForCausalLM \(sdpa\): linear_attention layers refuse"):
        hybrid_trainer(quickstart_build, tmp_path).train()
    pytest.importorskip("trl")
    # TRL's padding-free collator adds its own boundaries, which the conv fallback refuses too
    with pytest.raises(IsolationError, match=r"^Qwen3_5ForCausalLM \(sdpa\): linear_attention layers"):
        hybrid_trainer(quickstart_build, tmp_path, trl=True).train()


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
