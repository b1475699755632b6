"""Recipes: everything render_chat derives for one skeleton and one trained-message pattern, replayed for
the next conversation of the shape without a render or a target search (an accelerator: see routes.py)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from operator import add

from packtool.records import Example, Rendered, Span
from packtool.render.marks import _MARKERS

# A place in the rendered text as (literal piece k, characters into it): contents sit between pieces.
_Anchor = tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Recipe:
    """Everything render_chat derives for one _Skeleton and one trained-message pattern, with every
    position anchored in the skeleton's literals, so that a conversation of that shape needs neither
    the sentinel fill and strip nor the target search (alpaca with Qwen2.5, the whole render_chat: 50 ->
    22 us per sample; 13-14 us with the content cores stripped once and the data check of a record
    that brings only contents searching them as they are).

    What render_chat checks on a filled skeleton (each content printed once and verbatim, no tools,
    targets between the same literal markers) depends on the shape and the pattern alone, and was
    checked on the conversation the recipe was learned from; the recipe is kept only when it
    rebuilds that conversation's Rendered exactly.

        pieces   '<|im_start|>user\n'  ⟦0⟧  '<|im_end|>\n<|im_start|>assistant\n'  ⟦1⟧  '<|im_end|>\n'
        target   (1, 33) .. (2, 10), message 1: from the header's end to past <|im_end|>
    """

    pieces: tuple[str, ...]  # the skeleton's literals without sentinels; pieces[k] precedes content copy k
    piece_lengths: tuple[int, ...]
    copies: tuple[int, ...]  # the message each content copy is of
    spans: tuple[tuple[int, int, str], ...]  # (content copy, message, role) in Rendered.spans order
    targets: tuple[tuple[_Anchor, _Anchor, int], ...]

    @classmethod
    def of(
        cls, literals: tuple[str, ...], copies: tuple[int, ...], rendered: Rendered, texts: list[str]
    ) -> _Recipe | None:
        """The recipe of the Rendered a filled skeleton gave: its `literals` with `texts[copies[k]]` between
        literal k and k + 1 (a skeleton's own; the skeleton holds its recipes, so it is not imported here)."""
        pieces = tuple(_MARKERS.sub("", literal) for literal in literals)
        lengths = tuple(map(len, pieces))
        starts = _piece_starts(lengths, [texts[i] for i in copies])
        copy_at = {start + len(piece): k for k, (start, piece) in enumerate(zip(starts, pieces))}
        ends = list(map(add, starts, lengths))
        anchors = [_anchor(starts, ends, at) for start, end, _ in rendered.target_ranges for at in (start, end)]
        spans = [(copy_at.get(span.start), span.message, span.role) for span in rendered.spans]
        if any(anchor is None for anchor in anchors) or any(k is None for k, _, _ in spans):
            return None
        recipe = cls(
            pieces,
            lengths,
            copies,
            tuple((k, message, role) for k, message, role in spans if k is not None),
            tuple(
                (start, end, i)
                for start, end, (_, _, i) in zip(anchors[::2], anchors[1::2], rendered.target_ranges)
                if start is not None and end is not None
            ),
        )
        return recipe if recipe.rendered(rendered.example, texts) == rendered else None

    def rendered(self, example: Example, texts: list[str]) -> Rendered:
        """The Rendered of a conversation of this shape and pattern, with these texts (_Skeleton.texts)."""
        copied = [texts[i] for i in self.copies]
        lengths = self.piece_lengths
        starts = _piece_starts(lengths, copied)
        parts = [self.pieces[0]]
        for core, piece in zip(copied, self.pieces[1:]):
            parts += (core, piece)
        spans = tuple(
            Span(starts[k] + lengths[k], starts[k + 1], message, role, False) for k, message, role in self.spans
        )
        return Rendered(
            example=example,
            text="".join(parts),
            spans=spans,
            content_ranges=tuple((span.start, span.end) for span in spans),
            target_ranges=tuple((starts[ks] + ps, starts[ke] + pe, i) for (ks, ps), (ke, pe), i in self.targets),
        )


def _piece_starts(piece_lengths: tuple[int, ...], copied: list[str]) -> list[int]:
    """Where each literal piece starts in the text, with copied[k] between pieces k and k + 1."""
    return list(accumulate(map(add, piece_lengths, map(len, copied)), initial=0))


def _anchor(starts: list[int], ends: list[int], at: int) -> _Anchor | None:
    """The first piece holding position `at` (its end included); None inside a content. Pieces'
    ends never decrease, so a bisection finds it: a scan per target made a 10,000-turn
    conversation quadratic (7 s)."""
    k = bisect.bisect_left(ends, at)
    return (k, at - starts[k]) if k < len(ends) and starts[k] <= at else None
