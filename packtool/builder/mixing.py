"""Mixing: how many copies of each source's samples a build takes, as pure functions of amounts and seeds.

weights (mix_by multiplier | samples | tokens) --source_multipliers--> m per source --repeat_plan--> copies
quota (a source's amount of tokens or target tokens) --quota_plan--> copies
copies: (positions, repeat numbers) into the source's items, drawn under source_seed(seed, name)
packs' amounts of each source (mixing.interleave) --interleave_order--> the pack order
quotas and the amounts the shards hold --quota_misses--> a line for each quota the build fell short of
weights and what reached a pack --unsampled_sources--> a line for each source that kept records and trains none
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from packtool.config import BuildConfig, Quota
from packtool.errors import BuildError

# A plan holds ~70 bytes per copy of a sample (position, reference, repeat number, length, source, kind,
# targets), about twice while the sources are joined: 100M copies of one source is ~14 GB already. A quota
# of 10**13 target tokens on a chat source asked for 1.86 TiB before this check.
MAX_COPIES = 100_000_000


def _check_copies(copies: int, n: int, asked: str, source: str) -> None:
    """Refuse a plan too large to hold before any of it is allocated (a source's own samples, once each, are
    already held: a large source down-sampled or taken once is never refused)."""
    if copies > max(MAX_COPIES, n):
        digits = str(copies)  # weight 1e308: not a line of 309 digits (nor a float, which it overflows)
        count = f"{copies:,}" if len(digits) < 19 else f"{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"
        raise BuildError(
            f"source {source!r}: {asked} needs {count} copies of its {n:,} samples, over the {MAX_COPIES:,} "
            "a plan holds in memory (~14 GB); lower it, or add more data to the source"
        )


def source_multipliers(
    samples: dict[str, int], tokens: dict[str, int], weights: dict[str, float], mode: str
) -> dict[str, float]:
    """How many copies of each source's samples to take.

    multiplier: the weight itself (2.0 doubles a source). samples/tokens: weights are target
    shares of samples/tokens; multipliers m_i = share_i * total / own_i keep the total unchanged.
    """
    present = [name for name in samples if samples[name] > 0]
    if mode == "multiplier":
        return {name: weights[name] for name in present}
    amount = samples if mode == "samples" else tokens
    total = sum(amount[n] for n in present)
    weight_sum = sum(weights[n] for n in present)
    return {n: (weights[n] / weight_sum) * total / amount[n] for n in present}


def repeat_plan(n: int, multiplier: float, *, seed: int, source: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(positions, repeat numbers) of the copies of n samples: floor(m) full passes, then
    round(frac(m) * n) samples chosen by a seeded permutation.

    n=4, m=1.5 -> positions [0 1 2 3 | 1 3], repeats [0 0 0 0 | 1 1]   (which two: the seed decides)
    """
    whole = int(np.floor(multiplier))
    extra = round((multiplier - whole) * n)
    _check_copies(whole * n + extra, n, f"weight {multiplier:g}", source)
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:extra]) if extra else np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.tile(np.arange(n), whole), chosen]).astype(np.int64)
    repeats = np.concatenate([np.repeat(np.arange(whole), n), np.full(len(chosen), whole)]).astype(np.int32)
    return positions, repeats


