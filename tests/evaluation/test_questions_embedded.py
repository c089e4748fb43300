"""The embedded question set (evals/questions_embedded.py): its files, its answers computed by
code, its scoring, and its runner through the public API against the scripted endpoint."""
from __future__ import annotations

import re

from conftest import Reply, is_root, repl

from evals import questions_data as data
from evals import questions_embedded as qe


def _set(tmp_path):
    facts = data.write_data(tmp_path / "d")
    return tmp_path / "d", facts, qe.questions(tmp_path / "d", facts)


def test_the_set_covers_every_kind_over_every_kind_of_file(tmp_path):
    root, facts, qs = _set(tmp_path)
    assert len(qs) >= 30 and len({q.qid for q in qs}) == len(qs)
    for kind in qe.KINDS:
        assert sum(q.kind == kind for q in qs) >= 3, kind
    contexts = {q.context for q in qs}
    assert {"report.txt", "code", "logs/app.log", "sales.csv", "notes"} <= contexts
    assert all((root / q.context).exists() for q in qs)
    # the same seed writes the same bytes
    again = tmp_path / "again"
    data.write_data(again)
    for p in root.rglob("*"):
        if p.is_file():
            assert p.read_bytes() == (again / p.relative_to(root)).read_bytes()


def test_the_answers_are_in_the_files_and_the_counts_agree(tmp_path):
    root, facts, qs = _set(tmp_path)
    by = {q.qid: q for q in qs}
    for q in qs:
        if q.check == "all" and q.kind != "tool":
            path = root / q.context
            text = (path.read_text(encoding="utf-8") if path.is_file()
                    else "\n".join(data.read_tree(root, q.context).values()))
            for part in q.expected:
                assert part.lower() in text.lower(), (q.qid, part)
    report = (root / "report.txt").read_text(encoding="utf-8")
    # "program" ignoring case is the sum of its cased forms; "programs" is not counted
    lower = data.count_words(report, "program", True)
    assert by["c2"].expected == by["c1"].expected + by["c3"].expected + lower
    assert all(by[c].expected > 0 for c in ("c1", "c3", "c4", "c5", "c7", "c13"))
    assert by["c4"].expected > by["c5"].expected  # case matters for the phrase
    assert qe.room_of("Alice") == 101 and qe.nok_rate("eur") == 0.0853


def test_scoring():
    q = qe.Question("n", "count", "x", "?", "number", 68)
    assert qe.score(q, "completed", "68") == "right"
    assert qe.score(q, "completed", "There are 68 matches.") == "right"
    assert qe.score(q, "completed", "138") == "wrong"
    assert qe.score(q, "failed", None) == "no answer"
    assert qe.score(q, "completed", "NOT FOUND") == "no answer"
    q = qe.Question("t", "two-part", "x", "?", "all", ["Halvorsen", "late"])
    assert qe.score(q, "completed", "Halvorsen Metals, because of late deliveries") == "right"
    assert qe.score(q, "completed", "Halvorsen Metals") == "wrong"
    q = qe.Question("f", "files", "x", "?", "files", ["app/net.py", "app/cli.py"],
                    ["app/net.py", "app/cli.py", "app/db.py"])
    assert qe.score(q, "completed", "app/net.py, app/cli.py") == "right"
    assert qe.score(q, "completed", "net.py and cli.py") == "right"
    assert qe.score(q, "completed", "app/net.py") == "wrong"
    assert qe.score(q, "completed", "app/net.py, app/cli.py, app/db.py") == "wrong"


def test_the_runner_runs_questions_through_the_api_and_prints_the_table(scripted, tmp_path,
                                                                        capsys):
    """Right, wrong, a tool called from a cell, and a question held past its cap: the table
    says right / wrong / no answer and the time of each."""
    def responder(req):
        if not is_root(req):
            return "NONE"
        task = req["messages"][1]["content"]
        if "project code" in task:
            return repl("FINAL('KX-4471')")
        if "Program" in task:
            return repl("FINAL(138)")
        if "alice" in task:
            return repl("FINAL(room_of('alice'))")
        return Reply(content=repl("FINAL('late')"), delay=30)

    srv = scripted(responder)
    out = tmp_path / "r.jsonl"
    rc = qe.main(["--data", str(tmp_path / "d"), "--only", "l1,c1,x1,t1", "--cap", "8",
                  "--out", str(out), f"base_url={srv.base_url}", "api_key=k", "model=m",
                  "journal=false"])
    assert rc == 0
    text = capsys.readouterr().out
    rows = {m.group(1): (m.group(2), float(m.group(3)))
            for m in re.finditer(r"^\| (\w+) \| [\w -]+ \| ([\w ]+) \| ([\d.]+) \|", text, re.M)}
    assert {k: v[0] for k, v in rows.items()} == {"l1": "right", "c1": "wrong", "x1": "right",
                                                    "t1": "no answer"}
    assert rows["t1"][1] < 20  # the cap ended it, not the slow reply
    assert "right 2 of 4; wrong 1; no answer 1" in text
    assert len(out.read_text().splitlines()) == 4
