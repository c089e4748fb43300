"""RULER's synthetic tasks, re-implemented without NLTK or wonderwords.

The definitions follow RULER (Hsieh et al., 2024, "RULER: What's the real context size of
your long-context language models?") as shipped in ``nvidia-long-context-eval`` 26.3:
``synthetic.yaml`` for each task's arguments, ``data/synthetic/*.py`` for how a sample is
built, ``data/synthetic/constants.py`` for the prompt templates (imported, not copied).
Each builder here takes a seeded :class:`random.Random` factory and a unit count and returns
a :class:`~rlm.evaluation.sizing.Built`; :mod:`rlm.evaluation.tasks` sizes it.

Differences from RULER's scripts, all forced by running offline or by lengths past the data:

* key words (``words`` needles) are ``word-word`` pairs from :func:`data.vocabulary` (the
  essays' own vocabulary) instead of wonderwords' adjective-noun pairs; ``cwe`` draws its
  words from the same list;
* essays are cut into sentences by :func:`data.split_sentences` (a regex) instead of NLTK;
* when the essays run out they repeat (RULER does the same for long essay haystacks);
* ``cwe``: when a length needs more distinct words than the vocabulary has, every word
  repeats more often, keeping RULER's 10:1 ratio of common to uncommon repeats;
* ``qa_1``: past the 1,204 SQuAD paragraphs (about 197k tokens) the distractors continue
  with HotpotQA paragraphs;
* distractor keys of ``niah_multikey_2``/``_3`` never equal a real key (a collision would
  make the answer ambiguous).
"""
from __future__ import annotations

import random
import string
import uuid
from typing import Callable

from rlm.evaluation import data
from rlm.evaluation.sizing import Built

__all__ = ["NIAH", "NEEDLE", "REPEAT", "DEPTHS", "build_niah", "build_vt", "build_cwe",
           "build_fwe", "build_qa", "units_guess"]

Rng = Callable[[], random.Random]

