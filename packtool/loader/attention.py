"""Block-diagonal causal attention over a packed row, on whichever backend is available.

For cu_seqlens [0, 3, 5, 9] (segments A, B, C)::

    document_ids = [0, 0, 0, 1, 1, 2, 2, 2, 2]

    block_causal_mask (True = may attend), query rows x key columns:
          0  1  2  3  4  5  6  7  8
     0  [ 1  .  .  .  .  .  .  .  . ]
     1  [ 1  1  .  .  .  .  .  .  . ]
     2  [ 1  1  1  .  .  .  .  .  . ]
     3  [ .  .  .  1  .  .  .  .  . ]
     4  [ .  .  .  1  1  .  .  .  . ]
     5  [ .  .  .  .  .  1  .  .  . ]
     6  [ .  .  .  .  .  1  1  .  . ]
     7  [ .  .  .  .  .  1  1  1  . ]
     8  [ .  .  .  .  .  1  1  1  1 ]

A flat causal mask would also allow the 30 entries below the diagonal outside the blocks (45
legal pairs instead of 19): tokens of B and C would read A.

Backends, in the order `varlen_attention` tries them (measured with bench/gpu_check.py):
  flash_attn   `flash_attn_varlen_func`, CUDA, fp16/bf16 (FA2 needs a source build; FA4 returns (out, lse))
  torch_varlen `torch.nn.attention.varlen.varlen_attn`, CUDA only, fp16/bf16; causal is
               window_size=(-1, 0) in new torch, is_causal=True in older releases
  sdpa         `scaled_dot_product_attention` with the boolean mask: O(T^2) memory, the reference
"""

from __future__ import annotations

import inspect
import itertools
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from packtool.loader.contract import validate_cu_seqlens

BACKENDS = ("flash_attn", "torch_varlen", "sdpa")


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Segment index of every token: [0, 3, 5, 9] -> [0,0,0, 1,1, 2,2,2,2] (int32)."""
    validate_cu_seqlens(cu_seqlens, total)
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu.device, dtype=torch.int32), lengths)


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend key j (same segment and j <= i)."""
    doc = document_ids(cu_seqlens, total)
    idx = torch.arange(total, device=doc.device)
    return (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])


def additive_mask(cu_seqlens: torch.Tensor, total: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float [1, 1, T, T] mask, 0 where allowed and -inf elsewhere.

    This is the form to pass as a 4D `attention_mask` to Hugging Face models: a boolean 4D mask
    is silently misread by the eager backend.
    """
    allowed = block_causal_mask(cu_seqlens, total)
    mask = torch.zeros(total, total, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, float("-inf"))[None, None]


def flex_document_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device | str | None = None):
    """A FlexAttention `BlockMask` for the same block-diagonal causal pattern."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(cu_seqlens, total)
    if device is not None:
        doc = doc.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(mask_mod, None, None, total, total, device=doc.device)


def flex_varlen_attention(q, k, v, cu_seqlens, scale: float | None = None) -> torch.Tensor:
    """FlexAttention (eager unless the caller compiles it) on [T, H, D] inputs."""
    from torch.nn.attention.flex_attention import flex_attention

    total = q.shape[0]
    block_mask = flex_document_mask(cu_seqlens, total, device=q.device)
    heads_first = [x.transpose(0, 1)[None] for x in (q, k, v)]
    out = flex_attention(heads_first[0], heads_first[1], heads_first[2], block_mask=block_mask, scale=scale)
    if isinstance(out, tuple):  # the return_lse overload
        out = out[0]
    return out[0].transpose(0, 1)


def per_segment_attention(q, k, v, cu_seqlens, scale: float | None = None) -> torch.Tensor:
    """The reference: plain causal SDPA run on each segment alone, outputs concatenated."""
    outs = []
    bounds = cu_seqlens.tolist()
    for lo, hi in itertools.pairwise(bounds):
        sq, sk, sv = (x[lo:hi].transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def sdpa_varlen_attention(q, k, v, cu_seqlens, scale: float | None = None) -> torch.Tensor:
    """SDPA over the whole row with the boolean block-causal mask ([T, H, D] in and out)."""
    mask = block_causal_mask(cu_seqlens.to(q.device), q.shape[0])
    hq, hk, hv = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(hq, hk, hv, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


@cache
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@cache
def _torch_varlen():
    """(function, causal kwargs) for torch's varlen_attn, or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}
    return None


def select_backend(q: torch.Tensor) -> str:
    """The backend `varlen_attention(backend="auto")` will use for a tensor like q."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if _flash_attn_func() is not None:
            return "flash_attn"
        if _torch_varlen() is not None:
            return "torch_varlen"
    return "sdpa"


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention inside each segment of a packed row. q, k, v: [T, H, D]; returns [T, H, D].

    backend "auto" picks flash_attn, then torch_varlen (both CUDA, half precision), then sdpa;
    naming a backend forces it ("flex" is available too, eager unless compiled by the caller).
    """
    if backend == "auto":
        backend = select_backend(q)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if backend == "flash_attn":
        fn = _flash_attn_func()
        if fn is None:
            raise ImportError("flash_attn is not importable; install flash-attn or use backend='auto'")
        out: Any = fn(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, softmax_scale=scale)
        return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)
    if backend == "torch_varlen":
        found = _torch_varlen()
        if found is None:
            raise ImportError("this torch has no torch.nn.attention.varlen.varlen_attn; use backend='auto'")
        fn, causal = found
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **causal)
    if backend == "flex":
        return flex_varlen_attention(q, k, v, cu, scale=scale)
    if backend == "sdpa":
        return sdpa_varlen_attention(q, k, v, cu, scale=scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose auto, {', '.join(BACKENDS)} or flex")
