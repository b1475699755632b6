import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from packtool.errors import DatasetError, PackFormatError  # noqa: E402
from packtool.loader.collate import LoadedPack, collate  # noqa: E402
from packtool.loader.contract import validate_cu_seqlens  # noqa: E402
from packtool.loader.schedule import plan_micro_batches  # noqa: E402

# The worked example of docs/format.md: A=[a0,a1,E], B=[b0,E], C=[c0,c1,c2,E]
a0, a1, b0, c0, c1, c2, E = 10, 11, 20, 30, 31, 32, 2
EXAMPLE = {
    "input_ids": [a0, a1, E, b0, E, c0, c1, c2, E],
    "labels": [-100, a1, E, -100, E, -100, c1, c2, E],
    "cu_seqlens": [0, 3, 5, 9],
}


def test_worked_example():
    mb = collate([EXAMPLE])
    assert mb.input_ids.dtype == torch.int64 and mb.input_ids.shape == (1, 9)
    assert mb.labels.tolist() == [EXAMPLE["labels"]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert mb.max_seqlen == 4 and mb.n_targets == 6 and mb.n_packs == 1
    assert (mb.n_segments, mb.n_padding, mb.attn_cost) == (3, 0, 9 + 4 + 16)
    kw = mb.flash_kwargs()
    assert kw["cu_seq_lens_q"] is mb.cu_seqlens and kw["cu_seq_lens_k"] is mb.cu_seqlens
    assert kw["max_length_q"] == kw["max_length_k"] == 4
    assert set(mb.as_dict()) >= {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "max_length_k"}


def test_two_packs_concatenate_segments():
    second = {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8], "cu_seqlens": [0, 2, 4]}
    mb = collate([EXAMPLE, second])
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 9, 11, 13]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 0, 1]]
    assert mb.n_targets == 8 and mb.max_seqlen == 4 and mb.n_packs == 2


def test_fixed_shape_padding_is_its_own_segment_without_targets():
    mb = collate([EXAMPLE], capacity=12, pad_id=0)
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 9, 12]
    assert mb.labels[0, 9:].tolist() == [-100] * 3 and mb.input_ids[0, 9:].tolist() == [0] * 3
    assert mb.position_ids[0, 9:].tolist() == [0, 1, 2]
    assert mb.n_targets == 6 and (mb.n_segments, mb.n_padding, mb.attn_cost) == (3, 3, 29)
    padded = collate([EXAMPLE], capacity=12, n_padding_rows=1)
    assert padded.n_tokens == 24 and padded.cu_seqlens.tolist()[-2:] == [12, 24] and padded.n_packs == 1
    assert (padded.n_segments, padded.n_padding) == (3, 15)


@pytest.mark.parametrize(
    ("cu", "total", "max_len", "match"),
    [
        ([1, 3, 9], 9, None, "start at 0"),
        ([0, 3, 3, 9], 9, None, "strictly increasing"),
        ([0, 5, 3, 9], 9, None, "strictly increasing"),
        ([0, 3, 8], 9, None, "ends at 8 but the row has 9"),
        ([0, 3, 9], 9, 3, "max_seqlen 3 != longest segment 6"),
        ([0], 0, None, "at least 2"),
    ],
)
def test_validate_cu_seqlens_raises(cu, total, max_len, match):
    with pytest.raises(PackFormatError, match=match):
        validate_cu_seqlens(cu, total, max_len)


def test_validate_int32_overflow():
    big = 2**31
    with pytest.raises(PackFormatError, match="int32"):
        validate_cu_seqlens(np.array([0, big], dtype=np.int64), big)


def test_label_across_boundary_is_rejected():
    bad = dict(EXAMPLE, labels=[-100, a1, E, b0, E, -100, c1, c2, E])
    with pytest.raises(PackFormatError, match="predict the next"):
        collate([bad])


def test_plan_micro_batches_example():
    assert plan_micro_batches([5, 4, 3, 6], 8) == [[0], [1, 2], [3]]


def test_token_budget_is_a_hard_cap():
    with pytest.raises(DatasetError, match="pack 4 has 9 tokens > token_budget 8"):
        plan_micro_batches([5, 4, 3, 6, 9], 8)
    with pytest.raises(DatasetError, match="token_budget must be positive, got 0"):
        plan_micro_batches([5], 0)


def _row(n):
    return LoadedPack(np.arange(n), np.r_[-100, np.arange(1, n)], np.array([0, n]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30), st.integers(20, 45))
def test_batches_cover_every_pack_once_within_budget(lengths, budget):
    rows = [_row(n) for n in lengths]
    plan = plan_micro_batches(lengths, budget)
    assert [i for group in plan for i in group] == list(range(len(lengths)))  # every pack once, in order
    mbs = [collate([rows[i] for i in group]) for group in plan]
    assert sum(mb.n_tokens for mb in mbs) == sum(lengths)
    for mb in mbs:
        assert mb.n_tokens <= budget
        validate_cu_seqlens(mb.cu_seqlens, mb.n_tokens, mb.max_seqlen)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=20), st.integers(1, 3))
def test_fixed_shape_batches_have_one_shape(lengths, per_batch):
    rows = [_row(n) for n in lengths]
    plan = plan_micro_batches([10] * len(lengths), 10 * per_batch)  # fixed shape: a pack counts its capacity
    mbs = [collate([rows[i] for i in g], capacity=10, n_padding_rows=per_batch - len(g)) for g in plan]
    assert {mb.n_tokens for mb in mbs} == {10 * per_batch}
    assert sum(mb.n_packs for mb in mbs) == len(lengths)
    assert sum(mb.n_targets for mb in mbs) == sum(n - 1 for n in lengths)
