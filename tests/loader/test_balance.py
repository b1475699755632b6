import numpy as np
import pytest

from packtool.loader.balance import assign_lpt, assign_round_robin, imbalance, pack_costs


def test_docstring_example():
    costs = [9, 7, 6, 5, 4, 1]
    assert assign_round_robin(6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert assign_lpt(costs, 2) == [[0, 3, 5], [1, 2, 4]]
    assert imbalance(costs, assign_round_robin(6, 2)) == pytest.approx(19 / 16)
    assert imbalance(costs, assign_lpt(costs, 2)) == pytest.approx(17 / 16)


def test_lpt_balances_quadratic_cost_on_synthetic_step():
    rng = np.random.default_rng(0)
    capacity, world, n_packs = 4096, 8, 64
    attn, tokens = [], []
    for _ in range(n_packs):  # some packs hold one long document, most many short samples
        if rng.random() < 0.25:
            lengths = [capacity]
        else:
            lengths = rng.integers(64, 512, size=12).tolist()
            lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), capacity))]
        attn.append(sum(x * x for x in lengths))
        tokens.append(sum(lengths))
    costs = pack_costs(attn, tokens, alpha=4096.0)
    before = imbalance(costs, assign_round_robin(n_packs, world))
    after = imbalance(costs, assign_lpt(costs, world))
    print(f"imbalance max/mean: round robin {before:.3f} -> LPT {after:.3f}")
    assert after < before and after < 1.05
    plan = assign_lpt(costs, world)
    assert sorted(i for r in plan for i in r) == list(range(n_packs))
    assert plan == assign_lpt(costs.tolist(), world)  # a pure function: a resumed run agrees


def test_ties_go_to_lower_index_and_rank():
    assert assign_lpt([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]
