"""Questions a new user asks of their own files, run on the embedded model through the public API.

32 questions over prose, code, a log, a CSV, a folder of notes and tools
(:mod:`evals.questions_data` writes the files): lookups of one fact, two-part questions
("..., and why?"), case-sensitive and phrase counts worded as people word them, lists of files,
and questions only a tool answers. Every expected answer is computed by code from the written
files (:func:`evals.questions_data.count_words` for counts) or taken from the planted facts.

Command line::

    python -m evals.questions_embedded --data /tmp/qdata [--only ID,ID] [--cap 300]
        [--out results.jsonl] [-- rlm.completion options as key=value, e.g. prompt=small]

Each question is one ``rlm.completion`` (the embedded model unless ``OPENAI_BASE_URL``/
``OPENAI_API_KEY`` or ``base_url=``/``api_key=``/``model=`` name an endpoint) with a wall cap of
``--cap`` seconds (default 300: the 5 minutes a question may take). It prints one row per
question (id, kind, right / wrong / no answer, seconds, the answer) and the totals.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from evals.questions_data import REPORT_FACTS, count_words, read_tree, write_data

#: Kinds of question, in the order the table lists them.
KINDS = ("lookup", "two-part", "count", "case count", "phrase count", "files", "tool")


@dataclass
class Question:
    """One question: ``context`` is a path under the data directory (a file or a folder);
    ``check`` is ``"number"`` (the answer's first integer), ``"all"`` (every string of
    ``expected`` in the answer, any case) or ``"files"`` (exactly ``expected`` of ``names``)."""

    qid: str
    kind: str
    context: str
    query: str
    check: str
    expected: object
    names: list = field(default_factory=list)
    tools: list = field(default_factory=list)


STAFF = {"alice": 101, "bob": 214, "chen": 330}
RATES = {"EUR": 0.0853, "USD": 0.0921, "SEK": 0.9764}


def room_of(name: str) -> int | None:
    """The office room number of a staff member (lower-case first name), or None."""
    return STAFF.get(str(name).strip().lower())


def nok_rate(currency: str) -> float | None:
    """How many units of ``currency`` (a code such as "EUR") one Norwegian krone buys, or None."""
    return RATES.get(str(currency).strip().upper())


def _counts(root: Path) -> list[Question]:
    report = (root / "report.txt").read_text(encoding="utf-8")
    log = (root / "logs" / "app.log").read_text(encoding="utf-8")
    code = "\n".join(read_tree(root, "code").values())
    notes = "\n".join(read_tree(root, "notes").values())
    csv = (root / "sales.csv").read_text(encoding="utf-8")

    def q(qid, kind, ctx, query, text, target, exact):
        return Question(qid, kind, ctx, query, "number", count_words(text, target, exact))
    return [
        q("c1", "case count", "report.txt", 'How many times does the word "Program" appear? '
          "Count it case-sensitive.", report, "Program", True),
        q("c2", "count", "report.txt", 'How many times does "program" appear, ignoring case?',
          report, "program", False),
        q("c3", "case count", "report.txt", 'Count the exact case matches of "PROGRAM".', report,
          "PROGRAM", True),
        q("c4", "phrase count", "report.txt",
          'How many times does the phrase "supply chain" appear?', report, "supply chain",
          False),
        q("c5", "phrase count", "report.txt", 'How often is the phrase "Supply Chain" written '
          "with capitals, match case?", report, "Supply Chain", True),
        q("c6", "phrase count", "report.txt", 'How many times is "late deliveries" mentioned?',
          report, "late deliveries", False),
        q("c7", "case count", "logs/app.log", 'How many times does "ERROR" appear in capitals '
          "(case-sensitive)?", log, "ERROR", True),
        q("c8", "count", "logs/app.log", 'How many times does the word "timeout" appear?', log,
          "timeout", False),
        q("c9", "phrase count", "logs/app.log",
          'How many times does the phrase "connection reset" appear?', log, "connection reset",
          False),
        q("c10", "count", "code/app/util.py", 'How many times does the word "def" appear?',
          (root / "code/app/util.py").read_text(encoding="utf-8"), "def", False),
        q("c11", "case count", "code", 'How many times does "TODO" appear, exactly as written?',
          code, "TODO", True),
        q("c12", "count", "sales.csv", 'How many times does the word "North" appear?', csv,
          "North", False),
        q("c13", "case count", "notes", 'How many times does "Kubernetes" appear with a '
          "capital K?", notes, "Kubernetes", True),
    ]


def questions(root: Path, facts: dict) -> list[Question]:
    """The question set over the files :func:`evals.questions_data.write_data` wrote to
    ``root`` (``facts``: what it returned)."""
    assert "Halvorsen" in REPORT_FACTS[0]  # the answers below quote the planted facts
    log, sale = facts["log"], facts["sale"]
    notes = sorted(read_tree(root, "notes"))
    code = sorted(read_tree(root, "code"))
    look = [
        Question("l1", "lookup", "report.txt", "What is the project code for the bridge "
                 "renovation?", "all", ["KX-4471"]),
        Question("l2", "lookup", "report.txt", "When did the warehouse in Tromsø open?", "all",
                 ["March", "2016"]),
        Question("l3", "lookup", "report.txt", "In which city is the annual shareholder "
                 "meeting held?", "all", ["Bergen"]),
        Question("l4", "lookup", "code", "What is the value of TIMEOUT in the config?", "all",
                 ["37"]),
        Question("l5", "lookup", "logs/app.log", "At what time did the disk become full?",
                 "all", [log["disk"].split()[1]]),
        Question("l6", "lookup", "sales.csv", "What is the price of SKU-7731?", "all",
                 [sale["price"]]),
        Question("l7", "lookup", "notes", "How long are backups kept?", "all", ["35"]),
        Question("l8", "lookup", "logs/app.log", "Which service is restarted every night at "
                 "03:00?", "all", ["billing"]),
        Question("t1", "two-part", "report.txt", "Which supplier was dropped in 2019, and why?",
                 "all", ["Halvorsen", "late"]),
        Question("t2", "two-part", "report.txt", "Who leads the audit team, and when did she "
                 "join the company?", "all", ["Okafor", "2012"]),
        Question("t3", "two-part", "logs/app.log", "Which user was locked out, and at what "
                 "time?", "all", ["jdoe", log["locked"].split()[1]]),
        Question("t4", "two-part", "sales.csv", "In which region was SKU-7731 sold, and what "
                 "quantity?", "all", [sale["region"], sale["qty"]]),
        Question("t5", "two-part", "notes", "What is the on-call phone number, and when should "
                 "it be called?", "all", ["555 01 234", "outage"]),
    ]
    files = [
        Question("f1", "files", "code", "Which files import requests?", "files",
                 ["app/net.py", "app/cli.py"], code),
        Question("f2", "files", "notes", "Which files say that something is deprecated?",
                 "files", ["api-v1.md", "kubernetes.md"], notes),
        Question("f3", "files", "notes", "Which file describes the backup schedule?", "files",
                 ["backups.md"], notes),
    ]
    tools = [
        Question("x1", "tool", "notes", "Which room is alice in?", "all", ["101"],
                 tools=[room_of]),
        Question("x2", "tool", "notes", "Which room is chen in?", "all", ["330"],
                 tools=[room_of]),
        Question("x3", "tool", "sales.csv", "How many euros does one Norwegian krone buy?",
                 "all", ["0.0853"], tools=[nok_rate]),
    ]
    return look + _counts(root) + files + tools


def score(q: Question, status: str, answer: str | None) -> str:
    """``"right"``, ``"wrong"`` or ``"no answer"`` (no completed run, an empty answer or
    NOT FOUND) for ``answer`` to ``q``."""
    text = (answer or "").strip()
    if status != "completed" or not text or text.upper().strip(".") == "NOT FOUND":
        return "no answer"
    if q.check == "number":
        ints = re.findall(r"-?\d+", text.replace(",", ""))
        return "right" if ints and int(ints[0]) == q.expected else "wrong"
    if q.check == "files":
        named = {n for n in q.names if n in text or n.rsplit("/", 1)[-1] in text.split("/")[-1:]
                 or re.search(r"(?<![\w/])" + re.escape(n.rsplit("/", 1)[-1]) + r"(?!\w)", text)}
        return "right" if named == set(q.expected) else "wrong"
    return "right" if all(e.lower() in text.lower() for e in q.expected) else "wrong"


def run_one(q: Question, root: Path, cap: float, **options) -> dict:
    """One question through ``rlm.completion`` under a wall cap of ``cap`` seconds; returns
    ``{"qid", "kind", "result", "seconds", "status", "answer", "reason"}``."""
    import rlm
    ctx = root / q.context
    t0 = time.monotonic()
    try:
        res = rlm.completion(ctx, q.query, max_wall_seconds=cap, tools=q.tools or None,
                             **options)
        status, answer, reason = res.status, res.answer, res.reason
    except rlm.RLMError as exc:  # an endpoint or kernel failure: this question has no answer
        status, answer, reason = "error", None, f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    return {"qid": q.qid, "kind": q.kind, "result": score(q, status, answer),
            "seconds": round(seconds, 1), "status": status, "answer": answer,
            "reason": reason, "expected": q.expected}


def table(rows: list[dict]) -> str:
    """The results as a Markdown table, then totals per result and per kind."""
    out = ["| id | kind | result | seconds | answer |", "|---|---|---|---|---|"]
    for r in rows:
        said = r["answer"] if r["status"] == "completed" else f"{r['status']}: {r['reason']}"
        shown = str(said or "").replace("\n", " ").replace("|", "/")[:60]
        out.append(f"| {r['qid']} | {r['kind']} | {r['result']} | {r['seconds']:.1f} | "
                   f"{shown} |")
    right = sum(r["result"] == "right" for r in rows)
    out.append("")
    out.append(f"right {right} of {len(rows)}; wrong "
               f"{sum(r['result'] == 'wrong' for r in rows)}; no answer "
               f"{sum(r['result'] == 'no answer' for r in rows)}; longest "
               f"{max((r['seconds'] for r in rows), default=0):.1f} s")
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            out.append(f"- {kind}: {sum(r['result'] == 'right' for r in mine)} of {len(mine)}")
    return "\n".join(out)


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise SystemExit(f"questions_embedded: {text!r} is not an option; write key=value, "
                         "e.g. prompt=small")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="where the files are written")
    p.add_argument("--only", default="", help="comma-separated question ids")
    p.add_argument("--cap", type=float, default=300.0, help="seconds per question (300)")
    p.add_argument("--out", type=Path, help="append each result as a JSON line here")
    p.add_argument("options", nargs="*", help="rlm.completion options as key=value")
    a = p.parse_args(argv)
    options = dict(_option(o) for o in a.options)
    facts = write_data(a.data)
    chosen = [q for q in questions(a.data, facts)
              if not a.only or q.qid in a.only.split(",")]
    if not chosen:
        raise SystemExit(f"questions_embedded: no question has an id in {a.only!r}")
    rows = []
    for q in chosen:
        row = run_one(q, a.data, a.cap, **options)
        rows.append(row)
        print(f"{row['qid']}: {row['result']} in {row['seconds']:.1f} s", file=sys.stderr)
        if a.out:
            with a.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
