"""Token-level loss normalised over the whole update window (all micro-batches, all ranks).

The objective is the mean over every target token of the window::

    L = (sum over ranks r, micro-batches m of S_rm) / N,   N = sum of n_targets over the window

S_rm = token_loss_sum(...) is a sum, never a mean, so neither the packing, the micro-batch split nor
the rank split changes L. DDP averages gradients over W ranks, so rank r backpropagates
W * S_rm / N for each of its micro-batches and the average is exactly dL. Dividing each
micro-batch's mean by the number of micro-batches instead (mean of means) weights a token by
1 / (its micro-batch's target count): repacking then changes the gradient.

Worked example, one rank, two micro-batches: mb0 holds A (2 targets) and B (1), mb1 holds C (3)::

    N = 6            backprop S_0 / 6, then S_1 / 6      -> mean over the 6 targets
    mean of means    (S_0 / 3 + S_1 / 3) / 2             -> A's tokens weigh 1/6, C's 1/6 (equal
                                                             here by luck; move B to mb1 and they differ)

When the window has no target at all (N == 0) every rank skips the step; a rank with no local
target but N > 0 still runs forward and backward (its loss is 0 but the graph reaches every
parameter, so DDP's gradient all-reduce sees all of them on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packtool.errors import PacktoolError
from packtool.loader.collate import IGNORE_INDEX, MicroBatch


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of cross-entropy over targets, number of targets), Hugging Face shift inside.

    logits [B, T, V] at t predict labels[:, t + 1]; labels -100 are ignored. Accumulates in at
    least float32 so bf16 logits do not lose the sum. With every label ignored the sum is a 0
    that still depends on the logits (backward reaches every parameter).
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    acc = torch.promote_types(logits.dtype, torch.float32)
    loss_sum = F.cross_entropy(shift_logits.to(acc), shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((shift_labels != IGNORE_INDEX).sum())


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per position of the shifted pairs ([B, T-1], 0 where the label is ignored)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    shift_labels = labels[:, 1:].to(logits.device)
    return F.cross_entropy(
        logits[:, :-1].to(acc).transpose(1, 2), shift_labels, ignore_index=IGNORE_INDEX, reduction="none"
    )


def count_window_targets(micro_batches: Iterable[MicroBatch]) -> int:
    """Targets in this rank's micro-batches of one update window (known before any forward)."""
    return sum(mb.n_targets for mb in micro_batches)


def global_target_count(n_local: int, group=None, device: torch.device | str | None = None) -> int:
    """The window's target count over all ranks: one all_reduce(SUM); n_local when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return int(n_local)
    if device is None:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([int(n_local)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


@dataclass(frozen=True, slots=True)
class WindowNorm:
    """How to scale each micro-batch's loss sum in one update window on this rank."""

    n_local: int
    n_global: int
    world_size: int

    @property
    def skip(self) -> bool:
        """True on every rank at once when the window has no target anywhere."""
        return self.n_global == 0

    @property
    def scale(self) -> float:
        """Multiply each micro-batch's loss sum by this before backward: W / N_global."""
        return 0.0 if self.skip else self.world_size / self.n_global

    def loss_for_backward(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum * self.scale


def window_norm(micro_batches: Iterable[MicroBatch] | int, group=None) -> WindowNorm:
    """Count this rank's targets and all-reduce once; micro_batches may also be the count itself."""
    n_local = micro_batches if isinstance(micro_batches, int) else count_window_targets(micro_batches)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return WindowNorm(n_local=n_local, n_global=global_target_count(n_local, group), world_size=world)


SAMPLE_POLICIES = ("skip", "error")


def sample_mean_loss(
    logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, *, empty: str = "skip"
) -> tuple[torch.Tensor, int]:
    """(sum over samples of each sample's mean target loss, number of samples counted). B must be 1.

    A different objective from the token mean: every sample weighs the same whatever its
    length (a 2-target answer counts as much as a 500-target one). Divide by the window's
    sample count (all-reduced like the target count). A segment with zero targets is skipped
    (`empty="skip"`) or raises (`empty="error"`); with padding segments in fixed-shape batches
    use "skip".
    """
    if empty not in SAMPLE_POLICIES:
        raise ValueError(f"empty must be one of {SAMPLE_POLICIES}, got {empty!r}")
    if logits.shape[0] != 1:
        raise ValueError(f"sample_mean_loss takes a flattened batch [1, T, V], got {tuple(logits.shape)}")
    total = labels.shape[1]
    losses = per_token_losses(logits, labels)[0]  # position t-1 scores labels[t]
    cu = cu_seqlens.to(device=logits.device, dtype=torch.long)
    seg_of_label = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])[1:]
    is_target = labels[0, 1:].to(logits.device) != IGNORE_INDEX
    n_seg = len(cu) - 1
    sums = torch.zeros(n_seg, dtype=losses.dtype, device=losses.device).index_add(0, seg_of_label, losses)
    counts = torch.zeros(n_seg, dtype=torch.long, device=losses.device).index_add(0, seg_of_label, is_target.long())
    if total and empty == "error" and bool((counts == 0).any()):
        bad = int(torch.nonzero(counts == 0)[0])
        raise PacktoolError(f"segment {bad} (tokens {int(cu[bad])}:{int(cu[bad + 1])}) has no target")
    keep = counts > 0
    means = sums[keep] / counts[keep]
    return means.sum() + losses.sum() * 0, int(keep.sum())
