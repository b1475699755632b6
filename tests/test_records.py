"""Records (packtool.records): a special-token literal is looked for as its regex finds it; a document's
images are kept whole when it is sliced."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.records import PlacedImage, Tokenized

LITERAL_CHARACTERS = st.sampled_from(list("<|>[]\\^-a b\n\"'.*"))


@settings(max_examples=300, deadline=None)
@given(
    literals=st.lists(st.text(LITERAL_CHARACTERS, min_size=1, max_size=4), min_size=1, max_size=5),
    text=st.text(LITERAL_CHARACTERS, max_size=200),
    data=st.data(),
)
def test_a_literal_is_looked_for_as_the_regex_finds_it(literals, text, data):
    """spells_literal tries the pattern where the literals' first characters are, and past 32 such
    places searches with the regex: it answers what the pattern's own search answers, for any range,
    whatever characters the literals start with (regex syntax included)."""
    from packtool.records import literal_pattern, spells_literal

    pattern = literal_pattern(literals)
    assert pattern is not None
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, len(text)))
    assert spells_literal(pattern, text, start, end) == (pattern.search(text, start, end) is not None)
    assert spells_literal(pattern, text) == (pattern.search(text) is not None)


def _with_image(start: int, end: int, n: int = 10) -> Tokenized:
    image = PlacedImage("a.png", "0" * 64, 10, 4, 4, (1, 2, 2), start, end)
    ids = np.arange(n, dtype=np.int32)
    flags = np.zeros(n, bool), np.zeros(n, np.int8), np.zeros(n, np.int16)
    return Tokenized("x", "s", "h", ids, *flags, images=(image,))


def test_a_slice_keeps_an_image_whole_and_moves_its_tokens():
    document = _with_image(3, 7)
    assert [(i.start, i.end) for i in document.sliced(slice(2, None)).images] == [(1, 5)]
    keep = np.ones(10, bool)
    keep[[0, 8]] = False
    assert [(i.start, i.end) for i in document.sliced(keep).images] == [(2, 6)]
    assert document.sliced(slice(8, None)).images == ()


def test_a_cut_inside_an_image_is_refused():
    with pytest.raises(ValueError, match="inside the image"):
        _with_image(3, 7).sliced(slice(5, None))
    with pytest.raises(ValueError, match="outside"):
        _with_image(8, 11)
