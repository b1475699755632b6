"""Hugging Face `Trainer` and TRL `SFTTrainer` on a packtool build, without a custom training loop.

What a Trainer user needs, and where it is:

    data per rank        `trainer_dataset(path, args)`: a PackedDataset wired to args.process_index / world_size,
                         one pack per rank per round, so every rank runs the same number of steps
    batches              `PackedCollator(model)`: the Trainer's per_device_train_batch_size packs -> one
                         flattened row with the boundaries the model's layer types read (`model_inputs`:
                         restarting position_ids, cu_seq_lens_q/k, seq_idx, mRoPE positions, a vision build's
                         pixel_values and image_grid_thw; docs/isolation.md);
                         `one_document_per_row=True` pads each document into its own row instead
    isolation            `train()` first runs `check_isolation` (two forwards on a short packed row through
                         the trainer's own collator) and stops with one line when the model lets one
                         document change another; PACKTOOL_SKIP_ISOLATION_CHECK=1 skips it
    the loss             the Trainer's normalisation: sum / N, where the Trainer counts N over the whole
                         accumulation window and, with `average_tokens_across_devices` (default), over all
                         ranks, then multiplies by the world size against DDP's gradient average. The
                         window-wide token mean, unchanged by packing, micro-batch or rank split
                         (tests/loader/test_hf.py). The sum comes from the last hidden states, a chunk of
                         target rows at a time (`chunked_token_loss_sum`), never the [T, V] logits: a
                         151,936-token vocabulary over 8,192 tokens is 5 GB of float32 logits and as much
                         again for their gradient. `loss="model"` takes the model's own loss instead; a model
                         whose logits are more than its output layer on the last hidden states (soft-capping,
                         a logit scale) is found at train() by comparing the two, and gets its own loss
    the data order       saved beside every checkpoint (`packtool_data.json`, the dataset's global state) and
                         restored by `train(resume_from_checkpoint=...)`; the Trainer's own batch skipping is
                         turned off (`ignore_data_skip`), so a resume reads no batch twice and skips none,
                         also under another world size. `packtool_trainer.json` beside it holds the run's
                         gradient_accumulation_steps, which `packtool trace --checkpoint` needs and HF keeps
                         only in the pickled training_args.bin
    metrics              per logging window: input_tokens, target_tokens, segments, padding_slots added to the
                         Trainer's logs next to the loss (this rank's counts)
    provenance           `trainer.last_pack_hashes`: the packs of the micro-batch just trained

    args = TrainingArguments(output_dir=..., per_device_train_batch_size=4, gradient_accumulation_steps=2, ...)
    trainer = PackedTrainer(model=model, args=args, train_dataset=trainer_dataset("out/", args))
    trainer.train()                              # or train(resume_from_checkpoint=True)

TRL: `PackedSFTTrainer` is the same on top of `trl.SFTTrainer` with `padding_free=True`: TRL's own
padding-free collator takes each pack as one example {input_ids, labels, seq_lengths}, so its
flattened rows keep packtool's labels and segment boundaries. Give it `packed=trainer_dataset(path, args)`
(it hands TRL `sft_dataset(packed)`, as TRL accepts only `datasets` types) and
`SFTConfig(padding_free=True, dataset_kwargs={"skip_prepare_dataset": True})`. A vision build's packs go
through `PackedCollator` instead (TRL's padding-free collator has no place for pixel_values, image_grid_thw
and the mRoPE positions); TRL's trainer does the rest, its loss="model" path included.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as err:  # pragma: no cover - exercised without transformers
    raise ImportError("packtool.loader.hf needs transformers: pip install 'packtool[hf]'") from err

from packtool.errors import DatasetError
from packtool.loader.boundaries import model_inputs, one_document_per_row
from packtool.loader.collate import LoadedPack, MicroBatch, collate
from packtool.loader.dataset import PackedDataset
from packtool.loader.loss import chunked_token_loss_sum, token_loss_sum
from packtool.loader.probe import GUARD_LENGTHS, check_isolation, packed_row, synthetic_docs

__all__ = [  # + PackedSFTTrainer (needs trl)
    "PackedCollator",
    "PackedTrainer",
    "check_isolation",
    "model_inputs",
    "one_document_per_row",
    "sft_dataset",
    "trainer_dataset",
]

LOSSES = ("chunked", "model")  # from the last hidden states a chunk at a time, or the model's own (with the logits)
STATE_FILE = "packtool_data.json"
TRAINER_FILE = "packtool_trainer.json"
log = logging.getLogger(__name__)
POSITION_KEY = "packtool_resume_after"  # ride in each batch from the collator to training_step, popped there
HASHES_KEY = "packtool_pack_hashes"
EPOCH_END_KEY = "packtool_epoch_end"


def trainer_dataset(path: str | Path, args: transformers.TrainingArguments, **options: Any) -> PackedDataset:
    """A PackedDataset for this Trainer process: its rank, world size, worker count and seed."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    return PackedDataset(
        path,
        rank=args.process_index,
        world_size=args.world_size,
        num_workers=args.dataloader_num_workers,
        seed=seed,
        **options,
    )


