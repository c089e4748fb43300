"""Long-context evaluation tasks: RULER's thirteen plus ``aggregation``, ``pairs`` and
``word_count``.

``make_sample(task, length, seed, index)`` builds one :class:`Sample`: the ``context``
(a string, or a list of strings for the list tasks) sized to about ``length`` o200k_base
tokens, the ``query`` an RLM gets, the reference answers and the metric that scores an
answer. Samples are deterministic in (task, length, seed, index): all randomness comes
from :class:`random.Random` seeded with a string of those four values. Where a task picks
a question from a data set (``qa_1``, ``qa_2``) the pick ignores ``length``, so one index
asks the same question at every length.

Task definitions and metrics: :mod:`rlm.evaluation.ruler` (RULER) and
:mod:`rlm.evaluation.corpus` (``aggregation``, ``pairs``), :mod:`rlm.evaluation.counting`
(``word_count``: a word or phrase counted in real text, the truth computed by code).

Sizes: the context is within 5% of ``length`` tokens except where a task cannot be that
small: ``qa_1``/``qa_2`` need the question's own documents (one SQuAD paragraph, about
150 tokens; ten HotpotQA paragraphs, about 1,000 tokens), ``niah_multikey_3``'s lines of
two uuids are about 50 tokens each, and a sample always holds its needles, chain or ten
common words. Generation takes about 0.01 s at 8k tokens, 0.1-0.4 s at 128k and 0.6-2.6 s
at 1M (``python -m evals.bench_tasks``).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable

from rlm.errors import ConfigError
from rlm.models.tokens import count_tokens, encoding
from rlm.evaluation import corpus, counting, ruler
from rlm.evaluation.sizing import Built, context_text, fit

__all__ = ["TASKS", "Task", "TASK_NAMES", "METRICS", "ANSWER_TOKENS", "MIN_LENGTH", "MAX_LENGTH", "Sample", "make_sample", "parse_length",
           "parse_tasks", "score_answer"]

MIN_LENGTH = 256
MAX_LENGTH = 16 * 1024 * 1024
_UNITS = {"k": 1024, "m": 1024 * 1024}


def parse_length(text: str) -> int:
    """Parse a context length in tokens: ``"8k"`` -> 8192, ``"128K"`` -> 131072, ``"1M"``
    -> 1048576 (binary multiples), ``"32000"`` -> 32000, ``"1.5k"`` -> 1536.

    Raises:
        ConfigError: not a number with an optional k/M suffix, below 256 or above 16M.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ConfigError(f"bad length {text!r}: give tokens as a number, optionally with k "
                          "(x1024) or M (x1048576), e.g. 8k, 128k, 1M, 32000")
    value = int(round(float(m.group(1)) * _UNITS.get(m.group(2).lower(), 1)))
    if not MIN_LENGTH <= value <= MAX_LENGTH:
        raise ConfigError(f"length {text!r} = {value} tokens is outside {MIN_LENGTH}.."
                          f"{MAX_LENGTH} tokens")
    return value


def parse_tasks(text: str) -> list[str]:
    """Parse a comma-separated task list (``"all"`` = every task), duplicates dropped.

    Raises:
        ConfigError: empty list or an unknown name (the message lists the choices).
    """
    names: list[str] = []
    for raw in str(text).split(","):
        name = raw.strip()
        chosen = list(TASK_NAMES) if name == "all" else [name]
        for n in chosen:
            if n not in TASK_NAMES:
                raise ConfigError(f"unknown task {name!r}; choose from: all, "
                                  + ", ".join(TASK_NAMES))
            if n not in names:
                names.append(n)
    if not names or not all(r.strip() for r in str(text).split(",")):
        raise ConfigError("empty task in --tasks; choose from: all, " + ", ".join(TASK_NAMES))
    return names


