import pytest

torch = pytest.importorskip("torch")

from packtool.loader.attention import (  # noqa: E402
    additive_mask,
    block_causal_mask,
    document_ids,
    per_segment_attention,
    select_backend,
    varlen_attention,
)

CU = torch.tensor([0, 3, 5, 9], dtype=torch.int32)


def test_document_ids_and_mask_drawing():
    assert document_ids(CU, 9).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    mask = block_causal_mask(CU, 9)
    assert int(mask.sum()) == 19  # legal causal pairs for lengths [3, 2, 4] (attention.py draws them)
    assert int(torch.ones(9, 9).tril().sum()) == 45  # what a flat causal mask would allow
    assert mask[3].tolist() == [False] * 3 + [True] + [False] * 5
    add = additive_mask(CU, 9)
    assert add.shape == (1, 1, 9, 9) and torch.equal(add[0, 0] == 0, mask)


def _qkv(total=9, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def test_backends_agree_with_per_segment_reference():
    q, k, v = _qkv()
    ref = per_segment_attention(q, k, v, CU)
    assert select_backend(q) == "sdpa"
    sdpa = varlen_attention(q, k, v, CU, 4)
    assert torch.allclose(sdpa, ref, atol=1e-12)
    flex = varlen_attention(q.float(), k.float(), v.float(), CU, 4, backend="flex")
    assert torch.allclose(flex.double(), ref, atol=1e-5)


def test_flat_causal_counterexample():
    # One head, q = k = 0 so every allowed key gets the same weight; A's values are 1, B's first is 10.
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.zeros(5, 1, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 1.0, 1.0, 10.0, 0.0], dtype=torch.float64).view(5, 1, 1)
    isolated = varlen_attention(q, q, v, cu, 3)
    assert isolated[3, 0, 0].item() == pytest.approx(10.0)
    flat = varlen_attention(q, q, v, torch.tensor([0, 5], dtype=torch.int32), 5)
    assert flat[3, 0, 0].item() == pytest.approx(3.25)  # (1 + 1 + 1 + 10) / 4: B reads A


def test_unknown_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        varlen_attention(q, k, v, CU, 4, backend="nope")
