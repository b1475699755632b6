"""Proofs on a tiny random-weight Llama (CPU, float64): packing changes the layout, not the task."""

import itertools
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtool.loader.attention import additive_mask, varlen_attention  # noqa: E402
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.loss import per_token_losses, token_loss_sum  # noqa: E402

VOCAB = 128
EOT = 2


def tiny_llama(seed=0, dtype=torch.float64):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        use_cache=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def sample(length, seed, n_prompt=0):
    """(input_ids, labels) of one sample; the first n_prompt tokens (and always the first) are not targets."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=length)
    labels = ids.copy()
    labels[: max(1, n_prompt)] = -100
    return ids, labels


def pack(samples):
    return {
        "input_ids": np.concatenate([s[0] for s in samples]),
        "labels": np.concatenate([s[1] for s in samples]),
        "cu_seqlens": np.concatenate([[0], np.cumsum([len(s[0]) for s in samples])]),
    }


def packed_forward(model, mb, route="mask"):
    """route "mask": explicit 4D float mask (0 / -inf); "positions": attention_mask=None + position_ids."""
    mask = additive_mask(mb.cu_seqlens, mb.n_tokens, dtype=model.dtype) if route == "mask" else None
    return model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mask).logits


def alone(model, ids):
    return model(input_ids=torch.as_tensor(ids)[None]).logits


SAMPLES = [sample(5, 1, n_prompt=2), sample(3, 2), sample(7, 3, n_prompt=3)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("route", ["mask", "positions"])
def test_packed_forward_equals_each_sample_alone(model, route):
    mb = collate([pack(SAMPLES)])
    with torch.no_grad():
        packed = packed_forward(model, mb, route)[0]
        losses = per_token_losses(packed[None], mb.labels)[0]
        cu = mb.cu_seqlens.tolist()
        for (ids, labels), lo, hi in zip(SAMPLES, cu[:-1], cu[1:], strict=True):
            ref = alone(model, ids)
            assert torch.allclose(packed[lo:hi], ref[0], atol=1e-10)
            ref_losses = per_token_losses(ref, torch.as_tensor(labels)[None])[0]
            assert torch.allclose(losses[lo : hi - 1], ref_losses, atol=1e-10)


def test_flat_row_without_metadata_is_not_isolated(model):
    """The contrast: the same row with neither mask nor restarting positions mixes samples."""
    mb = collate([pack(SAMPLES)])
    with torch.no_grad():
        flat = model(input_ids=mb.input_ids).logits[0]
        ref_b = alone(model, SAMPLES[1][0])[0]
    assert (flat[5:8] - ref_b).abs().max() > 1e-3


def test_gradients_token_loss_packed_equals_per_sample_sum(model):
    mb = collate([pack(SAMPLES)])
    n = mb.n_targets
    model.zero_grad()
    loss_sum, n_seen = token_loss_sum(packed_forward(model, mb), mb.labels)
    assert n_seen == n
    (loss_sum / n).backward()
    packed = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    total = sum(token_loss_sum(alone(model, ids), torch.as_tensor(labels)[None])[0] for ids, labels in SAMPLES)
    (total / n).backward()
    for k, p in model.named_parameters():
        assert torch.allclose(packed[k], p.grad, atol=1e-10), k
    model.zero_grad()


def test_perturbing_a_leaves_b_and_c_unchanged(model):
    changed = [(SAMPLES[0][0][::-1] % 100 + 3, SAMPLES[0][1]), *SAMPLES[1:]]
    with torch.no_grad():
        before = packed_forward(model, collate([pack(SAMPLES)]))[0]
        after = packed_forward(model, collate([pack(changed)]))[0]
    assert (before[:5] - after[:5]).abs().max() > 1e-3  # A's own logits do change
    assert (before[5:] - after[5:]).abs().max() <= 1e-12


def test_flat_causal_counterexample_with_helper():
    q = torch.zeros(5, 1, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 1.0, 1.0, 10.0, 0.0], dtype=torch.float64).view(5, 1, 1)
    isolated = varlen_attention(q, q, v, torch.tensor([0, 3, 5]), 3)[3].item()
    flat = varlen_attention(q, q, v, torch.tensor([0, 5]), 5)[3].item()
    assert (isolated, flat) == (pytest.approx(10.0), pytest.approx(3.25))


# Six samples with different lengths and target counts, split two ways.
SIX = [sample(n, 10 + i, n_prompt=p) for i, (n, p) in enumerate([(4, 1), (9, 6), (3, 0), (6, 2), (2, 0), (8, 1)])]
SPLIT_X = [[[0, 1], [2]], [[3, 4, 5]]]  # micro-batches of packs of sample indices
SPLIT_Y = [[[5, 0]], [[1, 2, 3]], [[4]]]


def accumulate(model, split, normalise):
    mbs = [collate([pack([SIX[i] for i in p]) for p in packs]) for packs in split]
    n_window = sum(mb.n_targets for mb in mbs)
    model.zero_grad()
    for mb in mbs:
        loss_sum, n = token_loss_sum(packed_forward(model, mb), mb.labels)
        loss = loss_sum / n_window if normalise == "window" else loss_sum / n / len(mbs)
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return grads


def test_micro_batch_and_repacking_invariance(model):
    x, y = accumulate(model, SPLIT_X, "window"), accumulate(model, SPLIT_Y, "window")
    assert torch.allclose(x, y, atol=1e-10)
    mx, my = accumulate(model, SPLIT_X, "mean_of_means"), accumulate(model, SPLIT_Y, "mean_of_means")
    assert (mx - my).abs().max() > 1e-4  # mean of means: the split changes the objective


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_packs(rng, n, length):
    ids = rng.integers(0, 32, size=length)
    labels = ids.copy()
    labels[0] = -100
    labels[rng.random(length) < n] = -100
    return {"input_ids": ids, "labels": labels, "cu_seqlens": [0, length]}


def test_ddp_two_ranks_equal_global_token_mean(tmp_path):
    import multiprocessing as mp

    import _ddp_worker

    rng = np.random.default_rng(0)
    no_targets = {"input_ids": np.arange(6), "labels": np.full(6, -100), "cu_seqlens": [0, 6]}
    rank_batches = [
        [[_token_packs(rng, 0.1, 12), _token_packs(rng, 0.5, 7)], [_token_packs(rng, 0.0, 20)]],
        [[no_targets]],  # rank 1 has zero targets and one micro-batch: it still joins every collective
    ]
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_ddp_worker.run_rank, args=(r, 2, port, rank_batches, str(tmp_path / f"{r}.pt")))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert results[1]["n_local"] == 0 and results[0]["n_global"] == results[0]["n_local"] > 0

    model = _ddp_worker.tiny_model()
    mbs = [collate(packs) for rank in rank_batches for packs in rank]
    n_global = sum(mb.n_targets for mb in mbs)
    total = sum(token_loss_sum(model(mb.input_ids), mb.labels)[0] for mb in mbs)
    (total / n_global).backward()
    for name, p in model.named_parameters():
        for r in range(2):
            assert torch.allclose(results[r]["grads"][name], p.grad, atol=1e-12), (name, r)


def test_overfit_canary_and_greedy_generation():
    torch.manual_seed(0)
    model = tiny_llama(seed=1, dtype=torch.float32).train()
    canaries = [([1, 10 + i, 20 + i, 3], [40 + i, 50 + 2 * i, 60 + 3 * i, EOT]) for i in range(4)]
    samples = [(np.array(p + a), np.array([-100] * len(p) + a)) for p, a in canaries]
    mb = collate([pack(samples)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(80):
        opt.zero_grad()
        loss_sum, n = token_loss_sum(packed_forward(model, mb), mb.labels)
        (loss_sum / n).backward()
        opt.step()
        losses.append(loss_sum.item() / n)
    checkpoints = [*losses[::10], losses[-1]]
    assert all(b < a for a, b in itertools.pairwise(checkpoints)), checkpoints
    assert losses[-1] < 0.05
    model.eval()
    with torch.no_grad():
        for prompt, answer in canaries:
            ids = list(prompt)
            while len(ids) < len(prompt) + 8 and (len(ids) == len(prompt) or ids[-1] != EOT):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            assert ids[len(prompt) :] == answer