def quota_plan(amounts: np.ndarray, quota: int, *, seed: int, source: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(positions, repeat numbers) of the copies that bring a source to `quota`: whole passes while
    they stay below it, then samples in a seeded order until the total reaches it, so
    quota <= total < quota + the last sample's amount (met within one sample). A quota below the
    source's own total down-samples it (no whole pass).

    amounts [5, 3, 4], quota 20: one pass (12), then in seeded order (say 4, 5) until >= 20
    -> positions [0 1 2 | 0 2], repeats [0 0 0 | 1 1], total 21
    """
    n = len(amounts)
    total = int(amounts.sum())
    if n == 0 or total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    whole = (quota - 1) // total  # passes that stay below the quota (the next sample then reaches it)
    _check_copies(whole * n + n, n, f"quota {quota:,} ({total:,} a pass)", source)  # the last pass: at most n
    left = quota - whole * total
    order = np.random.default_rng(seed).permutation(n)
    reached = np.cumsum(amounts[order])
    extra = int(np.searchsorted(reached, left)) + 1  # the first prefix whose total reaches what is left
    chosen = np.sort(order[:extra])
    positions = np.concatenate([np.tile(np.arange(n), whole), chosen]).astype(np.int64)
    repeats = np.concatenate([np.repeat(np.arange(whole), n), np.full(len(chosen), whole)]).astype(np.int32)
    return positions, repeats


def source_quotas(config: BuildConfig) -> dict[str, Quota]:
    return {s.name: s.plan.quota for s in config.sources if s.plan.quota is not None}


# What the shards' per-source stats (summaries.summarize) call each quota unit.
REALIZED = {"target_tokens": "targets", "tokens": "tokens"}


def quota_misses(quotas: dict[str, Quota], realized: dict[str, dict[str, int]]) -> list[str]:
    """One line for each quota the shards fall short of. The plan meets a quota within one sample (quota <=
    realized < quota + the last sample), so any shortfall is a miss: a source that kept nothing (every record
    rejected or dropped, an empty file) or whose samples all went to the overflow or validation folder.

    quotas {docs: target_tokens 50,000}, realized {docs: {targets: 0}}
    -> ["quota 'docs' missed: realized 0 of 50,000 target_tokens (short by 50,000; a quota is met within one
        sample); the source holds none in OUT: see packtool stats"]
    """
    lines = []
    for name, quota in quotas.items():
        got = realized.get(name, {}).get(REALIZED[quota.unit], 0)
        if got < quota.amount:
            lines.append(
                f"quota {name!r} missed: realized {got:,} of {quota.amount:,} {quota.unit} (short by "
                f"{quota.amount - got:,}; a quota is met within one sample)"
                + ("; the source holds none in OUT: see packtool stats" if got == 0 else "")
            )
    return lines


def unsampled_sources(weights: dict[str, float], accounting: dict[str, dict[str, Any]]) -> list[str]:
    """One line for each source weighed in that kept records of which no segment reached a pack: a weight that
    draws no sample (1e-300 x 1,300 rounds to 0) left a whole source out of OUT without a word.

    weights {chat: 1e-300}, accounting {chat: {kept: 1300, segments: 0}}
    -> ["source 'chat' kept 1,300 records and none reached a pack (at weight 1e-300 it draws no sample, or the
        validation split holds them all); raise its weight: see packtool stats"]
    """
    lines = []
    for name, weight in weights.items():
        counts = accounting.get(name, {})
        if counts.get("kept", 0) > 0 and counts.get("segments", 0) == 0:
            lines.append(
                f"source {name!r} kept {counts['kept']:,} records and none reached a pack (at weight {weight:g} "
                "it draws no sample, or the validation split holds them all); raise its weight: see packtool stats"
            )
    return lines


def source_seed(seed: int, name: str) -> int:
    """The seed of one source's sampling: sources draw independently under one build seed."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def splitmix64(values: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of each value under a seed: uniform 64-bit scores that the seed reshuffles."""
    with np.errstate(over="ignore"):
        z = values + np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# How much the whole order's running gap weighs beside the current window's own gap. The window's gap is what
# is measured; the running gap stops a source from being put off window after window and piling up at the end.
# Measured on a three-source real build (tests/builder/test_interleave.py), worst window gap at K = 8/16/32/64:
# 0.142/0.063/0.032/0.013 at 0.1; 0.527/0.135/0.032/0.013 without the running gap; 0.263/0.089/0.036/0.017 with
# the running gap alone; 0.153/0.081/0.043/0.016 at 1.0.
RUNNING_GAP_WEIGHT = 0.1


def interleave_order(amounts: np.ndarray, window: int) -> np.ndarray:
    """A pack order whose windows of `window` consecutive packs each hold the sources near their shares of
    the whole: pack order[i] goes to position i.

    amounts [packs, sources] in the mix's unit. A pack's gap is share x its amount - its amount of each
    source; the window's gap, summed over its packs, is its deviation from the mix times its amount. Packs
    queue behind the source they hold most of, in the order they came (the packer's seeded shuffle), and
    each step takes the queue head that leaves the smallest window gap + RUNNING_GAP_WEIGHT x the gap of the
    whole order so far (sums of squares; ties: the lower source).

        amounts  [[6, 0], [6, 0], [6, 0], [0, 2], [0, 2], [0, 2]]   shares 0.75, 0.25, window 2
        order    [0, 3, 1, 4, 2, 5]                                 every window [6, 2]: exactly the mix
    """
    amounts = np.asarray(amounts, dtype=np.float64)
    n, k = amounts.shape
    total = amounts.sum()
    share = amounts.sum(axis=0) / total if total else np.full(k, 1.0 / max(k, 1))
    leading = amounts.argmax(axis=1) if k else np.zeros(n, np.int64)
    queues = [np.flatnonzero(leading == s).tolist() for s in range(k)]
    heads = [0] * k
    # plain floats: a step weighs a handful of candidates, where numpy's per-call cost is most of the time
    gaps = share[None, :] * amounts.sum(axis=1, keepdims=True) - amounts
    steps = gaps.tolist()
    # |w + d|^2 + c |r + d|^2 = |w|^2 + c |r|^2 + d . 2 (w + c r) + (1 + c) |d|^2: only the last two depend on d
    own = ((1 + RUNNING_GAP_WEIGHT) * (gaps * gaps).sum(axis=1)).tolist()
    in_window, running = [0.0] * k, [0.0] * k
    order = np.empty(n, np.int64)
    for i in range(n):
        if i % window == 0:
            in_window = [0.0] * k
        pull = [2 * (w + RUNNING_GAP_WEIGHT * r) for w, r in zip(in_window, running)]
        best, best_score = -1, math.inf
        for s in range(k):
            if heads[s] < len(queues[s]):
                pack = queues[s][heads[s]]
                score = own[pack] + sum(d * g for d, g in zip(steps[pack], pull))
                if score < best_score:
                    best, best_score = s, score
        pack = queues[best][heads[best]]
        heads[best] += 1
        in_window = [w + d for w, d in zip(in_window, steps[pack])]
        running = [r + d for r, d in zip(running, steps[pack])]
        order[i] = pack
    return order
