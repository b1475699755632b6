"""Make a sample fit `capacity` tokens, and record what that cost.

A sample longer than a pack cannot be packed. `truncate` applies one named strategy and
returns a `Truncation`: the samples that remain (none, one, or several for `split`), the
strategy actually applied, how many tokens and targets were removed, and a drop reason when
nothing remains. Stats count it (`truncated.left`, `dropped.too_long`); rejects explain it.
A pair's or group's segments are fitted together instead (`truncate_item`, at the end): the
same prompt tokens leave every segment, and the answers are never cut.

Worked example: a conversation of 13 tokens, capacity 8. `P` is what the template writes
before message 0 (BOS, a default system block, message 0's header), `h` a separator/header it
writes between messages (message_index -1); `s`, `u`, `a` are system, user and assistant
tokens; `*` marks a target.

    position        0   1   2   3   4   5   6   7   8   9  10  11  12
    tokens          P   s0  h   u0  u1  h   a0* a1* h   u2  h   a2* a3*
    message_index  -1   0  -1   1   1  -1   2   2  -1   3  -1   4   4
                    [head    ]  [turn 0              ]  [turn 1      ]

    right    0..7           P  s0 h  u0 u1 h  a0* a1*    the final answer is lost
    left     5..12          h  a0* a1* h  u2 h  a2* a3*  the system prompt is lost; position 5
                                                         starts the segment, so a0* is the
                                                         first label (the label builder's rule)
    middle   0..3 + 9..12   P  s0 h  u0 u2 h  a2* a3*    head 4 + tail 4 (the head gets an odd
                                                         token); one segment with a seam
    turns    0..2 + 9..12   P  s0 h  u2 h  a2* a3*       turn 0 removed whole (7 tokens fit)

`turns` removes the oldest turns as one token range, from the first removed user message's
own tokens (position 3) up to the next kept user message's own tokens (position 9). Both ends
sit just after a user header, so the header kept at 2 now introduces message 3 and the row
still reads as a well-formed chat: no orphan header, no empty message. (Attaching template
tokens to the *next* message instead breaks exactly when message 0 is a user message, the
common case when the template writes its own default system block: the kept preamble would
end with message 0's header and be followed by message 3's, an empty user turn.)

Every strategy keeps structured messages (tool calls, tool results) and images whole: half a
JSON call teaches broken syntax, and half an image's tokens match no grid the model's processor
makes. A cut that would land inside one moves outward, dropping the message or the image. An
image longer than capacity cannot be kept by any cut: its sample is dropped (`image_too_long`).

Whatever a strategy keeps, a sample left without targets is removed (`no_targets`): it would
cost pack space and train nothing. The first token of a sample never counts
(`Tokenized.n_targets`), because a segment start never carries a label.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from packtool.records import Tokenized, prompt_length


@dataclass(frozen=True, slots=True)
class Truncation:
    """What truncating one sample produced.

    `numbers[i]` and `offsets[i]` say which part of the original `samples[i]` is: its number among
    the parts the strategy cut (split numbers its pieces 0, 1, 2, ... in token order, counting pieces
    later removed for having no target; every other strategy keeps one part, 0) and the position
    of its first token in the original (0 for `right` and `middle`, whose first token is the
    original's). A trace names a segment with them (docs/format.md "Pieces").

    `removed_tokens + sum(len(s) for s in samples)` is the original length, and
    `removed_targets + sum(s.targets.sum() for s in samples)` its target count: the counts are
    of removed tokens and their target flags. A target that survives as a sample's first token
    is not counted as removed although it will not be a label; `n_targets` on each sample is
    the number that trains. `detail` is one line for the rejects file when `drop_reason` is set.
    """

    samples: tuple[Tokenized, ...]
    strategy: str
    removed_tokens: int
    removed_targets: int
    drop_reason: str | None = None
    detail: str = ""
    numbers: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.numbers) == len(self.offsets) == len(self.samples):
            raise ValueError("Truncation needs one piece number and one offset per kept sample")
        if (self.drop_reason is None) != bool(self.samples):
            raise ValueError(
                f"Truncation has {len(self.samples)} samples and drop_reason {self.drop_reason!r}; "
                "a drop reason is set exactly when no sample remains"
            )

    @property
    def kept_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


class Strategy(Protocol):
    def __call__(self, sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation: ...


def truncate(sample: Tokenized, capacity: int, strategy: str, *, fallback: str = "right", seed: int = 0) -> Truncation:
    """Fit `sample` into `capacity` tokens with the named strategy (see the module docstring).

    A sample that already fits comes back unchanged with strategy "none". `fallback` is what
    `turns` applies when removing turns is not enough (or the sample is plain text).
    """
    check_strategy(strategy, fallback)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
        raise ValueError(
            f"capacity {capacity!r} must be an integer >= 2: a segment's first token is never a label, "
            "so a one-token row trains nothing"
        )
    if sample.n_targets == 0 or len(sample) <= capacity:
        # Without targets nothing a strategy keeps could train: report no_targets, not too_long.
        return _finish(sample, (sample,), "none")
    too_long = next((image for image in sample.images if image.end - image.start > capacity), None)
    if too_long is not None:
        detail = (
            f"sample {sample.example_id!r}: image {too_long.reference or '(embedded)'} takes "
            f"{too_long.end - too_long.start} tokens > capacity {capacity}; no cut keeps it whole"
        )
        return _finish(sample, (), "drop", drop_reason="image_too_long", detail=detail)
    return STRATEGIES[strategy](sample, capacity, fallback=fallback, seed=seed)


def check_strategy(strategy: str, fallback: str = "right") -> None:
    """Raise ValueError for a strategy/fallback pair `truncate` cannot run (config validation calls this)."""
    valid = ", ".join(STRATEGIES)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown truncation strategy {strategy!r}; expected one of {valid}")
    if fallback == "turns":
        raise ValueError(
            "truncation fallback 'turns' is not allowed: the fallback runs when removing turns was not "
            f"enough; choose one of {', '.join(name for name in STRATEGIES if name != 'turns')}"
        )
    if fallback not in STRATEGIES:
        raise ValueError(f"unknown truncation fallback {fallback!r}; expected one of {valid}")


def _finish(
    sample: Tokenized,
    pieces: tuple[Tokenized, ...],
    strategy: str,
    drop_reason: str | None = None,
    detail: str = "",
    starts: tuple[int, ...] | None = None,
) -> Truncation:
    """`starts[k]`: where piece k begins in `sample` (all 0 when not given)."""
    starts = starts if starts is not None else (0,) * len(pieces)
    numbered = [(k, piece) for k, piece in enumerate(pieces) if piece.n_targets > 0]
    kept = tuple(piece for _, piece in numbered)
    if not kept and drop_reason is None:
        drop_reason = "no_targets"
        if strategy == "none":
            detail = f"sample {sample.example_id!r}: no target token (the first token of a segment is never a label)"
        else:
            left = sum(len(piece) for piece in pieces)
            detail = (
                f"sample {sample.example_id!r}: no target token left after '{strategy}' kept {left} of {len(sample)}"
            )
    kept_targets = sum(int(piece.targets.sum()) for piece in kept)
    return Truncation(
        samples=kept,
        strategy=strategy,
        removed_tokens=len(sample) - sum(len(piece) for piece in kept),
        removed_targets=int(sample.targets.sum()) - kept_targets,
        drop_reason=drop_reason,
        detail=detail if drop_reason else "",
        numbers=tuple(k for k, _ in numbered),
        offsets=tuple(starts[k] for k, _ in numbered),
    )


def _too_long(sample: Tokenized, capacity: int) -> str:
    return f"sample {sample.example_id!r}: {len(sample)} tokens > capacity {capacity}"


def _plain_text_only(sample: Tokenized, capacity: int, strategy: str) -> Truncation:
    detail = (
        f"{_too_long(sample, capacity)}; strategy '{strategy}' applies to plain text, this sample is a "
        "conversation; use 'turns' (or right/left/middle) for chat sources, or raise capacity"
    )
    return _finish(sample, (), strategy, drop_reason="too_long", detail=detail)


# -- structured messages and images stay whole ----------------------------------------------


def _whole_spans(sample: Tokenized) -> list[tuple[int, int]]:
    """(first, last) token position of each structured message present in the sample, and of each image."""
    spans = []
    for message in sorted(sample.structured_messages):
        where = np.flatnonzero(sample.message_index == message)
        if len(where):
            spans.append((int(where[0]), int(where[-1])))
    return spans + [(image.start, image.end - 1) for image in sample.images]


def _end_outside_whole(sample: Tokenized, end: int) -> int:
    """The largest end' <= end such that keeping [0, end') splits no structured message and no image."""
    spans = _whole_spans(sample)
    moved = True
    while moved:  # more than one pass only when a template interleaves messages
        moved = False
        for first, last in spans:
            if first < end <= last:
                # Cut before the message's own tokens: its header stays, but nothing after it
                # is kept, so those few tokens carry no label and shape no prediction.
                end, moved = first, True
    return end


def _start_outside_whole(sample: Tokenized, start: int) -> int:
    """The smallest start' >= start such that keeping [start', L) splits no structured message and no image."""
    spans = _whole_spans(sample)
    moved = True
    while moved:
        moved = False
        for first, last in spans:
            if first < start <= last:
                start, moved = last + 1, True
    return start


# -- the strategies -----------------------------------------------------------------------


def _drop(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    detail = f"{_too_long(sample, capacity)}; set truncation.strategy or raise capacity"
    return _finish(sample, (), "drop", drop_reason="too_long", detail=detail)


def _right(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    end = _end_outside_whole(sample, capacity)
    return _finish(sample, (sample.sliced(slice(0, end)),), "right")


def _left(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    # The first kept token becomes a segment start and loses its label; the label builder
    # applies that rule, so slicing here stays a plain slice.
    start = _start_outside_whole(sample, len(sample) - capacity)
    return _finish(sample, (sample.sliced(slice(start, len(sample))),), "left", starts=(start,))


def _middle(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    # The head gets the odd token: the prompt start (system, task) is usually the part the
    # answer depends on most.
    head = _end_outside_whole(sample, capacity - capacity // 2)
    tail = _start_outside_whole(sample, len(sample) - capacity // 2)
    keep = np.zeros(len(sample), dtype=bool)
    keep[:head] = True
    keep[tail:] = True
    return _finish(sample, (sample.sliced(keep),), "middle")


def _window(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    if sample.message_roles:
        return _plain_text_only(sample, capacity, "window")
    # blake2b, not hash(): str hashes are salted per process, and the same seed must pick the
    # same window on every run and machine.
    digest = hashlib.blake2b(f"{seed}\x00{sample.example_id}".encode(), digest_size=8).digest()
    start = _start_outside_whole(sample, int.from_bytes(digest, "little") % (len(sample) - capacity + 1))
    end = _end_outside_whole(sample, min(start + capacity, len(sample)))
    return _finish(sample, (sample.sliced(slice(start, end)),), "window", starts=(start,))


def _split(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    if sample.message_roles:
        return _plain_text_only(sample, capacity, "split")
    # Each piece is its own segment: piece k cannot see piece k-1, and its first token loses
    # its label; the price of keeping every token of a long document.
    bounds = [0]
    while bounds[-1] < len(sample):  # every capacity tokens, or before an image that would be cut there
        bounds.append(_end_outside_whole(sample, min(bounds[-1] + capacity, len(sample))))
    pieces = tuple(sample.sliced(slice(start, end)) for start, end in itertools.pairwise(bounds))
    return _finish(sample, pieces, "split", starts=tuple(bounds[:-1]))


def _turns(sample: Tokenized, capacity: int, *, fallback: str, seed: int) -> Truncation:
    keep = _old_turns_removed(sample, capacity)
    if keep is None or keep.all():
        return STRATEGIES[fallback](sample, capacity, fallback=fallback, seed=seed)
    reduced = sample.sliced(keep)
    if len(reduced) <= capacity:
        # Usually 0, but a first turn that begins at the sample's first token goes with the rest.
        return _finish(sample, (reduced,), "turns", starts=(int(np.flatnonzero(keep)[0]),))
    rest = STRATEGIES[fallback](reduced, capacity, fallback=fallback, seed=seed)
    detail = rest.detail
    if rest.drop_reason:
        then = rest.detail.removeprefix(f"sample {sample.example_id!r}: ")
        detail = f"{_too_long(sample, capacity)}; {len(reduced)} after removing old turns, then {then}"
    in_original = np.flatnonzero(keep)  # the fallback's offsets are positions in `reduced`
    starts = tuple(int(in_original[offset]) for offset in rest.offsets)
    return _finish(sample, rest.samples, f"turns+{rest.strategy}", rest.drop_reason, detail, starts)


def _old_turns_removed(sample: Tokenized, capacity: int) -> np.ndarray | None:
    """Which tokens stay when the oldest whole turns go, as few as fit `capacity` (all removable ones if none do).

    A turn is a user message and everything up to the next user message. Messages before the
    first user message (system) stay, as does the turn holding the last message with a target
    and anything after it. None when nothing can be removed.
    """
    index = sample.message_index.astype(np.int64)
    own = index[index >= 0]
    if not sample.message_roles or np.any(own[1:] < own[:-1]):
        # Plain text, or a template that interleaves messages: no turn is a contiguous range.
        return None
    # Every token gets the latest message seen so far; with ordered messages this makes the
    # first position of message m a binary search, and a trailing template token (an end
    # marker that is a target) belong to the message it closes.
    latest = np.maximum.accumulate(index)
    if not sample.targets.any():
        return None
    last_target = int(np.flatnonzero(sample.targets)[-1])
    final_trained = int(latest[last_target])
    starts = [m for m, role in enumerate(sample.message_roles) if role == "user" and m <= final_trained]
    if len(starts) < 2:
        return None
    # Cut from a user message's own tokens to another user message's own tokens: the header
    # left in front is the same kind (see the module docstring).
    bounds = [int(np.searchsorted(latest, m, side="left")) for m in starts]
    excess = len(sample) - capacity
    removed = next((r for r in range(1, len(bounds)) if bounds[r] - bounds[0] >= excess), len(bounds) - 1)
    keep = np.ones(len(sample), dtype=bool)
    keep[bounds[0] : bounds[removed]] = False
    return keep


# Named truncation strategies; config names are checked against these keys.
STRATEGIES: dict[str, Strategy] = {
    "drop": _drop,
    "right": _right,
    "left": _left,
    "middle": _middle,
    "turns": _turns,
    "window": _window,
    "split": _split,
}


# -- joint truncation ---------------------------------------------------------------------------

# How a pair's or group's shared prompt may be shortened to fit one pack (config: truncation.items). The
# answers are never cut: a preference between two half answers, or a reward for a completion the model no
# longer sees, is not the same signal.
ITEM_TRUNCATION = ("drop", "left", "turns")


@dataclass(frozen=True, slots=True)
class ItemTruncation:
    """What fitting one item into a pack produced.

    `segments` are the item's segments with the same prompt cut (empty when dropped);
    `removed_prompt_tokens` is the cut per segment, so the item lost
    `removed_prompt_tokens * len(segments)` tokens and no target.
    """

    segments: tuple[Tokenized, ...]
    strategy: str  # "none" when it fit, else the strategy that cut or dropped it
    removed_prompt_tokens: int
    drop_reason: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if (self.drop_reason is None) != bool(self.segments):
            raise ValueError("a drop reason is set exactly when no segment remains")

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


def truncate_item(
    segments: Sequence[Tokenized], capacity: int, strategy: str = "left", *, too_long: str = "pair_too_long"
) -> ItemTruncation:
    """Fit all segments of one item into one pack of `capacity` tokens by cutting their shared prompt.

    Worked example: two segments with a 10-token prompt and answers of 3 and 5 tokens make
    13 + 15 = 28 tokens; at capacity 20 each copy of the prompt must lose 4 tokens.

        left    keep the last 6 prompt tokens in both segments          6+3 + 6+5 = 20
        turns   remove the oldest whole turns of the prompt, from one user message's own tokens
                to a later user message's (as truncate's `turns` does), as few as free 4 tokens;
                drop when even keeping only the last user turn is too long
        drop    drop the item

    The same prompt tokens go in every segment, so the segments still share one prompt. The
    prompt keeps at least one token (the header that opens the answer). `left` may cut through a
    tool call in the prompt, unlike SFT truncation: prompt tokens are context only, so no broken
    syntax is ever a target; never through an image (the cut moves past it). `too_long` is the drop
    reason (`pair_too_long`, `group_too_long`).
    """
    if strategy not in ITEM_TRUNCATION:
        raise ValueError(f"unknown item truncation {strategy!r}; expected one of {', '.join(ITEM_TRUNCATION)}")
    segments = tuple(segments)
    total = sum(len(s) for s in segments)
    if total <= capacity:
        return ItemTruncation(segments, "none", 0)
    k = len(segments)
    n_prompt = prompt_length(segments[0])
    answers = total - k * n_prompt
    room = (capacity - answers) // k  # prompt tokens each segment may keep
    keep = _prompt_keep(segments[0], n_prompt, room, strategy) if room >= 1 else None
    if keep is None:
        detail = (
            f"item {segments[0].example_id!r}: {k} segments, {total} tokens > capacity {capacity} "
            f"(answers {answers} together, prompt {n_prompt} in each); truncation '{strategy}'"
        )
        return ItemTruncation((), strategy, 0, drop_reason=too_long, detail=detail)
    cut = tuple(s.sliced(np.concatenate([keep, np.ones(len(s) - n_prompt, dtype=bool)])) for s in segments)
    return ItemTruncation(cut, strategy, n_prompt - int(keep.sum()))


def _prompt_keep(segment: Tokenized, n_prompt: int, room: int, strategy: str) -> np.ndarray | None:
    """Which of the first `n_prompt` tokens stay (at most `room` of them), or None when the strategy cannot."""
    keep = np.ones(n_prompt, dtype=bool)
    if strategy == "left":
        cut = n_prompt - room
        for image in segment.images:  # in token order: a cut moved past one image may land in the next
            if image.start < cut < image.end:
                cut = image.end
        if cut >= n_prompt:
            return None
        keep[:cut] = False
        return keep
    if strategy != "turns":
        return None
    index = segment.message_index[:n_prompt].astype(np.int64)
    own = index[index >= 0]
    if np.any(own[1:] < own[:-1]):
        return None  # a template that interleaves messages: no turn is a contiguous range
    latest = np.maximum.accumulate(index)
    present = set(own.tolist())
    users = [m for m, role in enumerate(segment.message_roles) if role == "user" and m in present]
    bounds = [int(np.searchsorted(latest, m, side="left")) for m in users]
    excess = n_prompt - room
    removed = next((r for r in range(1, len(bounds)) if bounds[r] - bounds[0] >= excess), None)
    if removed is None:
        return None
    keep[bounds[0] : bounds[removed]] = False
    return keep
