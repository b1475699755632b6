"""Plain PyTorch training on a packtool build: gradient accumulation, token-level normalisation.

    python examples/train_plain.py OUT/ --steps 5 --accum 2 --token-budget 2048
    python examples/train_plain.py OUT/ --epochs 3                  # every window of epochs 0, 1, 2
    python examples/train_plain.py OUT/ --steps 5 --packs-per-step 16 --alpha 2048
    python examples/train_plain.py OUT/ --steps 5 --full-logits

Every update window (`--accum` micro-batches on each rank, or with `--packs-per-step` one step
of the attention-balanced plan) is normalised by its total target count N (one all_reduce
across ranks), so each target token weighs 1/N whatever the packing or the micro-batch split.
Each step logs the window's metrics (input and target tokens, segments, padding, the loss
denominator, attention cost) next to the loss. The loss comes from the last hidden states and the
output weight in chunks, never holding the [T, V] logits (at Qwen's 151,936-token vocabulary the
[8192, V] float32 logits alone are 5 GB); `--full-logits` uses the model's logits instead (needed
when the head adds soft-capping or a logit scale). Epochs run inside `packed_batches`: each is
shuffled by (seed, epoch), and a run resumed from `dataset.state_dict()` ends where it would have.
Uses a tiny random Llama so it runs on CPU; swap in your model.
Multi-GPU: launch with torchrun; PackedDataset reads rank/world size from torch.distributed, and
every rank gets the same number of micro-batches per epoch.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import transformers

from packtool.loader import (
    PackedDataset,
    chunked_token_loss_sum,
    packed_batches,
    packed_steps,
    token_loss_sum,
    window_metrics,
    window_norm,
)
from packtool.loader.boundaries import model_inputs
from packtool.loader.probe import check_isolation


def tiny_model(vocab_size: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # use_cache stays True, as in real checkpoints: model_inputs turns the cache off
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


# model_inputs: the boundaries this model's layer types read (here restarting position_ids with
# attention_mask=None and no KV cache; cu_seq_lens, seq_idx or mRoPE positions for other families
# and backends, docs/isolation.md). check_isolation in main() runs the forward the loss uses.
def hidden_states(model, mb):  # the decoder's last hidden states: with the lm_head weight, no [T, V] logits
    return model.model(**model_inputs(mb, model)).last_hidden_state


def logits(model, mb):
    return model(**model_inputs(mb, model)).logits


def loss_sum(model, mb, chunked: bool = True):
    if chunked:
        return chunked_token_loss_sum(hidden_states(model, mb), model.lm_head.weight, mb.labels)[0]
    return token_loss_sum(logits(model, mb), mb.labels)[0]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="a packtool build folder (with manifest.json)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 5, or all with --epochs)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs to read (default: as many as --steps need)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--token-budget", type=int, default=2048, help="max tokens per micro-batch")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument(
        "--packs-per-step", type=int, default=None, help="balance ranks by attention cost: global packs per step"
    )
    parser.add_argument("--alpha", type=float, default=0.0, help="linear term of a pack's cost (with --packs-per-step)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the manifest's tokenizer vocab_size")
    parser.add_argument("--full-logits", action="store_true", help="loss from the [T, V] logits (default: chunked)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    balance = {"balance": "attention", "packs_per_step": args.packs_per_step, "alpha": args.alpha}
    dataset = PackedDataset(
        args.build,
        seed=0,
        num_workers=args.workers,
        token_budget=args.token_budget,
        **(balance if args.packs_per_step else {}),
    )
    vocab = args.vocab_size or dataset.manifest.vocab_size or 32000
    model = tiny_model(vocab).train()
    # the loss's own forward, twice: changing one packed document must not move another
    check_isolation(model, forward=logits if args.full_logits else hidden_states)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    epochs = args.epochs or math.inf  # math.inf: epoch after epoch until --steps
    if args.packs_per_step:  # the plan's steps: every rank has the same number, of balanced cost
        windows = packed_steps(dataset, epochs=epochs)
    else:  # the same number of micro-batches on every rank, `accum` per optimizer step
        batches = packed_batches(dataset, epochs=epochs)
        windows = iter(lambda: list(itertools.islice(batches, args.accum)), [])
    steps = args.steps or (None if args.epochs else 5)

    losses: list[float] = []
    for window in itertools.islice(windows, steps):
        norm = window_norm(window)  # N over all micro-batches and ranks, one all_reduce
        if norm.skip:  # no target anywhere in the window: every rank skips together
            continue
        total = 0.0
        for mb in window:  # under DDP wrap all but the last in model.no_sync()
            s = loss_sum(model, mb, chunked=not args.full_logits)
            norm.loss_for_backward(s).backward()  # W * S / N; DDP's average makes it S / N
            total += s.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / norm.n_global)
        metrics = window_metrics(window, norm, total)  # the loss over all ranks; tokens/s and targets/s from counts
        print(f"step {len(losses)}: loss {losses[-1]:.4f} {metrics.as_dict()} state {dataset.state_dict()}")
    return losses


if __name__ == "__main__":
    main()
