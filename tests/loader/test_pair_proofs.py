"""Proofs on a tiny random-weight Llama (CPU, float64): pairs packed with other segments score as if run alone."""

from __future__ import annotations

import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_proofs import VOCAB, alone, pack, packed_forward, tiny_llama  # noqa: E402

from packtool.errors import PacktoolError  # noqa: E402
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.preference import (  # noqa: E402
    CHOSEN,
    REJECTED,
    chunked_segment_logprobs,
    count_pairs,
    dpo_loss,
    pair_index,
    pair_window_norm,
    segment_logprobs,
)
from packtool.packing_items import KIND_CODES  # noqa: E402

SINGLE = KIND_CODES["single"]
BETA = 0.1


def sequence(prompt, answer):
    """(input_ids, labels): the prompt is context, the answer the targets."""
    ids = np.concatenate([prompt, answer])
    labels = ids.copy()
    labels[: len(prompt)] = -100
    return ids, labels


def make_pair(seed, n_prompt, n_chosen, n_rejected, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, size=n_prompt)
    return sequence(prompt, rng.integers(3, vocab, size=n_chosen)), sequence(
        prompt, rng.integers(3, vocab, size=n_rejected)
    )


A = make_pair(1, 6, 4, 5)
B = make_pair(2, 3, 2, 6)
S = sequence(np.array([5, 6, 7]), np.array([8, 9, 10, 11]))  # a plain SFT sample beside the pairs
# Two packs in one micro-batch; pair B is stored rejected first: pairing goes by kind, not order.
SEGMENTS = [A[0], A[1], S, B[1], B[0]]
PACKS = [[0, 1, 2], [3, 4]]
GROUP_IDS = torch.tensor([11, 11, -1, 12, 12])
KINDS = torch.tensor([CHOSEN, REJECTED, SINGLE, REJECTED, CHOSEN])


def micro_batch(segments=SEGMENTS):
    return collate([pack([segments[i] for i in p]) for p in PACKS])


def naive_logp(logits, labels):
    """Sum of log p(label[t] | logits[t - 1]) over targets of one sequence alone, written out token by token."""
    logits = logits[0]
    total = torch.zeros((), dtype=logits.dtype)
    for t in range(1, len(labels)):
        if labels[t] != -100:
            total = total + torch.log_softmax(logits[t - 1], dim=-1)[int(labels[t])]
    return total


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def reference():
    return tiny_llama(seed=1)


@pytest.mark.parametrize("route", ["mask", "positions"])
def test_segment_logprobs_of_a_packed_micro_batch_equal_each_sequence_alone(model, route):
    mb = micro_batch()
    with torch.no_grad():
        packed = segment_logprobs(packed_forward(model, mb, route), mb)
        expected = torch.stack([naive_logp(alone(model, ids), labels) for ids, labels in SEGMENTS])
    assert (packed.sums - expected).abs().max() < 1e-9
    counts = [int((labels[1:] != -100).sum()) for _, labels in SEGMENTS]
    assert packed.counts.tolist() == counts
    assert torch.allclose(packed.means, expected / torch.tensor(counts, dtype=expected.dtype), atol=1e-12)


def test_dpo_loss_and_gradients_equal_the_unpacked_computation(model, reference):
    mb = micro_batch()
    n_pairs = count_pairs(KINDS)
    assert n_pairs == 2
    model.zero_grad()
    with torch.no_grad():
        ref = segment_logprobs(packed_forward(reference, mb), mb).sums
    terms = dpo_loss(segment_logprobs(packed_forward(model, mb), mb).sums, ref, GROUP_IDS, KINDS, BETA)
    (terms.loss_sum / n_pairs).backward()
    packed_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    packed_losses = terms.losses.detach()

    model.zero_grad()
    unpacked = []
    for chosen, rejected in (A, B):  # group order 11, 12
        pi = [naive_logp(alone(model, ids), labels) for ids, labels in (chosen, rejected)]
        with torch.no_grad():
            rf = [naive_logp(alone(reference, ids), labels) for ids, labels in (chosen, rejected)]
        z = BETA * ((pi[0] - rf[0]) - (pi[1] - rf[1]))
        unpacked.append(-torch.log(torch.sigmoid(z)))
    (sum(unpacked) / n_pairs).backward()
    assert torch.allclose(packed_losses, torch.stack(unpacked).detach(), atol=1e-12)
    for k, p in model.named_parameters():
        assert (packed_grads[k] - p.grad).abs().max() < 1e-10, k
    model.zero_grad()
    assert torch.allclose(terms.margins, terms.chosen_rewards - terms.rejected_rewards)


