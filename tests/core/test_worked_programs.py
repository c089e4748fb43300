"""Every worked program of every profile runs on any context a user can give.

A small model copies a worked program and changes only the question and its words, so a
program that crashes on some context crashes the run, and the model resends it turn after
turn. Each test takes every ```repl program out of a rendered system prompt (each profile, with
and without sub-calls, for a str, a list and a dict context), makes the copying model's edit,
and runs it in a real kernel, against the scripted endpoint's sub-calls, on generated edge
cases: empty texts, no match, a word found only inside a longer word cut at a window's edge,
one huge line, non-ASCII text, words with regex metacharacters, lists and dicts of odd values.
"""
from __future__ import annotations

import json
import re

import pytest

from conftest import Reply, repl, script

PROFILES = ("small", "small-count", "general")

#: Edge-case contexts by type: name -> a Python expression the kernel evaluates (so a 2 MB line
#: never travels in a cell's source).
CONTEXTS = {
    "str": {
        "empty": '""',
        "blank": '" \\n\\t \\n"',
        "no match": '"The river ran past the mill and the fields were quiet. " * 200',
        # "author" occurs nowhere but inside "authorship", cut at the 1,000-character edge of
        # the window around "essays": today's lookup divided by its count, 0
        "cut at the edge": '"x " * 600 + "essays" + " " * 987 + "authorship" + " y" * 600',
        "huge line": '"lorem " * 300000 + "The vault code is 7341-QX." + " ipsum" * 300000',
        "non-ASCII": '"Der Schlüssel zum Tresor: 東京 café naïve — «7341-QX» " * 50',
        "metacharacters": '"C++ and (vault) and a.b and [x] cost $5 * 2 + ? | ^ " * 40',
        "common word": '"the " * 60000 + "vault code 7341-QX"',
    },
    "list": {
        "empty": "[]",
        "odd items": '[None, 3, {"k": [1, 2]}, "", "the vault code is 7341-QX", b"raw"]',
        "strings": '["line %d about the harbour" % i for i in range(500)]',
    },
    "dict": {
        "empty": "{}",
        "files": '{"a.txt": "the vault code is 7341-QX", "b.csv": "x,y\\n1,2", "c/d.py": ""}',
        "odd values": '{"x": [1, 2], "y": {"z": None}, "n": 3, "e": ""}',
    },
}

#: The copying model's edit: (question, lookup words, count target) put in the examples' place.
EDITS = [
    ("What essays were written by the author?", ["essays", "written", "by", "the", "author"],
     "author"),
    ("What does C++ cost in (vault) a.b [x]?", ["C++", "(vault)", "a.b", "[x]", "$5", "*"],
     "C++"),
    ('How many times does "Schlüssel zum" appear? Count case-sensitive.', ["Schlüssel", "", " "],
     "Schlüssel zum"),
]


def programs(profile: str, ctype: str, can_recurse: bool) -> list[str]:
    """Every ```repl program in ``profile``'s system prompt rendered for a ``ctype`` context."""
    from rlm.prompting import prompts
    meta = {"type": ctype, "chars": 10, "tokens_estimate": 3, "items": 1, "item_chars": [10]}
    text = prompts.system_prompt(meta, can_recurse=can_recurse, profile=profile)
    return re.findall(r"```repl\n(.*?)\n```", text, re.S)


def edit(code: str, question: str, words: list[str], target: str) -> str:
    """``code`` as a copying model changes it: the question, the search words, the target."""
    code = re.sub(r'question = """.*?"""', lambda _: f'question = """{question}"""', code)
    code = code.replace('["lighthouse", "door", "colour"]', repr(words))
    return code.replace('"harbour"', repr(target))


def run_all(api, cases: list[tuple[str, str, str]], sub_reply: str = "7341-QX") -> dict:
    """Run each ``(name, program, context expression)`` in one real kernel, the program in a
    namespace of its own with ``context`` bound and FINAL collected; returns name ->
    ``["ok", answer]`` or ``["error", "Type: message"]``."""
    cell = repl(
        "import json",
        f"CASES = {cases!r}",
        "results = {}",
        "for name, code, expr in CASES:",
        "    got = []",
        "    ns = {'context': eval(expr), 'FINAL': got.append, 'llm_query': llm_query,",
        "          'llm_query_batched': llm_query_batched, 'print': lambda *a, **k: None}",
        "    try:",
        "        exec(code, ns)",
        "        results[name] = ['ok', str(got[0]) if got else None]",
        "    except Exception as exc:",
        "        results[name] = ['error', type(exc).__name__ + ': ' + str(exc)]",
        "FINAL(json.dumps(results))")

    def sub(req):
        return Reply(content=sub_reply)

    res, _ = api(script([cell], sub), "ctx", "q?", prompt="small", max_depth=1,
                 cell_timeout=240, max_output_chars=100000)
    assert res.status == "completed", res.reason
    return json.loads(res.answer)


@pytest.mark.parametrize("ctype", ["str", "list", "dict"])
def test_every_worked_program_runs_on_every_edge_case(api, ctype):
    cases = []
    for profile in PROFILES:
        for can_recurse in (True, False):
            for k, code in enumerate(programs(profile, ctype, can_recurse)):
                for question, words, target in EDITS:
                    changed = edit(code, question, words, target)
                    for cname, expr in CONTEXTS[ctype].items():
                        cases.append((f"{profile} d{int(can_recurse)} #{k} [{words[0]}] "
                                      f"{cname}", changed, expr))
    assert len(cases) > 50  # every profile with programs contributed
    results = run_all(api, cases)
    errors = {name: got for name, got in results.items() if got[0] != "ok"}
    assert errors == {}
    assert len(results) == len(cases)


def test_the_lookup_finds_the_fact_in_one_huge_line_and_answers_not_found_without_a_match(api):
    code = edit(programs("small", "str", True)[0], "What is the vault code?", ["vault", "code"],
                "vault")
    results = run_all(api, [("huge", code, CONTEXTS["str"]["huge line"]),
                            ("none", code, CONTEXTS["str"]["no match"]),
                            ("empty", code, CONTEXTS["str"]["empty"])])
    assert results == {"huge": ["ok", "7341-QX"], "none": ["ok", "NOT FOUND"],
                       "empty": ["ok", "NOT FOUND"]}
