"""Runs in each spawned DDP process (kept apart from the test module so children import only torch)."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32)).double()


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, port: int) -> Iterator[None]:
    """One rank of a two-process gloo group that ends without aborting a finished rank.

    Gloo aborts a process (SIGABRT, "terminate called without an active exception") when a peer tears down
    while its threads still hold work, or when its threads outlive the interpreter: both ranks pass a
    barrier before the group is destroyed, and a rank whose body succeeded skips interpreter finalization
    (its results are already on disk; a failing body still raises and exits non-zero).
    """
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_skipping_finalization()


def exit_skipping_finalization() -> None:
    """Exit 0 without interpreter finalization, where gloo's leftover threads can abort a finished rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(rank: int, world_size: int, port: int, rank_batches: list, out_file: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)

    from packtool.loader.collate import collate
    from packtool.loader.loss import token_loss_sum, window_norm

    with gloo_rank(rank, world_size, port):
        model = DDP(tiny_model())
        mbs = [collate(packs) for packs in rank_batches[rank]]
        norm = window_norm(mbs)  # the one all_reduce of the window's target count
        for i, mb in enumerate(mbs):
            sync = i == len(mbs) - 1  # DDP all-reduces gradients once, on the last micro-batch
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                loss_sum, _ = token_loss_sum(model(mb.input_ids), mb.labels)
                norm.loss_for_backward(loss_sum).backward()
        grads = {name: p.grad.clone() for name, p in model.module.named_parameters()}
        torch.save({"grads": grads, "n_local": norm.n_local, "n_global": norm.n_global}, out_file)
