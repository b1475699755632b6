"""The epoch plan as pure functions: every rank the same rounds, at most W-1 packs left out, resumable anywhere."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.errors import DatasetError
from packtool.loader.schedule import (
    ResumeState,
    epoch_order,
    plan_balanced,
    plan_packs,
    plan_token_budget,
    read_state,
    slot_ends,
)


def test_slot_ends_example():
    assert slot_ends(np.array([5, 3, 4, 4, 6]), 8) == [2, 4, 5]
    with pytest.raises(DatasetError, match="pack 1 has 9 tokens > token_budget 8"):
        slot_ends(np.array([5, 9]), 8)


def test_docstring_rounds():
    plan = plan_token_budget(0, np.array([5, 3, 4, 4, 6, 7, 2, 1]), 2, 8)
    assert plan.rank.tolist() == [0, 0, 1, 1, 0, 1, 0, 1]
    assert plan.round.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert plan.bounds.tolist() == [0, 4, 6, 8] and plan.dropped == 0
    short = plan_token_budget(0, np.array([5, 3, 4, 4, 6, 7, 2]), 2, 8)  # a 1-pack tail < W: left out
    assert short.rank.tolist() == [0, 0, 1, 1, 0, 1, -1] and short.dropped == 1


def _check(plan, world, n):
    kept = plan.rank >= 0
    assert plan.dropped == n - kept.sum() < world  # at most W-1 packs left out
    assert kept.tolist() == sorted(kept.tolist(), reverse=True)  # only a tail is left out
    for k in range(plan.rounds):
        inside = plan.rank[plan.bounds[k] - plan.start : plan.bounds[k + 1] - plan.start]
        assert sorted(set(inside.tolist())) == list(range(world))  # every rank has a share of every round


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=0, max_size=60), st.integers(1, 5), st.integers(16, 40))
def test_token_budget_plans(lengths, world, budget):
    lengths = np.array(lengths, dtype=np.int64)
    plan = plan_token_budget(0, lengths, world, budget)
    _check(plan, world, len(lengths))
    for r in range(world):  # each rank's share of a round is one micro-batch under the budget
        for k in range(plan.rounds):
            share = (plan.rank == r) & (plan.round == k)
            assert lengths[share].sum() <= budget
    for k in range(plan.rounds + 1):  # resuming at any round boundary plans the same rest
        q = int(plan.bounds[k])
        rest = plan_token_budget(q, lengths[q:], world, budget)
        assert rest.rank.tolist() == plan.rank[q:].tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 50), st.integers(1, 6))
def test_pack_plans(n, world):
    plan = plan_packs(0, n, world)
    _check(plan, world, n)
    assert plan.packs_per_rank() == [n // world] * world


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=0, max_size=50), st.integers(1, 4), st.integers(4, 12))
def test_balanced_plans(costs, world, per_step):
    costs = np.array(costs, dtype=np.float64)
    plan = plan_balanced(0, costs, world, per_step)
    _check(plan, world, len(costs))


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order([3, 2, 4], seed=1, epoch=0, shuffle=True)
    b = epoch_order([3, 2, 4], seed=1, epoch=0, shuffle=True)
    c = epoch_order([3, 2, 4], seed=1, epoch=1, shuffle=True)
    pairs = sorted(zip(a.unit.tolist(), a.row.tolist(), strict=True))
    assert pairs == [(u, r) for u, n in enumerate([3, 2, 4]) for r in range(n)]
    assert a.unit.tolist() == b.unit.tolist() and a.row.tolist() == b.row.tolist()
    assert (a.unit.tolist(), a.row.tolist()) != (c.unit.tolist(), c.row.tolist())
    plain = epoch_order([3, 2], seed=1, epoch=0, shuffle=False)
    assert plain.unit.tolist() == [0, 0, 0, 1, 1] and plain.row.tolist() == [0, 1, 2, 0, 1]


# ---- the one reader of a saved loader state: strict types, every problem at once ----

STATE = {"epoch": 1, "position": 3, "seed": 7, "shuffle": False, "build": "ab" * 32, "world_size": 4, "left_out": 1}


def test_read_state_reads_what_state_dict_writes():
    assert read_state(STATE) == ResumeState(1, 3, 7, False, "ab" * 32, 4, 1)
    assert read_state({"epoch": np.int64(0), "position": 0, "seed": 0}) == ResumeState(0, 0, 0)  # numpy's ints


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shuffle": "no"}, r"shuffle: expected true/false, got str 'no'"),
        ({"shuffle": 0}, r"shuffle: expected true/false, got int 0"),
        ({"position": 3.7}, r"position: expected an integer, got float 3.7"),
        ({"position": "7"}, r"position: expected an integer, got str '7'"),
        ({"position": True}, r"position: expected an integer, got bool True"),
        ({"epoch": -1}, r"epoch: must be between 0 and .* got -1"),
        ({"seed": -1}, r"seed: must be between 0 and 9,223,372,036,854,775,807 .* got -1"),
        ({"seed": 2**64}, r"seed: must be between 0 and 9,223,372,036,854,775,807"),
        ({"world_size": 0}, r"world_size: must be between 1 and"),
        ({"build": 5}, r"build: expected a sha256, got int 5"),
        ({"ranks": 4}, r"unknown key\(s\) 'ranks'; a state holds epoch, position, seed, shuffle, build"),
    ],
)
def test_read_state_refuses_what_a_state_cannot_hold(change, message):
    with pytest.raises(DatasetError, match=f"^resume state: {message}"):
        read_state(STATE | change)


def test_read_state_names_every_problem_and_what_is_missing():
    with pytest.raises(DatasetError, match=r"lacks \['seed'\].*; epoch: .*got -1; position: expected an integer"):
        read_state({"epoch": -1, "position": "0"})


@pytest.mark.parametrize("state", [[1, 2, 3], "state", None, 7])
def test_read_state_refuses_a_state_that_is_not_a_mapping(state):
    with pytest.raises(DatasetError, match=f"a loader state is a mapping .*, got {type(state).__name__}"):
        read_state(state)