#: niah variants from synthetic.yaml: (haystack, key type, value type, #keys, #values, #queries)
NIAH = {
    "niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
#: RULER's needle sentence and its ``repeat`` haystack sentence (niah.py).
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: Insertion depths in percent for essay needles: 40 evenly spaced values, rounded.
DEPTHS = [round(100 * i / 39) for i in range(40)]


def _template(task: str, **values) -> str:
    """RULER's template + answer prefix for ``task`` with ``{context}`` kept as placeholder."""
    t = data.ruler_templates()[task]
    text = t["template"] + t.get("answer_prefix", "")
    return text.format(context="{context}", **values)


def _question(template: str) -> str:
    """The question after the context in a filled template, without "Question: "."""
    tail = template.split("{context}", 1)[1]
    for prefix in (" Answer:", " The special magic"):
        tail = tail.split(prefix, 1)[0]
    return tail.rsplit("Question: ", 1)[-1].strip()


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    words = data.vocabulary()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _insert_lines(lines: list[str], needles: list[str], rng: random.Random) -> list[str]:
    for pos, needle in zip(sorted(rng.sample(range(len(lines)), len(needles)), reverse=True),
                           needles):
        lines.insert(pos, needle)
    return lines


def _essay_haystack(n_words: int, needles: list[str], rng: random.Random) -> str:
    words = data.essay_words()
    reps = -(-n_words // len(words))
    sents = data.split_sentences(" ".join((words * reps)[:n_words] if reps > 1
                                          else words[:n_words]))
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
    cuts.append(len(sents))
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(p for p in parts if p)


def build_niah(task: str, rng_factory: Rng, units: int) -> Built:
    """A needle-in-a-haystack sample (RULER ``niah.py``); ``units`` = haystack words
    (essay) or lines (repeat, needle)."""
    hay, ktype, vtype, nk, nv, nq = NIAH[task]
    rng = rng_factory()
    nk = max(nk, nq)
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    while len(keys) < nk:
        key = _random_value(ktype, rng)
        if key in keys:
            continue
        keys.append(key)
        values.append([_random_value(vtype, rng) for _ in range(nv)])
        needles += [NEEDLE.format(type_needle_v=vtype, key=key, value=v) for v in values[-1]]
    rng.shuffle(needles)
    if hay == "essay":
        context = _essay_haystack(units, needles, rng)
    else:
        lines = [REPEAT] * units if hay == "repeat" else _distractor_needles(
            units, ktype, vtype, set(keys), rng)
        context = "\n".join(_insert_lines(lines, needles, rng))
    asked = rng.sample(range(nk), nq)
    queried = [keys[i] for i in asked]
    query = queried[0] if nq == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
    question, template = _niah_frame(vtype, nq * nv == 1, query)
    return Built(context, question, [v for i in asked for v in values[i]], template)


def _distractor_needles(n: int, ktype: str, vtype: str, keys: set, rng) -> list[str]:
    lines = []
    while len(lines) < n:
        key = _random_value(ktype, rng)
        if key not in keys:
            lines.append(NEEDLE.format(type_needle_v=vtype, key=key,
                                       value=_random_value(vtype, rng)))
    return lines


def _niah_frame(vtype: str, single: bool, query: str) -> tuple[str, str]:
    t = data.ruler_templates()["niah"]
    text = t["template"] + t["answer_prefix"]
    if single:  # RULER's own rewording for one answer (niah.py)
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            text = text.replace(old, new)
        vtype = vtype[:-1]
    template = text.format(type_needle_v=vtype, context="{context}", query=query)
    return _question(template), template


# ---- variable tracking (variable_tracking.py; synthetic.yaml: 1 chain, 4 hops) ----

def _chain(rng: random.Random, letters: int, hops: int = 4) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    stmts = [f"VAR {names[0]} = {rng.randint(10000, 99998)}"]
    stmts += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, stmts


def _vt_context(n_noise: int, stmts: list[str], rng: random.Random) -> str:
    lines = [REPEAT + "\n"] * n_noise
    for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(stmts)))):
        lines.insert(pos + j, stmts[j])
    return " ".join(lines).replace(". \n", ".\n")


def build_vt(rng_factory: Rng, units: int) -> Built:
    """A variable-tracking sample; ``units`` = noise lines. The base prompt starts with one
    solved example (RULER adds a few-shot example of the same task, 3-letter names)."""
    rng = rng_factory()
    names, stmts = _chain(rng, 5)
    value = stmts[0].split("=")[-1].strip()
    ex_names, ex_stmts = _chain(rng, 3)
    ex_value = ex_stmts[0].split("=")[-1].strip()
    example = _template("variable_tracking", query=ex_value, num_v=5).replace(
        "{context}", _vt_context(15, ex_stmts, rng)) + " " + " ".join(ex_names)
    template = _template("variable_tracking", query=value, num_v=len(names))
    context = _vt_context(max(units, len(stmts)), stmts, rng)
    return Built(context, _question(template), names, example + "\n\n" + template)


# ---- common words extraction (common_words_extraction.py; 10 words x30, others x3) ----

def _word_list(words: list[str], common: int, uncommon: int, rng: random.Random
               ) -> tuple[str, list[str]]:
    listed = words[:10] * common + words[10:] * uncommon
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), words[:10]


def build_cwe(rng_factory: Rng, units: int, small: bool) -> Built:
    """A common-words sample; ``units`` = distinct words. ``small`` (length < 4096 tokens)
    uses RULER's short-context repeats (common x6, others x1, example 20 words x3/x1);
    otherwise common x30, others x3, example 40 words x10/x3. The base prompt starts with
    the solved example, as RULER's does."""
    rng = rng_factory()
    vocab = data.vocabulary()
    common, uncommon = (6, 1) if small else (30, 3)
    if units > len(vocab):  # more words than the vocabulary: repeat each more often
        uncommon = round(uncommon * units / len(vocab))
        common = uncommon * (6 if small else 10)
    words = rng.sample(vocab, min(max(units, 10), len(vocab)))
    ex_ctx, ex_answer = _word_list(rng.sample(vocab, 20 if small else 40),
                                   *((3, 1) if small else (10, 3)), rng=rng)
    example = _template("common_words_extraction", query="").replace("{context}", ex_ctx)
    example += " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
    context, answer = _word_list(words, common, uncommon, rng)
    template = _template("common_words_extraction", query="")
    return Built(context, _question(template), answer, example + "\n" + template)