class PackedCollator:
    """Packs -> one Trainer batch: a flattened row [1, T] with the boundaries `model` reads (`model_inputs`).

    Without a model: input_ids, labels and restarting position_ids (+ the flash-attention offsets
    when `flash`). `one_document_per_row`: each document its own right-padded row [S, Lmax], for
    models whose layers cannot keep packed documents apart (same targets, same loss normaliser).
    """

    def __init__(self, model: Any = None, *, flash: bool = False, one_document_per_row: bool = False) -> None:
        self.model, self.flash, self.one_document_per_row = model, flash, one_document_per_row

    def __call__(self, packs: list[LoadedPack]) -> dict[str, Any]:
        mb = collate(packs)
        if self.one_document_per_row:
            return one_document_per_row(mb)
        if self.model is not None:
            return {**model_inputs(mb, self.model), "labels": mb.labels}
        batch: dict[str, Any] = {"input_ids": mb.input_ids, "labels": mb.labels, "position_ids": mb.position_ids}
        if self.flash:
            batch.update(mb.flash_kwargs())
        return batch


def sft_example(pack: LoadedPack) -> dict[str, Any]:
    """One pack as the example TRL's padding-free collator reads: its segments are `seq_lengths`.

    TRL's collator has no place for a pack's images, so a vision build's pack is refused rather than trained
    with its image tokens read as text (PackedSFTTrainer collates such packs with PackedCollator)."""
    if pack.images is not None:
        raise DatasetError(
            "a vision build's packs carry images, which TRL's padding-free collator drops: train it with "
            "PackedSFTTrainer or PackedTrainer (their PackedCollator feeds pixel_values, image_grid_thw and the "
            "mRoPE positions)"
        )
    return {
        "input_ids": pack.input_ids.tolist(),
        "labels": pack.labels.tolist(),
        "seq_lengths": np.diff(pack.cu_seqlens).tolist(),
    }


def sft_dataset(dataset: PackedDataset):
    """The dataset as a `datasets.IterableDataset` of TRL examples (what SFTTrainer's type check accepts).

    PackedSFTTrainer reads the PackedDataset itself (position tracking, no re-sharding); this
    wrapper is what TRL inspects, and iterates this rank's packs if anything does read it.
    """
    import datasets

    def examples() -> Iterator[dict[str, Any]]:
        for pack in dataset:
            yield sft_example(pack)

    return datasets.IterableDataset.from_generator(examples)


def _first_pack_text(dataset: PackedDataset):
    """A vision build's first pack without its images: the one example TRL reads at init to choose its
    collator (an example with images it refuses under padding_free). Never trained from: PackedSFTTrainer
    reads the packs themselves, images included, through PackedCollator."""
    import datasets

    first = next(iter(dataset))
    return datasets.Dataset.from_list([sft_example(replace(first, images=None))])


class _Batches(IterableDataset):
    """The rank's packs in plan order, `batch_size` consecutive packs per item.

    Batches, not packs, are the DataLoader's items: a worker then hands out whole batches of
    consecutive rounds (worker w: batches w, w+k, ...), so the batches arrive in plan order and
    each one's last pack says where a resume starts, whatever the worker count.
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, drop_last: bool) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[LoadedPack]]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        packs = (pack for round_ in self.dataset._rounds(0, 1) for pack in round_)
        batches = iter(lambda: list(itertools.islice(packs, self.batch_size)), [])
        if self.drop_last:
            batches = itertools.takewhile(lambda batch: len(batch) == self.batch_size, batches)
        batch, i = next(batches, None), 0
        while batch is not None:
            after = next(batches, None)  # one batch ahead: the pass's last one is marked
            if i % n_workers == worker:
                yield batch if after is not None else _LastBatch(batch)
            batch, i = after, i + 1


class _LastBatch(list[LoadedPack]):
    """The last batch of a pass (a dropped tail follows it): training it ends the dataset's epoch."""


