"""The ``word_count`` task (rlm/evaluation/counting.py): real text, a word or phrase and a case
rule drawn by seed, the truth counted by code. Checked here against a count made another way
(tokens of the text compared one by one, not the task's regex)."""
from __future__ import annotations

import re

import pytest

from rlm.evaluation.tasks import make_sample


def independent_count(text: str, target: str, ignore_case: bool) -> int:
    # whole words: runs of word characters; a phrase is consecutive such runs separated by
    # exactly one space in the text
    norm = (lambda s: s.lower()) if ignore_case else (lambda s: s)
    want = [norm(w) for w in target.split(" ")]
    spans = [(m.group(0), m.start(), m.end()) for m in re.finditer(r"\w+", text)]
    n = 0
    for i in range(len(spans) - len(want) + 1):
        window = spans[i:i + len(want)]
        if [norm(w) for w, _, _ in window] != want:
            continue
        if all(text[a[2]:b[1]] == " " for a, b in zip(window, window[1:])):
            n += 1
    return n


def parse(query: str) -> tuple[str, bool]:
    target = re.search(r'the (?:word|phrase) "([^"]+)"', query).group(1)
    return target, "ignoring case" in query


@pytest.mark.parametrize("length", [2000, 8000, 36000])
@pytest.mark.parametrize("index", range(4))
def test_the_truth_is_the_count_of_the_text(length, index):
    s = make_sample("word_count", length, 0, index)
    target, ignore_case = parse(s.query)
    assert s.expected == [str(independent_count(s.context, target, ignore_case))]
    assert 3 <= int(s.expected[0]) <= 80 * 2  # a phrase's forms may add up past 80
    assert abs(s.context_tokens - length) <= 0.05 * length
    assert s.metric == "exact" and s.score(s.expected[0]) == 1.0 and s.score("1") == 0.0


def test_samples_are_drawn_by_seed_and_deterministic():
    queries = {make_sample("word_count", 8000, seed, 0).query for seed in range(12)}
    assert len(queries) >= 10  # words, phrases and case rules differ by seed
    text = " ".join(queries)
    assert "phrase" in text and "word" in text
    assert "ignoring case" in text and "case-sensitive" in text
    a, b = make_sample("word_count", 8000, 3, 1), make_sample("word_count", 8000, 3, 1)
    assert (a.context, a.query, a.expected) == (b.context, b.query, b.expected)
