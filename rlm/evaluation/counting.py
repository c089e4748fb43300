"""``word_count``: how many times a word or phrase occurs in real text, the truth counted by code.

A question code answers exactly and a model reading pieces answers badly: the measure of
whether a prompt profile teaches a model to count with code instead of asking a sub-model.

The text is Paul Graham's essays (RULER's essay haystack, :func:`data.essay_words`), a run of
consecutive words starting at an offset drawn by the seed (so each sample reads another part of
the collection). Drawn by the seed as well:

* the target: a word (alphabetic, 3+ letters) or a two-word phrase of that text, occurring
  3 to 80 times in it (so neither "1" nor a count of the whole vocabulary is right), drawn
  with weights growing as the square root of the count;
* the case rule: ignoring case, or exactly as written (then the target is written in one of
  the forms it takes in the text, and the other forms do not count).

Counting, as the question states it: whole words only (not inside a longer word: the
target may neither follow nor precede a letter, digit or underscore), phrases with single
spaces between their words. ``expected`` = ``[str(count)]``, metric ``exact``.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from typing import Callable

from rlm.evaluation import data
from rlm.evaluation.sizing import Built

__all__ = ["build_word_count", "count_occurrences", "WORDS_PER_TOKEN"]

#: rough words per o200k token in the essays, for the first sizing guess
WORDS_PER_TOKEN = 0.75
_MIN, _MAX = 3, 80


def count_occurrences(text: str, target: str, ignore_case: bool) -> int:
    """Whole-word occurrences of ``target`` in ``text`` (the rule the question states)."""
    flags = re.IGNORECASE if ignore_case else 0
    return len(re.findall(r"(?<!\w)" + re.escape(target) + r"(?!\w)", text, flags))


def _candidates(words: list[str], phrase: bool, ignore_case: bool) -> list[str]:
    clean = [re.sub(r"^\W+|\W+$", "", w) for w in words]
    if phrase:
        items = [f"{a} {b}" for a, b in zip(clean, clean[1:])
                 if a.isalpha() and b.isalpha() and len(a) + len(b) >= 6]
    else:
        items = [w for w in clean if w.isalpha() and len(w) >= 3]
    counts = Counter(w.lower() if ignore_case else w for w in items)
    return sorted((w, n) for w, n in counts.items() if _MIN <= n <= _MAX)


def build_word_count(rng_factory: Callable[[], random.Random], units: int) -> Built:
    """A ``word_count`` sample over ``units`` consecutive words of the essays (at least 200).

    Raises:
        ConfigError: RULER's data package is missing (from :mod:`rlm.evaluation.data`).
    """
    rng = rng_factory()
    every = data.essay_words()
    n = max(200, units)
    start = rng.randrange(len(every))
    words = [every[(start + i) % len(every)] for i in range(n)]
    text = " ".join(words)
    phrase = rng.random() < 0.3
    ignore_case = rng.random() < 0.6
    pool = _candidates(words, phrase, ignore_case) or _candidates(words, False, True)
    if not pool:  # a tiny text with no repeated word: count the commonest one
        pool, ignore_case = [Counter(w.lower() for w in words).most_common(1)[0]], True
    # weighted by the square root of the count: most words of a text are rare (Zipf), and a
    # uniform pick would make nearly every answer 3
    target = rng.choices([w for w, _ in pool], weights=[c ** 0.5 for _, c in pool])[0]
    if ignore_case:  # written as the text writes it most often, counted in any case
        forms = Counter(m.group(0) for m in re.finditer(
            r"(?<!\w)" + re.escape(target) + r"(?!\w)", text, re.IGNORECASE))
        target = forms.most_common(1)[0][0] if forms else target
    kind = "phrase" if " " in target else "word"
    rule = "ignoring case" if ignore_case else "exactly as written (case-sensitive)"
    query = (f'How many times does the {kind} "{target}" appear in the text? Count whole words '
             f"only (not inside longer words), {rule}. Answer with one integer.")
    count = count_occurrences(text, target, ignore_case)
    template = ("Below is a text.\n\n{context}\n\n" f"Question: {query} Answer:")
    return Built(text, query, [str(count)], template)