# ---- frequent words extraction (freq_words_extraction.py; zeta distribution, alpha 2) ----

def _zeta(alpha: float, n: int = 1000) -> float:
    """Riemann zeta by Euler-Maclaurin summation (error far below 1e-12 for alpha >= 2)."""
    head = sum(k ** -alpha for k in range(1, n))
    return head + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2 + alpha * n ** (-alpha - 1) / 12


def build_fwe(rng_factory: Rng, units: int, length: int, alpha: float = 2.0) -> Built:
    """A frequent-words sample; ``units`` = words of coded text. The vocabulary has
    ``length // 50`` six-letter coded words (at least 5); the word of rank k appears
    ``int(units * k**-alpha / zeta(alpha))`` times; rank 1 is the noise word ``...`` and the
    answer is ranks 2 to 4."""
    rng = rng_factory()
    size = max(5, length // 50)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    z = _zeta(alpha)
    words = [w for k, w in enumerate(ranked, 1) for _ in range(int(units * k ** -alpha / z))]
    rng.shuffle(words)
    template = _template("freq_words_extraction", query="")
    return Built(" ".join(words), _question(template), ranked[1:4], template)


# ---- question answering (qa.py; SQuAD for qa_1, HotpotQA for qa_2) ----

def _qa_pool(dataset: str) -> tuple[list[str], list[dict], Callable[[], list[str]]]:
    """(documents, questions, loader of extra distractor documents past the pool)."""
    if dataset == "squad":
        docs, qas = data.squad_docs_and_qas()
        return docs, qas, lambda: data.hotpot_docs_and_qas()[0]
    docs, qas = data.hotpot_docs_and_qas()
    return docs, qas, list


def build_qa(dataset: str, pick: random.Random, rng_factory: Rng, units: int) -> Built:
    """A QA sample; ``units`` = documents. ``pick`` chooses the question (the same one at
    every length for a given seed and index). The question's own documents always come
    first, then documents of the same article (SQuAD), then random others; then shuffled."""
    docs, qas, extra = _qa_pool(dataset)
    qa = qas[pick.randrange(len(qas))]
    rng = rng_factory()
    own, more = list(qa["context"]), list(qa["more_context"])
    n = max(units, len(own))
    if n <= len(own) + len(more):
        chosen = [docs[i] for i in own + rng.sample(more, n - len(own))]
    elif n <= len(docs):
        taken = set(own + more)
        rest = [i for i in range(len(docs)) if i not in taken]
        chosen = [docs[i] for i in own + more + rng.sample(rest, n - len(taken))]
    else:
        others = extra()
        chosen = list(docs) + rng.sample(others, min(len(others), n - len(docs)))
    rng.shuffle(chosen)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
    template = _template("qa", query=qa["query"])
    return Built(context, qa["query"], list(qa["outputs"]), template)


#: rough o200k tokens per unit, for the first guess of :func:`~rlm.evaluation.sizing.fit`.
TOKENS_PER_UNIT = {"essay": 1.3, "repeat": 22.0, "needle": 18.0, "vt": 22.0, "cwe": 12.0,
                   "fwe": 2.5, "qa_1": 165.0, "qa_2": 110.0}


def units_guess(kind: str, length: int) -> int:
    """First unit count to try for a context of ``length`` tokens."""
    return max(1, round(length / TOKENS_PER_UNIT[kind]))