def _hidden(model, mb):
    """The decoder's last hidden states (after the final norm): model.lm_head of them is the logits."""
    return model.model(input_ids=mb.input_ids, position_ids=mb.position_ids).last_hidden_state


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_dpo_path_equals_the_full_logits_path_in_values_and_gradients(model, reference, chunk):
    """Hidden states + lm_head weight, never the [T, V] logits: the same sums, DPO loss and gradients."""
    mb = micro_batch()

    def dpo(chunked):
        model.zero_grad()
        if chunked:
            policy = chunked_segment_logprobs(_hidden(model, mb), model.lm_head.weight, mb, chunk=chunk)
            with torch.no_grad():
                ref = chunked_segment_logprobs(_hidden(reference, mb), reference.lm_head.weight, mb, chunk=chunk)
        else:
            policy = segment_logprobs(packed_forward(model, mb, "positions"), mb)
            with torch.no_grad():
                ref = segment_logprobs(packed_forward(reference, mb, "positions"), mb)
        terms = dpo_loss(policy.sums, ref.sums, GROUP_IDS, KINDS, BETA)
        (terms.loss_sum / count_pairs(KINDS)).backward()
        return policy, terms, {k: p.grad.clone() for k, p in model.named_parameters()}

    full_logps, full_terms, full_grads = dpo(chunked=False)
    logps, terms, grads = dpo(chunked=True)
    model.zero_grad()
    assert logps.counts.tolist() == full_logps.counts.tolist()
    assert (logps.sums - full_logps.sums).abs().max() < 1e-9
    assert (terms.losses - full_terms.losses).abs().max() < 1e-9
    for k, grad in full_grads.items():
        assert (grads[k] - grad).abs().max() < 1e-9, k
    assert grads["lm_head.weight"].abs().max() > 0  # the chunked path reached the output weight


def test_perturbing_a_chosen_token_changes_nothing_in_its_partner_or_other_segments(model):
    changed = list(SEGMENTS)
    ids, labels = A[0]
    ids = ids.copy()
    ids[-2] = (ids[-2] + 17) % (VOCAB - 3) + 3  # an answer token of pair A's chosen segment
    labels = np.where(labels == -100, -100, ids)
    changed[0] = (ids, labels)
    with torch.no_grad():
        before = segment_logprobs(packed_forward(model, micro_batch()), micro_batch()).sums
        mb = micro_batch(changed)
        after = segment_logprobs(packed_forward(model, mb), mb).sums
    assert abs(before[0] - after[0]) > 1e-3  # the chosen segment's own score does change
    assert (before[1:] - after[1:]).abs().max() == 0  # partner, SFT sample and pair B: bit-identical


def test_pairing_by_group_and_kind_and_its_errors():
    chosen, rejected = pair_index(
        torch.tensor([7, 7, -1, 9, 9]), torch.tensor([CHOSEN, REJECTED, SINGLE, REJECTED, CHOSEN])
    )
    assert (chosen.tolist(), rejected.tolist()) == ([0, 4], [1, 3])
    with pytest.raises(PacktoolError, match=r"without a partner: \[9\]"):
        pair_index(torch.tensor([7, 7, 9]), torch.tensor([CHOSEN, REJECTED, CHOSEN]))
    with pytest.raises(PacktoolError, match=r"with two chosen: \[7\]"):
        pair_index(torch.tensor([7, 7, 7, 7]), torch.tensor([CHOSEN, REJECTED, CHOSEN, REJECTED]))


