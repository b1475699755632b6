"""Hugging Face Trainer on a packtool build: packtool.loader.hf does the wiring.

    python examples/train_hf_trainer.py OUT/ --steps 5 --accum 2
    torchrun --nproc_per_node 2 examples/train_hf_trainer.py OUT/ --steps 5     # DDP (gloo on CPU)
    python examples/train_hf_trainer.py OUT/ --steps 8 --resume                  # continue from the last checkpoint

`trainer_dataset` gives each rank its share (every rank the same number of steps),
`PackedTrainer` flattens `--packs-per-batch` packs into one padding-free row per micro-batch,
keeps the Trainer's own token-level loss over the whole accumulation window and all ranks
(`num_items_in_batch`), writes the data order into every checkpoint and restores it on resume.
The logs carry input_tokens, target_tokens, segments and padding_slots next to the loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers

from packtool.loader.hf import PackedTrainer, trainer_dataset


def training_args(out: str, args: argparse.Namespace) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=args.packs_per_batch,
        gradient_accumulation_steps=args.accum,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        seed=0,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="a packtool build folder (with manifest.json)")
    parser.add_argument("--output", default="hf-trainer-out", help="checkpoints go here")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--packs-per-batch", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    parser.add_argument("--vocab-size", type=int, default=None)
    args = parser.parse_args(argv)

    from train_plain import tiny_model  # same tiny random Llama as the plain example

    targs = training_args(args.output, args)
    dataset = trainer_dataset(args.build, targs)
    torch.manual_seed(0)
    model = tiny_model(args.vocab_size or dataset.manifest.vocab_size or 32000)
    trainer = PackedTrainer(model=model, args=targs, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if torch.distributed.is_initialized():
        # the Trainer leaves the process group to interpreter exit, where gloo's threads can abort the process
        torch.distributed.destroy_process_group()
    return [log for log in trainer.state.log_history if "loss" in log]


if __name__ == "__main__":
    main()
