"""Session.resume after a SIGKILL: the session is driven in a real subprocess that is killed;
a new process rebuilds the kernel state by replaying the recorded questions (the scripted
endpoint counts every request it gets) and goes on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import rlm
from conftest import API_KEY, MODEL, clean_env, repl, root_requests, script

#: Drives a session in a child process: question 1, question 2, then (``kill``) SIGKILL itself.
CHILD = textwrap.dedent("""
    import os, signal, sys
    import rlm
    url, journal, appendix, kill = sys.argv[1:5]
    s = rlm.Session("alpha beta gamma", session_id="crashy", base_url=url, api_key="k",
                    model="m", journal=journal, cell_timeout=10)
    print("A1", s.ask("How many words?").answer, flush=True)
    s.add_context(__import__("pathlib").Path(appendix))
    print("A2", s.ask("Reverse them.").answer, flush=True)
    if kill == "1":
        os.kill(os.getpid(), signal.SIGKILL)
""")

Q1 = [repl("words = context.split()", "print(len(words))"), repl("FINAL(len(words))")]
Q2 = [repl("rev = ' '.join(reversed(words))", "print(rev)"), repl("FINAL(rev)")]


def _child(tmp_path, srv, kill: bool, timeout: float = 90):
    (tmp_path / "child.py").write_text(CHILD)
    appendix = tmp_path / "appendix.txt"
    appendix.write_text("APPENDIX TEXT")
    return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), srv.base_url,
                             str(tmp_path / "j.sqlite3"), str(appendix), "1" if kill else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())


def test_sigkill_after_question_2_then_resume_pays_nothing_for_the_replayed_part(scripted,
                                                                                 tmp_path):
    first = scripted(script(Q1 + Q2))
    p = _child(tmp_path, first, kill=True)
    out, err = p.communicate(timeout=90)
    assert p.returncode == -signal.SIGKILL, err[-3000:]
    assert out.split() == ["A1", "3", "A2", "gamma", "beta", "alpha"]
    # question 3 needs q1's `words`, q2's `rev` and the appendix (a file: read again)
    second = scripted(script([repl("FINAL(f'{len(words)}|{rev}|{context_1}')")]))
    s = rlm.Session.resume("crashy", contexts=["alpha beta gamma"],
                           base_url=second.base_url, api_key=API_KEY, model=MODEL,
                           journal=str(tmp_path / "j.sqlite3"), cell_timeout=10)
    with s:
        assert len(second.requests) == 0  # the replayed questions sent nothing
        assert [r.answer for r in s.results] == ["3", "gamma beta alpha"]
        r3 = s.ask("Put it together.")
    assert (r3.status, r3.answer, r3.run_id) == ("completed", "3|gamma beta alpha|APPENDIX TEXT",
                                                 "crashy-q3"), r3.reason
    assert len(second.requests) == 1  # question 3's one turn, nothing else
    # its request continues the recorded conversation: the same messages question 2 ended with
    msgs = root_requests(second)[0]["messages"]
    assert [m["content"] for m in msgs[:2]] == [m["content"] for m in
                                                root_requests(first)[0]["messages"]]
    assert msgs[-1]["content"].endswith("Question: Put it together.")


def test_a_question_killed_midway_is_resumed_then_the_session_goes_on(scripted, tmp_path):
    box = {}

    def kill_then_answer(req):  # question 2's second turn: the process dies waiting for it
        os.kill(box["pid"], signal.SIGKILL)
        return Q2[1]
    first = scripted(script(Q1 + [Q2[0], kill_then_answer]))
    p = _child(tmp_path, first, kill=False)
    box["pid"] = p.pid
    out, err = p.communicate(timeout=90)
    assert p.returncode == -signal.SIGKILL and out.split() == ["A1", "3"], err[-3000:]
    second = scripted(script([Q2[1], repl("FINAL(rev.upper())")]))
    with rlm.Session.resume("crashy", contexts=["alpha beta gamma"], base_url=second.base_url,
                            api_key=API_KEY, model=MODEL, journal=str(tmp_path / "j.sqlite3"),
                            cell_timeout=10) as s:
        # question 1 replayed; question 2 resumed: its first turn from the journal, the
        # second (never answered) sent now
        assert len(second.requests) == 1
        assert [r.answer for r in s.results] == ["3", "gamma beta alpha"]
        r3 = s.ask("Louder.")
    assert (r3.answer, len(second.requests)) == ("GAMMA BETA ALPHA", 2)
    from harness.journal import Journal
    with Journal(tmp_path / "j.sqlite3") as j:
        assert [j.get_run(f"crashy-q{n}")["state"] for n in (1, 2, 3)] == ["completed"] * 3
