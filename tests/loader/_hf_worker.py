"""One Hugging Face Trainer run on a packtool build (plain `python` or under `torchrun`), for test_hf.py.

    python _hf_worker.py BUILD OUT.json --output DIR --steps 3 --accum 4 [--save-steps 2] [--resume] [--trl]

Writes {"losses": [...per step...], "hashes": [[pack hashes of each trained micro-batch]], "world": W}
from rank 0 (hashes gathered from every rank).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

from packtool.loader.hf import PackedTrainer, trainer_dataset


def tiny_llama(vocab: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        use_cache=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("build")
    parser.add_argument("out")
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--trl", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    common = {
        "output_dir": args.output,
        "max_steps": args.steps,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": args.accum,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",  # a resumed run then matches the uninterrupted one step for step
        "logging_steps": 1,
        "save_strategy": "steps" if args.save_steps else "no",
        "save_steps": args.save_steps or 500,
        "report_to": [],
        "use_cpu": True,
        "ddp_backend": "gloo" if distributed else None,
        "dataloader_num_workers": args.workers,
        "seed": 0,
        "disable_tqdm": True,
    }
    if args.trl:
        import trl

        from packtool.loader.hf import PackedSFTTrainer

        targs = trl.SFTConfig(
            **common, padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True}
        )
        dataset = trainer_dataset(args.build, targs)
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(dataset.path / dataset.manifest.raw["tokenizer"]["file"]), pad_token="<pad>"
        )
        trainer: PackedTrainer = PackedSFTTrainer(
            model=tiny_llama(dataset.manifest.vocab_size), args=targs, packed=dataset, processing_class=tokenizer
        )
    else:
        targs = transformers.TrainingArguments(**common)
        dataset = trainer_dataset(args.build, targs)
        trainer = PackedTrainer(model=tiny_llama(dataset.manifest.vocab_size), args=targs, train_dataset=dataset)

    trained: list[list[str]] = []
    step = trainer.training_step

    def recording(*args, **kwargs):
        loss = step(*args, **kwargs)
        trained.append(list(trainer.last_pack_hashes))  # in the main process, whatever the worker count
        return loss

    trainer.training_step = recording
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    gathered = [trained]
    if distributed:
        gathered = [None] * int(os.environ["WORLD_SIZE"])
        torch.distributed.all_gather_object(gathered, trained)
    result = {"losses": losses, "hashes": gathered, "world": len(gathered)}
    if trainer.is_world_process_zero():
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    if distributed:
        # Gloo's threads can abort a finished rank ("terminate called without an active exception", seen
        # twice in CI): both ranks pass a barrier before the group goes, and the script skips interpreter
        # finalization below.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    from _ddp_worker import exit_skipping_finalization

    main()
    exit_skipping_finalization()
