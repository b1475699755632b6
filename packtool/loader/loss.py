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
from packtool.labels import IGNORE_INDEX
from packtool.loader.collate import MicroBatch

DEFAULT_CHUNK = 1024  # rows of [chunk, V] fp32 logits at a time: 0.6 GB at V = 151,936, vs 2.5 GB per 4k tokens


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


class _ChunkedCrossEntropy(torch.autograd.Function):
    """sum_t CE(hidden[t] @ weight.T, target[t]) over rows of `chunk` positions; never holds [N, V].

    The gradient is computed in the forward pass, chunk by chunk, while the chunk's logits are in
    memory (d logits = softmax - onehot), and scaled by the incoming gradient in backward: the
    same work as one forward + backward of the full logits, with peak memory O(chunk * V).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for lo in range(0, hidden.shape[0], chunk):
            h, t = hidden[lo : lo + chunk], targets[lo : lo + chunk]
            logits = (h @ weight.T).to(acc)  # [c, V]: the only buffer of this size (softmax is made in place)
            picked = logits.gather(1, t[:, None]).squeeze(1)
            peak = logits.amax(dim=-1, keepdim=True)
            exp_sum = logits.sub_(peak).exp_().sum(dim=-1)
            total += (peak.squeeze(1) + exp_sum.log() - picked).sum()
            if want_h or want_w:
                logits.div_(exp_sum[:, None])  # softmax, then d logits = softmax - onehot
                logits[torch.arange(len(t), device=logits.device), t] -= 1
                if want_h:
                    grad_h[lo : lo + chunk] = (logits.to(weight.dtype) @ weight).to(hidden.dtype)  # type: ignore[index]
                if want_w:
                    grad_w.addmm_(logits.T, h.to(acc))  # type: ignore[union-attr]
            # Freed before the next chunk's product is allocated, or two [chunk, V] buffers live at once
            # (measured: the README loop at V = 151,936 peaked at 2.3 GB instead of 1.7 GB).
            del logits
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.has = (want_h, want_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        grad_h = next(saved) * grad_out if ctx.has[0] else None
        grad_w = (next(saved) * grad_out).to(ctx.weight_dtype) if ctx.has[1] else None
        return grad_h, grad_w, None, None


def chunked_token_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int = DEFAULT_CHUNK
) -> tuple[torch.Tensor, int]:
    """`token_loss_sum` from the last hidden states and the output weight, without the [T, V] logits.

    hidden [B, T, H] (after the final norm), weight [V, H] (the lm_head / tied embedding),
    labels [B, T] unshifted: hidden[:, t] predicts labels[:, t + 1]. Only positions with a
    target are scored, `chunk` rows at a time, so peak memory is about chunk * V floats plus one
    weight-sized gradient instead of 2-3 copies of T * V. Same value and gradients as
    `token_loss_sum(hidden @ weight.T, labels)` (tests/loader/test_loss.py).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    shift_labels = labels[:, 1:].to(hidden.device)
    keep = shift_labels != IGNORE_INDEX
    rows = hidden[:, :-1][keep]  # [N, H]: only the positions that carry a target
    targets = shift_labels[keep]
    if not len(targets):  # still touch the graph so backward reaches hidden and weight (DDP)
        return (hidden.sum() + weight.sum()) * 0.0, 0
    return _ChunkedCrossEntropy.apply(rows, weight, targets, chunk), len(targets)


