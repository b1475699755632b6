import pytest

torch = pytest.importorskip("torch")

from packtool.errors import PacktoolError  # noqa: E402
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.loss import (  # noqa: E402
    WindowNorm,
    count_window_targets,
    per_token_losses,
    sample_mean_loss,
    token_loss_sum,
    window_norm,
)

EXAMPLE = {
    "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9],
    "labels": [-100, 2, 3, -100, 5, -100, 7, 8, 9],
    "cu_seqlens": [0, 3, 5, 9],
}


def _logits(total=9, vocab=12, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, total, vocab, generator=g, dtype=dtype, requires_grad=True)


def test_token_loss_sum_shifts_and_counts():
    mb = collate([EXAMPLE])
    logits = _logits()
    loss_sum, n = token_loss_sum(logits, mb.labels)
    assert n == mb.n_targets == 6
    manual = sum(
        -torch.log_softmax(logits[0, t - 1], -1)[EXAMPLE["labels"][t]] for t in range(1, 9) if EXAMPLE["labels"][t] >= 0
    )
    assert torch.allclose(loss_sum, manual)


def test_bf16_logits_accumulate_in_float32():
    loss_sum, _ = token_loss_sum(_logits(dtype=torch.bfloat16), collate([EXAMPLE]).labels)
    assert loss_sum.dtype == torch.float32


def test_zero_targets_still_reaches_the_graph():
    logits = _logits()
    loss_sum, n = token_loss_sum(logits, torch.full((1, 9), -100))
    assert n == 0 and loss_sum.item() == 0.0
    loss_sum.backward()
    assert logits.grad is not None and not logits.grad.any()


def test_window_norm_single_process():
    mbs = [collate([EXAMPLE]), collate([EXAMPLE])]
    assert count_window_targets(mbs) == 12
    norm = window_norm(mbs)
    assert norm == WindowNorm(12, 12, 1) and norm.scale == pytest.approx(1 / 12) and not norm.skip
    empty = window_norm(0)
    assert empty.skip and empty.scale == 0.0


def test_sample_mean_loss():
    logits = _logits()
    labels = collate([EXAMPLE]).labels
    total, n = sample_mean_loss(logits, labels, torch.tensor([0, 3, 5, 9]))
    per = per_token_losses(logits, labels)[0]
    want = per[0:2].sum() / 2 + per[3] / 1 + per[5:8].sum() / 3
    assert n == 3 and torch.allclose(total, want)


def test_sample_mean_loss_empty_policy():
    labels = torch.tensor([[-100, 2, 3, -100, -100, -100, 7, 8, 9]])
    logits, cu = _logits(), torch.tensor([0, 3, 5, 9])
    assert sample_mean_loss(logits, labels, cu, empty="skip")[1] == 2
    with pytest.raises(PacktoolError, match="segment 1 \\(tokens 3:5\\) has no target"):
        sample_mean_loss(logits, labels, cu, empty="error")
