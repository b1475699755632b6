"""Per-segment log-probs and pair losses on packed micro-batches (shard schema v2, docs/pairs.md).

A micro-batch may hold whole pairs and groups next to plain samples; the segment metadata says
which segment is which. Worked example: pair 7 (chosen C, rejected R) and a plain sample S::

    t            0     1     2   3  | 4     5     6   7  | 8     9   10
    segment      C                  | R                  | S
    labels     [-100, -100, c2, E   | -100, -100, r2, E  | -100, s1, E ]
    cu_seqlens [0, 4, 8, 11]        group_ids [7, 7, -1]   kinds [chosen, rejected, single]

    segment_logprobs   sums[i]   = sum over t in segment i with labels[t] != -100 of
                                   log softmax(logits[t - 1])[labels[t]]          (HF unshifted labels)
                       counts    = [2, 2, 2]                    means = sums / counts
    dpo_loss           pairs (C, R) of group 7:
                       loss_7 = -log sigmoid(beta * ((pi_C - ref_C) - (pi_R - ref_R)))

Labels at a segment start are always -100 (collate checks it), so no segment's sum reaches into
the previous segment, and block-diagonal attention keeps each sum equal to the sequence run alone.

Pair losses are normalised by pairs, not tokens: the objective is the mean over every pair of the
update window (all micro-batches, all ranks), L = (sum of loss_g) / P. `pair_window_norm` counts
this rank's pairs and all-reduces once; each micro-batch backpropagates `norm.loss_for_backward(
terms.loss_sum)` = W / P * its sum, so DDP's gradient average is exactly dL (loss.py explains
why a sum, never a mean, leaves repacking and splitting invariant).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from packtool.errors import PacktoolError
from packtool.loader.collate import IGNORE_INDEX
from packtool.loader.loss import DEFAULT_CHUNK, WindowNorm, chunked_per_token_losses, per_token_losses, window_norm
from packtool.packing_items import KIND_CODES

CHOSEN = KIND_CODES["chosen"]
REJECTED = KIND_CODES["rejected"]


class Segmented(Protocol):
    """What segment_logprobs reads from a micro-batch (collate.MicroBatch has both)."""

    labels: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [S + 1]


class Paired(Protocol):
    """A micro-batch read from schema v2 shards (collate.MicroBatch): per-segment group ids and kinds."""

    segment_groups: torch.Tensor | None
    segment_kinds: torch.Tensor | None


def segment_pairing(mb: Paired) -> tuple[torch.Tensor, torch.Tensor]:
    """(group ids, kinds) of a micro-batch's segments; PacktoolError for packs without them (schema v1)."""
    if mb.segment_groups is None or mb.segment_kinds is None:
        raise PacktoolError(
            "this micro-batch has no segment_groups/segment_kinds: its shards are schema v1 (no pairs); "
            "build the data with a `format: preference` or `format: group` source"
        )
    return mb.segment_groups, mb.segment_kinds


@dataclass(frozen=True, slots=True)
class SegmentLogprobs:
    """Summed target log-probs and target counts per segment, [S] each."""

    sums: torch.Tensor
    counts: torch.Tensor

    @property
    def means(self) -> torch.Tensor:
        """Per-target mean (SimPO's and ORPO's length-normalised score); 0 for a segment without targets."""
        return self.sums / self.counts.clamp(min=1).to(self.sums.dtype)


def segment_logprobs(logits: torch.Tensor, mb: Segmented) -> SegmentLogprobs:
    """Each segment's summed and mean target log-prob from one flattened forward ([1, T, V] logits).

    Accumulates in at least float32 (per_token_losses). A segment without targets gets sum 0.
    """
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"segment_logprobs takes flattened logits [1, T, V], got {tuple(logits.shape)}")
    labels = mb.labels.to(logits.device)
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape[:2])}")
    return _segment_sums(-per_token_losses(logits, labels)[0], labels, mb.cu_seqlens)


def chunked_segment_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, mb: Segmented, *, chunk: int = DEFAULT_CHUNK
) -> SegmentLogprobs:
    """`segment_logprobs(hidden @ weight.T, mb)` without the [T, V] logits (the DPO path at a large vocabulary).

    hidden [1, T, H]: the decoder's last hidden states (after the final norm); weight [V, H]: the
    lm_head (or tied embedding) weight of a model whose logits are exactly hidden @ weight.T (no
    soft-capping or logit scale). Target rows are scored `chunk` at a time, so peak memory is about
    chunk * V floats plus one weight-sized gradient; same sums and gradients as the full path
    (tests/loader/test_pair_proofs.py). Feed `.sums` of the policy and the reference to `dpo_loss`.
    """
    if hidden.dim() != 3 or hidden.shape[0] != 1:
        raise ValueError(f"chunked_segment_logprobs takes flattened hidden states [1, T, H], got {tuple(hidden.shape)}")
    labels = mb.labels.to(hidden.device)
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape[:2])}")
    return _segment_sums(-chunked_per_token_losses(hidden, weight, labels, chunk=chunk)[0], labels, mb.cu_seqlens)