class _ChunkedTokenLosses(torch.autograd.Function):
    """CE(hidden[t] @ weight.T, target[t]) per row, `chunk` rows at a time; never holds [N, V].

    Unlike `_ChunkedCrossEntropy` the rows' losses are kept apart (a per-segment sum weighs each
    row by its segment's incoming gradient, unknown in forward), so backward recomputes each
    chunk's logits from the saved hidden rows and log-sum-exp: one more [chunk, H] x [H, V]
    product per chunk for peak memory O(chunk * V).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        losses = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        lse = torch.empty_like(losses)
        for lo in range(0, hidden.shape[0], chunk):
            t = targets[lo : lo + chunk]
            logits = (hidden[lo : lo + chunk] @ weight.T).to(acc)
            picked = logits.gather(1, t[:, None]).squeeze(1)
            peak = logits.amax(dim=-1, keepdim=True)
            lse[lo : lo + chunk] = peak.squeeze(1) + logits.sub_(peak).exp_().sum(dim=-1).log()
            losses[lo : lo + chunk] = lse[lo : lo + chunk] - picked
            del logits  # before the next chunk's product (see _ChunkedCrossEntropy)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return losses

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        for lo in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[lo : lo + ctx.chunk], targets[lo : lo + ctx.chunk]
            d = (h @ weight.T).to(acc).sub_(lse[lo : lo + ctx.chunk, None]).exp_()  # softmax, in place
            d[torch.arange(len(t), device=d.device), t] -= 1
            d.mul_(grad_out[lo : lo + ctx.chunk, None].to(acc))
            if grad_h is not None:
                grad_h[lo : lo + ctx.chunk] = (d.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(d.T, h.to(acc))
            del d  # before the next chunk's product (see _ChunkedCrossEntropy)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def chunked_per_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """`per_token_losses(hidden @ weight.T, labels)` without the [T, V] logits: [B, T-1], 0 where ignored.

    hidden [B, T, H] (after the final norm), weight [V, H]; only positions with a target are scored,
    `chunk` rows at a time (tests/loader/test_loss.py: same values and gradients as the full path).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    shift_labels = labels[:, 1:].to(hidden.device)
    keep = shift_labels != IGNORE_INDEX
    acc = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.zeros(shift_labels.shape, dtype=acc, device=hidden.device)
    if not bool(keep.any()):  # still touch the graph so backward reaches hidden and weight (DDP)
        return out + (hidden.sum() + weight.sum()).to(acc) * 0.0
    losses = _ChunkedTokenLosses.apply(hidden[:, :-1][keep], weight, shift_labels[keep], chunk)
    return out.masked_scatter(keep, losses)


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


def global_loss_sum(loss_sum: float | torch.Tensor, group=None) -> float:
    """A loss sum over all ranks: one all_reduce(SUM) in float64; the value itself when not distributed."""
    value = float(loss_sum.detach()) if isinstance(loss_sum, torch.Tensor) else float(loss_sum)
    if not (dist.is_available() and dist.is_initialized()):
        return value
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return float(t.item())


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


@dataclass(frozen=True, slots=True)
class WindowMetrics:
    """What one optimizer window on this rank asked of the model: log it next to the loss.

    tokens/s and targets/s from these make a change of budget or packing visible as a change of
    the task (more padding, fewer targets, more attention work), not a faster or slower kernel.
    """

    micro_batches: int
    input_tokens: int  # T summed over micro-batches, padding included
    target_tokens: int  # labels that are not -100 (this rank)
    segments: int  # real attention segments (samples)
    padding_slots: int  # padding tokens (fixed shape)
    loss_denominator: int  # the divisor in force: the window's targets over all ranks (WindowNorm.n_global)
    attn_cost: int  # sum(l_i^2) over real segments
    # the window's loss over all ranks, sum / loss_denominator: what the update minimised (None: not given)
    loss: float | None = None

    def as_dict(self) -> dict[str, int | float | None]:
        return {name: getattr(self, name) for name in self.__slots__}


def window_metrics(
    micro_batches: Iterable[MicroBatch], norm: WindowNorm, loss_sum: float | torch.Tensor | None = None, group=None
) -> WindowMetrics:
    """Counts of this rank's micro-batches in one window and the loss denominator in force; with this
    rank's `loss_sum` over the window (the micro-batches' sums added up), the window's loss over all
    ranks (one more all_reduce): the value to log, never a mean of the micro-batches' means."""
    mbs = list(micro_batches)
    loss = None
    if loss_sum is not None:
        loss = global_loss_sum(loss_sum, group) / norm.n_global if norm.n_global else 0.0
    return WindowMetrics(
        micro_batches=len(mbs),
        input_tokens=sum(mb.n_tokens for mb in mbs),
        target_tokens=sum(mb.n_targets for mb in mbs),
        segments=sum(mb.n_segments for mb in mbs),
        padding_slots=sum(mb.n_padding for mb in mbs),
        loss_denominator=norm.n_global,
        attn_cost=sum(mb.attn_cost for mb in mbs),
        loss=loss,
    )


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
