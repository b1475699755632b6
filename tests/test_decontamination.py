"""The matching of packtool.decontamination: normalized words, windows across line breaks, short items whole, and
the numpy index finding exactly what the reference (Python sets of word tuples) finds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.decontamination import (
    EvalIndex,
    EvalItem,
    Finding,
    ReferenceIndex,
    _batch,
    _Table,
    eval_strings,
    fold,
    words,
)

ANSWER = "The mitochondria is the powerhouse of the cell and it makes most of the energy a cell uses every day"


def _item(n: int, field: str = "answer") -> EvalItem:
    return EvalItem("eval.jsonl", f"eval.jsonl:{n}", field)


def _both(items, ngram=13, min_words=6):
    return EvalIndex.build(items, ngram, min_words), ReferenceIndex(items, ngram, min_words)


def test_words_are_normalized_across_lines_case_punctuation_and_unicode():
    assert words("The  Cat,\nsat -- on\tthe MAT!") == ["the", "cat", "sat", "on", "the", "mat"]
    assert words("ﬁne Straße café_au_lait ①") == ["fine", "strasse", "café", "au", "lait", "1"]
    assert fold("a\u00a0b") == "a b"  # NFKC: a no-break space is a space


@given(st.text(max_size=60))
def test_the_ascii_fast_fold_is_the_unicode_one(text):
    import re
    import unicodedata

    assert fold(text).split() == re.sub(r"[\W_]+", " ", unicodedata.normalize("NFKC", text).casefold()).split()


def test_eval_strings_walk_every_string_and_fields_narrow_them():
    record = {"id": "q1", "question": "Q?", "choices": ["a", "b"], "messages": [{"role": "user", "content": "hi"}]}
    assert list(eval_strings(record)) == [
        ("id", "q1"),
        ("question", "Q?"),
        ("choices[0]", "a"),
        ("choices[1]", "b"),
        ("messages[0].role", "user"),
        ("messages[0].content", "hi"),
    ]
    assert list(eval_strings(record, ["choices"])) == [("choices[0]", "a"), ("choices[1]", "b")]


def test_an_answer_rewrapped_into_8_word_lines_still_matches_in_the_target():
    rewrapped = "\n".join(" ".join(ANSWER.split()[i : i + 8]) for i in range(0, len(ANSWER.split()), 8))
    for index in _both([(_item(1), ANSWER)]):
        (finding,) = index.check([(["What does it do?"], [f"Sure. {rewrapped.upper()} Hope this helps."])])
        assert finding is not None and (finding.part, finding.rule, finding.item.record) == (
            "target",
            "ngram",
            "eval.jsonl:1",
        )
        assert len(finding.overlap.split()) == 13


def test_a_short_item_matches_whole_from_min_words_and_yes_matches_nothing():
    items = [(_item(1, "choices[2]"), "Paris is the capital of France"), (_item(2, "answer"), "Yes")]
    for index in _both(items):
        found = index.check([([], ["I think paris is the capital of france."]), ([], ["yes, Paris is the capital"])])
        assert found[0] == Finding(_item(1, "choices[2]"), "target", "short", "paris is the capital of france")
        assert found[1] is None


def test_a_target_overlap_wins_over_a_prompt_one_and_exact_comes_first():
    items = [(_item(1), ANSWER), (_item(2, "question"), "Explain what the mitochondria does in a cell please")]
    for index in _both(items):
        (prompt_only,) = index.check([(["Explain what the mitochondria does in a cell, please."], ["No idea."])])
        assert (prompt_only.part, prompt_only.rule, prompt_only.item.record) == ("prompt", "exact", "eval.jsonl:2")
        (both,) = index.check([(["Explain what the mitochondria does in a cell please"], [ANSWER])])
        assert (both.part, both.rule) == ("target", "exact")


def test_pieces_are_apart_a_window_does_not_span_two_messages():
    half = len(ANSWER.split()) // 2
    first, second = " ".join(ANSWER.split()[:half]), " ".join(ANSWER.split()[half:])
    for index in _both([(_item(1), ANSWER)]):
        assert index.check([([], [first, second])]) == [None]


# words of one 8-byte chunk and of several (the longest past the 255 bytes whose length seeds a word's hash)
VOCABULARY = ["alpha", "beta", "gamma", "Delta", "ETA", "Straße", "ﬁne", "café", "日本語", "naïve_x", "x²"]
VOCABULARY += ["Internationalization", "überempfindlichkeit", "q" * 300]
phrases = st.lists(st.sampled_from(VOCABULARY), min_size=0, max_size=20).map(" ".join)
separators = st.sampled_from([" ", "\n", ", ", " -- "])


@settings(max_examples=60, deadline=None)
@given(
    evals=st.lists(phrases, min_size=1, max_size=6),
    samples=st.lists(st.tuples(st.lists(phrases, max_size=2), st.lists(phrases, max_size=3)), min_size=1, max_size=6),
    ngram=st.integers(3, 6),
    min_words=st.integers(1, 3),
    separator=separators,
)
def test_the_index_finds_what_the_reference_finds(evals, samples, ngram, min_words, separator):
    """Few words, so overlaps are frequent: every rule, and ties between them, are exercised; some words are not
    ASCII (NFKC, casefold, a ligature, an underscore that splits), so the unicode path is too."""
    items = [(_item(i), text) for i, text in enumerate(evals)]
    samples = [([p.replace(" ", separator) for p in prompts], targets) for prompts, targets in samples]
    fast, reference = _both(items, ngram, min_words)
    got, expected = fast.check(samples), reference.check(samples)
    # the same decision, part and rule; the eval record and words may be another of equal rank
    assert [(f.part, f.rule) if f else None for f in got] == [(f.part, f.rule) if f else None for f in expected]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.text(max_size=40) | phrases, max_size=8))
def test_a_batch_hashes_the_words_that_words_finds(texts):
    """The numpy word split (one translate for an ASCII batch, fold per piece otherwise) is `words`, word for word."""
    batch = _batch(texts)
    alone = [_batch([w]).runs(np.zeros(1, np.int64), 1)[0] for text in texts for w in words(text)]
    assert np.diff(batch.first).tolist() == [len(words(text)) for text in texts]
    assert batch.runs(np.arange(len(alone)), 1).tolist() == alone


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=300), st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_a_table_finds_what_a_binary_search_finds(held, others):
    """Repeats, empty buckets and buckets of many (few hashes share the top bits of a small table)."""
    hashes = np.sort(np.array(held + held[:20], np.uint64))
    table = _Table.of(hashes)
    wanted = np.array(held[::3] + others, np.uint64)
    at, place = table.find(wanted)
    first = np.searchsorted(hashes, wanted)
    expected = np.flatnonzero(hashes[np.minimum(first, len(hashes) - 1)] == wanted) if len(hashes) else []
    assert at.tolist() == list(expected)
    assert place.tolist() == first[at].tolist()


@settings(max_examples=150, deadline=None)
@given(
    ngram=st.integers(2, 9),
    min_words=st.integers(1, 9),
    start=st.integers(0, 31),
    before=st.integers(0, 20),
    lead=st.integers(0, 20),
)
def test_every_eval_window_is_found_wherever_it_sits_in_the_batch(ngram, min_words, start, before, lead):
    """The window filter is read at every stride-th word of the batch only: a copied window is found at any
    word of any piece (`lead` words in an earlier sample shift it in the batch, `before` within its piece)."""
    min_words = min(min_words, ngram)
    answer = [f"answer{i}" for i in range(40)]
    copied = answer[start : start + ngram]
    piece = " ".join([f"filler{i}" for i in range(before)] + copied + ["filler", "end"])
    index = EvalIndex.build([(_item(1), " ".join(answer))], ngram, min_words)
    lead_sample = ([" ".join(f"lead{i}" for i in range(lead))], [])
    found = index.check([lead_sample, (["A question?"], [piece])])
    assert found[0] is None
    assert found[1] == Finding(_item(1), "target", "ngram", " ".join(copied))


def test_an_empty_index_and_empty_samples():
    index = EvalIndex.build([], 13, 6)
    assert index.check([([], []), ([""], ["   "])]) == [None, None]
    assert EvalIndex.build([(_item(1), ANSWER)], 13, 6).check([]) == []


@pytest.mark.parametrize("text", ["", "a b", ANSWER])
def test_sizes_count_what_is_indexed(text):
    sizes = EvalIndex.build([(_item(1), text)], 13, 2).sizes
    assert sizes["strings"] == 1
    assert sizes["ngrams"] == max(0, len(text.split()) - 12)
    assert sizes["short"] == (1 if 2 <= len(text.split()) < 13 else 0)


def _config(tmp_path, **section):
    from support import QUICKSTART

    from packtool.config import parse_config

    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    raw = {
        "sources": [{"path": "chat.jsonl", "format": "messages"}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 64,
        "output": "out",
        "decontamination": section,
    }
    return parse_config(raw, base_dir=tmp_path)


def test_the_section_is_checked_like_any_other_all_problems_at_once(tmp_path):
    from packtool.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, against="missing-*.jsonl", ngramm=10, action="delete", min_line_words=20, fields=[1])
    problems = caught.value.problems
    assert "decontamination.ngramm: unknown key; did you mean 'ngram'?" in problems
    assert any(p.startswith("decontamination.against: no file matches 'missing-*.jsonl'") for p in problems)
    assert any(p.startswith("decontamination.action: 'delete' is not one of drop, report") for p in problems)
    assert any(p.startswith("decontamination.min_line_words:") for p in problems)
    assert any(p.startswith("decontamination.fields: expected a list of field names") for p in problems)
    with pytest.raises(ConfigError, match=r"decontamination.against: is required"):
        _config(tmp_path, ngram=10)


def test_min_line_words_left_out_follows_a_smaller_ngram(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"q": "fine"}\n')
    assert _config(tmp_path, against="eval.jsonl", ngram=4).decontamination.min_line_words == 4
    assert _config(tmp_path, against="eval.jsonl", ngram=13).decontamination.min_line_words == 6


def test_an_eval_set_is_read_whole_or_the_build_stops_naming_the_record(tmp_path):
    from packtool.decontamination import eval_set
    from packtool.errors import PacktoolError

    (tmp_path / "eval.jsonl").write_text('{"q": "fine"}\n{"q": broken\n')
    settings = _config(tmp_path, against="eval.jsonl").decontamination
    with pytest.raises(PacktoolError, match=r"decontamination.against: eval.jsonl:2"):
        eval_set(settings)
    (tmp_path / "eval.jsonl").write_text('{"q": "fine"}\n')
    narrowed = _config(tmp_path, against="eval.jsonl", fields=["answer"]).decontamination
    with pytest.raises(PacktoolError, match=r"eval.jsonl: 1 records and no fields \['answer'\] to match"):
        eval_set(narrowed)
    whole = eval_set(_config(tmp_path, against="eval.jsonl").decontamination)
    assert whole.files[0]["records"] == 1 and whole.record()["index"]["strings"] == 1
