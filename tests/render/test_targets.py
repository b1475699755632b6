"""Which characters are trained (render.targets): the end of a turn and a printed value, each against a plain
search over the whole text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.render.targets import _end_of_turn, _printed_at


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(st.sampled_from(list("<|>ab")), max_size=40),
    markers=st.lists(st.text(st.sampled_from(list("<|>ab")), min_size=1, max_size=3), min_size=1, max_size=4),
    data=st.data(),
)
def test_the_end_of_a_turn_is_the_first_marker_outside_data(text, markers, data):
    """_end_of_turn searches for all markers at once; it answers what looking for every marker over the
    whole range does: the earliest start outside the skipped ranges (ties: the smaller marker)."""
    start = data.draw(st.integers(0, len(text)))
    limit = data.draw(st.integers(start, len(text)))
    skip = tuple(
        (a, a + data.draw(st.integers(0, 5))) for a in data.draw(st.lists(st.integers(0, len(text)), max_size=3))
    )
    found = [
        (at, marker)
        for marker in markers
        for at in range(start, limit - len(marker) + 1)
        if text.startswith(marker, at) and not any(a <= at < b for a, b in skip)
    ]
    first = min(found, default=None)
    for include in (False, True):
        expected = None if first is None else first[0] + (len(first[1]) if include else 0)
        assert _end_of_turn(text, start, limit, tuple(markers), include=include, skip=skip) == expected


def test_markers_starting_at_the_same_place_end_the_turn_the_same_way_whichever_is_listed_first():
    for markers in (("ab", "a"), ("a", "ab")):
        assert _end_of_turn("xxab", 0, 4, markers, include=True) == 3
    assert _end_of_turn("xxab", 0, 4, ("b", "ab"), include=False, skip=((2, 3),)) == 3


_PRINTABLE_VALUES = st.one_of(
    st.text(alphabet=st.sampled_from('ab"\\é\n{} '), max_size=6), st.integers(-99, 99), st.booleans(), st.none()
)


@settings(max_examples=300, deadline=None)
@given(
    value=_PRINTABLE_VALUES,
    noise=st.text(alphabet=st.sampled_from('ab"\\é\n{}: '), max_size=30),
    hint=st.integers(0, 40),
)
def test_a_printed_value_is_found_exactly_when_one_of_its_forms_is_in_the_text(value, noise, hint):
    """_printed_at tries the value as it is first and alone: the verdict (printed or not) is still whether any
    form a template may print (raw, JSON with or without escapes, Python) is in the text."""
    forms = {str(value), json.dumps(value), json.dumps(value, ensure_ascii=False)}
    if isinstance(value, str):
        forms |= {form[1:-1] for form in forms if form.startswith('"')} | {repr(value)[1:-1]}
    for text in (noise, noise + json.dumps(value) + noise, noise[:3] + str(value)):
        at = _printed_at(value, text, hint)
        assert (at >= 0) == any(form in text for form in forms)
        assert at < 0 or any(text.startswith(form, at) for form in forms)
