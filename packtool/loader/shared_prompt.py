"""Shared-prompt layout: a group's prompt stored once, each answer attending to the prompt and itself.

Experimental: no build writes this layout yet (groups are packed as whole sequences, docs/pairs.md);
the masks and gathers here are proven on hand-made rows only (tests/loader/test_shared_prompt.py).

One group, prompt P = [p0, p1, p2] and answers A = [a0, a1], B = [b0, b1, b2], stored as P A B::

    t             0    1    2    3    4    5    6    7
    token         p0   p1   p2   a0   a1   b0   b1   b2
    document      0    0    0    0    0    0    0    0
    branch        0    0    0    1    1    2    2    2      0: the shared prompt, k: answer k
    position_ids  0    1    2    3    4    3    4    5      every answer continues from the prompt
    predecessor  -1    0    1    2    3    2    5    6      whose logits predict this token
    answer_of    -1   -1   -1    0    0    1    1    1

    may attend (query rows, key columns):
          p0 p1 p2 a0 a1 b0 b1 b2
    p0  [ 1  .  .  .  .  .  .  . ]
    p1  [ 1  1  .  .  .  .  .  . ]
    p2  [ 1  1  1  .  .  .  .  . ]
    a0  [ 1  1  1  1  .  .  .  . ]
    a1  [ 1  1  1  1  1  .  .  . ]
    b0  [ 1  1  1  .  .  1  .  . ]
    b1  [ 1  1  1  .  .  1  1  . ]
    b2  [ 1  1  1  .  .  1  1  1 ]

Rule: same document, key not after the query, and the key is in the prompt or in the query's own
answer. Each answer token then sees exactly what it sees in the unshared sequence P + answer, at
the same positions, so its logits are the same. The first token of every answer is predicted by
the prompt's last token (b0's predecessor is p2, not a1): one position predicts several answers,
so labels cannot be Hugging Face-shifted here and `answer_logprobs` gathers through
`predecessor` instead.

A group of k answers stores (k - 1) * len(P) fewer tokens; on the DPO demo files that is 25.8%
of all tokens (bench/pairs_bench.py). The mask is not block-diagonal, so varlen kernels cannot
run it: it needs FlexAttention (`shared_prompt_block_mask`) or a dense mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from packtool.loader.preference import SegmentLogprobs


@dataclass(frozen=True, slots=True)
class SharedLayout:
    """Per-token layout facts of a row of shared-prompt groups, all int64 [T] (see the module docstring)."""

    document: torch.Tensor
    branch: torch.Tensor
    position_ids: torch.Tensor
    predecessor: torch.Tensor
    answer_of: torch.Tensor  # global answer index, -1 on prompt tokens

    @property
    def n_tokens(self) -> int:
        return int(self.document.numel())

    @property
    def n_answers(self) -> int:
        return int(self.answer_of.max()) + 1 if self.n_tokens else 0


def shared_prompt_layout(groups: Sequence[tuple[int, Sequence[int]]]) -> SharedLayout:
    """Layout of groups `(prompt_length, [answer_length, ...])` stored one after another.

    [(3, [2, 3])] is the module docstring's row.
    """
    parts: list[tuple[np.ndarray, ...]] = []
    offset = answers_before = 0
    for g, (n_prompt, answers) in enumerate(groups):
        if n_prompt < 1 or not answers or min(answers) < 1:
            raise ValueError(f"group {g}: prompt {n_prompt} and answers {list(answers)} must all be >= 1 token")
        branch, position, predecessor = _group_layout(n_prompt, list(answers))
        predecessor = np.where(predecessor >= 0, predecessor + offset, -1)
        answer_of = np.where(branch > 0, branch - 1 + answers_before, -1)
        parts.append((np.full(branch.size, g), branch, position, predecessor, answer_of))
        offset += branch.size
        answers_before += len(answers)
    if not parts:
        raise ValueError("a shared-prompt row needs at least one group")
    return SharedLayout(*(torch.from_numpy(np.concatenate(column).astype(np.int64)) for column in zip(*parts)))


def _group_layout(n_prompt: int, answers: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(branch, position, predecessor) of one group, predecessor counted from the group's first token."""
    branch = np.repeat(np.arange(len(answers) + 1), [n_prompt, *answers])
    starts = n_prompt + np.cumsum([0, *answers[:-1]])  # where each answer begins
    position = np.concatenate([np.arange(n_prompt), *(np.arange(n_prompt, n_prompt + a) for a in answers)])
    predecessor = np.arange(-1, branch.size - 1)
    predecessor[starts] = n_prompt - 1  # every answer's first token is predicted by the prompt's last
    return branch, position, predecessor


def shared_prompt_mask(layout: SharedLayout) -> torch.Tensor:
    """Boolean [T, T], True where query i may attend key j."""
    idx = torch.arange(layout.n_tokens)
    doc, branch = layout.document, layout.branch
    return (
        (doc[:, None] == doc[None, :])
        & (idx[None, :] <= idx[:, None])
        & ((branch[None, :] == 0) | (branch[None, :] == branch[:, None]))
    )


def shared_prompt_additive_mask(layout: SharedLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float [1, 1, T, T], 0 where allowed and -inf elsewhere: the 4D `attention_mask` HF models take."""
    allowed = shared_prompt_mask(layout)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]


def shared_prompt_block_mask(layout: SharedLayout, device: torch.device | str | None = None):
    """The same rule as a FlexAttention `BlockMask` (no T x T tensor is built)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc, branch = layout.document.to(device), layout.branch.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        same_branch = (branch[kv_idx] == 0) | (branch[kv_idx] == branch[q_idx])
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx) & same_branch

    total = layout.n_tokens
    return create_block_mask(mask_mod, None, None, total, total, device=doc.device)


def answer_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor, layout: SharedLayout
) -> SegmentLogprobs:
    """Summed target log-prob of every answer: token t scored by the logits at `predecessor[t]`.

    logits [1, T, V]; input_ids [1, T] or [T]; targets bool [T] (answer tokens to score; a token
    without a predecessor is never scored). Accumulates in at least float32.
    """
    if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[1] != layout.n_tokens:
        raise ValueError(f"answer_logprobs takes logits [1, {layout.n_tokens}, V], got {tuple(logits.shape)}")
    ids = input_ids.reshape(-1).to(logits.device)
    pred = layout.predecessor.to(logits.device)
    scored = torch.nonzero(targets.to(logits.device).reshape(-1) & (pred >= 0)).flatten()
    owner = layout.answer_of.to(logits.device)[scored]
    if bool((owner < 0).any()):
        raise ValueError("a prompt token is marked as a target; only answer tokens are scored")
    acc = torch.promote_types(logits.dtype, torch.float32)
    logps = -F.cross_entropy(logits[0, pred[scored]].to(acc), ids[scored], reduction="none")
    n = layout.n_answers
    sums = torch.zeros(n, dtype=acc, device=logits.device).index_add(0, owner, logps)
    counts = torch.zeros(n, dtype=torch.long, device=logits.device).index_add(0, owner, torch.ones_like(owner))
    return SegmentLogprobs(sums=sums, counts=counts)
