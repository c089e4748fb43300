"""A session whose conversation is compacted: one compactor for every question, so the kernel's
``history`` in question 2 still holds question 1's turns that compaction took out of the
conversation (before, each question started a new compactor and lost them)."""
from __future__ import annotations

import threading

import rlm
from conftest import API_KEY, MODEL, repl
from rlm.prompting import prompts
from scripted_server import WindowedEndpoint

WINDOW = 6000  # tokens (characters / 4): a few turns of 3,000 characters of output


def test_history_in_a_later_question_keeps_what_compaction_took_out(scripted, tmp_path):
    lock = threading.Lock()
    turns = {"n": 0, "summaries": 0}

    def model(req):
        first = (req.get("messages") or [{}])[0]
        with lock:
            if first.get("content") == prompts.COMPACT_SYSTEM:
                turns["summaries"] += 1
                return "NOTES: `acc` holds the running sum; go on."
            turns["n"] += 1
            n = turns["n"]
        if n < 8:  # question 1: seven turns of big output, then its answer
            return repl(f"acc = globals().get('acc', 0) + {n}",
                        f"print('Q1TURN{n:02d} ' + 'lorem ipsum dolor ' * 160)")
        if n == 8:
            return repl("FINAL(acc)")
        # question 2: the first turn of question 1 is gone from the conversation, not from
        # `history`
        return repl("first = [m['content'] for m in history if 'Q1TURN01 ' in m['content']]",
                    "FINAL(f'{len(first)}|{len(history)}')")

    srv = scripted(WindowedEndpoint(model, WINDOW))
    opts = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                journal=str(tmp_path / "j.sqlite3"), max_iterations=12, max_output_chars=3000,
                cell_timeout=10, context_window=WINDOW)
    with rlm.Session("some context", session_id="sc", **opts) as s:
        r1 = s.ask("Sum the turn numbers.")
        r2 = s.ask("Is the first turn still in history?")
    assert r1.status == "completed" and r1.answer == str(sum(range(1, 8))), r1.reason
    assert turns["summaries"] >= 1  # question 1 was compacted
    found, length = r2.answer.split("|")
    assert r2.status == "completed" and int(found) >= 1, r2.answer
    assert int(length) >= 2 + 2 * 8  # system, task, question 1's eight turns and their outputs