@dataclass(frozen=True)
class Sample:
    """One evaluation sample.

    Attributes:
        task, length, seed, index: what built it (``length`` = requested context tokens).
        context: the document (str) or the list of items (list[str]) an RLM gets.
        query: the question an RLM gets.
        expected: reference answers, used by ``metric``.
        metric: ``string_match_all`` | ``string_match_part`` | ``exact`` | ``pairs_f1``.
        context_chars, context_tokens: actual size of the context in characters and
            o200k_base tokens (a list counts as its items joined by newlines).
        template: the plain-completion prompt of the task (RULER's template and answer
            prefix, with any few-shot example RULER adds) with the literal ``{context}``
            where the context goes; empty means the context, a blank line and the query.
    """

    task: str
    length: int
    seed: int
    index: int
    context: str | list[str]
    query: str
    expected: list[str]
    metric: str
    context_chars: int
    context_tokens: int
    template: str = field(default="", repr=False)

    @property
    def answer_tokens(self) -> int:
        """Tokens to leave for the answer in a plain completion (RULER's setting)."""
        return ANSWER_TOKENS.get(self.task, 128)

    def base_prompt(self, max_tokens: int) -> tuple[str, bool]:
        """One plain-completion prompt with the context cut to fit ``max_tokens``.

        The context keeps its start (a list is cut between items); the whole prompt is at
        most ``max_tokens`` o200k_base tokens. Leave room for the answer yourself
        (:attr:`answer_tokens`).

        Returns:
            ``(prompt, truncated)``; ``truncated`` is True when the context was cut.
        Raises:
            ConfigError: ``max_tokens`` cannot hold even the template without context.
        """
        template = self.template or "{context}\n\n" + self.query
        head, tail = template.split("{context}", 1)
        room = max_tokens - count_tokens(head) - count_tokens(tail) - 2
        if room < 0:
            raise ConfigError(f"max_tokens={max_tokens} cannot hold the {self.task} prompt "
                              "without its context")
        text = context_text(self.context)
        if self.context_tokens <= room:
            return head + text + tail, False
        cut = _cut(text, room, isinstance(self.context, list))
        while count_tokens(head + cut + tail) > max_tokens and cut:
            cut = _cut(cut, count_tokens(cut) - 8, isinstance(self.context, list))
        return head + cut + tail, True

    def score(self, answer: str | None) -> float:
        """Score ``answer`` against ``expected`` by ``metric``: 0.0..1.0 (None -> 0.0)."""
        return score_answer(self.metric, answer, self.expected)


def _cut(text: str, tokens: int, by_line: bool) -> str:
    """The first ``tokens`` tokens of ``text``; a list's text is cut back to a whole line."""
    enc = encoding()
    cut = enc.decode(enc.encode_ordinary(text)[:max(tokens, 0)], errors="ignore")
    if by_line and cut != text:
        cut = cut[:cut.rfind("\n") + 1].rstrip("\n") if "\n" in cut else ""
    return cut


# ---- scoring ----

def score_answer(metric: str, answer: str | None, expected: list[str]) -> float:
    """Score one answer, 0.0..1.0.

    * ``string_match_all``: fraction of references found in the answer, case-insensitive
      substring (RULER, ``eval/synthetic/constants.py``);
    * ``string_match_part``: 1.0 when any reference is found (RULER, same file);
    * ``exact``: the last integer in the answer (commas as thousands separators allowed)
      equals ``int(expected[0])``;
    * ``pairs_f1``: ids ``q<digits>`` in the answer, taken two at a time in order, form
      unordered pairs (ids compared by number, so q7 = q0007); F1 of that set against the
      expected pairs.

    Raises:
        ConfigError: unknown metric.
    """
    if answer is None:
        return 0.0
    if metric not in _SCORERS:
        raise ConfigError(f"unknown metric {metric!r}; choose from: " + ", ".join(_SCORERS))
    return _SCORERS[metric](str(answer), expected)


def _match_all(answer: str, refs: list[str]) -> float:
    low = answer.lower()
    return sum(r.lower() in low for r in refs) / len(refs) if refs else 0.0


def _match_part(answer: str, refs: list[str]) -> float:
    low = answer.lower()
    return max((float(r.lower() in low) for r in refs), default=0.0)


def _exact(answer: str, refs: list[str]) -> float:
    found = re.findall(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+", answer)
    return float(bool(found) and bool(refs) and int(found[-1].replace(",", "")) == int(refs[0]))


def _pair_set(text: str) -> set[frozenset[int]]:
    ids = [int(x) for x in re.findall(r"\bq(\d+)\b", text, flags=re.IGNORECASE)]
    return {frozenset(p) for p in zip(ids[0::2], ids[1::2]) if p[0] != p[1]}


def _pairs_f1(answer: str, refs: list[str]) -> float:
    want = set().union(*(_pair_set(r) for r in refs)) if refs else set()
    got = _pair_set(answer)
    hits = len(want & got)
    if not hits:
        return float(not want and not got)
    precision, recall = hits / len(got), hits / len(want)
    return 2 * precision * recall / (precision + recall)


_SCORERS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": _match_all, "string_match_part": _match_part, "exact": _exact,
    "pairs_f1": _pairs_f1}


# ---- building ----

