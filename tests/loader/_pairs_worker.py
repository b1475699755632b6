"""Runs in each spawned process of the two-rank pair-normalisation proof (children import only torch and the loader)."""

from __future__ import annotations

import torch


def run_rank(rank: int, world_size: int, port: int, rank_batches: list, beta: float, out_file: str) -> None:
    """rank_batches[rank]: micro-batches as (packs, group_ids, kinds)."""
    from _ddp_worker import gloo_rank, tiny_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from packtool.loader.collate import collate
    from packtool.loader.preference import dpo_loss, pair_window_norm, segment_logprobs

    torch.set_num_threads(1)
    with gloo_rank(rank, world_size, port):
        model, reference = DDP(tiny_model(0)), tiny_model(1)
        batches = rank_batches[rank]
        norm = pair_window_norm([torch.as_tensor(kinds) for _, _, kinds in batches])  # the one all_reduce
        for i, (packs, group_ids, kinds) in enumerate(batches):
            mb = collate(packs)
            ctx = model.no_sync() if i < len(batches) - 1 else torch.enable_grad()
            with ctx:
                policy = segment_logprobs(model(mb.input_ids), mb).sums
                with torch.no_grad():
                    ref = segment_logprobs(reference(mb.input_ids), mb).sums
                terms = dpo_loss(policy, ref, torch.as_tensor(group_ids), torch.as_tensor(kinds), beta)
                norm.loss_for_backward(terms.loss_sum).backward()
        grads = {name: p.grad.clone() for name, p in model.module.named_parameters()}
        torch.save({"grads": grads, "n_local": norm.n_local, "n_global": norm.n_global}, out_file)
