"""PackedSFTTrainer on a vision build: TRL's trainer with packtool's PackedCollator in place of TRL's padding-free
collator (which has no place for pixel_values, image_grid_thw and the mRoPE positions).

The vision quickstart (configs/quickstart-vision.yaml) built here and trained two steps on a tiny random Qwen2-VL:
the same packs, the same images in the forward and the same losses as PackedTrainer, whose packed logits
tests/loader/test_vision.py holds to the processor path, with packtool's chunked loss and with TRL's own
(its fused LM head); and two DDP ranks, one given a pack without images, train without hanging.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
from test_vision import tiny_qwen2_vl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("PIL.Image")

from packtool.format import MANIFEST, read_manifest  # noqa: E402
from packtool.loader.hf import PackedTrainer, trainer_dataset  # noqa: E402

# sgd: Adam's g / sqrt(v) would turn float noise on a near-zero gradient into a whole step between the two runs
COMMON = {"max_steps": 2, "per_device_train_batch_size": 2, "optim": "sgd", "learning_rate": 0.5, "logging_steps": 1}
COMMON |= {"report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True}


@pytest.fixture(scope="module")
def quickstart_vision(tmp_path_factory):
    from packtool.builder import build
    from packtool.config import load_config

    out = tmp_path_factory.mktemp("quickstart-vision") / "out"
    build(load_config(REPO / "configs" / "quickstart-vision.yaml", output=str(out)), use_cache=False)
    assert (out / MANIFEST).is_file()
    return out


def train(trainer) -> dict:
    """Two steps, with each forward's images (its pixel_values rows and image grids) recorded as the model got them."""
    model = trainer.model
    fed: list[tuple[int, list]] = []

    def record(_module, _args, kwargs):
        if model.training:  # the isolation and loss checks run text-only rows in eval mode
            grids = kwargs.get("image_grid_thw")
            pixels = kwargs.get("pixel_values")
            fed.append((0 if pixels is None else len(pixels), [] if grids is None else grids.tolist()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    hashes = []

    class Recorded(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            hashes.append(list(trainer.last_pack_hashes))

    trainer.add_callback(Recorded())
    try:
        trainer.train()
    finally:
        handle.remove()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"losses": [log["loss"] for log in logs], "fed": fed, "hashes": hashes, "loss": trainer.loss, "logs": logs}


@pytest.fixture(scope="module")
def reference(quickstart_vision, tmp_path_factory):
    """PackedTrainer with its chunked loss: the run the TRL ones are held to."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path_factory.mktemp("reference")), **COMMON)
    model = tiny_qwen2_vl(read_manifest(quickstart_vision).vision["image_token_id"]).train()
    return train(PackedTrainer(model=model, args=args, train_dataset=trainer_dataset(quickstart_vision, args)))


def sft_trainer(build, tmp_path, loss: str):
    from packtool.loader.hf import PackedSFTTrainer

    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        **COMMON,
        bf16=False,  # TRL's default on; PackedTrainer's reference runs in float32
        padding_free=True,
        max_length=None,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO / "configs" / "quickstart_vision" / "model")
    model = tiny_qwen2_vl(read_manifest(build).vision["image_token_id"]).train()
    packed = trainer_dataset(build, args)
    return PackedSFTTrainer(model=model, args=args, packed=packed, processing_class=tokenizer, loss=loss)


@pytest.mark.parametrize("loss", ["chunked", "model"])
def test_the_sft_trainer_trains_a_vision_build_as_packed_trainer(quickstart_vision, reference, tmp_path, loss):
    """loss="chunked" is packtool's loss from the last hidden states; loss="model" is TRL's compute_loss (its fused
    LM head on the backbone fed the images): both equal PackedTrainer's on the same packs."""
    sft = train(sft_trainer(quickstart_vision, tmp_path, loss))
    assert sft["loss"] == loss
    assert sft["hashes"] == reference["hashes"] and len(sft["hashes"]) == 2
    assert sft["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert len(sft["losses"]) == 2
    if loss == "model":  # TRL's metrics come with its loss: its running token count is the packs' tokens
        running = list(itertools.accumulate(log["input_tokens"] for log in sft["logs"]))
        assert [log["num_tokens"] for log in sft["logs"]] == running


def test_the_images_reach_the_model(quickstart_vision, reference, tmp_path):
    """Each training forward of PackedSFTTrainer gets its micro-batch's pixel_values and image grids, the ones
    PackedTrainer's forward gets."""
    sft = train(sft_trainer(quickstart_vision, tmp_path, "chunked"))
    assert len(sft["fed"]) == 2 and all(n > 0 and grids for n, grids in sft["fed"])
    assert sft["fed"] == reference["fed"]
    for n, grids in sft["fed"]:  # a pixel_values row per patch of every image
        assert n == sum(t * h * w for t, h, w in grids)


DDP_RUN = """
import json
import sys
from pathlib import Path

import torch, transformers, trl
sys.path[:0] = [sys.argv[2], str(Path(sys.argv[2]).parent)]
from test_vision import tiny_qwen2_vl
from packtool.format import read_manifest
from packtool.loader.hf import PackedSFTTrainer, trainer_dataset

torch.set_num_threads(1)
build = Path(sys.argv[1])
args = trl.SFTConfig(output_dir=sys.argv[3], max_steps=2, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                     save_strategy="no", disable_tqdm=True, ddp_backend="gloo", bf16=False, padding_free=True,
                     max_length=None, dataset_kwargs={"skip_prepare_dataset": True})
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[4])
model = tiny_qwen2_vl(read_manifest(build).vision["image_token_id"]).train()
trainer = PackedSFTTrainer(model=model, args=args, packed=trainer_dataset(build, args, shuffle=False),
                           processing_class=tokenizer)
imageless = []
model.register_forward_pre_hook(
    lambda _m, _a, kwargs: imageless.append(model.training and kwargs.get("pixel_values") is None), with_kwargs=True
)
trainer.train()
result = [args.ddp_find_unused_parameters, sum(imageless)]  # a file each: the ranks' prints interleave
Path(sys.argv[3]).mkdir(parents=True, exist_ok=True)
Path(sys.argv[3], f"rank{args.process_index}.json").write_text(json.dumps(result))
"""


def test_ddp_trains_a_micro_batch_without_images(quickstart_vision, tmp_path):
    """Two ranks under TRL's default gradient checkpointing, one pack each: the rank whose pack has no image
    leaves the vision tower without gradients, and DDP waited for them forever until the trainer had it look
    for unused parameters (as TRL does when given a processor rather than a tokenizer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "run.py"
    script.write_text(DDP_RUN)
    tokenizer = REPO / "configs" / "quickstart_vision" / "model"
    here = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += [str(script), str(quickstart_vision), here, str(tmp_path / "out"), str(tokenizer)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    pipe = subprocess.PIPE
    run = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        _, stderr = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)  # the ranks too, not torchrun alone
        run.communicate()
        pytest.fail("the two ranks hung (DDP waiting for the vision tower's gradients)")
    assert run.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [find_unused for find_unused, _ in ranks] == [True, True]
    assert sum(imageless for _, imageless in ranks) > 0  # a training forward without images happened


def test_packed_trainer_looks_for_unused_parameters_on_a_vision_build_only(quickstart_vision, make_build, tmp_path):
    """The same setting for PackedTrainer under gradient checkpointing; a text build's and a user's choice stand."""
    model = tiny_qwen2_vl(read_manifest(quickstart_vision).vision["image_token_id"])
    text, _ = make_build(n_packs=4)
    cases = [(quickstart_vision, None, True), (text, None, None), (quickstart_vision, False, False)]
    for build, setting, wanted in cases:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), gradient_checkpointing=True, ddp_find_unused_parameters=setting, **COMMON
        )
        PackedTrainer(model=model, args=args, train_dataset=trainer_dataset(build, args))
        assert args.ddp_find_unused_parameters is wanted


def test_reentrant_checkpointing_under_ddp_is_refused_on_a_vision_build(quickstart_vision, monkeypatch, tmp_path):
    """Reentrant checkpointing fails with DDP's search for unused parameters and hangs without it (a micro-batch
    without images): one line before training, unless the user chose."""
    from packtool.errors import DatasetError

    model = tiny_qwen2_vl(read_manifest(quickstart_vision).vision["image_token_id"])
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda _: 2))
    reentrant = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), **reentrant, **COMMON)
    with pytest.raises(DatasetError, match=r"reentrant gradient checkpointing: .* set gradient_checkpointing_kwargs"):
        PackedTrainer(model=model, args=args, train_dataset=trainer_dataset(quickstart_vision, args))
