import pytest

torch = pytest.importorskip("torch")

from packtool.errors import PacktoolError  # noqa: E402
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.loss import (  # noqa: E402
    WindowNorm,
    chunked_per_token_losses,
    chunked_token_loss_sum,
    count_window_targets,
    per_token_losses,
    sample_mean_loss,
    token_loss_sum,
    window_metrics,
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


@pytest.mark.parametrize("chunk", [1, 4, 5, 1024])
def test_chunked_loss_equals_the_full_loss_in_value_and_gradients(chunk):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9), generator=g)
    labels[0, [0, 3, 4]] = -100
    labels[1, 0] = -100
    full, n_full = token_loss_sum(hidden @ weight.T, labels)
    full_grads = torch.autograd.grad(full * 0.37, (hidden, weight))
    chunked, n = chunked_token_loss_sum(hidden, weight, labels, chunk=chunk)
    grads = torch.autograd.grad(chunked * 0.37, (hidden, weight))
    assert n == n_full == 14  # 2 x 8 shifted pairs, two of them ignored
    assert torch.allclose(chunked, full, atol=1e-12, rtol=0)
    for got, want in zip(grads, full_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_chunked_per_token_losses_equal_the_full_path_in_values_and_gradients(chunk):
    """Each row's loss kept apart (what per-segment sums need), under any upstream weighting of the rows."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9), generator=g)
    labels[0, [0, 3, 4]] = -100
    labels[1, 0] = -100
    upstream = torch.randn(2, 8, generator=g, dtype=torch.float64)  # a different gradient for every row
    full = per_token_losses(hidden @ weight.T, labels)
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight))
    chunked = chunked_per_token_losses(hidden, weight, labels, chunk=chunk)
    grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    assert chunked.shape == full.shape == (2, 8)
    assert (chunked - full).abs().max() < 1e-9
    for got, want in zip(grads, full_grads, strict=True):
        assert (got - want).abs().max() < 1e-9


def test_chunked_per_token_losses_without_targets_still_reach_the_graph():
    hidden = torch.randn(1, 4, 3, requires_grad=True)
    weight = torch.randn(5, 3, requires_grad=True)
    losses = chunked_per_token_losses(hidden, weight, torch.full((1, 4), -100))
    losses.sum().backward()
    assert not losses.any() and hidden.grad is not None and weight.grad is not None


def test_chunked_loss_without_targets_still_reaches_the_graph():
    hidden = torch.randn(1, 4, 3, requires_grad=True)
    weight = torch.randn(5, 3, requires_grad=True)
    loss, n = chunked_token_loss_sum(hidden, weight, torch.full((1, 4), -100))
    loss.backward()
    assert n == 0 and loss.item() == 0.0 and hidden.grad is not None and weight.grad is not None


def test_chunked_loss_bf16_weight_gets_a_bf16_gradient():
    hidden = torch.randn(1, 6, 4, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.tensor([[-100, 1, 2, 3, 4, 5]])
    loss, _ = chunked_token_loss_sum(hidden, weight, labels, chunk=2)
    loss.backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == hidden.grad.dtype == torch.bfloat16


def test_window_metrics_count_the_window():
    mbs = [collate([EXAMPLE]), collate([EXAMPLE], capacity=12)]
    metrics = window_metrics(mbs, window_norm(mbs))
    assert metrics.as_dict() == {
        "micro_batches": 2,
        "input_tokens": 9 + 12,
        "target_tokens": 12,
        "segments": 6,
        "padding_slots": 3,
        "loss_denominator": 12,
        "attn_cost": 2 * (9 + 4 + 16),
        "loss": None,
    }
    # the window's loss: the sums of its micro-batches over the window's targets, not a mean of means
    sums = [token_loss_sum(torch.randn(1, mb.input_ids.shape[1], 64), mb.labels)[0] for mb in mbs]
    logged = window_metrics(mbs, window_norm(mbs), loss_sum=sum(sums)).as_dict()["loss"]
    assert logged == pytest.approx(float(sum(sums)) / 12)
