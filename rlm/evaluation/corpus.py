"""Two list tasks RULER lacks, built from SQuAD questions: ``aggregation`` and ``pairs``.

Both give the model a *list* ``context``: one string per item, ``"q0412: <question>"``,
each a question from SQuAD 2.0 dev (35 Wikipedia articles, 11,847 questions whose text is
unique in the data set; see :func:`data.squad_articles`). Which article a question is
about is not written anywhere in the list: a model has to read each question and judge
it, which is what makes these tasks grow with the context (the RLM paper's point that
recursion pays off on such "information-dense" tasks; cf. OOLONG, Bertsch et al., 2025).
Ids are sequential in list order, zero-padded to at least four digits.

``aggregation``: items are drawn uniformly from all articles (the pool is reshuffled and
reused, with new ids, once a long list has used every question). The query names one
article whose count sits in the middle third of the articles present, and asks how many
questions are about it. ``expected`` = ``[str(count)]``, metric ``exact``.

``pairs``: three target articles contribute 2 to 5 questions each (drawn without
replacement); every other item comes from the other 32 articles. The query names the three
articles and asks for every pair of question ids about the same one of them; ``expected``
is the sorted list of ``"qA,qB"`` strings (at most 3 x 10 = 30 pairs whatever the length,
so the answer stays short while finding the items takes reading all of them), metric
``pairs_f1``.
"""
from __future__ import annotations

import random
from itertools import combinations
from typing import Callable

from rlm.evaluation import data
from rlm.evaluation.sizing import Built

__all__ = ["build_aggregation", "build_pairs", "LIST_TEMPLATE", "TOKENS_PER_ITEM"]

#: Plain-completion frame of both list tasks (our wording; ``{context}`` is the list).
LIST_TEMPLATE = ("Below is a list of questions, one per line, each after its id. Every "
                 "question was written about one Wikipedia article.\n\n{context}\n\n"
                 "Question: {query} Answer:")
#: rough o200k tokens per list item, for the first sizing guess
TOKENS_PER_ITEM = 16.0


def _ids(n: int) -> list[str]:
    width = max(4, len(str(n - 1)))
    return [f"q{i:0{width}d}" for i in range(n)]


def _draw(pool: list[tuple[str, str]], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """``n`` items from ``pool``, each pass over the pool in a fresh random order."""
    out: list[tuple[str, str]] = []
    while len(out) < n:
        batch = list(pool)
        rng.shuffle(batch)
        out += batch[:n - len(out)]
    return out


def _frame(query: str) -> str:
    return LIST_TEMPLATE.replace("{query}", query)


def build_aggregation(rng_factory: Callable[[], random.Random], units: int) -> Built:
    """An aggregation sample of ``units`` questions (at least 1)."""
    rng = rng_factory()
    pool = [(title, q) for title, qs in data.squad_articles() for q in qs]
    items = _draw(pool, max(1, units), rng)
    counts: dict[str, int] = {}
    for title, _ in items:
        counts[title] = counts.get(title, 0) + 1
    ranked = sorted(counts, key=lambda t: (counts[t], t))
    third = len(ranked) // 3
    title = rng.choice(ranked[third:len(ranked) - third] or ranked)
    query = (f'How many of these questions are about the article "{title}"? '
             "Answer with one integer.")
    context = [f"{i}: {q}" for i, (_, q) in zip(_ids(len(items)), items)]
    return Built(context, query, [str(counts[title])], _frame(query))


def build_pairs(rng_factory: Callable[[], random.Random], units: int) -> Built:
    """A pairs sample of about ``units`` questions (at least the targets' 6 to 15)."""
    rng = rng_factory()
    articles = list(data.squad_articles())
    targets = rng.sample(range(len(articles)), 3)
    chosen = [(articles[t][0], q) for t in targets
              for q in rng.sample(articles[t][1], rng.randint(2, 5))]
    filler = [(title, q) for k, (title, qs) in enumerate(articles) if k not in targets
              for q in qs]
    items = chosen + _draw(filler, max(0, units - len(chosen)), rng)
    rng.shuffle(items)
    ids = _ids(len(items))
    by_title: dict[str, list[str]] = {}
    for i, (title, _) in zip(ids, items):
        by_title.setdefault(title, []).append(i)
    names = [articles[t][0] for t in targets]
    expected = sorted(f"{a},{b}" for t in names for a, b in combinations(by_title[t], 2))
    quoted = ", ".join(f'"{t}"' for t in names)
    query = (f"List every pair of question ids whose two questions are about the same one of "
             f"these articles: {quoted}. Write one pair per line as qA,qB.")
    context = [f"{i}: {q}" for i, (_, q) in zip(ids, items)]
    return Built(context, query, expected, _frame(query))
