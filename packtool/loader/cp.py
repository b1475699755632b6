"""Context parallelism for packed rows: each rank gets a load-balanced slice of every segment.

Causal attention makes late tokens cost more than early ones, so cutting a row into cp_size
contiguous pieces gives the last rank most of the work. The layout used by varlen context-
parallel kernels for packed (THD) sequences instead pads every segment to a multiple of
2 * cp_size, cuts it into 2 * cp_size equal chunks and gives rank r the chunks r and
2 * cp_size - 1 - r: an early and a late chunk, the same causal work on every rank.

One segment of 6 tokens, cp_size 2 (padded to 8, 4 chunks of 2)::

    tokens        s0 s1 | s2 s3 | s4 s5 | P  P          P = padding (pad id, target -100)
    chunk         0       1       2       3
    rank 0        chunks 0 and 3:  s0 s1 P  P       global index 0 1 6 7
    rank 1        chunks 1 and 2:  s2 s3 s4 s5      global index 2 3 4 5

Targets are shifted before slicing, inside each segment (target[t] = labels[t + 1], the
segment's last token and the padding get -100), so no target pair is split between two chunks
or two ranks, and the loss is a plain per-token cross-entropy with no shift on each rank.
Padding sits at the end of its segment, so under causal attention no real token sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from packtool.labels import IGNORE_INDEX
from packtool.loader.collate import MicroBatch
from packtool.loader.contract import validate_cu_seqlens

__all__ = ["CPSlice", "context_parallel_slice"]


@dataclass(frozen=True, slots=True)
class CPSlice:
    """One rank's share of a micro-batch (T_r = padded total / cp_size tokens).

    `cu_seqlens` / `cu_seqlens_padded` describe the whole micro-batch (real and padded segment
    offsets, as THD context-parallel kernels take them); `local_cu_seqlens` this rank's tokens.
    `global_index` is each local token's index in the padded row (its causal offset: it attends
    to keys of its segment at indices <= its own); `source_index` its index in the micro-batch,
    -1 for padding.
    """

    input_ids: torch.Tensor  # int64 [1, T_r]
    targets: torch.Tensor  # int64 [1, T_r], already shifted: score logits[t] against targets[t]
    position_ids: torch.Tensor  # int64 [1, T_r], position inside the (padded) segment
    cu_seqlens: torch.Tensor  # int32 [S+1], unpadded segment offsets
    cu_seqlens_padded: torch.Tensor  # int32 [S+1], padded segment offsets
    local_cu_seqlens: torch.Tensor  # int32 [S+1], cu_seqlens_padded / cp_size
    max_seqlen: int  # longest padded segment
    global_index: torch.Tensor  # int64 [T_r]
    source_index: torch.Tensor  # int64 [T_r]
    n_targets: int
    cp_size: int
    cp_rank: int


def _segment_chunks(length: int, cp_size: int) -> tuple[int, int]:
    """(padded length, chunk length) of one segment."""
    unit = 2 * cp_size
    padded = -(-length // unit) * unit
    return padded, padded // unit


def context_parallel_slice(mb: MicroBatch, cp_size: int, cp_rank: int, *, pad_id: int = 0) -> CPSlice:
    """Rank `cp_rank`'s chunks r and 2*cp_size-1-r of every segment of `mb` (batch dimension 1)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_size {cp_size}, cp_rank {cp_rank}")
    if mb.input_ids.shape[0] != 1:
        raise ValueError(
            f"context_parallel_slice takes a flattened micro-batch [1, T], got {tuple(mb.input_ids.shape)}"
        )
    if mb.vision_inputs() or mb.mrope_position_ids is not None:
        raise ValueError("context_parallel_slice does not split a vision build's images or mRoPE positions")
    ids = mb.input_ids[0].cpu().numpy()
    labels = mb.labels[0].cpu().numpy()
    cu = mb.cu_seqlens.cpu().numpy().astype(np.int64)
    validate_cu_seqlens(cu, len(ids))
    shifted = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    shifted[:-1] = labels[1:]
    shifted[cu[1:] - 1] = IGNORE_INDEX  # a segment's last token predicts nothing (no pair across segments)
    lengths = np.diff(cu)
    padded_cu = [0]
    pieces: list[np.ndarray] = []  # padded-row indices this rank keeps, segment by segment
    for length in lengths.tolist():
        padded, chunk = _segment_chunks(length, cp_size)
        base = padded_cu[-1]
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(base + c * chunk + np.arange(chunk))
        padded_cu.append(base + padded)
    padded_cu_arr = np.asarray(padded_cu, dtype=np.int64)
    global_index = np.concatenate(pieces)
    segment = np.searchsorted(padded_cu_arr, global_index, side="right") - 1
    offset = global_index - padded_cu_arr[segment]
    real = offset < lengths[segment]
    source = np.where(real, cu[segment] + offset, -1)
    safe = np.where(real, source, 0)
    input_ids = np.where(real, ids[safe], pad_id)
    targets = np.where(real, shifted[safe], IGNORE_INDEX)
    return CPSlice(
        input_ids=torch.from_numpy(input_ids.astype(np.int64))[None],
        targets=torch.from_numpy(targets)[None],
        position_ids=torch.from_numpy(offset.astype(np.int64))[None],
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        cu_seqlens_padded=torch.from_numpy(padded_cu_arr.astype(np.int32)),
        local_cu_seqlens=torch.from_numpy((padded_cu_arr // cp_size).astype(np.int32)),
        max_seqlen=int(np.diff(padded_cu_arr).max()),
        global_index=torch.from_numpy(global_index),
        source_index=torch.from_numpy(source.astype(np.int64)),
        n_targets=int((targets != IGNORE_INDEX).sum()),
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