def _segment_sums(logps: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor) -> SegmentLogprobs:
    """Per-segment sums of the shifted log-probs [T-1] (position t - 1 scores labels[t]) and target counts."""
    cu = cu_seqlens.to(device=logps.device, dtype=torch.long)
    n_seg = cu.numel() - 1
    # Label t belongs to the segment holding token t; t = 0 has no scoring position.
    segment_of = torch.repeat_interleave(torch.arange(n_seg, device=cu.device), cu[1:] - cu[:-1])[1:]
    is_target = labels[0, 1:] != IGNORE_INDEX
    sums = torch.zeros(n_seg, dtype=logps.dtype, device=logps.device).index_add(0, segment_of, logps)
    counts = torch.zeros(n_seg, dtype=torch.long, device=logps.device).index_add(0, segment_of, is_target.long())
    return SegmentLogprobs(sums=sums, counts=counts)


def pair_index(group_ids: torch.Tensor, kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment indices of each pair's chosen and rejected answer, ordered by group id.

    group_ids [7, 7, -1, 9, 9], kinds [chosen, rejected, single, rejected, chosen] -> ([0, 4], [1, 3])
    Raises PacktoolError when a group has no partner or two answers of one kind (a micro-batch
    that split a pair, or shards that are not preference shards).
    """
    groups = np.asarray(group_ids.detach().cpu(), dtype=np.int64)
    kind = np.asarray(kinds.detach().cpu(), dtype=np.int64)
    if groups.shape != kind.shape:
        raise ValueError(f"group_ids {groups.shape} and kinds {kind.shape} differ in shape")
    chosen = np.flatnonzero(kind == CHOSEN)
    rejected = np.flatnonzero(kind == REJECTED)
    chosen = chosen[np.argsort(groups[chosen], kind="stable")]
    rejected = rejected[np.argsort(groups[rejected], kind="stable")]
    g_chosen, g_rejected = groups[chosen], groups[rejected]
    if not np.array_equal(g_chosen, g_rejected) or np.any(g_chosen[1:] == g_chosen[:-1]):
        unmatched = sorted(set(g_chosen.tolist()) ^ set(g_rejected.tolist()))
        doubled = sorted({int(g) for g in g_chosen[1:][g_chosen[1:] == g_chosen[:-1]]})
        raise PacktoolError(
            f"preference segments do not form pairs (groups without a partner: {unmatched[:5]}, "
            f"with two chosen: {doubled[:5]}); a micro-batch must hold whole groups"
        )
    device = group_ids.device
    return torch.as_tensor(chosen, device=device), torch.as_tensor(rejected, device=device)


@dataclass(frozen=True, slots=True)
class PairTerms:
    """Per-pair DPO terms, [P] each, ordered by group id. `loss_sum` is what to scale and backpropagate."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor  # beta * (pi_chosen - ref_chosen), detached
    rejected_rewards: torch.Tensor
    loss_sum: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards


def dpo_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    group_ids: torch.Tensor | Paired,
    kinds: torch.Tensor | None = None,
    beta: float = 0.1,
) -> PairTerms:
    """Sigmoid DPO over the pairs of one micro-batch, from per-segment log-probs [S] (usually `.sums`).

    Pass the micro-batch itself (`dpo_loss(policy, reference, mb, beta=0.1)`: its segment_groups
    and segment_kinds pair the segments) or the two tensors (`dpo_loss(policy, reference, groups, kinds, beta)`).

        z_g    = beta * ((pi_c - ref_c) - (pi_r - ref_r))
        loss_g = -log sigmoid(z_g)

    Other pair objectives change only the line computing `losses` from the same pairing:
    IPO: (z_g / beta - 1 / (2 * beta)) ** 2 with mean log-probs; SimPO: no reference,
    z_g = beta * (mean_c - mean_r) - gamma, from `SegmentLogprobs.means`; ORPO: no reference,
    the log odds ratio of the means plus the chosen segment's token NLL (loss.token_loss_sum).
    `loss_sum` also carries a zero times every log-prob, so a micro-batch without a pair still
    reaches every parameter (DDP expects a gradient for each on every rank).
    """
    if not isinstance(group_ids, torch.Tensor):
        group_ids, kinds = segment_pairing(group_ids)
    if kinds is None:
        raise ValueError("dpo_loss needs the segment kinds with group ids (or pass the micro-batch)")
    chosen, rejected = pair_index(group_ids, kinds)
    reference = reference_logps.detach().to(policy_logps.dtype)
    chosen_ratio = policy_logps[chosen] - reference[chosen]
    rejected_ratio = policy_logps[rejected] - reference[rejected]
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return PairTerms(
        losses=losses,
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
        loss_sum=losses.sum() + policy_logps.sum() * 0,
    )


def count_pairs(kinds: torch.Tensor | np.ndarray) -> int:
    """Pairs among a micro-batch's segments: its chosen segments."""
    return int((np.asarray(kinds.detach().cpu() if isinstance(kinds, torch.Tensor) else kinds) == CHOSEN).sum())


def pair_window_norm(kinds_per_micro_batch: Iterable[torch.Tensor | np.ndarray] | int, group=None) -> WindowNorm:
    """Normalisation by the window's pair count: one all_reduce; `scale` = W / P_global.

    Takes the segment kinds of this rank's micro-batches (or the local pair count itself).
    """
    if isinstance(kinds_per_micro_batch, int):
        return window_norm(kinds_per_micro_batch, group)
    return window_norm(sum(count_pairs(k) for k in kinds_per_micro_batch), group)
