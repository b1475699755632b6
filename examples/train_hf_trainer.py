"""Hugging Face Trainer on a packtool build, with the same token-level normalisation.

    python examples/train_hf_trainer.py OUT/ --steps 5 --accum 2

Trainer counts the targets of the whole accumulation window and passes that count to
`compute_loss` as `num_items_in_batch` (all ranks when `average_tokens_across_devices`). We
return sum(loss) / num_items_in_batch and tell Trainer not to divide by the accumulation steps
again (`loss_is_scaled_for_ga = True`). Each micro-batch is one flattened row of
`--packs-per-batch` packs, with position_ids restarting per segment.
Single process as written; under DDP give PackedDataset the rank/world size yourself and keep
Trainer from re-sharding it.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

from packtool.loader import PackedDataset, collate, token_loss_sum


def collate_for_trainer(rows):
    mb = collate(rows)
    return {"input_ids": mb.input_ids, "labels": mb.labels, "position_ids": mb.position_ids}


class PackedTrainer(transformers.Trainer):
    loss_is_scaled_for_ga = True  # compute_loss already divides by the window's target count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
        loss_sum, n_local = token_loss_sum(outputs.logits, inputs["labels"])
        if num_items_in_batch is None:  # evaluation: this batch alone
            loss = loss_sum / max(n_local, 1)
        else:
            loss = loss_sum / num_items_in_batch
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages gradients over ranks
        return (loss, outputs) if return_outputs else loss


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="a packtool build folder (with manifest.json)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--packs-per-batch", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=None)
    args = parser.parse_args(argv)

    from train_plain import tiny_model  # same tiny random Llama as the plain example

    torch.manual_seed(0)
    dataset = PackedDataset(args.build, seed=0)
    vocab = args.vocab_size or (dataset.manifest.get("tokenizer") or {}).get("vocab_size") or 32000
    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.packs_per_batch,
            gradient_accumulation_steps=args.accum,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            remove_unused_columns=False,
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
        )
        trainer = PackedTrainer(
            model=tiny_model(vocab), args=training_args, train_dataset=dataset, data_collator=collate_for_trainer
        )
        trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


if __name__ == "__main__":
    main()
