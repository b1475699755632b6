"""context_parallel_slice: the slices reassemble the micro-batch, and attention and loss computed
slice by slice equal the unsliced ones (float64)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from packtool.loader import PackedDataset, collate, context_parallel_slice, packed_batches  # noqa: E402
from packtool.loader.attention import per_segment_attention  # noqa: E402
from packtool.loader.loss import token_loss_sum  # noqa: E402


def micro_batch(lengths, seed=0, vocab=50):
    """Segments of these lengths, ~30% of labels ignored, -100 at every segment start."""
    rng = np.random.default_rng(seed)
    packs = []
    for n in lengths:
        ids = rng.integers(3, vocab, size=n)
        labels = np.where(rng.random(n) < 0.3, -100, ids)
        labels[0] = -100
        packs.append({"input_ids": ids, "labels": labels, "cu_seqlens": [0, n]})
    return collate(packs)


LENGTHS = [13, 1, 8, 27, 3, 16, 5]  # short segments (< 2 * cp_size) included


def test_docstring_example():
    mb = collate([{"input_ids": [10, 11, 12, 13, 14, 15], "labels": [-100, 11, 12, 13, 14, 15], "cu_seqlens": [0, 6]}])
    r0, r1 = (context_parallel_slice(mb, 2, r) for r in range(2))
    assert r0.global_index.tolist() == [0, 1, 6, 7] and r1.global_index.tolist() == [2, 3, 4, 5]
    assert r0.input_ids.tolist() == [[10, 11, 0, 0]] and r0.targets.tolist() == [[11, 12, -100, -100]]
    assert r1.input_ids.tolist() == [[12, 13, 14, 15]] and r1.targets.tolist() == [[13, 14, 15, -100]]
    assert r0.position_ids.tolist() == [[0, 1, 6, 7]]
    assert r0.cu_seqlens.tolist() == [0, 6] and r0.cu_seqlens_padded.tolist() == [0, 8]
    assert r0.local_cu_seqlens.tolist() == [0, 4]


@pytest.mark.parametrize("cp", [2, 4])
def test_slices_reassemble_the_micro_batch(cp):
    mb = micro_batch(LENGTHS)
    slices = [context_parallel_slice(mb, cp, r) for r in range(cp)]
    source = torch.cat([s.source_index for s in slices])
    real = source[source >= 0]
    assert sorted(real.tolist()) == list(range(mb.n_tokens))  # every token on exactly one rank
    ids = torch.empty(mb.n_tokens, dtype=torch.long)
    targets = torch.empty(mb.n_tokens, dtype=torch.long)
    for s in slices:
        keep = s.source_index >= 0
        assert len(s.source_index) == int(s.cu_seqlens_padded[-1]) // cp  # equal share of the padded row
        ids[s.source_index[keep]] = s.input_ids[0, keep]
        targets[s.source_index[keep]] = s.targets[0, keep]
        assert (s.targets[0, ~keep] == -100).all()
    assert ids.tolist() == mb.input_ids[0].tolist()
    labels = mb.labels[0]
    want = torch.cat([labels[1:], torch.tensor([-100])])
    want[mb.cu_seqlens[1:].long() - 1] = -100  # no pair across segments
    assert targets.tolist() == want.tolist()
    assert sum(s.n_targets for s in slices) == mb.n_targets


@pytest.mark.parametrize("cp", [2, 4])
def test_sliced_attention_equals_block_causal_attention(cp):
    mb = micro_batch(LENGTHS, seed=1)
    g = torch.Generator().manual_seed(0)
    heads, dim = 2, 4
    q, k, v = (torch.randn(mb.n_tokens, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    reference = per_segment_attention(q, k, v, mb.cu_seqlens)
    first = context_parallel_slice(mb, cp, 0)
    padded_total = int(first.cu_seqlens_padded[-1])
    # The padded row every rank's keys come from (all-gathered K/V in a real CP run); padding random.
    qp, kp, vp = (torch.randn(padded_total, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    for s in (context_parallel_slice(mb, cp, r) for r in range(cp)):
        real = s.source_index >= 0
        qp[s.global_index[real]] = q[s.source_index[real]]
        kp[s.global_index[real]] = k[s.source_index[real]]
        vp[s.global_index[real]] = v[s.source_index[real]]
    segment_of = torch.repeat_interleave(
        torch.arange(len(first.cu_seqlens_padded) - 1), torch.diff(first.cu_seqlens_padded.long())
    )
    keys = torch.arange(padded_total)
    for r in range(cp):
        s = context_parallel_slice(mb, cp, r)
        gi = s.global_index
        mask = (segment_of[gi][:, None] == segment_of[None, :]) & (keys[None, :] <= gi[:, None])  # causal offsets
        out = F.scaled_dot_product_attention(
            qp[gi].transpose(0, 1), kp.transpose(0, 1), vp.transpose(0, 1), attn_mask=mask
        ).transpose(0, 1)
        real = s.source_index >= 0
        err = (out[real] - reference[s.source_index[real]]).abs().max().item()
        assert err < 1e-9


@pytest.mark.parametrize("cp", [2, 4])
def test_loss_summed_over_ranks_equals_the_unsliced_loss(cp):
    mb = micro_batch(LENGTHS, seed=2)
    vocab = 50
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, mb.n_tokens, vocab, generator=g, dtype=torch.float64)
    full_sum, n = token_loss_sum(logits, mb.labels)
    total, targets = 0.0, 0
    for r in range(cp):
        s = context_parallel_slice(mb, cp, r)
        local = torch.randn(s.input_ids.shape[1], vocab, generator=g, dtype=torch.float64)  # padding: anything
        real = s.source_index >= 0
        local[real] = logits[0, s.source_index[real]]
        total += F.cross_entropy(local, s.targets[0], ignore_index=-100, reduction="sum").item()
        targets += s.n_targets
    assert targets == n
    assert abs(total / targets - full_sum.item() / n) < 1e-12


def _causal_pairs(s) -> int:
    """Query-key pairs of real tokens this rank's attention computes: a query at offset o sees o + 1 keys."""
    return int((s.position_ids[0][s.source_index >= 0] + 1).sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_cost_per_rank_is_balanced_on_the_quickstart(quickstart_build, cp):
    worst = 0.0
    for mb in packed_batches(PackedDataset(quickstart_build, token_budget=4096)):
        costs = [_causal_pairs(context_parallel_slice(mb, cp, r)) for r in range(cp)]
        assert sum(costs) == sum(n * (n + 1) // 2 for n in torch.diff(mb.cu_seqlens.long()).tolist())
        worst = max(worst, max(costs) / (sum(costs) / cp))
    print(f"cp {cp}: worst micro-batch max/mean attention cost per rank {worst:.4f}")
    assert worst <= 1.10
