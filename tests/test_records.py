"""Records (packtool.records): a special-token literal is looked for as its regex finds it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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