def test_micro_batch_without_pairs_still_reaches_every_parameter(model):
    mb = collate([pack([S])])
    logps = segment_logprobs(packed_forward(model, mb), mb).sums
    terms = dpo_loss(logps, logps.detach(), torch.tensor([-1]), torch.tensor([SINGLE]))
    assert terms.losses.numel() == 0
    model.zero_grad()
    terms.loss_sum.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pair_normalisation_over_two_gloo_ranks_equals_single_process(tmp_path):
    import multiprocessing as mp

    import _pairs_worker
    from _ddp_worker import tiny_model

    vocab = 32  # _ddp_worker.tiny_model's embedding
    p1, p2, p3 = (make_pair(20 + i, 4 + i, 3, 2 + i, vocab) for i in range(3))
    sft = sequence(np.array([3, 4, 5]), np.array([6, 7]))
    rank_batches = [
        [([pack([p1[0], p1[1]])], [1, 1], [CHOSEN, REJECTED])],  # rank 0: one pair
        [  # rank 1: two pairs, then a micro-batch with no pair at all
            ([pack([p2[1], p2[0], p3[0]]), pack([p3[1]])], [2, 2, 3, 3], [REJECTED, CHOSEN, CHOSEN, REJECTED]),
            ([pack([sft])], [-1], [SINGLE]),
        ],
    ]
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_pairs_worker.run_rank, args=(r, 2, port, rank_batches, BETA, str(tmp_path / f"{r}.pt")))
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
    assert [r["n_local"] for r in results] == [1, 2] and results[0]["n_global"] == 3

    def window_grads(split):
        """One process: every micro-batch's pair-loss sum, each group of micro-batches divided as `split` says."""
        model, reference = tiny_model(0), tiny_model(1)
        for batches, divisor in split:
            for packs, group_ids, kinds in batches:
                mb = collate(packs)
                with torch.no_grad():
                    ref = segment_logprobs(reference(mb.input_ids), mb).sums
                policy = segment_logprobs(model(mb.input_ids), mb).sums
                terms = dpo_loss(policy, ref, torch.tensor(group_ids), torch.tensor(kinds), BETA)
                (terms.loss_sum / divisor).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    expected = window_grads([(rank_batches[0] + rank_batches[1], 3)])
    for name, grad in expected.items():
        for r in range(2):
            assert torch.allclose(results[r]["grads"][name], grad, atol=1e-12), (name, r)
    # The contrast: each rank averaging its own pairs (then DDP's mean over ranks) is another objective.
    local = window_grads([(rank_batches[0], 1 * 2), (rank_batches[1], 2 * 2)])
    assert max((local[n] - expected[n]).abs().max() for n in expected) > 1e-6
    assert pair_window_norm([KINDS]).scale == 1 / 2  # not distributed: W = 1, two pairs


def test_encoded_items_planned_and_collated_score_like_each_sequence_alone():
    """The build-side pieces composed: real encodings, joint truncation, item planning, labels, collate."""
    from support import QUICKSTART

    from packtool.adapters import group_from_record, pair_from_record
    from packtool.builder.answers import encode_answers
    from packtool.chat_templates import load_template
    from packtool.config import TokenizerConfig
    from packtool.encode import load_tokenizer
    from packtool.labels import cu_seqlens_from_lengths, labels_for
    from packtool.packing_items import plan_items, validate_item_plan
    from packtool.truncate import truncate_item

    folder = QUICKSTART / "tokenizer"
    tokenizer = load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))
    template = load_template("model", tokenizer.config)
    records = [
        {"prompt": "Name a colour of the sky at noon, please.", "chosen": "Blue.", "rejected": "Green."},
        {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5, I think"}]},
        {"prompt": "Say hi.", "completions": ["hi", "hello there", "hey"]},
    ]  # fmt: skip
    items = [
        group_from_record(r, sample_id=f"g:{i}", source="s")
        if "completions" in r
        else pair_from_record(r, sample_id=f"p:{i}", source="s")
        for i, r in enumerate(records)
    ]
    capacity = 72
    segments, kinds, groups = [], [], []
    for i, item in enumerate(items):
        fitted = truncate_item(encode_answers(item, template, tokenizer), capacity, "left")
        assert fitted.drop_reason is None
        segments += fitted.segments
        k = len(fitted.segments)
        kinds += [CHOSEN, REJECTED] if "completions" not in records[i] else [KIND_CODES["completion"]] * k
        groups += [i] * k
    lengths = [len(s) for s in segments]
    offsets = np.concatenate([[0], np.cumsum([2, 2, 3])])
    plan = plan_items(lengths, offsets, capacity, seed=1)
    validate_item_plan(plan, lengths, offsets, capacity)
    order = plan.segments.members.tolist()
    packs = []
    for p in range(plan.segments.n_packs):
        members = plan.segments.pack(p).tolist()
        ids = np.concatenate([segments[j].input_ids for j in members])
        cu = cu_seqlens_from_lengths([lengths[j] for j in members])
        packs.append(
            {
                "input_ids": ids,
                "labels": labels_for(ids, np.concatenate([segments[j].targets for j in members]), cu),
                "cu_seqlens": cu,
            }
        )
    mb = collate(packs)
    model = tiny_llama(seed=2)
    model.resize_token_embeddings(tokenizer.vocab_size)
    with torch.no_grad():
        scores = segment_logprobs(packed_forward(model, mb), mb)
        for position, j in enumerate(order):
            ids = segments[j].input_ids
            labels = np.where(segments[j].targets, ids, -100)
            assert abs(scores.sums[position] - naive_logp(alone(model, ids), labels)) < 1e-9
            assert int(scores.counts[position]) == segments[j].n_targets
    terms = dpo_loss(scores.sums, scores.sums.detach() - 1, torch.tensor(groups)[order], torch.tensor(kinds)[order])
    assert terms.losses.numel() == 2 and torch.isfinite(terms.losses).all()