def make_sample(task: str, length: int, seed: int, index: int) -> Sample:
    """Build the sample ``index`` of ``task`` at ``length`` tokens for ``seed``.

    Args:
        task: one of :data:`TASK_NAMES`.
        length: wanted context size in o200k_base tokens (256 .. 16M).
        seed, index: any integers; the same four arguments give the same sample.
    Raises:
        ConfigError: unknown task, bad length, or RULER's data package missing (the message
            gives the pip command).
    """
    if task not in TASK_NAMES:
        raise ConfigError(f"unknown task {task!r}; choose from: " + ", ".join(TASK_NAMES))
    if not isinstance(length, int) or not MIN_LENGTH <= length <= MAX_LENGTH:
        raise ConfigError(f"length must be an int of {MIN_LENGTH}..{MAX_LENGTH} tokens, "
                          f"got {length!r}")
    key = f"{task}|{length}|{seed}|{index}"

    def rng_factory() -> random.Random:
        return random.Random(key)

    build, guess, minimum = TASKS[task].builder(task, length, seed, index, rng_factory)
    built, tokens = fit(build, length, guess, minimum)
    return Sample(task=task, length=length, seed=seed, index=index, context=built.context,
                  query=built.query, expected=list(built.expected), metric=METRICS[task],
                  context_chars=len(context_text(built.context)), context_tokens=tokens,
                  template=built.template)


#: What a builder returns: (units -> :class:`Built`, first guess of units, minimum units).
Builder = Callable[[str, int, int, int, Callable[[], random.Random]],
                   "tuple[Callable[[int], Built], int, int]"]


@dataclass(frozen=True)
class Task:
    """One task of ``rlm eval``: its metric (RULER's ``eval/synthetic/constants.py`` for RULER's
    tasks), the tokens a model needs for its answer (RULER's ``tokens_to_generate``; ours for the
    list tasks: a number, or up to 30 id pairs), and its builder: ``(task, length, seed, index,
    rng_factory) -> (units -> Built, first unit guess, minimum units)``, :func:`sizing.fit`
    then finds the units that make ``length`` tokens."""

    metric: str
    answer_tokens: int
    builder: Builder


def _niah(task, length, seed, index, rng_factory):
    kind, _, _, nk, nv, nq = ruler.NIAH[task]
    return ((lambda n: ruler.build_niah(task, rng_factory, n)),
            ruler.units_guess(kind, length), max(nk, nq) * nv)


def _vt(task, length, seed, index, rng_factory):
    return (lambda n: ruler.build_vt(rng_factory, n)), ruler.units_guess("vt", length), 5


def _cwe(task, length, seed, index, rng_factory):
    return ((lambda n: ruler.build_cwe(rng_factory, n, length < 4096)),
            ruler.units_guess("cwe", length) * (3 if length < 4096 else 1), 10)


def _fwe(task, length, seed, index, rng_factory):
    return ((lambda n: ruler.build_fwe(rng_factory, n, length)),
            ruler.units_guess("fwe", length), 10)


def _qa(task, length, seed, index, rng_factory):
    dataset = "squad" if task == "qa_1" else "hotpotqa"
    return ((lambda n: ruler.build_qa(dataset, random.Random(f"{task}|{seed}|{index}"),
                                      rng_factory, n)),
            ruler.units_guess(task, length), 1)


def _corpus(build):
    def builder(task, length, seed, index, rng_factory):
        return ((lambda n: build(rng_factory, n)),
                max(1, round(length / corpus.TOKENS_PER_ITEM)), 1)
    return builder


def _word_count(task, length, seed, index, rng_factory):
    return ((lambda n: counting.build_word_count(rng_factory, n)),
            max(200, round(length * counting.WORDS_PER_TOKEN)), 200)


#: The task table: name -> :class:`Task`. A new task is one builder and one entry here.
TASKS: dict[str, Task] = {
    **{name: Task("string_match_all", 128, _niah) for name in ruler.NIAH},
    "vt": Task("string_match_all", 30, _vt),
    "cwe": Task("string_match_all", 120, _cwe),
    "fwe": Task("string_match_all", 50, _fwe),
    "qa_1": Task("string_match_part", 32, _qa),
    "qa_2": Task("string_match_part", 32, _qa),
    "aggregation": Task("exact", 16, _corpus(corpus.build_aggregation)),
    "pairs": Task("pairs_f1", 512, _corpus(corpus.build_pairs)),
    "word_count": Task("exact", 16, _word_count),
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
#: metric of each task, and the tokens its answer needs (from :data:`TASKS`)
METRICS = {name: t.metric for name, t in TASKS.items()}
ANSWER_TOKENS = {name: t.answer_tokens for name, t in TASKS.items()}
