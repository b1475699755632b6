"""The pure math of a pack: labels, segment offsets, positions, and what attention costs.

Worked example (samples A=[a0,a1,E], B=[b0,E], C=[c0,c1,c2,E], every token a target):

    input_ids    = [a0,   a1, E,  b0,   E,  c0,   c1, c2, E]
    labels       = [-100, a1, E,  -100, E,  -100, c1, c2, E]
    cu_seqlens   = [0, 3, 5, 9]
    position_ids = [0, 1, 2, 0, 1, 0, 1, 2, 3]      max_seqlen = 4

The model shifts internally (logits at t predict labels[t+1]), so -100 at b0 is what removes the
pair E -> b0: no sample learns to predict the first token of the next one, while each sample's
own EOS stays a target (a1 -> E, b0 -> E, c2 -> E).
"""

from __future__ import annotations

import numpy as np

# PyTorch's cross_entropy ignore_index default; every HF model uses it for "not a target".
IGNORE_INDEX = -100


def cu_seqlens_from_lengths(lengths: np.ndarray | list[int]) -> np.ndarray:
    """[3, 2, 4] -> [0, 3, 5, 9] as int32, the dtype varlen attention kernels take."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths <= 0).any():
        raise ValueError(f"segment lengths must be positive, got {lengths.tolist()}")
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{out[-1]} tokens do not fit int32 offsets")
    return out.astype(np.int32)


def labels_for(input_ids: np.ndarray, targets: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
    """Hugging Face labels: the token where it is a target, -100 elsewhere and at every segment start."""
    input_ids = np.asarray(input_ids)
    targets = np.asarray(targets, dtype=bool)
    if input_ids.shape != targets.shape:
        raise ValueError(f"input_ids {input_ids.shape} and targets {targets.shape} differ in shape")
    cu = np.asarray(cu_seqlens)
    if cu[-1] != len(input_ids):
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but there are {len(input_ids)} tokens")
    labels = np.where(targets, input_ids, IGNORE_INDEX).astype(np.int32)
    labels[cu[:-1]] = IGNORE_INDEX
    return labels


def position_ids(cu_seqlens: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 in every segment: [0, 3, 5, 9] -> [0,1,2, 0,1, 0,1,2,3]."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    return np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lengths)


def target_pairs(labels: np.ndarray) -> int:
    """Number of (context -> next token) pairs that carry loss: labels that are not -100."""
    return int((np.asarray(labels) != IGNORE_INDEX).sum())