class _PackedMixin:
    """Shared by PackedTrainer and PackedSFTTrainer: DataLoader, data-order checkpoints, window metrics."""

    packed: PackedDataset
    last_pack_hashes: list[str]  # the micro-batch last trained (pack_hash -> shard row -> sample ids)
    loss: str  # LOSSES
    _packs_as_examples = False

    def _setup_packed(self, dataset: PackedDataset, loss: str) -> None:
        if not isinstance(dataset, PackedDataset):
            raise DatasetError("train a PackedTrainer on packtool.loader.hf.trainer_dataset(path, args)")
        if loss not in LOSSES:
            raise DatasetError(f"loss={loss!r}: one of {', '.join(map(repr, LOSSES))}")
        self.loss = loss
        if dataset.token_budget is not None or dataset.balance is not None:
            raise DatasetError(
                "a Trainer batches packs itself (per_device_train_batch_size): build the dataset without "
                "token_budget / balance (trainer_dataset(path, args))"
            )
        self.packed = dataset
        self.args.ignore_data_skip = True  # type: ignore[attr-defined]  # the data order is restored from our state
        self._window = dict.fromkeys(("input_tokens", "target_tokens", "segments", "padding_slots"), 0)
        self.add_callback(_SaveDataOrder(self))  # type: ignore[attr-defined]

    def get_train_dataloader(self) -> DataLoader:
        """A plain per-rank DataLoader: the dataset is already this rank's share (no accelerate re-sharding)."""
        args = self.args  # type: ignore[attr-defined]
        return DataLoader(
            _Batches(self.packed, args.per_device_train_batch_size, args.dataloader_drop_last),
            batch_size=None,  # items are already batches of consecutive packs
            collate_fn=self._collate,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
        )

    def _collate(self, packs: list[LoadedPack]) -> dict[str, Any]:
        collator = self.data_collator  # type: ignore[attr-defined]
        batch = dict(collator([sft_example(p) for p in packs] if self._packs_as_examples else packs))
        batch[POSITION_KEY] = packs[-1].resume_after
        batch[EPOCH_END_KEY] = isinstance(packs, _LastBatch)
        batch[HASHES_KEY] = [p.pack_hash for p in packs]
        return batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        position = inputs.pop(POSITION_KEY)
        epoch_ends = inputs.pop(EPOCH_END_KEY)
        self.last_pack_hashes = inputs.pop(HASHES_KEY)  # provenance of the micro-batch just trained
        positions = inputs["position_ids"]
        positions = positions[0] if positions.ndim == 3 else positions  # mRoPE: text positions come first
        mask = inputs.get("attention_mask")
        n_tokens = int(inputs["input_ids"].numel() if not isinstance(mask, torch.Tensor) else mask.sum())
        self._window["padding_slots"] += int(inputs["input_ids"].numel()) - n_tokens
        self._window["input_tokens"] += n_tokens
        self._window["target_tokens"] += int((inputs["labels"][..., 1:] != -100).sum())
        self._window["segments"] += int((positions == 0).sum())
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        if epoch_ends:  # the next pass reads the next epoch (not the tail drop_last left, again and again)
            self.packed.set_epoch(self.packed.epoch + 1)
        else:
            self.packed.advance(position)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:
            logs = {**logs, **self._window}
            self._window = dict.fromkeys(self._window, 0)
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval: Any = None
    ):
        self._check_isolation()
        self._check_loss()
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
        if isinstance(checkpoint, str):
            state_file = Path(checkpoint) / STATE_FILE
            if not state_file.is_file():
                raise DatasetError(f"{checkpoint}: no {STATE_FILE}; it was not written by a packtool trainer")
            self.packed.load_state_dict(json.loads(state_file.read_text()))
        return super().train(  # type: ignore[misc]
            resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss with the model's own normalisation, from the last hidden states."""
        if self.loss != "chunked" or return_outputs or "labels" not in inputs:
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        features = {key: value for key, value in inputs.items() if key != "labels"}
        hidden, weight = self._last_hidden(model, features)
        loss_sum, n_targets = chunked_token_loss_sum(hidden, weight, inputs["labels"])
        # as the Trainer's compute_loss and a causal LM's loss do it: the window's N when the model takes it
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:  # type: ignore[attr-defined]
            loss = loss_sum / num_items_in_batch
            if self.args.average_tokens_across_devices:  # type: ignore[attr-defined]
                processes = self.accelerator.num_processes // self.get_tp_size()  # type: ignore[attr-defined]
                loss = loss * (processes if self.args.n_gpu <= 1 else self.args.n_gpu)  # type: ignore[attr-defined]
            return loss
        return loss_sum / max(n_targets, 1)

    def _last_hidden(self, model: Any, features: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's last hidden states and the output layer's weight, from a forward of the model
        as the Trainer wrapped it (DDP's hooks run) that computes the logits of one position only."""
        unwrapped = self.accelerator.unwrap_model(model)  # type: ignore[attr-defined]
        captured: list[Any] = []
        handle = unwrapped.get_decoder().register_forward_hook(lambda _m, _a, output: captured.append(output))
        try:
            model(**features, logits_to_keep=1)
        finally:
            handle.remove()
        output = captured[-1]
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        return hidden, unwrapped.get_output_embeddings().weight

    def _check_loss(self) -> None:
        """The chunked loss against the model's own on a short packed row; a model whose logits are not
        its output layer on the last hidden states (Gemma-2's soft-capping, Cohere's logit scale) or
        that cannot compute one position's logits gets its own loss, with one line saying so."""
        if self.loss != "chunked":
            return
        model = self.model  # type: ignore[attr-defined]
        why = _chunked_loss_problem(model, self._guard_inputs, self._last_hidden)
        if why is not None:
            log.warning("%s: %s; training with the model's own loss, which holds the [T, V] logits", type(model), why)
            self.loss = "model"

    def _check_isolation(self) -> None:
        """Two forwards of the real model on a short packed row, fed through this trainer's collator."""
        check_isolation(self.model, feed=self._guard_inputs, fallback=self._one_per_row)  # type: ignore[attr-defined]

    @property
    def _one_per_row(self) -> str:
        """The way this trainer trains one document per row, spelled as a user writes it."""
        way = "PackedTrainer(..., data_collator=PackedCollator(model, one_document_per_row=True))"
        if self._packs_as_examples:  # TRL's collator packs its rows: PackedTrainer is the way out
            return f"train one document per row on {way}; TRL's padding-free collator always packs"
        return f"train one document per row: {way}"

    def _guard_inputs(self, mb: MicroBatch, model: Any) -> dict[str, Any]:
        pack = LoadedPack(
            input_ids=mb.input_ids[0].cpu().numpy(),
            labels=mb.labels[0].cpu().numpy(),
            cu_seqlens=mb.cu_seqlens.cpu().numpy(),
        )
        collator = self.data_collator  # type: ignore[attr-defined]
        batch = dict(collator([sft_example(pack)] if self._packs_as_examples else [pack]))
        device = next(model.parameters()).device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}


def _chunked_loss_problem(model: Any, feed: Any, last_hidden: Any) -> str | None:
    """Why the chunked loss would not be the model's own on a short packed row (float32), or None."""
    if not any(name == "logits_to_keep" for name in inspect.signature(model.forward).parameters):
        return "its forward takes no logits_to_keep, so its logits cannot be left out"
    if model.get_output_embeddings() is None or getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "its output layer is not a weight alone"
    mb = packed_row(synthetic_docs(GUARD_LENGTHS, int(model.config.get_text_config().vocab_size)))
    features = feed(mb, model)
    labels = mb.labels.to(next(model.parameters()).device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own, _ = token_loss_sum(model(**features).logits.float(), labels)
            hidden, weight = last_hidden(model, features)
            chunked, _ = chunked_token_loss_sum(hidden.float(), weight.float(), labels)
    except Exception as err:  # a model that refuses logits_to_keep or the hook: its own loss is the way
        return f"the chunked loss could not run ({type(err).__name__}: {err})"
    finally:
        model.train(training)
    if not torch.isclose(own, chunked, rtol=1e-4, atol=1e-5):
        return f"its logits are more than its output layer on the last hidden states (loss {own:.6f} vs {chunked:.6f})"
    return None


class _SaveDataOrder(transformers.TrainerCallback):
    """Writes the dataset's global state into each checkpoint folder (rank 0; every rank holds the same)."""

    def __init__(self, trainer: _PackedMixin) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE_FILE).write_text(json.dumps(self.trainer.packed.state_dict(), indent=2) + "\n")
            steps = {"gradient_accumulation_steps": args.gradient_accumulation_steps}
            (folder / TRAINER_FILE).write_text(json.dumps(steps, indent=2) + "\n")
        return control


def _find_unused_for_images(dataset: PackedDataset, args: Any) -> None:
    """Under DDP, a vision build's micro-batch without images leaves the vision tower without gradients, which
    the other ranks wait for forever (a hang, seen under TRL's default gradient checkpointing) unless DDP looks
    for unused parameters; transformers turns that off under gradient checkpointing, and TRL turns it back on
    only when given a processor. Reentrant checkpointing fails with that search (both seen on two CPU ranks),
    so there a user who has not chosen is stopped in one line instead of left to hang."""
    if not isinstance(dataset, PackedDataset) or dataset.manifest.vision is None:
        return  # not a vision build (or not a PackedDataset, which _setup_packed refuses)
    if args is None or args.ddp_find_unused_parameters is not None:
        return
    if not (args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        args.ddp_find_unused_parameters = True
    elif args.gradient_checkpointing and args.world_size > 1:
        raise DatasetError(
            "a vision build under DDP with reentrant gradient checkpointing: a micro-batch without images leaves "
            "the vision tower without gradients, which the ranks then wait for forever, and DDP's search for unused "
            "parameters fails under reentrant checkpointing; set gradient_checkpointing_kwargs={'use_reentrant': "
            "False}, or ddp_find_unused_parameters=False when every micro-batch holds an image"
        )


class PackedTrainer(_PackedMixin, transformers.Trainer):
    """`transformers.Trainer` reading a packtool build: see the module docstring."""

    def __init__(
        self, *, train_dataset: PackedDataset, data_collator: Any = None, loss: str = "chunked", **kwargs: Any
    ) -> None:
        _find_unused_for_images(train_dataset, kwargs.get("args"))
        collator = data_collator or PackedCollator(kwargs.get("model"))
        super().__init__(train_dataset=train_dataset, data_collator=collator, **kwargs)
        self._setup_packed(train_dataset, loss)


def _sft_trainer_base():
    import trl

    return trl.SFTTrainer


def __getattr__(name: str) -> Any:
    # trl is optional: PackedSFTTrainer is built on first use so `import packtool.loader.hf` needs only transformers.
    if name == "PackedSFTTrainer":
        base = _sft_trainer_base()

        class PackedSFTTrainer(_PackedMixin, base):  # type: ignore[misc, valid-type]
            """`trl.SFTTrainer(padding_free=True)` reading a packtool build through TRL's own collator, a vision
            build's through PackedCollator (its images, grids and mRoPE positions)."""

            _packs_as_examples = True

            def __init__(self, *, packed: PackedDataset, loss: str = "chunked", **kwargs: Any) -> None:
                if packed.manifest.vision is None:
                    super().__init__(train_dataset=sft_dataset(packed), **kwargs)
                else:  # TRL refuses a collator of ours beside padding_free: it builds its own, replaced here
                    _find_unused_for_images(packed, kwargs.get("args"))
                    super().__init__(train_dataset=_first_pack_text(packed), **kwargs)
                    self.data_collator = PackedCollator(self.model)
                    self._packs_as_examples = False
                self._setup_packed(packed, loss)

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                if self._packs_as_examples or self.loss != "model" or return_outputs or not model.training:
                    return super().compute_loss(
                        model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                    )
                # TRL's loss counts a batch's tokens by its attention_mask when the key is there (PackedCollator's
                # is None, the forward's default, which TRL cannot sum: left out), else by position_ids.size(1),
                # which is 1 for the [4, 1, T] mRoPE rows: counted here
                before = self._total_train_tokens
                inputs = {key: value for key, value in inputs.items() if key != "attention_mask" or value is not None}
                loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                tokens = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
                counted = self.accelerator.gather_for_metrics(tokens).sum().item()
                self._total_train_tokens = before + counted // self._tp_size
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
                return loss

        globals()["PackedSFTTrainer"] = PackedSFTTrainer
        return PackedSFTTrainer
    raise AttributeError(f"module 'packtool.loader.hf' has no attribute {name!r}")
