"""Numbers checked where they enter: one checker per kind of input, shared by the config, the CLI, `trace` and
the loader, so a seed or an alpha is held to one rule whichever door it came through.

A checker returns what is wrong (the value, the limit, what the limit guards) or None, so a caller collects
every problem before it raises. Types are strict: True is not the integer 1, 3.7 is not a position, "7" is not
a number; numpy's integers and floats are integers and numbers.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any

MAX_COUNT = 2**62  # a count of tokens, packs or processes any machine holds: past it, a typo
MAX_SEED = 2**63 - 1  # seeds feed 64-bit generators; numpy's SeedSequence refuses a negative one
# A pack's attention cost is at most capacity**2, so at alpha = capacity its tokens already outweigh its
# attention; past the largest capacity (2**20) a larger alpha orders the packs the same, only nearer inf.
MAX_ALPHA = float(2**20)


def range_problem(value: float, low: float, high: float, why: str) -> str | None:
    """`value` (of the right type) outside [low, high], NaN included."""
    if not low <= value <= high:  # also true for NaN
        return f"must be between {low:,} and {high:,} ({why}), got {value!r}"
    return None


def integer_problem(value: Any, low: int, high: int, why: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        return f"expected an integer, got {type(value).__name__} {value!r}"
    return range_problem(int(value), low, high, why)


def number_problem(value: Any, low: float, high: float, why: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, Real):
        return f"expected a number, got {type(value).__name__} {value!r}"
    return range_problem(float(value), low, high, why)


def seed_problem(value: Any) -> str | None:
    """A build's or a loader's seed."""
    return integer_problem(value, 0, MAX_SEED, "seeds are non-negative 64-bit integers")


def alpha_problem(value: Any) -> str | None:
    """The loader's balance weight of a pack's tokens beside its attention cost."""
    return number_problem(value, 0.0, MAX_ALPHA, "the weight of a pack's tokens beside its attention cost")
