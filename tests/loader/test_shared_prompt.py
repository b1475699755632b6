"""Shared-prompt layout (issue 13 item 7): a prompt stored once scores every answer as the unshared sequences do."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_pair_proofs import naive_logp  # noqa: E402
from test_proofs import VOCAB, alone, tiny_llama  # noqa: E402

from packtool.loader.attention import additive_mask  # noqa: E402
from packtool.loader.shared_prompt import (  # noqa: E402
    answer_logprobs,
    shared_prompt_additive_mask,
    shared_prompt_block_mask,
    shared_prompt_layout,
    shared_prompt_mask,
)

# Two groups in one row: a prompt of 6 with three answers, a prompt of 3 with two (a DPO pair).
GROUPS = [(6, [4, 5, 3]), (3, [2, 6])]


def group_tokens(seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for n_prompt, answers in GROUPS:
        out.append((rng.integers(3, VOCAB, size=n_prompt), [rng.integers(3, VOCAB, size=a) for a in answers]))
    return out


def test_layout_matches_the_drawn_example():
    layout = shared_prompt_layout([(3, [2, 3])])
    assert layout.branch.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    assert layout.predecessor.tolist() == [-1, 0, 1, 2, 3, 2, 5, 6]
    assert layout.answer_of.tolist() == [-1, -1, -1, 0, 0, 1, 1, 1]
    drawn = """
        1 . . . . . . .
        1 1 . . . . . .
        1 1 1 . . . . .
        1 1 1 1 . . . .
        1 1 1 1 1 . . .
        1 1 1 . . 1 . .
        1 1 1 . . 1 1 .
        1 1 1 . . 1 1 1"""
    expected = [[c == "1" for c in line.split()] for line in drawn.strip().splitlines()]
    assert shared_prompt_mask(layout).tolist() == expected
    two = shared_prompt_layout([(2, [1]), (1, [1, 1])])
    assert two.predecessor.tolist() == [-1, 0, 1, -1, 3, 3]  # group 2 starts fresh; both answers read its prompt
    assert two.answer_of.tolist() == [-1, -1, 0, -1, 1, 2]
    with pytest.raises(ValueError, match="group 0"):
        shared_prompt_layout([(0, [1])])


def test_shared_prompt_scores_equal_each_unshared_sequence_alone():
    model = tiny_llama(seed=0)
    groups = group_tokens(5)
    layout = shared_prompt_layout(GROUPS)
    ids = torch.from_numpy(np.concatenate([np.concatenate([p, *answers]) for p, answers in groups]))[None]
    targets = layout.branch > 0  # every answer token is a target
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            position_ids=layout.position_ids[None],
            attention_mask=shared_prompt_additive_mask(layout, torch.float64),
        ).logits
        shared = answer_logprobs(logits, ids, targets, layout)
        expected, stored_alone = [], 0
        for prompt, answers in groups:
            for answer in answers:
                sequence = np.concatenate([prompt, answer])
                labels = np.where(np.arange(len(sequence)) >= len(prompt), sequence, -100)
                expected.append(naive_logp(alone(model, sequence), labels))
                stored_alone += len(sequence)
    assert (shared.sums - torch.stack(expected)).abs().max() < 1e-9
    assert shared.counts.tolist() == [a for _, answers in GROUPS for a in answers]
    # the contrast: a plain causal mask per group lets later answers read earlier ones
    cu = torch.tensor([0, *np.cumsum([p + sum(a) for p, a in GROUPS])])
    with torch.no_grad():
        causal = model(
            input_ids=ids,
            position_ids=layout.position_ids[None],
            attention_mask=additive_mask(cu, layout.n_tokens, torch.float64),
        ).logits
    mixed = answer_logprobs(causal, ids, targets, layout).sums
    first = torch.tensor([True, False, False, True, False])  # the first answer of a group reads only the prompt
    assert (mixed - shared.sums)[first].abs().max() < 1e-9 and (mixed - shared.sums)[~first].abs().min() > 1e-6
    # the saving: each group stores its prompt once instead of once per answer
    assert stored_alone - layout.n_tokens == sum((len(a) - 1) * p for p, a in GROUPS)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_equals_the_dense_rule():
    from torch.nn.attention.flex_attention import flex_attention

    layout = shared_prompt_layout(GROUPS)
    total = layout.n_tokens
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, total, 8) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=shared_prompt_block_mask(layout))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=shared_prompt_mask(layout))
    assert torch.allclose(flex, dense, atol=1e-5)
